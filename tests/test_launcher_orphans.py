"""A launcher that dies without stopping its ranks (SIGKILL) must not leave them running (issue 32/3).

End-to-end tests run ``python -m zerospeed`` as a subprocess, SIGKILL it, and watch the ranks' PIDs
(which the rank scripts write into $ZS_TEST_OUT) and the launch's temporary folder (TMPDIR points
into the test's folder). The worker guard's own behaviour (exit status kept, SIGKILL after the
grace, a launcher dead before the rank starts, the folder removed by the last one out) is tested
by running the guard directly with a ``sleep`` standing in for the launcher, which needs neither
torch nor the elastic agent. Every process a test starts is killed in ``finally``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from zerospeed.launcher import worker_guard
from zerospeed.launcher.runners import guarded_command
from zerospeed.launcher.worker_guard import (
    LOCK_NAME,
    RUN_DIR_PREFIX,
    ProcessIdentity,
    ProcessWatch,
    RunDirLock,
    guard_argv,
    watch_rank,
)
from zerospeed.testing import free_port

REPO = Path(__file__).resolve().parents[1]
GUARD = str(REPO / "src" / "zerospeed" / "launcher" / "worker_guard.py")
# How long the ranks may take to stop once the launcher is gone (they need well under a second).
STOP_DEADLINE_S = 15.0
# How long a launch may take to get its ranks running (the launcher imports torch first).
START_DEADLINE_S = 60.0


def _env(out_dir: Path, tmp_dir: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO / "src"), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["ZS_TEST_OUT"] = str(out_dir)
    env["TMPDIR"] = str(tmp_dir)
    env.pop("OMP_NUM_THREADS", None)
    env.update(extra)
    return env


def _wait_until(condition: Callable[[], object], deadline_s: float, what: str, *,
                poll_s: float = 0.05) -> float:
    """Poll ``condition`` until true; return the seconds it took, fail naming ``what`` at the deadline."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > deadline_s:
            pytest.fail(f"{what} within {deadline_s} s")
        time.sleep(poll_s)
    return time.monotonic() - start


def _processes_mentioning(text: str) -> list[ProcessIdentity]:
    """Running processes whose command line contains ``text`` (the watchers name the run folder)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path("/proc", entry, "cmdline").read_bytes()
        except OSError:
            continue
        cmdline = raw.replace(b"\0", b" ").decode("utf-8", "replace")
        identity = ProcessIdentity.of(int(entry))
        if text in cmdline and identity.running():
            found.append(identity)
    return found


def _kill_all(identities: list[ProcessIdentity]) -> None:
    for identity in identities:
        if identity.running():
            try:
                os.kill(identity.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class _Job:
    """A launcher (or a guard) started by a test, its output in files, killed with all it started."""

    def __init__(self, cmd: list[str], env: dict[str, str], logs: Path, *, new_session: bool = False) -> None:
        self.stderr_path = logs / "stderr.txt"
        with open(logs / "stdout.txt", "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err,
                                         start_new_session=new_session)
        self.others: list[ProcessIdentity] = []  # ranks and watchers found while it ran

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        _kill_all(self.others)


@pytest.fixture
def dirs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    out.mkdir()
    tmp.mkdir()
    yield out, tmp
    _kill_all(_processes_mentioning(str(tmp)))  # watchers of a failed test name the run folder


@pytest.mark.timeout(START_DEADLINE_S + 2 * STOP_DEADLINE_S + 30)
def test_ranks_of_a_killed_launcher_stop_and_the_run_folder_goes(dirs: tuple[Path, Path],
                                                                 tmp_path: Path) -> None:
    out, tmp = dirs
    cmd = [sys.executable, "-m", "zerospeed", "--num_procs", "2", "--master_port", str(free_port()),
           "tests/launcher_scripts/heartbeat_forever.py"]
    job = _Job(cmd, _env(out, tmp), tmp_path)
    try:
        _wait_until(lambda: all((out / f"pid{r}").exists() for r in (0, 1)) or job.proc.poll() is not None,
                    START_DEADLINE_S, "both ranks did not start")
        assert job.proc.poll() is None, f"the launcher ended early:\n{job.stderr()}"
        ranks = [ProcessIdentity.of(int((out / f"pid{r}").read_text())) for r in (0, 1)]
        run_dirs = [p for p in tmp.iterdir() if p.name.startswith(RUN_DIR_PREFIX)]
        assert len(run_dirs) == 1, run_dirs
        watchers = _processes_mentioning(str(run_dirs[0]))
        job.others = [*ranks, *watchers]
        assert all(rank.running() for rank in ranks) and len(watchers) == 2, (ranks, watchers)

        job.proc.kill()  # the launcher alone, as the OOM killer would
        job.proc.wait()
        _wait_until(lambda: not any(p.running() for p in job.others), STOP_DEADLINE_S,
                    "the ranks (or their watchers) did not stop after the launcher was killed")
        beats = [(out / f"beat{r}").read_text() for r in (0, 1)]
        _wait_until(lambda: not run_dirs[0].exists(), STOP_DEADLINE_S,
                    "the launch's temporary folder was not removed")
        time.sleep(0.2)
        assert [(out / f"beat{r}").read_text() for r in (0, 1)] == beats  # nobody beats any more
        for rank, identity in enumerate(ranks):
            assert (f"zerospeed: the launcher (pid {job.proc.pid}) is gone; stopping rank {rank} "
                    f"(pid {identity.pid}) with SIGTERM\n") in job.stderr()
    finally:
        job.kill()


# The launcher called as a function by a process that lives on (a notebook, a sweep): two launches, then idle.
_LONG_LIVED = textwrap.dedent("""
    import time
    from zerospeed.launcher.cli import main

    for _ in range(2):
        code = main(["--num_procs", "1", "--master_port", "0", "tests/launcher_scripts/record_watcher.py"])
        assert code == 0, code
    print("launched", flush=True)
    time.sleep(120)
