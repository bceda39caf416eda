"""The one gradient reducer on 2 gloo ranks, driven directly with a reduce-scatter (stages 1-3's collective)."""

from __future__ import annotations

import torch
from torch import nn

from zerospeed.distributed import Comm
from zerospeed.testing import run_distributed
from zerospeed.zero.reducer import Bucket, BucketState, GradReducer, GradSlot, ReduceScatter, ReductionPolicy


def _reduce_scatter_window(fold_early: bool, overlap: bool) -> dict:
    comm = Comm()
    world, rank = comm.world_size, comm.rank
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(3)) for _ in range(4)]
    # one bucket per parameter, padded to 4 elements (2 per rank); the last bucket holds two
    buckets = [Bucket(0, [GradSlot(0, torch.Size([3]), 0)], 4, torch.device("cpu")),
               Bucket(1, [GradSlot(0, torch.Size([3]), 1)], 4, torch.device("cpu")),
               Bucket(2, [GradSlot(0, torch.Size([3]), 2), GradSlot(3, torch.Size([3]), 3)], 6, torch.device("cpu"))]
    landed: dict[int, torch.Tensor] = {}
    reduced: list[int] = []
    reducer = GradReducer(params, buckets, [2, 1, 0], comm, collective=ReduceScatter(comm),
                          policy=ReductionPolicy(prescale=True), accum_dtype=torch.float32,
                          land=lambda bucket, out: landed.__setitem__(bucket.index, out.clone()),
                          late_gradient=lambda bucket: RuntimeError(f"late gradient for bucket {bucket.index}"),
                          on_reduced=reduced.append, keep_accumulators=not fold_early, fold_early=fold_early,
                          overlap=overlap, max_in_flight_elems=4)
    calls = comm.stats.calls.get("reduce_scatter", 0)
    scale = torch.tensor([1.0, 2.0, 3.0, 4.0]) * (rank + 1)
    reducer.begin_pass(True)
    sum((p * p).sum() * s for p, s in zip(params, scale, strict=True)).backward()
    states = [b.state for b in reducer.buckets]
    reducer.flush()
    out = {"calls": comm.stats.calls["reduce_scatter"] - calls, "reduced": reduced,
           "states_after_backward": states, "states": [b.state for b in reducer.buckets],
           "landed": {b: t.tolist() for b, t in landed.items()}}  # plain values cross the process boundary
    try:  # a further gradient in the same pass would be lost: the caller's error
        (params[0] * params[0]).sum().backward()
    except RuntimeError as error:
        out["late"] = str(error)
    reducer.begin_pass(True)
    out["restarted"] = [b.state for b in reducer.buckets]
    out["arrivals"] = reducer.agreed_arrivals()
    out["params"] = [p.tolist() for p in params]
    return out


def _check(results: list[dict], world: int) -> None:
    params = [torch.tensor(p) for p in results[0]["params"]]
    mean_scale = sum(r + 1 for r in range(world)) / world
    full = {0: 2 * params[0] * 1 * mean_scale, 1: 2 * params[1] * 2 * mean_scale,
            2: torch.cat([2 * params[2] * 3 * mean_scale, 2 * params[3] * 4 * mean_scale])}
    for rank, result in enumerate(results):
        assert result["calls"] == 3 and result["reduced"] == [2, 1, 0]  # in order, each once
        assert result["states"] == [BucketState.REDUCED] * 3
        assert result["late"] == "late gradient for bucket 0"
        assert result["restarted"] == [BucketState.ACCUMULATING] * 3
        assert result["arrivals"] == results[0]["arrivals"]  # rank 0's, on every rank
        assert sorted(result["arrivals"]) == [0, 1, 2, 3]
        for b, values in full.items():
            padded = torch.cat([values, torch.zeros(2 * world - values.numel() if b < 2 else 0)])
            size = padded.numel() // world
            torch.testing.assert_close(torch.tensor(result["landed"][b]), padded[rank * size: (rank + 1) * size])


def test_reduce_scatter_in_order_kept_accumulators() -> None:
    results = run_distributed(_reduce_scatter_window, 2, False, True)
    _check(results, 2)
    # kept accumulators, nothing folded early: buckets launched in backward stay in flight until flush
    assert results[0]["states_after_backward"] == [BucketState.LAUNCHED] * 3


def test_reduce_scatter_folding_early_and_without_overlap() -> None:
    for overlap in (True, False):
        results = run_distributed(_reduce_scatter_window, 2, True, overlap)
        _check(results, 2)
        if not overlap:  # each reduction is waited for as it is launched
            assert results[0]["states_after_backward"] == [BucketState.REDUCED] * 3
