"""Attribute access that imports a package's submodule (or a name from one) on first use.

DeepSpeed imports its whole tree eagerly, so frameworks write ``deepspeed.runtime.lr_schedules.X``
after a bare ``import deepspeed``; zerospeed keeps ``import zerospeed`` cheap and imports a
submodule when such a chain first reaches it. :func:`lazy_attributes` does the same for names that
a package re-exports from its modules (``zerospeed.initialize``, ``zerospeed.distributed.Comm``), so
the launcher can import a torch-free corner of a package without torch.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Collection, Iterable, Mapping
from types import ModuleType
from typing import Any


def submodule_getattr(package: str) -> Callable[[str], ModuleType]:
    """A module ``__getattr__`` for ``package`` that imports ``package.<name>`` when it exists."""

    def __getattr__(name: str) -> ModuleType:
        if name.startswith("__") or importlib.util.find_spec(f"{package}.{name}") is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return importlib.import_module(f"{package}.{name}")

    return __getattr__


def lazy_attributes(package: str, names: Mapping[str, str], *, submodules: Collection[str] = (),
                    public: Iterable[str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module's PEP 562 ``__getattr__`` and ``__dir__``: ``names`` maps each lazy name to the module
    defining it (imported on first access), ``submodules`` are ``package.<name>`` modules reachable as
    attributes; ``__dir__`` lists ``public`` (the module's ``__all__``)."""
    listed = sorted(public)

    def __getattr__(name: str) -> Any:
        if name in submodules:
            return importlib.import_module(f"{package}.{name}")
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    def __dir__() -> list[str]:
        return list(listed)

    return __getattr__, __dir__
