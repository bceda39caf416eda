"""What ``zerospeed.initialize`` does for tensor parallelism, kept out of the engine.

The degree comes from one of three places, which must agree: an ``mpu=`` (Megatron's model
parallel unit, or a zerospeed :class:`Mesh`), the config's ``tensor_parallel.autotp_size``, or the
model's own tensor-parallel layers. The mesh is then built (or taken from the ``mpu``), AutoTP splits
a plain model, replicated parameters are made equal across the group, and the gradient norm learns
which parameters each rank counts (:class:`~zerospeed.zero.step_grads.NormScope`).
"""

from __future__ import annotations

import datetime
from typing import Any, Mapping

import torch
from torch import nn

from zerospeed.distributed.groups import group_members
from zerospeed.distributed.mesh import Axis, Mesh, ParallelDims
from zerospeed.tensor_parallel.layers import TensorParallelLayer
from zerospeed.tensor_parallel.layout import TPLayout, tp_layout
from zerospeed.zero.owner import init_partition
from zerospeed.zero.step_grads import NormScope

_MPU_TP = ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size")
_MPU_TP_GROUP = ("get_tensor_model_parallel_group", "get_model_parallel_group")
_MPU_PP = ("get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size")


def _ask(mpu: Any, names: tuple[str, ...]) -> Any:
    for name in names:
        method = getattr(mpu, name, None)
        if callable(method):
            return method()
    return None


def model_tp_degree(model: nn.Module) -> int:
    """The tensor-parallel size the model's layers were built for (1 when none is split)."""
    sizes = {m.tp_size for m in model.modules() if isinstance(m, TensorParallelLayer) and m.tp_size > 1}
    if len(sizes) > 1:
        raise ValueError(f"the model's tensor-parallel layers use groups of different sizes {sorted(sizes)}; "
                         f"build every layer with the same tp_group")
    return sizes.pop() if sizes else 1


def declared_dims(world_size: int, *, model: nn.Module, mpu: Any, autotp_size: int, pipeline_stages: int = 1
                  ) -> ParallelDims:
    """The job's degrees, from the ``mpu``, the config and the model (``pipeline_stages``: a
    ``PipelineModule``'s stages); every source that names a size must name the same one."""
    sources: dict[str, int] = {}
    mpu_stages: int | None = None
    if isinstance(mpu, Mesh):
        if mpu.dims.world_size != world_size:
            raise ValueError(f"mpu: the mesh was built for {mpu.dims.world_size} ranks but the job has {world_size}")
        sources["mpu"] = mpu.dims.tp
        mpu_stages = mpu.dims.pp
    elif mpu is not None:
        size = _ask(mpu, _MPU_TP)
        if size is None or _ask(mpu, ("get_data_parallel_world_size",)) is None:
            raise TypeError(f"mpu={type(mpu).__name__}: an mpu must answer get_data_parallel_world_size() and "
                            f"get_model_parallel_world_size() (or get_tensor_model_parallel_world_size())")
        sources["mpu"] = int(size)
        mpu_stages = int(_ask(mpu, _MPU_PP) or 1)
    if mpu_stages is not None and mpu_stages != pipeline_stages:
        if pipeline_stages == 1:
            raise ValueError(f"mpu: its pipeline-parallel size is {mpu_stages} but the model is not a PipelineModule; "
                             f"give initialize zerospeed.pipe.PipelineModule(layers, num_stages={mpu_stages})")
        raise ValueError(f"mpu: its pipeline-parallel size is {mpu_stages} but the PipelineModule has "
                         f"{pipeline_stages} stages; make them agree")
    if autotp_size > 1:
        sources["tensor_parallel.autotp_size"] = autotp_size
    layers = model_tp_degree(model)
    if layers > 1:
        sources["the model's tensor-parallel layers"] = layers
    if len(set(sources.values())) > 1:
        said = ", ".join(f"{where}: {size}" for where, size in sources.items())
        raise ValueError(f"conflicting tensor-parallel sizes ({said}); make them agree")
    tp = next(iter(sources.values()), 1)
    return ParallelDims(world_size=world_size, tp=tp, pp=pipeline_stages)


