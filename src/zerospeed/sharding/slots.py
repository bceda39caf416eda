"""What a model-state strategy hands the checkpoint code: its parameters and the slices it holds.

A checkpoint never stores a rank's flat buffers (their layout depends on the world size, the ZeRO
stage and the unit boundaries); it stores, for every parameter, contiguous element ranges of the
parameter's flattened values. Each strategy (stage 0's :class:`ReplicatedState`, stages 1-3's
:class:`ShardedState`) describes what it holds as :class:`Slot` values, so saving and resharded
loading are written once, in :mod:`zerospeed.checkpoint.state_io` (this module sits below both).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamInfo:
    """A parameter as the checkpoint records it (canonical name: the first under which it appears)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # the model's (compute) dtype
    trainable: bool


@dataclass(frozen=True)
class Slot:
    """Elements ``[start, end)`` of parameter ``param`` (flattened) that this rank holds.

    ``master`` is the 1-D view of those elements in full precision (the fp32 master, or the
    parameter itself when there is none); ``opt_key`` is the tensor the optimizer keys its state by
    (None for frozen parameters), of which this slot covers elements ``[key_offset, key_offset +
    end - start)``.
    """

    param: str
    start: int
    end: int
    master: torch.Tensor
    opt_key: torch.Tensor | None = None
    key_offset: int = 0

    @property
    def numel(self) -> int:
        return self.end - self.start


def even_split(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank ``rank``'s part of ``numel`` elements split as evenly as possible (for replicated state,
    whose ranks each write a share so a save runs in parallel)."""
    return numel * rank // world_size, numel * (rank + 1) // world_size
