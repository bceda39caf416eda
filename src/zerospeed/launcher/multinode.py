"""What ``zerospeed`` does on the launching host for a job that spans several hosts.

:mod:`~zerospeed.launcher.commands` turns a :class:`~zerospeed.launcher.job.JobSpec` into pure
values: the processes to start here (``RemoteLaunch``: a pdsh, ssh, ``mpirun`` or ``srun`` command
line that starts the node agent on its hosts), the pre-flight command and the commands that stop
this job on every host. This module runs them, in four steps:

1. **Pre-flight** (skipped with ``--no_ssh_check``): the pre-flight command runs through the same
   runner on every host with a short deadline, while (when the master host is this machine) we listen
   on the master port so each host can prove it reaches it. Hosts that do not answer are named with the
   command to try by hand; the answers are compared with this machine's own
   (:func:`zerospeed.launcher.preflight.compare`). Any problem raises :class:`PreflightError` (the CLI
   prints it and exits 2) before any rank has started, listing every problem with its host and fix.
2. **Launch**: every ``RemoteLaunch`` becomes a child in its own session (so the terminal's Ctrl-C
   reaches only us, and we can signal each one's whole process group), with a stdin pipe that we keep
   open: the agents run with ``--watch_stdin``, so if this process dies (even by SIGKILL) the pipe
   closes, ssh passes the EOF on, and every remote agent stops its workers; each child is also set to
   get SIGTERM from the kernel when we die (PR_SET_PDEATHSIG), since pdsh does not pass stdin on and
   mpirun's/srun's agents do not watch it: they stop their children on SIGTERM. Their stdout and stderr
   are copied to ours one whole line at a time under one lock (two hosts never splice a line). The
   agents already prefix each worker line with ``[<host> rank <r>]``; pdsh adds its own ``<host>: ``
   in front, which we drop when the agent's prefix follows (it says the same) and keep otherwise
   (pdsh's and ssh's own messages then still say which host they came from).
3. **Failure**: when a launch process exits non-zero, or pdsh reports that one host's command did,
   the job is stopped everywhere: the stop commands (``kill -TERM <agent pid>`` from the job's pid
   file on each host, never a name pattern) run in parallel with SIGTERM to our children's process
   groups (ssh/pdsh then end, closing the agents' stdin; Open MPI's and MPICH's ``mpirun`` forward
   SIGTERM to their remote processes, checked on the namespace test cluster: nothing is left on
   either host; ``srun`` does so by its documentation), and whatever is still alive after
   ``stop_grace_s`` gets SIGKILL. We exit with the failed process's code and name the host, the rank
   and the first error line seen from it (a small ring of recent lines is kept per host to quote).
   A lost host breaks the collectives of every other host a moment later, so exits within half a
   second of the first are gathered and a *lost* host (ssh's 255, a signal) is named before hosts
   whose ranks merely failed, which are listed after it. Ctrl-C, SIGTERM and SIGHUP (also during
   pre-flight) stop exactly this job the same way and exit 130 / 143 / 129; a second one skips the
   grace and kills at once. Losing host 0 of an elastic job fails it at once (its agent keeps the
   rendezvous).
4. **Elastic** (``spec.elastic``): a host's launch ending is not a failure while at least
   ``min_nodes`` hosts remain: we log the loss and probe the host every few seconds (a short ssh
   command); once it answers we start its agent again, which re-joins the c10d rendezvous so torch's
   agents restart the workers at the bigger world size. This needs one launch process per host, so
   pdsh runs as ``pdsh -w <host>`` per host for elastic jobs (ssh is per host anyway).

Importing this module does not import torch.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, TYPE_CHECKING, Protocol, TextIO

from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.job import JobSpec
from zerospeed.launcher.runners import signal_name

if TYPE_CHECKING:
    from zerospeed.launcher.commands import RemoteLaunch

__all__ = ["PREFLIGHT_MARKER", "Preflight", "PreflightError", "run_job", "run_preflight"]

# The pre-flight command prints exactly one line starting with this, followed by its JSON answer.
PREFLIGHT_MARKER = "ZEROSPEED_PREFLIGHT "
# How many recent output lines are kept per host to quote when that host fails.
_RING_LINES = 20
# Main loop poll period: bounds how fast an exit or a signal is acted on.
_POLL_S = 0.05
# Elastic: after the first agent exits 0, how long the others get to end by themselves before a late
# re-joiner (waiting on a closed rendezvous) is stopped.
_COMPLETED_GRACE_S = 10.0
# How long a stop command may run before we stop waiting for it (it is killed then).
_STOP_COMMAND_TIMEOUT_S = 10.0
# After a launch process exits, how long we wait for its last output lines before reporting.
_DRAIN_S = 2.0
# After the first failed exit, how long other exits are gathered to tell the cause from the effects.
_SETTLE_S = 0.5
# Elastic: seconds between reachability probes of a lost host, and each probe's own deadline.
_PROBE_INTERVAL_S = 5.0
_PROBE_TIMEOUT_S = 5.0
# ssh exits 255 for its own errors: connection refused or lost, authentication, the remote command
# killed by a signal.
_SSH_ERROR = 255

# Linux's prctl(2), resolved once here: the child's pre-exec hook must not load libraries or allocate much
# (it runs between fork and exec while other threads of ours may hold locks). None elsewhere.
_PR_SET_PDEATHSIG = 1
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
_SIGTERM = int(signal.SIGTERM)
# The signals that stop the job like Ctrl-C: SIGHUP is the terminal (or the ssh session) we run in closing.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Pre-flight commands stopped by a signal get this long after SIGTERM before SIGKILL.
_PREFLIGHT_STOP_GRACE_S = 2.0

_PDSH_EXIT = re.compile(r"^pdsh@[^:\s]+: (?P<host>[^:\s]+): \S+ exited with exit code (?P<code>\d+)")
_PDSH_PREFIX = re.compile(r"^(?P<host>[^:\s\[]+): (?P<rest>.*)$", re.DOTALL)
_AGENT_PREFIX = re.compile(r"^\[(?P<host>[^\s\]]+) rank (?P<rank>\d+)\]")
# The agent's report of a failed rank: "zerospeed: host <h> rank <r> (local <l>, pid <p>) exited ...".
_AGENT_RANK_REPORT = re.compile(r"zerospeed: (?:host \S+ )?rank (?P<rank>\d+)\b")
# Lines that look like an error: a strong one names it (``RuntimeError: boom``, ``error: ...``, a
# rank's exit report), a weak one only announces it (``Traceback ...``). We quote a host's first
# strong line, else its first weak one, else its last line.
_STRONG_ERROR = re.compile(
    r"(?:^|\s)[\w.]*(?:Error|Exception|Interrupt)\b:|\berror:|exited with code|was killed by|"
    r"Connection (?:closed|reset|refused)|Permission denied|Could not resolve|ABORT"
)
_WEAK_ERROR = re.compile(r"Traceback|Error\b|Exception\b|Killed|failed")
# What a remote shell says when the interpreter or the launch folder is not there.
_MISSING_PATH = re.compile(r"No such file|can't cd|can not cd|cannot cd")


class PreflightError(LauncherError):
    """Pre-flight found problems; no rank was started. The message lists every problem with its host
    and the fix, one per line."""


class _Launch(Protocol):
    """The fields of :class:`zerospeed.launcher.commands.RemoteLaunch` this module uses."""

    @property
    def argv(self) -> tuple[str, ...]: ...
    @property
    def hosts(self) -> tuple[str, ...]: ...
    @property
    def env(self) -> Mapping[str, str]: ...


# What run_job accepts as the pre-flight commands: the commands, or a function of ``check_master``.
Preflight = Sequence["RemoteLaunch"] | Sequence[_Launch] | Callable[[bool], Sequence[_Launch]]


@dataclass(frozen=True)
class _ProbeLaunch:
    """The default elastic probe: ``ssh -o BatchMode=yes -o ConnectTimeout=3 <host> true``."""

    argv: tuple[str, ...]
    hosts: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)


def run_job(
    spec: JobSpec,
    *,
    runner: str,
    launches: Sequence[RemoteLaunch] | Sequence[_Launch],
    stop: Sequence[RemoteLaunch] | Sequence[_Launch] = (),
    preflight: Preflight = (),
    probe: Callable[[str], _Launch] | None = None,
    no_ssh_check: bool = False,
    log: TextIO | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
    preflight_timeout_s: float = 10.0,
    stop_grace_s: float = 10.0,
    probe_interval_s: float = _PROBE_INTERVAL_S,
) -> int:
    """Run a multi-node job from the launching host; return its exit code.

    ``launches`` start the node agents (one per host, or one ``mpirun``/``srun``/pdsh for all);
    ``stop`` are run once each when the job must stop (failure, Ctrl-C), bounded in time;
    ``preflight`` runs the pre-flight command on the hosts named in each one's ``hosts`` (a callable
    gets ``check_master``: whether the commands should add ``--check_master``, true while we listen on
    the master port); ``probe`` gives, for a host, a short command that exits 0 when the host is reachable (elastic only; the
    default is a plain ``ssh``). Pre-flight problems raise :class:`PreflightError` before anything
    starts. Returns 0 when every launch ended with 0; the failed launch's code (or 1) on failure;
    130 / 143 / 129 after SIGINT / SIGTERM / SIGHUP. Must be called from the main thread when it
    should handle those signals (elsewhere they are left to the caller). Every child is started from
    the calling thread, and gets SIGTERM when that thread ends (PR_SET_PDEATHSIG).
    """
    log = sys.stderr if log is None else log
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    if not launches:
        raise LauncherError(f"no launch commands for runner {runner!r}: nothing would start the ranks")
    if spec.elastic is not None:
        shared = [launch for launch in launches if len(launch.hosts) != 1]
        if shared:
            raise LauncherError(
                f"elastic training needs one launch process per host, but the {runner} command "
                f"{' '.join(shared[0].argv[:3])} ... reaches {len(shared[0].hosts)} hosts; use "
                "--launcher ssh or pdsh (run as one pdsh -w <host> per host)"
            )
    with _signals_caught() as caught:
        if not no_ssh_check and (callable(preflight) or preflight):
            try:
                run_preflight(spec, runner=runner, preflight=preflight, timeout_s=preflight_timeout_s,
                              log=log, caught=caught)
            except _Interrupted as stopped:
                _say(log, f"stopped by {stopped.signal.name} during pre-flight; no rank was started")
                return 128 + int(stopped.signal)
        job = _Job(spec, runner=runner, stop=stop, probe=probe, log=log, out=out, err=err,
                   stop_grace_s=stop_grace_s, probe_interval_s=probe_interval_s)
        return job.run(launches, caught)


# ---------------------------------------------------------------------------------------------------
# pre-flight


def run_preflight(spec: JobSpec, *, runner: str, preflight: Preflight, timeout_s: float,
                  log: TextIO, caught: _Caught | None = None) -> None:
    """Run the pre-flight command on every host; raise :class:`PreflightError` listing every problem.

    While the commands run, this process listens on the master port when the master host is this
    machine (each host's pre-flight connects to it with a short timeout). With ``caught`` (run_job's
    signal handling), a SIGINT/SIGTERM/SIGHUP stops the commands (they lead their own sessions, so
    nothing else would) and raises ``_Interrupted``.
    """
    problems: list[str] = []
    with _master_listener(spec) as listening:
        if listening is False:
            problems.append(
                f"host {spec.master_addr} (the master, this machine): --master_port {spec.master_port} is "
                "already in use here; pass another --master_port or stop the process using it"
            )
        commands = preflight(bool(listening)) if callable(preflight) else preflight
        results = _run_collecting(commands, timeout_s=timeout_s, caught=caught)
    answers: dict[str, dict[str, object]] = {}
    for result in results:
        for host, line in result.lines:
            if PREFLIGHT_MARKER not in line:
                continue
            payload = line.split(PREFLIGHT_MARKER, 1)[1]
            try:
                answer = json.loads(payload)
            except ValueError:
                problems.append(f"host {host or '?'} printed an unreadable pre-flight answer "
                                f"{payload[:200]!r}: it may run a different zerospeed version")
                continue
            name = str(answer.get("host") or host or "")
            if name:
                answers[name] = answer
    for result in results:
        for host in result.launch.hosts:
            if host in answers:
                continue
            problems.append(_unreachable(host, result, runner, timeout_s))
    if answers:
        problems.extend(_compare(answers, spec))
    if problems:
        raise PreflightError(
            f"pre-flight found {len(problems)} problem(s); no rank was started:\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\n(pass --no_ssh_check to skip these checks)"
        )
    _say(log, f"pre-flight passed on {len(answers)} host(s) through {runner}")


def _compare(answers: Mapping[str, Mapping[str, object]], spec: JobSpec) -> list[str]:
    """Every host's answer against this machine's own (versions, script, master port): the pure
    :func:`zerospeed.launcher.preflight.compare`. Hosts that did not answer are reported by the
    caller, with what the runner said."""
    from zerospeed.launcher import preflight as checks

    local = checks.answer(spec, host=None, cwd=os.getcwd())
    return list(checks.compare(answers, local))


def _unreachable(host: str, result: _Collected, runner: str, timeout_s: float) -> str:
    how, fix = _route(runner, host)
    said = [line for h, line in result.lines if h in (host, None) and line.strip()]
    tail = f" (it said: {said[-1].strip()[:200]})" if said else ""
    if result.timed_out:
        return f"host {host} did not answer within {timeout_s:g} s {how}{tail}: {fix}"
    if result.returncode in (126, 127) or any(_MISSING_PATH.search(line) for line in said):
        # ssh got through; the remote shell could not run the interpreter or cd into the folder.
        fix = (f"the Python interpreter {sys.executable} and the launch folder {os.getcwd()} must exist "
               "at the same paths on every host (a shared file system, or the same virtual environment "
               "path)")
    return (f"host {host} did not answer {how}: the command exited with code {result.returncode}"
            f"{tail}: {fix}")


def _route(runner: str, host: str) -> tuple[str, str]:
    """How a runner reaches a host, and the command a user runs to check that by hand."""
    if runner in ("pdsh", "ssh"):
        return "over ssh", f"check that `ssh {host} true` works without a password"
    if runner in ("openmpi", "mpich"):
        return "through mpirun", f"check that `mpirun -H {host} -n 1 hostname` works"
    if runner == "slurm":
        return "through srun", (f"check that `srun -w {host} -N 1 hostname` works and that the node is "
                                "up in `sinfo`")
    return f"through {runner}", f"check that {runner} reaches {host}"


@contextlib.contextmanager
def _master_listener(spec: JobSpec) -> Iterator[bool | None]:
    """Listen on the master port while pre-flight runs, when the master address is this machine.

    Yields ``True`` while listening, ``None`` when the master is another host (its agent will listen
    later; the hosts' connection test then has nobody to reach), ``False`` when the port is taken.
    """
    if not _is_local_address(spec.master_addr):
        yield None
        return
    server = socket.socket(socket.AF_INET6 if ":" in spec.master_addr else socket.AF_INET,
                           socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        server.bind(("", spec.master_port))
    except OSError as exc:
        server.close()
        if exc.errno in (errno.EADDRINUSE, errno.EACCES):
            yield False
            return
        raise
    server.listen(64)
    server.settimeout(0.1)
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.close()

    thread = threading.Thread(target=accept, name="zerospeed-preflight-master", daemon=True)
    thread.start()
    try:
        yield True
    finally:
        done.set()
        thread.join(timeout=1.0)
        server.close()


def _is_local_address(addr: str) -> bool:
    """Whether ``addr`` names this machine: a socket can bind to one of its addresses."""
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((sockaddr[0], 0))
            except OSError:
                continue
            return True
    return False


@dataclass
class _Collected:
    launch: _Launch
    lines: list[tuple[str | None, str]]
    returncode: int | None
    timed_out: bool


def _run_collecting(launches: Sequence[_Launch], *, timeout_s: float,
                    caught: _Caught | None = None) -> list[_Collected]:
    """Run short commands in parallel, each in its own session, killed at the shared deadline, or
    stopped (SIGTERM, SIGKILL after a short grace or at a second signal) when ``caught`` sees a signal:
    then ``_Interrupted`` is raised."""
    procs: list[tuple[_Launch, subprocess.Popen[bytes], list[tuple[str | None, str]],
                      list[threading.Thread]]] = []
    try:
        for launch in launches:
            proc = _popen(launch, stdin=subprocess.DEVNULL)
            lines: list[tuple[str | None, str]] = []
            lock = threading.Lock()

            def sink(host: str | None, line: str, *, _lines: list[tuple[str | None, str]] = lines,
                     _lock: threading.Lock = lock) -> None:
                with _lock:
                    _lines.append((host, line))

            threads = [_reader(stream, launch, sink) for stream in (proc.stdout, proc.stderr)]
            procs.append((launch, proc, lines, threads))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(proc.poll() is None for _, proc, _, _ in procs):
            if caught is not None and caught.signal is not None:
                _stop_collecting([proc for _, proc, _, _ in procs], caught)
                raise _Interrupted(caught.signal)
            if caught is not None:
                caught.event.wait(_POLL_S)
            else:
                time.sleep(_POLL_S)
    finally:
        results = []
        for launch, proc, lines, threads in procs:
            timed_out = proc.poll() is None
            if timed_out:
                _kill_group(proc, signal.SIGKILL)
            proc.wait()
            for thread in threads:
                thread.join(timeout=1.0)
            results.append(_Collected(launch, list(lines), proc.returncode, timed_out))
    return results


def _stop_collecting(procs: Sequence[subprocess.Popen[bytes]], caught: _Caught) -> None:
    """Pre-flight stopped by a signal: SIGTERM its commands' groups, SIGKILL what is left after
    :data:`_PREFLIGHT_STOP_GRACE_S` or as soon as a second signal comes."""
    for proc in procs:
        if proc.poll() is None:
            _kill_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + _PREFLIGHT_STOP_GRACE_S
    while (time.monotonic() < deadline and caught.again is None
           and any(proc.poll() is None for proc in procs)):
        caught.pause(_POLL_S)
    for proc in procs:
        if proc.poll() is None:
            _kill_group(proc, signal.SIGKILL)


class _Interrupted(Exception):
    """A stop signal arrived during pre-flight (its commands are stopped already)."""

    def __init__(self, sig: signal.Signals) -> None:
        super().__init__(sig.name)
        self.signal = sig


def _say(log: TextIO, message: str) -> None:
    """Print one ``zerospeed:`` line to the log; never raise: with our stderr a closed pipe
    (``zerospeed ... 2>&1 | head``) the job must still be stopped after the message is lost."""
    with contextlib.suppress(OSError, ValueError):
        print(f"zerospeed: {message}", file=log, flush=True)


# ---------------------------------------------------------------------------------------------------
# processes and their output


def _popen(launch: _Launch, *, stdin: int) -> subprocess.Popen[bytes]:
    """Start ``launch`` in its own session (Ctrl-C on the terminal reaches only us; we signal its
    group), set to get SIGTERM when this process dies, even by SIGKILL: the agents do not all see
    our death otherwise (pdsh does not pass stdin on, so ``--watch_stdin`` never sees EOF; mpirun's and
    srun's agents do not watch stdin), while pdsh/ssh/mpirun/srun stop their children on SIGTERM.

    Every process is started from the thread that called :func:`run_job` (the kernel sends the
    signal when the *thread* that forked the child ends)."""
    env = dict(os.environ)
    env.update(launch.env)
    try:
        return subprocess.Popen(list(launch.argv), stdin=stdin, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env, start_new_session=True,
                                preexec_fn=_die_with_parent(os.getpid()))
    except OSError as exc:
        raise LauncherError(f"cannot start {launch.argv[0]!r} for host(s) {', '.join(launch.hosts)}: "
                            f"{exc.strerror}; is it installed and on PATH?") from None


def _die_with_parent(parent: int) -> Callable[[], None] | None:
    """The child's pre-exec hook: PR_SET_PDEATHSIG=SIGTERM, and exit at once when ``parent`` already
    died before the setting took (the child was then re-parented and would get no signal)."""
    prctl = _PRCTL
    if prctl is None:
        return None

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, _SIGTERM)
        if os.getppid() != parent:
            os._exit(1)

    return hook


def _attribute(line: str, launch: _Launch) -> tuple[str | None, str]:
    """Which host a line came from, and the line as we print it (pdsh's redundant prefix dropped)."""
    host: str | None = launch.hosts[0] if len(launch.hosts) == 1 else None
    match = _PDSH_PREFIX.match(line)
    if match is not None and match["host"] in launch.hosts:
        host = match["host"]
        if _AGENT_PREFIX.match(match["rest"]) is not None:
            line = match["rest"]
    agent = _AGENT_PREFIX.match(line)
    if agent is not None and (host is None or len(launch.hosts) > 1) and agent["host"] in launch.hosts:
        host = agent["host"]
    return host, line


def _reader(stream: IO[bytes] | None, launch: _Launch,
            sink: Callable[[str | None, str], None]) -> threading.Thread:
    """A thread that hands each whole line of ``stream`` (decoded, without its newline) to ``sink``."""

    def pump() -> None:
        assert stream is not None
        with stream:
            for raw in iter(stream.readline, b""):
                text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                host, text = _attribute(text, launch)
                sink(host, text)

    thread = threading.Thread(target=pump, name=f"zerospeed-out-{','.join(launch.hosts)[:40]}",
                              daemon=True)
    thread.start()
    return thread


def _kill_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Signal the child's whole process group (it leads its own session)."""
    # Also after the leader ended: children it left in its group are stragglers; a group id is not
    # handed out again while any member lives. (pdsh's ssh children are NOT in the group: ssh calls
    # setsid(). pdsh stops them itself on SIGTERM; the stop commands stop the agents by PID.)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


class _Output:
    """Copies lines to our stdout/stderr whole, under one lock, and remembers recent lines per host."""

    def __init__(self, out: TextIO, err: TextIO) -> None:
        self._out = out
        self._err = err
        self._lock = threading.Lock()
        self.recent: dict[str | None, collections.deque[str]] = {}
        self.first_error: dict[str | None, str] = {}
        self.first_weak: dict[str | None, str] = {}
        self.host_exits: queue.Queue[tuple[str, int]] = queue.Queue()

    def sink(self, target: TextIO) -> Callable[[str | None, str], None]:
        def write(host: str | None, line: str) -> None:
            with self._lock:
                try:
                    target.write(line + "\n")
                    target.flush()
                except (OSError, ValueError):
                    # Our stdout is gone (a closed pipe such as `| head`): keep draining the job's
                    # pipes so it never blocks on a full one, and keep the lines for the report.
                    pass
                self.recent.setdefault(host, collections.deque(maxlen=_RING_LINES)).append(line)
                if host not in self.first_error and _STRONG_ERROR.search(line):
                    self.first_error[host] = line
                elif host not in self.first_weak and _WEAK_ERROR.search(line):
                    self.first_weak[host] = line
            pdsh = _PDSH_EXIT.match(line)
            if pdsh is not None:
                self.host_exits.put((pdsh["host"], int(pdsh["code"])))

        return write

    def first_failing(self, hosts: Sequence[str]) -> str | None:
        """The first of ``hosts`` that printed an error line (strong ones first), if any."""
        with self._lock:
            for seen in (self.first_error, self.first_weak):
                for host in seen:
                    if host in hosts:
                        return host
        return None

    def error_of(self, host: str | None) -> tuple[str | None, bool]:
        """The line to quote for a failed host, and whether it looks like an error (else it is the
        host's last line)."""
        with self._lock:
            for seen in (self.first_error, self.first_weak):
                if host in seen:
                    return seen[host], True
            ring = self.recent.get(host)
            return (ring[-1] if ring else None), False


@dataclass
class _Running:
    launch: _Launch
    proc: subprocess.Popen[bytes]
    threads: list[threading.Thread]


class _Caught:
    """The first SIGINT/SIGTERM/SIGHUP received while the job runs; ``again`` once a second one came
    (the user insists: stopping skips its grace and kills at once)."""

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None
        self.again: signal.Signals | None = None
        self.event = threading.Event()

    def handler(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is None:
            self.signal = signal.Signals(signum)
        elif self.again is None:
            self.again = signal.Signals(signum)
        self.event.set()

    def pause(self, seconds: float) -> None:
        """Sleep up to ``seconds`` while stopping; wake at once when a second signal comes."""
        self.event.clear()
        if self.again is None:
            self.event.wait(seconds)


@contextlib.contextmanager
def _signals_caught() -> Iterator[_Caught]:
    caught = _Caught()
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return
    previous = {sig: signal.signal(sig, caught.handler) for sig in _STOP_SIGNALS}
    try:
        yield caught
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# ---------------------------------------------------------------------------------------------------
# the job


class _Job:
    """One run: the launch processes, their output, failure and elastic bookkeeping."""

    def __init__(self, spec: JobSpec, *, runner: str, stop: Sequence[_Launch],
                 probe: Callable[[str], _Launch] | None, log: TextIO, out: TextIO, err: TextIO,
                 stop_grace_s: float, probe_interval_s: float) -> None:
        self.spec = spec
        self.runner = runner
        self.stop_commands = stop
        self.probe = probe or _ssh_probe
        self.log = log
        self.output = _Output(out, err)
        self.out = out
        self.err = err
        self.stop_grace_s = stop_grace_s
        self.probe_interval_s = probe_interval_s
        self.running: list[_Running] = []
        # elastic: lost host -> (monotonic time of the next probe, running probe or None)
        self.lost: dict[str, tuple[float, subprocess.Popen[bytes] | None, float]] = {}
        self.rejoins: collections.Counter[str] = collections.Counter()
        # The launch that starts each host's agent alone (elastic restarts it after a loss).
        self.by_host: dict[str, _Launch] = {}
        # Elastic: when the first agent exited 0 (its round's workers all succeeded: the job is done).
        self.completed_at: float | None = None
        # The signals seen (set by run): a second one makes stop_everything kill at once.
        self.caught = _Caught()

    def say(self, message: str) -> None:
        _say(self.log, message)

    def start(self, launch: _Launch) -> _Running:
        proc = _popen(launch, stdin=subprocess.PIPE)
        threads = [_reader(proc.stdout, launch, self.output.sink(self.out)),
                   _reader(proc.stderr, launch, self.output.sink(self.err))]
        running = _Running(launch, proc, threads)
        self.running.append(running)
        return running

    def run(self, launches: Sequence[_Launch], caught: _Caught) -> int:
        self.caught = caught
        try:
            for launch in launches:
                if len(launch.hosts) == 1:
                    self.by_host[launch.hosts[0]] = launch
                self.start(launch)
            return self._watch(caught)
        finally:
            self._reap_all()

    def _watch(self, caught: _Caught) -> int:
        while True:
            if caught.signal is not None:
                sig = caught.signal
                self.say(f"stopped by {sig.name}; stopping this job's processes on every host")
                self.stop_everything()
                return 128 + int(sig)
            failure = self._pdsh_failure()
            if failure is not None:
                return failure
            for running, code in self._reap_ended():
                result = self._ended(running, code)
                if result is not None:
                    return result
            if not self.running and not self._probing():
                return 0
            if self.completed_at is not None and time.monotonic() - self.completed_at > _COMPLETED_GRACE_S:
                return self._finish_completed()
            if not self.running and self.lost and self.spec.elastic is not None:
                # Every remaining host finished while some were lost: the job is done without them.
                for host in list(self.lost):
                    self._stop_probe(host)
                    self.say(f"host {host} did not come back before the job finished")
                return 0
            self._poll_probes()
            caught.event.wait(_POLL_S)

    # --- exits ---------------------------------------------------------------------------------

    def _ended(self, running: _Running, code: int) -> int | None:
        hosts = running.launch.hosts
        if code == 0:
            if self.spec.elastic is not None and self.completed_at is None:
                self.completed_at = time.monotonic()
            return None
        if self.completed_at is not None:
            # An agent that re-joined just as the job finished finds the rendezvous closed: not a failure.
            self.say(f"host {', '.join(hosts)} ended ({_describe(code)}) after the job completed; ignored")
            return None
        # A re-joined host's new agent that exits with an ordinary error is lost again, not a failure
        # of the job (a stale agent from a healed partition can make it exit 2): probed again later;
        # _rejoin leaves the host out after max_restarts re-joins.
        if (self.spec.elastic is not None and len(hosts) == 1
                and (self.rejoins[hosts[0]] > 0 or self._host_lost(hosts[0], code))):
            return self._lose(hosts[0], code)
        return self._fail(hosts, code)

    def _finish_completed(self) -> int:
        """Elastic: the job completed, but agents started to re-join a lost host still wait for a
        rendezvous that closed (and probes still run): stop them, and report success."""
        for host in list(self.lost):
            self._stop_probe(host)
            self.say(f"host {host} did not come back before the job finished")
        if self.running:
            late = ", ".join(h for r in self.running for h in r.launch.hosts)
            self.say(f"the job completed; stopping the agent(s) on {late} that were still re-joining")
            self.stop_everything()
        return 0

    def _pdsh_failure(self) -> int | None:
        """pdsh keeps running while one host's command already failed; act on its report at once."""
        while True:
            try:
                host, code = self.output.host_exits.get_nowait()
            except queue.Empty:
                return None
            if code == 0:
                continue
            owner = next((r for r in self.running if host in r.launch.hosts), None)
            if owner is None:
                continue
            if self.spec.elastic is not None and len(owner.launch.hosts) == 1:
                continue  # its own exit is handled when the per-host pdsh ends
            return self._fail((host,), code)

    def _host_lost(self, host: str, code: int) -> bool:
        """Elastic: a host is lost (not the job failed) when ssh lost it or killed the agent by a
        signal, or when the host does not answer a probe right away. An agent that exits with an
        ordinary error code on a host that still answers reports a real failure of the job."""
        return _is_loss(code) or not self._probe_once(host)

    def _lose(self, host: str, code: int) -> int | None:
        assert self.spec.elastic is not None
        if self.spec.hosts and host == self.spec.hosts[0]:
            # Its agent hosts the c10d rendezvous store: nobody can re-join without it.
            self.say(f"host {host} lost ({_describe(code)}): it keeps the elastic rendezvous "
                     f"({self.spec.master_addr}:{self.spec.master_port}); the job cannot go on without it")
            return self._fail((host,), code)
        remaining = {h for r in self.running for h in r.launch.hosts}
        when = time.strftime("%H:%M:%S")
        if len(remaining) < self.spec.elastic.min_nodes:
            self.say(f"host {host} lost at {when} ({_describe(code)}); only {len(remaining)} host(s) "
                     f"left, fewer than --min_elastic_nodes {self.spec.elastic.min_nodes}")
            return self._fail((host,), code)
        self.say(f"host {host} lost at {when} ({_describe(code)}); continuing on {len(remaining)} "
                 f"host(s); will start its agent again when it answers")
        self.lost[host] = (time.monotonic() + self.probe_interval_s, None, 0.0)
        return None

    def _fail(self, hosts: Sequence[str], code: int) -> int:
        """Report the failure and stop the job. A lost host makes the ranks elsewhere fail too (their
        collectives break a moment later), so exits that follow within :data:`_SETTLE_S` are gathered
        and a host that was *lost* (ssh's 255, a signal) is named before one whose ranks merely
        failed; the others are listed after it."""
        ended = [(tuple(hosts), code), *self._settle()]
        lost = [(h, c) for h, c in ended if _is_loss(c)]
        hosts, code = (lost or ended)[0]
        also = [(h, c) for h, c in ended if (h, c) != (hosts, code)]
        host = self._failed_host(hosts)
        error, is_error = self.output.error_of(host)
        rank = _rank_in(error) if is_error and error is not None else None
        ranks = self._ranks_of(host) if host is not None else None
        who = f"host {host}" if host is not None else f"one of hosts {', '.join(hosts)} ({self.runner})"
        where = (f", rank {rank}" if rank is not None else f", {ranks}" if ranks is not None else "")
        first = ("" if error is None else
                 f"; {'first error' if is_error else 'its last line'}: {error.strip()[:400]}")
        self.say(f"{who}{where} failed: {_describe(code)}{first}")
        for other_hosts, other_code in also:
            self.say(f"{', '.join(other_hosts)} also ended: {_describe(other_code)}")
        self.say("stopping this job on every host")
        self.stop_everything()
        if code < 0:
            return 128 - code
        return code if code > 0 else 1

    def _reap_ended(self) -> list[tuple[_Running, int]]:
        """The launches that ended since the last look, with their exit codes, their output drained and
        removed from :attr:`running`."""
        ended: list[tuple[_Running, int]] = []
        for running in list(self.running):
            code = running.proc.poll()
            if code is None:
                continue
            self.running.remove(running)
            for thread in running.threads:
                thread.join(timeout=_DRAIN_S)
            ended.append((running, code))
        return ended

    def _settle(self) -> list[tuple[tuple[str, ...], int]]:
        """Other launches (or pdsh hosts) that end non-zero within :data:`_SETTLE_S`."""
        ended: list[tuple[tuple[str, ...], int]] = []
        deadline = time.monotonic() + _SETTLE_S
        while True:
            ended.extend((running.launch.hosts, code) for running, code in self._reap_ended() if code != 0)
            with contextlib.suppress(queue.Empty):
                while True:
                    host, code = self.output.host_exits.get_nowait()
                    if code != 0:
                        ended.append(((host,), code))
            if time.monotonic() >= deadline or not self.running:
                return ended
            time.sleep(_POLL_S)

    def _failed_host(self, hosts: Sequence[str]) -> str | None:
        if len(hosts) == 1:
            return hosts[0]
        # A launch reaching several hosts (mpirun, srun): the first host with an error line.
        return self.output.first_failing(hosts)

    def _ranks_of(self, host: str) -> str | None:
        start = 0
        for name, slots in self.spec.world:
            if name == host:
                last = start + len(slots) - 1
                return f"rank {start}" if last == start else f"ranks {start}-{last}"
            start += len(slots)
        return None

    # --- stopping ------------------------------------------------------------------------------

    def stop_everything(self) -> None:
        """Stop this job on every host: stop commands (by PID) and our children's groups, SIGTERM
        then SIGKILL after the grace; bounded in time."""
        for host in list(self.lost):
            self._stop_probe(host)
        for running in self.running:
            if running.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    running.proc.stdin.close()
        # (process, its launch) together: a stop command that cannot start must not shift the hosts
        # named for the others.
        stoppers: list[tuple[subprocess.Popen[bytes], _Launch]] = []
        for launch in self.stop_commands:
            try:
                proc = _popen(launch, stdin=subprocess.DEVNULL)
            except LauncherError as exc:
                self.say(str(exc))
                continue
            stoppers.append((proc, launch))
        for running in self.running:
            _kill_group(running.proc, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        while (time.monotonic() < deadline and self.caught.again is None
               and any(running.proc.poll() is None for running in self.running)):
            self.caught.pause(_POLL_S)
        if self.caught.again is not None:
            self.say(f"stopped again by {self.caught.again.name}; killing this job's processes now")
        for running in self.running:
            if running.proc.poll() is None and self.caught.again is None:
                self.say(f"{' '.join(running.launch.argv[:1])} for {', '.join(running.launch.hosts)} "
                         f"did not stop within {self.stop_grace_s:g} s; killing it")
            _kill_group(running.proc, signal.SIGKILL)
        stop_deadline = time.monotonic() + _STOP_COMMAND_TIMEOUT_S
        for proc, launch in stoppers:
            try:
                stdout, stderr = proc.communicate(timeout=max(0.1, stop_deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(proc, signal.SIGKILL)
                stdout, stderr = proc.communicate()
                self.say(f"the stop command for {', '.join(launch.hosts)} did not finish within "
                         f"{_STOP_COMMAND_TIMEOUT_S:g} s")
            for line in (stdout + stderr).decode("utf-8", "replace").splitlines():
                if line.strip():
                    self.say(f"stop on {', '.join(launch.hosts)}: {line}")

    def _reap_all(self) -> None:
        """Nothing we started outlives this call (normally everything has already ended)."""
        for host in list(self.lost):
            self._stop_probe(host)
        for running in self.running:
            _kill_group(running.proc, signal.SIGKILL)
            running.proc.wait()
            for thread in running.threads:
                thread.join(timeout=_DRAIN_S)
            if running.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    running.proc.stdin.close()
        self.running.clear()

    # --- elastic probing -------------------------------------------------------------------------

    def _probing(self) -> bool:
        return bool(self.lost)

    def _probe_once(self, host: str) -> bool:
        proc = _popen(self.probe(host), stdin=subprocess.DEVNULL)
        try:
            proc.communicate(timeout=_PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _kill_group(proc, signal.SIGKILL)
            proc.communicate()
            return False
        return proc.returncode == 0

    def _poll_probes(self) -> None:
        now = time.monotonic()
        for host, (next_at, proc, started) in list(self.lost.items()):
            if proc is None:
                if now >= next_at:
                    self.lost[host] = (next_at, _popen(self.probe(host), stdin=subprocess.DEVNULL), now)
                continue
            code = proc.poll()
            if code is None and now - started < _PROBE_TIMEOUT_S:
                continue
            if code is None:
                _kill_group(proc, signal.SIGKILL)
            proc.communicate()
            if code != 0:
                self.lost[host] = (now + self.probe_interval_s, None, 0.0)
                continue
            self._rejoin(host)

    def _rejoin(self, host: str) -> None:
        assert self.spec.elastic is not None
        del self.lost[host]
        self.rejoins[host] += 1
        if self.rejoins[host] > self.spec.elastic.max_restarts:
            self.say(f"host {host} answers again but was already restarted "
                     f"{self.spec.elastic.max_restarts} time(s) (max_restarts); leaving it out")
            return
        launch = self._launch_of(host)
        if launch is None:
            return
        self.start(launch)
        self.say(f"host {host} answers again at {time.strftime('%H:%M:%S')}; started its agent, it "
                 "re-joins at the next restart point")

    def _launch_of(self, host: str) -> _Launch | None:
        return self.by_host.get(host)

    def _stop_probe(self, host: str) -> None:
        _, proc, _ = self.lost.pop(host)
        if proc is not None:
            _kill_group(proc, signal.SIGKILL)
            proc.communicate()


def _ssh_probe(host: str) -> _Launch:
    return _ProbeLaunch(("ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=3", host, "true"), (host,))


def _is_loss(code: int) -> bool:
    """An exit that means the host or its agent was lost (ssh's own error, a signal), not that the
    agent reported its ranks' failure."""
    return code == _SSH_ERROR or code >= 128 or code < 0


def _rank_in(line: str) -> int | None:
    agent = _AGENT_PREFIX.match(line)
    if agent is not None:
        return int(agent["rank"])
    report = _AGENT_RANK_REPORT.search(line)
    return int(report["rank"]) if report is not None else None


def _describe(code: int) -> str:
    if code < 0:
        return f"its launch process was killed by {signal_name(-code)}"
    if code == _SSH_ERROR:
        return ("exit code 255 (ssh lost the host: it went down, its sshd or the agent was killed, or "
                "the network failed)")
    if code > 128:
        try:
            return f"exit code {code} (killed by {signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return f"exit code {code}"
