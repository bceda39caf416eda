"""Run a function on N real processes with a gloo process group, for tests.

The parent hosts the rendezvous store on a free port (no port races between concurrent tests),
starts the ranks from a forkserver that has torch imported already (fast), and collects each
rank's result over a pipe. A rank that raises stops the whole run at once and its traceback is
re-raised in the parent; ``pytest.skip`` inside any rank skips the test; a rank that hangs past
the timeout has its Python stack dumped into the error, then is killed. Ranks report *before*
they exit and then leave with ``os._exit`` after destroying their process group, so torch's
occasional abort at interpreter shutdown cannot turn a passing run into a failure. Each rank
also holds a lifeline pipe to the test process and exits if that process dies, so no rank is
ever orphaned.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from zerospeed.distributed.defaults import DEFAULT_ADDR

_HOST = DEFAULT_ADDR
_STACK_DUMP_GRACE_S = 1.0


class RankFailed(AssertionError):
    """A rank raised; the message carries that rank's traceback."""


@dataclass(frozen=True)
class _Report:
    rank: int
    status: str  # "ok" | "error" | "skip"
    payload: Any


@dataclass(frozen=True)
class _RankSetup:
    rank: int
    world_size: int
    port: int
    threads: int
    stack_file: str
    pg_timeout: float | None = None


def _exit_when_parent_dies(lifeline: mpc.Connection) -> None:
    """Block on the lifeline; EOF means the test process is gone, so this rank must go too."""
    try:
        lifeline.recv()
    except (EOFError, OSError):
        pass
    os._exit(1)


def _rank_main(fn: Callable[..., Any], setup: _RankSetup, conn: mpc.Connection, lifeline: mpc.Connection,
               args: tuple, kwargs: dict) -> None:
    """Entry point of one rank (runs in the child)."""
    from zerospeed.distributed import env as dist_env

    threading.Thread(target=_exit_when_parent_dies, args=(lifeline,), daemon=True).start()
    stack_file = open(setup.stack_file, "w")  # noqa: SIM115 - lives until os._exit
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    rank, world_size = setup.rank, setup.world_size
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=_HOST, MASTER_PORT=str(setup.port))
    torch.set_num_threads(setup.threads)
    report: _Report
    try:
        store = dist.TCPStore(_HOST, setup.port, world_size, is_master=False)
        if setup.pg_timeout is None:
            dist_env.init_distributed(dist_backend="gloo", store=store)
        else:
            dist_env.init_distributed(dist_backend="gloo", store=store,
                                      timeout=datetime.timedelta(seconds=setup.pg_timeout))
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
            dist_env.shutdown_distributed()  # looked up late so a test can make it misbehave
        finally:
            os._exit(0)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                    threads_per_rank: int | None = None, pg_timeout: float | None = None,
                    **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return each rank's result.

    ``fn`` must be importable by name (defined at module level). Inside it the default process
    group is up (started with ``pg_timeout`` seconds, as ``init_distributed(timeout=...)`` would,
    when given): build a :class:`zerospeed.distributed.Comm` and go.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    ctx = mp.get_context("forkserver")
    # torch._dynamo: the first torch.optim optimizer imports it (~4 s per rank when not preloaded).
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "zerospeed.testing.dist"])
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    store = dist.TCPStore(_HOST, 0, world_size, is_master=True, wait_for_workers=False)
    procs: list[BaseProcess] = []
    conns: dict[mpc.Connection, int] = {}  # the parent's end of each rank's result pipe -> rank
    lifelines: list[mpc.Connection] = []
    with tempfile.TemporaryDirectory(prefix="zerospeed-ranks-") as stacks:
        try:
            for rank in range(world_size):
                parent_end, child_end = ctx.Pipe(duplex=False)
                life_read, life_write = ctx.Pipe(duplex=False)
                setup = _RankSetup(rank, world_size, store.port, threads, str(Path(stacks) / f"rank{rank}.txt"),
                                   pg_timeout)
                proc: BaseProcess = ctx.Process(target=_rank_main, name=f"zerospeed-rank{rank}", daemon=True,
                                   args=(fn, setup, child_end, life_read, args, kwargs))
                proc.start()
                child_end.close()
                life_read.close()
                procs.append(proc)
                conns[parent_end] = rank
                lifelines.append(life_write)
            return _collect(procs, conns, world_size, timeout, Path(stacks))
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
            for proc in procs:
                proc.join(timeout=10)
            for conn in [*conns, *lifelines]:
                conn.close()
            del store


def _collect(procs: list[BaseProcess], conns: dict[mpc.Connection, int], world_size: int, timeout: float,
             stacks: Path) -> list[Any]:
    deadline = time.monotonic() + timeout
    reports: dict[int, _Report] = {}
    pending = dict(conns)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(pending.values())
            raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:g}s "
                               f"(finished: {sorted(reports)}){_stack_dumps(procs, missing, stacks)}")
        for ready in mpc.wait(list(pending), timeout=min(left, 0.5)):
            # wait() returns some of the objects it was given, and those are all pipe connections
            if not isinstance(ready, mpc.Connection):
                raise TypeError(f"multiprocessing.connection.wait returned {ready!r}, not one of the rank pipes")
            rank = pending.pop(ready)
            try:
                report: _Report = ready.recv()
            except EOFError:
                procs[rank].join(timeout=5)
                raise RankFailed(f"rank {rank} died without reporting (exit code {procs[rank].exitcode})") from None
            reports[rank] = report
            if report.status == "error":
                raise RankFailed(f"rank {rank} of {world_size} failed:\n{report.payload}")
            if report.status == "skip":  # the others may now fail or hang for want of this rank
                import pytest

                pytest.skip(f"rank {rank}: {report.payload}")
    return [reports[rank].payload for rank in range(world_size)]


def _stack_dumps(procs: list, ranks: list[int], stacks: Path) -> str:
    """Ask hung ranks for their Python stacks (faulthandler on SIGUSR1) and return them as text."""
    for rank in ranks:
        if procs[rank].is_alive():
            os.kill(procs[rank].pid, signal.SIGUSR1)
    time.sleep(_STACK_DUMP_GRACE_S)
    parts = []
    for rank in ranks:
        text = (stacks / f"rank{rank}.txt").read_text(errors="replace").strip()
        parts.append(f"\n--- rank {rank} stack ---\n{text or '(no stack dump)'}")
    return "".join(parts)


@contextmanager
def one_process_group() -> Iterator[None]:
    """A one-rank gloo group in this process for the duration (engines built in-process, no spawn); left
    alone when a group already runs. Restores the environment and destroys the group afterwards."""
    if dist.is_initialized():
        yield
        return
    from zerospeed.distributed.defaults import free_port
    from zerospeed.distributed.env import init_distributed

    saved = dict(os.environ)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR=_HOST, MASTER_PORT=str(free_port()))
    init_distributed(dist_backend="gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)
