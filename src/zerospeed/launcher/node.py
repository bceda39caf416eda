"""The node agent: one per host of a multi-node job, ``python -u -m zerospeed.launcher.node --job=<token>``.

Every runner (pdsh, ssh, ``mpirun``, ``srun``, or the user under ``--no_ssh``) starts this once per host.
It reads the job (:class:`~zerospeed.launcher.job.JobSpec`), finds its node rank
(:func:`~zerospeed.launcher.job.node_rank_of`: ``--node_rank``, ``--node_host``, or the runner's
variables), and runs this host's ranks under torch's elastic agent, configured by the same builder as
single-node launches (:func:`~zerospeed.launcher.runners.agent_config`): the static rendezvous for a
fixed job, c10d for ``--elastic_training``. Each rank starts through the worker guard, as locally.

What it adds (see :mod:`zerospeed.launcher.agent` for the output and restart mechanics):

- every line of every rank is prefixed ``[<host> rank <global rank>] ``, whole lines only;
- ``each_rank_log_dir``: each rank's output also in ``<dir>/<start time>_<host>_rank<r>.log``;
- ``bind_cores_to_rank``: each local rank pinned to its share of the cores (DeepSpeed's rule), with
  ``OMP_NUM_THREADS`` set to that share's size;
- the job folder ``<tempfile.gettempdir()>/zerospeed-job-<job id>-<hostname>-n<node rank>/`` holding ``agent.pid`` (this
  process) and ``workers.pid``, removed at exit (by the ranks' watchers if this process is killed
  outright): stopping the job on a host is ``kill -TERM $(cat .../agent.pid)``;
- ``save_pid`` (DeepSpeed's ``--save_pid``): ``launcher pid: <pid>`` printed and written to
  ``<tempfile.gettempdir()>/<N>.deepspeed``, N being ``--save_pid N`` (the runner's PID) or else the PID
  of the process that started this agent; removed at exit (when several hosts share ``/tmp`` the first
  agent's file stays, the others say so);
- SIGTERM/SIGINT/SIGHUP/SIGQUIT stop the ranks (the same signal, SIGKILL after the grace) and exit
  128 + the signal; with ``--watch_stdin`` the end of stdin (the runner's pipe: the runner died) does
  what SIGTERM does;
- a failed rank: exit non-zero with one line ``zerospeed: host <h> rank <r> (local <l>, pid <p>)
  exited with code X`` (or ``was killed by SIG...``);
- elastic restarts: ``ZEROSPEED_ELASTIC_LOST_AT``/``ZEROSPEED_ELASTIC_RESTART_COUNT`` in the new
  workers' environment (:mod:`zerospeed.launcher.elastic_env`), which the engine turns into its
  downtime line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import TextIO

from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.job import JobSpec, node_rank_of
from zerospeed.launcher.runners import (
    _SHUTDOWN_GRACE_S,
    _patched_environ,
    _report_failure,
    agent_config,
    guarded_command,
    local_command,
    run_agent,
)
from zerospeed.launcher.worker_guard import JOB_DIR_PREFIX, cores_of_rank, default_core_list, parse_core_list

__all__ = ["AGENT_PID_FILE", "job_dir_of", "main", "parse_rdzv_conf", "rendezvous_configs", "worker_environ"]

# In the job folder: this agent's PID (``kill -TERM`` it to stop the job on this host).
AGENT_PID_FILE = "agent.pid"
# Signals that stop the job on this host (torch's agent handles the same set once workers run).
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
# Seconds to wait, after the ranks ended, for the rest of their output.
_OUTPUT_DRAIN_S = 5.0
# After a stop signal: how long the agent's own stop path may take before the watchdog exits for it. With
# ranks started, their grace and then some; before (nothing to stop), a moment for the Python handler.
_WATCHDOG_GRACE_S = _SHUTDOWN_GRACE_S + 5.0
# After SIGKILL of a stale agent: how long to wait for the kernel to end it.
_KILLED_WAIT_S = 5.0
_WATCHDOG_NO_WORKERS_S = 2.0
# How a live process is recognised as a node agent: ``python -m zerospeed.launcher.node`` (every runner),
# or ``zerospeed --no_ssh``, which runs the agent in-process.
_AGENT_MODULE = b"zerospeed.launcher.node"
_JOB_ID = re.compile(r"[A-Za-z0-9._-]+")


def job_dir_of(job_id: str, tmp: str | None = None, *, node_rank: int = 0, hostname: str | None = None) -> str:
    """``<tmp>/zerospeed-job-<job_id>-<hostname>-n<node_rank>``: this agent's folder (runners build stop
    commands from it: ``commands.agent_pid_file``). The host's own name (``uname -n``) and the node rank
    are in it because hosts may share ``/tmp`` (a shared file system, or test hosts on one machine): each
    agent's PID file must be its own. A job id that could leave the folder (``/``, ``..``) is refused."""
    if not _JOB_ID.fullmatch(job_id) or job_id in (".", ".."):
        raise LauncherError(f"job id {job_id!r} may only hold letters, digits and '._-'")
    name = os.uname().nodename if hostname is None else hostname
    if "/" in name or name in ("", ".", ".."):
        raise LauncherError(f"host name {name!r} cannot name a folder")
    return os.path.join(tmp or tempfile.gettempdir(), f"{JOB_DIR_PREFIX}{job_id}-{name}-n{node_rank}")


