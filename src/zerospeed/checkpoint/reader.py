"""Read any element range of any parameter's saved state, whatever topology wrote it.

A checkpoint's fragments (``kind``, ``param``, ``[start, end)``, file, key) tile each parameter's
flattened values; :meth:`CheckpointSet.read_range` finds the fragments overlapping a requested
range and ``pread``s just those bytes, so a rank loading a shard reads only that shard, and a
consolidation holds one chunk at a time.

A checkpoint is read as seen by a model of a given tensor-parallel layout (``layout``; default:
an unsplit model): ``params`` give the shapes that model holds, and ``read_range`` ranges of its
slices, mapped onto the stored parts by :mod:`~zerospeed.checkpoint.tp_reshard`.

Every byte handed out is checked against the manifest's CRC-32s first (checkpoints whose manifest
names a ``checksum``): a safetensors header when its file is opened, a stored tensor when it is
first read (over the bytes read, when the read takes it whole; otherwise the whole stored tensor is
checked before the part is read, whose pages that leaves in the page cache), the pickled files in
:meth:`CheckpointSet.checked_file`. A mismatch raises :func:`~zerospeed.checkpoint.layout.damaged`.

A reader that goes through stored tensors chunk by chunk, in order (``zerospeed convert``), says so
with :meth:`CheckpointSet.reading_in_order`: there a part read at the tensor's first byte, and each
read continuing where the last one ended, extend a running CRC-32 instead, checked with the read that
reaches the tensor's end (so each byte is read once; the caller relies on none of the tensor's parts
before that read has returned), and a tensor left unfinished is checked when the block ends. Out of that block (a
load at another topology reads a rank's part and never the rest) a part is checked whole first.
"""

from __future__ import annotations

import bisect
import contextlib
import os
from collections import defaultdict
from typing import Any, Iterator

import torch

from zerospeed.checkpoint.layout import MANIFEST, CheckpointError, check_crc, damaged, read_manifest
from zerospeed.checkpoint.safetensors_io import SafetensorsReader, crc32_range, pread_into
from zerospeed.checkpoint.tp_reshard import (ReadSplit, StoredTP, local_shape, part_name, plan_reads, reading_split,
                                             run_reads)
from zerospeed.tensor_parallel.layout import TPLayout


