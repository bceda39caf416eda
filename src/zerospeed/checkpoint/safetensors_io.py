"""Streaming reads and writes of safetensors files, a tensor slice at a time.

The safetensors library writes a whole ``dict`` of tensors that must not share storage and reads
through a memory map, which keeps every page it touched resident. A checkpoint wants the
opposite: write many views of a few flat buffers straight from memory, in large sequential
writes, and read any element range of any tensor into a caller's buffer with ``pread`` so the
peak memory of a consolidation is one chunk. The files are plain safetensors (8-byte header
length, JSON header, raw little-endian data) and open with ``safetensors.safe_open``.

Writes go out "write-behind": every ``WRITE_PIECE`` bytes the writer asks the kernel to start
writing that range to disk (``sync_file_range``), waits for the range ``WRITE_WINDOW`` pieces back
and drops it from the page cache. The disk then works while later bytes are still being copied in,
instead of everything waiting for one ``fsync`` at the end (a plain write + fsync runs the two in
series: about half the bandwidth on this machine's disk), the dirty memory of a save stays bounded,
and a checkpoint does not push the training's useful pages out of the page cache.

Integrity: a writer asked for ``checksums`` keeps a CRC-32 (:func:`~zerospeed.checkpoint.checksum.crc32`, zlib's values) of every tensor's bytes
and of the header, computed on the bytes as they are handed to the kernel (no second pass over the
data, no read back); a reader computes the same over the bytes it ``pread``s (:meth:`read_into`'s
``crc``), so a checkpoint can be checked against its manifest while it is loaded. The CRC of each
piece runs on a helper thread while the caller's thread writes or reads the next (:class:`_Crcs`;
the CRC releases the GIL), so it adds little as long as it is faster than the disk and a
second CPU is there for it (:data:`CRC_THREAD`).
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch

from zerospeed.checkpoint import checksum
from zerospeed.tensor_bytes import tensor_bytes

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
DTYPES: dict[str, torch.dtype] = {name: dtype for dtype, name in DTYPE_NAMES.items()}
_ALIGN = 8  # the header is padded so the data starts 8-byte aligned, as the reference writer does
CHUNK_BYTES = 32 * 1024 * 1024  # reads that cast go through a buffer of at most this size
WRITE_PIECE = 32 * 1024 * 1024  # write-behind: start writing back every this many bytes ...
WRITE_WINDOW = 4  # ... and wait for (then drop from the page cache) the piece this many pieces back
_SYNC_FILE_RANGE_WAIT_BEFORE, _SYNC_FILE_RANGE_WRITE, _SYNC_FILE_RANGE_WAIT_AFTER = 1, 2, 4
OVERLAP_BYTES = 1024 * 1024  # a CRC-32 update of at least this many bytes runs beside the I/O ...
# ... when the process has a second usable CPU for it. Measured (BENCHMARKS.md, "Checkpoint checksums"; 1 GB,
# bench_checkpoint.py --crc-thread both) on a 2-core machine loaded by other jobs: threaded against inline, the
# load took 7-29% less time and the save 0-11% less (3 runs); pinned to 1 CPU the two were within the noise
# (load +11%, save -4% threaded), so one CPU keeps them inline.
CRC_THREAD = len(os.sched_getaffinity(0)) > 1 if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1) > 1


@functools.lru_cache(maxsize=1)
def _sync_file_range():
    """libc's ``sync_file_range`` (Linux), or None where there is none."""
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file: its dtype, shape and the byte range of its data."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # byte offsets relative to the start of the data section
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class _Crcs:
    """Running CRC-32s (one per tensor), updated in order on one helper thread while the caller's
    thread does the I/O of the next piece. Updates smaller than :data:`OVERLAP_BYTES` run inline
    (after the queued ones); :meth:`wait` must return before the caller reuses the bytes it handed in."""

    def __init__(self, values: list[int]):
        self.values = values
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None

    def update(self, index: int, data: memoryview) -> None:
        if data.nbytes < OVERLAP_BYTES or not CRC_THREAD:
            self.wait()
            self._update(index, data)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="zerospeed-crc32")
        self._pending = self._pool.submit(self._update, index, data)  # one worker: runs in order

    def _update(self, index: int, data: memoryview) -> None:
        self.values[index] = checksum.crc32(data, self.values[index])

    def wait(self) -> None:
        if self._pending is not None:  # the last queued update; the single worker ran the others before it
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


