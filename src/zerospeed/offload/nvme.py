"""The NVMe tier's mechanics: a per-run directory of swap files, and flat "slabs" that live in them.

A slab is one flat tensor (e.g. a unit's fp32 master followed by its optimizer states) whose bytes
live in a file between uses. Swapped out, its memory goes back to a small pool of page-aligned
buffers (:class:`SlabBuffers`), and every view of it that was attached — optimizer pieces, state
tensors — stays the same Python object: while released its ``.data`` is an empty tensor (so a stray
read is a shape error, not a read of freed memory), and it points into a buffer again once the slab
is read back. A pass
over many slabs is streamed: the next slabs are read while the current one is used, and used ones
are written back, with at most ``lookahead + 2`` slabs resident (DeepSpeed's ``buffer_count`` and
``pipeline_read`` / ``pipeline_write``).

Files live in ``<nvme_path>/zerospeed-<run id>/rank<r>/``: a run never sees another run's files,
the directory is removed when the owner is closed or garbage-collected, and the room a run needs is
checked before anything is written.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import mmap
import os
import shutil
import time
import weakref
from pathlib import Path
from typing import Callable, Generator, Iterable, Iterator, Protocol, Sequence

import torch

from zerospeed.disk_errors import Refusal, refusal
from zerospeed.offload.aio_file import io_memory
from zerospeed.lifecycle import Transitions
from zerospeed.tensor_bytes import format_bytes


class NvmeSpaceError(OSError):
    """The NVMe path cannot hold what a run will write there."""


class RunDirectory:
    """This rank's directory of swap files for one run (removed by :meth:`close` or at garbage collection).

    ``key`` is the config key that set ``root`` (e.g. ``zero_optimization.offload_optimizer.nvme_path``):
    every error about the directory names it, the path and the fix, since the raw ``OSError`` of a
    read-only or full file system names neither."""

    def __init__(self, root: str | os.PathLike[str], run_id: str, rank: int, *, key: str = "nvme_path"):
        base = Path(root)
        self.key = key
        if not base.is_dir():
            raise FileNotFoundError(errno.ENOENT, f"{key} {str(base)!r} does not exist or is not a directory; "
                                                  f"create it or point {key} at a mounted NVMe directory",
                                    str(base))
        self.path = base / f"zerospeed-{run_id}" / f"rank{rank}"
        try:
            self.path.mkdir(parents=True, exist_ok=False)
        except FileExistsError:
            raise FileExistsError(errno.EEXIST, f"{self.path} already exists: another process of this run uses it; "
                                                f"each run and rank needs its own swap directory",
                                  str(self.path)) from None
        except OSError as exc:
            raise unusable_path(key, base, self.path, exc) from None
        self._finalizer = weakref.finalize(self, _remove_run_dir, self.path)

    def file(self, name: str) -> Path:
        return self.path / name

    def explain(self, exc: OSError) -> OSError:
        """``exc`` (a swap file's write failed) with the config key, the path and the fix when the file
        system refused it (read-only, full, not permitted); other errors as they are."""
        said = _refusal(exc, self.key)
        if said is None:
            return exc
        return OSError(exc.errno, f"{exc.strerror or exc}; this run's swap files are under {self.key} "
                                  f"{str(self.path.parent.parent)!r}: {said.cause}; {said.fix}")

    def check_room(self, nbytes: int, what: str) -> None:
        """Raise :class:`NvmeSpaceError` unless the file system has ``nbytes`` free (beyond what this
        directory already holds)."""
        held = sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())
        free = shutil.disk_usage(self.path).free + held
        if nbytes > free:
            full = _refusal(errno.ENOSPC, self.key)
            assert full is not None  # ENOSPC is in the table
            raise NvmeSpaceError(errno.ENOSPC, f"{what} needs {format_bytes(nbytes)} ({nbytes} bytes) under "
                                               f"{self.path.parent.parent} but only {format_bytes(free)} are free "
                                               f"({free} bytes); {full.fix}")

    def close(self) -> None:
        self._finalizer()


def _refusal(exc: BaseException | int, key: str) -> Refusal | None:
    """Why the file system refused a run directory or a swap file under the NVMe path ``key`` names, and
    the fix (the table shared with checkpoint saves: :mod:`zerospeed.disk_errors`)."""
    return refusal(exc, to=f"point {key} at", where="NVMe directory")


def unusable_path(key: str, root: Path, path: Path, exc: OSError) -> OSError:
    """The error for an NVMe path where this run's directory ``path`` cannot be made: ``key`` (the
    config key), the path, the cause and the fix. The same ``OSError`` subclass as ``exc`` (the errno
    picks it: ``PermissionError`` for EACCES...), so callers catching those still do."""
    code = exc.errno if exc.errno is not None else 0
    said = _refusal(exc, key) or Refusal(errno.errorcode.get(code, str(code)), exc.strerror or str(exc),
                                         f"point {key} at a writable local directory")
    return OSError(code, f"{key} {str(root)!r} cannot hold this run's swap files: creating {str(path)!r} failed "
                         f"with {said.name} ({said.cause}); {said.fix}")


def _remove_run_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):
        path.parent.rmdir()  # the run's directory, once every rank's is gone


PAGE = mmap.PAGESIZE


class SlabBuffers:
    """Page-aligned buffers for resident slabs, reused from one swap to the next.

    Why not a fresh tensor per read: slabs are read in and released many times a step, and glibc
    keeps freed chunks below its (self-raising) mmap threshold in the heap, so the process's memory
    creeps far past what is resident (measured: a 0.24B-parameter run peaked at 4.3 GiB this way,
    1.8 GiB with these buffers). Buffers are anonymous mappings (:func:`zerospeed.offload.aio_file.io_memory`:
    private and on huge pages, which reads fill 1.5x faster than shared maps), returned to the system
    when dropped, and page-aligned, so O_DIRECT moves their bytes without a bounce copy. Every buffer is
    as large as the largest slab seen (DeepSpeed's fixed ``buffer_size``, here taken from the plan), so
    any free buffer fits any slab; at most ``keep`` free ones are kept.
    """

    def __init__(self, keep: int):
        self.keep = max(int(keep), 0)
        self.size = PAGE
        self._free: list[torch.Tensor] = []

    def fit(self, nbytes: int) -> None:
        """Make every future buffer at least ``nbytes`` large (the largest slab)."""
        size = -(-max(int(nbytes), 1) // PAGE) * PAGE
        if size > self.size:
            self.size = size
            self._free = []  # too small from now on

    def take(self) -> torch.Tensor:
        """A free buffer (1-D uint8, ``size`` bytes)."""
        if self._free:
            return self._free.pop()
        mapping, offset = io_memory(self.size)
        return torch.frombuffer(mapping, dtype=torch.uint8, count=self.size, offset=offset)

    def give(self, buffer: torch.Tensor) -> None:
        if buffer.numel() >= self.size and len(self._free) < self.keep:
            self._free.append(buffer)

    def clear(self) -> None:
        self._free = []


class IOWait(Protocol):
    """A submitted transfer (:class:`zerospeed.offload.aio.IORequest`)."""

    def done(self) -> bool: ...

    def wait(self) -> int: ...


class IOEngine(Protocol):
    """What slabs ask of the async I/O engine (:class:`zerospeed.offload.aio.AsyncIOHandle`)."""

    def submit_pread(self, tensor: torch.Tensor, path: str, offset: int = 0) -> IOWait: ...

    def submit_pwrite(self, tensor: torch.Tensor, path: str, offset: int = 0) -> IOWait: ...


class SlabState(enum.Enum):
    """Where one slab's values are."""

    OUT = "out"  # in its file only (its views are empty)
    READING = "reading"  # a read into its buffer is in flight
    RESIDENT = "resident"  # in memory
    WRITING = "writing"  # in memory, being written back
    SAVED = "saved"  # written back, its memory not yet released
    UNSAVED = "unsaved"  # in memory, its write-back failed: the memory is the only good copy


_SLAB = Transitions({
    SlabState.OUT: frozenset({SlabState.READING}),
    SlabState.READING: frozenset({SlabState.RESIDENT, SlabState.OUT}),  # landed / failed or unused
    SlabState.RESIDENT: frozenset({SlabState.WRITING, SlabState.OUT}),  # written back / unchanged, dropped
    SlabState.WRITING: frozenset({SlabState.SAVED, SlabState.UNSAVED}),
    SlabState.SAVED: frozenset({SlabState.OUT}),
    SlabState.UNSAVED: frozenset({SlabState.WRITING, SlabState.OUT}),  # written again / dropped (closing)
})


class SwappedSlabs:
    """Flat tensors kept in files of a :class:`RunDirectory` and made resident on demand (see the
    module docstring). Each slab's lifecycle is a :class:`SlabState`, moved only as ``_SLAB`` allows."""

    def __init__(self, slabs: Sequence[torch.Tensor], directory: RunDirectory, aio: IOEngine, *, lookahead: int = 1,
                 name: str = "slab", attach: Sequence[Sequence[torch.Tensor]] | None = None,
                 keep_buffers: int | None = None):
        """``slabs``: the flat, contiguous CPU tensors to manage; ``attach[i]``: views of slab ``i`` to
        keep pointing into it (see :meth:`attach`). Each is written out and released; more can be
        :meth:`add`-ed one at a time (so they need not all be in memory together). ``keep_buffers``:
        free buffers kept for reuse (default ``lookahead + 2``, the most a :meth:`stream` holds)."""
        self.directory = directory
        self.aio = aio
        self.lookahead = max(int(lookahead), 0)
        self.writes_behind = 1  # slabs written back while the next is used (resident: lookahead + 2 at most)
        self.name = name
        self.slabs: list[torch.Tensor] = []  # resident: the slab; swapped out: an empty tensor
        self.numels: list[int] = []
        self.dtypes: list[torch.dtype] = []
        self.buffers = SlabBuffers(keep=self.lookahead + 2 if keep_buffers is None else keep_buffers)
        self._buffer_of: dict[int, torch.Tensor] = {}  # slab index -> the pool buffer it is resident in
        self.nbytes: list[int] = []
        self.kept: list[int] = []  # bytes of each slab's head that write-back stores (the rest: scratch)
        self.paths: list[Path] = []
        self.states: list[SlabState] = []
        self.views: list[list[tuple[torch.Tensor, int, tuple[int, ...]]]] = []
        self._empty: dict[torch.dtype, torch.Tensor] = {}
        self.bytes_read = 0
        self.bytes_written = 0
        self.read_wait = 0.0  # seconds the caller spent blocked waiting for reads / writes
        self.write_wait = 0.0
        directory.check_room(sum(s.numel() * s.element_size() for s in slabs), f"swapping {len(slabs)} {name}s")
        attach = list(attach or [])
        for i, slab in enumerate(slabs):
            self.add(slab, attach[i] if i < len(attach) else (), check_room=False)

    def add(self, slab: torch.Tensor, views: Sequence[torch.Tensor] = (), check_room: bool = True,
            keep_numel: int | None = None) -> int:
        """Manage one more slab (with its attached ``views``): written to its file now and released.
        ``keep_numel``: only the slab's first elements are written back when it is released; the rest
        is a scratch region (e.g. a gradient) written on its own with :meth:`write_region`. Returns
        its index."""
        index = len(self.slabs)
        if slab.dim() != 1 or not slab.is_contiguous() or slab.device.type != "cpu":
            raise ValueError(f"{self.name} {index}: swapped slabs must be flat contiguous CPU tensors, got shape "
                             f"{tuple(slab.shape)} on {slab.device}")
        nbytes = slab.numel() * slab.element_size()
        if check_room:
            self.directory.check_room(nbytes, f"swapping {self.name} {index}")
        self.slabs.append(slab)  # the caller's memory until it is swapped out below
        self.numels.append(slab.numel())
        self.dtypes.append(slab.dtype)
        self.buffers.fit(nbytes)
        self.nbytes.append(nbytes)
        kept = slab.numel() if keep_numel is None else int(keep_numel)
        if not 0 < kept <= slab.numel():
            raise ValueError(f"{self.name} {index}: keep_numel {keep_numel} is outside 1..{slab.numel()}")
        self.kept.append(kept * slab.element_size())
        self.paths.append(self.directory.file(f"{self.name}{index}.bin"))
        self.states.append(SlabState.RESIDENT)
        self.views.append([])
        for view in views:
            self.attach(index, view)
        self.swap_out([index])
        if os.path.getsize(self.paths[index]) < nbytes:  # the scratch tail reads as zeros until written
            os.truncate(self.paths[index], nbytes)
        return index

    def attach(self, index: int, view: torch.Tensor) -> None:
        """Keep ``view`` (a tensor viewing slab ``index``, e.g. an optimizer state) pointing into the
        slab while it is resident, and empty while it is not."""
        slab = self.slabs[index]
        if self.states[index] is SlabState.OUT:
            raise RuntimeError(f"slab {index} is swapped out; attach views while it is resident")
        offset = (view.data_ptr() - slab.data_ptr()) // slab.element_size()
        if view.untyped_storage().data_ptr() != slab.untyped_storage().data_ptr() or not view.is_contiguous() \
                or not 0 <= offset <= slab.numel() - view.numel():
            raise ValueError(f"slab {index}: attached tensors must be contiguous views of the slab")
        self.views[index].append((view, offset, tuple(view.shape)))

    @property
    def resident(self) -> list[bool]:
        """Per slab: does it hold memory now (anything but :attr:`SlabState.OUT`)?"""
        return [state is not SlabState.OUT for state in self.states]

    def lease(self, index: int) -> "SlabLease":
        """Shared residency of slab ``index`` (see :class:`SlabLease`)."""
        return SlabLease(self, index)

    def _move(self, i: int, new: SlabState) -> None:
        self.states[i] = _SLAB.check(f"{self.name} {i}: a slab", self.states[i], new)

    # -- single moves -----------------------------------------------------------------------------
    def _allocate(self, i: int) -> None:
        if i not in self._buffer_of:
            buffer = self._buffer_of[i] = self.buffers.take()
            self.slabs[i] = buffer[: self.nbytes[i]].view(self.dtypes[i])
        slab = self.slabs[i]
        with torch.no_grad():
            for view, offset, shape in self.views[i]:
                view.data = slab[offset: offset + _numel(shape)].view(shape)

    def _release(self, i: int, closing: bool = False) -> None:
        """Give slab ``i``'s memory back (``closing``: whatever its state; every transfer has ended)."""
        if self.states[i] is SlabState.OUT:
            return
        if closing:
            self.states[i] = SlabState.OUT
        else:
            self._move(i, SlabState.OUT)
        dtype = self.dtypes[i]
        empty = self._empty.setdefault(dtype, torch.empty(0, dtype=dtype))
        for view, _, _ in self.views[i]:
            view.data = empty
        buffer = self._buffer_of.pop(i, None)
        if buffer is not None:
            self.buffers.give(buffer)
        else:  # the caller's memory, the first time: freed now (views made of it keep it as their base)
            storage = self.slabs[i].untyped_storage()
            if storage.resizable():
                storage.resize_(0)
        self.slabs[i] = empty

    def swap_in(self, indices: Iterable[int]) -> None:
        """Make slabs resident (read, waited for). If a read fails, the slabs being read are released
        again (their files are unchanged) and the error is raised."""
        wanted = [i for i in indices if self.states[i] is SlabState.OUT]
        requests = [(i, self._start_read(i)) for i in wanted]
        self._wait_reads(requests)

    def swap_out(self, indices: Iterable[int]) -> None:
        """Write slabs back and release them (waited for). A slab whose write failed stays resident
        (its values are the only good copy) and the error is raised."""
        wanted = [i for i in indices if self.states[i] is not SlabState.OUT]
        requests = [(i, self._start_write(i)) for i in wanted]
        self._wait_writes(requests)

    def start_read(self, i: int) -> IOWait | None:
        """Begin making slab ``i`` resident (None when it already is); :meth:`finish_read` waits for it."""
        return self._start_read(i) if self.states[i] is SlabState.OUT else None

    def finish_read(self, i: int, request: IOWait | None) -> None:
        """Wait for a :meth:`start_read` (releasing the slab again if the read failed)."""
        if request is not None:
            self._wait_reads([(i, request)])

    def _start_read(self, i: int) -> IOWait:
        self._move(i, SlabState.READING)
        self._allocate(i)
        try:
            request = self.aio.submit_pread(self.slabs[i], str(self.paths[i]), 0)
        except BaseException:
            self._release(i)  # never marked resident over a (reused) buffer it was not read into
            raise
        self.bytes_read += self.nbytes[i]
        return request

    def _start_write(self, i: int) -> IOWait:
        _SLAB.check(f"{self.name} {i}: a slab", self.states[i], SlabState.WRITING)  # before any byte reaches the file
        head = self.slabs[i][: self.kept[i] // itemsize(self.dtypes[i])]
        try:
            request = self.aio.submit_pwrite(head, str(self.paths[i]), 0)
        except OSError as exc:  # the file cannot be opened for writing: a read-only or full file system
            raise self.directory.explain(exc) from exc
        self.states[i] = SlabState.WRITING
        self.bytes_written += self.kept[i]
        return request

    # -- regions of a swapped-out slab ----------------------------------------------------------
    def write_region(self, i: int, values: torch.Tensor, offset: int) -> IOWait:
        """Start writing ``values`` (contiguous, the slab's dtype) at element ``offset`` of slab ``i``'s
        file, while the slab is swapped out; returns the request (keep ``values`` alive until it is
        waited for)."""
        self._check_region(i, values, offset)
        self.bytes_written += values.numel() * values.element_size()
        try:
            return self.aio.submit_pwrite(values, str(self.paths[i]), offset * values.element_size())
        except OSError as exc:
            raise self.directory.explain(exc) from exc

    def read_region(self, i: int, out: torch.Tensor, offset: int) -> None:
        """Read ``out.numel()`` elements at element ``offset`` of slab ``i``'s file into ``out``."""
        self._check_region(i, out, offset)
        self.bytes_read += out.numel() * out.element_size()
        start = time.perf_counter()
        try:
            self.aio.submit_pread(out, str(self.paths[i]), offset * out.element_size()).wait()
        finally:
            self.read_wait += time.perf_counter() - start

    def start_copy(self, i: int, out: torch.Tensor) -> IOWait:
        """Start reading swapped-out slab ``i``'s stored values into ``out`` (contiguous, the slab's
        dtype and size), leaving the slab itself swapped out: a reader that needs a copy elsewhere
        (a one-rank ZeRO-3 gather, whose full buffer is the shard) skips the slab buffer and the copy
        out of it. :meth:`finish_copy` waits for it."""
        self._check_region(i, out, 0)
        if out.numel() != self.numels[i]:
            raise ValueError(f"{self.name} {i}: a copy needs all {self.numels[i]} elements, got {out.numel()}")
        self.bytes_read += self.nbytes[i]
        return self.aio.submit_pread(out, str(self.paths[i]), 0)

    def finish_copy(self, request: IOWait) -> None:
        """Wait for a :meth:`start_copy` (its error raised; the time counted as read wait)."""
        start = time.perf_counter()
        try:
            request.wait()
        finally:
            self.read_wait += time.perf_counter() - start

    def wait_region_writes(self, requests: Sequence[IOWait]) -> None:
        """Wait for :meth:`write_region` requests (all of them, then raise the first error)."""
        seconds, error = _wait_each([(-1, request) for request in requests])
        self.write_wait += seconds
        if error is not None:
            raise self.directory.explain(error) from error

    def _check_region(self, i: int, values: torch.Tensor, offset: int) -> None:
        numel, dtype = self.numels[i], self.dtypes[i]
        if self.states[i] is not SlabState.OUT:
            raise RuntimeError(f"{self.name} {i} is resident: use the slab in memory, not its file")
        if values.dtype != dtype or not values.is_contiguous() or values.device.type != "cpu" \
                or not 0 <= offset <= numel - values.numel():
            raise ValueError(f"{self.name} {i}: a region must be a contiguous CPU {dtype} tensor inside the "
                             f"slab (offset {offset}, {values.numel()} of {numel} elements)")

    def _wait_reads(self, requests: list[tuple[int, IOWait]]) -> None:
        # a slab partly read is not to be used (its file still holds the values)
        seconds, error = _wait_each(requests, failed=self._release, done=self._landed)
        self.read_wait += seconds
        if error is not None:
            raise error

    def _wait_writes(self, requests: list[tuple[int, IOWait]]) -> None:
        # a slab whose write failed stays resident: its memory is the only good copy now
        seconds, error = _wait_each(requests, failed=self._unsaved, done=self._saved)
        self.write_wait += seconds
        if error is not None:
            raise self.directory.explain(error) from error

    def _landed(self, i: int) -> None:
        self._move(i, SlabState.RESIDENT)

    def _saved(self, i: int) -> None:
        self._move(i, SlabState.SAVED)
        self._release(i)

    def _unsaved(self, i: int) -> None:
        self._move(i, SlabState.UNSAVED)

    # -- passes -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def resident_during(self, indices: Sequence[int], write_back: bool = True) -> Iterator[None]:
        """Slabs resident inside the block (read-only use: ``write_back=False``); afterwards the ones
        this block read are written back (if asked) and released, others stay as they were."""
        loaded = [i for i in indices if self.states[i] is SlabState.OUT]
        self.swap_in(loaded)
        try:
            yield
        finally:
            if write_back:
                self.swap_out(loaded)
            else:
                for i in loaded:
                    self._release(i)

    def stream(self, order: Sequence[int], write_back: bool = True) -> Generator[int, None, None]:
        """Yield each index of ``order`` once its slab is resident; after the consumer moves on, the
        slab is written back (``write_back``) while the next ones are used, and released once written.
        The next ``lookahead`` slabs are read while one is in use: only the read of the slab about
        to be used is waited for, so I/O overlaps the consumer's work; the write of the previous slab
        is waited for once the current one has been used, so at most ``lookahead + 2`` are resident. If the consumer fails, the slab
        it held is released without being written, so its file keeps the values from before the pass."""
        order = list(order)
        ahead = 0  # order[:ahead] have been started reading
        reads: dict[int, IOWait] = {}
        writes: list[tuple[int, IOWait]] = []
        try:
            for pos, i in enumerate(order):
                while ahead < len(order) and ahead <= pos + self.lookahead:
                    j = order[ahead]
                    if self.states[j] is SlabState.OUT:
                        reads[j] = self._start_read(j)
                    ahead += 1
                if i in reads:
                    self._wait_reads([(i, reads.pop(i))])
                # asked once per write: one that completes between two asks would be neither waited
                # for nor kept, and its slab would stay in memory, written, until written again
                landed = [(j, w, w.done()) for j, w in writes]
                finished = [(j, w) for j, w, done in landed if done]
                writes = [(j, w) for j, w, done in landed if not done]
                self._wait_writes(finished)  # complete already: releases them (raises a failed write)
                yield i
                if write_back:
                    writes.append((i, self._start_write(i)))
                    if len(writes) > self.writes_behind:  # bounded memory: wait for the oldest write
                        self._wait_writes([writes.pop(0)])
                else:
                    self._release(i)
            self._wait_writes(writes)
            writes = []
        finally:
            for i, request in reads.items():  # read ahead, never used
                with contextlib.suppress(OSError):
                    request.wait()
                self._release(i)
            pending, writes = writes, []
            with contextlib.suppress(OSError):  # an error of its own is already on its way up
                self._wait_writes(pending)
            for i in order:  # held by the consumer when it failed (written ones are out, or unsaved)
                if self.states[i] is SlabState.RESIDENT:
                    self._release(i)

    def forget(self, i: int) -> None:
        """Slab ``i`` is no longer needed: release it and delete its file (its disk space is needed)."""
        self._release(i)
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.paths[i])

    def discard(self, i: int) -> None:
        """Release a resident slab without writing it (unchanged since it was read)."""
        self._release(i)

    def close(self) -> None:
        """Release every slab (the files go with the run directory, removed by its owner)."""
        for i in range(len(self.slabs)):
            self._release(i, closing=True)
        self.buffers.clear()


def _wait_each(requests: Iterable[tuple[int, IOWait]], failed: Callable[[int], None] = lambda i: None,
               done: Callable[[int], None] = lambda i: None) -> tuple[float, OSError | None]:
    """Wait for every ``(slab index, request)``, even after one failed, calling ``failed(i)`` or
    ``done(i)`` for each; returns the seconds spent waiting and the first error (for the caller to
    raise once it has counted the time)."""
    first: OSError | None = None
    start = time.perf_counter()
    for i, request in requests:
        try:
            request.wait()
        except OSError as exc:
            first = first or exc
            failed(i)
        else:
            done(i)
    return time.perf_counter() - start, first


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


class LeaseState(enum.Enum):
    """Whether a :class:`SlabLease` is held, and whether a holder changed the slab."""

    FREE = "free"  # no holder: the slab is in its file
    HELD = "held"  # held, unchanged since it was read
    CHANGED = "changed"  # changed by a holder: written back at the last release (stays, unheld, if that failed)


_LEASE = Transitions({
    LeaseState.FREE: frozenset({LeaseState.HELD}),
    LeaseState.HELD: frozenset({LeaseState.CHANGED, LeaseState.FREE}),
    LeaseState.CHANGED: frozenset({LeaseState.FREE}),
})


class SlabLease:
    """Shared residency of one slab: the first holder reads it in, the last one releases it (writing
    it back only if some holder changed it). Stage-3 parameter shards on NVMe are held by a gather
    (until its all-gather is complete) and by whatever updates them (the optimizer step, a load)."""

    def __init__(self, slabs: SwappedSlabs, index: int):
        self.slabs, self.index = slabs, index
        self.holders = 0
        self.state = LeaseState.FREE
        self._read: IOWait | None = None  # a read in flight (started by ``acquire(wait=False)``)

    @property
    def dirty(self) -> bool:
        """A holder changed the slab since it was read (it is written back at the last release)."""
        return self.state is LeaseState.CHANGED

    def _move(self, new: LeaseState) -> None:
        if new is not self.state:
            self.state = _LEASE.check(f"{self.slabs.name} {self.index}: a slab lease", self.state, new)

    def acquire(self, wait: bool = True) -> None:
        """Hold the slab, starting its read unless it is resident or being read (also after an earlier
        read failed). ``wait=False`` returns at once (a prefetch: the read overlaps whatever comes
        next); :meth:`ready` waits for it. A failed read raises here (or in :meth:`ready`) and leaves
        the slab swapped out, its file unchanged."""
        if self._read is None:
            self._read = self.slabs.start_read(self.index)
        self.holders += 1
        if self.state is LeaseState.FREE:
            self._move(LeaseState.HELD)
        if wait:
            try:
                self.ready()
            except BaseException:
                self.holders -= 1
                if self.holders == 0 and self.state is LeaseState.HELD:
                    self._move(LeaseState.FREE)
                raise

    def copy_into(self, out: torch.Tensor) -> IOWait | None:
        """Start reading the slab's stored values into ``out`` without making the slab resident, when
        its file is current (no holder, nothing resident); None otherwise (acquire it instead)."""
        if self.state is not LeaseState.FREE or self.slabs.states[self.index] is not SlabState.OUT:
            return None
        return self.slabs.start_copy(self.index, out)

    def finish_copy(self, request: IOWait) -> None:
        self.slabs.finish_copy(request)

    def ready(self) -> None:
        """Wait until the slab is resident (its read, if one is in flight, has completed)."""
        if self._read is not None:
            request, self._read = self._read, None
            self.slabs.finish_read(self.index, request)

    def release(self, changed: bool = False) -> None:
        if self.holders <= 0:
            raise RuntimeError(f"{self.slabs.name} {self.index}: released more often than acquired")
        if changed:
            self._move(LeaseState.CHANGED)
        self.holders -= 1
        if self.holders == 0:
            self.ready()  # a read still in flight lands before its buffer is given back
            if self.state is LeaseState.CHANGED:
                self.slabs.swap_out([self.index])  # raises when it failed: stays CHANGED (memory: the only copy)
            else:
                self.slabs.discard(self.index)
            self._move(LeaseState.FREE)

    @contextlib.contextmanager
    def held(self, write_back: bool = False) -> Iterator[None]:
        """Resident inside the block; ``write_back``: the block changes it (written back at the end)."""
        self.acquire()
        failed = True
        try:
            yield
            failed = False
        finally:
            self.release(changed=write_back and not failed)
