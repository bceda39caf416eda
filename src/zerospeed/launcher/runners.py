"""Start the ranks of a :class:`LaunchPlan`.

Single-node jobs run under torch's elastic agent (the machinery behind ``torchrun``): it starts one
process per rank with ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``LOCAL_WORLD_SIZE``/``MASTER_ADDR``/
``MASTER_PORT`` set, hosts the rendezvous store, watches the workers and, because we allow no
restarts, stops every other rank as soon as one fails. We only translate our plan into its
``LaunchConfig`` and its outcome into an exit code. Multi-node runners (ssh/pdsh, slurm, mpirun)
come later and will sit next to :func:`run_local`.

Each rank starts through :mod:`~zerospeed.launcher.worker_guard` (:func:`guarded_command`), which
stops the rank and removes the launch's temporary folder if this process dies without doing so
itself (SIGKILL, the OOM killer); while we live, nothing changes: the agent stops, reports and
cleans up as before.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import sys
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, TextIO

from zerospeed.distributed.defaults import free_port
from zerospeed.launcher.errors import LauncherError, MultiNodeNotImplementedError
from zerospeed.launcher.plan import DEFAULT_MASTER_PORT, LaunchPlan, Program
from zerospeed.launcher.worker_guard import RUN_DIR_PREFIX, ProcessIdentity, guard_argv

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

__all__ = ["choose_master_port", "guarded_command", "local_command", "port_is_free", "run", "run_local"]

# torch's agent substitutes this macro in worker arguments with each worker's local rank.
_LOCAL_RANK_MACRO = "${local_rank}"
# Seconds between SIGTERM and SIGKILL when the agent stops the surviving ranks after a failure.
_SHUTDOWN_GRACE_S = 10
# How often the agent polls its workers; bounds how fast a failure is noticed.
_MONITOR_INTERVAL_S = 0.1


def run(plan: LaunchPlan, *, log: TextIO | None = None) -> int:
    """Launch ``plan`` with the runner that fits it and return the job's exit code."""
    if plan.num_nodes != 1:
        raise MultiNodeNotImplementedError(
            f"multi-node launch is not implemented yet ({plan.num_nodes} hosts: "
            f"{', '.join(plan.resources)})"
        )
    return run_local(plan, log=log)


def local_command(program: Program, python: str | None = None) -> tuple[str, list[str]]:
    """The worker command as torch's agent wants it: an executable plus per-rank argument templates.

    The agent runs :class:`string.Template` substitution over every argument (``$$`` -> ``$``,
    ``${local_rank}`` -> the rank), so user text is escaped to reach the script unchanged.
    """
    user = [_escape_macros(arg) for arg in program.args]
    if program.append_local_rank:
        user.append(f"--local_rank={_LOCAL_RANK_MACRO}")
    if program.no_python:  # the agent substitutes arguments only, never the executable
        return program.script, user
    user.insert(0, _escape_macros(program.script))
    flags = ["-u", "-m"] if program.module else ["-u"]
    return python or sys.executable, flags + user


def guarded_command(command: tuple[str, list[str]], *, run_dir: str, grace_s: float,
                    launcher: ProcessIdentity | None = None,
                    python: str | None = None) -> tuple[str, list[str]]:
    """Wrap :func:`local_command`'s ``command`` so the rank runs under the worker guard.

    The guard watches ``launcher`` (this process by default), replaces itself with the command by
    ``exec`` (same PID, argv, environment and exit status as without it) and, if the launcher dies
    first, stops the rank (SIGTERM, SIGKILL after ``grace_s``) and helps remove ``run_dir``. The
    command's executable becomes an argument, so it is escaped for the agent's substitution too.
    """
    entry, args = command
    launcher = ProcessIdentity.of(os.getpid()) if launcher is None else launcher
    guard = guard_argv(launcher, [], run_dir=run_dir, grace_s=grace_s)
    return python or sys.executable, [*(_escape_macros(a) for a in guard), _escape_macros(entry), *args]


def _escape_macros(arg: str) -> str:
    return arg.replace("$", "$$")


