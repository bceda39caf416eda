"""Multi-node plans without processes: DeepSpeed's host/slot selection against hand-written tables for a
4-host hostfile with uneven slots (every --include/--exclude/--num_nodes/--num_gpus form in DeepSpeed's
docs), the runner options, the JobSpec built from a plan, and what ``launch_main`` hands to the runner."""

from __future__ import annotations

import base64
import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from zerospeed.launcher.cli import (
    _VALUE_OPTIONS,
    RunnerOptions,
    build_launch_parser,
    main,
    parse_launch,
    plan_from_args,
    split_script,
)
from zerospeed.launcher.commands import RemoteLaunch
from zerospeed.launcher.environment import FORWARDED_FAMILIES
from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.job import DEFAULT_RDZV_CONFIGS, ElasticSpec, JobSpec
from zerospeed.launcher.plan import JobOptions, LaunchMode, LaunchPlan, Program, job_spec, stable_job_id

# Hostfile order is not name order, and every host has its own slot count.
HOSTFILE = "worker-1 slots=4\nworker-3 slots=2\nworker-0 slots=3\nworker-2 slots=2\n"
NO_DEFAULT = "/nonexistent/job/hostfile"


@pytest.fixture()
def job(tmp_path: Path) -> tuple[str, str]:
    hosts = tmp_path / "hostfile"
    hosts.write_text(HOSTFILE)
    script = tmp_path / "train.py"
    script.touch()
    return str(hosts), str(script)


def _plan(job: tuple[str, str], *options: str) -> LaunchPlan:
    hosts, script = job
    return plan_from_args(["-H", hosts, *options, script], environ={}, default_hostfile=NO_DEFAULT)


W1, W3, W0, W2 = "worker-1", "worker-3", "worker-0", "worker-2"


# (options, hosts with slots in node-rank order, mode, master_addr)
SELECTIONS: list[tuple[list[str], dict[str, tuple[int, ...]], LaunchMode, str]] = [
    # deepspeed --hostfile=myhostfile: every host, every slot, in hostfile order
    ([], {W1: (0, 1, 2, 3), W3: (0, 1), W0: (0, 1, 2), W2: (0, 1)}, LaunchMode.RUNNER, W1),
    # deepspeed --num_nodes=2: the first two hosts of the file
    (["--num_nodes=2"], {W1: (0, 1, 2, 3), W3: (0, 1)}, LaunchMode.RUNNER, W1),
    # --num_gpus: the first N slots of every host
    (["--num_gpus=2"], {W1: (0, 1), W3: (0, 1), W0: (0, 1), W2: (0, 1)}, LaunchMode.RUNNER, W1),
    (["--num_nodes=3", "--num_gpus=1"], {W1: (0,), W3: (0,), W0: (0,)}, LaunchMode.RUNNER, W1),
    # one host left runs on this machine, as DeepSpeed does (--force_multi starts it through the runner)
    (["--num_nodes=1"], {W1: (0, 1, 2, 3)}, LaunchMode.LOCAL, "127.0.0.1"),
    (["--num_nodes=1", "--force_multi"], {W1: (0, 1, 2, 3)}, LaunchMode.RUNNER, W1),
    # deepspeed --exclude="worker-2:0@worker-3:0,1": worker-3 loses both of its slots, so the host goes
    (["--exclude=worker-2:0@worker-3:0,1"], {W1: (0, 1, 2, 3), W0: (0, 1, 2), W2: (1,)}, LaunchMode.RUNNER, W1),
    # deepspeed --include="worker-2:0,1": one host
    (["--include=worker-2:0,1"], {W2: (0, 1)}, LaunchMode.LOCAL, "127.0.0.1"),
    (["--include=worker-2:0,1", "--force_multi"], {W2: (0, 1)}, LaunchMode.RUNNER, W2),
    # -i "worker-0@worker-1:0,2" (the runner's help): hostfile order, not the order of the string
    (["-i", "worker-0@worker-1:0,2"], {W1: (0, 2), W0: (0, 1, 2)}, LaunchMode.RUNNER, W1),
    # -e "worker-1:0" (the runner's help): everything but slot 0 of worker-1
    (["-e", "worker-1:0"], {W1: (1, 2, 3), W3: (0, 1), W0: (0, 1, 2), W2: (0, 1)}, LaunchMode.RUNNER, W1),
    (["-e", "worker-1@worker-0"], {W3: (0, 1), W2: (0, 1)}, LaunchMode.RUNNER, W3),
    (["-i", "worker-3:1@worker-1:3@worker-1:1"], {W1: (1, 3), W3: (1,)}, LaunchMode.RUNNER, W1),
    (["--master_addr=10.0.0.5", "--master_port=6000", "--num_nodes=2"], {W1: (0, 1, 2, 3), W3: (0, 1)},
     LaunchMode.RUNNER, "10.0.0.5"),
    # --no_ssh: this host's agent only; the master is still the first host of the selection
    (["--no_ssh", "--node_rank=2", "-e", "worker-1"], {W3: (0, 1), W0: (0, 1, 2), W2: (0, 1)}, LaunchMode.NODE,
     W3),
]


