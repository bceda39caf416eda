"""A tier's storage for one owner of state: nothing for memory tiers, an NVMe run for swapping ones.

An :class:`NvmeRun` owns everything a swapping owner needs — this rank's run directory, the async
I/O handle, and the slabs made in it — and is opened in one place (:meth:`NvmeRun.open`, reached
through :meth:`zerospeed.offload.tier.StateTier.open`), which agrees the run id over the ranks. The
owner (optimizer state, parameter shards, ``zero.Init`` partitions) closes it and everything goes.
:class:`MemoryStorage` answers the same questions (traffic, bytes held) with zeros.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from zerospeed.distributed.comm import Comm
from zerospeed.offload.aio import AsyncIOHandle
from zerospeed.offload.nvme import RunDirectory, SwappedSlabs

if TYPE_CHECKING:
    from zerospeed.offload.tier import NvmeTier


@dataclass(frozen=True)
class IoStats:
    """File traffic since the storage was opened, and the seconds the caller spent blocked on it."""

    bytes_read: int = 0
    bytes_written: int = 0
    read_wait_s: float = 0.0
    write_wait_s: float = 0.0

    def __add__(self, other: IoStats) -> IoStats:
        return IoStats(self.bytes_read + other.bytes_read, self.bytes_written + other.bytes_written,
                       self.read_wait_s + other.read_wait_s, self.write_wait_s + other.write_wait_s)

    def as_dict(self) -> dict[str, float]:
        return {"bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
                "read_wait_s": self.read_wait_s, "write_wait_s": self.write_wait_s}


class TierStorage(Protocol):
    """What an owner of state asks of its tier's storage, whichever the tier."""

    @property
    def swaps(self) -> bool: ...

    def slabs(self, name: str, *, lookahead: int = 1, keep_buffers: int | None = None) -> SwappedSlabs: ...

    def check_room(self, nbytes: int, what: str) -> None: ...

    def io_stats(self) -> IoStats: ...

    def bytes_held(self) -> int: ...

    def close(self) -> None: ...


class MemoryStorage:
    """The storage of a memory tier: state is ordinary tensors, so there is nothing to open, move or close."""

    swaps = False

    def slabs(self, name: str, *, lookahead: int = 1, keep_buffers: int | None = None) -> SwappedSlabs:
        raise AssertionError(f"{name}: a memory tier keeps no slabs (ask the tier whether it swaps first)")

    def check_room(self, nbytes: int, what: str) -> None:
        """Memory is not checked ahead (allocation fails on its own)."""

    def io_stats(self) -> IoStats:
        return IoStats()

    def bytes_held(self) -> int:
        return 0

    def close(self) -> None:
        pass


class NvmeRun:
    """This rank's part of one NVMe run: its directory, its async I/O handle and its slabs."""

    swaps = True

    def __init__(self, *, directory: RunDirectory, aio: AsyncIOHandle):
        self.directory = directory
        self.aio = aio
        self._slabs: list[SwappedSlabs] = []
        self._open = True

    @classmethod
    def open(cls, tier: NvmeTier, comm: Comm, *, purpose: str, what: str) -> NvmeRun:
        """Open this rank's run directory under ``tier.path`` (collective: the ranks agree one run id,
        and fail together when the directory cannot be made on any of them)."""
        run_id = comm.all_gather_object(uuid.uuid4().hex[:12])[0]
        aio = AsyncIOHandle.from_config(tier.aio) if tier.aio is not None else AsyncIOHandle()
        directory: RunDirectory | None = None
        error: OSError | None = None
        try:
            directory = RunDirectory(tier.path, f"{run_id}-{purpose}" if purpose else run_id, comm.rank,
                                     key=tier.key)
        except OSError as exc:
            error = exc
        try:
            comm.fail_together(error, what)
        except BaseException:
            aio.close()
            raise
        assert directory is not None
        return cls(directory=directory, aio=aio)

    def slabs(self, name: str, *, lookahead: int = 1, keep_buffers: int | None = None) -> SwappedSlabs:
        """A new, empty set of slabs in this run's directory (released when the run is closed);
        ``keep_buffers``: free slab buffers kept for reuse (default: ``lookahead + 2``)."""
        slabs = SwappedSlabs([], self.directory, self.aio, lookahead=lookahead, name=name,
                             keep_buffers=keep_buffers)
        self._slabs.append(slabs)
        return slabs

    def check_room(self, nbytes: int, what: str) -> None:
        self.directory.check_room(nbytes, what)

    def io_stats(self) -> IoStats:
        total = IoStats()
        for s in self._slabs:
            total += IoStats(s.bytes_read, s.bytes_written, s.read_wait, s.write_wait)
        return total

    def bytes_held(self) -> int:
        """Bytes of the slabs kept in this run's files."""
        return sum(sum(s.nbytes) for s in self._slabs)

    def close(self) -> None:
        """Stop the I/O threads (pending transfers end first), release the slabs, delete the files."""
        if not self._open:
            return
        self._open = False
        self.aio.close()
        for s in self._slabs:
            s.close()
        self.directory.close()
