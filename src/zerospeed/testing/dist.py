"""Run a function on N real processes with a gloo process group, for tests.

The parent hosts the rendezvous store on a free port (no port races between concurrent tests),
starts the ranks from a forkserver that has torch imported already (fast), and collects each
rank's result over a pipe. A rank that raises stops the whole run at once and its traceback is
re-raised in the parent; ``pytest.skip`` inside a rank skips the test; a rank that hangs past the
timeout is killed and named. Ranks report *before* they exit and then leave with ``os._exit`` after
destroying their process group, so torch's occasional abort at interpreter shutdown cannot turn a
passing run into a failure.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

_HOST = "127.0.0.1"


class RankFailed(AssertionError):
    """A rank raised; the message carries that rank's traceback."""


@dataclass(frozen=True)
class _Report:
    rank: int
    status: str  # "ok" | "error" | "skip"
    payload: Any


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, threads: int,
               conn: mpc.Connection, args: tuple, kwargs: dict) -> None:
    """Entry point of one rank (runs in the child)."""
    from zerospeed.dist.env import init_distributed, shutdown_distributed

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=_HOST, MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    report: _Report
    try:
        store = dist.TCPStore(_HOST, port, world_size, is_master=False)
        init_distributed(dist_backend="gloo", store=store)
        report = _Report(rank, "ok", fn(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - every outcome must reach the parent
        if type(exc).__name__ == "Skipped":  # pytest.skip, without importing pytest here
            report = _Report(rank, "skip", str(exc))
        else:
            report = _Report(rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    try:
        conn.send(report)
    except Exception as exc:  # e.g. an unpicklable result
        conn.send(_Report(rank, "error", f"rank {rank} could not send its result: {exc!r}"))
    finally:
        conn.close()
        try:
            shutdown_distributed()
        finally:
            os._exit(0)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                    threads_per_rank: int | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return each rank's result.

    ``fn`` must be importable by name (defined at module level). Inside it the default process
    group is up: build a :class:`zerospeed.dist.Comm` and go.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "zerospeed.testing.dist"])
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    store = dist.TCPStore(_HOST, 0, world_size, is_master=True, wait_for_workers=False)
    procs, conns = [], {}
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_rank_main, name=f"zerospeed-rank{rank}", daemon=True,
                               args=(fn, rank, world_size, store.port, threads, child_end, args, kwargs))
            proc.start()
            child_end.close()
            procs.append(proc)
            conns[parent_end] = rank
        return _collect(procs, conns, world_size, timeout)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=10)
        for conn in conns:
            conn.close()
        del store


def _collect(procs: list, conns: dict, world_size: int, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    reports: dict[int, _Report] = {}
    pending = dict(conns)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(pending.values())
            raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:g}s "
                               f"(finished: {sorted(reports)})")
        for conn in mpc.wait(list(pending), timeout=min(left, 0.5)):
            rank = pending.pop(conn)
            try:
                report = conn.recv()
            except EOFError:
                code = procs[rank].exitcode
                procs[rank].join(timeout=5)
                code = procs[rank].exitcode if code is None else code
                raise RankFailed(f"rank {rank} died without reporting (exit code {code})") from None
            reports[rank] = report
            if report.status == "error":
                raise RankFailed(f"rank {rank} of {world_size} failed:\n{report.payload}")
    skips = [reports[rank] for rank in sorted(reports) if reports[rank].status == "skip"]
    if skips:
        import pytest

        pytest.skip(f"rank {skips[0].rank}: {skips[0].payload}")
    return [reports[rank].payload for rank in range(world_size)]
