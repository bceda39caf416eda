"""``deepspeed.checkpoint.utils``: helpers for code that saves tensors with ``torch.save`` itself."""

from __future__ import annotations

from typing import Any

import torch

from zerospeed.tensor_tree import map_tensors


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = torch.device("cpu")) -> Any:
    """``item`` with every tensor (through tuples, lists and mappings) cloned to ``device``: ``torch.save``
    of a view writes its whole storage, a clone writes only its own elements."""
    return map_tensors(item, lambda t: t.detach().to(device).clone())


__all__ = ["clone_tensors_for_torch_save"]
