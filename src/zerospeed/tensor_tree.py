"""One walk over the tensors inside a nested value (a batch, a state dict, a forward's arguments).

Tuples (named ones too), lists and mappings are rebuilt around the mapped tensors (a dict subclass
is kept when it can be rebuilt from a dict); anything else is returned as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``fn`` applied to every tensor in it."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        items = [map_tensors(v, fn) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return type(value)(map_tensors(v, fn) for v in value)
    if isinstance(value, Mapping):
        mapped = {k: map_tensors(v, fn) for k, v in value.items()}
        if type(value) is dict:
            return mapped
        try:
            return type(value)(mapped)  # type: ignore[call-arg]  # a dict subclass or alike
        except TypeError:
            return mapped
    return value


__all__ = ["map_tensors"]
