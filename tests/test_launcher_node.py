"""The node agent (``python -m zerospeed.launcher.node``): one per host of a multi-node job.

The multi-process tests run two agents on this machine as two "hosts" of one job: ``127.0.0.1`` (node
0, ranks 0-1) and ``localhost`` (node 1, ranks 2-3), both names of this machine, each agent with its
own ``--node_rank`` and its own ``TMPDIR`` (so each has its own job folder, as on two machines). The
ranks run ``launcher_scripts/node_ranks.py``. The pure parts (core binding, pre-flight comparison,
output pump, node rank from Slurm, the engine's downtime line) are tested in-process.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.launcher.elastic_env import ElasticRestart, restart_message
from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.job import ElasticSpec, JobSpec, node_rank_of
from zerospeed.launcher.plan import Program
from zerospeed.launcher.preflight import answer, compare, parse_answers, program_exists
from zerospeed.launcher.worker_guard import cores_of_rank, parse_core_list
from zerospeed.testing import free_port, log_messages, one_process_group

REPO = Path(__file__).resolve().parents[1]
SCRIPT = "tests/launcher_scripts/node_ranks.py"
HOSTS = ("127.0.0.1", "localhost")
# Bound for one agent run; a healthy one takes a few seconds.
RUN_TIMEOUT_S = 60
LINE = re.compile(r"^\[(?P<host>[^ \]]+) rank (?P<rank>\d+)\] (?P<text>.*)$")
# Elastic tests: torch's defaults wait 30 s for more hosts after a loss and 15 s to declare a host dead.
FAST_RDZV = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2"


def _job(job_id: str, *, slots: tuple[int, ...] = (0, 1), elastic: ElasticSpec | None = None,
         each_rank_log_dir: str | None = None, save_pid: bool = False) -> JobSpec:
    return JobSpec(job_id=job_id, world=tuple((host, slots) for host in HOSTS), master_addr=HOSTS[0],
                   master_port=free_port(), program=Program(script=SCRIPT), elastic=elastic,
                   each_rank_log_dir=each_rank_log_dir, save_pid=save_pid)


class Agents:
    """The two agents of one job, started as separate sessions (as ssh would)."""

    def __init__(self, tmp_path: Path, spec: JobSpec, *, watch_stdin: bool = False, rdzv_conf: str | None = None,
                 **env: str) -> None:
        self.out = tmp_path / "out"
        self.out.mkdir()
        self.tmpdirs = [tmp_path / f"tmp{node}" for node in range(len(HOSTS))]
        self.spec = spec
        base = dict(os.environ, PYTHONPATH=str(REPO / "src"), ZS_TEST_OUT=str(self.out), **env)
        base.pop("OMP_NUM_THREADS", None)
        self.procs: list[subprocess.Popen[str]] = []
        # Files, not pipes: a test reading one agent while the other's pipe fills would stall the job.
        self.logs = [(tmp_path / f"agent{node}.out", tmp_path / f"agent{node}.err") for node in range(len(HOSTS))]
        for node, tmp in enumerate(self.tmpdirs):
            tmp.mkdir()
            argv = [sys.executable, "-u", "-m", "zerospeed.launcher.node", f"--job={spec.encode()}",
                    f"--node_rank={node}"]
            argv += ["--watch_stdin"] if watch_stdin else []
            argv += [f"--rdzv_conf={rdzv_conf}"] if rdzv_conf else []
            with open(self.logs[node][0], "w") as out, open(self.logs[node][1], "w") as err:
                self.procs.append(subprocess.Popen(
                    argv, cwd=REPO, env=dict(base, TMPDIR=str(tmp)), stdout=out, stderr=err,
                    stdin=subprocess.PIPE if watch_stdin else subprocess.DEVNULL, text=True, start_new_session=True))

    def job_dir(self, node: int) -> Path:
        return self.tmpdirs[node] / f"zerospeed-job-{self.spec.job_id}-{os.uname().nodename}-n{node}"

    def rank_pid(self, rank: int, restart: int = 0, timeout: float = RUN_TIMEOUT_S) -> int:
        path = self.out / f"pid{rank}-{restart}"
        deadline = time.monotonic() + timeout
        while not path.exists() or not path.read_text():
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"rank {rank} never started: {self.outputs()}")
            time.sleep(0.05)
        return int(path.read_text())

    def wait(self, node: int, timeout: float = RUN_TIMEOUT_S) -> tuple[int, str, str]:
        proc = self.procs[node]
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"agent {node} did not finish within {timeout} s\n{self.outputs()}")
        return proc.returncode, self.logs[node][0].read_text(), self.logs[node][1].read_text()

    def outputs(self) -> str:
        """Both agents' output (lines cut at 300 characters), after stopping them."""
        self.stop()
        return "\n".join(f"agent {node}: rc={proc.returncode}\n" + "\n".join(
            line[:300] for path in self.logs[node] for line in path.read_text().splitlines())
            for node, proc in enumerate(self.procs))

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture()
def agents_cleanup() -> Iterator[list[Agents]]:
    started: list[Agents] = []
    yield started
    for agents in started:
        agents.stop()