""")


@pytest.mark.timeout(START_DEADLINE_S + STOP_DEADLINE_S + 30)
def test_watchers_of_launches_in_a_long_lived_process_exit_after_each_launch(dirs: tuple[Path, Path],
                                                                             tmp_path: Path) -> None:
    """A watcher whose rank ended waits for the launcher's cleanup, not for the launcher's process to
    exit: it used to idle until then, one per rank and launch. The ranks record their watchers' PIDs
    (found by the lock file they hold open)."""
    out, tmp = dirs
    job = _Job([sys.executable, "-c", _LONG_LIVED], _env(out, tmp), tmp_path)
    stdout = tmp_path / "stdout.txt"
    try:
        _wait_until(lambda: "launched" in stdout.read_text() or job.proc.poll() is not None, START_DEADLINE_S,
                    "the two launches did not return")
        assert job.proc.poll() is None, job.stderr()
        records = sorted(out.glob("watchers-*"))
        watchers = [ProcessIdentity(int(pid), start) for record in records
                    for pid, start in (line.split() for line in record.read_text().splitlines())]
        job.others = watchers
        assert len(records) == 2 and len(watchers) == 2, (records, watchers)
        _wait_until(lambda: not any(watcher.running() for watcher in watchers), STOP_DEADLINE_S,
                    "the watchers of the finished launches did not exit while their launcher's process lives")
        assert job.proc.poll() is None and list(tmp.iterdir()) == []  # the launcher removed its folders
    finally:
        job.kill()


# -- the guard alone, a `sleep` standing in for the launcher -------------------------------------

def _stand_in_launcher() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "120"])


def _guard(launcher: subprocess.Popen[bytes] | ProcessIdentity, run_dir: Path, command: list[str],
           logs: Path, grace_s: float = 1.0, env: dict[str, str] | None = None) -> _Job:
    """Start ``command`` under the guard as torch's agent would: a session leader."""
    identity = launcher if isinstance(launcher, ProcessIdentity) else ProcessIdentity.of(launcher.pid)
    argv = [sys.executable, *guard_argv(identity, command, run_dir=str(run_dir), grace_s=grace_s)]
    return _Job(argv, env or {**os.environ, "RANK": "5"}, logs, new_session=True)


