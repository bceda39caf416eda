"""Asynchronous tensor <-> file I/O for NVMe offload, with DeepSpeed's ``aio_handle`` API.

Pure Python on threads: ``os.preadv`` / ``os.pwrite`` release the GIL, so worker threads keep several
block-sized I/Os in flight while the caller computes. Files are read and written with O_DIRECT where
the file system allows it (offloaded state is far bigger than the page cache, and caching it only
evicts useful pages), falling back to buffered I/O per file system otherwise; unaligned tensors,
offsets and tails are handled (see :mod:`zerospeed.offload.aio_file`), so round trips are bit-exact for
any size and offset.

    with AsyncIOHandle(block_size=1 << 20, queue_depth=8) as aio:
        buf = aio.new_cpu_locked_tensor(n, torch.empty(0))  # page-aligned: zero-copy O_DIRECT
        aio.async_pwrite(buf, "/nvme/swap/a.bin", 0)
        ...                                                 # compute while it is written
        aio.wait()                                          # 1 request done (raises its error, if any)
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal

import torch

from zerospeed.accelerator import get_accelerator
from zerospeed.offload.aio_file import (ALIGN, AioShortReadError, Piece, Scratch, Target, direct_block, io_memory,
                                        move_piece, open_direct, open_for, plan_pieces, preallocate)
from zerospeed.tensor_bytes import tensor_bytes

if TYPE_CHECKING:
    from zerospeed.config.schema import Config
    from zerospeed.config.schema_zero import AioConfig

__all__ = ["AsyncIOHandle", "AioShortReadError", "IORequest", "worker_count"]


def worker_count(queue_depth: int, intra_op_parallelism: int) -> int:
    """Worker threads of a handle: ``queue_depth`` I/Os in flight (at least ``intra_op_parallelism``).

    Threads here mostly wait on the kernel (the GIL is released during every read, write and
    memcpy), so the number of in-flight I/Os, not the CPU count, is what matters. Measured with
    benchmarks/bench_aio.py on a 2-core VM's virtio disk: 4, 8 and 32 threads all reach the device
    (~1.4 GB/s read, ~2.1 GB/s write) within run-to-run noise; 8 (the default depth) was best overall."""
    return max(intra_op_parallelism, queue_depth)


class IORequest:
    """One submitted transfer, waited for on its own (:meth:`AsyncIOHandle.submit_pread`)."""

    def __init__(self, request: "_Request"):
        self._request = request

    def done(self) -> bool:
        return self._request.done.is_set()

    def wait(self) -> int:
        """Block until the transfer ended; the bytes moved, or its error raised."""
        return AsyncIOHandle._finish(self._request)


class _Request:
    """One queued tensor <-> file transfer: its pieces, completion and first error."""

    def __init__(self, target: Target, pieces: list[Piece], tensor: torch.Tensor, dev: int,
                 previous: threading.Event | None, tasks: int):
        self.target, self.pieces, self.tensor, self.dev, self.previous = target, pieces, tensor, dev, previous
        self.tasks = tasks  # worker tasks still running this request
        self._next = 0
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.lock = threading.Lock()

    def claim(self) -> int:
        """The index of the next piece nobody has taken yet (may be past the end)."""
        with self.lock:
            index, self._next = self._next, self._next + 1
        return index


class AsyncIOHandle:
    """Queue tensor reads/writes of files; ``wait()`` collects them (DeepSpeed ``aio_handle`` API).

    ``block_size`` is the size of each I/O; ``queue_depth`` and ``intra_op_parallelism`` bound the
    worker threads (:func:`worker_count`); ``single_submit=True`` moves each request's blocks in order
    on one worker (no parallelism inside a request); ``overlap_events=False`` starts a request only
    after the previous one finished. ``use_direct_io=False`` forces buffered I/O (page cache)."""

    def __init__(self, block_size: int = 1048576, queue_depth: int = 8, intra_op_parallelism: int = 1,
                 single_submit: bool = False, overlap_events: bool = True, *, use_direct_io: bool = True):
        for name, value in (("block_size", block_size), ("queue_depth", queue_depth),
                            ("intra_op_parallelism", intra_op_parallelism)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"AsyncIOHandle {name}={value!r} must be a positive integer (e.g. "
                                 f"block_size=1048576, queue_depth=8, intra_op_parallelism=1)")
        for name, flag in (("single_submit", single_submit), ("overlap_events", overlap_events),
                           ("use_direct_io", use_direct_io)):
            if not isinstance(flag, bool):
                raise ValueError(f"AsyncIOHandle {name}={flag!r} must be True or False")
        self._block_size, self._queue_depth, self._intra = block_size, queue_depth, intra_op_parallelism
        self._single_submit, self._overlap, self._use_direct = single_submit, overlap_events, use_direct_io
        self.num_workers = worker_count(queue_depth, intra_op_parallelism)
        self._pool = ThreadPoolExecutor(max_workers=self.num_workers, thread_name_prefix="zerospeed-aio")
        self._local = threading.local()  # per worker thread: its O_DIRECT scratch buffer
        self._lock = threading.Lock()
        self._pending: list[_Request] = []  # queued by async_* calls, collected by wait()
        self._inflight: set[_Request] = set()
        self._last_done: threading.Event | None = None
        self._direct_ok: dict[int, bool] = {}  # st_dev -> O_DIRECT works on that file system
        self._locked: dict[int, torch.Tensor] = {}  # data_ptr -> tensor from new_cpu_locked_tensor
        self._closed = False

    @classmethod
    def from_config(cls, aio_cfg: AioConfig | Config | Mapping[str, object]) -> AsyncIOHandle:
        """Build from the ``aio`` config section (``load_config(...).aio``), a whole config, or a plain dict."""
        from zerospeed.config.schema import Config
        from zerospeed.config.schema_zero import AioConfig

        if isinstance(aio_cfg, Config):
            aio_cfg = aio_cfg.aio
        if isinstance(aio_cfg, Mapping):
            aio_cfg = AioConfig.model_validate(dict(aio_cfg))
        if not isinstance(aio_cfg, AioConfig):
            raise TypeError(f"AsyncIOHandle.from_config(aio_cfg={aio_cfg!r}) needs the parsed 'aio' section "
                            f"(load_config(...).aio) or a dict of it")
        if aio_cfg.use_gds:
            raise ValueError("aio.use_gds=true (GPUDirect Storage) is not supported by zerospeed; set "
                             "aio.use_gds to false to use host-memory async I/O")
        return cls(aio_cfg.block_size, aio_cfg.queue_depth, aio_cfg.intra_op_parallelism,
                   aio_cfg.single_submit, aio_cfg.overlap_events)

    # getters (DeepSpeed names)
    def get_block_size(self) -> int:
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_intra_op_parallelism(self) -> int:
        return self._intra

    def get_single_submit(self) -> bool:
        return self._single_submit

    def get_overlap_events(self) -> bool:
        return self._overlap

    # I/O
    def async_pread(self, tensor: torch.Tensor, path: str | os.PathLike[str], offset: int = 0) -> int:
        """Queue a read of ``tensor``'s bytes from ``path`` at byte ``offset``; 0 once queued."""
        self._pending_add(self._submit("read", tensor, path, offset))
        return 0

    def async_pwrite(self, tensor: torch.Tensor, path: str | os.PathLike[str], offset: int = 0) -> int:
        """Queue a write of ``tensor``'s bytes to ``path`` at byte ``offset`` (created if missing, never
        truncated); 0 once queued. The tensor must not change until :meth:`wait` returns."""
        self._pending_add(self._submit("write", tensor, path, offset))
        return 0

    def submit_pread(self, tensor: torch.Tensor, path: str | os.PathLike[str], offset: int = 0) -> IORequest:
        """Like :meth:`async_pread`, but the request is waited for on its own (``request.wait()``), not by
        :meth:`wait`: a pipeline can wait for the read it needs now while later ones are in flight."""
        return IORequest(self._submit("read", tensor, path, offset))

    def submit_pwrite(self, tensor: torch.Tensor, path: str | os.PathLike[str], offset: int = 0) -> IORequest:
        """Like :meth:`async_pwrite`, waited for on its own (see :meth:`submit_pread`)."""
        return IORequest(self._submit("write", tensor, path, offset))

    def sync_pread(self, tensor: torch.Tensor, path: str | os.PathLike[str], offset: int = 0) -> int:
        """Read and wait for this request only; returns the bytes read."""
        return self._finish(self._submit("read", tensor, path, offset))

    def sync_pwrite(self, tensor: torch.Tensor, path: str | os.PathLike[str], offset: int = 0) -> int:
        """Write and wait for this request only; returns the bytes written."""
        return self._finish(self._submit("write", tensor, path, offset))

    def wait(self) -> int:
        """Wait for every request queued by ``async_*``; returns how many completed.

        When some failed, all are still waited for and the first failure (in submission order)
        is raised, naming the file, offset and what happened."""
        with self._lock:
            requests, self._pending = self._pending, []
        for req in requests:
            req.done.wait()
        errors = [req.error for req in requests if req.error is not None]
        if errors:
            if len(errors) > 1 and hasattr(errors[0], "add_note"):  # add_note: Python 3.11+
                errors[0].add_note(f"{len(errors) - 1} more of the {len(requests)} requests also failed")
            raise errors[0]
        return len(requests)

    # pinned, page-aligned buffers
    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor | torch.dtype) -> torch.Tensor:
        """A flat tensor of ``num_elem`` elements of ``example_tensor``'s dtype, page-aligned (and pinned when
        an accelerator exists), so O_DIRECT moves its bytes without a bounce copy (DeepSpeed's signature;
        a ``torch.dtype`` is accepted too). Release it early with :meth:`free_cpu_locked_tensor`.

        Without an accelerator to pin for, the memory is :func:`~zerospeed.offload.aio_file.io_memory`
        (huge-page backed where the kernel allows): each block then reaches the disk as one DMA segment
        instead of one per 4 KiB page, which a 1 MiB block into ordinary pages exceeds on virtio disks."""
        dtype = example_tensor.dtype if isinstance(example_tensor, torch.Tensor) else example_tensor
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"new_cpu_locked_tensor example_tensor={example_tensor!r} must be a tensor (its dtype "
                             f"is used) or a torch.dtype")
        if isinstance(num_elem, bool) or not isinstance(num_elem, int) or num_elem < 0:
            raise ValueError(f"new_cpu_locked_tensor num_elem={num_elem!r} must be a non-negative integer")
        tensor = _locked_bytes(num_elem * torch.empty((), dtype=dtype).element_size()).view(dtype)
        with self._lock:
            self._locked[tensor.data_ptr()] = tensor
        return tensor

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        """Release a tensor from :meth:`new_cpu_locked_tensor` now (its storage shrinks to 0 bytes); True.

        As in DeepSpeed, a tensor this handle did not make is left alone and False returned (drop your
        references to free it). Freeing a tensor while an I/O on it is in flight raises instead."""
        ptr = tensor.data_ptr()
        with self._lock:
            mine = self._locked.get(ptr)
            if mine is None or tensor.untyped_storage().data_ptr() != mine.untyped_storage().data_ptr():
                return False
            end = ptr + mine.numel() * mine.element_size()
            if any(r.target.address < end and ptr < r.target.address + r.target.nbytes for r in self._inflight):
                raise ValueError("free_cpu_locked_tensor(tensor): an I/O on this tensor is still in flight; "
                                 "call wait() first")
            del self._locked[ptr]
        if tensor.untyped_storage().resizable():
            tensor.untyped_storage().resize_(0)
        else:  # a mapping (io_memory): this tensor lets go of it, and it is unmapped with its last view
            tensor.set_(torch.empty(0, dtype=tensor.dtype).untyped_storage())
        return True

    # lifetime
    def close(self) -> None:
        """Finish in-flight requests and stop the worker threads; raises errors nobody waited for."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._pool.shutdown(wait=True)

    def __enter__(self) -> AsyncIOHandle:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        self._closed = True  # an exception is already propagating: do not mask it with I/O errors
        self._pool.shutdown(wait=True)

    def __repr__(self) -> str:
        return (f"AsyncIOHandle(block_size={self._block_size}, queue_depth={self._queue_depth}, "
                f"intra_op_parallelism={self._intra}, single_submit={self._single_submit}, "
                f"overlap_events={self._overlap}, workers={self.num_workers})")

    # internals
    def _submit(self, op: Literal["read", "write"], tensor: torch.Tensor, path: str | os.PathLike[str],
                offset: int) -> _Request:
        if self._closed:
            raise RuntimeError("AsyncIOHandle is closed; create a new handle for more I/O")
        memory = _tensor_bytes(tensor, op)
        path = os.fspath(path)
        if not isinstance(path, str):
            raise ValueError(f"path={path!r} must be a str or os.PathLike of str")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset={offset!r} must be a non-negative integer byte offset into {path!r}")
        fd, direct_fd = open_for(op, path), -1
        try:
            dev = os.fstat(fd).st_dev
            direct_fd = self._open_direct(op, path, dev, offset, len(memory))
            if op == "write" and direct_fd >= 0:
                preallocate(fd, path, offset, len(memory))
        except BaseException:
            os.close(fd)
            if direct_fd >= 0:
                os.close(direct_fd)
            raise
        target = Target(op, path, offset, len(memory), tensor.data_ptr(), memory, fd, direct_fd)
        pieces = plan_pieces(len(memory), offset, target.address, self._block_size, direct_fd >= 0)
        tasks = 1 if self._single_submit else min(self.num_workers, len(pieces))
        with self._lock:
            req = _Request(target, pieces, tensor, dev, None if self._overlap else self._last_done, tasks)
            self._last_done = req.done
            self._inflight.add(req)
            if not pieces:  # nothing to move: done now (no worker may complete it a second time)
                self._complete(req)
                return req
            for _ in range(req.tasks):
                self._pool.submit(self._run, req)
        return req

    def _open_direct(self, op: Literal["read", "write"], path: str, dev: int, offset: int, nbytes: int) -> int:
        """An O_DIRECT descriptor when it helps (an aligned middle exists) and the file system allows it."""
        if not self._use_direct or nbytes - (-offset) % ALIGN < ALIGN:
            return -1
        with self._lock:
            if not self._direct_ok.get(dev, True):
                return -1
        fd = open_direct(op, path)
        if fd < 0:
            with self._lock:
                self._direct_ok[dev] = False
        return fd

    def _run(self, req: _Request) -> None:
        """Worker: take the request's next pieces until none are left (or it failed), then check out.

        Pieces are claimed from a shared counter rather than submitted one by one, so the pool's
        per-task cost is paid per worker and request, not per block."""
        try:
            if req.previous is not None:
                req.previous.wait()
            pieces = req.pieces
            while (index := req.claim()) < len(pieces) and req.error is None:
                piece = pieces[index]
                if not move_piece(req.target, piece, self._scratch() if piece.mode == "bounce" else None):
                    with self._lock:
                        self._direct_ok[req.dev] = False
        except BaseException as exc:  # delivered to wait(); a worker thread has nobody else to tell
            with req.lock:
                req.error = req.error or exc
        with req.lock:
            req.tasks -= 1
            last = req.tasks == 0
        if last:
            with self._lock:
                self._complete(req)

    def _complete(self, req: _Request) -> None:
        """Close the request's files and mark it done (caller holds ``self._lock``)."""
        assert not req.done.is_set(), "a request completed twice would close descriptors reused by others"
        os.close(req.target.fd)
        if req.target.direct_fd >= 0:
            os.close(req.target.direct_fd)
        self._inflight.discard(req)
        req.done.set()

    def _scratch(self) -> Scratch:
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = Scratch(direct_block(self._block_size))
        return scratch

    def _pending_add(self, req: _Request) -> None:
        with self._lock:
            self._pending.append(req)

    @staticmethod
    def _finish(req: _Request) -> int:
        req.done.wait()
        if req.error is not None:
            raise req.error
        return req.target.nbytes


