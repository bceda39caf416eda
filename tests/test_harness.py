"""The multi-rank test harness itself: results, errors, skips, hangs, and an abort at exit."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist

from zerospeed.testing import RankFailed, run_distributed


def _whoami(offset: int, *, scale: int = 1) -> tuple[int, int, str]:
    return (dist.get_rank() * scale + offset, dist.get_world_size(), dist.get_backend())


def _raise_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom from rank 1")
    time.sleep(60)


def _skip_everywhere() -> None:
    pytest.skip("no fancy hardware here")


def _hang_on_rank_two() -> None:
    if dist.get_rank() == 2:
        time.sleep(60)


def _abort_after_work() -> int:
    # Emulates torch+gloo's occasional "terminate called without an active exception" at exit:
    # the work is done and reported; how the process dies afterwards must not matter.
    import atexit

    atexit.register(os.abort)
    return dist.get_rank()


def test_results_come_back_in_rank_order_with_args() -> None:
    assert run_distributed(_whoami, 3, 10, scale=2) == [(10, 3, "gloo"), (12, 3, "gloo"), (14, 3, "gloo")]


def test_a_failing_rank_stops_the_run_quickly_with_its_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_distributed(_raise_on_rank_one, 2, timeout=90)
    assert time.monotonic() - start < 30
    text = str(info.value)
    assert text.startswith("rank 1 of 2 failed:\nValueError: boom from rank 1")
    assert "in _raise_on_rank_one" in text  # the rank's own traceback


def test_skip_inside_a_rank_skips_the_test() -> None:
    with pytest.raises(pytest.skip.Exception, match="rank 0: no fancy hardware here"):
        run_distributed(_skip_everywhere, 2)


def test_a_hanging_rank_is_named_and_killed() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[2\] of 3 did not finish within 8s \(finished: \[0, 1\]\)"):
        run_distributed(_hang_on_rank_two, 3, timeout=8)
    assert time.monotonic() - start < 30


def test_an_abort_after_reporting_does_not_fail_the_run() -> None:
    assert run_distributed(_abort_after_work, 2) == [0, 1]


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="world_size=0 must be >= 1"):
        run_distributed(_whoami, 0, 0)
