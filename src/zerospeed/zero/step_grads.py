"""The gradient shards a step updates from, whether they are in memory or kept on NVMe.

The engine unscales (fp16), measures the global norm and clips before the update. A shard in memory
is changed in place, as always. A shard kept in an NVMe slab (:mod:`zerospeed.zero.swapped`) is not
in memory at that point: its norm was measured when its final value was written, and the operations
are recorded here and applied, in the same order, when the unit is read in for its update — so the
update sees the same values either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from zerospeed.distributed.comm import Comm

Ranges = Sequence[tuple[int, int]]


@dataclass(frozen=True)
class NormScope:
    """How this rank's gradients add up to the global norm when the model itself is split (tensor
    parallelism): each parameter must be counted exactly once over all ranks.

    ``counted_elsewhere`` names parameters whose gradient another rank counts (replicated over the
    tensor-parallel group: tensor-parallel rank 0 counts them), ``across`` the Comms the squared norm
    is summed over besides the data-parallel sum the state does itself (the tensor-parallel group).
    The default is plain data parallelism: nothing skipped, nothing more to sum."""

    counted_elsewhere: frozenset[str] = frozenset()
    across: tuple[Comm, ...] = ()

    def sum_across(self, squared: torch.Tensor) -> torch.Tensor:
        """``squared`` (a float64 scalar) summed over ``across``."""
        for comm in self.across:
            total = squared.reshape(1).clone()
            comm.all_reduce(total)
            squared = total[0]
        return squared


def counted_norm(tensor: torch.Tensor, skip: Ranges = ()) -> torch.Tensor:
    """The float32 norm of ``tensor`` (1-D) leaving out the element ranges ``skip`` (sorted, disjoint)."""
    if not skip:
        return torch.linalg.vector_norm(tensor, dtype=torch.float32)
    parts, at = [], 0
    for lo, hi in skip:
        if lo > at:
            parts.append(torch.linalg.vector_norm(tensor[at:lo], dtype=torch.float32))
        at = max(at, hi)
    if at < tensor.numel():
        parts.append(torch.linalg.vector_norm(tensor[at:], dtype=torch.float32))
    if not parts:
        return torch.zeros((), dtype=torch.float32, device=tensor.device)
    return torch.linalg.vector_norm(torch.stack(parts))


class StepGrads:
    """One window's gradient shards in unit order: ``(tensor, norm)`` pairs, where ``norm`` is None for
    a shard in memory and the float32 norm of the stored value for one kept on NVMe (whose
    ``tensor`` is then only valid while its unit is resident)."""

    def __init__(self, entries: Sequence[tuple[torch.Tensor, torch.Tensor | None]], device: torch.device,
                 skip: Sequence[Ranges] | None = None):
        """``skip``: per entry, element ranges left out of the norm (counted on another rank)."""
        self.entries = list(entries)
        self.device = device
        self.skip = list(skip) if skip is not None else [()] * len(self.entries)
        self.ops: list[tuple[str, float]] = []  # ("div" | "mul", value), in the order the engine applied them

    @classmethod
    def in_memory(cls, tensors: Sequence[torch.Tensor], skip: Sequence[Ranges] | None = None) -> "StepGrads":
        return cls([(t, None) for t in tensors], tensors[0].device if tensors else torch.device("cpu"), skip)

    def div_(self, value: float) -> None:
        self._record("div", value)

    def mul_(self, value: float) -> None:
        self._record("mul", value)

    def _record(self, op: str, value: float) -> None:
        for tensor, norm in self.entries:
            if norm is None:
                getattr(tensor, f"{op}_")(value)
        self.ops.append((op, value))

    def local_norm(self) -> torch.Tensor:
        """This rank's gradient norm (float32, on ``device``): inf or nan when any shard has one."""
        norms = [counted_norm(t.reshape(-1), skip) if norm is None else self.apply(norm.clone())
                 for (t, norm), skip in zip(self.entries, self.skip, strict=True)]
        if not norms:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        return torch.linalg.vector_norm(torch.stack([n.to(self.device) for n in norms]))

    def apply(self, tensor: torch.Tensor) -> torch.Tensor:
        """The recorded operations, in place on ``tensor`` (a shard just read in, or its norm)."""
        for op, value in self.ops:
            getattr(tensor, f"{op}_")(value)
        return tensor
