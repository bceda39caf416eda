"""Stop a rank whose launcher is gone: every rank of a ``zerospeed`` launch starts through this file.

The launcher runs torch's elastic agent in its own process. If that process dies without running its
shutdown (SIGKILL, the OOM killer), nothing told the ranks: they trained and saved on for as long as
they lived, and the launch's temporary folder stayed. Each rank's command is therefore
``python -I -S worker_guard.py --launcher-pid L ... -- <the rank's real command>``. The guard

1. opens a pidfd on the launcher (checking its start time, so a recycled PID is not taken for it)
   and one on itself, and takes the rank's shared lock on the run folder (below);
2. forks a small *watcher* process, detached into its own session (so the launcher's group signals
   and a shell's ``wait`` never meet it), which inherits both pidfds and the lock;
3. resets SIGPIPE and SIGXFSZ (below) and replaces itself with the real command by ``exec``, so the
   rank keeps the PID, the process group, the environment, the ``sys.argv``/``__main__``/``sys.path``
   and the exit status that the agent and the user's script see today. Nothing runs inside the
   user's process, so scripts that never import zerospeed, ``-m`` modules and ``--no_python``
   executables are covered alike. The price is one idle interpreter (about 10 MB) per rank while it
   runs.

The watcher sleeps on the two pidfds. When the rank ends first it waits until the launcher is gone
*or* has removed the run folder itself (its normal cleanup: the watcher sees the lock file it holds
unlinked, checking every :data:`_CLEANUP_POLL_S` seconds), so that a launch called from a process
that lives on (a notebook, a sweep calling ``main()`` in a loop) leaves no idle watcher behind; a
guard given no run folder has nothing to clean, and its watcher exits with the rank. When the
launcher ends first the watcher does what the agent would have done: SIGTERM to the rank's process
group (user handlers run), SIGKILL after the same grace the agent uses, then helps remove the run
folder.

Why not ``prctl(PR_SET_PDEATHSIG)``: it fires when the parent *thread* exits, and torch starts the
workers from whichever thread called the agent (``PContext.start`` even warns about a non-main
thread); it can only be armed after the ``exec`` of a wrapper, racing a launcher that dies first;
and it delivers one bare signal, with no escalation to SIGKILL and nobody left to remove the folder.
Why not an inherited pipe whose EOF means death: torch's ``Popen`` closes every descriptor but
0-2 and takes no ``pass_fds``. A pidfd gives the same guarantees (woken at once, immune to PID
reuse once opened); where Linux has none (before 5.3) or there is no ``/proc``, the watcher polls
the PID and its start time every :data:`_POLL_S` seconds instead.

Checkpoints: a rank stopped in the middle of a save leaves the previous checkpoint intact by
construction, so the watcher does not wait for saves. A tag directory appears only by an atomic
rename of a complete, fsynced temporary directory and ``latest`` is rewritten by temp+rename
(:mod:`zerospeed.checkpoint.layout`, :mod:`zerospeed.checkpoint.commit`), and a multi-rank save
could not finish anyway: it commits through the rendezvous store, which lived in the launcher.

The run folder: every watcher holds a shared ``flock`` on ``<run dir>/ranks.lock`` until both its
rank and the launcher have ended; then it releases it and tries to take it exclusively without
blocking. Only the watcher that releases last gets it, and removes the folder. The guard takes the
shared lock itself, before it forks the watcher and before the rank's command runs: ``flock``
belongs to the open file, so the watcher's inherited descriptor keeps it after the guard closes its
own copy before the ``exec``. Taken later, in the watcher, a sibling whose rank ended
could count itself last while this rank already ran, and a late ``O_CREAT`` could put
``ranks.lock`` back into a folder the launcher was removing ("directory not empty"); the lock file
is therefore only ever created by a guard whose launcher still lives. A launcher that lives
removes the folder itself as before (the watchers then find it gone); one killed after its ranks
ended but before its cleanup is covered too, since the watchers wait for it.

The rank's signal dispositions are what ``subprocess`` gives a child (``restore_signals``): Python
starts with SIGPIPE and SIGXFSZ ignored, an ignore survives ``exec``, and torch's ``Popen`` had reset
both for the rank before this guard sat in between; the guard resets them before its ``exec``.

This file runs by path with ``-I -S`` (isolated: no ``PYTHON*`` variables such as ``PYTHONPATH``, no
script folder or user site on ``sys.path``; no site-packages: a fast start, and no ``sitecustomize``
run twice), so it imports only the standard library; zerospeed need not even be importable by the
rank's interpreter. The rank's command still gets the environment unchanged.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not sys.flags.isolated:
    # Run by path without -I (by hand), so this folder is sys.path[0]: drop it before the imports
    # below so that a sibling module can never shadow a standard-library one. (-I leaves it out.)
    del sys.path[0]

import argparse  # noqa: E402
import fcntl  # noqa: E402
import os  # noqa: E402
import select  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable, Mapping, MutableMapping, Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402

__all__ = ["JOB_DIR_PREFIX", "LOCK_NAME", "RUN_DIR_PREFIX", "STDERR_FIFO_VARIABLE", "STDOUT_FIFO_VARIABLE",
           "GuardOptions", "ProcessIdentity", "ProcessWatch", "RunDirLock", "bind_to_cores", "cores_of_rank",
           "default_core_list", "guard_argv", "main", "parse_core_list", "parse_guard_args",
           "redirect_output", "restore_signals", "run_dir_problem", "stop_process", "wait_for_any",
           "wait_for_cleanup", "watch_rank"]

# The launcher's temporary folder starts with this; the watcher refuses to remove any other folder.
RUN_DIR_PREFIX = "zerospeed-launch-"
# A multi-node job's folder on one host (``<tmp>/zerospeed-job-<job id>``, the node agent's): its
# watchers may remove it too, so an agent killed outright leaves neither ranks nor its pid file behind.
JOB_DIR_PREFIX = "zerospeed-job-"
# Set by the node agent in each rank's environment: FIFOs (read by the agent, which prefixes every
# line with the rank's host and rank) that the guard makes the rank's stdout and stderr. Removed from
# the environment before the ``exec``.
STDOUT_FIFO_VARIABLE = "ZEROSPEED_STDOUT_FIFO"
STDERR_FIFO_VARIABLE = "ZEROSPEED_STDERR_FIFO"
# The file in the run folder whose shared locks say "a rank may still be running".
LOCK_NAME = "ranks.lock"
# Seconds between looks at a process where no pidfd can be opened.
_POLL_S = 0.2
# Seconds to wait for a rank to vanish after SIGKILL before giving up on it.
_KILL_WAIT_S = 5.0
# Seconds between looks at whether a live launcher has removed the run folder, once the rank ended
# (one fstat each: the watcher then exits instead of idling until the launcher's process exits).
_CLEANUP_POLL_S = 0.5
# Signals Python ignores at start-up and ``subprocess`` (restore_signals) resets for a child.
_RESTORED_SIGNALS = ("SIGPIPE", "SIGXFSZ")
# What the rank is called in messages, from the variables torch's agent sets for it.
_UNKNOWN_RANK = "?"


@dataclass(frozen=True)
class ProcessIdentity:
    """A process named by PID *and* start time, so that a recycled PID is never taken for it.

    ``start`` is field 22 of ``/proc/<pid>/stat`` (clock ticks since boot), kept as text; ``None``
    where there is no ``/proc``, and then only the PID is compared.
    """

    pid: int
    start: str | None = None

    @classmethod
    def of(cls, pid: int) -> ProcessIdentity:
        """The identity of the running process ``pid`` (``start=None`` if it is gone or unknown)."""
        stat = _proc_stat(pid) if _has_proc() else None
        return cls(pid, None if stat is None else stat[1])

    def running(self) -> bool:
        """Whether this very process still runs; a zombie (exited, not yet reaped) does not."""
        if not _has_proc():
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
            return True
        stat = _proc_stat(self.pid)
        if stat is None:
            return False
        state, start = stat
        return state not in ("Z", "X", "x") and (self.start is None or start == self.start)


def _has_proc() -> bool:
    return os.path.exists("/proc/self/stat")


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """``(state, start time)`` from ``/proc/<pid>/stat``; ``None`` when there is no such process.

    The command name (field 2) is in parentheses and may hold spaces or parentheses itself, so the
    fields are counted from the last ``)``.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read().decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return fields[0], fields[19]


