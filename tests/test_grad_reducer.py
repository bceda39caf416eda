"""The one gradient reducer, without processes: bucket lifecycle, layout bookkeeping, relay order."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from zerospeed.zero.reducer import (AllReduce, Bucket, BucketState, GradReducer, GradSlot, ReducerStateError,
                                    ReductionPolicy)
from zerospeed.zero.sharded_grads import ShardWindow, _SHARD_TRANSITIONS


@dataclass
class _OneRank:  # what the reducer reads of a Comm before any collective runs
    rank: int = 0
    world_size: int = 1


def _bucket(index: int, params: list[int | None], numel: int | None = None) -> Bucket:
    slots = [GradSlot(2 * k, torch.Size([2]), p) for k, p in enumerate(params)]
    return Bucket(index, slots, numel if numel is not None else 2 * len(params), torch.device("cpu"))


def test_bucket_lifecycle_is_checked() -> None:
    bucket = _bucket(0, [0, None], numel=6)
    assert (bucket.n_trainable, bucket.used, bucket.state) == (1, 4, BucketState.ACCUMULATING)
    with pytest.raises(ReducerStateError, match="internal error: gradient bucket 0 cannot go from accumulating to reduced"):
        bucket.advance(BucketState.REDUCED)
    bucket.advance(BucketState.LAUNCHED)
    with pytest.raises(ReducerStateError, match="from launched to accumulating"):
        bucket.advance(BucketState.ACCUMULATING)
    bucket.advance(BucketState.REDUCED)
    bucket.advance(BucketState.ACCUMULATING)


def test_shard_window_lifecycle_allows_only_forward_steps() -> None:
    assert _SHARD_TRANSITIONS[ShardWindow.EMPTY] == {ShardWindow.SUMMED}
    assert _SHARD_TRANSITIONS[ShardWindow.SUMMED] == {ShardWindow.SUMMED, ShardWindow.PREPARED}
    assert not _SHARD_TRANSITIONS[ShardWindow.PREPARED]  # only a new window (zero()) empties it


def _reducer(params: list[nn.Parameter], buckets: list[Bucket], order: list[int]) -> GradReducer:
    comm = _OneRank()
    return GradReducer(params, buckets, order, comm,  # type: ignore[arg-type]
                       collective=AllReduce(comm), policy=ReductionPolicy(),  # type: ignore[arg-type]
                       accum_dtype=torch.float32, land=lambda bucket, out: None,
                       late_gradient=lambda bucket: RuntimeError(f"late for {bucket.index}"),
                       keep_accumulators=True)


def test_accumulates_into_slots_and_frees_param_grad() -> None:
    params = [nn.Parameter(torch.zeros(2)) for _ in range(3)]
    reducer = _reducer(params, [_bucket(0, [0, 1]), _bucket(1, [2])], [1, 0])
    assert reducer.where(params[2]) == (1, 0) and reducer.where(params[1]) == (0, 1)
    for step in range(2):  # not reducing: the second pass adds to the first
        (sum(p.sum() * (k + 1) for k, p in enumerate(params))).backward()
        assert all(p.grad is None for p in params)
    assert torch.equal(reducer.buckets[0].acc, torch.tensor([2.0, 2.0, 4.0, 4.0]))
    assert torch.equal(reducer.buckets[1].acc, torch.tensor([6.0, 6.0]))
    reducer.new_window()  # the window's first gradient overwrites what the buffers hold
    params[0].sum().backward()
    assert torch.equal(reducer.buckets[0].acc[:2], torch.tensor([1.0, 1.0]))
    reducer.remove_hooks()
    params[1].sum().backward()
    assert params[1].grad is not None  # no hook any more


def test_completion_order_follows_the_arrivals_then_the_current_order() -> None:
    params = [nn.Parameter(torch.zeros(2)) for _ in range(5)]
    buckets = [_bucket(0, [0, 1]), _bucket(1, [2, None]), _bucket(2, [3, 4]), _bucket(3, [None])]
    reducer = _reducer(params, buckets, [2, 1, 0])
    # bucket 1 completes with param 2, bucket 0 with param 1 (seen after 0); bucket 2 never completes
    assert reducer.completion_order([3, 2, 0, 1]) == [1, 0, 2]
    assert reducer.completion_order([]) == [2, 1, 0]
    reducer.set_order([0, 1, 2])
    assert reducer.order == [0, 1, 2]
    with pytest.raises(AssertionError, match="same buckets"):
        reducer.set_order([0, 1, 3])


def test_no_trainable_parameters_is_refused() -> None:
    with pytest.raises(ValueError, match="no trainable parameters"):
        _reducer([], [], [])
