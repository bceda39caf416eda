"""The gradient shards a step updates from, whether they are in memory or kept on NVMe.

The engine unscales (fp16), measures the global norm and clips before the update. A shard in memory
is changed in place, as always. A shard kept in an NVMe slab (:mod:`zerospeed.zero.swapped`) is not
in memory at that point: its norm was measured when its final value was written, and the operations
are recorded here and applied, in the same order, when the unit is read in for its update — so the
update sees the same values either way.
"""

from __future__ import annotations

from typing import Sequence

import torch


class StepGrads:
    """One window's gradient shards in unit order: ``(tensor, norm)`` pairs, where ``norm`` is None for
    a shard in memory and the float32 norm of the stored value for one kept on NVMe (whose
    ``tensor`` is then only valid while its unit is resident)."""

    def __init__(self, entries: Sequence[tuple[torch.Tensor, torch.Tensor | None]], device: torch.device):
        self.entries = list(entries)
        self.device = device
        self.ops: list[tuple[str, float]] = []  # ("div" | "mul", value), in the order the engine applied them

    @classmethod
    def in_memory(cls, tensors: Sequence[torch.Tensor]) -> "StepGrads":
        return cls([(t, None) for t in tensors], tensors[0].device if tensors else torch.device("cpu"))

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
        norms = [torch.linalg.vector_norm(t, dtype=torch.float32) if norm is None else self.apply(norm.clone())
                 for t, norm in self.entries]
        if not norms:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        return torch.linalg.vector_norm(torch.stack([n.to(self.device) for n in norms]))

    def apply(self, tensor: torch.Tensor) -> torch.Tensor:
        """The recorded operations, in place on ``tensor`` (a shard just read in, or its norm)."""
        for op, value in self.ops:
            getattr(tensor, f"{op}_")(value)
        return tensor
