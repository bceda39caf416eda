"""What ``initialize`` adds for a model with mixture-of-experts layers.

The expert-parallel degree comes from the layers (``MoE(ep_size=...)``, as in DeepSpeed) and splits
the data-parallel axis of the mesh; the layers are then bound to the mesh's expert-parallel group (they
exchange tokens over it). The training state is split (:class:`~zerospeed.zero.split_state.SplitState`):
dense parameters over the data-parallel group, expert parameters over their expert-data-parallel group
with gradients summed there and divided by the whole data-parallel size (DeepSpeed's averaging: their
tokens came from every data-parallel rank), and the clipping norm counts every expert once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

from torch import nn

from zerospeed.distributed.comm import Comm
from zerospeed.distributed.mesh import Mesh, ParallelDims
from zerospeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
from zerospeed.zero.reducer import ReductionPolicy
from zerospeed.zero.step_grads import NormScope


@runtime_checkable
class ExpertParallelLayer(Protocol):
    """A layer whose experts are split over ``ep_size`` ranks, bound to their group by the engine."""

    ep_size: int

    @property
    def expert_offset(self) -> int:
        """The global index of this rank's first local expert (0 until bound)."""
        ...

    def bind_expert_parallel(self, comm: Comm) -> None:
        """Exchange tokens over ``comm`` (the expert-parallel group, of ``ep_size`` ranks)."""


def expert_layers(model: nn.Module) -> list[tuple[str, ExpertParallelLayer]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, ExpertParallelLayer)]


def has_experts(model: nn.Module) -> bool:
    return any(is_moe_param(p) for p in model.parameters())


def expert_degree(model: nn.Module) -> int:
    """The model's expert-parallel degree: every MoE layer's ``ep_size`` (they must agree), 1 without any."""
    sizes = {name: int(layer.ep_size) for name, layer in expert_layers(model)}
    if len(set(sizes.values())) > 1:
        said = ", ".join(f"{name}: {size}" for name, size in sizes.items())
        raise ValueError(f"the model's MoE layers have different ep_size ({said}); zerospeed runs one expert-parallel "
                         f"degree per job: give every MoE layer the same ep_size")
    return next(iter(sizes.values()), 1)


def with_experts(dims: ParallelDims, model: nn.Module) -> ParallelDims:
    """``dims`` with the model's expert-parallel degree (which must divide the data-parallel size)."""
    ep = expert_degree(model)
    if ep == 1:
        return dims
    if dims.dp % ep:
        raise ValueError(f"MoE ep_size={ep} must divide the data-parallel size {dims.dp} (world {dims.world_size} / "
                         f"tp {dims.tp} / pp {dims.pp}): experts are split over ranks of the data-parallel axis; run "
                         f"on a multiple of {ep} data-parallel ranks or lower ep_size")
    return dataclasses.replace(dims, ep=ep)


def bind(model: nn.Module, mesh: Mesh) -> None:
    """Hand every MoE layer the mesh's expert-parallel group."""
    layers = expert_layers(model)
    if layers:
        comm = mesh.comm("ep")
        for _, layer in layers:
            layer.bind_expert_parallel(comm)


def global_expert_names(model: nn.Module) -> dict[str, str]:
    """Each expert parameter's name with its expert's global index in place of the local one
    (``...deepspeed_experts.<local>...`` -> ``...deepspeed_experts.<ep_rank * num_local + local>...``):
    the names checkpoints store experts under, the same at every expert-parallel degree."""
    out: dict[str, str] = {}
    offsets = {id(layer): layer.expert_offset for _, layer in expert_layers(model)}
    for prefix, module in model.named_modules():
        if id(module) not in offsets:
            continue
        offset = offsets[id(module)]
        for name, _ in module.named_parameters():
            head, sep, rest = name.partition("deepspeed_experts.")
            if not sep:
                continue
            local, dot, tail = rest.partition(".")
            full = f"{prefix}.{name}" if prefix else name
            out[full] = f"{prefix + '.' if prefix else ''}{head}{sep}{int(local) + offset}{dot}{tail}"
    return out


def optimizer_groups(params: list[Any]) -> list[Any]:
    """The parameters a configured optimizer is built from: expert parameters in groups of their own
    (as DeepSpeed's engine does for a model with MoE layers)."""
    groups = params if params and isinstance(params[0], dict) else [{"params": params}]
    groups = [{"name": f"group{i}", **group} for i, group in enumerate(groups)]
    return split_params_into_different_moe_groups_for_optimizer(groups)


def expert_reduction(dense: ReductionPolicy, mesh: Mesh) -> ReductionPolicy:
    """Expert gradients: summed over their expert-data-parallel group, averaged over all of data parallelism."""
    return dataclasses.replace(dense, average_over=mesh.dp.world_size)


def expert_norm(dense: NormScope, mesh: Mesh) -> NormScope:
    """How expert gradients add up to the global norm: they differ across the expert-parallel group, so
    the squared norm is summed over it too (replicated at stage 0 they are the same on an expert-data-
    parallel group; sharded, the state sums over that group itself)."""
    return NormScope(counted_elsewhere=dense.counted_elsewhere, across=(mesh.comm("ep"), *dense.across))


__all__ = ["ExpertParallelLayer", "bind", "expert_degree", "global_expert_names", "expert_layers", "expert_norm", "expert_reduction",
           "has_experts", "optimizer_groups", "with_experts"]
