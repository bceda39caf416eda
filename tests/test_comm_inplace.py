"""In-place (aliased) reduce_scatter / all_gather and the all_reduce way of reduce-scattering, on gloo.

Values are small integers, so sums are exact in fp32 and bf16 alike and results are compared
bit for bit. One spawn per world size runs every combination.
"""

from __future__ import annotations

import datetime
import itertools
import time

import pytest
import torch

from zerospeed.distributed import CollectiveTimeout, Comm
from zerospeed.distributed.comm import (
    ALL_REDUCE_REDUCE_SCATTER,
    NATIVE_REDUCE_SCATTER,
    ReduceScatterPolicy,
    _overlaps,
)
from zerospeed.testing import run_distributed

WIDTH = 6  # elements per rank: not a multiple of any world size tested
UNEVEN = [3, 1, 4, 2]


def _fill(rank: int, part: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s contribution to part ``part``: small integers, distinct per rank and part."""
    return ((torch.arange(n) % 5) + 7 * rank + 3 * part).to(dtype)


def _expected(ws: int, part: int, n: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    total = sum(_fill(r, part, n, torch.float32) for r in range(ws)).to(dtype)
    return total.div_(ws) if op == "avg" else total  # the same rounding as Comm's own division


def _finish(handle, via_all_reduce: bool) -> None:
    if handle is None:
        return
    if via_all_reduce:  # a real all_reduce Work reports completion (gloo's reduce_scatter Work never does)
        deadline = time.monotonic() + 30
        while not handle.is_completed():
            assert time.monotonic() < deadline, "is_completed() never turned True"
            time.sleep(0.001)
    handle.wait()


def _reduce_scatter_cases(comm: Comm, forced_all_reduce: bool) -> int:
    rank, ws = comm.rank, comm.world_size
    cases = 0
    for dtype, async_op, aliased, writable, op in itertools.product(
            (torch.float32, torch.bfloat16), (False, True), (False, True), (False, True), ("sum", "avg")):
        what = f"{dtype} async={async_op} aliased={aliased} writable={writable} op={op}"
        original = torch.cat([_fill(rank, p, WIDTH, dtype) for p in range(ws)])
        inputs = original.clone()
        output = inputs[rank * WIDTH:(rank + 1) * WIDTH] if aliased else torch.full((WIDTH,), -1.0, dtype=dtype)
        before = dict(comm.stats.calls), dict(comm.stats.bytes)
        handle = comm.reduce_scatter(output, inputs, op=op, async_op=async_op, inputs_writable=writable)
        _finish(handle, forced_all_reduce and writable)
        assert torch.equal(output, _expected(ws, rank, WIDTH, dtype, op)), (what, output)
        if not writable:  # untouched, apart from the output that was asked to live inside inputs
            mask = torch.ones(inputs.numel(), dtype=torch.bool)
            if aliased:
                mask[rank * WIDTH:(rank + 1) * WIDTH] = False
            assert torch.equal(inputs[mask], original[mask]), what
        elif forced_all_reduce:  # the whole buffer was all-reduced in place
            for p in range(ws):
                if p != rank or op == "sum":
                    assert torch.equal(inputs[p * WIDTH:(p + 1) * WIDTH], _expected(ws, p, WIDTH, dtype, "sum")), what
        # counted as one reduce_scatter of the whole input, whichever collective ran
        assert comm.stats.calls["reduce_scatter"] == before[0].get("reduce_scatter", 0) + 1, what
        assert comm.stats.bytes["reduce_scatter"] == (before[1].get("reduce_scatter", 0)
                                                      + ws * WIDTH * original.element_size()), what
        assert comm.stats.calls["all_reduce"] == 0, what
        cases += 1

    # uneven parts (a list), with and without permission to clobber: lists are packed, so never touched
    sizes = UNEVEN[:ws]
    for dtype, async_op, writable, op in itertools.product(
            (torch.float32, torch.bfloat16), (False, True), (False, True), ("sum", "avg")):
        parts = [_fill(rank, p, sizes[p], dtype) for p in range(ws)]
        output = torch.empty(sizes[rank], dtype=dtype)
        handle = comm.reduce_scatter(output, parts, op=op, async_op=async_op, inputs_writable=writable)
        _finish(handle, forced_all_reduce)
        assert torch.equal(output, _expected(ws, rank, sizes[rank], dtype, op)), (dtype, op, output)
        assert all(torch.equal(parts[p], _fill(rank, p, sizes[p], dtype)) for p in range(ws))
        cases += 1

    # a non-contiguous flat input and a 2-D output still work on either way
    original = torch.cat([_fill(rank, p, WIDTH, torch.float32) for p in range(ws)])
    strided = torch.stack([original, torch.zeros_like(original)], dim=1)[:, 0]
    output = torch.empty(2, WIDTH // 2)
    comm.reduce_scatter(output, strided, inputs_writable=True)
    assert torch.equal(output.reshape(-1), _expected(ws, rank, WIDTH, torch.float32, "sum"))
    return cases + 1


def _all_gather_cases(comm: Comm) -> int:
    rank, ws = comm.rank, comm.world_size
    cases = 0
    for dtype, async_op, aliased in itertools.product((torch.float32, torch.bfloat16), (False, True), (False, True)):
        expected = torch.cat([_fill(r, 0, WIDTH, dtype) for r in range(ws)])
        outputs = torch.full((ws * WIDTH,), -1.0, dtype=dtype)
        mine = outputs[rank * WIDTH:(rank + 1) * WIDTH] if aliased else torch.empty(WIDTH, dtype=dtype)
        mine.copy_(_fill(rank, 0, WIDTH, dtype))
        handle = comm.all_gather(outputs, mine, async_op=async_op)
        if handle is not None:
            handle.wait()
        assert torch.equal(outputs, expected), (dtype, async_op, aliased, outputs)
        cases += 1
    return cases


def _inplace(ws_expected: int) -> dict:
    counts = {}
    for name, policy in (("native", NATIVE_REDUCE_SCATTER), ("all_reduce", ALL_REDUCE_REDUCE_SCATTER)):
        comm = Comm(reduce_scatter_policy=policy)
        assert comm.world_size == ws_expected
        counts[f"reduce_scatter/{name}"] = _reduce_scatter_cases(comm, name == "all_reduce")
    for alias_safe in (True, False):  # False: the path for backends that must not see aliased buffers
        comm = Comm()
        comm._alias_safe = alias_safe
        counts[f"all_gather/alias_safe={alias_safe}"] = _all_gather_cases(comm)
        assert comm.stats.calls["all_gather"] == counts[f"all_gather/alias_safe={alias_safe}"]
    comm = Comm()
    comm._alias_safe = False  # a reduce_scatter into its own input on such a backend gets a scratch output
    inputs = torch.cat([_fill(comm.rank, p, WIDTH, torch.float32) for p in range(ws_expected)])
    comm.reduce_scatter(inputs[comm.rank * WIDTH:(comm.rank + 1) * WIDTH], inputs)
    assert torch.equal(inputs[comm.rank * WIDTH:(comm.rank + 1) * WIDTH],
                       _expected(ws_expected, comm.rank, WIDTH, torch.float32, "sum"))

    # the backend's default policy: from its threshold on, a writable input is all-reduced in place
    comm = Comm()
    threshold = comm.reduce_scatter_policy.all_reduce_min_numel
    assert threshold is not None and comm.reduce_scatter_policy == ReduceScatterPolicy.for_backend("gloo")
    width = max(-(-threshold // ws_expected), 1)
    inputs = torch.ones(width * ws_expected)
    comm.reduce_scatter(inputs[:width] if comm.rank == 0 else torch.empty(width), inputs, inputs_writable=True)
    assert inputs[-1].item() == ws_expected  # the last rank's part was reduced here too: an all_reduce ran
    return counts


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_inplace_and_all_reduce_reduce_scatter(world_size: int) -> None:
    results = run_distributed(_inplace, world_size, world_size, timeout=120)
    assert results[0] == {"reduce_scatter/native": 49, "reduce_scatter/all_reduce": 49,
                          "all_gather/alias_safe=True": 8, "all_gather/alias_safe=False": 8}


def _rank_skips_reduce_scatter() -> str:
    comm = Comm(timeout=datetime.timedelta(seconds=1), reduce_scatter_policy=ALL_REDUCE_REDUCE_SCATTER)
    if comm.rank == 1:
        time.sleep(3)
        return ""
    try:
        comm.reduce_scatter(torch.empty(2), torch.ones(4), inputs_writable=True)
    except CollectiveTimeout as exc:
        return str(exc)
    return "no timeout"


def test_all_reduce_way_times_out_as_a_reduce_scatter() -> None:
    message = run_distributed(_rank_skips_reduce_scatter, 2, timeout=60)[0]
    assert message.startswith("reduce_scatter (call #1 on group 'world', ranks [0, 1]) did not complete within 1s")


def test_policy_is_a_frozen_value_chosen_per_backend() -> None:
    assert ReduceScatterPolicy.for_backend("nccl") == NATIVE_REDUCE_SCATTER
    assert ReduceScatterPolicy.for_backend("no-such-backend") == NATIVE_REDUCE_SCATTER
    gloo = ReduceScatterPolicy.for_backend("gloo")
    assert gloo.all_reduce_min_numel is not None
    assert not gloo.use_all_reduce(gloo.all_reduce_min_numel - 1) and gloo.use_all_reduce(gloo.all_reduce_min_numel)
    assert not NATIVE_REDUCE_SCATTER.use_all_reduce(1 << 40) and ALL_REDUCE_REDUCE_SCATTER.use_all_reduce(0)
    with pytest.raises(AttributeError):
        gloo.all_reduce_min_numel = 0  # type: ignore[misc]
    with pytest.raises(ValueError, match="must be >= 0 or None"):
        ReduceScatterPolicy(-1)


def test_overlap_compares_storage_and_extent() -> None:
    flat = torch.zeros(12)
    assert _overlaps(flat, flat[4:8]) and _overlaps(flat[2:5], flat[4:6])
    assert not _overlaps(flat[:4], flat[4:8]) and not _overlaps(flat, torch.zeros(12))
    assert not _overlaps(flat[:0], flat)
