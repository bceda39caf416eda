"""Read any element range of any parameter's saved state, whatever topology wrote it.

A checkpoint's fragments (``kind``, ``param``, ``[start, end)``, file, key) tile each parameter's
flattened values; :meth:`CheckpointSet.read_range` finds the fragments overlapping a requested
range and ``pread``s just those bytes, so a rank loading a shard reads only that shard, and a
consolidation holds one chunk at a time.

A checkpoint is read as seen by a model of a given tensor-parallel layout (``layout``; default:
an unsplit model): ``params`` give the shapes that model holds, and ``read_range`` ranges of its
slices, mapped onto the stored parts by :mod:`~zerospeed.checkpoint.tp_reshard`.
"""

from __future__ import annotations

import bisect
import os
from collections import defaultdict
from typing import Any

import torch

from zerospeed.checkpoint.layout import CheckpointError, read_manifest
from zerospeed.checkpoint.safetensors_io import SafetensorsReader
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
            self._reader(file).read_into(key, target[a - start: b - start], start=a - lo)
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

    def _reader(self, file: str) -> SafetensorsReader:
        reader = self._readers.get(file)
        if reader is None:
            try:
                reader = SafetensorsReader(os.path.join(self.path, file))
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"cannot read {os.path.join(self.path, file)}: {exc}") from None
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
