"""Tensor-parallel checkpoint parts read back at another degree (issue 17), without processes.

``plan_reads`` is checked against exact expected reads for dim-0 and dim-1 splits (2 -> 1, 1 -> 4,
2 -> 4, 4 -> 2, ranges starting and ending inside rows), and against values for every degree pair,
rank and many ranges; then a checkpoint directory written by hand as two parts is read through
``CheckpointSet`` at degrees 1, 2 and 4, converted (full tensors), and refused with another split dim.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest
import torch

from zerospeed.checkpoint import convert_checkpoint
from zerospeed.checkpoint.layout import FORMAT, MANIFEST, MASTER, CheckpointError, rank_file, tensor_key
from zerospeed.checkpoint.reader import CheckpointSet
from zerospeed.checkpoint.safetensors_io import SafetensorsReader, StreamingWriter
from zerospeed.checkpoint.tp_reshard import (Block, Run, full_shape, parse_part_name, part_name, plan_reads,
                                             run_reads, slots_to_save, to_parts)
from zerospeed.sharding.slots import Slot
from zerospeed.tensor_parallel.layout import ParamSplit, TPLayout


def test_dim0_two_parts_into_one():
    # (8, 3) split along dim 0 into two parts of 12 elements: one contiguous read per part
    assert plan_reads((8, 3), 0, 2, 1, 0, 0, 24) == [Run(0, 0, 12, 0), Run(1, 0, 12, 12)]
    assert plan_reads((8, 3), 0, 2, 1, 0, 5, 20) == [Run(0, 5, 12, 5), Run(1, 0, 8, 12)]


def test_dim1_two_parts_into_one_blockwise():
    # (3, 4) split along dim 1: each part's 3 rows in one read, columns copied through views
    assert plan_reads((3, 4), 1, 2, 1, 0, 0, 12) == [Block(0, 3, 0, 2, 0, 0, 4, 0, 2), Block(1, 3, 0, 2, 0, 0, 4, 2, 2)]
    reads = plan_reads((3, 4), 1, 2, 1, 0, 1, 11)  # starts and ends inside a row
    assert reads == [Run(0, 1, 2, 1), Run(1, 0, 2, 2),  # row 0 from column 1
                     Run(0, 2, 4, 4), Run(1, 2, 4, 6),  # row 1, whole: one run per part
                     Run(0, 4, 6, 8), Run(1, 4, 5, 10)]  # row 2 up to column 3


def test_one_into_four_and_two_into_four():
    # rank 2 of 4 along dim 1 of (2, 8): columns 4-5 of the single stored part, both rows in one read
    reads = plan_reads((2, 8), 1, 1, 4, 2, 0, 4)
    assert reads == [Block(0, 2, 0, 8, 4, 0, 2, 0, 2)]
    assert (reads[0].start, reads[0].end) == (4, 14)
    assert plan_reads((8,), 0, 2, 4, 3, 0, 2) == [Run(1, 2, 4, 0)]  # the second half of part 1
    assert plan_reads((8, 2), 0, 2, 4, 1, 1, 3) == [Run(0, 5, 7, 1)]


def test_four_into_two():
    assert plan_reads((2, 8), 1, 4, 2, 1, 0, 8) == [Block(2, 2, 0, 2, 0, 0, 4, 0, 2), Block(3, 2, 0, 2, 0, 0, 4, 2, 2)]
    assert plan_reads((16,), 0, 4, 2, 1, 2, 7) == [Run(2, 2, 4, 2), Run(3, 0, 3, 4)]  # elements 10-14


def test_same_degree_is_one_contiguous_read():
    assert plan_reads((6, 4), 1, 2, 2, 1, 3, 9) == [Run(1, 3, 9, 3)]
    assert plan_reads((6, 4), 1, 2, 2, 1, 3, 3) == []


def test_blocks_are_bounded():
    reads = plan_reads((10, 4), 1, 2, 1, 0, 0, 40, block_elements=6)  # 3 old rows of 2 per block
    assert [r.rows for r in reads if isinstance(r, Block)] == [3, 3, 3, 1] * 2


def test_indivisible_degree_is_refused():
    with pytest.raises(CheckpointError, match=r"cannot be split into 3 equal parts along dim 1"):
        plan_reads((2, 8), 1, 2, 3, 0, 0, 2)
    with pytest.raises(CheckpointError, match=r"\(3 fused\) cannot be split into 4 equal parts"):
        plan_reads((6, 2), 0, 1, 4, 0, 0, 2, fused=3)


def test_fused_dim0_reads_each_fused_tensor():
    # (6, 2) = q, k, v of 2 rows each; rank 1 of 2 holds the second row of each: one read of the
    # unsplit part (elements 2-11) as 3 rows of 4, whose last 2 columns are copied
    assert plan_reads((6, 2), 0, 1, 2, 1, 0, 6, fused=3) == [Block(0, 3, 0, 4, 2, 0, 2, 0, 2)]


def _expected(full: torch.Tensor, dim: int, degree: int, rank: int, fused: int = 1) -> torch.Tensor:
    return ParamSplit(dim, rank, degree, fused).local_slice(full).reshape(-1)


@pytest.mark.parametrize("shape,dim,fused", [((8, 12), 0, 1), ((8, 12), 1, 1), ((3, 4, 8), 1, 1), ((24,), 0, 1),
                                             ((2, 3, 8), 2, 1), ((12, 4), 0, 3), ((2, 24), 1, 3), ((24,), 0, 3)])
def test_values_for_every_degree_pair(shape, dim, fused):
    """``fused``: q, k and v in one tensor, each split on its own (AutoTP's fused projections)."""
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    for old, new in itertools.permutations((1, 2, 4), 2):
        parts = [_expected(full, dim, old, p, fused) for p in range(old)]
        calls = []

        def read_part(part, lo, hi, out):
            calls.append((part, lo, hi))
            out.copy_(parts[part][lo:hi])

        for rank in range(new):
            want = _expected(full, dim, new, rank, fused)
            n = want.numel()
            for start, end in [(0, n), (1, n - 1), (3, 4), (n // 2, n), (0, 1), (min(5, n), max(n - 7, min(5, n)))]:
                out = torch.full((end - start,), -1.0)
                reads = plan_reads(shape, dim, old, new, rank, start, end, fused=fused, block_elements=7)
                run_reads(reads, read_part, start, out)
                assert torch.equal(out, want[start:end]), (old, new, rank, start, end)
        outer = torch.Size(shape[:dim]).numel()
        assert len(calls) < outer * fused * 40 * new, "reads should be per block, not per element"


def test_names_and_save_helpers():
    assert part_name("w", 1, 2) == "w#tp1of2" and part_name("w", 0, 1) == "w"
    assert parse_part_name("a.b#tp3of4") == ("a.b", 3, 4) and parse_part_name("a.b") == ("a.b", 0, 1)
    layout = TPLayout(2, 1, {"fc.weight": ParamSplit(1, 1, 2)})
    assert full_shape("fc.weight", (4, 3), layout) == (4, 6) and full_shape("ln.weight", (4,), layout) == (4,)
    slots = [Slot("fc.weight", 0, 12, torch.zeros(12)), Slot("ln.weight", 0, 4, torch.zeros(4))]
    assert [s.param for s in slots_to_save(slots, layout)] == ["fc.weight"]  # replicated: tp rank 0 writes
    assert len(slots_to_save(slots, TPLayout(2, 0, layout.splits))) == 2
    tensors = [(tensor_key(MASTER, "fc.weight", 0, 12), torch.zeros(12))]
    fragments = [{"kind": MASTER, "param": "fc.weight", "start": 0, "end": 12, "key": tensors[0][0]}]
    to_parts(tensors, fragments, layout)
    assert fragments[0]["param"] == "fc.weight#tp1of2" and tensors[0][0] == "master:fc.weight#tp1of2[0:12]"


# -- a checkpoint directory, written as a degree-2 save would write it --------------------------------
FULL = {"fc.weight": (torch.arange(48.0).reshape(6, 8), 1), "emb.weight": (torch.arange(100.0, 124.0).reshape(8, 3), 0),
        "ln.weight": (torch.arange(200.0, 208.0), None)}


def _write(path: Path, degree: int = 2) -> None:
    """Rank files of ``degree`` tensor-parallel ranks x 2 data-parallel ranks (each half of each part),
    replicated parameters from tensor-parallel rank 0 only, and the manifest."""
    path.mkdir()
    fragments, files = [], {}
    for tp, dp in itertools.product(range(degree), range(2)):
        rank = tp * 2 + dp
        entries = []
        for name, (full, dim) in FULL.items():
            if dim is None and tp:
                continue
            part = full.reshape(-1) if dim is None else full.chunk(degree, dim)[tp].reshape(-1)
            stored = name if dim is None else part_name(name, tp, degree)
            lo, hi = part.numel() * dp // 2, part.numel() * (dp + 1) // 2
            for kind, values in ((MASTER, part), ("optim.exp_avg", -part)):
                key = tensor_key(kind, stored, lo, hi)
                entries.append((key, values[lo:hi].clone()))
                fragments.append({"kind": kind, "param": stored, "start": lo, "end": hi, "key": key,
                                  "file": rank_file(rank)})
        with StreamingWriter(str(path / rank_file(rank)), [(k, t.dtype, (t.numel(),)) for k, t in entries],
                             {"format": FORMAT}) as writer:
            for _, t in entries:
                writer.write(t)
        files[rank_file(rank)] = {"bytes": os.path.getsize(path / rank_file(rank))}
    manifest = {"format": FORMAT, "version": 2, "files": files, "fragments": fragments, "aliases": {}, "buffers": [],
                "params": [{"name": n, "shape": list(t.shape), "dtype": "float32", "trainable": True}
                           for n, (t, _) in FULL.items()],
                "tensor_parallel": {"degree": degree, "splits": {n: d for n, (_, d) in FULL.items() if d is not None}}}
    (path / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("degree", [1, 2, 4])
def test_checkpoint_set_reads_slices_at_any_degree(tmp_path, degree):
    _write(tmp_path / "ckpt")
    for rank in range(degree):
        layout = TPLayout(degree, rank, {} if degree == 1 else
                          {n: ParamSplit(d, rank, degree) for n, (_, d) in FULL.items() if d is not None})
        with CheckpointSet(str(tmp_path / "ckpt"), layout) as ckpt:
            ckpt.check_layout()
            for name, (full, dim) in FULL.items():
                want = full if dim is None or degree == 1 else full.chunk(degree, dim)[rank]
                assert tuple(ckpt.params[name]["shape"]) == tuple(want.shape)
                assert ckpt.has(MASTER, name) and ckpt.kinds(name) == [MASTER, "optim.exp_avg"]
                got = torch.empty_like(want)
                ckpt.read_range(MASTER, name, 0, got.numel(), got)
                assert torch.equal(got, want), (name, degree, rank)
                moment = torch.empty(want.numel())
                ckpt.read_range("optim.exp_avg", name, 1, want.numel(), moment[1:])
                assert torch.equal(moment[1:], -want.reshape(-1)[1:])
                transposed = torch.empty_like(want.t()).t() if want.dim() == 2 else torch.empty_like(want)
                ckpt.read_range(MASTER, name, 0, want.numel(), transposed)  # a non-contiguous target
                assert torch.equal(transposed, want)


def test_convert_joins_parts(tmp_path):
    _write(tmp_path / "ckpt")
    out = tmp_path / "model.safetensors"
    convert_checkpoint(str(tmp_path / "ckpt"), str(out), chunk_bytes=20)
    reader = SafetensorsReader(str(out))
    try:
        for name, (full, _) in FULL.items():
            got = torch.empty(full.numel())
            reader.read_into(name, got)
            assert torch.equal(got.view(full.shape), full), name
    finally:
        reader.close()


def test_another_split_dim_is_refused(tmp_path):
    _write(tmp_path / "ckpt")
    layout = TPLayout(2, 0, {"fc.weight": ParamSplit(0, 0, 2), "emb.weight": ParamSplit(0, 0, 2)})
    with CheckpointSet(str(tmp_path / "ckpt"), layout) as ckpt:
        with pytest.raises(CheckpointError, match=r"fc.weight of shape \(6, 8\) is split along dim 1 \(1 fused "
                                                  r"tensor\(s\)\) in the checkpoint but along dim 0 \(1 fused\)"):
            ckpt.check_layout()
    fused = TPLayout(2, 0, {"fc.weight": ParamSplit(1, 0, 2, parts=2), "emb.weight": ParamSplit(0, 0, 2)})
    with CheckpointSet(str(tmp_path / "ckpt"), fused) as ckpt:
        with pytest.raises(CheckpointError, match=r"along dim 1 \(2 fused\) in this model"):
            ckpt.check_layout()
