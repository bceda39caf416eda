"""Start the ranks of a :class:`LaunchPlan`.

Single-node jobs run under torch's elastic agent (the machinery behind ``torchrun``): it starts one
process per rank with ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``LOCAL_WORLD_SIZE``/``MASTER_ADDR``/
``MASTER_PORT`` set, hosts the rendezvous store, watches the workers and, because we allow no
restarts, stops every other rank as soon as one fails. We only translate our plan into its
``LaunchConfig`` and its outcome into an exit code. Multi-node jobs run one node agent per host
(:mod:`~zerospeed.launcher.node`), which builds its ``LaunchConfig`` with the same :func:`agent_config`
and runs it with :func:`run_agent`; the launching host's side is :mod:`~zerospeed.launcher.multinode`.

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
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, TextIO

from zerospeed.distributed.defaults import free_port
from zerospeed.launcher.errors import LauncherError, MultiNodeNotImplementedError
from zerospeed.launcher.plan import DEFAULT_MASTER_PORT, LaunchPlan, Program
from zerospeed.launcher.worker_guard import RUN_DIR_PREFIX, ProcessIdentity, guard_argv

if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import LogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig

__all__ = ["agent_config", "choose_master_port", "guarded_command", "local_command", "port_is_free", "run",
           "run_agent", "run_local"]

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
                    python: str | None = None, bind_cores: str | None = None) -> tuple[str, list[str]]:
    """Wrap :func:`local_command`'s ``command`` so the rank runs under the worker guard.

    The guard watches ``launcher`` (this process by default), replaces itself with the command by
    ``exec`` (same PID, argv, environment and exit status as without it) and, if the launcher dies
    first, stops the rank (SIGTERM, SIGKILL after ``grace_s``) and helps remove ``run_dir``. The
    command's executable becomes an argument, so it is escaped for the agent's substitution too.
    ``bind_cores`` (a core list, or ``"all"``) pins each rank to its share of those cores first.
    """
    entry, args = command
    launcher = ProcessIdentity.of(os.getpid()) if launcher is None else launcher
    guard = guard_argv(launcher, [], run_dir=run_dir, grace_s=grace_s, bind_cores=bind_cores)
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

    with tempfile.TemporaryDirectory(prefix=RUN_DIR_PREFIX) as run_dir, _patched_environ(
        _worker_environ(plan, os.environ)
    ):
        entrypoint, args = guarded_command(local_command(plan.program), run_dir=run_dir,
                                           grace_s=_SHUTDOWN_GRACE_S)
        config = agent_config(
            nproc_per_node=plan.nproc_per_node,
            run_id=f"zerospeed-{uuid.uuid4().hex[:12]}",
            master_addr=plan.master_addr,
            master_port=port,
            node_rank=0,
            num_nodes=1,
            logs_specs=DefaultLogsSpecs(log_dir=run_dir),
            local_addr=plan.master_addr,
        )
        try:
            run_agent(config, entrypoint, args)
        except ChildFailedError as failed:
            return _report_failure(failed, log)
        except SignalException as stopped:
            print(f"zerospeed: stopped by {stopped.sigval.name}; all ranks were terminated", file=log)
            return 128 + int(stopped.sigval)
    return 0


def agent_config(*, nproc_per_node: int, run_id: str, master_addr: str, master_port: int, node_rank: int,
                 num_nodes: int, logs_specs: LogsSpecs, local_addr: str | None,
                 elastic: tuple[int, int, int] | None = None,
                 rdzv_configs: Mapping[str, object] | None = None) -> LaunchConfig:
    """torch's ``LaunchConfig`` for one host's agent: the one place single-node and multi-node jobs
    configure it.

    A fixed job (``elastic`` None) uses the static rendezvous: ``num_nodes`` agents, this one
    ``node_rank``, the store on ``master_addr:master_port`` hosted by node 0, and no restarts, so the
    first failed rank stops the job. An elastic job (``elastic = (min_nodes, max_nodes,
    max_restarts)``) uses the c10d rendezvous on the same endpoint, hosted by node 0 (``is_host``:
    explicit, so two agents on one machine never both try), with ``rdzv_configs`` on top (torch's
    keys: ``join_timeout``, ``last_call_timeout``, ``close_timeout``, ``keep_alive_interval``, ...).
    ``local_addr`` is how the other hosts reach this one (elastic: where node 0's workers find their
    store); ``None`` lets torch use this machine's fully qualified name.
    """
    from torch.distributed.launcher.api import LaunchConfig

    host = f"[{master_addr}]" if ":" in master_addr else master_addr
    configs: dict[str, object]
    if elastic is None:
        min_nodes = max_nodes = num_nodes
        backend, configs, restarts = "static", {"rank": node_rank}, 0
    else:
        min_nodes, max_nodes, restarts = elastic
        backend, configs = "c10d", {"is_host": node_rank == 0}
    configs.update(rdzv_configs or {})
    return LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc_per_node,
        run_id=run_id,
        role="zerospeed",
        rdzv_backend=backend,
        rdzv_endpoint=f"{host}:{master_port}",
        rdzv_configs=configs,
        max_restarts=restarts,
        monitor_interval=_MONITOR_INTERVAL_S,
        local_addr=local_addr,
        logs_specs=logs_specs,
        shutdown_timeout=_SHUTDOWN_GRACE_S,
    )


def run_agent(config: LaunchConfig, entrypoint: str, args: list[str], *,
              agent_class: Callable[..., LocalElasticAgent] | None = None) -> None:
    """Run torch's elastic agent as ``torch.distributed.launcher.api.launch_agent`` does, with
    ``agent_class`` (a :class:`LocalElasticAgent` subclass, or a factory of one taking its arguments)
    in its place, which ``launch_agent`` does not allow. Raises ``ChildFailedError`` when the workers failed and ``SignalException`` when this process
    was told to stop (the workers are stopped either way), like ``elastic_launch``."""
    import torch.distributed.elastic.rendezvous.registry as rdzv_registry
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    parameters = RendezvousParameters(backend=config.rdzv_backend, endpoint=config.rdzv_endpoint,
                                      run_id=config.run_id, min_nodes=config.min_nodes,
                                      max_nodes=config.max_nodes, local_addr=config.local_addr,
                                      **config.rdzv_configs)
    # As torch's launch_agent: only the static rendezvous fixes the workers' store address; under c10d the
    # agents agree on one per round (a fresh port on the host of rank 0, see node.worker_environ).
    master_addr: str | None = None
    master_port: int | None = None
    if config.rdzv_backend == "static":
        master_addr, master_port = parse_rendezvous_endpoint(config.rdzv_endpoint, default_port=-1)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    spec = WorkerSpec(role=config.role, local_world_size=config.nproc_per_node, entrypoint=entrypoint,
                      args=tuple(args), rdzv_handler=rdzv_registry.get_rendezvous_handler(parameters),
                      max_restarts=config.max_restarts, monitor_interval=config.monitor_interval,
                      master_addr=master_addr, master_port=master_port, local_addr=config.local_addr)
    assert config.logs_specs is not None  # LaunchConfig fills in the default
    agent = (agent_class or LocalElasticAgent)(spec=spec, logs_specs=config.logs_specs,
                                               start_method=config.start_method,
                                               shutdown_timeout=config.shutdown_timeout or _SHUTDOWN_GRACE_S)
    shutdown_rdzv = True
    try:
        result = agent.run()
        if result is not None and result.is_failed():
            raise ChildFailedError(name=os.path.basename(entrypoint), failures=result.failures)
    except SignalException:
        # As torch: an agent stopped by a signal leaves the rendezvous open, so an elastic job's
        # other hosts can go on (or this host can come back) under the same run id.
        shutdown_rdzv = False
        raise
    finally:
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()


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


def _report_failure(failed: ChildFailedError, log: TextIO, host: str | None = None) -> int:
    """Name the rank that failed first and how; its traceback was already streamed to our stderr.

    Ranks the agent terminated afterwards are listed as stopped, not as failures, so the summary
    points at the root cause. ``host`` (a multi-node job's node agent) names the host too.
    """
    first_rank, first = failed.get_first_failure()
    if host is None:
        where = f"rank {first_rank} (local_rank {first.local_rank}, pid {first.pid})"
    else:
        where = f"host {host} rank {first_rank} (local {first.local_rank}, pid {first.pid})"
    print(f"zerospeed: {where} {_describe_exit(first.exitcode)}; see its output above", file=log)
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


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15; ``signal 99`` for a number with no name (exit reports of both runners)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal_name(-code)}"
    return f"exited with code {code}"
