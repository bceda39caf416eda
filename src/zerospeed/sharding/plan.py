"""Who owns which bytes: a pure plan of flat, padded, sharded parameter units.

Parameters are grouped into *units* (for ZeRO-3 a block such as one transformer layer: gathered,
used and released together). Each unit is laid out as one flat buffer — its parameters back to back
— padded so that it splits into ``world_size`` equal shards whose length is a multiple of ``align``
elements (aligned shard starts for vectorised kernels and collectives). Rank ``r`` owns shard ``r``.
Everything here is arithmetic on names and shapes: no tensors, no processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

DEFAULT_ALIGN = 8  # elements: 16-byte shard starts for 2-byte dtypes, 32 for fp32


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in its unit's flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int  # first element in the unit's flat buffer

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class Piece:
    """The part ``[start, end)`` of parameter ``param`` (flattened) that lies in one rank's shard,
    at ``shard_offset`` within that shard."""

    param: str
    start: int
    end: int
    shard_offset: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class UnitPlan:
    """One unit: its parameters' layout and how its padded flat buffer splits across ranks."""

    name: str
    params: tuple[ParamSlot, ...]
    world_size: int
    align: int

    @property
    def numel(self) -> int:
        """Elements of real data (no padding)."""
        return self.params[-1].end if self.params else 0

    @property
    def shard_numel(self) -> int:
        per_rank = -(-self.numel // self.world_size)
        return -(-per_rank // self.align) * self.align if per_rank else 0

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of rank ``rank``'s shard in the padded flat buffer."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def pieces(self, rank: int) -> list[Piece]:
        """The parameter parts rank ``rank`` owns, in buffer order (padding owns nothing)."""
        lo, hi = self.shard_range(rank)
        out = []
        for slot in self.params:
            start, end = max(lo, slot.offset), min(hi, slot.end)
            if start < end:
                out.append(Piece(slot.name, start - slot.offset, end - slot.offset, start - lo))
        return out

    def owners(self, param: str) -> list[int]:
        """The ranks holding some part of ``param``."""
        slot = self.slot(param)
        if slot.numel == 0 or self.shard_numel == 0:
            return []
        return list(range(slot.offset // self.shard_numel, (slot.end - 1) // self.shard_numel + 1))

    def slot(self, param: str) -> ParamSlot:
        for slot in self.params:
            if slot.name == param:
                return slot
        raise KeyError(f"parameter {param!r} is not in unit {self.name!r}")


@dataclass(frozen=True)
class ShardPlan:
    """Every unit of a model for one data-parallel world size."""

    world_size: int
    units: tuple[UnitPlan, ...]

    @classmethod
    def build(cls, units: Sequence[tuple[str, Sequence[tuple[str, Sequence[int]]]]], world_size: int,
              align: int = DEFAULT_ALIGN) -> "ShardPlan":
        """Lay out ``units`` — ``(unit name, [(param name, shape), ...])`` in order — for ``world_size`` ranks."""
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        if align < 1:
            raise ValueError(f"align={align} must be >= 1 element")
        seen: dict[str, str] = {}
        built = []
        for unit_name, params in units:
            slots, offset = [], 0
            for name, shape in params:
                if name in seen:
                    raise ValueError(f"parameter {name!r} is in unit {seen[name]!r} and again in {unit_name!r}; "
                                     f"a shared (tied) parameter belongs to exactly one unit")
                seen[name] = unit_name
                slot = ParamSlot(name, tuple(int(d) for d in shape), offset)
                slots.append(slot)
                offset = slot.end
            built.append(UnitPlan(unit_name, tuple(slots), world_size, align))
        return cls(world_size, tuple(built))

    def unit_of(self, param: str) -> UnitPlan:
        for unit in self.units:
            if any(slot.name == param for slot in unit.params):
                return unit
        raise KeyError(f"parameter {param!r} is in no unit of this plan")

    def shard_numel(self, rank: int) -> int:
        """Elements rank ``rank`` stores across all units (padding included)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        return sum(unit.shard_numel for unit in self.units)

    @property
    def numel(self) -> int:
        return sum(unit.numel for unit in self.units)