class ProcessWatch:
    """Tells when one process has ended.

    Holds a pidfd where Linux offers one: it becomes readable the moment the process exits (also
    while it is an unreaped zombie), and once opened it cannot refer to a later process with the
    same PID; the identity is checked right after opening to close the window before it. Without a
    pidfd, :meth:`ended` asks ``/proc`` each time.
    """

    def __init__(self, identity: ProcessIdentity) -> None:
        self.identity = identity
        self._fd: int | None = None
        self._ended_at_open = False
        try:
            self._fd = os.pidfd_open(identity.pid)
        except ProcessLookupError:
            self._ended_at_open = True
        except (AttributeError, OSError):  # no pidfd_open in this Python or kernel: poll instead
            self._fd = None
        if not self._ended_at_open and not identity.running():
            self.close()
            self._ended_at_open = True

    def fileno(self) -> int | None:
        """The pidfd, or ``None`` when this watch polls."""
        return self._fd

    def ended(self) -> bool:
        """Whether the process has exited (checked now, without waiting)."""
        if self._ended_at_open:
            return True
        if self._fd is not None:
            return bool(select.select([self._fd], [], [], 0)[0])
        return not self.identity.running()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def wait_for_any(watches: Sequence[ProcessWatch], timeout: float | None) -> list[ProcessWatch]:
    """Block until one of ``watches`` has ended or ``timeout`` seconds passed; return those ended.

    Sleeps in ``select`` on the pidfds; while any watch has no pidfd it wakes every :data:`_POLL_S`
    seconds to poll that one.
    """
    if not watches:
        raise ValueError("wait_for_any needs at least one process to watch")
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        ended = [watch for watch in watches if watch.ended()]
        if ended:
            return ended
        wait = None if deadline is None else deadline - time.monotonic()
        if wait is not None and wait <= 0:
            return []
        fds = [fd for fd in (watch.fileno() for watch in watches) if fd is not None]
        if len(fds) < len(watches):
            wait = _POLL_S if wait is None else min(wait, _POLL_S)
        select.select(fds, [], [], wait)