def _lines(text: str) -> list[tuple[str, int, str]]:
    """Every line as (host, rank, text); a line without the exact prefix fails the test."""
    parsed = []
    for line in text.splitlines():
        match = LINE.match(line)
        assert match, f"line without a rank prefix (spliced?): {line[:200]!r}"
        parsed.append((match["host"], int(match["rank"]), match["text"]))
    return parsed


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


# --- two hosts on this machine ------------------------------------------------------------------


def test_two_agents_run_one_job_with_whole_prefixed_lines(tmp_path: Path, agents_cleanup: list[Agents]) -> None:
    lines, size = 20, 10_000  # each line far above PIPE_BUF (4096): unlocked writers would splice them
    logs = tmp_path / "each"
    agents = Agents(tmp_path, _job("whole", each_rank_log_dir=str(logs)), LINES=str(lines), LINE_BYTES=str(size))
    agents_cleanup.append(agents)
    results = [agents.wait(node) for node in range(2)]
    for node, (code, out, err) in enumerate(results):
        assert code == 0, err
        seen = _lines(out)
        ranks = {rank for _, rank, _ in seen}
        assert ranks == {2 * node, 2 * node + 1}
        for host, rank, text in seen:
            assert host == HOSTS[rank // 2]
        for rank in ranks:
            texts = [text for _, r, text in seen if r == rank]
            assert texts[0] == (f"ranks {rank} 4 {rank % 2} pid={agents.rank_pid(rank)} lost_at=- restarts=-")
            letter = "abcd"[rank]
            assert texts[1:1 + lines] == [f"long {rank} {i} " + letter * size for i in range(lines)]
            assert texts[1 + lines:] == [f"sum {rank} 10"]
        assert not agents.job_dir(node).exists()  # removed at exit
    # --enable_each_rank_log: each rank's own lines, unprefixed, in <start>_<host>_rank<r>.log
    files = sorted(logs.iterdir())
    assert [re.sub(r"^\d{14}_", "", f.name) for f in files] == [
        "127.0.0.1_rank0.log", "127.0.0.1_rank1.log", "localhost_rank2.log", "localhost_rank3.log"]
    rank3 = files[3].read_text().splitlines()
    assert rank3[0].startswith("ranks 3 4 1 ") and rank3[-1] == "sum 3 10" and len(rank3) == lines + 2


def test_a_failed_rank_ends_both_hosts_naming_it_after_its_traceback(tmp_path: Path,
                                                                        agents_cleanup: list[Agents]) -> None:
    agents = Agents(tmp_path, _job("fail", slots=(0,)), ZS_FAIL_RANK="1", ZS_HOLD_S="60", ZS_HOLD_COLLECTIVE="1")
    agents_cleanup.append(agents)
    started = time.monotonic()
    code, _, err = agents.wait(1, timeout=30)
    pid = agents.rank_pid(1)
    assert code == 1
    summary = f"zerospeed: host localhost rank 1 (local 0, pid {pid}) exited with code 1; see its output above"
    lines = err.splitlines()
    assert summary in lines
    last_traceback_line = "[localhost rank 1] [rank1]: RuntimeError: rank 1 fails on purpose"
    assert lines.index(last_traceback_line) < lines.index(summary)
    # The other host's rank loses its peer in the next all-reduce: that host fails too, at once.
    code, _, err = agents.wait(0, timeout=30)
    assert code == 1
    pid = agents.rank_pid(0)
    assert f"zerospeed: host 127.0.0.1 rank 0 (local 0, pid {pid}) exited with code 1; see its output above" in err
    assert time.monotonic() - started < 30


def test_sigterm_and_stdin_eof_stop_an_agent_and_its_ranks(tmp_path: Path, agents_cleanup: list[Agents]) -> None:
    agents = Agents(tmp_path, _job("stop", save_pid=True), watch_stdin=True, ZS_HOLD_S="60", ZS_NO_DIST="1")
    agents_cleanup.append(agents)
    pids = [agents.rank_pid(rank) for rank in range(4)]
    # save_pid, DeepSpeed's: <tmp>/<the starting process's pid>.deepspeed holds the agent's PID
    saved = [tmp / f"{os.getpid()}.deepspeed" for tmp in agents.tmpdirs]
    assert [path.read_text() for path in saved] == [str(proc.pid) for proc in agents.procs]
    # The job folder: agent.pid and workers.pid, which stop commands and operators use.
    for node in range(2):
        folder = agents.job_dir(node)
        assert (folder / "agent.pid").read_text() == f"{agents.procs[node].pid}\n"
        assert (folder / "workers.pid").read_text() == f"{pids[2 * node]}\n{pids[2 * node + 1]}\n"
    agents.procs[1].send_signal(signal.SIGTERM)
    code, _, err = agents.wait(1, timeout=20)
    assert code == 128 + signal.SIGTERM
    assert "zerospeed: host localhost: stopped by SIGTERM; its ranks were terminated" in err.splitlines()
    assert _gone(pids[2]) and _gone(pids[3])
    assert not agents.job_dir(1).exists() and not saved[1].exists()
    assert f"launcher pid: {agents.procs[1].pid}" in err.splitlines()
    # The runner holding agent 0's stdin dies: EOF does what SIGTERM does.
    assert agents.procs[0].poll() is None
    assert agents.procs[0].stdin is not None
    agents.procs[0].stdin.close()
    code, _, err = agents.wait(0, timeout=20)
    assert code == 128 + signal.SIGTERM, err
    assert _gone(pids[0]) and _gone(pids[1])
    assert not agents.job_dir(0).exists() and not saved[0].exists()


def test_an_elastic_job_goes_on_without_a_lost_host(tmp_path: Path, agents_cleanup: list[Agents]) -> None:
    spec = _job("elastic", slots=(0,), elastic=ElasticSpec(min_nodes=1, max_nodes=2, max_restarts=3))
    agents = Agents(tmp_path, spec, rdzv_conf=FAST_RDZV, ZS_HOLD_S="60", ZS_HOLD_COLLECTIVE="1")
    agents_cleanup.append(agents)
    survivor, lost = agents.rank_pid(0), agents.rank_pid(1)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while "sum 0 3" not in agents.logs[0][0].read_text():  # the 2-rank world formed and all-reduced
        assert time.monotonic() < deadline, agents.outputs()
        time.sleep(0.05)
    # Host "localhost" is lost: its agent and its rank die at once.
    os.kill(agents.procs[1].pid, signal.SIGKILL)
    os.kill(lost, signal.SIGKILL)
    killed = time.time()
    restarted = agents.rank_pid(0, restart=1, timeout=30)
    code, out, err = agents.wait(0, timeout=30)
    assert code == 0, err
    texts = [text for _, _, text in _lines(out)]
    assert texts[:2] == [f"ranks 0 2 0 pid={survivor} lost_at=- restarts=-", "sum 0 3"]
    match = re.fullmatch(rf"ranks 0 1 0 pid={restarted} lost_at=(\d+\.\d+) restarts=1", texts[2])
    assert match, texts
    assert killed < float(match[1]) < killed + 10  # when the agent saw its rank fail
    assert texts[3:] == ["sum 0 1"]  # the survivor alone: world size 1


# --- in-process parts ----------------------------------------------------------------------------


def test_core_lists_and_each_ranks_share_follow_deepspeed() -> None:
    assert parse_core_list("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_core_list("5") == [5]
    assert [cores_of_rank([0, 1, 2, 3, 8], r, 2) for r in range(2)] == [[0, 1], [2, 3]]  # 8 stays unused
    assert [cores_of_rank(list(range(8)), r, 3) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert cores_of_rank([4, 6], 1, 2) == [6]
    with pytest.raises(ValueError, match=r"bind_core_list '3-1': range '3-1' must be non-negative and end at"):
        parse_core_list("3-1")
    with pytest.raises(ValueError, match=r"bind_core_list '0-3,2': '2' overlaps or precedes the item before it"):
        parse_core_list("0-3,2")
    with pytest.raises(ValueError, match=r"bind_core_list '0,x': 'x' is neither a core number nor a range"):
        parse_core_list("0,x")
    with pytest.raises(ValueError, match=r"2 core\(s\) cannot be shared by 3 ranks on this host"):
        cores_of_rank([0, 1], 0, 3)


def test_the_guard_pins_the_rank_to_its_cores_before_exec(tmp_path: Path) -> None:
    from zerospeed.launcher.worker_guard import ProcessIdentity, guard_argv

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two CPUs")
    command = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)), os.environ['OMP_NUM_THREADS'])"]
    argv = guard_argv(ProcessIdentity.of(os.getpid()), command, run_dir=None, grace_s=1,
                      bind_cores=f"{cores[0]},{cores[1]}")
    env = dict(os.environ, LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="7")
    done = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=30)
    assert done.stdout == f"[{cores[1]}] 1\n", done.stderr


