"""The node agent's additions to torch's elastic agent: prefixed whole-line output, and the restart facts.

Output. Every line a rank writes reaches the agent's stdout (or stderr) as ``[<host> rank <global
rank>] <line>``, one whole line per ``write`` under one lock shared by all ranks of this host, so two
ranks never splice each other's lines, however long. torch's own mechanism (``tee`` with
``log_line_prefix_template``) tails log files with ``readline``: a line the rank has half written
(``print`` under ``python -u`` writes the text and the newline separately) comes out as two prefixed
fragments, and what was not yet tailed when the agent is stopped is lost. Here each rank's stdout and
stderr are FIFOs in the job folder that the worker guard (:func:`~zerospeed.launcher.worker_guard.
redirect_output`) opens before it ``exec``\\ s the rank; one :class:`LinePump` thread per FIFO reads
until every writer has closed it (the rank and whatever it started), so the last lines of a failing
rank's traceback are printed before the agent reports the failure. The agent itself never holds a
write end, so the end of the rank's output is a plain EOF.

Restarts. :class:`NodeAgent` records, at each worker restart, when the failure or membership change was
seen and how many restarts there were (:mod:`zerospeed.launcher.elastic_env`), in the environment the
next workers inherit, and the workers' PIDs in the job folder's ``workers.pid``.

This module imports torch; :mod:`zerospeed.launcher.node` imports it only once the job is read.
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Mapping
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, LogsDest

from zerospeed.launcher.elastic_env import LOST_AT_VARIABLE, RESTART_COUNT_VARIABLE
from zerospeed.launcher.worker_guard import STDERR_FIFO_VARIABLE, STDOUT_FIFO_VARIABLE

__all__ = ["LinePump", "NodeAgent", "NodeLogsSpecs", "OutputRouter", "WORKERS_PID_FILE", "rank_log_name"]

# In the job folder: the PIDs of this host's current workers, one per line (rewritten at each start).
WORKERS_PID_FILE = "workers.pid"
# How often an idle pump looks whether it was told to stop.
_PUMP_POLL_S = 0.2
# A "line" longer than this without a newline is passed on in pieces of this size (bounded memory).
_MAX_LINE_BYTES = 1 << 20


def rank_log_name(started: str, host: str, rank: str) -> str:
    """``--enable_each_rank_log`` file of one rank: ``<agent start %Y%m%d%H%M%S>_<host>_rank<rank>.log``
    (DeepSpeed's ``<time>_rank<rank>.log`` with the host added, since several hosts may share the
    folder). Both streams of the rank go there, unprefixed; a restart appends."""
    safe_host = "".join(c if c.isalnum() or c in "-_." else "_" for c in host)
    return f"{started}_{safe_host}_rank{rank}.log"


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data``; a reader that went away (the runner's pipe closed) drops it silently, so
    the ranks are never blocked by a dead console."""
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:
        pass


