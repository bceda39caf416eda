"""Tensor-parallel parts in a checkpoint, and reading them back at any tensor-parallel degree.

A tensor-parallel rank holds slice ``r`` of ``n`` of each split parameter. A save stores that slice
as it is, as the *part* ``name#tp{r}of{n}`` (:func:`part_name`): its fragments are ranges of the
slice's own flattened values, so a save never permutes data, and the fragment index, the byte
reads and the coverage check of :class:`~zerospeed.checkpoint.reader.CheckpointSet` work per part
unchanged. The manifest's ``params`` keep the base name with the *full* shape, and
``tensor_parallel`` records the degree and each split parameter's dimension (absent: degree 1).

Loading at another degree maps a range ``[start, end)`` of the new slice to the old parts
(:func:`plan_reads`, pure): viewing the full tensor as ``[outer, split, inner]`` around the split
dimension, every slice is one contiguous run per outer index, so within one outer row a new slice's
columns meet each old part in one contiguous run. A split along dim 0 (``outer == 1``) is therefore
a few contiguous reads; a split along a later dimension reads the old part's rows blockwise into a
temporary and copies the needed columns through strided views (:class:`Block`), never one read per
row or element. The same degree is the old single contiguous read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, Union

import torch

from zerospeed.checkpoint.layout import CheckpointError, tensor_key
from zerospeed.sharding.slots import Slot
from zerospeed.tensor_parallel.layout import ParamSplit, TPLayout

# Largest temporary one Block reads (elements): 4 Mi elements, 16 MB of fp32.
BLOCK_ELEMENTS = 4 * 1024 * 1024
_PART = re.compile(r"(?P<name>.+)#tp(?P<rank>\d+)of(?P<degree>\d+)")


def part_name(name: str, rank: int, degree: int) -> str:
    """The name part ``rank`` of ``degree`` of parameter ``name`` is stored under (``name`` at degree 1)."""
    return name if degree == 1 else f"{name}#tp{rank}of{degree}"


def parse_part_name(stored: str) -> tuple[str, int, int]:
    """``(name, rank, degree)`` of a stored name (``(stored, 0, 1)`` for an unsplit one)."""
    match = _PART.fullmatch(stored)
    if match is None:
        return stored, 0, 1
    return match["name"], int(match["rank"]), int(match["degree"])


# -- the pure mapping ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    """Read old part ``part``'s local elements ``[start, end)`` into new-local ``[dest, dest + end - start)``."""

    part: int
    start: int
    end: int
    dest: int


@dataclass(frozen=True)
class Block:
    """``rows`` whole rows of the new slice, from old part ``part``: the new rows (width ``dst_width``,
    first row at new-local ``dst_row``) take columns ``[dst_col, dst_col + cols)`` from columns
    ``[src_col, src_col + cols)`` of the old part's rows (width ``src_width``, first at ``src_row``).
    One read covers the old elements from the first needed to the last needed (:attr:`start`, :attr:`end`)."""

    part: int
    rows: int
    src_row: int
    src_width: int
    src_col: int
    dst_row: int
    dst_width: int
    dst_col: int
    cols: int

    @property
    def start(self) -> int:
        return self.src_row + self.src_col

    @property
    def end(self) -> int:
        return self.src_row + (self.rows - 1) * self.src_width + self.src_col + self.cols


Read = Union[Run, Block]