def _stop(launcher: subprocess.Popen[bytes]) -> None:
    if launcher.poll() is None:
        launcher.kill()
    launcher.wait()


@pytest.mark.timeout(START_DEADLINE_S + STOP_DEADLINE_S + 30)
def test_a_rank_stopped_mid_save_leaves_latest_on_the_complete_tag(tmp_path: Path) -> None:
    """Saves are atomic by construction (a temporary folder renamed into place, ``latest`` rewritten
    by temp + rename), so a rank stopped in the middle of a save leaves ``latest`` on the previous,
    complete tag, which loads exactly. One rank, under the guard alone: the launcher's part is the
    test above, and this keeps the test to one torch start."""
    from zerospeed.checkpoint import get_fp32_state_dict
    from zerospeed.checkpoint.layout import read_latest

    run_dir = tmp_path / f"{RUN_DIR_PREFIX}v"
    run_dir.mkdir()
    save_dir = tmp_path / "ckpt"
    rank_env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "ZS_SAVE_DIR": str(save_dir)}
    launcher = _stand_in_launcher()
    job = _guard(launcher, run_dir, [sys.executable, "-u", "tests/launcher_scripts/save_slowly.py"], tmp_path,
                 env=_env(tmp_path, tmp_path, **rank_env), grace_s=10)
    try:
        _wait_until(lambda: (tmp_path / "saving0").exists() or job.proc.poll() is not None, START_DEADLINE_S,
                    "the rank did not reach its second save")
        assert job.proc.poll() is None, job.stderr()
        job.others = _processes_mentioning(str(run_dir))
        launcher.kill()
        launcher.wait()
        assert job.proc.wait(timeout=STOP_DEADLINE_S) == -signal.SIGTERM
        _wait_until(lambda: not run_dir.exists(), STOP_DEADLINE_S, "the run folder was not removed")
    finally:
        _stop(launcher)
        job.kill()
    assert read_latest(str(save_dir)) == "global_step2"
    assert not (save_dir / "global_step3").exists()
    assert any(name.startswith(".tmp-global_step3") for name in os.listdir(save_dir))  # the save in progress
    saved = json.loads((tmp_path / "step2.json").read_text())
    loaded = get_fp32_state_dict(str(save_dir))
    assert {name: tensor.reshape(-1).tolist() for name, tensor in loaded.items()} == saved


@pytest.mark.timeout(60)
def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    """An executable (``--no_python``) that ignores SIGTERM; the rank keeps the guard's PID."""
    run_dir = tmp_path / f"{RUN_DIR_PREFIX}x"
    run_dir.mkdir()
    pid_file = tmp_path / "pid"
    launcher = _stand_in_launcher()
    script = f"trap '' TERM; echo $$ > {pid_file}; while :; do sleep 0.05; done"
    job = _guard(launcher, run_dir, ["/bin/sh", "-c", script], tmp_path)
    try:
        _wait_until(lambda: pid_file.exists() and pid_file.read_text().strip(), 10, "the rank did not start")
        assert int(pid_file.read_text()) == job.proc.pid  # exec: the rank is the process the agent started
        watchers = _processes_mentioning(str(run_dir))
        job.others = watchers
        assert len(watchers) == 1
        launcher.kill()
        launcher.wait()
        start = time.monotonic()
        assert job.proc.wait(timeout=STOP_DEADLINE_S) == -signal.SIGKILL
        assert 0.9 < time.monotonic() - start < STOP_DEADLINE_S  # not before the 1 s grace
        _wait_until(lambda: not run_dir.exists() and not watchers[0].running(), STOP_DEADLINE_S,
                    "the watcher did not remove the run folder and exit")
        assert job.stderr() == (
            f"zerospeed: the launcher (pid {launcher.pid}) is gone; stopping rank 5 (pid {job.proc.pid}) "
            f"with SIGTERM\n"
            f"zerospeed: rank 5 (pid {job.proc.pid}) still runs 1 s after SIGTERM; sending SIGKILL\n"
        )
    finally:
        _stop(launcher)
        job.kill()