def _answer(**facts: object) -> dict[str, object]:
    base: dict[str, object] = {"host": "h", "python": "3.11.7", "torch": "2.13.0+cpu", "zerospeed": "0.1.0",
                               "cwd": "/job", "program": "train.py", "program_exists": True, "job_error": None}
    return {**base, **facts}


def test_preflight_compare_names_each_host_and_the_fix() -> None:
    local = _answer(host="a")
    answers = {
        "a": _answer(host="a", python="3.11.9"),  # micro versions may differ
        "b": _answer(host="b", torch="2.12.0", program_exists=False),
        "c": _answer(host="c", zerospeed="0.0.9", python="3.10.4", master="10.0.0.1:29500",
                     master_error="Connection refused"),
        "e": _answer(host="e", torch=None, job_error="cannot read the job description"),
    }
    assert compare(answers, local, hosts=["a", "b", "c", "d", "e"]) == [
        "host b: torch 2.12.0 but the launching host has torch 2.13.0+cpu; install torch==2.13.0+cpu on b",
        "host b: 'train.py' does not exist in /job there (every host runs the job from the launching folder); "
        "copy it to that path or use a shared file system",
        "host c: Python 3.10.4 but the launching host runs Python 3.11.7; use the same Python 3.11 on every host",
        "host c: zerospeed 0.0.9 but the launching host has zerospeed 0.1.0; install zerospeed==0.1.0 on c",
        "host c: cannot connect to the master port 10.0.0.1:29500 (Connection refused); open that port between "
        "the hosts or pass --master_addr/--master_port that every host reaches",
        "host d: no pre-flight answer (unreachable, or no python with zerospeed there); check that the runner "
        "reaches d without a password prompt and that zerospeed is installed there",
        "host e: cannot read the job (cannot read the job description); install zerospeed 0.1.0 there",
        "host e: no torch but the launching host has torch 2.13.0+cpu; install torch==2.13.0+cpu on e",
    ]
    assert compare({"a": local}, local) == []