@pytest.mark.parametrize(("options", "world", "mode", "master"), SELECTIONS)
def test_selection_gives_deepspeeds_world(job: tuple[str, str], options: list[str],
                                          world: dict[str, tuple[int, ...]], mode: LaunchMode, master: str) -> None:
    plan = _plan(job, *options)
    assert list(plan.resources.items()) == list(world.items())
    assert (plan.mode, plan.master_addr) == (mode, master)
    assert plan.world_size == sum(len(slots) for slots in world.values())
    port = 6000 if "--master_port=6000" in options else 29500
    assert plan.master_port == (None if mode is LaunchMode.LOCAL else port)


@pytest.mark.parametrize(("options", "message"), [
    (["--num_nodes=2", "-i", "worker-1"], "--num_procs/--num_gpus/--num_nodes cannot be combined with "
     "--include/--exclude; select slots with one or the other"),
    (["--num_gpus=1", "-e", "worker-1"], "--num_procs/--num_gpus/--num_nodes cannot be combined with "
     "--include/--exclude; select slots with one or the other"),
    (["--num_nodes=5"], "--num_nodes 5 exceeds the 4 host(s) of hostfile {hosts} (worker-1, worker-3, worker-0, "
     "worker-2); lower --num_nodes or add hosts"),
    (["--num_gpus=3"], "--num_procs/--num_gpus 3 exceeds the 2 slots of host 'worker-3' in the hostfile; lower it "
     "or raise that host's slots="),
    (["-i", "worker-9"], "--include 'worker-9': unknown host 'worker-9'; available hosts: worker-1, worker-3, "
     "worker-0, worker-2"),
    (["-i", "worker-3:2"], "--include 'worker-3:2': slot 2 on host 'worker-3' is out of range; 'worker-3' has 2 "
     "slots (ids 0..1)"),
    (["-e", "worker-1@worker-3@worker-0@worker-2"], "--exclude 'worker-1@worker-3@worker-0@worker-2' removes every "
     "slot on every host; nothing is left to run on"),
    (["--master_port=0"], "--master_port 0 (any free port) only works on one machine: the other hosts cannot learn "
     "the port; pass a fixed --master_port (default 29500)"),
    (["--no_ssh"], "--no_ssh needs --node_rank: this host's position (0-based) among the selected hosts of the "
     "hostfile; run the same command on every host with its own --node_rank"),
    (["--node_rank=1"], "--node_rank 1 is only used with --no_ssh (each host started by hand); add --no_ssh, or "
     "drop --node_rank and let the runner start every host"),
    (["--no_ssh", "--node_rank=2", "--num_nodes=2"], "--node_rank 2 is outside the 2 selected host(s) (worker-1, "
     "worker-3); node ranks are 0..1, in hostfile order"),
    (["--elastic_training"], "--elastic_training needs --master_addr: the address of the host that keeps the "
     "rendezvous (it must stay up for the whole job), as in DeepSpeed"),
    (["--min_elastic_nodes=2"], "--min_elastic_nodes 2 only applies with --elastic_training; add it or drop "
     "--min_elastic_nodes"),
    (["--elastic_training", "--master_addr=a", "--min_elastic_nodes=5"], "--min_elastic_nodes 5 and "
     "--max_elastic_nodes 4 must satisfy 1 <= min <= max"),
    (["--elastic_training", "--master_addr=a", "--num_nodes=2", "--min_elastic_nodes=3", "--max_elastic_nodes=3"],
     "--min_elastic_nodes 3 exceeds the 2 selected host(s); the job could never start; lower it or select more "
     "hosts"),
    (["--elastic_training", "--master_addr=a", "--max_elastic_nodes=3"], "--max_elastic_nodes 3 is below the 4 "
     "selected host(s), which would leave 1 of them idle; raise it or select fewer hosts (--num_nodes 3)"),
    (["--elastic_training", "--master_addr=a", "--launcher=OpenMPI"], "--elastic_training cannot run under "
     "--launcher openmpi: Open MPI's mpirun starts every host's agent as one job that ends as a whole when one host "
     "is lost; use --launcher pdsh or ssh, or --no_ssh on each host"),
    (["--elastic_training", "--master_addr=a", "--launcher=mpich"], "--elastic_training cannot run under "
     "--launcher mpich: MPICH's mpirun (hydra) starts every host's agent as one job that ends as a whole when one "
     "host is lost; use --launcher pdsh or ssh, or --no_ssh on each host"),
    (["--elastic_training", "--master_addr=a", "--launcher=slurm", "--num_nodes=2"], "--elastic_training cannot "
     "run under --launcher slurm: srun starts every host's agent as one job that ends as a whole when one host is "
     "lost; use --launcher pdsh or ssh, or --no_ssh on each host"),
    (["--bind_core_list=0-3"], "--bind_core_list '0-3' only applies with --bind_cores_to_rank; add it"),
    (["--bind_cores_to_rank", "--bind_core_list=0-3,x"], "--bind_core_list '0-3,x': 'x' is not a core id or an "
     "'a-b' range; write e.g. '0-3,8'"),
    (["--launcher=impi"], "--launcher 'impi' is not a launcher (DeepSpeed's impi and mvapich runners are not "
     "supported); choose one of pdsh, openmpi, mpich, slurm, ssh"),
    (["--launcher=rsh"], "--launcher 'rsh' is not a launcher; choose one of pdsh, openmpi, mpich, slurm, ssh"),
    (["--launcher_args=--mca 'x"], "--launcher_args \"--mca 'x\" cannot be split into arguments (No closing "
     "quotation); check its quotes"),
    (["--append_local_rank", "--no_local_rank"], "argument --no_local_rank/--no-local-rank: not allowed with "
     "argument --append_local_rank/--append-local-rank (see 'zerospeed --help')"),
])
def test_selections_and_options_deepspeed_rejects_or_that_cannot_run(job: tuple[str, str], options: list[str],
                                                                     message: str) -> None:
    with pytest.raises(LauncherError) as info:
        _plan(job, *options)
    assert str(info.value) == message.format(hosts=job[0])