@pytest.mark.timeout(60)
def test_exit_status_is_kept_and_the_folder_waits_for_the_launcher(tmp_path: Path) -> None:
    """A rank that ends under a live launcher: its exit code passes through the guard unchanged and
    the folder stays (the launcher removes it) until the launcher is gone without removing it."""
    run_dir = tmp_path / f"{RUN_DIR_PREFIX}y"
    run_dir.mkdir()
    launcher = _stand_in_launcher()
    job = _guard(launcher, run_dir, [sys.executable, "-c", "import sys; sys.exit(3)"], tmp_path)
    try:
        assert job.proc.wait(timeout=30) == 3
        job.others = _processes_mentioning(str(run_dir))
        time.sleep(0.3)
        assert run_dir.exists() and len(job.others) == 1 and job.others[0].running()
        launcher.kill()
        launcher.wait()
        _wait_until(lambda: not run_dir.exists() and not job.others[0].running(), STOP_DEADLINE_S,
                    "the run folder of a launcher killed after its ranks ended was not removed")
        assert job.stderr() == ""
    finally:
        _stop(launcher)
        job.kill()


@pytest.mark.timeout(60)
def test_the_rank_gets_the_signal_dispositions_it_would_get_without_the_guard(tmp_path: Path) -> None:
    """Python ignores SIGPIPE and SIGXFSZ and an ignore survives exec: the guard resets both, as
    ``subprocess`` (and so torch's agent) does for any child."""
    run_dir = tmp_path / f"{RUN_DIR_PREFIX}s"
    run_dir.mkdir()
    probe = ["/bin/sh", "-c", "grep SigIgn /proc/self/status"]
    launcher = _stand_in_launcher()
    job = _guard(launcher, run_dir, probe, tmp_path)
    try:
        assert job.proc.wait(timeout=30) == 0, job.stderr()
        guarded = (tmp_path / "stdout.txt").read_text()
        assert guarded == subprocess.run(probe, capture_output=True, text=True, check=True).stdout
        ignored = int(guarded.split()[1], 16)
        assert not ignored & (1 << (signal.SIGPIPE - 1) | 1 << (signal.SIGXFSZ - 1)), guarded
    finally:
        _stop(launcher)
        job.kill()
        _kill_all(_processes_mentioning(str(run_dir)))


# Prints the locks on argv[1] from /proc/locks as "<kind> <mode> <pid>" ("-> " marks a blocked waiter).
_LOCKS_ON = textwrap.dedent("""
    import os, sys
    st = os.stat(sys.argv[1])
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in open("/proc/locks"):
        fields = line.split()
        if fields[1] != "->" and fields[5] == key:
            print(fields[1], fields[3], fields[4])
""")


@pytest.mark.timeout(60)
def test_the_guard_takes_the_ranks_share_of_the_lock_before_the_rank_runs(tmp_path: Path) -> None:
    """The share is taken by the guard (the rank's own PID, before the exec), so it is held from the
    rank's first instruction: taken later by the watcher, a sibling could count itself last meanwhile."""
    run_dir = tmp_path / f"{RUN_DIR_PREFIX}l"
    run_dir.mkdir()
    launcher = _stand_in_launcher()
    job = _guard(launcher, run_dir, [sys.executable, "-c", _LOCKS_ON, str(run_dir / LOCK_NAME)], tmp_path)
    try:
        assert job.proc.wait(timeout=30) == 0, job.stderr()
        assert (tmp_path / "stdout.txt").read_text() == f"FLOCK READ {job.proc.pid}\n"
        job.others = _processes_mentioning(str(run_dir))
        assert len(job.others) == 1  # the watcher, which holds it on
    finally:
        _stop(launcher)
        job.kill()