def parse_rdzv_conf(text: str | None) -> dict[str, str]:
    """torchrun's ``--rdzv-conf`` syntax, ``key=value,key=value`` (e.g. ``last_call_timeout=2``)."""
    conf: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise LauncherError(f"--rdzv_conf item {item!r} is not key=value (e.g. last_call_timeout=5)")
        conf[key.strip()] = value.strip()
    return conf


def rendezvous_configs(spec: JobSpec, rdzv_conf: str | None) -> dict[str, str]:
    """The rendezvous settings this agent gives torch: an elastic job's own (``spec.elastic.rdzv_configs``,
    shorter than torch's defaults, which make a survivor wait ~45 s after a loss: see
    :data:`zerospeed.launcher.job.DEFAULT_RDZV_CONFIGS`), then ``--rdzv_conf`` key by key on top (tests
    and experiments shorten them further). A fixed job's static rendezvous has none of its own."""
    configs = dict(spec.elastic.rdzv_configs) if spec.elastic is not None else {}
    configs.update(parse_rdzv_conf(rdzv_conf))
    return configs


def worker_environ(spec: JobSpec, node_rank: int, parent: Mapping[str, str], *,
                   cuda_devices: int) -> dict[str, str]:
    """Variables this host's ranks get on top of the agent's own (torch's agent adds the per-rank ones):
    ``CUDA_VISIBLE_DEVICES`` from the host's slots when CUDA devices exist (as DeepSpeed's launch does,
    mapped through an inherited value), ``OMP_NUM_THREADS=1`` for several ranks unless set (as
    single-node launches; a core binding sets it per rank instead), then the job's ``worker_env``.

    Elastic jobs also get ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (read by the agent's c10d rendezvous
    too, which runs inside the same patched environment): by default the ranks of every rendezvous round
    meet on the agents' one long-lived store, where the previous round's keys (each rank's gloo address)
    are still set, so a restarted rank connects to a rank that no longer listens ("Connection refused").
    With the variable set, rank 0 of each round serves a fresh store on a free port the agents agree on."""
    from zerospeed.launcher.plan import _visible_devices

    slots = spec.slots_of(node_rank)
    extra: dict[str, str] = {}
    if cuda_devices > 0:
        visible = _visible_devices(list(slots), parent.get("CUDA_VISIBLE_DEVICES"))
        extra["CUDA_VISIBLE_DEVICES"] = ",".join(visible)
    if "OMP_NUM_THREADS" not in parent and len(slots) > 1:
        extra["OMP_NUM_THREADS"] = "1"
    if spec.elastic is not None:
        extra["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    extra.update(spec.worker_env)
    return extra


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m zerospeed.launcher.node", allow_abbrev=False,
                                     description="Run one host's ranks of a multi-node zerospeed job.")
    parser.add_argument("--job", required=True, help="the job, as the runner encoded it")
    parser.add_argument("--node_rank", type=int, default=None, help="this host's index in the job's hosts")
    parser.add_argument("--node_host", default=None, help="this host's name in the job's hosts (pdsh's %%h)")
    parser.add_argument("--watch_stdin", action="store_true",
                        help="stop the ranks and exit when stdin reaches its end (the runner died)")
    parser.add_argument("--save_pid", type=int, default=0,
                        help="write this agent's PID to <tmp>/<SAVE_PID>.deepspeed (DeepSpeed's launch)")
    parser.add_argument("--rdzv_conf", default=None,
                        help="elastic jobs: torch rendezvous settings key=value,... over the job's own "
                        "(last_call_timeout=...)")
    return parser.parse_args(list(argv))