class LinePump:
    """Copies one FIFO to ``dest_fd`` a whole line at a time, each line with ``prefix``, until every
    writer closed the FIFO (or, once :meth:`stop` was called, until nothing more is there right now).

    The FIFO is opened without blocking and waited on with ``select``: Linux reports it readable only
    once a writer has come, so a rank that never started leaves the pump idle, not stuck in ``open``.
    """

    def __init__(self, path: str, *, prefix: bytes, dest_fd: int, lock: threading.Lock,
                 log_path: str | None = None) -> None:
        self.path = path
        self._prefix = prefix
        self._dest_fd = dest_fd
        self._lock = lock
        self._log_path = log_path
        self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"zerospeed-pump-{os.path.basename(path)}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Finish after passing on what is readable now (a stray writer may hold the FIFO forever)."""
        self._stop.set()

    def join(self, timeout: float | None) -> bool:
        """Wait for the pump to finish; True when it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        pending = b""
        log_fd = (os.open(self._log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
                  if self._log_path else None)
        try:
            while True:
                if not select.select([self._fd], [], [], _PUMP_POLL_S)[0]:
                    if self._stop.is_set():
                        break
                    continue
                try:
                    chunk = os.read(self._fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:  # EOF: the rank and everything it started closed the stream
                    break
                pending += chunk
                lines = pending.split(b"\n")
                pending = lines.pop()
                for line in lines:
                    self._emit(line + b"\n", log_fd)
                while len(pending) > _MAX_LINE_BYTES:
                    self._emit(pending[:_MAX_LINE_BYTES] + b"\n", log_fd)
                    pending = pending[_MAX_LINE_BYTES:]
        finally:
            if pending:  # a last line without its newline (a rank killed mid-line)
                self._emit(pending + b"\n", log_fd)
            os.close(self._fd)
            if log_fd is not None:
                os.close(log_fd)

    def _emit(self, line: bytes, log_fd: int | None) -> None:
        with self._lock:
            _write_all(self._dest_fd, self._prefix + line)
            if log_fd is not None:
                _write_all(log_fd, line)


class OutputRouter:
    """The FIFOs and pumps of one agent: :meth:`attach` makes a rank's pair at each worker start."""

    def __init__(self, fifo_dir: str, host: str, *, stdout_fd: int = 1, stderr_fd: int = 2,
                 each_rank_log_dir: str | None = None, started: str | None = None) -> None:
        self._dir = fifo_dir
        self._host = host
        self._fds = (stdout_fd, stderr_fd)
        self._log_dir = each_rank_log_dir
        self._started = started or time.strftime("%Y%m%d%H%M%S")
        self._lock = threading.Lock()  # one for both streams: they may be the same pipe (2>&1)
        self._pumps: list[LinePump] = []
        self._count = 0
        os.makedirs(fifo_dir, exist_ok=True)

    def attach(self, rank: str) -> tuple[str, str]:
        """New FIFOs for global rank ``rank``'s stdout and stderr, their pumps running; their paths."""
        self._count += 1
        prefix = f"[{self._host} rank {rank}] ".encode()
        log_path = (os.path.join(self._log_dir, rank_log_name(self._started, self._host, rank))
                    if self._log_dir else None)
        paths = []
        for stream, fd in zip(("out", "err"), self._fds):
            path = os.path.join(self._dir, f"{self._count}-rank{rank}.{stream}")
            os.mkfifo(path, 0o600)
            self._pumps.append(LinePump(path, prefix=prefix, dest_fd=fd, lock=self._lock, log_path=log_path))
            paths.append(path)
        return paths[0], paths[1]

    def close(self, timeout: float) -> None:
        """Let every pump pass on what its rank wrote: wait up to ``timeout`` seconds for the ends of
        the streams, then stop the pumps still waiting (a stray process holding a stream)."""
        deadline = time.monotonic() + timeout
        for pump in self._pumps:
            pump.join(max(0.0, deadline - time.monotonic()))
        for pump in self._pumps:
            pump.stop()
        for pump in self._pumps:
            pump.join(1.0)


class NodeLogsSpecs(DefaultLogsSpecs):
    """torch's default log layout (error files under ``log_dir``), with each rank's stdout and stderr
    going to the :class:`OutputRouter`'s FIFOs through the worker guard (see the module docstring)."""

    def __init__(self, log_dir: str, router: OutputRouter) -> None:
        super().__init__(log_dir=log_dir)
        self._router = router

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        dest = super().reify(envs)
        for env in envs.values():
            env[STDOUT_FIFO_VARIABLE], env[STDERR_FIFO_VARIABLE] = self._router.attach(env["RANK"])
        return dest


class NodeAgent(LocalElasticAgent):
    """torch's local agent plus what zerospeed's node agent adds: the restart facts in the workers'
    environment (:mod:`zerospeed.launcher.elastic_env`) and the workers' PIDs in ``workers.pid``."""

    def __init__(self, *args: Any, job_dir: str, environ: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._job_dir = job_dir
        # The environment torch builds the workers' from (os.environ, patched by the node agent).
        self._environ = os.environ if environ is None else environ
        self.restarts = 0

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        # Called right after the monitor saw a failed rank or a host waiting to join.
        self.restarts += 1
        self._environ[LOST_AT_VARIABLE] = f"{time.time():.3f}"
        self._environ[RESTART_COUNT_VARIABLE] = str(self.restarts)
        super()._restart_workers(worker_group)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        pids: dict[int, Any] = super()._start_workers(worker_group)
        _write_pids(os.path.join(self._job_dir, WORKERS_PID_FILE), pids)
        return pids


def _write_pids(path: str, pids: Mapping[int, Any]) -> None:
    """Replace ``path`` atomically with one PID per line (local rank order)."""
    temporary = f"{path}.tmp"
    with open(temporary, "w") as fh:
        fh.writelines(f"{pids[rank]}\n" for rank in sorted(pids))
    os.replace(temporary, path)