def _locked_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` page-aligned bytes for :meth:`AsyncIOHandle.new_cpu_locked_tensor`: pinned by the
    accelerator when it pins, else huge-page backed anonymous memory."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    accelerator = get_accelerator()
    probe = torch.empty(1, dtype=torch.uint8)
    if accelerator.pin_memory(probe) is probe:  # nothing to pin for (CPU): the faster memory for O_DIRECT
        mapping, shift = io_memory(nbytes)
        return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=shift)  # keeps the mapping alive
    base = accelerator.pin_memory(torch.empty(nbytes + ALIGN, dtype=torch.uint8))
    shift = (-base.data_ptr()) % ALIGN
    return base[shift:shift + nbytes]


def _tensor_bytes(tensor: torch.Tensor, op: str) -> memoryview:
    """The tensor's bytes as a writable uint8 memoryview, without a copy (bf16 etc. via a uint8 view)."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"async I/O needs a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"async I/O {op} needs a CPU tensor, got one on {tensor.device}; use a host buffer "
                         f"(AsyncIOHandle.new_cpu_locked_tensor) and copy to/from the device")
    if tensor.layout != torch.strided or not tensor.is_contiguous():
        raise ValueError(f"async I/O {op} needs a contiguous tensor (got shape {tuple(tensor.shape)}, stride "
                         f"{tensor.stride()}); pass tensor.contiguous() (for a read, copy the result back)")
    # not .numpy(), which would pin the storage's size (swapped slabs are released between uses);
    # the request keeps the tensor alive while its I/O runs
    return tensor_bytes(tensor)
