"""``deepspeed.checkpoint.utils``: helpers for code that saves tensors with ``torch.save`` itself."""

from __future__ import annotations

from typing import Any

import torch


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = torch.device("cpu")) -> Any:
    """``item`` with every tensor (through lists, tuples and dicts) cloned to ``device``: ``torch.save``
    of a view writes its whole storage, a clone writes only its own elements."""
    if torch.is_tensor(item):
        return item.detach().to(device).clone()
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item


__all__ = ["clone_tensors_for_torch_save"]