def build_mesh(dims: ParallelDims, mpu: Any, timeout: datetime.timedelta | None) -> Mesh:
    """The job's mesh: the given zerospeed Mesh itself, or new groups laid out as ``dims`` (checked
    against a Megatron ``mpu``'s groups, which must hold the same ranks)."""
    if isinstance(mpu, Mesh):
        return mpu
    mesh = dims.build(**({} if timeout is None else {"timeout": timeout}))
    if mpu is not None:
        checks: tuple[tuple[Axis, tuple[str, ...]], ...] = (("tp", _MPU_TP_GROUP), ("dp", ("get_data_parallel_group",)))
        for axis, names in checks:
            group = _ask(mpu, names)
            if group is None:
                continue
            theirs, ours = group_members(group), mesh.ranks(axis)
            if sorted(theirs) != sorted(ours):
                raise ValueError(f"the mpu's {axis} group holds ranks {theirs} but zerospeed lays ranks out with "
                                 f"tensor-parallel peers adjacent and pipeline stages outermost (Megatron's default "
                                 f"order), giving {ours}; build the mpu with that order")
    return mesh


def check_model_groups(model: nn.Module, mesh: Mesh) -> None:
    """Every split layer talks over the mesh's tensor-parallel ranks (not, say, a group of its own)."""
    ours = mesh.ranks("tp")
    for path, layer in model.named_modules():
        if isinstance(layer, TensorParallelLayer) and layer.tp is not None and layer.tp_size > 1:
            if list(layer.tp.global_ranks) != ours:
                raise ValueError(f"{path}: its tensor-parallel group holds ranks {list(layer.tp.global_ranks)} but "
                                 f"this rank's tensor-parallel group is {ours}; build the layers with the mesh "
                                 f"passed as mpu= (tp_group=mesh)")


def apply_config_autotp(model: nn.Module, mesh: Mesh, settings: Mapping[str, Any]) -> None:
    """``tensor_parallel.autotp_size``: split a plain model with AutoTP (not one already split)."""
    if mesh.dims.tp == 1 or model_tp_degree(model) > 1:
        return
    from zerospeed.tensor_parallel.autotp import apply_autotp

    apply_autotp(model, mesh.comm("tp"), partition_config=settings.get("partition_config"),
                 preset_model=settings.get("preset_model"))


def broadcast_replicated(model: nn.Module, mesh: Mesh, layout: TPLayout) -> None:
    """Start every tensor-parallel rank from rank 0's replicated parameters and buffers (split ones
    differ by design; the data-parallel broadcast already made each slice equal across replicas)."""
    if mesh.dims.tp == 1:
        return
    tp = mesh.comm("tp")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not layout.is_split(name) and init_partition(param) is None:
                tp.broadcast(param.data, src=0)
        for buffer in model.buffers():
            tp.broadcast(buffer.data, src=0)


def norm_scope(model: nn.Module, mesh: Mesh, layout: TPLayout) -> NormScope:
    """Replicated parameters counted on tensor-parallel rank 0 only, the norm summed over the group."""
    if mesh.dims.tp == 1:
        return NormScope()
    names = [name for name, _ in model.named_parameters()]
    return NormScope(counted_elsewhere=layout.counted_elsewhere(names), across=(mesh.comm("tp"),))


def layout_of(model: nn.Module, mesh: Mesh) -> TPLayout:
    return tp_layout(model, mesh.dims.tp, mesh.comm("tp").rank)


__all__ = ["declared_dims", "build_mesh", "check_model_groups", "apply_config_autotp", "broadcast_replicated",
           "norm_scope", "layout_of", "model_tp_degree"]
