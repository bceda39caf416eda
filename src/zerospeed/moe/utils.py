"""DeepSpeed's MoE parameter helpers (``deepspeed.moe.utils``).

An expert parameter is marked as DeepSpeed marks it: ``param.allreduce = False`` (its gradient is
averaged over the expert-data-parallel group, not the whole data-parallel group) and
``param.group_name`` naming that group. Optimizers need expert parameters in groups of their own,
one per group name, which :func:`split_params_into_different_moe_groups_for_optimizer` builds.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from torch import nn

# DeepSpeed's default: about 178.9M elements per expert parameter group.
DEFAULT_MAX_GROUP_SIZE = 178956971


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` belongs to an expert (it is not all-reduced over the whole data-parallel group)."""
    return getattr(param, "allreduce", True) is False


def has_moe_layers(module: nn.Module) -> tuple[bool, int]:
    """``(True, num_experts)`` of the first MoE layer in ``module``, else ``(False, 0)``. A layer counts
    as MoE when it declares ``num_experts`` and owns expert parameters."""
    for sub in module.modules():
        experts = getattr(sub, "num_experts", None)
        if isinstance(experts, int) and any(is_moe_param(p) for p in sub.parameters()):
            return True, experts
    return False, 0


def split_params_into_shared_and_expert_params(
        params: Iterable[nn.Parameter]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(shared, expert)`` parameters, each in the given order."""
    shared: list[nn.Parameter] = []
    expert: list[nn.Parameter] = []
    for p in params:
        (expert if is_moe_param(p) else shared).append(p)
    return shared, expert


def split_params_grads_into_shared_and_expert_params(
        group: Iterable[nn.Parameter]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(shared, expert)`` gradients (in each parameter's dtype) of the parameters that have one."""
    shared: list[torch.Tensor] = []
    expert: list[torch.Tensor] = []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    return bool(param_group.get("moe", False))


def _as_group_list(param_groups: Any) -> list[dict[str, Any]]:
    if isinstance(param_groups, dict):
        return [param_groups]
    if isinstance(param_groups, (list, tuple)):
        return list(param_groups)
    raise ValueError(f"split_params_into_different_moe_groups_for_optimizer: param_groups must be a dict or a "
                     f"list/tuple of dicts (optimizer parameter groups), got {type(param_groups).__name__}")


def _chunks(params: Sequence[nn.Parameter], max_elems: int | float) -> list[list[nn.Parameter]]:
    """Consecutive runs of ``params`` of at most ``max_elems`` elements (a larger parameter stands alone)."""
    runs: list[list[nn.Parameter]] = []
    run: list[nn.Parameter] = []
    size = 0
    for p in params:
        numel = int(getattr(p, "ds_numel", p.numel()))
        if run and size + numel > max_elems:
            runs.append(run)
            run, size = [], 0
        run.append(p)
        size += numel
    if run:
        runs.append(run)
    return runs


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: dict[str, Any] | Sequence[dict[str, Any]],
        max_group_size: int | float | None = DEFAULT_MAX_GROUP_SIZE) -> list[dict[str, Any]]:
    """Move expert parameters out of each group into groups of their own (``moe=True``, ``name`` = the
    expert group's name, the original group's other options kept), split into runs of at most
    ``max_group_size`` elements; the shared parameters stay in the original groups. As in DeepSpeed,
    the given group dicts are updated in place and every group needs a ``"name"`` when any parameter
    is an expert."""
    groups = _as_group_list(param_groups)
    for group in groups:
        group["params"] = list(group["params"])  # a filter() or generator is read once
    expert_names = sorted({p.group_name for g in groups for p in g["params"] if is_moe_param(p)})
    if expert_names:
        unnamed = [i for i, g in enumerate(groups) if "name" not in g]
        if unnamed:
            raise ValueError(f"split_params_into_different_moe_groups_for_optimizer: parameter group(s) {unnamed} "
                             f"have no \"name\"; give each group a name (e.g. {{'params': ..., 'name': 'decay'}})")
    new_groups: list[dict[str, Any]] = []
    for group in groups:
        experts: dict[str, list[nn.Parameter]] = {name: [] for name in expert_names}
        shared: list[nn.Parameter] = []
        for p in group["params"]:
            if is_moe_param(p):
                experts[p.group_name].append(p)
            else:
                shared.append(p)
        group["params"] = shared
        for name, params in experts.items():
            runs = _chunks(params, max_group_size) if max_group_size is not None else [params]
            new_groups += [{**group, "name": name, "moe": True, "params": run} for run in runs]
    return groups + new_groups


__all__ = ["has_moe_layers", "is_moe_param", "is_moe_param_group", "split_params_grads_into_shared_and_expert_params",
           "split_params_into_different_moe_groups_for_optimizer", "split_params_into_shared_and_expert_params"]