def test_elastic_with_an_mpi_or_slurm_launcher_is_fine_where_the_launcher_is_not_used(job: tuple[str, str]) -> None:
    """--no_ssh (each host started by hand) and a one-host job never start hosts through --launcher."""
    by_hand = _plan(job, "--elastic_training", "--master_addr=a", "--launcher=slurm", "--no_ssh", "--node_rank=1")
    assert (by_hand.mode, by_hand.elastic_nodes) == (LaunchMode.NODE, (1, 4))
    one = _plan(job, "--elastic_training", "--master_addr=a", "--launcher=openmpi", "--num_nodes=1")
    assert (one.mode, one.elastic_nodes) == (LaunchMode.NODE, (1, 1))
    assert _plan(job, "--elastic_training", "--master_addr=a", "--launcher=ssh").mode is LaunchMode.RUNNER


def test_default_hostfile_is_used_when_it_exists(job: tuple[str, str], tmp_path: Path) -> None:
    hosts, script = job
    plan = plan_from_args(["--num_procs=1", script], environ={}, default_hostfile=hosts)
    assert (list(plan.resources), plan.hosts_from) == ([W1, W3, W0, W2], f"hostfile {hosts}")
    local = plan_from_args(["--num_procs=2", script], environ={}, default_hostfile=str(tmp_path / "absent"))
    assert (dict(local.resources), local.mode) == ({"localhost": (0, 1)}, LaunchMode.LOCAL)
    with pytest.raises(LauncherError, match=r"hostfile '.*/absent' does not exist"):
        plan_from_args(["-H", str(tmp_path / "absent"), script], environ={}, default_hostfile=hosts)