def test_preflight_answers_are_found_in_runner_output_and_programs_resolved(tmp_path: Path) -> None:
    spec = _job("pre")
    facts = answer(spec, host="localhost", cwd=str(REPO), check_master=True, connect_timeout=1)
    assert facts["program_exists"] is True and facts["master"] == f"127.0.0.1:{spec.master_port}"
    assert facts["master_error"] == "Connection refused"  # nobody listens on a free port
    assert facts["zerospeed"] == zerospeed.__version__ and facts["torch"] == torch.__version__
    output = f"localhost: ZEROSPEED_PREFLIGHT {json.dumps(facts)}\nother: noise\nx: ZEROSPEED_PREFLIGHT {{bad\n"
    assert parse_answers(output) == {"localhost": facts}
    assert not program_exists(Program(script="missing.py"), str(REPO))
    assert program_exists(Program(script="zerospeed.launcher.node", module=True), str(tmp_path))
    assert program_exists(Program(script="json", module=True), str(tmp_path))
    assert not program_exists(Program(script="zerospeed.no_such_module", module=True), str(tmp_path))
    assert program_exists(Program(script="ls", no_python=True), str(tmp_path))
    # the CLI: one line, exit 0, no torch import needed
    done = subprocess.run([sys.executable, "-m", "zerospeed.launcher.preflight", f"--job={spec.encode()}",
                           "--node_rank=1"], cwd=REPO, capture_output=True, text=True, timeout=30,
                          env=dict(os.environ, PYTHONPATH=str(REPO / "src")))
    assert done.returncode == 0 and done.stdout.startswith("ZEROSPEED_PREFLIGHT {")
    assert parse_answers(done.stdout)["localhost"]["program_exists"] is True