@pytest.mark.timeout(60)
def test_a_rank_whose_launcher_is_already_gone_does_not_start(tmp_path: Path) -> None:
    run_dir = tmp_path / f"{RUN_DIR_PREFIX}z"
    run_dir.mkdir()
    launcher = _stand_in_launcher()
    identity = ProcessIdentity.of(launcher.pid)
    _stop(launcher)
    marker = tmp_path / "ran"
    job = _guard(identity, run_dir, ["/bin/sh", "-c", f"touch {marker}"], tmp_path)
    try:
        assert job.proc.wait(timeout=30) == 1
        assert job.stderr() == f"zerospeed: the launcher (pid {launcher.pid}) is gone; not starting rank 5\n"
        assert not marker.exists() and not run_dir.exists()
    finally:
        job.kill()


@pytest.mark.timeout(60)
def test_a_command_that_cannot_start_exits_127_naming_it(tmp_path: Path) -> None:
    run_dir = tmp_path / f"{RUN_DIR_PREFIX}u"
    run_dir.mkdir()
    launcher = _stand_in_launcher()
    job = _guard(launcher, run_dir, [str(tmp_path / "no_such_program"), "--x"], tmp_path)
    try:
        assert job.proc.wait(timeout=30) == 127
        assert job.stderr() == (f"zerospeed: cannot run '{tmp_path / 'no_such_program'}' for rank 5: "
                                "No such file or directory\n")
    finally:
        _stop(launcher)
        job.kill()
        _kill_all(_processes_mentioning(str(run_dir)))


# -- pure pieces -------------------------------------------------------------------------------------

def test_identity_tells_a_recycled_pid_and_a_zombie_from_the_process() -> None:
    me = ProcessIdentity.of(os.getpid())
    assert me.start is not None and me.running()
    assert not ProcessIdentity(os.getpid(), str(int(me.start) + 1)).running()  # same PID, other process
    assert ProcessWatch(ProcessIdentity(os.getpid(), "0")).ended()
    child = subprocess.Popen(["true"])
    try:
        identity = ProcessIdentity.of(child.pid)
        watch = ProcessWatch(identity)
        # Exited but not reaped: a zombie has ended, for the pidfd and for /proc alike.
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        assert watch.ended() and not identity.running()
        watch.close()
    finally:
        child.wait()


def test_the_last_lock_holder_removes_the_run_folder(tmp_path: Path) -> None:
    run_dir = tmp_path / f"{RUN_DIR_PREFIX}w"
    run_dir.mkdir()
    (run_dir / "log.txt").write_text("x")
    first, second = RunDirLock(str(run_dir)), RunDirLock(str(run_dir))
    try:
        first.hold()
        second.hold()
        assert not first.remove_if_last() and run_dir.exists()
        assert second.remove_if_last() and not run_dir.exists()
        assert not RunDirLock(str(run_dir)).remove_if_last()  # gone already: nothing to do
    finally:
        first.close()
        second.close()
    with pytest.raises(ValueError, match=r"--run-dir '/tmp' is not a zerospeed launch folder \(its name must "
                                         r"start with 'zerospeed-launch-' or 'zerospeed-job-'\); refusing"):
        RunDirLock("/tmp")


def test_only_a_holder_can_be_last_and_nothing_recreates_the_lock_file(tmp_path: Path) -> None:
    """A watcher never creates ``ranks.lock`` after its rank started: an ``O_CREAT`` in a folder that the
    launcher's cleanup was removing made that cleanup fail ("directory not empty")."""
    run_dir = tmp_path / f"{RUN_DIR_PREFIX}n"
    run_dir.mkdir()
    assert not RunDirLock(str(run_dir)).remove_if_last()
    assert list(run_dir.iterdir()) == []
    lock = RunDirLock(str(run_dir))
    try:
        assert lock.hold() and not lock.removed()
        shutil.rmtree(run_dir)  # the launcher's own cleanup, while the watcher still holds its share
        assert lock.removed() and not lock.remove_if_last() and not run_dir.exists()
    finally:
        lock.close()
    assert not RunDirLock(str(run_dir)).hold()  # gone: nothing to hold, nothing created