def test_runner_options_and_the_pdsh_fallback(job: tuple[str, str]) -> None:
    hosts, script = job
    _, options = parse_launch(["-H", hosts, "--launcher", "OpenMPI", "--launcher_args", "--mca btl ^openib",
                               "--ssh_port", "2222", "--no_ssh_check", script], environ={},
                              default_hostfile=NO_DEFAULT)
    assert options == RunnerOptions(launcher="openmpi", launcher_args=("--mca", "btl", "^openib"), ssh_port=2222,
                                    no_ssh_check=True)
    assert RunnerOptions().runner(lambda name: None) == (
        "ssh", "zerospeed: pdsh is not installed (not on PATH); starting the hosts with ssh instead")
    assert RunnerOptions().runner(lambda name: "/usr/bin/" + name) == ("pdsh", None)
    assert RunnerOptions(launcher="pdsh").runner(lambda name: None) == ("pdsh", None)  # the executable check refuses


def test_agent_options_and_elastic_reach_the_plan(job: tuple[str, str]) -> None:
    plan = _plan(job, "--elastic_training", "--master_addr=worker-1", "--min_elastic_nodes=2", "--save_pid",
                 "--enable_each_rank_log=/logs", "--bind_cores_to_rank", "--bind_core_list=0-3,8")
    assert plan.elastic_nodes == (2, 4)
    assert plan.options == JobOptions(bind_cores_to_rank=True, bind_core_list="0-3,8", each_rank_log_dir="/logs",
                                      save_pid=True)
    # one host with an option only the node agent applies runs through the agent on this machine
    _, script = job
    single = plan_from_args(["--num_procs=2", "--bind_cores_to_rank", script], environ={},
                            default_hostfile=NO_DEFAULT)
    assert (single.mode, single.master_addr, single.master_port) == (LaunchMode.NODE, "127.0.0.1", None)
    none_log = _plan(job, "--enable_each_rank_log=None")  # DeepSpeed's spelling of "off"
    assert none_log.options == JobOptions()


def test_job_spec_from_a_plan(job: tuple[str, str]) -> None:
    plan = plan_from_args(["-H", job[0], "-e", "worker-3", "--elastic_training", "--master_addr=10.0.0.1",
                           "--master_port=7000", "--save_pid", "--bind_cores_to_rank", job[1], "--lr", "0.1"],
                          environ={}, default_hostfile=NO_DEFAULT)
    spec = job_spec(plan, job_id="0123456789ab")
    assert spec == JobSpec(
        job_id="0123456789ab", world=((W1, (0, 1, 2, 3)), (W0, (0, 1, 2)), (W2, (0, 1))), master_addr="10.0.0.1",
        master_port=7000, program=Program(script=job[1], args=("--lr", "0.1")),
        elastic=ElasticSpec(min_nodes=1, max_nodes=3), bind_cores_to_rank=True, save_pid=True)
    assert JobSpec.decode(spec.encode()) == spec
    local = plan_from_args(["--num_procs=1", "--save_pid", job[1]], environ={}, default_hostfile=NO_DEFAULT)
    with pytest.raises(LauncherError, match="^the job needs a master port; pass --master_port$"):
        job_spec(local, job_id="x")
    assert job_spec(local, job_id="x", master_port=1234).master_port == 1234


def test_elastic_rendezvous_settings_travel_in_the_job_and_old_tokens_get_the_defaults() -> None:
    elastic = ElasticSpec(min_nodes=1, max_nodes=3)
    assert elastic.rdzv_configs == dict(DEFAULT_RDZV_CONFIGS) == {
        "join_timeout": "600", "last_call_timeout": "3", "keep_alive_interval": "2", "keep_alive_max_attempt": "3"}
    spec = JobSpec(job_id="j", world=((W1, (0,)), (W3, (0,))), master_addr=W1, master_port=1,
                   program=Program(script="t.py"),
                   elastic=ElasticSpec(min_nodes=1, max_nodes=2, rdzv_configs={"last_call_timeout": 7, "x": "y"}))
    decoded = JobSpec.decode(spec.encode())
    assert decoded == spec and decoded.elastic is not None
    assert decoded.elastic.rdzv_configs == {"last_call_timeout": "7", "x": "y"}  # strings, as torchrun passes them
    assert hash(elastic) == hash(ElasticSpec(min_nodes=1, max_nodes=3))
    # a token from before rdzv_configs existed
    raw = json.loads(base64.urlsafe_b64decode(spec.encode()))
    del raw["elastic"]["rdzv_configs"]
    old = base64.urlsafe_b64encode(json.dumps(raw).encode()).decode()
    assert JobSpec.decode(old).elastic == ElasticSpec(min_nodes=1, max_nodes=2)
    with pytest.raises(LauncherError) as info:
        ElasticSpec(min_nodes=1, max_nodes=2, rdzv_configs={"keep_alive_interval": "0"})
    assert str(info.value) == ("rendezvous setting keep_alive_interval='0' must be a positive integer (seconds, or a "
                               "count); e.g. keep_alive_interval=2")


