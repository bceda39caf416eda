"""Which parameters form each ZeRO unit, and which module gathers it (stage 3).

A unit is what one collective moves: its gradients are reduce-scattered together and, under
stage 3, its parameters are all-gathered before the module that owns it runs and released after.
Units start from the module tree (:func:`zerospeed.sharding.units.module_units`: one per repeated
block, one per other top-level child); a unit larger than ``reduce_bucket_size`` elements is cut at
parameter boundaries so no bucket exceeds it. Under stage 3, parameters smaller than
``stage3_param_persistence_threshold`` elements are *persistent*: they stay whole on every rank
(gathering them would cost more latency than the memory saved) and go into one unit of their own.

Under stages 1-2 a unit is only what one reduce-scatter and one all-gather move (no module gathers
it), so neighbouring units smaller than :data:`MIN_UNIT_ELEMS` are joined with one another, up to
``reduce_bucket_size``: a small model's blocks then cost a few collectives per step instead of one
each, while larger units keep their size. Stage 3 keeps the module tree's units, which are what its
modules gather and release.

Modules that use a parameter of another unit (a tied LM head reusing the embedding's weight, or a
parameter registered with :func:`register_external_parameter`) gather that unit too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from zerospeed.sharding.units import ROOT, coalesce, module_units, repeated_block_classes
from zerospeed.zero.flat_param import shape_of
from zerospeed.zero.grads import plan_buckets

PERSISTENT = "<persistent>"
# Units smaller than this (4 MB in fp32) are joined at stages 1-2: a collective's fixed cost (gloo on 2
# CPU ranks: ~1 ms, about the time to move 1 MB; more when the ranks compete for cores) would be a large
# part of theirs.
MIN_UNIT_ELEMS = 1 << 20


@dataclass(frozen=True)
class UnitSpec:
    """One unit: its parameters (in flat-buffer order) and which module's forward gathers it.

    ``module_path`` is the block (or ``""``, the root) whose forward gathers the whole unit; for
    the other units (parameters of a top-level child that is not a block, such as an embedding, or
    a ``ModuleDict`` whose forward never runs) it is None and each module holding one of the unit's
    parameters gathers it. A persistent unit is never gathered or released.
    """

    name: str
    param_names: tuple[str, ...]
    params: tuple[nn.Parameter, ...] = field(repr=False)
    module_path: str | None
    persistent: bool = False

    @property
    def numel(self) -> int:
        return sum(math.prod(shape_of(p)) for p in self.params)


def build_units(model: nn.Module, *, bucket_elems: int, persistence_threshold: int = 0, min_unit_elems: int = 0,
                unit_classes: tuple[type, ...] | None = None,
                owns: Callable[[nn.Parameter], bool] | None = None) -> list[UnitSpec]:
    """Units of ``model`` in registration order (persistent parameters last, in one unit); neighbouring
    units smaller than ``min_unit_elems`` are joined, up to ``bucket_elems`` (stages 1-2, where no
    module gathers a unit: a joined unit has no ``module_path``). ``owns``: only these parameters
    (a state over part of the model, e.g. its experts)."""
    by_name = dict(model.named_parameters())
    modules = dict(model.named_modules())
    classes = tuple(unit_classes) if unit_classes is not None else repeated_block_classes(model)
    units: list[UnitSpec] = []
    persistent: list[str] = []
    tree_units = module_units(model, unit_classes, shape_of)
    numel = {name: math.prod(shape) for _, entries in tree_units for name, shape in entries}
    for unit_name, entries in tree_units:
        names: list[str] = []
        for name, _shape in entries:
            if owns is not None and not owns(by_name[name]):
                continue
            (persistent if numel[name] < persistence_threshold else names).append(name)
        is_block = isinstance(modules.get(unit_name), classes) if classes else False
        module_path = "" if unit_name == ROOT else unit_name if is_block else None
        groups = plan_buckets([numel[n] for n in names], bucket_elems) if names else []
        for part, group in enumerate(groups):
            chosen = tuple(names[i] for i in group)
            label = unit_name if len(groups) == 1 else f"{unit_name}[{part}]"
            units.append(UnitSpec(label, chosen, tuple(by_name[n] for n in chosen), module_path))
    if min_unit_elems > 0:
        units = _coalesce(units, min_unit_elems, bucket_elems)
    if persistent:
        units.append(UnitSpec(PERSISTENT, tuple(persistent), tuple(by_name[n] for n in persistent), None,
                              persistent=True))
    return units


def _coalesce(units: list[UnitSpec], min_elems: int, max_elems: int) -> list[UnitSpec]:
    """``units`` with small neighbours joined (see :func:`zerospeed.sharding.units.coalesce`): one
    dtype per unit, and trainable units apart from frozen ones (whose gradients are never reduced)."""
    kinds = [(u.params[0].dtype, u.params[0].device, any(p.requires_grad for p in u.params)) for u in units]
    out = []
    for group in coalesce([u.numel for u in units], kinds, min_elems=min_elems, max_elems=max_elems):
        joined = [units[i] for i in group]
        if len(joined) == 1:
            out.append(joined[0])
            continue
        name = f"{joined[0].name}..{joined[-1].name}"
        out.append(UnitSpec(name, sum((u.param_names for u in joined), ()), sum((u.params for u in joined), ()),
                            module_path=None))
    return out


def module_users(model: nn.Module, units: list[UnitSpec],
                 external: dict[int, list[nn.Parameter]] | None = None) -> dict[str, list[int]]:
    """For each module path, the indices of the non-persistent units its forward needs gathered.

    A block (or the root) gathers its whole unit; any other module gathers the unit of every
    parameter it holds directly (also a tied parameter held under a second name), or declared to
    use (``external``: ``id(module) -> params``), unless that unit belongs to a block around it.
    A ZeRO-3 leaf module (``deepspeed.utils.set_z3_leaf_modules``: e.g. a mixture of experts, whose
    children run in a data-dependent order) gathers everything its subtree needs on entry instead.
    """
    unit_of_param = {id(p): i for i, unit in enumerate(units) for p in unit.params}
    users: dict[str, list[int]] = {}
    for i, unit in enumerate(units):
        if not unit.persistent and unit.module_path is not None:
            users.setdefault(unit.module_path, []).append(i)
    for path, module in model.named_modules():
        used = [p for p in module._parameters.values() if p is not None]
        used += (external or {}).get(id(module), [])
        for p in used:
            index = unit_of_param.get(id(p))
            if index is None or units[index].persistent:
                continue
            owner = units[index].module_path
            inside_owner = owner is not None and (owner == "" or path == owner or path.startswith(owner + "."))
            if not inside_owner and index not in users.setdefault(path, []):
                users[path].append(index)
    leaves = [path for path, module in model.named_modules() if getattr(module, "_z3_leaf", False)]
    for leaf in leaves:
        inside = [path for path in users if path == leaf or path.startswith(leaf + ".") or leaf == ""]
        folded = [i for path in inside for i in users.pop(path)]
        users[leaf] = list(dict.fromkeys(folded))  # a leaf inside a leaf: empty
    return {path: ids for path, ids in users.items() if ids}