def test_preflight_node_0_says_whether_master_addr_is_its_own_and_compare_names_the_fix() -> None:
    """Rank 0's store runs on node 0: a --master_addr of another machine would leave every agent waiting."""
    from zerospeed.launcher.preflight import is_local_address

    assert is_local_address("127.0.0.1") and is_local_address("localhost")
    assert not is_local_address("192.0.2.1")  # TEST-NET-1 (RFC 5737): no interface has it, bind fails
    assert not is_local_address("no-such-host.invalid")
    spec = JobSpec(job_id="m", world=(("h0", (0,)), ("h1", (0,))), master_addr="192.0.2.1", master_port=29500,
                   program=Program(script=SCRIPT))
    node0 = answer(spec, host="h0", cwd=str(REPO), node_rank=0)
    assert node0["master_addr"] == "192.0.2.1" and node0["master_is_local"] is False
    assert "master_is_local" not in answer(spec, host="h1", cwd=str(REPO), node_rank=1)
    local = _answer(host="h0")
    answers = {"h0": _answer(host="h0", master_addr="192.0.2.1", master_is_local=False), "h1": _answer(host="h1")}
    assert compare(answers, local, hosts=["h0", "h1"]) == [
        "host h0 runs rank 0's store but --master_addr 192.0.2.1 is not one of its addresses; pass "
        "--master_addr h0 (or omit it)",
    ]
    answers["h0"] = _answer(host="h0", master_addr="127.0.0.1", master_is_local=True)
    assert compare(answers, local, hosts=["h0", "h1"]) == []
    # the CLI finds node 0 from --node_host too
    done = subprocess.run([sys.executable, "-m", "zerospeed.launcher.preflight", f"--job={spec.encode()}",
                           "--node_host=h0"], cwd=REPO, capture_output=True, text=True, timeout=30,
                          env=dict(os.environ, PYTHONPATH=str(REPO / "src")))
    assert done.returncode == 0, done.stderr
    assert parse_answers(done.stdout)["h0"]["master_is_local"] is False


def test_srun_node_rank_comes_from_the_node_name_before_the_allocation_index() -> None:
    spec = _job("slurm")
    assert node_rank_of(spec, environ={"SLURM_NODEID": "0", "SLURMD_NODENAME": "localhost"}) == 1
    assert node_rank_of(spec, environ={"SLURM_NODEID": "1", "SLURMD_NODENAME": "elsewhere"}) == 1
    assert node_rank_of(spec, environ={"PMI_RANK": "0", "SLURMD_NODENAME": "localhost"}) == 0  # MPI first