def run_dir_problem(run_dir: str) -> str | None:
    """Why ``run_dir`` may not be handed to a watcher to remove (``None``: it may)."""
    if not os.path.basename(os.path.normpath(run_dir)).startswith((RUN_DIR_PREFIX, JOB_DIR_PREFIX)):
        return (f"--run-dir {run_dir!r} is not a zerospeed launch folder (its name must start with "
                f"{RUN_DIR_PREFIX!r} or {JOB_DIR_PREFIX!r}); refusing to take charge of removing it")
    return None


class RunDirLock:
    """The run folder's ``ranks.lock``: a shared ``flock`` per rank still running, the last one out
    removes the folder (see the module docstring).

    ``flock`` locks belong to the open file and vanish with the last process that holds it, so a
    watcher killed outright never blocks the others' cleanup forever.
    """

    def __init__(self, run_dir: str) -> None:
        problem = run_dir_problem(run_dir)
        if problem is not None:
            raise ValueError(problem)
        self.run_dir = run_dir
        self._fd: int | None = None

    def hold(self) -> bool:
        """Take this rank's shared lock (blocking only while a last watcher is removing the folder);
        False when the folder is gone already.

        Creates the lock file: call it only before the rank starts (its launcher still lives, so the
        folder is not being removed by the launcher's cleanup), never later.
        """
        try:
            fd = os.open(os.path.join(self.run_dir, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except (FileNotFoundError, NotADirectoryError):
            return False
        fcntl.flock(fd, fcntl.LOCK_SH)
        self._fd = fd
        if self.removed():  # a last watcher removed the folder while we waited for the lock
            self.close()
            return False
        return True

    def removed(self) -> bool:
        """Whether the lock file we hold has been unlinked (the folder was removed: by the launcher's own
        cleanup, or by a last watcher). False when we hold none."""
        return self._fd is not None and os.fstat(self._fd).st_nlink == 0

    def remove_if_last(self) -> bool:
        """Give up our share; if nobody else holds one, remove the run folder. True if we removed it.

        Needs a share taken by :meth:`hold` (without one it does nothing, and never creates the lock
        file). Unlock-then-try is deliberate: of watchers releasing at the same time, the last to unlock
        finds no other share (or one holding it exclusively, which then removes the folder), so the
        folder is removed exactly once. A lock file already unlinked means the folder is gone.
        """
        if self._fd is None:
            return False
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        if self.removed():
            return False
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass(frozen=True)
class GuardOptions:
    """The guard's command line: whom to watch, what to clean, how long SIGTERM may take, what to run,
    and (``bind_cores``) the cores of this host whose share the rank is pinned to: a core list in
    DeepSpeed's ``--bind_core_list`` syntax, or ``"all"`` for DeepSpeed's default (every physical core)."""

    launcher: ProcessIdentity
    command: tuple[str, ...]
    run_dir: str | None = None
    grace_s: float = 10.0
    bind_cores: str | None = None


def guard_argv(launcher: ProcessIdentity, command: Sequence[str], *, run_dir: str | None,
               grace_s: float, bind_cores: str | None = None) -> list[str]:
    """Interpreter arguments that run ``command`` under this guard (``python <these>``)."""
    argv = ["-I", "-S", os.path.abspath(__file__), "--launcher-pid", str(launcher.pid)]
    if launcher.start is not None:
        argv += ["--launcher-start", launcher.start]
    if run_dir is not None:
        argv += ["--run-dir", run_dir]
    if bind_cores is not None:
        argv += ["--bind-cores", bind_cores]
    return [*argv, "--grace", f"{grace_s:g}", "--", *command]


def parse_core_list(text: str) -> list[int]:
    """DeepSpeed's ``--bind_core_list`` syntax: ``"0,2-4,6"`` -> ``[0, 2, 3, 4, 6]``; items ascending,
    not overlapping, no spaces (its ``parse_range_list`` rules, with errors that name the item)."""
    cores: list[int] = []
    last = -1
    for item in text.split(","):
        bounds = item.split("-")
        try:
            if len(bounds) == 1:
                first = final = int(bounds[0])
            elif len(bounds) == 2:
                first, final = int(bounds[0]), int(bounds[1])
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"bind_core_list {text!r}: {item!r} is neither a core number nor a range like "
                             "'0-3'") from None
        if first < 0 or first > final:
            raise ValueError(f"bind_core_list {text!r}: range {item!r} must be non-negative and end at or after "
                             "its start")
        if first <= last:
            raise ValueError(f"bind_core_list {text!r}: {item!r} overlaps or precedes the item before it; list "
                             "the cores in ascending order, each once")
        cores.extend(range(first, final + 1))
        last = final
    return cores


def default_core_list() -> list[int]:
    """The cores a rank binding shares out when no list is given: as DeepSpeed, cores ``0..P-1`` where P
    is this host's number of physical cores (sibling hyper-threads counted once, from sysfs; all CPUs
    where sysfs does not say)."""
    cores: set[tuple[str, str]] = set()
    base = "/sys/devices/system/cpu"
    try:
        names = [n for n in os.listdir(base) if n.startswith("cpu") and n[3:].isdigit()]
        for name in names:
            topology = os.path.join(base, name, "topology")
            with open(os.path.join(topology, "physical_package_id")) as package, \
                    open(os.path.join(topology, "core_id")) as core:
                cores.add((package.read().strip(), core.read().strip()))
    except OSError:
        cores = set()
    count = len(cores) or os.cpu_count() or 1
    return list(range(count))


def cores_of_rank(cores: Sequence[int], local_rank: int, local_world_size: int) -> list[int]:
    """Local rank ``local_rank``'s share of ``cores``: DeepSpeed's numactl binding, ``len(cores) //
    local_world_size`` consecutive cores each, in list order (a remainder stays unused)."""
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"local rank {local_rank} is outside 0..{local_world_size - 1}")
    per_rank = len(cores) // local_world_size
    if per_rank < 1:
        raise ValueError(f"--bind_cores_to_rank: {len(cores)} core(s) cannot be shared by {local_world_size} "
                         "ranks on this host (each needs at least one); give --bind_core_list more cores "
                         "or start fewer ranks per host")
    return list(cores[per_rank * local_rank:per_rank * (local_rank + 1)])


