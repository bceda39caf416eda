"""Parallel degrees validated into named process groups.

:class:`ParallelDims` is a pure value: it checks that the degrees multiply to the world size and
says which ranks share each axis. :meth:`ParallelDims.build` turns it into a :class:`Mesh` (one
:class:`~zerospeed.distributed.comm.Comm` per axis) that is passed to whoever
needs groups; nothing is stored in module globals.

Rank layout is row-major over ``(pp, dp, tp)``: tensor-parallel peers are adjacent ranks (they
talk most), pipeline stages are farthest apart.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Literal, Mapping

import torch.distributed as dist

from zerospeed.distributed.comm import DEFAULT_COMM_TIMEOUT, Comm

Axis = Literal["pp", "dp", "tp"]
AXES: tuple[Axis, ...] = ("pp", "dp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallel axis. ``dp=-1`` means "whatever the world size leaves"."""

    world_size: int
    dp: int = -1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelDims.{name}={value!r} must be an integer >= 1")
        if not isinstance(self.dp, int) or isinstance(self.dp, bool):
            raise ValueError(f"ParallelDims.dp={self.dp!r} must be an integer >= 1, or -1 to infer it")
        fixed = self.tp * self.pp
        if self.dp == -1:
            if self.world_size % fixed:
                raise ValueError(
                    f"world size {self.world_size} is not divisible by tp*pp = {self.tp}*{self.pp} = {fixed}; "
                    f"choose tp and pp whose product divides {self.world_size}"
                )
            object.__setattr__(self, "dp", self.world_size // fixed)
        elif self.dp < 1 or self.dp * fixed != self.world_size:
            raise ValueError(
                f"dp*tp*pp = {self.dp}*{self.tp}*{self.pp} = {self.dp * fixed} but the world size is "
                f"{self.world_size}; set dp=-1 to infer it (would be {self.world_size / fixed:g})"
            )
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp={self.dp}: expert groups split the data-parallel axis")

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.pp, self.dp, self.tp)

    def coords(self, rank: int) -> dict[Axis, int]:
        """This rank's index along each axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        return {"pp": rank // (self.dp * self.tp), "dp": (rank // self.tp) % self.dp, "tp": rank % self.tp}

    def rank_groups(self, axis: Axis) -> list[list[int]]:
        """Every group of ranks that differ only along ``axis``, in a fixed order."""
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}; expected one of {AXES}")
        groups: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            key = tuple(c[a] for a in AXES if a != axis)
            groups.setdefault(key, []).append(rank)
        return list(groups.values())

    def build(self, timeout: datetime.timedelta = DEFAULT_COMM_TIMEOUT) -> "Mesh":
        """Create the process groups (collective: every rank must call it)."""
        if self.ep > 1:
            raise NotImplementedError(f"ParallelDims.ep={self.ep}: expert parallelism lands with MoE support")
        if not dist.is_initialized():
            raise RuntimeError("ParallelDims.build() needs a process group; call zerospeed.init_distributed() first")
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"ParallelDims.world_size={self.world_size} but the process group has {dist.get_world_size()} ranks"
            )
        comms = {axis: Comm(self._my_group(axis), name=axis, timeout=timeout) for axis in AXES}
        return Mesh(self, comms)

    def _my_group(self, axis: Axis) -> dist.ProcessGroup:
        """Create every group of ``axis`` (all ranks must) and return the one holding this rank.

        Plain ``new_group`` rather than a torch ``DeviceMesh``: a DeviceMesh is cached by torch and
        keeps its groups alive past ``destroy_process_group``, and gloo groups destroyed at
        interpreter teardown abort the process ("terminate called without an active exception").
        """
        groups = self.rank_groups(axis)
        if len(groups) == 1:
            return dist.group.WORLD
        mine, _ = dist.new_subgroups_by_enumeration(groups)
        return mine


@dataclass(frozen=True)
class Mesh:
    """The built groups: ``mesh.comm('dp')`` is the data-parallel :class:`Comm` of this rank."""

    dims: ParallelDims
    comms: Mapping[Axis, Comm]

    def comm(self, axis: Axis) -> Comm:
        return self.comms[axis]

    @property
    def dp(self) -> Comm:
        return self.comms["dp"]
