"""The experts a rank holds (DeepSpeed's ``Experts``: ``deepspeed_experts.<local index>``).

Each expert is a deep copy of the user's module, its parameters marked as DeepSpeed marks them
(``allreduce = False``, ``group_name`` = the expert group), so optimizers and gradient reduction
(:func:`zerospeed.moe.utils.is_moe_param`) treat them as expert parameters.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
from torch import Tensor, nn


def _first(out: Tensor | tuple[Tensor, ...]) -> Tensor:
    """An expert may return ``(output, bias)`` (Megatron style); the bias is ignored, as in DeepSpeed."""
    return out[0] if isinstance(out, tuple) else out


class Experts(nn.Module):
    """``num_local_experts`` copies of ``expert``, run on capacity buffers or on grouped rows."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for module in self.deepspeed_experts:
            for param in module.parameters():
                param.allreduce = False  # type: ignore[attr-defined]
                param.group_name = expert_group_name  # type: ignore[attr-defined]

    def forward(self, inputs: Tensor) -> Tensor:
        """Capacity path: ``inputs`` ``[ep, local_experts, C, d]``; local expert i runs on ``[:, i]``."""
        chunks = inputs.chunk(self.num_local_experts, dim=1)
        outs = [_first(module(chunk)) for chunk, module in zip(chunks, self.deepspeed_experts)]
        return torch.cat(outs, dim=1)

    def forward_grouped(self, rows: Tensor, counts: Sequence[int]) -> Tensor:
        """Dropless path: ``rows`` sorted by local expert, ``counts[i]`` rows for expert i.

        One call per expert over its contiguous slice, no padding. An expert with no rows still
        runs on an empty slice, so its parameters get a (zero) gradient like every other rank's.
        """
        if len(counts) != self.num_local_experts or sum(counts) != rows.shape[0]:
            raise ValueError(f"Experts.forward_grouped: counts={list(counts)} must have {self.num_local_experts} "
                             f"entries summing to the {rows.shape[0]} rows")
        slices = rows.split([int(n) for n in counts], dim=0)
        outs = [_first(module(part)) for part, module in zip(slices, self.deepspeed_experts)]
        return torch.cat(outs, dim=0)


__all__ = ["Experts"]