def bind_to_cores(spec: str, environ: MutableMapping[str, str]) -> list[int]:
    """Pin this process (about to ``exec`` the rank) to its share of ``spec`` (``"all"`` or a core list)
    and set ``OMP_NUM_THREADS`` to the share's size, as DeepSpeed's launcher does for a bound rank; the
    share follows from ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``, which torch's agent set. Returns it."""
    cores = default_core_list() if spec == "all" else parse_core_list(spec)
    share = cores_of_rank(cores, int(environ["LOCAL_RANK"]), int(environ["LOCAL_WORLD_SIZE"]))
    os.sched_setaffinity(0, share)
    environ["OMP_NUM_THREADS"] = str(len(share))
    return share


def redirect_output(environ: MutableMapping[str, str]) -> None:
    """Make the node agent's FIFOs (:data:`STDOUT_FIFO_VARIABLE`, :data:`STDERR_FIFO_VARIABLE`) this
    process's stdout and stderr, and drop the variables (the rank never sees them).

    Opened without blocking: a FIFO with no reader (the agent is gone) fails at once with ENXIO, and the
    stream then stays as inherited (the rank still runs; its lines are just not prefixed). The
    descriptor is made blocking again, so a slow reader slows the rank down instead of losing lines.
    """
    for variable, target in ((STDOUT_FIFO_VARIABLE, 1), (STDERR_FIFO_VARIABLE, 2)):
        path = environ.pop(variable, None)
        if not path:
            continue
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            _say(f"zerospeed: cannot attach {_rank_label(environ)}'s output to {path} "
                 f"({exc.strerror or exc}); its lines go out unprefixed")
            continue
        os.set_blocking(fd, True)
        os.dup2(fd, target)  # dup2's copy is inheritable: it survives the exec
        os.close(fd)


