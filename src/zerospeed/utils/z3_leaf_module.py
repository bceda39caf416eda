"""``deepspeed.utils.z3_leaf_module``: mark modules ZeRO-3 treats as leaves.

A leaf module has every parameter of its subtree gathered when it is entered, and none of its
descendants is hooked: for mixtures of experts (experts run in a data-dependent order, which would
defeat a recorded prefetch order) and for very fine-grained modules. The mark is DeepSpeed's own
attribute, ``module._z3_leaf``, so models and frameworks that set or read it directly agree with these
functions. A ZeRO-3 engine reads the marks when ``zerospeed.initialize`` builds it (mark first).
"""

from __future__ import annotations

from typing import Callable, Sequence, Union

import torch
from torch import nn

LeafClasses = Sequence[Union[type, str]]


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether ``model`` is marked as a ZeRO-3 leaf."""
    return bool(getattr(model, "_z3_leaf", False))


def z3_leaf_parameter(model: torch.nn.Parameter) -> bool:
    """Whether a parameter belongs to a leaf module (DeepSpeed's ``ds_z3_leaf_module`` attribute)."""
    return hasattr(model, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """Every module in ``model`` marked as a leaf."""
    return [module for module in model.modules() if z3_leaf_module(module)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    model._z3_leaf = flag  # type: ignore[assignment]  # DeepSpeed's attribute, set on the module itself


def _qualified_name(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _matches(module: nn.Module, wanted: type | str) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    return type(module).__name__ == wanted or _qualified_name(module) == wanted


def _set_flags(model: nn.Module, leaf_module_classes: LeafClasses, flag: bool,
               raise_if_not_found: bool) -> list[nn.Module]:
    bad = [c for c in leaf_module_classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf_module_classes={bad!r}: expected module classes or class names "
                        f"(e.g. [MixtralSparseMoeBlock] or ['MixtralSparseMoeBlock'])")
    found = [m for m in model.modules() if any(_matches(m, c) for c in leaf_module_classes)]
    for module in found:
        set_z3_leaf_module(module, flag)
    if not found and raise_if_not_found:
        raise ValueError(f"leaf_module_classes={list(leaf_module_classes)!r}: no module of these classes in "
                         f"{type(model).__name__}; check the class names (or pass raise_if_not_found=False)")
    return found


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: LeafClasses,
                        raise_if_not_found: bool = True) -> list[nn.Module]:
    """Mark every module of ``leaf_module_classes`` (classes, class names or qualified names) as a leaf."""
    return _set_flags(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: LeafClasses,
                          raise_if_not_found: bool = True) -> list[nn.Module]:
    """Clear the leaf mark of every module of ``leaf_module_classes``."""
    return _set_flags(model, leaf_module_classes, False, raise_if_not_found)


def _by_path(model: nn.Module, paths: Sequence[str], matches: Callable[[str, str], bool], flag: bool,
             raise_if_not_found: bool) -> tuple[list[nn.Module], list[str]]:
    modules = dict(model.named_modules())
    found: list[nn.Module] = []
    missing: list[str] = []
    for wanted in paths:
        hits = [m for name, m in modules.items() if matches(name, wanted)]
        if not hits:
            missing.append(wanted)
        for module in hits:
            if all(module is not f for f in found):
                set_z3_leaf_module(module, flag)
                found.append(module)
    if missing and raise_if_not_found:
        raise ValueError(f"no module named {missing!r} in {type(model).__name__} (names as in named_modules())")
    return found, missing


def set_z3_leaf_modules_by_name(model: nn.Module, module_names: Sequence[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Mark the modules named (as in ``named_modules()``); returns them and the names not found."""
    return _by_path(model, module_names, lambda name, wanted: name == wanted, flag, raise_if_not_found)


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes: Sequence[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Mark the modules whose ``named_modules()`` name ends with one of the suffixes."""
    return _by_path(model, module_name_suffixes, lambda name, wanted: name.endswith(wanted), flag,
                    raise_if_not_found)


__all__ = ["get_z3_leaf_modules", "set_z3_leaf_module", "set_z3_leaf_modules", "set_z3_leaf_modules_by_name",
           "set_z3_leaf_modules_by_suffix", "unset_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter"]