def main(argv: Sequence[str] | None = None, *, log: TextIO | None = None) -> int:
    """Run this host's share of the job; the exit code (0, the failed rank's, 128 + a signal, 1 or 2)."""
    log = sys.stderr if log is None else log
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    try:
        spec = JobSpec.decode(args.job)
        node_rank = node_rank_of(spec, explicit=args.node_rank, host=args.node_host, environ=os.environ)
        rdzv_conf = rendezvous_configs(spec, args.rdzv_conf)
        _check_binding(spec, node_rank, os.environ)
        job_dir = job_dir_of(spec.job_id, node_rank=node_rank)
    except LauncherError as exc:
        print(f"zerospeed: error: {exc}", file=log, flush=True)
        return 2
    host = spec.hosts[node_rank]
    from torch.distributed.elastic.multiprocessing import SignalException

    def stop(signum: int, frame: object) -> None:
        sigval = signal.Signals(signum)
        raise SignalException(f"node agent {os.getpid()} got {sigval.name}", sigval=sigval)

    previous = {sig: signal.signal(sig, stop) for sig in _STOP_SIGNALS}
    saved: list[str] = []

    def cleanup() -> None:  # the watchdog's, when the main thread never comes back from C++
        if _agent_pid(job_dir) == os.getpid():
            shutil.rmtree(job_dir, ignore_errors=True)
        for path in saved:
            with contextlib.suppress(OSError):
                os.remove(path)

    try:
        with _StopWatchdog(job_dir, cleanup, log), _job_folder(job_dir, log) as folder, \
                _saved_pid(spec.save_pid or bool(args.save_pid), args.save_pid or os.getppid(), log) as saved_path:
            if saved_path is not None:
                saved.append(saved_path)
            if args.watch_stdin:
                threading.Thread(target=_watch_stdin, name="zerospeed-watch-stdin", daemon=True).start()
            return _run(spec, node_rank, host, folder, rdzv_conf, log)
    except SignalException as stopped:  # before the ranks started, or while cleaning up
        print(f"zerospeed: host {host}: stopped by {stopped.sigval.name}", file=log, flush=True)
        return 128 + int(stopped.sigval)
    except LauncherError as exc:
        print(f"zerospeed: error: host {host}: {exc}", file=log, flush=True)
        return 2
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(spec: JobSpec, node_rank: int, host: str, job_dir: str, rdzv_conf: Mapping[str, str],
         log: TextIO) -> int:
    """Start the agent with this host's ranks; report how they ended."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError

    from zerospeed.launcher.agent import NodeAgent, NodeLogsSpecs, OutputRouter

    if spec.each_rank_log_dir:
        _make_log_dir(spec.each_rank_log_dir)
    router = OutputRouter(os.path.join(job_dir, "output"), host, each_rank_log_dir=spec.each_rank_log_dir)
    bind = (spec.bind_core_list or "all") if spec.bind_cores_to_rank else None
    entrypoint, args = guarded_command(local_command(spec.program), run_dir=job_dir, grace_s=_SHUTDOWN_GRACE_S,
                                       bind_cores=bind)
    elastic = spec.elastic
    config = agent_config(
        nproc_per_node=len(spec.slots_of(node_rank)),
        run_id=spec.job_id,
        master_addr=spec.master_addr,
        master_port=spec.master_port,
        node_rank=node_rank,
        num_nodes=len(spec.world),
        logs_specs=NodeLogsSpecs(os.path.join(job_dir, "logs"), router),
        local_addr=host,
        elastic=None if elastic is None else (elastic.min_nodes, elastic.max_nodes, elastic.max_restarts),
        rdzv_configs=rdzv_conf,
    )
    if len(spec.world) > 1:
        print(f"zerospeed: host {host} (node {node_rank}): waiting for {len(spec.world) - 1} other host(s) at "
              f"{spec.master_addr}:{spec.master_port} (job {spec.job_id})", file=log, flush=True)
    try:
        with _patched_environ(worker_environ(spec, node_rank, os.environ, cuda_devices=_cuda_devices())):
            run_agent(config, entrypoint, args, agent_class=partial(NodeAgent, job_dir=job_dir))
    except ChildFailedError as failed:
        router.close(_OUTPUT_DRAIN_S)  # the failed rank's last lines come before the summary
        return _report_failure(failed, log, host=host)
    except SignalException as stopped:
        router.close(_OUTPUT_DRAIN_S)
        print(f"zerospeed: host {host}: stopped by {stopped.sigval.name}; its ranks were terminated",
              file=log, flush=True)
        return 128 + int(stopped.sigval)
    except RendezvousError as exc:
        router.close(_OUTPUT_DRAIN_S)
        print(f"zerospeed: host {host}: the rendezvous at {spec.master_addr}:{spec.master_port} failed "
              f"({type(exc).__name__}: {exc}); check that node 0 ({spec.hosts[0]}) runs its agent and that "
              "this host reaches that address and port", file=log, flush=True)
        return 1
    router.close(_OUTPUT_DRAIN_S)
    return 0


def _check_binding(spec: JobSpec, node_rank: int, environ: Mapping[str, str]) -> None:
    """Refuse a core binding that cannot work before any rank starts (the guard would fail each rank)."""
    if not spec.bind_cores_to_rank:
        return
    if "KMP_AFFINITY" in environ:  # DeepSpeed refuses it for the same reason
        raise LauncherError("KMP_AFFINITY is set, which conflicts with --bind_cores_to_rank (it overrides "
                            "the cores each rank is bound to); unset KMP_AFFINITY")
    try:
        cores = parse_core_list(spec.bind_core_list) if spec.bind_core_list else default_core_list()
        cores_of_rank(cores, 0, len(spec.slots_of(node_rank)))
    except ValueError as exc:
        raise LauncherError(str(exc)) from None


def _make_log_dir(path: str) -> None:
    if os.path.isfile(path):
        raise LauncherError(f"--enable_each_rank_log {path!r} is a file; give a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise LauncherError(f"--enable_each_rank_log {path!r}: cannot create the folder ({exc.strerror})") from None


class _StopWatchdog:
    """Exits the agent when a stop signal did not end it in time.

    Python runs signal handlers only when the main thread is back in the interpreter; torch's static
    rendezvous blocks in C++ (node 0's ``TCPStore`` waiting for the other agents, the others retrying to
    connect) for up to its 15 min timeout, so SIGINT/SIGTERM (and ``--watch_stdin``'s EOF, which sends
    SIGTERM) would be ignored that long, the master port kept bound. ``signal.set_wakeup_fd`` makes the
    C-level handler write the signal number to a pipe even then (for every signal that has a Python
    handler: ours, or the ones torch's agent installs later, since the wakeup fd is independent of which
    Python function handles the signal); a daemon thread reads it and, when the process is still here
    :data:`_WATCHDOG_GRACE_S` after a stop signal (:data:`_WATCHDOG_NO_WORKERS_S` while no rank was
    ever started: there is nothing to stop), says so, runs ``cleanup`` (the job folder) and
    ``os._exit(128 + signal)``; ranks started meanwhile end through their worker guards, which watch
    this agent. Armed only in the main thread (the only one that may set the wakeup fd); it restores
    the previous wakeup fd at exit (``zerospeed --no_ssh`` runs the agent in-process)."""

    def __init__(self, job_dir: str, cleanup: Callable[[], None], log: TextIO) -> None:
        self._job_dir = job_dir
        self._cleanup = cleanup
        self._log = log
        self._done = threading.Event()
        self._previous_fd: int | None = None
        self._write_fd = -1

    def __enter__(self) -> _StopWatchdog:
        if threading.current_thread() is not threading.main_thread():
            return self
        read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # set_wakeup_fd requires it
        self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read_fd,), name="zerospeed-stop-watchdog", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._previous_fd is not None:
            signal.set_wakeup_fd(self._previous_fd)
            os.close(self._write_fd)  # the reader sees EOF and ends

    def _watch(self, read_fd: int) -> None:
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            while not self._done.is_set():
                data = pipe.read(64)
                if not data:
                    return
                stops = [number for number in data if number in {int(sig) for sig in _STOP_SIGNALS}]
                if stops:
                    self._expire(signal.Signals(stops[0]))
                    return

    def _expire(self, sig: signal.Signals) -> None:
        from zerospeed.launcher.agent import WORKERS_PID_FILE

        started = os.path.exists(os.path.join(self._job_dir, WORKERS_PID_FILE))
        wait_s = _WATCHDOG_GRACE_S if started else _WATCHDOG_NO_WORKERS_S
        if self._done.wait(wait_s):
            return  # the agent's own stop path finished
        try:
            print(f"zerospeed: node agent still waiting in the rendezvous {wait_s:g} s after {sig.name}; exiting",
                  file=self._log, flush=True)
        except (OSError, ValueError):
            pass
        self._cleanup()
        os._exit(128 + int(sig))


@contextlib.contextmanager
def _job_folder(path: str, log: TextIO) -> Iterator[str]:
    """Create the job folder with ``agent.pid``; remove it at exit.

    A folder left by an agent that is gone is taken over, as is one whose PID now belongs to a process
    that is no node agent (a recycled PID). One whose node agent still runs is the SAME job and node
    rank (both are in the folder's name): an agent left behind a network partition, which the runner
    (or the user) replaced only after losing it; this newer agent stops it (SIGTERM, SIGKILL after
    :data:`_WATCHDOG_GRACE_S`) and takes over, else the old one would hold this host's ranks and port."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        other = _agent_pid(path)
        if other is not None and other != os.getpid() and _alive(other) and _is_node_agent(other):
            print(f"zerospeed: replacing the node agent of this job still running here (pid {other}, "
                  f"{os.path.join(path, AGENT_PID_FILE)}): stopping it", file=log, flush=True)
            _stop_agent(other, _WATCHDOG_GRACE_S)
        shutil.rmtree(path, ignore_errors=True)
        os.mkdir(path, 0o700)
    try:
        with open(os.path.join(path, AGENT_PID_FILE), "w") as fh:
            fh.write(f"{os.getpid()}\n")
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _agent_pid(path: str) -> int | None:
    try:
        with open(os.path.join(path, AGENT_PID_FILE)) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def _is_node_agent(pid: int) -> bool:
    """Whether ``pid`` runs a node agent, from ``/proc/<pid>/cmdline``; a process that cannot be read
    (gone, or no ``/proc``) counts as one while it is alive (the safe side: it is stopped by PID)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            args = fh.read().split(b"\0")
    except FileNotFoundError:
        return _alive(pid)
    except OSError:
        return True
    if _AGENT_MODULE in args or any(arg.endswith(b"zerospeed/launcher/node.py") for arg in args):
        return True
    return b"--no_ssh" in args and any(os.path.basename(arg) == b"zerospeed" for arg in args)


def _stop_agent(pid: int, grace_s: float) -> None:
    """SIGTERM ``pid`` (it stops its ranks), SIGKILL when still there after ``grace_s``."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    killed = False
    while _alive(pid) and not _zombie(pid):
        if not killed and time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            # SIGKILL is delivered asynchronously: wait (bounded) until the kernel has ended it, so its
            # ports and files are free before this agent starts its ranks.
            killed, deadline = True, time.monotonic() + _KILLED_WAIT_S
        elif killed and time.monotonic() > deadline:
            break
        time.sleep(0.05)


def _zombie(pid: int) -> bool:
    """An exited process its parent has not reaped yet (it holds nothing any more)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _saved_pid(enabled: bool, owner: int, log: TextIO) -> Iterator[str | None]:
    """DeepSpeed's ``--save_pid``: ``<tmp>/<owner>.deepspeed`` holds this agent's PID while it runs;
    yields that path when this agent wrote it (else ``None``)."""
    if not enabled:
        yield None
        return
    path = os.path.join(tempfile.gettempdir(), f"{owner}.deepspeed")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        # Another agent of this job on a host sharing /tmp (same runner PID), or a file left by a launch
        # that is gone: never overwrite or remove a file this agent did not write.
        print(f"zerospeed: --save_pid: {path} exists already (another agent sharing this /tmp, or a file "
              f"left by an earlier launch); this agent's PID is {os.getpid()}", file=log, flush=True)
        yield None
        return
    with os.fdopen(fd, "w") as fh:
        fh.write(f"{os.getpid()}")
    print(f"launcher pid: {os.getpid()}", file=log, flush=True)
    try:
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _watch_stdin() -> None:
    """Block on stdin; at its end (the runner that holds the other end is gone) stop like SIGTERM."""
    try:
        while os.read(0, 65536):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


if __name__ == "__main__":
    sys.exit(main())