def test_the_pump_passes_whole_lines_from_writers_that_write_pieces(tmp_path: Path) -> None:
    from zerospeed.launcher.agent import OutputRouter

    read_end, write_end = os.pipe()
    router = OutputRouter(str(tmp_path / "fifos"), "hostA", stdout_fd=write_end, stderr_fd=write_end)
    fifos = [router.attach(str(rank)) for rank in range(2)]
    pieces = 300

    def write(path: str, letter: str) -> None:
        fd = os.open(path, os.O_WRONLY)
        for i in range(pieces):  # each line in three writes, the newline last (print's shape)
            os.write(fd, f"{letter}{i} ".encode())
            os.write(fd, (letter * 5000).encode())
            os.write(fd, b"\n")
        os.write(fd, b"no newline at the end")
        os.close(fd)

    collected = bytearray()
    reader = threading.Thread(target=lambda: _read_all(read_end, collected))
    reader.start()
    writers = [threading.Thread(target=write, args=(fifos[r][s], "xy"[r] if s == 0 else "XY"[r]))
               for r in range(2) for s in range(2)]
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()
    router.close(10)
    os.close(write_end)
    reader.join()
    lines = collected.decode().splitlines()
    assert len(lines) == 4 * (pieces + 1)
    for letter, rank in (("x", 0), ("X", 0), ("y", 1), ("Y", 1)):
        mine = [line for line in lines if line.startswith(f"[hostA rank {rank}] {letter}")]
        assert mine == [f"[hostA rank {rank}] {letter}{i} " + letter * 5000 for i in range(pieces)]
    assert lines.count("[hostA rank 0] no newline at the end") == 2


def _read_all(fd: int, into: bytearray) -> None:
    while chunk := os.read(fd, 1 << 16):
        into.extend(chunk)
    os.close(fd)


def test_the_failure_line_names_the_host() -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from zerospeed.launcher.runners import _report_failure

    failure = ProcessFailure(local_rank=1, pid=4321, exitcode=-int(signal.SIGKILL), error_file="/nonexistent")
    log = io.StringIO()
    assert _report_failure(ChildFailedError("job", {3: failure}), log, host="h2") == 128 + int(signal.SIGKILL)
    assert log.getvalue() == "zerospeed: host h2 rank 3 (local 1, pid 4321) was killed by SIGKILL; see its output above\n"


def test_bad_node_arguments_are_one_line_errors(tmp_path: Path) -> None:
    from zerospeed.launcher.node import job_dir_of, main, parse_rdzv_conf

    log = io.StringIO()
    assert main([f"--job={_job('bad').encode()}", "--node_rank=5"], log=log) == 2
    assert log.getvalue() == ("zerospeed: error: --node_rank 5 is outside this job's 2 host(s) (127.0.0.1, "
                              "localhost); node ranks are 0..1\n")
    assert parse_rdzv_conf("last_call_timeout=2, join_timeout=60") == {"last_call_timeout": "2",
                                                                        "join_timeout": "60"}
    with pytest.raises(LauncherError, match=r"--rdzv_conf item 'oops' is not key=value"):
        parse_rdzv_conf("oops")
    with pytest.raises(LauncherError, match=r"job id '\.\./x' may only hold"):
        job_dir_of("../x")
    assert job_dir_of("j-1", str(tmp_path), node_rank=2, hostname="h1") == str(tmp_path / "zerospeed-job-j-1-h1-n2")
    assert job_dir_of("j-1", str(tmp_path)) == str(tmp_path / f"zerospeed-job-j-1-{os.uname().nodename}-n0")


def test_elastic_agents_use_the_jobs_rendezvous_settings_with_rdzv_conf_on_top(tmp_path: Path) -> None:
    """torch ignores keys it does not know, so the settings are checked where torch reads them: the c10d
    handler the agent builds (torch's defaults: last call 30 s, keep-alive 5 s x 3)."""
    from datetime import timedelta

    import torch.distributed.elastic.rendezvous.registry as rdzv_registry
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from zerospeed.launcher.node import rendezvous_configs
    from zerospeed.launcher.runners import agent_config

    spec = _job("rdzv", elastic=ElasticSpec(min_nodes=1, max_nodes=2))
    assert rendezvous_configs(spec, None) == {"join_timeout": "600", "last_call_timeout": "3",
                                              "keep_alive_interval": "2", "keep_alive_max_attempt": "3"}
    assert rendezvous_configs(spec, "last_call_timeout=1,close_timeout=9") == {
        "join_timeout": "600", "last_call_timeout": "1", "keep_alive_interval": "2", "keep_alive_max_attempt": "3",
        "close_timeout": "9"}
    assert rendezvous_configs(_job("fixed"), None) == {}  # the static rendezvous: nothing of its own
    assert rendezvous_configs(_job("fixed"), "read_timeout=5") == {"read_timeout": "5"}
    config = agent_config(nproc_per_node=1, run_id="rdzv", master_addr="127.0.0.1", master_port=free_port(),
                          node_rank=0, num_nodes=2, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)),
                          local_addr="127.0.0.1", elastic=(1, 2, 3), rdzv_configs=rendezvous_configs(spec, None))
    handler = rdzv_registry.get_rendezvous_handler(RendezvousParameters(
        backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id, min_nodes=1, max_nodes=2,
        local_addr=config.local_addr, **config.rdzv_configs))
    try:
        settings = handler.settings  # type: ignore[attr-defined]
        assert (settings.timeout.join, settings.timeout.last_call, settings.keep_alive_interval,
                settings.keep_alive_max_attempt) == (timedelta(seconds=600), timedelta(seconds=3),
                                                     timedelta(seconds=2), 3)
    finally:
        handler.shutdown()


