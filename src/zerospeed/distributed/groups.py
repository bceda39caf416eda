"""Process groups: whether one is up, who this rank is in it, making and destroying groups.

With :mod:`zerospeed.distributed.comm` (the collectives) and :mod:`zerospeed.distributed.env`
(starting the default group) this is the only code that talks to ``torch.distributed``; the mesh
and ``zerospeed.comm`` go through it, so a backend other than torch's plugs in here.
"""

from __future__ import annotations

from typing import Sequence

import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


def is_initialized() -> bool:
    """Whether the default process group is up."""
    return dist.is_available() and dist.is_initialized()


def world_group() -> ProcessGroup:
    """The default group (every rank)."""
    return _default_group("world_group()")


def group_rank(group: ProcessGroup | None = None) -> int:
    """This rank's index in ``group`` (None: the default group); -1 when it is not a member."""
    _require_initialized("get_rank()")
    return dist.get_rank(group)


def group_size(group: ProcessGroup | None = None) -> int:
    """How many ranks ``group`` has (None: the default group)."""
    _require_initialized("get_world_size()")
    return dist.get_world_size(group)


def group_members(group: ProcessGroup | None = None) -> list[int]:
    """The global ranks of ``group``, in group-rank order."""
    _require_initialized("group_members()")
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def new_group(ranks: Sequence[int] | None = None) -> ProcessGroup:
    """A new group of ``ranks`` (None: all). Every rank of the job must call this, in the same order."""
    _require_initialized("new_group()")
    return dist.new_group(None if ranks is None else list(ranks))


def new_partition(groups: Sequence[Sequence[int]]) -> ProcessGroup:
    """Create every group of a partition of the ranks and return the one holding this rank.

    Collective: every rank creates every group, in the same order (torch requires it). A partition
    into one group of every rank is the default group itself, so nothing is created.
    """
    _require_initialized("new_partition()")
    if len(groups) == 1 and sorted(groups[0]) == list(range(dist.get_world_size())):
        return _default_group("new_partition()")
    mine, _ = dist.new_subgroups_by_enumeration([list(g) for g in groups])
    return mine


def destroy_group(group: ProcessGroup | None = None) -> None:
    """Destroy ``group``; None destroys every group and the default one (as torch does)."""
    if is_initialized():
        dist.destroy_process_group(group)


def _require_initialized(what: str) -> None:
    if not is_initialized():
        raise RuntimeError(f"{what} needs a process group; call zerospeed.init_distributed() "
                           f"(or zerospeed.comm.init_distributed()) first")


def _default_group(what: str) -> ProcessGroup:
    """The default group; torch types it Optional (None before init), so check it is up."""
    _require_initialized(what)
    world = dist.group.WORLD
    if world is None:  # is_initialized() said yes, so torch has a default group; belt and braces
        raise RuntimeError(f"{what}: torch.distributed reports no default process group")
    return world
