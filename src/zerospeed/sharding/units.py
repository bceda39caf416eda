"""Choose ZeRO-3 units from a model's module tree (what is gathered, used and released together).

By default the blocks a model repeats — the items of its ``nn.ModuleList``s, e.g. transformer
layers — become one unit each; every other parameter joins a unit named after the top-level child
that holds it (``embed``, ``final_norm``...), or ``<root>`` for the model's own parameters. Pass
``unit_classes`` to choose the block classes yourself (like FSDP's wrap policy). A parameter shared
by several modules (tied weights) belongs to the first unit that reaches it.

Where a unit is only what one collective moves (ZeRO stages 1-2), :func:`coalesce` joins small
neighbouring units, so a model of many small blocks does not pay one collective's latency per block.
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

import torch

from torch import nn

Units = list[tuple[str, list[tuple[str, tuple[int, ...]]]]]
ROOT = "<root>"


def repeated_block_classes(model: nn.Module) -> tuple[type, ...]:
    """Classes of the items of every ``nn.ModuleList`` in ``model`` (its repeated blocks)."""
    found: list[type] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for child in module:
                if type(child) not in found and any(True for _ in child.parameters()):
                    found.append(type(child))
    return tuple(found)


def module_units(model: nn.Module, unit_classes: Sequence[type] | None = None,
                 shape_of: Callable[[torch.Tensor], tuple[int, ...]] = lambda p: tuple(p.shape)) -> Units:
    """``(unit name, [(param name, shape), ...])`` in the order parameters are registered
    (``shape_of`` reads a parameter's full shape when its data is a partition)."""
    classes = tuple(unit_classes) if unit_classes is not None else repeated_block_classes(model)
    block_of: dict[str, str] = {}  # module path -> the unit it belongs to
    for path, module in model.named_modules():
        if path and isinstance(module, classes) and not any(path.startswith(p + ".") for p in block_of):
            block_of[path] = path
    units: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, param in model.named_parameters():  # each parameter once, under its first name
        owner = next((unit for path, unit in block_of.items() if name.startswith(path + ".")), None)
        if owner is None:
            owner = name.split(".", 1)[0] if "." in name else ROOT
        units.setdefault(owner, []).append((name, shape_of(param)))
    return list(units.items())


def coalesce(sizes: Sequence[int], kinds: Sequence[Hashable], *, min_elems: int, max_elems: int) -> list[list[int]]:
    """Group consecutive items (indices, in order): items smaller than ``min_elems`` share a group with
    their small neighbours until it holds ``min_elems``, never above ``max_elems``, one kind per group.

    Items of ``min_elems`` or more stay alone (their own size, so equal blocks keep reusing one
    another's buffers); ``kinds`` keep apart what must not share one collective (different dtypes;
    trainable and frozen units, so frozen bytes are never reduced).
    """
    if len(sizes) != len(kinds):
        raise ValueError(f"{len(sizes)} sizes for {len(kinds)} kinds")
    groups: list[list[int]] = []
    filled = 0
    for i, size in enumerate(sizes):
        if groups and kinds[groups[-1][-1]] == kinds[i] and max(filled, size) < min_elems \
                and filled + size <= max_elems:
            groups[-1].append(i)
            filled += size
        else:
            groups.append([i])
            filled = size
    return groups