def parse_guard_args(argv: Sequence[str]) -> GuardOptions:
    """Parse ``[options] -- command...``; everything after the first ``--`` is the command, verbatim."""
    args = list(argv)
    if "--" not in args:
        raise SystemExit("zerospeed worker guard: missing '--' before the command to run")
    split = args.index("--")
    command = tuple(args[split + 1:])
    if not command:
        raise SystemExit("zerospeed worker guard: no command after '--'")
    parser = argparse.ArgumentParser(prog="worker_guard.py", allow_abbrev=False,
                                     description="Run a rank's command; stop it if the launcher dies.")
    parser.add_argument("--launcher-pid", type=int, required=True)
    parser.add_argument("--launcher-start", default=None)
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--grace", type=float, default=10.0)
    parser.add_argument("--bind-cores", default=None)
    ns = parser.parse_args(args[:split])
    if ns.run_dir is not None and (problem := run_dir_problem(ns.run_dir)) is not None:
        parser.error(problem)
    return GuardOptions(launcher=ProcessIdentity(ns.launcher_pid, ns.launcher_start), command=command,
                        run_dir=ns.run_dir, grace_s=ns.grace, bind_cores=ns.bind_cores)


def _say(message: str) -> None:
    """One line on stderr; a closed stderr (the launcher's pipe reader died with it) is no error.

    One ``write`` of the whole line: ``print`` writes the text and the newline separately, so two
    watchers speaking at once interleaved ("...SIGTERMzerospeed: ...rank 1..." then two newlines). One
    write of up to PIPE_BUF bytes to a pipe is atomic, and so is one to a file whose descriptor the
    writers share; a longer message (a traceback) is finished in further writes.
    """
    data = (message + "\n").encode("utf-8", "replace")
    try:
        while data:
            data = data[os.write(2, data):]
    except OSError:
        pass


def _rank_label(environ: Mapping[str, str]) -> str:
    return f"rank {environ.get('RANK', _UNKNOWN_RANK)}"


def stop_process(watch: ProcessWatch, *, group: bool, grace_s: float, label: str) -> None:
    """SIGTERM (to the process group if ``group``), SIGKILL after ``grace_s`` seconds; like the agent.

    SIGTERM first so user handlers and the script's own shutdown run; the group, because torch
    starts each rank as a session leader and signals its whole group (data-loader workers included).
    """
    _signal(watch, signal.SIGTERM, group=group)
    if wait_for_any([watch], grace_s):
        return
    _say(f"zerospeed: {label} (pid {watch.identity.pid}) still runs {grace_s:g} s after SIGTERM; "
         "sending SIGKILL")
    _signal(watch, signal.SIGKILL, group=group)
    wait_for_any([watch], _KILL_WAIT_S)