@dataclass(frozen=True)
class FileChecksums:
    """What a checkpoint's manifest records of a written safetensors file: the CRC-32 of its header
    and of each tensor's bytes by name."""

    header: int
    tensors: dict[str, int]


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"safetensors cannot store dtype {dtype}") from None


def build_header(entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: Mapping[str, str] | None = None) -> tuple[bytes, list[TensorEntry]]:
    """The encoded header for tensors written back to back in this order, and their entries."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    out, offset = [], 0
    for name, dtype, shape in entries:
        if name in header:
            raise ValueError(f"tensor name {name!r} appears twice in one safetensors file")
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        header[name] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        out.append(TensorEntry(name, dtype, tuple(shape), offset, offset + nbytes))
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(8 + len(encoded)) % _ALIGN)
    return len(encoded).to_bytes(8, "little") + encoded, out


class StreamingWriter:
    """Writes the tensors announced up front, in order, from any number of chunks each.

    ``write(chunk)`` appends raw elements of the current tensor; :meth:`close` checks every byte
    was written and (by default) fsyncs, so a file that closed cleanly is complete on disk. With
    ``checksums`` it also keeps the CRC-32 of the header (:attr:`header_crc32`) and of every tensor
    (:attr:`checksums`), over the very bytes it writes.
    """

    def __init__(self, path: str | os.PathLike, entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: Mapping[str, str] | None = None, *, checksums: bool = False):
        self.path = os.fspath(path)
        header, self.entries = build_header(entries, metadata)
        self.header_crc32: int | None = checksum.crc32(header) if checksums else None
        self._crcs: _Crcs | None = _Crcs([0] * len(self.entries)) if checksums else None  # crc32(b"") == 0
        self._entry = 0  # index of the tensor being written
        self._file = open(self.path, "wb", buffering=0)
        self._sync_range = _sync_file_range()
        self._kicked = 0  # file offset up to which write-back was started
        self._in_flight: list[tuple[int, int]] = []  # (offset, length) started but not yet waited for
        self.bytes_written = 0
        self._write_all(memoryview(header))
        self._total = self.entries[-1].end if self.entries else 0
        self._written = 0

    def write(self, chunk: torch.Tensor) -> None:
        """Append ``chunk``'s elements (any shape; its dtype must be the current tensor's)."""
        if chunk.numel() == 0:
            return
        expected = self._current_entry()
        if chunk.dtype != expected.dtype:
            raise TypeError(f"{self.path}: tensor {expected.name!r} is {expected.dtype}, got a {chunk.dtype} chunk")
        data = chunk.detach().reshape(-1)
        if data.device.type != "cpu":
            data = data.cpu()
        data = data.contiguous()
        raw = tensor_bytes(data)
        if self._written + raw.nbytes > expected.end:
            raise ValueError(f"{self.path}: tensor {expected.name!r} overflows its "
                             f"{expected.end - expected.begin} bytes")
        try:
            self._write_all(raw, self._entry)
        finally:
            if self._crcs is not None:
                self._crcs.wait()  # the caller may reuse ``chunk`` once this returns
        self._written += raw.nbytes

    @property
    def checksums(self) -> FileChecksums:
        """The CRC-32s of the header and of each tensor's bytes (complete once every tensor is written)."""
        if self._crcs is None or self.header_crc32 is None:
            raise ValueError(f"{self.path}: this StreamingWriter was made without checksums=True")
        self._crcs.wait()
        return FileChecksums(self.header_crc32,
                             {entry.name: crc for entry, crc in zip(self.entries, self._crcs.values, strict=True)})

    def _current_entry(self) -> TensorEntry:
        while self._entry < len(self.entries) and self._written >= self.entries[self._entry].end:
            self._entry += 1  # finished (or empty) tensors
        if self._entry == len(self.entries):
            raise ValueError(f"{self.path}: every announced tensor is already written")
        return self.entries[self._entry]

    def _write_all(self, view: memoryview, entry: int | None = None) -> None:
        """Write ``view`` in pieces; with ``entry``, each piece's CRC-32 is added to that tensor's on the
        helper thread while the piece is written."""
        view = view.cast("B")
        while view.nbytes:
            piece, view = view[:WRITE_PIECE], view[WRITE_PIECE:]
            if entry is not None and self._crcs is not None:
                self._crcs.update(entry, piece)
            while piece.nbytes:  # all of it, even after a short write
                n = self._file.write(piece)
                piece = piece[n:]
                self.bytes_written += n
                if self.bytes_written - self._kicked >= WRITE_PIECE:
                    self._write_behind()

    def _write_behind(self) -> None:
        """Start writing back what was written since the last call; wait for and drop old pieces."""
        if self._sync_range is None:
            return
        fd = self._file.fileno()
        start, length = self._kicked, self.bytes_written - self._kicked
        if self._sync_range(fd, start, length, _SYNC_FILE_RANGE_WRITE) != 0:
            self._sync_range = None  # e.g. a file system without it: the fsync at close does it all
            return
        self._kicked = self.bytes_written
        self._in_flight.append((start, length))
        while len(self._in_flight) > WRITE_WINDOW:
            start, length = self._in_flight.pop(0)
            self._sync_range(fd, start, length, _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE
                             | _SYNC_FILE_RANGE_WAIT_AFTER)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)

    def close(self, fsync: bool = True) -> None:
        if self._file.closed:
            return
        try:
            if self._written != self._total:
                raise ValueError(f"{self.path}: {self._written} of {self._total} data bytes written")
            if fsync:
                os.fsync(self._file.fileno())
        finally:
            self._file.close()
            if self._crcs is not None:
                self._crcs.close()

    def abort(self) -> None:
        """Close without the completeness check (the caller discards the file)."""
        self._file.close()
        if self._crcs is not None:
            self._crcs.close()

    def __enter__(self) -> "StreamingWriter":
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


