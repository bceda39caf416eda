"""The runner process of a multi-node job (zerospeed.launcher.multinode.run_job): pre-flight, streaming,
failure naming, stopping, Ctrl-C and elastic loss/re-join, driven with fake agents.

A "host" here is a small Python script standing in for what pdsh/ssh would start remotely (the node
agent): it prints "[<host> rank <r>] ..." lines, writes its PID to a file, stops when its stdin reaches
EOF (as ``--watch_stdin`` does) and, by its mode, finishes, fails with a traceback, hangs, or ignores
SIGTERM. A fake "pdsh" runs several of them behind one process with pdsh's "<host>: " prefixes and its
"pdsh@...: <host>: ssh exited with exit code N" report. No torch, no network: each test runs in a
few seconds. One test at the end uses the namespace test cluster (real sshd, real torch, gloo) and is
skipped with the reason where that cluster cannot be made.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from zerospeed.launcher.job import ElasticSpec, JobSpec
from zerospeed.launcher.multinode import PreflightError, run_job
from zerospeed.launcher.plan import Program

pytestmark = pytest.mark.spawns

PY = sys.executable
# A job whose every host is stopped must be gone well within this (grace in these tests: 1-2 s).
STOP_BOUND_S = 10.0

FAKE_AGENT = textwrap.dedent(
    r'''
    import os, signal, sys, threading, time
    host, rank, mode, folder = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    lines = int(sys.argv[5]) if len(sys.argv) > 5 else 3
    with open(os.path.join(folder, f"{host}.pid"), "a") as f:
        f.write(f"{os.getpid()}\n")
    if mode == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def watch_stdin():
        while os.read(0, 4096):           # EOF: the runner is gone or stopping us
            pass
        os.write(2, f"[{host} rank {rank}] stdin closed\n".encode())
        if mode != "ignore_term":
            os._exit(9)

    threading.Thread(target=watch_stdin, daemon=True).start()
    for i in range(lines):
        print(f"[{host} rank {rank}] step {i} " + host * 200, flush=True)
    if mode == "ok":
        sys.exit(0)
    if mode == "fail":
        time.sleep(0.3)
        print(f"[{host} rank {rank}] Traceback (most recent call last):", file=sys.stderr, flush=True)
        print(f'[{host} rank {rank}]   File "train.py", line 3, in <module>', file=sys.stderr, flush=True)
        print(f"[{host} rank {rank}] RuntimeError: boom on {host}", file=sys.stderr, flush=True)
        sys.exit(1)
    if mode.startswith("exit"):
        sys.exit(int(mode[4:]))
    if mode.startswith("until:"):       # run until a file appears, then finish
        while not os.path.exists(mode[6:]):
            time.sleep(0.05)
        sys.exit(0)
    while True:                          # hang / ignore_term
        time.sleep(0.1)
    '''
)

FAKE_PDSH = textwrap.dedent(
    r'''
    import subprocess, sys, threading
    # argv: python fake_pdsh.py <agent.py> <folder> host:rank:mode ...
    agent, folder = sys.argv[1], sys.argv[2]
    lock = threading.Lock()

    def run(spec):
        host, rank, mode = spec.split(":", 2)
        proc = subprocess.Popen([sys.executable, agent, host, rank, mode, folder],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=sys.stdin)
        for line in proc.stdout:
            with lock:
                sys.stdout.write(f"{host}: " + line.decode())
                sys.stdout.flush()
        code = proc.wait()
        if code:
            with lock:
                sys.stderr.write(f"pdsh@launcher: {host}: ssh exited with exit code {code}\n")
                sys.stderr.flush()
        return code

    threads = [threading.Thread(target=run, args=(s,)) for s in sys.argv[3:]]
    for t in threads: t.start()
    for t in threads: t.join()
    sys.exit(1)
    '''
)


@dataclass(frozen=True)
class Launch:
    """Stands in for commands.RemoteLaunch (same fields)."""

    argv: tuple[str, ...]
    hosts: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)


def _spec(hosts: tuple[str, ...], *, elastic: ElasticSpec | None = None) -> JobSpec:
    return JobSpec(job_id="test", world=tuple((h, (0,)) for h in hosts), master_addr="10.255.255.1",
                   master_port=29999, program=Program(script="train.py"), elastic=elastic)


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    (tmp_path / "agent.py").write_text(FAKE_AGENT)
    (tmp_path / "pdsh.py").write_text(FAKE_PDSH)
    return tmp_path


def _agent(folder: Path, host: str, rank: int, mode: str, lines: int = 3) -> Launch:
    return Launch((PY, str(folder / "agent.py"), host, str(rank), mode, str(folder), str(lines)), (host,))


def _pids(folder: Path, host: str) -> list[int]:
    path = folder / f"{host}.pid"
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes (its parent, the fake pdsh, may not have reaped it yet).
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _run(spec: JobSpec, launches: list[Launch], **kwargs: object) -> tuple[int, str, str, str, float]:
    out, err, log = io.StringIO(), io.StringIO(), io.StringIO()
    started = time.monotonic()
    code = run_job(spec, runner=str(kwargs.pop("runner", "ssh")), launches=launches, out=out, err=err,
                   log=log, **kwargs)  # type: ignore[arg-type]
    return code, out.getvalue(), err.getvalue(), log.getvalue(), time.monotonic() - started


def test_every_host_streams_whole_lines_and_success_is_zero(folder: Path) -> None:
    hosts = ("h0", "h1", "h2")
    launches = [_agent(folder, h, r, "ok", lines=400) for r, h in enumerate(hosts)]
    code, out, err, log, _ = _run(_spec(hosts), launches, no_ssh_check=True)
    assert code == 0, log + err
    lines = out.splitlines()
    assert len(lines) == 3 * 400
    pattern = re.compile(r"\[(h\d) rank (\d)\] step (\d+) (h\d)+$")
    for line in lines:
        match = pattern.match(line)
        assert match is not None and line.endswith(match[1] * 200), f"spliced line: {line[:80]}..."
    for rank, host in enumerate(hosts):
        steps = [int(m[3]) for m in map(pattern.match, lines) if m and m[1] == host]
        assert steps == list(range(400)), host


def test_a_failed_host_stops_the_job_and_is_named_with_rank_and_first_error(folder: Path) -> None:
    hosts = ("h0", "h1", "h2")
    stop_marker = folder / "stopped"
    stop = [Launch((PY, "-c", f"open({str(stop_marker)!r}, 'a').write('{h}\\n')"), (h,)) for h in hosts]
    launches = [_agent(folder, "h0", 0, "hang"), _agent(folder, "h1", 1, "fail"),
                _agent(folder, "h2", 2, "hang")]
    code, out, err, log, took = _run(_spec(hosts), launches, stop=stop, no_ssh_check=True,
                                     stop_grace_s=2.0)
    assert code == 1
    assert ("zerospeed: host h1, rank 1 failed: exit code 1; first error: "
            "[h1 rank 1] RuntimeError: boom on h1\n") in log
    assert "stopping this job on every host" in log
    assert sorted(stop_marker.read_text().split()) == ["h0", "h1", "h2"]  # each host's stop ran once
    assert took < STOP_BOUND_S
    for host in hosts:
        assert _pids(folder, host) and not any(_alive(p) for p in _pids(folder, host)), host
    # The failing host's traceback reached our stderr whole, before the summary.
    assert "[h1 rank 1] Traceback (most recent call last):\n" in err


def test_an_agent_that_ignores_sigterm_is_killed_after_the_grace(folder: Path) -> None:
    launches = [_agent(folder, "h0", 0, "ignore_term"), _agent(folder, "h1", 1, "exit3")]
    code, _, _, log, took = _run(_spec(("h0", "h1")), launches, no_ssh_check=True, stop_grace_s=1.0)
    assert code == 3
    assert "zerospeed: host h1, rank 1 failed: exit code 3; its last line: [h1 rank 1] step 2 h1h1" in log
    assert "for h0 did not stop within 1 s; killing it" in log
    assert 1.0 <= took < STOP_BOUND_S
    assert not any(_alive(p) for p in _pids(folder, "h0"))


def test_pdsh_report_of_one_host_stops_the_job_without_waiting_for_the_others(folder: Path) -> None:
    hosts = ("h0", "h1")
    pdsh = Launch((PY, str(folder / "pdsh.py"), str(folder / "agent.py"), str(folder),
                   "h0:0:hang", "h1:1:fail"), hosts)
    code, out, err, log, took = _run(_spec(hosts), [pdsh], runner="pdsh", no_ssh_check=True,
                                     stop_grace_s=2.0)
    assert code == 1  # pdsh's report for h1 (the pdsh process itself is stopped, not waited for)
    assert ("zerospeed: host h1, rank 1 failed: exit code 1; first error: "
            "[h1 rank 1] RuntimeError: boom on h1\n") in log
    assert took < STOP_BOUND_S
    # pdsh's "<host>: " prefix is dropped where the agent's own "[<host> rank r]" follows.
    assert "[h0 rank 0] step 0 " in out and "h0: [h0" not in out
    assert "pdsh@launcher: h1: ssh exited with exit code 1\n" in err
    for host in hosts:
        assert not any(_alive(p) for p in _pids(folder, host)), host


def test_a_lost_host_is_named_before_the_host_whose_ranks_broke_because_of_it(folder: Path) -> None:
    # h0's ranks fail first (their collective broke), h1's ssh reports the lost host a moment later
    # (as soon as run_job has reaped h0's launch process).
    h1 = Launch((PY, "-c", f"import os, sys, time; p = {str(folder / 'h0.pid')!r}\n"
                 "while not os.path.exists(p): time.sleep(0.01)\n"
                 "while os.path.exists(f'/proc/{int(open(p).read())}'): time.sleep(0.01)\n"
                 "print('Connection to h1 closed by remote host.', file=sys.stderr); sys.exit(255)"), ("h1",))
    launches = [_agent(folder, "h0", 0, "fail"), h1]
    code, _, _, log, _ = _run(_spec(("h0", "h1")), launches, no_ssh_check=True, stop_grace_s=2.0)
    assert code == 255
    assert ("zerospeed: host h1, rank 1 failed: exit code 255 (ssh lost the host: it went down, its sshd or "
            "the agent was killed, or the network failed); its last line: Connection to h1 closed by remote "
            "host.\n") in log
    assert "zerospeed: h0 also ended: exit code 1\n" in log


def test_a_launch_for_several_hosts_names_the_host_that_printed_the_error(folder: Path) -> None:
    # As mpirun/srun: one process for all hosts; the agents' prefixes say which host failed.
    script = ("import sys; print('[h0 rank 0] step 0', flush=True); "
              "print('[h1 rank 1] ValueError: bad batch', file=sys.stderr, flush=True); "
              "print('zerospeed: host h1 rank 1 (local 0, pid 7) exited with code 1', file=sys.stderr); "
              "sys.exit(1)")
    launch = Launch((PY, "-c", script), ("h0", "h1"))
    code, _, _, log, _ = _run(_spec(("h0", "h1")), [launch], runner="openmpi", no_ssh_check=True)
    assert code == 1
    assert ("zerospeed: host h1, rank 1 failed: exit code 1; first error: [h1 rank 1] ValueError: bad "
            "batch\n") in log


@pytest.mark.parametrize("sig, expected", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_sigterm_stops_exactly_this_job(folder: Path, sig: signal.Signals,
                                                  expected: int) -> None:
    launches = [_agent(folder, "h0", 0, "hang"), _agent(folder, "h1", 1, "hang")]
    bystander = _agent(folder, "other", 0, "hang")  # not part of the job: must survive
    other = subprocess.Popen(bystander.argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    try:
        def send() -> None:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not all(_pids(folder, h) for h in ("h0", "h1", "other")):
                time.sleep(0.05)
            os.kill(os.getpid(), sig)

        threading.Thread(target=send, daemon=True).start()
        code, _, _, log, took = _run(_spec(("h0", "h1")), launches, no_ssh_check=True,
                                     stop_grace_s=2.0)
        assert code == expected
        assert f"zerospeed: stopped by {sig.name}; stopping this job's processes on every host" in log
        assert took < STOP_BOUND_S
        for host in ("h0", "h1"):
            assert not any(_alive(p) for p in _pids(folder, host)), host
        assert other.poll() is None and _alive(_pids(folder, "other")[0])
    finally:
        other.kill()
        other.wait()
    # Our handlers are gone again: the previous ones are back.
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_preflight_names_an_unreachable_host_and_starts_nothing(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started = folder / "started"
    launches = [Launch((PY, "-c", f"open({str(started)!r}, 'w')"), ("h0",))]
    answer = '{"host": "h0"}'
    preflight = [Launch((PY, "-c", f"print('ZEROSPEED_PREFLIGHT {answer}')"), ("h0",)),
                 Launch((PY, "-c", "import time; time.sleep(30)"), ("h1",)),
                 Launch((PY, "-c", "import sys; print('ssh: Could not resolve hostname h2', file=sys.stderr); "
                                   "sys.exit(255)"), ("h2",))]
    compared: list[object] = []
    _fake_compare(monkeypatch, compared, problems=["host h0: zerospeed 0.1 here, 0.2 there: install 0.2"])
    with pytest.raises(PreflightError) as raised:
        _run(_spec(("h0", "h1", "h2")), launches, preflight=preflight, preflight_timeout_s=1.0)
    message = str(raised.value)
    assert message.startswith("pre-flight found 3 problem(s); no rank was started:\n")
    assert ("  - host h1 did not answer within 1 s over ssh: check that `ssh h1 true` works without a "
            "password\n") in message
    assert ("  - host h2 did not answer over ssh: the command exited with code 255 (it said: ssh: Could "
            "not resolve hostname h2): check that `ssh h2 true` works without a password\n") in message
    assert "  - host h0: zerospeed 0.1 here, 0.2 there: install 0.2\n" in message
    assert compared == [{"h0": {"host": "h0"}}]
    assert not started.exists()


def test_preflight_passes_and_the_master_port_is_listened_on_when_master_is_here(
        folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from zerospeed.testing import free_port

    port = free_port()
    spec = JobSpec(job_id="t", world=(("h0", (0,)),), master_addr="127.0.0.1", master_port=port,
                   program=Program(script="train.py"))
    connect = (f"import json, socket; s = socket.create_connection(('127.0.0.1', {port}), timeout=3); "
               "print('ZEROSPEED_PREFLIGHT ' + json.dumps({'host': 'h0', 'master_reachable': True}))")
    compared: list[object] = []
    _fake_compare(monkeypatch, compared, problems=[])
    code, out, _, log, _ = _run(spec, [_agent(folder, "h0", 0, "ok")],
                                preflight=[Launch((PY, "-c", connect), ("h0",))])
    assert code == 0
    assert compared == [{"h0": {"host": "h0", "master_reachable": True}}]
    assert "zerospeed: pre-flight passed on 1 host(s) through ssh" in log


def test_preflight_with_the_real_checks_refuses_a_missing_script_and_checks_the_master_port(
        folder: Path) -> None:
    from zerospeed.testing import free_port

    port = free_port()
    spec = JobSpec(job_id="t", world=(("h0", (0,)), ("h1", (0,))), master_addr="127.0.0.1", master_port=port,
                   program=Program(script=str(folder / "missing.py")))
    asked: list[bool] = []

    def preflight(check_master: bool) -> list[Launch]:
        asked.append(check_master)
        return [Launch((PY, "-m", "zerospeed.launcher.preflight", f"--job={spec.encode()}", f"--node_host={h}",
                        *(["--check_master"] if check_master else [])), (h,)) for h in spec.hosts]

    started = folder / "started"
    with pytest.raises(PreflightError) as raised:
        _run(spec, [Launch((PY, "-c", f"open({str(started)!r}, 'w')"), ("h0",))], preflight=preflight)
    assert asked == [True]  # we listened on 127.0.0.1:<port>, so the hosts were asked to connect
    message = str(raised.value)
    assert message.startswith("pre-flight found 2 problem(s); no rank was started:\n")
    for host in spec.hosts:
        assert (f"  - host {host}: {str(folder / 'missing.py')!r} does not exist in {os.getcwd()} there") in message
    assert "cannot connect to the master port" not in message
    assert not started.exists()


def _fake_compare(monkeypatch: pytest.MonkeyPatch, seen: list[object], *, problems: list[str]) -> None:
    """Stand in for preflight.compare (the node-agent helper's pure function) to test our side."""
    from zerospeed.launcher import multinode

    def compare(answers: Mapping[str, object], spec: JobSpec) -> list[str]:
        seen.append(dict(answers))
        return problems

    monkeypatch.setattr(multinode, "_compare", compare)


# --- elastic ------------------------------------------------------------------------------------


def _counted(folder: Path, name: str, *codes: int) -> Launch:
    """A command that exits with codes[i] on its i-th run (the last code repeats)."""
    script = (f"import os, sys; p = {str(folder / name)!r}; n = len(open(p).read()) if os.path.exists(p) "
              f"else 0; open(p, 'a').write('x'); c = {list(codes)!r}; sys.exit(c[min(n, len(c) - 1)])")
    return Launch((PY, "-c", script), ("h1",))


def test_elastic_continues_without_a_lost_host_and_restarts_its_agent_when_it_answers(
        folder: Path) -> None:
    rejoined = folder / "h1-rejoined"
    # h1's agent: the first run dies as if ssh lost the host (255); the second records that it ran.
    h1 = Launch((PY, "-c", f"import os, sys; p = {str(folder / 'h1-runs')!r}; "
                 "n = len(open(p).read()) if os.path.exists(p) else 0; open(p, 'a').write('x'); "
                 f"sys.exit(255) if n == 0 else open({str(rejoined)!r}, 'w')"), ("h1",))
    launches = [_agent(folder, "h0", 0, f"until:{rejoined}"), h1]
    probe = _counted(folder, "probes", 255, 255, 0)  # the host answers at the 3rd probe
    spec = _spec(("h0", "h1"), elastic=ElasticSpec(min_nodes=1, max_nodes=2))
    code, _, err, log, took = _run(spec, launches, no_ssh_check=True, probe=lambda host: probe,
                                   probe_interval_s=0.2)
    assert code == 0, log + err
    assert re.search(r"zerospeed: host h1 lost at \d\d:\d\d:\d\d \(exit code 255 \(ssh lost the host", log)
    assert "; continuing on 1 host(s); will start its agent again when it answers" in log
    assert re.search(r"zerospeed: host h1 answers again at \d\d:\d\d:\d\d; started its agent", log)
    assert (folder / "probes").read_text() == "xxx"
    assert rejoined.exists() and took < STOP_BOUND_S


def test_elastic_fails_below_min_nodes(folder: Path) -> None:
    launches = [_agent(folder, "h0", 0, "hang"), _agent(folder, "h1", 1, "exit255")]
    spec = _spec(("h0", "h1"), elastic=ElasticSpec(min_nodes=2, max_nodes=2))
    code, _, _, log, took = _run(spec, launches, no_ssh_check=True, stop_grace_s=2.0,
                                 probe=lambda host: Launch((PY, "-c", "0"), (host,)))
    assert code == 255
    assert "only 1 host(s) left, fewer than --min_elastic_nodes 2" in log
    assert "zerospeed: host h1, rank 1 failed: exit code 255 (ssh lost the host" in log
    assert "; its last line: [h1 rank 1] step 2 h1h1" in log
    assert took < STOP_BOUND_S and not any(_alive(p) for p in _pids(folder, "h0"))


def test_elastic_agent_error_on_a_live_host_is_a_job_failure(folder: Path) -> None:
    launches = [_agent(folder, "h0", 0, "hang"), _agent(folder, "h1", 1, "fail")]
    spec = _spec(("h0", "h1"), elastic=ElasticSpec(min_nodes=1, max_nodes=2))
    code, _, _, log, _ = _run(spec, launches, no_ssh_check=True, stop_grace_s=2.0,
                              probe=lambda host: Launch((PY, "-c", "0"), (host,)))
    assert code == 1
    assert "lost" not in log
    assert "host h1, rank 1 failed: exit code 1; first error: [h1 rank 1] RuntimeError: boom on h1" in log


def test_elastic_refuses_a_launch_that_reaches_several_hosts(folder: Path) -> None:
    from zerospeed.launcher.errors import LauncherError

    spec = _spec(("h0", "h1"), elastic=ElasticSpec(min_nodes=1, max_nodes=2))
    with pytest.raises(LauncherError, match="elastic training needs one launch process per host"):
        _run(spec, [Launch(("pdsh", "-w", "h0,h1", "x"), ("h0", "h1"))], runner="pdsh", no_ssh_check=True)




# --- review fixes: the runner's death, signals, elastic re-joins, stop commands ------------------------

# Runs run_job in its own process (so the test can SIGKILL or SIGHUP it) with launches that never read
# their stdin, like mpirun/srun agents (no --watch_stdin) or pdsh (which does not pass stdin on).
DEATH_DRIVER = textwrap.dedent(
    r'''
    import sys
    from dataclasses import dataclass, field
    from zerospeed.launcher.job import JobSpec
    from zerospeed.launcher.multinode import run_job
    from zerospeed.launcher.plan import Program

    @dataclass(frozen=True)
    class Launch:
        argv: tuple
        hosts: tuple
        env: dict = field(default_factory=dict)

    folder = sys.argv[1]
    hang = ("import os, signal, sys, time; open(os.path.join(sys.argv[1], sys.argv[2] + '.pid'), 'w')"
            ".write(str(os.getpid())); time.sleep(60)")
    hosts = ("h0", "h1")
    spec = JobSpec(job_id="t", world=tuple((h, (0,)) for h in hosts), master_addr="10.255.255.1",
                   master_port=29999, program=Program(script="train.py"))
    sys.exit(run_job(spec, runner="openmpi", no_ssh_check=True, stop_grace_s=2.0,
                     launches=[Launch((sys.executable, "-c", hang, folder, h), (h,)) for h in hosts]))
    '''
)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP])
def test_the_launch_processes_do_not_outlive_the_runner(folder: Path, sig: signal.Signals) -> None:
    """SIGKILL (OOM, kill -9): each launch process gets SIGTERM from the kernel (PR_SET_PDEATHSIG), as
    pdsh/mpirun/srun/ssh then stop their own children. SIGHUP (the terminal closed) stops the job like
    Ctrl-C: exit 129, naming the signal."""
    (folder / "driver.py").write_text(DEATH_DRIVER)
    runner = subprocess.Popen([PY, str(folder / "driver.py"), str(folder)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 20
        while not all(_pids(folder, h) for h in ("h0", "h1")):
            assert runner.poll() is None, runner.communicate()
            assert time.monotonic() < deadline, "the launches did not start in 20 s"
            time.sleep(0.02)
        pids = [p for h in ("h0", "h1") for p in _pids(folder, h)]
        runner.send_signal(sig)
        _, err = runner.communicate(timeout=STOP_BOUND_S)
        if sig == signal.SIGHUP:
            assert runner.returncode == 129, err
            assert "zerospeed: stopped by SIGHUP; stopping this job's processes on every host" in err
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not [p for p in pids if _alive(p)], "launch processes outlived the runner"
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.communicate()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_elastic_a_rejoined_agent_that_fails_counts_as_lost_again_up_to_max_restarts(folder: Path) -> None:
    # h1's first agent is lost (255); the re-joined one exits 2 (a stale agent from a healed partition
    # holds its rendezvous slot): lost again, probed, and then left out (max_restarts=1), not a failure.
    left_out = folder / "h1-second-run"
    h1 = Launch((PY, "-c", f"import os, sys; p = {str(folder / 'h1-runs')!r}; "
                 "n = len(open(p).read()) if os.path.exists(p) else 0; open(p, 'a').write('x'); "
                 f"n and open({str(left_out)!r}, 'w'); sys.exit(255 if n == 0 else 2)"), ("h1",))
    h0 = Launch((PY, "-c", f"import os, time\nwhile not os.path.exists({str(left_out)!r}): time.sleep(0.05)\n"
                 "time.sleep(1.5)"), ("h0",))
    probe = Launch((PY, "-c", "0"), ("h1",))
    spec = _spec(("h0", "h1"), elastic=ElasticSpec(min_nodes=1, max_nodes=2, max_restarts=1))
    code, _, err, log, took = _run(spec, [h0, h1], no_ssh_check=True, probe=lambda host: probe,
                                   probe_interval_s=0.1, stop_grace_s=2.0)
    assert code == 0, log + err
    assert len(re.findall(r"zerospeed: host h1 lost at", log)) == 2, log
    assert "host h1 lost at" in log and "(exit code 2); continuing on 1 host(s)" in log
    assert ("zerospeed: host h1 answers again but was already restarted 1 time(s) (max_restarts); "
            "leaving it out\n") in log
    assert (folder / "h1-runs").read_text() == "xx" and took < STOP_BOUND_S


def test_elastic_losing_host_0_fails_fast_naming_the_rendezvous(folder: Path) -> None:
    h1 = Launch((PY, "-c", "import time; time.sleep(5)"), ("h1",))  # would end the job with 0 in 5 s
    launches = [_agent(folder, "h0", 0, "exit255"), h1]
    spec = _spec(("h0", "h1"), elastic=ElasticSpec(min_nodes=1, max_nodes=2))
    code, _, _, log, took = _run(spec, launches, no_ssh_check=True, stop_grace_s=2.0,
                                 probe=lambda host: Launch((PY, "-c", "0"), (host,)))
    assert code == 255
    assert ("zerospeed: host h0 lost (exit code 255 (ssh lost the host: it went down, its sshd or the agent "
            "was killed, or the network failed)): it keeps the elastic rendezvous (10.255.255.1:29999); the "
            "job cannot go on without it\n") in log
    assert "continuing on" not in log and took < 4


PREFLIGHT_HANG = ("import os, signal, sys, time; {ignore}open({pid!r}, 'w').write(str(os.getpid())); "
                  "time.sleep(30)")


def _signal_when(path: Path, *signals: signal.Signals, gap_s: float = 0.3) -> None:
    def send() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not path.exists():
            time.sleep(0.02)
        time.sleep(0.1)
        for sig in signals:
            os.kill(os.getpid(), sig)
            time.sleep(gap_s)

    threading.Thread(target=send, daemon=True).start()


@pytest.mark.parametrize("sig, expected", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_preflight_stops_its_commands_and_exits_with_the_signal_code(
        folder: Path, sig: signal.Signals, expected: int) -> None:
    pid_file = folder / "preflight.pid"
    started = folder / "started"
    preflight = [Launch((PY, "-c", PREFLIGHT_HANG.format(ignore="", pid=str(pid_file))), ("h0",))]
    _signal_when(pid_file, sig)
    code, _, _, log, took = _run(_spec(("h0",)), [Launch((PY, "-c", f"open({str(started)!r}, 'w')"), ("h0",))],
                                 preflight=preflight, preflight_timeout_s=20.0, stop_grace_s=2.0)
    assert code == expected
    assert f"zerospeed: stopped by {sig.name} during pre-flight; no rank was started\n" in log
    assert took < 5 and not started.exists()
    assert not _alive(int(pid_file.read_text()))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_signal_skips_the_grace_in_preflight_and_while_stopping(folder: Path) -> None:
    pid_file = folder / "preflight.pid"
    ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    preflight = [Launch((PY, "-c", PREFLIGHT_HANG.format(ignore=ignore, pid=str(pid_file))), ("h0",))]
    _signal_when(pid_file, signal.SIGINT, signal.SIGINT)
    code, _, _, log, took = _run(_spec(("h0",)), [_agent(folder, "h0", 0, "ok")], preflight=preflight,
                                 preflight_timeout_s=20.0, stop_grace_s=10.0)
    assert code == 130, log
    assert took < 1.9, took  # the second Ctrl-C came ~0.4 s in; pre-flight's own grace is 2 s
    assert not _alive(int(pid_file.read_text()))
    # The same while the job runs: an agent that ignores SIGTERM is killed at the second Ctrl-C.
    _signal_when(folder / "h0.pid", signal.SIGINT, signal.SIGINT)
    code, _, _, log, took = _run(_spec(("h0",)), [_agent(folder, "h0", 0, "ignore_term")], no_ssh_check=True,
                                 stop_grace_s=10.0)
    assert code == 130 and took < 5, log
    assert "zerospeed: stopped again by SIGINT; killing this job's processes now\n" in log
    assert not any(_alive(p) for p in _pids(folder, "h0"))


def test_a_closed_log_stream_does_not_keep_the_stop_commands_from_running(folder: Path) -> None:
    # `zerospeed ... 2>&1 | head`: our stderr is a closed pipe once head has exited.
    marker = folder / "stopped"
    stop = [Launch((PY, "-c", f"open({str(marker)!r}, 'a').write('{h}\\n')"), (h,)) for h in ("h0", "h1")]
    log = io.StringIO()
    log.close()
    code = run_job(_spec(("h0", "h1")), runner="ssh", no_ssh_check=True, stop=stop, stop_grace_s=2.0,
                   launches=[_agent(folder, "h0", 0, "hang"), _agent(folder, "h1", 1, "exit3")],
                   log=log, out=io.StringIO(), err=io.StringIO())
    assert code == 3
    assert sorted(marker.read_text().split()) == ["h0", "h1"]
    assert not any(_alive(p) for p in _pids(folder, "h0"))


def test_a_stop_command_that_cannot_start_does_not_shift_the_hosts_of_the_others(folder: Path) -> None:
    stop = [Launch((str(folder / "no-such-ssh"), "h0", "kill"), ("h0",)),
            Launch((PY, "-c", "print('stopped agent 123')"), ("h1",))]
    code, _, _, log, _ = _run(_spec(("h0", "h1")), [_agent(folder, "h0", 0, "exit3")], stop=stop,
                              no_ssh_check=True, stop_grace_s=2.0)
    assert code == 3
    assert f"zerospeed: cannot start {str(folder / 'no-such-ssh')!r} for host(s) h0: " in log
    assert "zerospeed: stop on h1: stopped agent 123\n" in log and "stop on h0" not in log


def test_preflight_blames_a_missing_interpreter_or_launch_folder_not_ssh(folder: Path) -> None:
    preflight = [Launch((PY, "-c", "import sys; print('bash: line 1: /venv/bin/python: No such file or directory', "
                                   "file=sys.stderr); sys.exit(127)"), ("h0",)),
                 Launch((PY, "-c", "import sys; print('sh: 1: cd: can\\'t cd to /work/job', file=sys.stderr); "
                                   "sys.exit(2)"), ("h1",))]
    with pytest.raises(PreflightError) as raised:
        _run(_spec(("h0", "h1")), [_agent(folder, "h0", 0, "ok")], preflight=preflight)
    message = str(raised.value)
    same_path = (f"the Python interpreter {sys.executable} and the launch folder {os.getcwd()} must exist at "
                 "the same paths on every host (a shared file system, or the same virtual environment path)")
    assert ("  - host h0 did not answer over ssh: the command exited with code 127 (it said: bash: line 1: "
            f"/venv/bin/python: No such file or directory): {same_path}\n") in message
    assert ("  - host h1 did not answer over ssh: the command exited with code 2 (it said: sh: 1: cd: can't cd "
            f"to /work/job): {same_path}\n") in message
    assert "ssh h0 true" not in message


# --- a real two-host job on the namespace test cluster ----------------------------------------------

TRAIN = textwrap.dedent(
    r'''
    import datetime, os, sys, time
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, out = dist.get_rank(), os.environ["ZS_TEST_OUT"]
    with open(os.path.join(out, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    for step in range(100000):
        value = torch.ones(1)
        dist.all_reduce(value)
        print(f"step {step} sum {value.item():g}", flush=True)
        if step == 3:
            open(os.path.join(out, f"rank{rank}.step3"), "w").close()
        time.sleep(0.1)
    '''
)

DRIVER = textwrap.dedent(
    r'''
    import json, os, sys
    from zerospeed.launcher.commands import RemoteLaunch, launches, preflight_launches, stop_commands
    from zerospeed.launcher.job import JobSpec
    from zerospeed.launcher.multinode import run_job

    spec, exports = JobSpec.decode(sys.argv[1]), json.loads(sys.argv[2])
    where = dict(launcher_args=(), ssh_port=None)
    found = dict(exports=exports, cwd=os.getcwd(), python=sys.executable, **where)

    def own_tmp(commands, check_master=False):
        # ssh: the remote shell is the last word. The cluster's hosts share /tmp, where real hosts have
        # their own: each host gets its own TMPDIR (the agent's job folder and pid file live there).
        return [RemoteLaunch((*l.argv[:-1], f"mkdir -p {tmp}/{l.hosts[0]}; export TMPDIR={tmp}/{l.hosts[0]}; "
                              + l.argv[-1] + (" --check_master" if check_master else "")), l.hosts, l.env)
                for l in commands]

    tmp = os.environ["ZS_TEST_OUT"]
    sys.exit(run_job(spec, runner="ssh", launches=own_tmp(launches(spec, "ssh", **found)),
                     stop=own_tmp(stop_commands(spec, "ssh", **where)),
                     preflight=lambda check: own_tmp(preflight_launches(spec, "ssh", **found), check),
                     stop_grace_s=5.0))
    '''
)


@pytest.mark.cluster
def test_real_hosts_a_killed_host_is_named_and_nothing_of_the_job_remains(tmp_path: Path) -> None:
    """2 hosts x 1 rank over real ssh with the real node agent and a gloo all-reduce loop; every
    process on h1 is killed mid-run: the runner (on h0) exits non-zero naming h1 within a bound, and
    no process of the job is left on either host."""
    from zerospeed.testing import cluster as clusters
    from zerospeed.testing import free_port

    if importlib.util.find_spec("zerospeed.launcher.node") is None:
        pytest.skip("zerospeed.launcher.node (the node agent) is not there yet")
    reason = clusters.cluster_unavailable_reason(("ssh",))
    if reason is not None:
        pytest.skip(reason)
    repo = Path(__file__).resolve().parents[1]
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "driver.py").write_text(DRIVER)
    spec = JobSpec(job_id=f"t{os.getpid()}", world=(("h0", (0,)), ("h1", (0,))), master_addr="h0",
                   master_port=free_port(), program=Program(script=str(tmp_path / "train.py")))
    exports = json.dumps({"PYTHONPATH": str(repo / "src"), "ZS_TEST_OUT": str(tmp_path), "OMP_NUM_THREADS": "1"})
    with clusters.Cluster(2) as cluster:
        before = {h: cluster.pids_on(h) for h in (0, 1)}
        runner = cluster.run_on(0, [PY, str(tmp_path / "driver.py"), spec.encode(), exports], cwd=str(tmp_path),
                                env={"ZS_TEST_OUT": str(tmp_path)}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 90
            while not all((tmp_path / f"rank{r}.step3").exists() for r in (0, 1)):
                assert runner.poll() is None, runner.communicate()[1][-6000:]
                assert time.monotonic() < deadline, "the job did not reach step 3 in 90 s"
                time.sleep(0.1)
            killed_at = time.monotonic()
            cluster.kill_host(1)
            out, err = runner.communicate(timeout=60)
            took = time.monotonic() - killed_at
        finally:
            if runner.poll() is None:
                runner.kill()
                runner.communicate()
        assert runner.returncode != 0, err
        assert re.search(r"zerospeed: host h1, rank 1 failed: exit code 255", err), err
        assert took < 30, f"the runner took {took:.1f} s to stop after h1 died"
        assert "[h0 rank 0] step 3 sum 2" in out and "[h1 rank 1] step 3 sum 2" in out
        assert "zerospeed: pre-flight passed on 2 host(s) through ssh" in err
        # Nothing of the job is left on either host (h1's sshd died with it; the worker guards' watchers
        # may need a moment).
        deadline = time.monotonic() + 15
        while True:
            left = {h: cluster.pids_on(h) - before[h] for h in (0, 1)}
            if not any(left.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not any(left.values()), {h: _cmdlines(p) for h, p in left.items()}


def _cmdlines(pids: set[int]) -> list[str]:
    found = []
    for pid in pids:
        with contextlib.suppress(OSError):
            found.append(f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:200])
    return found