class CheckpointSet:
    """One tag directory: its manifest and lazily opened rank files, read by a model of ``layout``."""

    def __init__(self, path: str, layout: TPLayout | None = None):
        self.path = path
        self.manifest: dict[str, Any] = read_manifest(path)
        self.tp = StoredTP.of(self.manifest)
        self.layout = layout if layout is not None else TPLayout(1, 0)
        self.full_params: dict[str, dict[str, Any]] = {p["name"]: p for p in self.manifest["params"]}
        self._splits: dict[str, ReadSplit | None] = {}
        self._layout_errors: list[str] = []
        for name, info in self.full_params.items():
            try:
                self._splits[name] = reading_split(name, info["shape"], self.tp, self.layout, path)
            except CheckpointError as exc:
                self._layout_errors.append(str(exc))
                self._splits[name] = None
        # as this model holds them: the slice's shape of every split parameter
        self.params: dict[str, dict[str, Any]] = {
            name: dict(info, shape=list(local_shape(info["shape"], self._splits[name])))
            for name, info in self.full_params.items()}
        index: dict[tuple[str, str], list[tuple[int, int, str, str]]] = defaultdict(list)
        for frag in self.manifest["fragments"]:
            index[(frag["kind"], frag["param"])].append((frag["start"], frag["end"], frag["file"], frag["key"]))
        self._index = {key: sorted(frags) for key, frags in index.items()}
        self._starts = {key: [f[0] for f in frags] for key, frags in self._index.items()}
        # (file, stored tensor) -> its CRC-32 (None if missing: refused when read); None for the manifest of a
        # release that recorded none
        self.checked = "checksum" in self.manifest
        self._crcs: dict[tuple[str, str], int | None] | None = (
            {(frag["file"], frag["key"]): frag.get("crc32") for frag in self.manifest["fragments"]}
            if self.checked else None)
        self._verified: set[tuple[str, str]] = set()
        # under reading_in_order: (file, stored tensor) -> (the element its next read must start at, the CRC-32
        # of its bytes before that element), for tensors read in part so far
        self._in_order = False
        self._running: dict[tuple[str, str], tuple[int, int]] = {}
        self._readers: dict[str, SafetensorsReader] = {}
        self._aliases: dict[str, str] = dict(self.manifest.get("aliases", {}))

    def canonical(self, name: str) -> str | None:
        """The name ``name``'s values are stored under (tied parameters are stored once, under the first
        name the saving model gave them, which may be another name in the loading model); None if absent."""
        if name in self.params:
            return name
        return self._aliases.get(name)

    def check_layout(self) -> None:
        """Refuse a parameter split along another dimension than this model splits it."""
        if self._layout_errors:
            raise CheckpointError("; ".join(self._layout_errors[:4]))

    def _stored(self, param: str) -> str:
        return self.canonical(param) or param

    def _part0(self, param: str) -> str:
        """The stored name of ``param``'s first part (itself when the checkpoint does not split it)."""
        return self.tp.stored_name(self._stored(param))

    def has(self, kind: str, param: str) -> bool:
        return (kind, self._part0(param)) in self._index

    def kinds(self, param: str) -> list[str]:
        stored = self._part0(param)
        return sorted(kind for kind, name in self._index if name == stored)

    def stored_dtype(self, kind: str, param: str) -> torch.dtype:
        frags = self._index.get((kind, self._part0(param)))
        if not frags:  # nothing stored (an empty parameter): the manifest's dtype
            info = self.params.get(self._stored(param))
            if info is None:
                raise CheckpointError(f"{self.path} has no {kind!r} values for {param!r}")
            return torch.float32 if info["dtype"] in ("float16", "bfloat16") else getattr(torch, info["dtype"])
        _, _, file, key = frags[0]
        return self._reader(file).entries[key].dtype

    def read_range(self, kind: str, param: str, start: int, end: int, out: torch.Tensor) -> None:
        """Fill ``out`` (``end - start`` elements) with elements ``[start, end)`` of ``param``'s ``kind``
        (of this model's slice of it, when tensor parallelism splits it on either side)."""
        if end == start:
            return
        name = self._stored(param)
        split = self._splits.get(name)
        if split is None:
            return self._read_stored(kind, name, start, end, out)
        if out.numel() != end - start:
            raise ValueError(f"read_range: out has {out.numel()} elements for [{start}, {end})")
        reads = plan_reads(self.full_params[name]["shape"], split.dim, split.old_degree, split.new_degree,
                           split.new_rank, start, end, fused=split.fused)
        target = out.view(-1) if out.is_contiguous() else torch.empty(end - start, dtype=out.dtype, device=out.device)
        run_reads(reads, lambda part, lo, hi, buf: self._read_stored(kind, part_name(name, part, split.old_degree),
                                                                    lo, hi, buf), start, target)
        if target.data_ptr() != out.data_ptr():
            out.copy_(target.view(out.shape))

    def _read_stored(self, kind: str, param: str, start: int, end: int, out: torch.Tensor) -> None:
        """Elements ``[start, end)`` of the stored tensor ``param`` (a part's name, or an unsplit one's)."""
        frags = self._index.get((kind, param))
        if frags is None:
            raise CheckpointError(f"{self.path} has no {kind!r} values for parameter {param!r}")
        if out.numel() != end - start:
            raise ValueError(f"read_range: out has {out.numel()} elements for [{start}, {end})")
        target = out.view(-1) if out.device.type == "cpu" and out.is_contiguous() else torch.empty(
            end - start, dtype=out.dtype)
        covered = 0
        first = max(bisect.bisect_right(self._starts[(kind, param)], start) - 1, 0)
        for lo, hi, file, key in frags[first:]:
            if lo >= end:
                break
            a, b = max(lo, start), min(hi, end)
            if a >= b:
                continue
            self._read_fragment(file, key, target[a - start: b - start], a - lo, whole=a == lo and b == hi)
            covered += b - a
        if covered != end - start:
            raise CheckpointError(f"{self.path}: the saved {kind!r} fragments of {param!r} cover {covered} of the "
                                  f"{end - start} elements [{start}, {end}); the checkpoint is incomplete")
        if target is not out and target.data_ptr() != out.data_ptr():
            out.copy_(target.view(out.shape))  # out may be non-contiguous (a transposed buffer): no view(-1)

    def read_param(self, kind: str, param: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        info = self.params[param]
        shape = tuple(info["shape"])
        out = torch.empty(shape, dtype=dtype or self.stored_dtype(kind, param))
        self.read_range(kind, param, 0, out.numel(), out)
        return out

    @contextlib.contextmanager
    def reading_in_order(self) -> Iterator[None]:
        """Within this block the caller reads each stored tensor it starts from its first element on, in
        order, and uses no part of it until the read that reaches its end has returned (which raises on a
        mismatch): every byte is then read once, checked by a running CRC-32 (see the module's doc).
        Tensors read only in part are checked when the block ends without an error (by reading the rest)."""
        outer, self._in_order = self._in_order, True
        try:
            yield
            if not outer:
                for (file, key), (start, crc) in sorted(self._running.items()):
                    self._check(file, key, self._reader(file).checksum(key, start, crc))
        finally:
            self._in_order = outer
            if not outer:
                self._running.clear()

    def _read_fragment(self, file: str, key: str, out: torch.Tensor, offset: int, *, whole: bool) -> None:
        """Elements ``[offset, offset + out.numel())`` of stored tensor ``key``, checked against its CRC-32
        the first time it is read: in the same pass when ``whole`` or when continuing an in-order read
        (:meth:`reading_in_order`), else by reading it all first."""
        reader = self._reader(file)
        if self._crcs is None or (file, key) in self._verified:
            reader.read_into(key, out, start=offset)
            return
        self._expected(file, key)  # a tensor without a checksum is refused before anything of it is read
        running = self._running.pop((file, key), None)
        if whole:
            self._check(file, key, reader.read_into(key, out, crc=0))
            return
        if self._in_order and offset == (running[0] if running is not None else 0):
            crc = reader.read_into(key, out, start=offset, crc=running[1] if running is not None else 0)
            end = offset + out.numel()
            if end < reader.entries[key].numel:
                self._running[(file, key)] = (end, crc if crc is not None else -1)
            else:
                self._check(file, key, crc)
            return
        # a part from its middle, or out of order: the whole tensor first (which leaves the part in the page cache)
        self._check(file, key, reader.checksum(key))
        reader.read_into(key, out, start=offset)

    def _expected(self, file: str, key: str) -> int:
        """The CRC-32 the manifest records for stored tensor ``key`` of ``file``; refused when none."""
        expected = (self._crcs or {}).get((file, key))
        if expected is None:
            raise damaged(self.path, f"tensor {key!r} in {os.path.join(self.path, file)} has no checksum in "
                                     f"{os.path.join(self.path, MANIFEST)}")
        return expected

    def _check(self, file: str, key: str, actual: int | None) -> None:
        """Refuse stored tensor ``key`` of ``file`` unless ``actual`` (the CRC-32 of all its bytes) is the
        manifest's; remember it checked."""
        check_crc(self.path, f"tensor {key!r} in {os.path.join(self.path, file)}", self._expected(file, key),
                  actual if actual is not None else -1)
        self._verified.add((file, key))

    def checked_file(self, name: str) -> str:
        """The path of the tag's file ``name`` (``engine_state.pt``, ``rank<N>.state.pt``) once its bytes
        match the manifest's CRC-32 (checkpoints without checksums: unchecked)."""
        path = os.path.join(self.path, name)
        if not self.checked:
            return path
        info = self.manifest["files"].get(name)
        if info is None or "crc32" not in info:
            raise damaged(self.path, f"{path} has no checksum in {os.path.join(self.path, MANIFEST)}")
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                crc = crc32_range(lambda buffer, offset: pread_into(fd, path, buffer, offset), 0, size)
            finally:
                os.close(fd)
        except OSError as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from None
        check_crc(self.path, path, info["crc32"], crc)
        return path

    def _reader(self, file: str) -> SafetensorsReader:
        reader = self._readers.get(file)
        if reader is None:
            path = os.path.join(self.path, file)
            try:
                reader = SafetensorsReader(path)
            except ValueError as exc:  # present with its recorded size (read_manifest), but not readable
                raise damaged(self.path, str(exc)) from None
            except OSError as exc:
                raise CheckpointError(f"cannot read {path}: {exc}") from None
            if self.checked:
                try:
                    check_crc(self.path, f"the header of {path}",
                              self.manifest["files"].get(file, {}).get("header_crc32"), reader.header_crc32)
                except CheckpointError:
                    reader.close()
                    raise
            self._readers[file] = reader
        return reader

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()

    def __enter__(self) -> "CheckpointSet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