def _signal(watch: ProcessWatch, sig: signal.Signals, *, group: bool) -> None:
    if watch.ended():  # never signal a PID (or group) that may already belong to someone else
        return
    pid = watch.identity.pid
    try:
        if group:
            try:
                os.killpg(pid, sig)
                return
            except ProcessLookupError:  # the rank left its group (setsid/setpgid): signal it alone
                pass
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def watch_rank(rank: ProcessWatch, launcher: ProcessWatch, *, lock: RunDirLock | None, grace_s: float,
               group: bool, label: str) -> None:
    """The watcher's whole life: see the module docstring. ``lock`` is the run folder's, already held
    (``None``: no folder to clean up); it is closed on return."""
    try:
        ended = wait_for_any([rank, launcher], None)
        if launcher in ended and rank not in ended:
            _say(f"zerospeed: the launcher (pid {launcher.identity.pid}) is gone; stopping {label} "
                 f"(pid {rank.identity.pid}) with SIGTERM")
            stop_process(rank, group=group, grace_s=grace_s, label=label)
        elif launcher not in ended:
            if lock is None:  # nothing of ours to clean up: nothing to wait for
                return
            # The rank ended under a live launcher, which removes the folder itself when its run ends;
            # wait for that, or for the launcher to die before it gets there.
            wait_for_cleanup(launcher, lock)
        if lock is not None:
            lock.remove_if_last()
    finally:
        if lock is not None:
            lock.close()


def wait_for_cleanup(launcher: ProcessWatch, lock: RunDirLock, poll_s: float = _CLEANUP_POLL_S) -> None:
    """Return once the launcher has ended or has removed the run folder (the lock file we hold is
    unlinked), looking at the folder every ``poll_s`` seconds (one ``fstat``) and woken at once by the
    launcher's end."""
    while not lock.removed() and not wait_for_any([launcher], poll_s):
        pass


def _start_detached(task: Callable[[], None]) -> None:
    """Run ``task`` in a grandchild in its own session (classic double fork) and return at once.

    Detached, it is no child of the rank (a shell's ``wait`` or a ``waitpid(-1)`` never meets it)
    and outside the rank's process group (the agent's ``killpg`` spares it, so it can still clean
    up). stdin/stdout point to /dev/null; stderr stays, for its messages.
    """
    child = os.fork()
    if child:
        os.waitpid(child, 0)
        return
    try:
        os.setsid()
        if os.fork():
            os._exit(0)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.close(null)
        task()
        os._exit(0)
    except BaseException:  # noqa: BLE001 - report anything, and never unwind into the guard's main
        _say("zerospeed: the rank watcher failed:\n" + traceback.format_exc())
        os._exit(1)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Arm the watcher and become the rank's command; returns only if that cannot start."""
    options = parse_guard_args(sys.argv[1:] if argv is None else argv)
    environ = os.environ if environ is None else environ
    label = _rank_label(environ)
    launcher = ProcessWatch(options.launcher)
    lock = RunDirLock(options.run_dir) if options.run_dir is not None else None
    if launcher.ended():
        _say(f"zerospeed: the launcher (pid {options.launcher.pid}) is gone; not starting {label}")
        if lock is not None:
            try:
                if lock.hold():
                    lock.remove_if_last()
            finally:
                lock.close()
        return 1
    # The share is taken here, before the fork and the exec (see the module docstring); the watcher
    # inherits it, and keeps it when we close our own copy of the descriptor below.
    if lock is not None and not lock.hold():
        lock = None  # the folder is gone already: the watcher watches, but has nothing to clean
    rank = ProcessWatch(ProcessIdentity.of(os.getpid()))
    group = os.getpgrp() == os.getpid()
    _start_detached(lambda: watch_rank(rank, launcher, lock=lock, grace_s=options.grace_s, group=group,
                                       label=label))
    rank.close()
    launcher.close()
    if lock is not None:
        lock.close()  # the watcher's descriptor keeps the shared lock (flock belongs to the open file)
    # After the watcher's fork: its messages (the launcher is gone) must not go to a FIFO nobody reads.
    redirect_output(os.environ)
    if options.bind_cores is not None:
        try:
            bind_to_cores(options.bind_cores, os.environ)
        except (ValueError, KeyError, OSError) as exc:
            _say(f"zerospeed: cannot bind {label} to its cores: {exc}")
            return 1
    restore_signals()
    try:
        os.execvp(options.command[0], list(options.command))
    except OSError as exc:
        _say(f"zerospeed: cannot run {options.command[0]!r} for {label}: {exc.strerror or exc}")
    return 127


def restore_signals() -> None:
    """Give the signals Python ignores at start-up back their default action, as ``subprocess`` does
    for a child (``restore_signals=True``): an ignored disposition survives ``exec``, and the rank
    must see a closed pipe (SIGPIPE) and a file-size limit (SIGXFSZ) as it would without this guard."""
    for name in _RESTORED_SIGNALS:
        number = getattr(signal, name, None)
        if number is not None:
            signal.signal(number, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