def test_no_ssh_hosts_agree_on_the_job_id(job: tuple[str, str]) -> None:
    ids = {stable_job_id(_plan(job, "--no_ssh", f"--node_rank={rank}")) for rank in range(4)}
    assert len(ids) == 1 and len(next(iter(ids))) == 12
    assert stable_job_id(_plan(job, "--no_ssh", "--node_rank=0", "--master_port=29501")) not in ids


def test_no_ssh_job_id_ignores_per_host_program_and_options(job: tuple[str, str], tmp_path: Path) -> None:
    """The id is torch's rendezvous run id: hosts naming the script differently or passing per-host
    arguments and agent options must still compute the same one (else they never meet: a silent hang)."""
    hosts, script = job
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "train.py").touch()

    def plan(*args: str) -> LaunchPlan:
        return plan_from_args(["-H", hosts, "--no_ssh", *args], environ={}, default_hostfile=NO_DEFAULT)

    base = stable_job_id(plan("--node_rank=0", script, "--output_dir=/a"))
    assert stable_job_id(plan("--node_rank=1", str(tmp_path / "other" / "train.py"), "--output_dir=/b",
                              "--lr=2")) == base
    assert stable_job_id(plan("--node_rank=2", "--bind_cores_to_rank", "--enable_each_rank_log=/logs",
                              "--save_pid", script)) == base
    assert stable_job_id(plan("--node_rank=3", "--module", "pkg.train")) == base
    # a different world or elastic range is a different job
    assert stable_job_id(plan("--node_rank=0", "--num_nodes=2", script)) != base
    assert stable_job_id(plan("--node_rank=0", "--num_gpus=1", script)) != base
    assert stable_job_id(plan("--node_rank=0", "--elastic_training", "--master_addr=worker-1", "--min_elastic_nodes=1",
                              "--max_elastic_nodes=4", script)) != stable_job_id(
        plan("--node_rank=0", "--elastic_training", "--master_addr=worker-1", "--min_elastic_nodes=2",
             "--max_elastic_nodes=4", script))


def test_value_options_match_the_parser() -> None:
    """split_script must know every option that takes a value, or it would take the value for the script."""
    takes_value = {flag for action in build_launch_parser()._actions if action.nargs != 0
                   for flag in action.option_strings}
    assert takes_value == set(_VALUE_OPTIONS)
    assert split_script(["--launcher", "ssh", "--launcher_args", "-x y", "--node_rank", "1", "--no_ssh",
                         "--bind_core_list", "1-2", "t.py", "--launcher", "a"]) == (
        ["--launcher", "ssh", "--launcher_args", "-x y", "--node_rank", "1", "--no_ssh", "--bind_core_list", "1-2"],
        "t.py", ["--launcher", "a"])


def test_help_no_longer_says_one_machine_only(capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--launcher NAME", "--launcher_args ARGS", "--no_ssh", "--node_rank K", "--force_multi",
                 "--elastic_training", "--min_elastic_nodes K", "--enable_each_rank_log DIR", "--bind_core_list CORES",
                 "--no_local_rank", "--ssh_port P", "--save_pid", "--no_ssh_check"):
        assert flag in out, flag
    assert "only K=1" not in out and "one machine, one process" not in out


# --- what launch_main hands on ---------------------------------------------------------------------------