def plan_reads(full_shape: Sequence[int], dim: int, old_degree: int, new_degree: int, new_rank: int,
               start: int, end: int, *, fused: int = 1, block_elements: int = BLOCK_ELEMENTS) -> list[Read]:
    """The reads that fill elements ``[start, end)`` of slice ``new_rank`` of ``new_degree`` (along
    ``dim``) from a checkpoint that stored ``old_degree`` parts along the same ``dim``; ``fused``
    tensors concatenated along ``dim`` are each split on their own (:class:`ParamSplit` ``parts``)."""
    shape = tuple(full_shape)
    outer, split, inner = ParamSplit(dim, 0, 1, fused).blocks(shape)
    for degree in (old_degree, new_degree):
        if degree < 1 or split % degree or split * fused != shape[dim]:
            raise CheckpointError(f"a tensor of shape {shape} ({fused} fused) cannot be split into {degree} equal "
                                  f"parts along dim {dim}; use a tensor-parallel degree that divides {split}")
    if end <= start:
        return []
    if old_degree == new_degree:  # the part this rank held: the plain contiguous read
        return [Run(new_rank, start, end, start)]
    w_new, w_old = split // new_degree * inner, split // old_degree * inner
    if not 0 <= start <= end <= outer * w_new:
        raise ValueError(f"range [{start}, {end}) outside a slice of {outer * w_new} elements")
    base = new_rank * w_new  # the new slice's first column in the full tensor's [outer, split * inner] rows
    overlaps = []  # (part, new column, old column, columns) of every old part the new slice meets
    for part in range(base // w_old, min((base + w_new - 1) // w_old, old_degree - 1) + 1):
        lo, hi = max(base, part * w_old), min(base + w_new, (part + 1) * w_old)
        if lo < hi:
            overlaps.append((part, lo - base, lo - part * w_old, hi - lo))
    out: list[Read] = []

    def partial(row: int, a: int, b: int) -> None:  # new-local [a, b) inside one row
        for part, c_new, c_old, cols in overlaps:
            x0, x1 = max(a - row * w_new, c_new), min(b - row * w_new, c_new + cols)
            if x0 < x1:
                src = row * w_old + c_old + (x0 - c_new)
                out.append(Run(part, src, src + x1 - x0, row * w_new + x0))

    first_full, last_full = -(-start // w_new), end // w_new  # whole rows [first_full, last_full)
    if last_full < first_full:  # inside one row, partial at both ends
        partial(start // w_new, start, end)
        return out
    if start % w_new:
        partial(start // w_new, start, first_full * w_new)
    rows_per_block = max(block_elements // w_old, 1)
    for part, c_new, c_old, cols in overlaps:
        if last_full == first_full:
            break
        if last_full - first_full == 1:  # one row: its columns are contiguous on both sides
            src = first_full * w_old + c_old
            out.append(Run(part, src, src + cols, first_full * w_new + c_new))
            continue
        for row in range(first_full, last_full, rows_per_block):
            rows = min(rows_per_block, last_full - row)
            out.append(Block(part, rows, row * w_old, w_old, c_old, row * w_new, w_new, c_new, cols))
    if end % w_new and last_full * w_new >= start:
        partial(last_full, last_full * w_new, end)
    return out


ReadPart = Callable[[int, int, int, torch.Tensor], None]  # (part, start, end, out): one contiguous read


def run_reads(reads: Sequence[Read], read_part: ReadPart, start: int, out: torch.Tensor) -> None:
    """Execute :func:`plan_reads`' reads into the contiguous 1-D ``out`` (new-local ``[start, ...)``)."""
    for read in reads:
        if isinstance(read, Run):
            read_part(read.part, read.start, read.end, out[read.dest - start: read.dest - start + read.end - read.start])
            continue
        temp = torch.empty(read.rows * read.src_width, dtype=out.dtype)
        read_part(read.part, read.start, read.end, temp[read.src_col: read.src_col + read.end - read.start])
        lo = read.dst_row - start
        dst = out[lo: lo + read.rows * read.dst_width].view(read.rows, read.dst_width)
        dst[:, read.dst_col: read.dst_col + read.cols].copy_(
            temp.view(read.rows, read.src_width)[:, read.src_col: read.src_col + read.cols])


# -- the checkpoint's record ------------------------------------------------------------------------
@dataclass(frozen=True)
class StoredTP:
    """What a manifest says about tensor parallelism: the degree, each split parameter's dim and,
    for fused tensors (AutoTP's q/k/v in one weight), how many are fused."""

    degree: int = 1
    splits: Mapping[str, int] = field(default_factory=dict)
    fused: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, manifest: Mapping[str, Any]) -> "StoredTP":
        record = manifest.get("tensor_parallel") or {}
        return cls(int(record.get("degree", 1)), dict(record.get("splits", {})), dict(record.get("fused_parts", {})))

    def stored_name(self, name: str, rank: int = 0) -> str:
        """Where part ``rank`` of ``name`` is (the name itself when it is not split)."""
        return part_name(name, rank, self.degree) if name in self.splits else name


@dataclass(frozen=True)
class ReadSplit:
    """How to read one parameter: stored as ``old_degree`` parts, wanted as slice ``new_rank`` of
    ``new_degree``, both along ``dim`` (of ``fused`` tensors each split on its own)."""

    dim: int
    old_degree: int
    new_degree: int
    new_rank: int
    fused: int = 1


def reading_split(name: str, full_shape: Sequence[int], stored: StoredTP, layout: TPLayout,
                  path: str) -> ReadSplit | None:
    """How to read ``name`` (stored name, the model's name in ``layout``), or None when neither side
    splits it (plain ranges). Either side may be unsplit: the other one says the dim."""
    old_dim = stored.splits.get(name)
    new = layout.splits.get(name)
    if old_dim is None and new is None:
        return None
    old_fused = stored.fused.get(name, 1) if old_dim is not None else None
    if old_dim is not None and new is not None and (old_dim, old_fused) != (new.dim, new.parts):
        raise CheckpointError(f"{path}: parameter {name} of shape {tuple(full_shape)} is split along dim {old_dim} "
                              f"({old_fused} fused tensor(s)) in the checkpoint but along dim {new.dim} ({new.parts} "
                              f"fused) in this model; build the model with the same tensor-parallel layers as the "
                              f"saving one (or convert the checkpoint with `zerospeed convert` and load the full "
                              f"tensors)")
    if new is not None:
        return ReadSplit(new.dim, stored.degree if old_dim is not None else 1, new.degree, new.rank, new.parts)
    return ReadSplit(int(old_dim), stored.degree, 1, 0, int(old_fused or 1))  # type: ignore[arg-type]


def local_shape(full_shape: Sequence[int], split: ReadSplit | None) -> tuple[int, ...]:
    """The shape of the slice this model holds (the full shape when it does not split the parameter)."""
    if split is None:
        return tuple(full_shape)
    return tuple(n // split.new_degree if d == split.dim else n for d, n in enumerate(full_shape))


# -- saving ---------------------------------------------------------------------------------------
def slots_to_save(slots: Sequence[Slot], layout: TPLayout) -> list[Slot]:
    """The slots this rank writes: every split one, and replicated ones only on tensor-parallel rank 0
    (the others hold the same values)."""
    if layout.degree == 1 or layout.rank == 0:
        return list(slots)
    return [slot for slot in slots if slot.param in layout.splits]


def to_parts(tensors: list[tuple[str, torch.Tensor]], fragments: list[dict[str, Any]], layout: TPLayout) -> None:
    """Rename (in place) the fragments of split parameters to their part names: ``tensors`` and
    ``fragments`` are a payload's parallel lists. Scalars and group membership keep the base name."""
    if layout.degree == 1:
        return
    for i, frag in enumerate(fragments):
        split = layout.splits.get(frag["param"])
        if split is None:
            continue
        param = part_name(frag["param"], split.rank, split.degree)
        key = tensor_key(frag["kind"], param, frag["start"], frag["end"])
        fragments[i] = dict(frag, param=param, key=key)
        tensors[i] = (key, tensors[i][1])


def full_shape(name: str, shape: tuple[int, ...], layout: TPLayout) -> tuple[int, ...]:
    """A parameter's full (unsplit) shape, from the slice this rank holds."""
    split = layout.splits.get(name)
    return shape if split is None else split.full_shape(shape)


__all__ = ["Block", "ReadSplit", "Run", "StoredTP", "full_shape", "local_shape", "parse_part_name", "part_name", "plan_reads",
           "reading_split", "run_reads", "slots_to_save", "to_parts"]
