"""AutoTP for training: split an existing model's layers over a tensor-parallel group, in place.

:func:`apply_autotp` executes an :class:`~zerospeed.tensor_parallel.autotp_plan.AutoTPPlan`: each
column- or row-split ``nn.Linear`` becomes a :class:`ColumnParallelLinear` / :class:`RowParallelLinear`
holding this rank's slice, each split ``Conv1D`` a :class:`ColumnParallelConv1D` /
:class:`RowParallelConv1D`, and attention modules get their per-rank head counts. Replacements sit
at the same paths with the same parameter names (``model.layers.0.self_attn.q_proj.weight``), so
state dicts and checkpoints keep their keys; :func:`~zerospeed.tensor_parallel.layout.tp_layout`
reads the splits back from the layers.

The model is marked ``ds_autotp_parsed`` (DeepSpeed's attribute) and ``zerospeed_autotp_size`` so a
second call is a no-op at the same size and an error at another (a split model cannot be re-split).

:func:`tp_model_init` is DeepSpeed's ``deepspeed.tp_model_init``. DeepSpeed 0.19 only records its
arguments and shards inside ``initialize``; here it shards at once (issue 17), so the model a script
gets back is already split and the engine finds it parsed.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from zerospeed.config.schema_tp import AutoTPPartitionConfig
from zerospeed.tensor_parallel.autotp_plan import (AutoTPError, AutoTPPlan, HeadPlan, LayerKind, LayerPlan, Split,
                                                   describe_model, plan_autotp)
from zerospeed.tensor_parallel.conv1d import ColumnParallelConv1D, RowParallelConv1D, fused_slice
from zerospeed.tensor_parallel.group import TPGroup, degree, rank, tp_comm
from zerospeed.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, TensorParallelLayer

#: DeepSpeed's marker of a model AutoTP has split.
PARSED_ATTR = "ds_autotp_parsed"
#: The tensor-parallel size it was split at (zerospeed's own, so a different size can be refused).
SIZE_ATTR = "zerospeed_autotp_size"


def autotp_size_of(model: nn.Module) -> int | None:
    """The tensor-parallel size ``model`` was split at by AutoTP, or None if it was not."""
    if not getattr(model, PARSED_ATTR, False):
        return None
    size = getattr(model, SIZE_ATTR, None)
    return size if isinstance(size, int) else None


def apply_autotp(model: nn.Module, tp_group: TPGroup, *, partition_config: Mapping | AutoTPPartitionConfig | None = None,
                 preset_model: str | None = None) -> nn.Module:
    """Split ``model`` over ``tp_group`` (a Comm, Mesh, ProcessGroup, or None for one rank) in place and
    return it. Already split at this size: returned as is; at another size: refused."""
    comm = tp_comm(tp_group)
    tp_size = degree(comm)
    if getattr(model, PARSED_ATTR, False):
        done = autotp_size_of(model)
        if done in (None, tp_size):
            return model
        raise AutoTPError(f"the model was already split by AutoTP at tensor-parallel size {done}, not {tp_size}; "
                          f"split a fresh copy of the unsharded model instead")
    if any(isinstance(m, TensorParallelLayer) and m.tp_size > 1 for m in model.modules()):
        raise AutoTPError("the model already holds tensor-parallel layers; AutoTP splits plain models only (build "
                          "the parallel layers with the mesh's tp group, or pass the unsharded model)")
    plan = plan_autotp(describe_model(model), tp_size, partition_config=partition_config, preset_model=preset_model)
    if tp_size > 1:
        _execute(model, plan, comm)
    setattr(model, PARSED_ATTR, True)
    setattr(model, SIZE_ATTR, tp_size)
    return model


def _execute(model: nn.Module, plan: AutoTPPlan, comm: Any) -> None:
    """Replace the split layers and adjust the attention modules (the plan was checked already)."""
    for name, layer_plan in plan.split_layers().items():
        old = model.get_submodule(name)
        parent_path, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, child, _replacement(old, layer_plan, comm))
    for name, heads in plan.heads.items():
        _set_heads(model.get_submodule(name), heads)


def _replacement(old: nn.Module, plan: LayerPlan, comm: Any) -> TensorParallelLayer:
    kind = LayerKind.LINEAR if isinstance(old, nn.Linear) else LayerKind.CONV1D
    if kind is LayerKind.CONV1D:
        if plan.split is Split.COLUMN:
            return ColumnParallelConv1D(old, tp_group=comm, parts=plan.parts, gather_output=plan.gather_output)
        return RowParallelConv1D(old, tp_group=comm)
    assert isinstance(old, nn.Linear)
    if plan.split is Split.ROW:
        return RowParallelLinear.from_linear(old, tp_group=comm)
    layer = ColumnParallelLinear.from_linear(old, tp_group=comm, gather_output=plan.gather_output)
    if plan.parts > 1:  # this rank's piece of each fused tensor, not one contiguous chunk
        layer.fused_parts = plan.parts
        layer.weight = nn.Parameter(fused_slice(old.weight, 0, plan.parts, rank(comm), degree(comm)),
                                    requires_grad=old.weight.requires_grad)
        if old.bias is not None:
            layer.bias = nn.Parameter(fused_slice(old.bias, 0, plan.parts, rank(comm), degree(comm)),
                                      requires_grad=old.bias.requires_grad)
    return layer


def _set_heads(attention: nn.Module, heads: HeadPlan) -> None:
    """Per-rank head counts on the attributes the module's forward reads.

    transformers 5.23: Llama-style attention reshapes with ``-1`` heads and keeps the q/kv ratio
    (``num_key_value_groups``), so it needs nothing, but older or other families read ``num_heads``
    / ``num_key_value_heads``, which are set when present. GPT-2 splits ``c_attn``'s output with
    ``split_size`` (its per-rank hidden size) and is given ``num_heads`` too; ``embed_dim`` (the
    input width, unsplit) is left alone.
    """
    for attr, value in (("num_heads", heads.num_heads), ("num_attention_heads", heads.num_heads),
                        ("num_key_value_heads", heads.num_kv_heads), ("split_size", heads.split_size)):
        if value is not None and isinstance(getattr(attention, attr, None), int):
            setattr(attention, attr, value)


_TP_MODEL_INIT_KWARGS = ("tp_group",)


def tp_model_init(model: nn.Module, tp_size: int, dtype: torch.dtype, config: Mapping | str | None = None,
                  **kwargs: Any) -> nn.Module:
    """DeepSpeed's ``tp_model_init``: cast ``model`` to ``dtype`` and split it over ``tp_size`` ranks now.

    The process group is started (or joined) with ``init_distributed``; the tensor-parallel group is the
    mesh's ``tp`` axis of ``ParallelDims(world_size, tp=tp_size)``, unless ``tp_group=`` is given.
    ``config`` (a DeepSpeed config dict or JSON path) may carry ``tensor_parallel.partition_config`` /
    ``preset_model``; its ``autotp_size`` and ``dtype``, when given, must agree with the arguments.
    """
    unknown = sorted(set(kwargs) - set(_TP_MODEL_INIT_KWARGS))
    if unknown:
        raise TypeError(f"tp_model_init() got unexpected keyword arguments {unknown}; it accepts "
                        f"{list(_TP_MODEL_INIT_KWARGS)} besides model, tp_size, dtype and config")
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_model_init: tp_size={tp_size!r} must be an integer >= 1")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"tp_model_init: dtype={dtype!r} must be a floating-point torch.dtype (torch.bfloat16...)")
    section = _tp_section(config)
    if section is not None:
        _check_agrees(section, tp_size, dtype)
    from zerospeed.distributed.env import init_distributed
    from zerospeed.distributed.mesh import ParallelDims

    group: TPGroup = kwargs.get("tp_group")
    if group is None:
        info = init_distributed()
        group = ParallelDims(world_size=info.world_size, tp=tp_size).build().comm("tp")
    elif degree(tp_comm(group)) != tp_size:
        raise ValueError(f"tp_model_init: tp_group has {degree(tp_comm(group))} ranks but tp_size={tp_size}; "
                         f"pass a group of tp_size ranks")
    model.to(dtype)
    return apply_autotp(model, group, partition_config=None if section is None else section.partition_config,
                        preset_model=None if section is None else section.preset_model)


def _tp_section(config: Mapping | str | None) -> Any:
    """The validated ``tensor_parallel`` section of a DeepSpeed config (dict or JSON path), if any."""
    if config is None:
        return None
    if isinstance(config, str):
        import json
        from pathlib import Path

        config = json.loads(Path(config).read_text())
    if not isinstance(config, Mapping):
        raise TypeError(f"tp_model_init: config={config!r} must be a DeepSpeed config dict or a JSON file path")
    if "tensor_parallel" not in config:
        return None
    from pydantic import ValidationError

    from zerospeed.config.schema_tp import TensorParallelConfig
    from zerospeed.config.translate import config_error

    try:
        return TensorParallelConfig.model_validate(config["tensor_parallel"])
    except ValidationError as err:
        raise AutoTPError("\n".join(f"tensor_parallel.{line}" for line in
                                    config_error(err, TensorParallelConfig).problems)) from None


def _check_agrees(section: Any, tp_size: int, dtype: torch.dtype) -> None:
    """DeepSpeed's merge rule: the config is canonical, a mismatch with the arguments is an error."""
    if section.autotp_size not in (0, tp_size):
        raise ValueError(f"tp_model_init: tp_size={tp_size} but the config's tensor_parallel.autotp_size is "
                         f"{section.autotp_size}; make them equal")
    if "dtype" in section.model_fields_set and section.dtype.torch_dtype != dtype:
        raise ValueError(f"tp_model_init: dtype={dtype} but the config's tensor_parallel.dtype is "
                         f"{section.dtype.value}; make them equal")


__all__ = ["PARSED_ATTR", "SIZE_ATTR", "apply_autotp", "autotp_size_of", "tp_model_init"]
