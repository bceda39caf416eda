"""A unit's flat, padded buffer with a view per parameter: the tensors a ShardPlan describes.

Parameters, gradients and optimizer states of one unit live in one contiguous buffer so a single
collective moves them all; each parameter is a view into it, and rank ``r``'s shard is one slice.
"""

from __future__ import annotations

from typing import Mapping

import torch

from zerospeed.sharding.plan import UnitPlan


class FlatUnit:
    """``buffer`` (``plan.padded_numel`` elements, padding zeroed) and ``views[name]`` in each parameter's shape."""

    def __init__(self, plan: UnitPlan, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.plan = plan
        self.buffer = torch.zeros(plan.padded_numel, dtype=dtype, device=device)
        self.views = {slot.name: self.buffer[slot.offset: slot.end].view(slot.shape) for slot in plan.params}

    @classmethod
    def from_tensors(cls, plan: UnitPlan, tensors: Mapping[str, torch.Tensor], *,
                     dtype: torch.dtype | None = None) -> "FlatUnit":
        """Copy each parameter's values in (casting to ``dtype``, default the first tensor's dtype)."""
        missing = [slot.name for slot in plan.params if slot.name not in tensors]
        if missing:
            raise KeyError(f"unit {plan.name!r} needs tensors for {missing}")
        first = tensors[plan.params[0].name] if plan.params else torch.empty(0)
        flat = cls(plan, dtype=dtype or first.dtype, device=first.device)
        for slot in plan.params:
            tensor = tensors[slot.name]
            if tuple(tensor.shape) != slot.shape:
                raise ValueError(f"{slot.name}: shape {tuple(tensor.shape)} does not match the plan's {slot.shape}")
            flat.views[slot.name].copy_(tensor)
        return flat

    def shard(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s slice of the buffer (a view: writes go to the buffer)."""
        start, end = self.plan.shard_range(rank)
        return self.buffer[start:end]
