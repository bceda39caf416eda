"""Attribute access that imports a package's submodule on first use.

DeepSpeed imports its whole tree eagerly, so frameworks write ``deepspeed.runtime.lr_schedules.X``
after a bare ``import deepspeed``; zerospeed keeps ``import zerospeed`` cheap and imports a
submodule when such a chain first reaches it.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Callable


def submodule_getattr(package: str) -> Callable[[str], ModuleType]:
    """A module ``__getattr__`` for ``package`` that imports ``package.<name>`` when it exists."""

    def __getattr__(name: str) -> ModuleType:
        if name.startswith("__") or importlib.util.find_spec(f"{package}.{name}") is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return importlib.import_module(f"{package}.{name}")

    return __getattr__