def test_the_engine_logs_the_downtime_at_the_first_step_after_a_restart(monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ZEROSPEED_ELASTIC_LOST_AT", f"{time.time() - 12.34:.3f}")
    monkeypatch.setenv("ZEROSPEED_ELASTIC_RESTART_COUNT", "2")
    with one_process_group(), log_messages() as messages:
        engine, *_ = zerospeed.initialize(model=nn.Linear(4, 1), config={
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        for _ in range(2):
            engine.backward(engine(torch.ones(2, 4)).sum())
            engine.step()
    line = re.compile(r"zerospeed: elastic restart 2: 1 ranks, downtime (\d+\.\d) s \(host lost -> first step\)")
    logged = [match for match in map(line.fullmatch, messages) if match]
    assert len(logged) == 1 and 12.3 <= float(logged[0][1]) < 60  # lost 12.34 s before the engine was built
    assert line.findall(capsys.readouterr().err) == []  # logged once, through the logger: never printed twice
    assert restart_message(ElasticRestart(count=1, lost_at=100.0), world_size=4, now=103.25) == (
        "zerospeed: elastic restart 1: 4 ranks, downtime 3.2 s (host lost -> first step)")
    assert ElasticRestart.from_environ({}) is None


def test_save_pid_never_overwrites_or_removes_another_agents_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hosts sharing /tmp: the second agent of a job finds the runner's ``<pid>.deepspeed`` written by the
    first; it says so and leaves the file alone (it used to refuse to start)."""
    from zerospeed.launcher.node import _saved_pid

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    (tmp_path / "4242.deepspeed").write_text("1111")
    log = io.StringIO()
    with _saved_pid(True, 4242, log):
        assert (tmp_path / "4242.deepspeed").read_text() == "1111"
    assert (tmp_path / "4242.deepspeed").read_text() == "1111"
    assert log.getvalue() == (f"zerospeed: --save_pid: {tmp_path / '4242.deepspeed'} exists already (another agent "
                              f"sharing this /tmp, or a file left by an earlier launch); this agent's PID is "
                              f"{os.getpid()}\n")


def _lone_agent(tmp_path: Path, name: str, node: int, *, watch_stdin: bool = False
                ) -> tuple[subprocess.Popen[str], JobSpec, Path, Path]:
    """One agent of a two-host fixed job whose other host never comes: it blocks in torch's static
    rendezvous (node 0 in its TCPStore waiting for workers, node 1 retrying to connect)."""
    spec = _job(name, slots=(0,))
    tmp = tmp_path / name
    tmp.mkdir()
    err = tmp_path / f"{name}.err"
    with open(err, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "zerospeed.launcher.node", f"--job={spec.encode()}", f"--node_rank={node}",
             *(["--watch_stdin"] if watch_stdin else [])],
            cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO / "src"), TMPDIR=str(tmp)), stdout=fh, stderr=fh,
            stdin=subprocess.PIPE if watch_stdin else subprocess.DEVNULL, text=True, start_new_session=True)
    return proc, spec, tmp / f"zerospeed-job-{name}-{os.uname().nodename}-n{node}", err


def test_a_stop_reaches_an_agent_blocked_in_the_rendezvous(tmp_path: Path) -> None:
    """SIGINT, or --watch_stdin's EOF, ends an agent whose main thread is in torch's C++ rendezvous (it
    used to wait out the 15 min rendezvous timeout, the master port bound): the watchdog exits for it."""
    from zerospeed.launcher.node import _WATCHDOG_GRACE_S, _WATCHDOG_NO_WORKERS_S

    started = [_lone_agent(tmp_path, "lone0", 0), _lone_agent(tmp_path, "lone1", 1, watch_stdin=True)]
    try:
        for proc, spec, folder, err in started:
            waiting = (f"zerospeed: host {spec.hosts[0] if folder.name.endswith('n0') else spec.hosts[1]} "
                       f"(node {0 if folder.name.endswith('n0') else 1}): waiting for 1 other host(s) at "
                       f"127.0.0.1:{spec.master_port} (job {spec.job_id})")
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while waiting not in err.read_text().splitlines():
                assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
                time.sleep(0.05)
            assert (folder / "agent.pid").read_text() == f"{proc.pid}\n"
        time.sleep(1.0)  # well inside the rendezvous's C++ wait
        stopped_at = time.monotonic()
        started[0][0].send_signal(signal.SIGINT)
        stdin = started[1][0].stdin
        assert stdin is not None
        stdin.close()  # the runner died: the agent sends itself SIGTERM
        for (proc, _, folder, err), sig in zip(started, (signal.SIGINT, signal.SIGTERM)):
            proc.wait(timeout=_WATCHDOG_GRACE_S + 15)
            assert proc.returncode == 128 + sig, err.read_text()
            assert (f"zerospeed: node agent still waiting in the rendezvous {_WATCHDOG_NO_WORKERS_S:g} s after "
                    f"{sig.name}; exiting") in err.read_text().splitlines()
            assert not folder.exists()
        assert time.monotonic() - stopped_at < _WATCHDOG_GRACE_S + 5
    finally:
        for proc, *_ in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _fake_agent(tmp_path: Path, *, ignore_term: bool) -> subprocess.Popen[bytes]:
    """A process whose command line names the node module, as a stale agent's does."""
    ready = tmp_path / f"ready-{ignore_term}"
    code = ("import pathlib, signal, sys, time\n"
            f"signal.signal(signal.SIGTERM, {'signal.SIG_IGN' if ignore_term else 'lambda *a: sys.exit(143)'})\n"
            f"pathlib.Path({str(ready)!r}).touch()\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, "-m", "zerospeed.launcher.node", "--job=x"])
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return proc


def test_a_newer_agent_replaces_a_stale_one_of_the_same_job_and_takes_recycled_pids(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Elastic, after a healed partition: the old agent of the same job and node rank still holds the
    folder; the newer one stops it (SIGTERM, SIGKILL after the grace) and takes over. A PID that now
    belongs to another program is a stale file: taken over silently, that process left alone."""
    from zerospeed.launcher import node
    from zerospeed.launcher.node import _job_folder

    folder = tmp_path / "zerospeed-job-j-h-n0"
    # a cooperative old agent gets a grace long enough for a loaded machine; one that ignores SIGTERM a short one
    for ignore_term, code, grace in ((False, 143, 20.0), (True, -signal.SIGKILL, 1.0)):
        monkeypatch.setattr(node, "_WATCHDOG_GRACE_S", grace)
        old = _fake_agent(tmp_path, ignore_term=ignore_term)
        folder.mkdir()
        (folder / "agent.pid").write_text(f"{old.pid}\n")
        log = io.StringIO()
        began = time.monotonic()
        with _job_folder(str(folder), log):
            assert old.poll() is not None or _gone(old.pid)
            assert (folder / "agent.pid").read_text() == f"{os.getpid()}\n"
        assert old.wait(5) == code
        assert time.monotonic() - began < grace + 5
        assert log.getvalue() == (f"zerospeed: replacing the node agent of this job still running here (pid "
                                  f"{old.pid}, {folder / 'agent.pid'}): stopping it\n")
        assert not folder.exists()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        folder.mkdir()
        (folder / "agent.pid").write_text(f"{other.pid}\n")
        log = io.StringIO()
        with _job_folder(str(folder), log):
            assert (folder / "agent.pid").read_text() == f"{os.getpid()}\n"
        assert log.getvalue() == "" and other.poll() is None
    finally:
        other.kill()
        other.wait()
