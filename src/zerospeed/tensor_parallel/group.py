"""Which tensor-parallel group a layer talks over: a :class:`Comm`, taken from what the user has.

Layers accept the tensor-parallel ``Comm`` itself, a :class:`~zerospeed.distributed.mesh.Mesh`
(its ``tp`` axis), a torch ``ProcessGroup`` (a Megatron ``mpu``'s group, wrapped once), or None
(one rank: the layer is its plain counterpart and issues no collectives).
"""

from __future__ import annotations

from typing import Union

from zerospeed.distributed.comm import Comm
from zerospeed.distributed.groups import ProcessGroup
from zerospeed.distributed.mesh import Mesh

TPGroup = Union[Comm, Mesh, ProcessGroup, None]


def tp_comm(group: TPGroup) -> Comm | None:
    """The tensor-parallel ``Comm`` of ``group`` (None for a single rank)."""
    if group is None or isinstance(group, Comm):
        return group
    if isinstance(group, Mesh):
        return group.comm("tp")
    if isinstance(group, ProcessGroup):
        return Comm(group, name="tp")
    raise TypeError(f"tp_group={group!r}: expected a zerospeed Comm, a Mesh, a torch ProcessGroup or None")


def degree(comm: Comm | None) -> int:
    """Ranks in the tensor-parallel group (1 without one)."""
    return 1 if comm is None else comm.world_size


def rank(comm: Comm | None) -> int:
    """This rank's index in the tensor-parallel group (0 without one)."""
    return 0 if comm is None else comm.rank


def divide(total: int, parts: int, what: str) -> int:
    """``total / parts``, refusing an uneven split with what to change."""
    if total % parts:
        raise ValueError(f"{what} = {total} is not divisible by the tensor-parallel size {parts}; "
                         f"choose a tensor-parallel size that divides it")
    return total // parts