def port_is_free(port: int) -> bool:
    """Whether a TCP server could listen on ``port`` on all interfaces right now.

    ``SO_REUSEADDR`` mirrors what the rendezvous store does, so ports in TIME_WAIT count as free.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def choose_master_port(
    requested: int | None, *, default: int = DEFAULT_MASTER_PORT, log: TextIO | None = None
) -> int:
    """Resolve the rendezvous port: an explicit port must be free, ``0`` means any free port, and
    an unspecified port is ``default`` (29500) unless that is busy, in which case we pick a free
    one. (Probing then binding leaves a tiny window for another process to take the port.)"""
    if requested is None:
        if port_is_free(default):
            return default
        port = free_port()
        if log is not None:
            print(f"zerospeed: default master port {default} is busy, using free port {port}",
                  file=log)
        return port
    if requested == 0:
        return free_port()
    if not port_is_free(requested):
        raise LauncherError(
            f"--master_port {requested} is already in use on this machine; pass another port, "
            "--master_port 0 for any free port, or omit it"
        )
    return requested


def run_local(plan: LaunchPlan, *, log: TextIO | None = None) -> int:
    """Run all ranks of a single-node plan under torch's elastic agent; return the exit code.

    Worker stdout/stderr are inherited, so a failing rank's traceback appears in our output as it
    happens. On failure the agent terminates the other ranks and we return the failed rank's exit
    code (128 + signal number if it was killed by a signal). The port is chosen before torch is
    imported (sockets only), so a busy ``--master_port`` is refused at once.
    """
    log = sys.stderr if log is None else log
    port = choose_master_port(plan.master_port, log=log)

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    host = f"[{plan.master_addr}]" if ":" in plan.master_addr else plan.master_addr
    with tempfile.TemporaryDirectory(prefix=RUN_DIR_PREFIX) as run_dir, _patched_environ(
        _worker_environ(plan, os.environ)
    ):
        entrypoint, args = guarded_command(local_command(plan.program), run_dir=run_dir,
                                           grace_s=_SHUTDOWN_GRACE_S)
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=plan.nproc_per_node,
            run_id=f"zerospeed-{uuid.uuid4().hex[:12]}",
            role="zerospeed",
            rdzv_backend="static",
            rdzv_endpoint=f"{host}:{port}",
            rdzv_configs={"rank": 0},
            max_restarts=0,
            monitor_interval=_MONITOR_INTERVAL_S,
            local_addr=plan.master_addr,
            logs_specs=DefaultLogsSpecs(log_dir=run_dir),
            shutdown_timeout=_SHUTDOWN_GRACE_S,
        )
        try:
            elastic_launch(config, entrypoint)(*args)
        except ChildFailedError as failed:
            return _report_failure(failed, log)
        except SignalException as stopped:
            print(f"zerospeed: stopped by {stopped.sigval.name}; all ranks were terminated", file=log)
            return 128 + int(stopped.sigval)
    return 0


def _worker_environ(plan: LaunchPlan, parent: Mapping[str, str]) -> dict[str, str]:
    """Variables every rank inherits on top of ours (the agent adds the per-rank ones)."""
    extra: dict[str, str] = {}
    if plan.visible_devices is not None:
        extra["CUDA_VISIBLE_DEVICES"] = ",".join(plan.visible_devices)
    if "OMP_NUM_THREADS" not in parent and plan.nproc_per_node > 1:
        # Like torchrun: N ranks each spawning one OpenMP thread per core oversubscribe the CPU.
        extra["OMP_NUM_THREADS"] = "1"
    return extra


@contextlib.contextmanager
def _patched_environ(extra: Mapping[str, str]) -> Iterator[None]:
    """Temporarily extend ``os.environ``: the agent builds worker environments from it, and it also
    writes variables of its own there; restoring the snapshot keeps ``main()`` free of side effects."""
    saved = dict(os.environ)
    os.environ.update(extra)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _report_failure(failed: ChildFailedError, log: TextIO) -> int:
    """Name the rank that failed first and how; its traceback was already streamed to our stderr.

    Ranks the agent terminated afterwards are listed as stopped, not as failures, so the summary
    points at the root cause.
    """
    first_rank, first = failed.get_first_failure()
    print(
        f"zerospeed: rank {first_rank} (local_rank {first.local_rank}, pid {first.pid}) "
        f"{_describe_exit(first.exitcode)}; see its output above",
        file=log,
    )
    others = [rank for rank in sorted(failed.failures) if rank != first_rank]
    stopped = [r for r in others if failed.failures[r].exitcode == -int(signal.SIGTERM)]
    for rank in others:
        if rank not in stopped:
            print(f"zerospeed: rank {rank} also {_describe_exit(failed.failures[rank].exitcode)}",
                  file=log)
    if stopped:
        print(f"zerospeed: stopped the remaining rank(s) {', '.join(map(str, stopped))}", file=log)
    code = first.exitcode
    if code < 0:
        return 128 + (-code)
    return code if code > 0 else 1


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"
