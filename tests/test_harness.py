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
    # the work is done and reported, then the process dies of SIGABRT while shutting down.
    import zerospeed.distributed.env

    zerospeed.distributed.env.shutdown_distributed = os.abort
    return dist.get_rank()


def _skip_on_one_rank() -> None:
    import torch

    if dist.get_rank() == 1:
        pytest.skip("rank 1 lacks the hardware")
    dist.all_reduce(torch.ones(1))  # fails or hangs without rank 1; the skip must win


def _sleeping_parent(marker: str) -> None:
    """A test process that starts ranks which hang, then gets killed."""
    run_distributed(_hang_writing_pid, 2, marker, timeout=300)


def _hang_writing_pid(marker: str) -> None:
    with open(f"{marker}.{dist.get_rank()}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(300)


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
    with pytest.raises(pytest.skip.Exception, match=r"^rank [01]: no fancy hardware here$"):
        run_distributed(_skip_everywhere, 2)


def test_a_hanging_rank_is_named_with_its_stack_and_killed() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[2\] of 3 did not finish within 8s \(finished: \[0, 1\]\)") as info:
        run_distributed(_hang_on_rank_two, 3, timeout=8)
    assert time.monotonic() - start < 30
    assert "--- rank 2 stack ---" in str(info.value)
    assert "in _hang_on_rank_two" in str(info.value)


def test_a_skip_on_one_rank_skips_even_if_the_others_fail() -> None:
    with pytest.raises(pytest.skip.Exception, match="rank 1: rank 1 lacks the hardware"):
        run_distributed(_skip_on_one_rank, 2, timeout=60)


def test_ranks_die_with_the_test_process(tmp_path) -> None:
    import multiprocessing as mp

    marker = str(tmp_path / "pid")
    parent = mp.get_context("spawn").Process(target=_sleeping_parent, args=(marker,))
    parent.start()
    deadline = time.monotonic() + 60
    while not all(os.path.exists(f"{marker}.{r}") for r in range(2)) and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = [int(open(f"{marker}.{r}").read()) for r in range(2)]
    parent.kill()
    parent.join()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids), f"orphaned ranks {pids}"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        # The process can vanish between open() and read(): /proc then reports ESRCH.
        return False


def test_an_abort_after_reporting_does_not_fail_the_run() -> None:
    assert run_distributed(_abort_after_work, 2) == [0, 1]


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="world_size=0 must be >= 1"):
        run_distributed(_whoami, 0, 0)