def pread_into(fd: int, path: str, buffer, offset: int) -> None:
    """Fill ``buffer`` with the bytes of the open file ``fd`` (named ``path`` in errors) from ``offset``,
    all of them even after a short read; OSError at the end of the file."""
    view = memoryview(buffer).cast("B")
    while view.nbytes:
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise OSError(f"{path}: short read at byte {offset} ({view.nbytes} bytes missing)")
        view, offset = view[n:], offset + n


def crc32_range(pread: Callable[[memoryview, int], None], start: int, end: int, crc: int = 0) -> int:
    """The CRC-32 of bytes ``[start, end)`` continued from ``crc`` (``zlib.crc32``'s running value, as :func:`~zerospeed.checkpoint.checksum.crc32` takes it),
    read by ``pread(buffer, offset)`` through one buffer of at most ``CHUNK_BYTES``: the one loop behind
    :meth:`SafetensorsReader.checksum` and the checks of whole files (the pickled states), so a file
    of any size is checked in bounded memory."""
    if end <= start:
        return crc
    buffer = memoryview(bytearray(min(end - start, CHUNK_BYTES)))
    for lo in range(start, end, CHUNK_BYTES):
        piece = buffer[: min(CHUNK_BYTES, end - lo)]
        pread(piece, lo)
        crc = checksum.crc32(piece, crc)
    return crc