def test_launch_main_hands_a_multi_node_job_to_the_runner(job: tuple[str, str], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    hosts, script = job
    calls: list[tuple[JobSpec, dict[str, Any]]] = []

    def run_job(spec: JobSpec, **kwargs: Any) -> int:
        calls.append((spec, kwargs))
        return 7

    monkeypatch.setitem(sys.modules, "zerospeed.launcher.multinode", types.SimpleNamespace(run_job=run_job))
    home = tmp_path / "home"
    home.mkdir()
    (home / ".deepspeed_env").write_text("FROM_FILE=1\n")
    monkeypatch.setenv("HOME", str(home))
    for name in list(os.environ):
        if name.startswith(FORWARDED_FAMILIES):
            monkeypatch.delenv(name)
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.chdir(tmp_path)
    assert main(["-H", hosts, "--num_nodes=2", "--launcher=ssh", "--ssh_port=2200", script, "--x"]) == 7
    ((spec, kwargs),) = calls
    assert spec.world == ((W1, (0, 1, 2, 3)), (W3, (0, 1)))
    assert (spec.master_addr, spec.master_port, spec.program.args) == (W1, 29500, ("--x",))
    assert len(spec.job_id) == 12 and int(spec.job_id, 16) >= 0
    assert kwargs["runner"] == "ssh" and set(kwargs) == {"runner", "launches", "preflight", "stop", "probe",
                                                         "no_ssh_check"}
    assert kwargs["no_ssh_check"] is False
    agents: tuple[RemoteLaunch, ...] = kwargs["launches"]
    assert [launch.hosts for launch in agents] == [(W1,), (W3,)]
    assert agents[0].argv[-2:] == (W1, f"export NCCL_DEBUG=INFO; export PYTHONPATH={tmp_path}; export FROM_FILE=\"1\"; "
                                       f"cd {tmp_path} && exec {sys.executable} -u -m zerospeed.launcher.node "
                                       f"--job={spec.encode()} --watch_stdin --node_rank=0")
    assert "-p" in agents[0].argv and [launch.hosts for launch in kwargs["stop"]] == [(W1,), (W3,)]
    # pre-flight is a function of check_master: run_job asks for the port check only while it listens
    assert kwargs["preflight"](False)[1].argv[-1].endswith(f"--node_host={W3}")
    assert [launch.argv[-1].rsplit(" ", 2)[1:] for launch in kwargs["preflight"](True)] == [
        [f"--node_host={W1}", "--check_master"], [f"--node_host={W3}", "--check_master"]]
    assert kwargs["probe"](W3) == RemoteLaunch(
        argv=("ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=3", "-p", "2200", W3, "true"), hosts=(W3,))


def test_launch_main_hands_an_elastic_pdsh_job_over_as_one_pdsh_per_host(job: tuple[str, str],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    hosts, script = job
    calls: list[dict[str, Any]] = []
    monkeypatch.setitem(sys.modules, "zerospeed.launcher.multinode",
                        types.SimpleNamespace(run_job=lambda spec, **kwargs: calls.append(kwargs) or 0))
    monkeypatch.setattr("shutil.which", lambda name: f"/usr/bin/{name}")
    assert main(["-H", hosts, "--num_nodes=3", "--elastic_training", f"--master_addr={W1}", "--launcher=pdsh",
                 script]) == 0
    ((kwargs),) = calls
    assert kwargs["runner"] == "pdsh"
    assert [(launch.argv[:8], launch.hosts) for launch in kwargs["launches"]] == [
        (("pdsh", "-S", "-f", "1024", "-R", "ssh", "-w", host), (host,)) for host in (W1, W3, W0)]
    assert kwargs["probe"](W0).argv == ("pdsh", "-S", "-t", "3", "-R", "ssh", "-w", W0, "true")
    for mpi in ("openmpi", "slurm"):  # refused before anything is built or started
        assert main(["-H", hosts, "--elastic_training", f"--master_addr={W1}", f"--launcher={mpi}", script]) == 2
    assert len(calls) == 1


def test_launch_main_runs_a_no_ssh_host_as_its_node_agent(job: tuple[str, str], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    hosts, script = job
    seen: list[list[str]] = []
    monkeypatch.setitem(sys.modules, "zerospeed.launcher.node",
                        types.SimpleNamespace(main=lambda argv: seen.append(argv) or 0))
    (tmp_path / ".deepspeed_env").write_text("FROM_FILE=2\n")
    monkeypatch.setenv("HOME", str(tmp_path / "nohome"))
    monkeypatch.chdir(tmp_path)
    assert main(["-H", hosts, "--no_ssh", "--node_rank=1", "--master_port=6001", script]) == 0
    ((job_arg, rank_arg),) = seen
    spec = JobSpec.decode(job_arg.removeprefix("--job="))
    assert rank_arg == "--node_rank=1"
    assert (spec.hosts, spec.master_addr, spec.master_port) == ((W1, W3, W0, W2), W1, 6001)
    assert spec.worker_env["FROM_FILE"] == "2"
    assert spec.job_id == stable_job_id(_plan(job, "--no_ssh", "--node_rank=1", "--master_port=6001"))
