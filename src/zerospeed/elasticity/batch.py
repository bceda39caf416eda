"""DeepSpeed's elastic batch arithmetic: one global batch that many GPU counts can share.

A global batch ``B`` works at ``n`` data-parallel ranks when ``B / n`` is a multiple of one of the
accepted micro batches (the rest is gradient accumulation). Version 0.1 searches batch sizes of the
form "accepted micro batch (or their least common multiple) x a highly composite number", the largest
such size within ``max_train_batch_size`` for each base, and keeps the one valid at the most GPU
counts in ``min_gpus..max_gpus`` (ties: the larger batch, or the smaller with ``prefer_larger_batch``
false). Version 0.2 runs the same search over nodes (``num_gpus_per_node`` GPUs, of which
``model_parallel_size`` form one model replica) and, when the current world size is not in the
result, falls back to the largest batch that fits the current size alone.

These rules are DeepSpeed's (``deepspeed/elasticity/elasticity.py``, 0.19.7, including the fix that
keeps every candidate within ``max_train_batch_size``), reimplemented so the results are the same
numbers, including version 0.2's float arithmetic on the fallback path. Everything here is pure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .config import ElasticityError

#: The 38 smallest highly composite numbers (OEIS A002182), DeepSpeed's scale factors: enough for
#: batch sizes up to about 720K.
HCN_LIST: tuple[int, ...] = (
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560, 10080, 15120,
    20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200, 332640, 498960, 554400,
    665280, 720720,
)


def _largest_hcn_at_most(value: int) -> int:
    """The largest listed highly composite number <= ``value`` (the last one for larger values)."""
    best = HCN_LIST[0]
    for hcn in HCN_LIST:
        if hcn > value:
            break
        best = hcn
    return best


def get_candidate_batch_sizes(base_list: Sequence[int], max_acceptable_batch_size: int) -> list[int]:
    """Each base scaled by the largest highly composite number that keeps it within
    ``max_acceptable_batch_size`` (a base above the limit is dropped, one equal to it kept as is)."""
    candidates: set[int] = set()
    for base in base_list:
        if base > max_acceptable_batch_size:
            continue
        if base == max_acceptable_batch_size:
            candidates.add(base)
        else:
            candidates.add(_largest_hcn_at_most(max_acceptable_batch_size // base) * base)
    return sorted(candidates)


def get_valid_gpus(batch_size: int, micro_batches: Sequence[int], min_valid_gpus: int,
                   max_valid_gpus: int) -> list[int]:
    """The GPU counts in ``min_valid_gpus..max_valid_gpus`` at which ``batch_size`` splits into whole
    micro batches of one accepted size: for each micro batch dividing it, ``batch_size / micro``
    itself and its divisors up to half of it."""
    valid: set[int] = set()
    for micro in micro_batches:
        if batch_size % micro:
            continue
        most = batch_size // micro
        if min_valid_gpus <= most <= max_valid_gpus:
            valid.add(most)
        for count in range(max(1, min_valid_gpus), min(most // 2, max_valid_gpus) + 1):
            if most % count == 0:
                valid.add(count)
    return sorted(valid)


def get_best_candidates(candidate_batch_sizes: Sequence[int], micro_batches: Sequence[int], min_gpus: int,
                        max_gpus: int, prefer_larger: bool) -> tuple[int, list[int] | None]:
    """The candidate valid at the most GPU counts (ties: the larger batch when ``prefer_larger``, else
    the smaller) and those counts. When no candidate beats DeepSpeed's starting point (the smallest
    micro batch, valid nowhere), that point is returned with ``None``."""
    best_count = 0
    best_valid: list[int] | None = None
    best_batch = int(min(micro_batches))
    for batch_size in candidate_batch_sizes:
        valid = get_valid_gpus(batch_size, micro_batches, min_gpus, max_gpus)
        better_tie = batch_size > best_batch if prefer_larger else batch_size < best_batch
        if len(valid) > best_count or (len(valid) == best_count and better_tie):
            best_count, best_valid, best_batch = len(valid), valid, batch_size
    return best_batch, best_valid


def _get_compatible_gpus_v01(micro_batches: Sequence[int], max_acceptable_batch_size: int,
                             min_gpus: int | None = None, max_gpus: int | None = None,
                             prefer_larger: bool = True) -> tuple[int, list[int] | None]:
    """Version 0.1: ``(global batch, valid GPU counts)``. Unset (or 0) ``min_gpus``/``max_gpus`` mean 1
    and ``max_acceptable_batch_size // min(micro_batches)``. Raises ``ValueError`` (as DeepSpeed)
    when a micro batch exceeds ``max_acceptable_batch_size``."""
    min_gpus = min_gpus or 1
    max_gpus = max_gpus or max_acceptable_batch_size // min(micro_batches)
    too_large = [m for m in micro_batches if m > max_acceptable_batch_size]
    if too_large:
        raise ValueError(f"elasticity.micro_batch_sizes: {too_large} exceed max_train_batch_size "
                         f"{max_acceptable_batch_size}; every micro batch must be <= max_train_batch_size")
    bases = [*micro_batches, math.lcm(*micro_batches)]
    candidates = get_candidate_batch_sizes(bases, max_acceptable_batch_size)
    return get_best_candidates(candidates, micro_batches, min_gpus, max_gpus, prefer_larger)


def _micro_batch_for(batch_size: float, current_num_gpus: int, micro_batches: Sequence[int],
                     prefer_larger: bool) -> int | None:
    """Version 0.2's micro batch for ``batch_size`` at ``current_num_gpus``: of the accepted sizes
    dividing the per-GPU share, the largest when ``prefer_larger``, else the first listed."""
    chosen: int | None = None
    for micro in micro_batches:
        if batch_size // current_num_gpus % micro == 0:
            if chosen is None:
                chosen = micro
            if prefer_larger and chosen < micro:
                chosen = micro
    return chosen


def _get_compatible_gpus_v02(micro_batches: Sequence[int], max_acceptable_batch_size: int, current_num_gpus: int,
                             min_gpus: int, max_gpus: int, prefer_larger: bool = True, num_gpus_per_node: int = 1,
                             model_parallel_size: int = 1) -> tuple[float, list[int], int | None]:
    """Version 0.2: ``(global batch, valid data-parallel sizes, micro batch)``, searched per node.

    The division and float steps are DeepSpeed's own, so a fallback batch comes out the same number."""
    if num_gpus_per_node % model_parallel_size != 0:
        raise ElasticityError(f"elasticity.num_gpus_per_node: {num_gpus_per_node} is not divisible by "
                              f"elasticity.model_parallel_size {model_parallel_size}; elasticity version 0.2 "
                              "places whole model replicas on each node")
    dp_size_per_node = num_gpus_per_node // model_parallel_size
    node_batch, valid_nodes = _get_compatible_gpus_v01(
        micro_batches, int(max_acceptable_batch_size / dp_size_per_node), int(min_gpus / num_gpus_per_node),
        int(max_gpus / num_gpus_per_node), prefer_larger=prefer_larger)
    final_batch_size = int(node_batch) * dp_size_per_node
    valid_dp_sizes = [count * dp_size_per_node for count in (valid_nodes or [])]
    if current_num_gpus // model_parallel_size in valid_dp_sizes:
        return (final_batch_size, valid_dp_sizes,
                _micro_batch_for(final_batch_size, current_num_gpus, micro_batches, prefer_larger))

    # The current size is outside the searched set: the largest (or smallest) batch that fits it alone.
    current_dp_size = (current_num_gpus / num_gpus_per_node) * dp_size_per_node
    candidates = []
    for micro in micro_batches:
        min_batch_size = micro * current_dp_size
        factor = math.floor(max_acceptable_batch_size / float(min_batch_size))
        candidates.append(factor * min_batch_size)
    batch = max(candidates) if prefer_larger else min(candidates)
    return batch, [int(current_dp_size)], _micro_batch_for(batch, current_num_gpus, micro_batches, prefer_larger)


def largest_micro_batch(final_batch_size: int, world_size: int, micro_batches: Sequence[int]) -> int | None:
    """The largest accepted micro batch dividing ``final_batch_size // world_size`` (None if none does)."""
    for micro in sorted(set(micro_batches), reverse=True):
        if final_batch_size // world_size % micro == 0:
            return micro
    return None


__all__ = ["HCN_LIST", "get_best_candidates", "get_candidate_batch_sizes", "get_valid_gpus", "largest_micro_batch"]