class SafetensorsReader:
    """Random access to a safetensors file's tensors by element range, without a memory map."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            size = os.fstat(self._fd).st_size
            head = os.pread(self._fd, 8, 0)
            if len(head) != 8:
                raise ValueError("shorter than a safetensors header")
            length = int.from_bytes(head, "little")
            if length > size - 8:
                raise ValueError(f"header length {length} exceeds the file size {size}")
            encoded = os.pread(self._fd, length, 8)
            header = json.loads(encoded)
        except (ValueError, OSError) as exc:
            os.close(self._fd)
            raise ValueError(f"{self.path} is not a readable safetensors file: {exc}") from None
        self._data_start = 8 + length
        self.header_crc32 = checksum.crc32(encoded, checksum.crc32(head))  # as StreamingWriter's, over the same bytes
        self.metadata: dict[str, str] = header.pop("__metadata__", {}) or {}
        self.entries: dict[str, TensorEntry] = {}
        for name, info in header.items():
            begin, end = info["data_offsets"]
            self.entries[name] = TensorEntry(name, DTYPES[info["dtype"]], tuple(info["shape"]), begin, end)
        data_end = max((e.end for e in self.entries.values()), default=0)
        if self._data_start + data_end > size:
            os.close(self._fd)
            raise ValueError(f"{self.path} is truncated: its header needs {self._data_start + data_end} bytes, "
                             f"the file has {size}")

    def read_into(self, name: str, out: torch.Tensor, start: int = 0, crc: int | None = None) -> int | None:
        """Fill ``out`` (contiguous, CPU) with elements ``[start, start + out.numel())`` of tensor
        ``name`` flattened, casting to ``out.dtype`` when the stored dtype differs. Given ``crc``,
        returns it continued over the stored bytes just read (``checksum.crc32(data, crc)``: pass 0 at
        the tensor's first byte), so a caller checks a tensor read in order without reading it twice."""
        entry = self.entries[name]
        if start < 0 or start + out.numel() > entry.numel:
            raise IndexError(f"{self.path}: elements [{start}, {start + out.numel()}) are outside "
                             f"{name!r} ({entry.numel} elements)")
        flat = out.view(-1)
        itemsize = torch.empty(0, dtype=entry.dtype).element_size()
        offset = self._data_start + entry.begin + start * itemsize
        if entry.dtype == out.dtype:
            raw = tensor_bytes(flat)
            if crc is None:
                self._pread_into(raw, offset)
                return None
            crcs = _Crcs([crc])
            size = max(OVERLAP_BYTES, min(CHUNK_BYTES, raw.nbytes // 4))  # a few pieces, to overlap
            try:  # each piece's CRC on the helper thread while the next is read
                for lo in range(0, raw.nbytes, size):
                    piece = raw[lo: lo + size]
                    self._pread_into(piece, offset + lo)
                    crcs.update(0, piece)
            finally:
                crcs.close()
            return crcs.values[0]
        step = max(CHUNK_BYTES // itemsize, 1)
        buffer = torch.empty(min(step, flat.numel()), dtype=entry.dtype)
        cast_crcs = None if crc is None else _Crcs([crc])
        try:
            for lo in range(0, flat.numel(), step):
                part = buffer[: min(step, flat.numel() - lo)]
                raw = tensor_bytes(part)
                if cast_crcs is not None:
                    cast_crcs.wait()  # the buffer is read again: the last piece's CRC must be done
                self._pread_into(raw, offset + lo * itemsize)
                if cast_crcs is not None:
                    cast_crcs.update(0, raw)  # beside the cast copy, which only reads the buffer too
                flat[lo: lo + part.numel()].copy_(part)
        finally:
            if cast_crcs is not None:
                cast_crcs.close()
        return None if cast_crcs is None else cast_crcs.values[0]

    def checksum(self, name: str, start: int = 0, crc: int = 0) -> int:
        """The CRC-32 of tensor ``name``'s stored bytes from element ``start`` on, continued from ``crc``
        (so a caller that read elements ``[0, start)`` with :meth:`read_into`'s ``crc`` finishes the
        tensor's CRC without reading those again), read by :func:`crc32_range`."""
        entry = self.entries[name]
        itemsize = torch.empty(0, dtype=entry.dtype).element_size()
        return crc32_range(self._pread_into, self._data_start + entry.begin + start * itemsize,
                           self._data_start + entry.end, crc)

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        entry = self.entries[name]
        out = torch.empty(entry.shape, dtype=dtype or entry.dtype)
        self.read_into(name, out)
        return out

    def _pread_into(self, buffer, offset: int) -> None:
        pread_into(self._fd, self.path, buffer, offset)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