def test_a_message_is_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two watchers speaking at once must not interleave: ``print`` wrote text and newline apart."""
    writes: list[tuple[int, bytes]] = []
    monkeypatch.setattr(worker_guard.os, "write", lambda fd, data: writes.append((fd, bytes(data))) or len(data))
    worker_guard._say("zerospeed: the launcher (pid 1) is gone; stopping rank 1 (pid 2) with SIGTERM")
    assert writes == [(2, b"zerospeed: the launcher (pid 1) is gone; stopping rank 1 (pid 2) with SIGTERM\n")]


@pytest.fixture(params=["pidfd", "polling"])
def watch_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each in-process watcher test runs with pidfds and with the fallback that polls /proc."""
    if request.param == "polling":
        monkeypatch.delattr(os, "pidfd_open")
    return str(request.param)


def _watches(*procs: subprocess.Popen[bytes], kind: str) -> list[ProcessWatch]:
    watches = [ProcessWatch(ProcessIdentity.of(proc.pid)) for proc in procs]
    assert [watch.fileno() is None for watch in watches] == [kind == "polling"] * len(procs)
    return watches


@pytest.mark.timeout(60)
def test_the_watcher_stops_the_rank_when_the_launcher_dies(tmp_path: Path, watch_kind: str,
                                                           capfd: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / f"{RUN_DIR_PREFIX}a"
    run_dir.mkdir()
    launcher, rank = _stand_in_launcher(), subprocess.Popen(["sleep", "120"])
    lock = RunDirLock(str(run_dir))
    try:
        rank_watch, launcher_watch = _watches(rank, launcher, kind=watch_kind)
        assert lock.hold()
        threading.Timer(0.3, launcher.kill).start()
        watch_rank(rank_watch, launcher_watch, lock=lock, grace_s=5, group=False, label="rank 7")
        assert rank.wait(timeout=1) == -signal.SIGTERM and not run_dir.exists()
        assert capfd.readouterr().err == (f"zerospeed: the launcher (pid {launcher.pid}) is gone; stopping rank 7 "
                                          f"(pid {rank.pid}) with SIGTERM\n")
    finally:
        lock.close()
        _stop(launcher)
        _stop(rank)


@pytest.mark.timeout(60)
def test_a_watcher_whose_rank_ended_exits_once_the_launcher_removed_the_folder(tmp_path: Path,
                                                                               watch_kind: str) -> None:
    """The launcher lives on (a notebook): its cleanup, not its exit, ends the watcher."""
    run_dir = tmp_path / f"{RUN_DIR_PREFIX}b"
    run_dir.mkdir()
    launcher, rank = _stand_in_launcher(), _stand_in_launcher()
    lock = RunDirLock(str(run_dir))
    try:
        rank_watch, launcher_watch = _watches(rank, launcher, kind=watch_kind)
        assert lock.hold()
        _stop(rank)  # the rank ends; its launcher lives on
        threading.Timer(0.3, shutil.rmtree, [run_dir]).start()
        start = time.monotonic()
        watch_rank(rank_watch, launcher_watch, lock=lock, grace_s=5, group=False, label="rank 7")
        assert 0.3 <= time.monotonic() - start < STOP_DEADLINE_S
        assert launcher.poll() is None and not run_dir.exists()  # and no lock file put back
        # No folder to clean up: the watcher ends with its rank.
        second = _stand_in_launcher()
        watches = _watches(second, launcher, kind=watch_kind)
        _stop(second)
        start = time.monotonic()
        watch_rank(*watches, lock=None, grace_s=5, group=False, label="rank 7")
        assert time.monotonic() - start < 1 and launcher.poll() is None
    finally:
        lock.close()
        _stop(launcher)


def test_guarded_command_wraps_and_escapes_the_rank_command() -> None:
    command = ("./a$b.sh", ["$$x", "${local_rank}"])
    assert guarded_command(command, run_dir="/t/zerospeed-launch-$q", grace_s=10,
                           launcher=ProcessIdentity(42, "777"), python="py") == ("py", [
        "-I", "-S", GUARD, "--launcher-pid", "42", "--launcher-start", "777", "--run-dir",
        "/t/zerospeed-launch-$$q", "--grace", "10", "--", "./a$$b.sh", "$$x", "${local_rank}"])
