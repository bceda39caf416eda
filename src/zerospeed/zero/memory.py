"""Bytes held by tensors, counted once per storage (views of one buffer are not double-counted)."""

from __future__ import annotations

from typing import Iterable

import torch


def storage_bytes(tensors: Iterable[torch.Tensor | None], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Sum of the allocated bytes of the distinct storages behind ``tensors``, minus ``exclude``'s."""
    skip = {_key(t) for t in exclude if t is not None}
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t is None:
            continue
        key = _key(t)
        if key in skip or key in seen:
            continue
        seen[key] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _key(t: torch.Tensor) -> tuple[str, int]:
    storage = t.untyped_storage()
    return (str(t.device), storage.data_ptr() if storage.nbytes() else id(storage))
