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
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import os
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

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
    was written and (by default) fsyncs, so a file that closed cleanly is complete on disk.
    """

    def __init__(self, path: str | os.PathLike, entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: Mapping[str, str] | None = None):
        self.path = os.fspath(path)
        header, self.entries = build_header(entries, metadata)
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
        self._write_all(raw)
        self._written += raw.nbytes

    def _current_entry(self) -> TensorEntry:
        for entry in self.entries:
            if self._written < entry.end:
                return entry
        raise ValueError(f"{self.path}: every announced tensor is already written")

    def _write_all(self, view: memoryview) -> None:
        view = view.cast("B")
        while view.nbytes:
            n = self._file.write(view[:WRITE_PIECE])
            view = view[n:]
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

    def abort(self) -> None:
        """Close without the completeness check (the caller discards the file)."""
        self._file.close()

    def __enter__(self) -> "StreamingWriter":
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


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
            header = json.loads(os.pread(self._fd, length, 8))
        except (ValueError, OSError) as exc:
            os.close(self._fd)
            raise ValueError(f"{self.path} is not a readable safetensors file: {exc}") from None
        self._data_start = 8 + length
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

    def read_into(self, name: str, out: torch.Tensor, start: int = 0) -> None:
        """Fill ``out`` (contiguous, CPU) with elements ``[start, start + out.numel())`` of tensor
        ``name`` flattened, casting to ``out.dtype`` when the stored dtype differs."""
        entry = self.entries[name]
        if start < 0 or start + out.numel() > entry.numel:
            raise IndexError(f"{self.path}: elements [{start}, {start + out.numel()}) are outside "
                             f"{name!r} ({entry.numel} elements)")
        flat = out.view(-1)
        itemsize = torch.empty(0, dtype=entry.dtype).element_size()
        offset = self._data_start + entry.begin + start * itemsize
        if entry.dtype == out.dtype:
            self._pread_into(tensor_bytes(flat), offset)
            return
        step = max(CHUNK_BYTES // itemsize, 1)
        buffer = torch.empty(min(step, flat.numel()), dtype=entry.dtype)
        for lo in range(0, flat.numel(), step):
            part = buffer[: min(step, flat.numel() - lo)]
            self._pread_into(tensor_bytes(part), offset + lo * itemsize)
            flat[lo: lo + part.numel()].copy_(part)

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        entry = self.entries[name]
        out = torch.empty(entry.shape, dtype=dtype or entry.dtype)
        self.read_into(name, out)
        return out

    def _pread_into(self, buffer, offset: int) -> None:
        view = memoryview(buffer).cast("B")
        while view.nbytes:
            n = os.preadv(self._fd, [view], offset)
            if n <= 0:
                raise OSError(f"{self.path}: short read at byte {offset} ({view.nbytes} bytes missing)")
            view, offset = view[n:], offset + n

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
