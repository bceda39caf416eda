"""What each multi-node runner executes (``launcher/commands.py``), as exact command lines, and the
environment a job forwards to its hosts (``launcher/environment.py``). Pure values, plus three small real
checks: the remote shell string run by ``sh``, pdsh's substitution with a stand-in ``ssh``, and the stop
script against real processes."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zerospeed.launcher.commands import (
    RemoteLaunch,
    check_elastic_launcher,
    launches,
    preflight_launches,
    probe_command,
    remote_shell,
    runner_executable,
    stop_commands,
    stop_script,
)
from zerospeed.launcher.environment import (
    ForwardedEnvironment,
    env_file_paths,
    forwarded_environment,
    parse_env_file,
    parse_env_lines,
    read_env_files,
)
from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.job import ElasticSpec, JobSpec
from zerospeed.launcher.plan import Program

ROOT = Path(__file__).resolve().parents[1]
SPEC = JobSpec(job_id="abc123def456", world=(("h0", (0, 1)), ("h1", (0,)), ("h2", (1, 2))),
               master_addr="h0", master_port=29500, program=Program(script="train.py", args=("--x", "a b")))
ELASTIC = dataclasses.replace(SPEC, elastic=ElasticSpec(min_nodes=1, max_nodes=3))
TOKEN = SPEC.encode()
EXPORTS = {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/work dir:/lib", "ZEROSPEED_X": "a,b%c"}
SSH = ("ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=5",
       "-o", "ServerAliveCountMax=3")
NODE = ("/venv/bin/python", "-u", "-m", "zerospeed.launcher.node", f"--job={TOKEN}")
EXPORT_SHELL = "export NCCL_DEBUG=INFO; export PYTHONPATH='/work dir:/lib'; export ZEROSPEED_X=a,b%c;"
STOP = ('for f in "${TMPDIR:-${TEMP:-${TMP:-/tmp}}}/zerospeed-job-abc123def456-$(uname -n)"-n*/agent.pid; '
        'do p=$(cat "$f" 2>/dev/null) && grep -qa zerospeed.launcher.node "/proc/$p/cmdline" 2>/dev/null '
        '&& kill -TERM "$p"; done; exit 0')


def _launches(runner: str, *, launcher_args: tuple[str, ...] = (), ssh_port: int | None = None,
              **extra: object) -> tuple[RemoteLaunch, ...]:
    return launches(SPEC, runner, launcher_args=launcher_args, ssh_port=ssh_port, exports=EXPORTS,
                    cwd="/work dir", python="/venv/bin/python", **extra)  # type: ignore[arg-type]


# --- the node agent's launch, per runner ------------------------------------------------------------


def test_pdsh_one_process_for_all_hosts_named_by_pdsh() -> None:
    (launch,) = _launches("pdsh", launcher_args=("-u", "30"), ssh_port=2222,
                          local_environ={"PDSH_SSH_ARGS_APPEND": "-q"})
    assert launch.argv == (
        "pdsh", "-S", "-f", "1024", "-R", "ssh", "-w", "h0,h1,h2", "-u", "30",
        # pdsh substitutes %h (and %n, %u): our own '%' is written '%%'
        "export NCCL_DEBUG=INFO; export PYTHONPATH='/work dir:/lib'; export ZEROSPEED_X=a,b%%c; "
        f"cd '/work dir' && exec /venv/bin/python -u -m zerospeed.launcher.node --job={TOKEN} --watch_stdin "
        "--node_host=%h",
    )
    assert launch.hosts == ("h0", "h1", "h2")
    assert dict(launch.env) == {
        "PDSH_RCMD_TYPE": "ssh",
        "PDSH_SSH_ARGS_APPEND": "-q -o BatchMode=yes -o ConnectTimeout=10 -o ServerAliveInterval=5 "
                                "-o ServerAliveCountMax=3 -p 2222",
    }


def test_save_pid_passes_the_runners_pid_to_every_agent() -> None:
    (launch,) = _launches("mpich", save_pid=4242)
    assert launch.argv[-2:] == (f"--job={TOKEN}", "--save_pid=4242")
    assert _launches("ssh", save_pid=4242)[1].argv[-1].endswith(
        f"--job={TOKEN} --save_pid=4242 --watch_stdin --node_rank=1")


def test_ssh_one_process_per_host_with_its_node_rank() -> None:
    got = _launches("ssh", launcher_args=("-i", "/k"), ssh_port=2222)
    assert got == tuple(
        RemoteLaunch(argv=(*SSH, "-p", "2222", "-i", "/k", host,
                           f"{EXPORT_SHELL} cd '/work dir' && exec /venv/bin/python -u -m zerospeed.launcher.node "
                           f"--job={TOKEN} --watch_stdin --node_rank={rank}"), hosts=(host,))
        for rank, host in enumerate(("h0", "h1", "h2")))


def test_openmpi_one_application_context_per_host() -> None:
    (launch,) = _launches("openmpi", launcher_args=("--allow-run-as-root",), ssh_port=2222,
                          executable="mpirun.openmpi")

    def context(rank: int, host: str) -> tuple[str, ...]:
        return ("-n", "1", "--host", host, "-wdir", "/work dir", "-x", "NCCL_DEBUG=INFO",
                "-x", "PYTHONPATH=/work dir:/lib", "-x", "ZEROSPEED_X=a,b%c", *NODE, f"--node_rank={rank}")

    assert launch.argv == ("mpirun.openmpi", "--mca", "plm_rsh_args", "-p 2222", "--allow-run-as-root",
                           *context(0, "h0"), ":", *context(1, "h1"), ":", *context(2, "h2"))
    assert (launch.hosts, dict(launch.env)) == (("h0", "h1", "h2"), {})


def test_mpich_hydra_one_rank_per_host_in_host_order() -> None:
    (launch,) = _launches("mpich", launcher_args=("-iface", "eth1"), executable="mpirun.mpich")
    assert launch.argv == ("mpirun.mpich", "-n", "3", "-ppn", "1", "-hosts", "h0,h1,h2", "-iface", "eth1",
                           "-genv", "NCCL_DEBUG", "INFO", "-genv", "PYTHONPATH", "/work dir:/lib",
                           "-genv", "ZEROSPEED_X", "a,b%c", "-wdir", "/work dir", *NODE)
    with pytest.raises(LauncherError) as info:
        _launches("mpich", ssh_port=2222)
    assert str(info.value) == (
        "--ssh_port 2222 cannot be passed to MPICH's hydra (it has no option for ssh arguments); set 'Port' for "
        "these hosts in ~/.ssh/config instead, or use --launcher pdsh, ssh or openmpi")


def test_an_ssh_port_under_slurm_is_refused_not_ignored() -> None:
    for build in (lambda: _launches("slurm", ssh_port=2222),
                  lambda: stop_commands(SPEC, "slurm", launcher_args=(), ssh_port=2222)):
        with pytest.raises(LauncherError) as info:
            build()
        assert str(info.value) == (
            "--ssh_port 2222 has no meaning under --launcher slurm (srun reaches the hosts through slurmd, not "
            "ssh); leave it out, or use --launcher pdsh, ssh or openmpi")


def test_slurm_srun_names_the_nodes_and_the_agent_finds_itself_by_slurm_node_name() -> None:
    (launch,) = _launches("slurm", launcher_args=("--partition", "gpu"))
    assert launch.argv == (
        "srun", "--nodes=3", "--ntasks=3", "--ntasks-per-node=1", "--nodelist=h0,h1,h2", "--partition", "gpu",
        "--kill-on-bad-exit=1", "--chdir=/work dir",
        # srun splits --export at commas: a value holding one travels through srun's own environment
        "--export=ALL,NCCL_DEBUG=INFO,PYTHONPATH=/work dir:/lib,ZEROSPEED_X",
        "sh", "-c", f'exec /venv/bin/python -u -m zerospeed.launcher.node --job={TOKEN} '
                    '--node_host="$SLURMD_NODENAME"')
    assert dict(launch.env) == {"ZEROSPEED_X": "a,b%c"}


def test_no_ssh_starts_nothing_remotely_and_unknown_runners_are_refused() -> None:
    assert _launches("no_ssh") == ()
    assert stop_commands(SPEC, "no_ssh", launcher_args=(), ssh_port=None) == ()
    with pytest.raises(LauncherError, match=r"^unknown launcher 'impi'; choose one of pdsh, openmpi, mpich, "
                                            r"slurm, ssh, no_ssh$"):
        _launches("impi")


def test_preflight_runs_through_the_same_runner_naming_each_host() -> None:
    def preflight(runner: str) -> tuple[RemoteLaunch, ...]:
        return preflight_launches(SPEC, runner, launcher_args=(), ssh_port=None, exports={}, cwd="/w",
                                  python="py")

    probe = f"py -u -m zerospeed.launcher.preflight --job={TOKEN}"
    assert [launch.argv[-1] for launch in preflight("ssh")] == [
        f"cd /w && exec {probe} --node_host={host}" for host in ("h0", "h1", "h2")]
    assert preflight("pdsh")[0].argv[-1] == f"cd /w && exec {probe} --node_host=%h"
    assert preflight("openmpi")[0].argv[-4:] == ("-m", "zerospeed.launcher.preflight", f"--job={TOKEN}",
                                                 "--node_host=h2")
    assert preflight("mpich")[0].argv[-1] == f"--job={TOKEN}"


def test_preflight_asks_for_the_master_port_check_after_the_host_on_every_runner() -> None:
    def preflight(runner: str, check_master: bool) -> tuple[RemoteLaunch, ...]:
        return preflight_launches(SPEC, runner, launcher_args=(), ssh_port=None, exports={"A": "1"}, cwd="/w",
                                  python="py", check_master=check_master)

    probe = f"py -u -m zerospeed.launcher.preflight --job={TOKEN}"
    assert [launch.argv[-1] for launch in preflight("ssh", True)] == [
        f"export A=1; cd /w && exec {probe} --node_host={host} --check_master" for host in ("h0", "h1", "h2")]
    assert preflight("pdsh", True)[0].argv[-1] == f"export A=1; cd /w && exec {probe} --node_host=%h --check_master"
    (openmpi,) = preflight("openmpi", True)
    assert openmpi.argv == ("mpirun", *(word for rank, host in enumerate(("h0", "h1", "h2")) for word in (
        *((":",) if rank else ()), "-n", "1", "--host", host, "-wdir", "/w", "-x", "A=1", "py", "-u", "-m",
        "zerospeed.launcher.preflight", f"--job={TOKEN}", f"--node_host={host}", "--check_master")))
    assert preflight("mpich", True)[0].argv[-2:] == (f"--job={TOKEN}", "--check_master")
    assert preflight("slurm", True)[0].argv[-3:] == (
        "sh", "-c", f'exec {probe} --node_host="$SLURMD_NODENAME" --check_master')
    for runner in ("ssh", "pdsh", "openmpi", "mpich", "slurm"):  # not asked for: not there
        assert not any("--check_master" in word for launch in preflight(runner, False) for word in launch.argv)
    assert preflight_launches(SPEC, "no_ssh", launcher_args=(), ssh_port=None, exports={}, cwd="/w", python="py",
                              check_master=True) == ()


def test_an_elastic_job_starts_one_pdsh_per_host() -> None:
    """The runner must see a lost host's agent end alone, and start it again alone."""
    got = launches(ELASTIC, "pdsh", launcher_args=("-u", "30"), ssh_port=2222, exports={}, cwd="/w", python="py")
    command = f"cd /w && exec py -u -m zerospeed.launcher.node --job={ELASTIC.encode()} --watch_stdin --node_host=%h"
    (fixed,) = launches(SPEC, "pdsh", launcher_args=(), ssh_port=2222, exports={}, cwd="/w", python="py")
    assert got == tuple(RemoteLaunch(argv=("pdsh", "-S", "-f", "1024", "-R", "ssh", "-w", host, "-u", "30", command),
                                     hosts=(host,), env=fixed.env) for host in ("h0", "h1", "h2"))
    assert [launch.hosts for launch in launches(ELASTIC, "ssh", launcher_args=(), ssh_port=None, exports={},
                                                cwd="/w", python="py")] == [("h0",), ("h1",), ("h2",)]
    assert launches(ELASTIC, "no_ssh", launcher_args=(), ssh_port=None, exports={}, cwd="/w", python="py") == ()


@pytest.mark.parametrize(("runner", "which"), [("openmpi", "Open MPI's mpirun"),
                                               ("mpich", "MPICH's mpirun (hydra)"), ("slurm", "srun")])
def test_elastic_training_is_refused_where_one_process_starts_every_host(runner: str, which: str) -> None:
    message = (f"--elastic_training cannot run under --launcher {runner}: {which} starts every host's agent as one "
               "job that ends as a whole when one host is lost; use --launcher pdsh or ssh, or --no_ssh on each host")
    with pytest.raises(LauncherError) as info:
        launches(ELASTIC, runner, launcher_args=(), ssh_port=None, exports={}, cwd="/w", python="py")
    assert str(info.value) == message
    with pytest.raises(LauncherError) as info:
        check_elastic_launcher(runner, elastic=True)
    assert str(info.value) == message
    check_elastic_launcher(runner, elastic=False)
    for fine in ("pdsh", "ssh", "no_ssh"):
        check_elastic_launcher(fine, elastic=True)


def test_the_elastic_probe_reaches_the_host_as_its_agent_does_and_gives_up_in_3_s() -> None:
    ssh = probe_command("ssh", "h1", launcher_args=("-l", "me"), ssh_port=2222)
    assert ssh == RemoteLaunch(argv=("ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=3", "-p", "2222", "-l", "me",
                                     "h1", "true"), hosts=("h1",))
    assert probe_command("ssh", "h1", launcher_args=(), ssh_port=None).argv == (
        "ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=3", "h1", "true")
    pdsh = probe_command("pdsh", "h2", launcher_args=("-l", "me"), ssh_port=2222, executable="/usr/bin/pdsh",
                         local_environ={"PDSH_SSH_ARGS_APPEND": "-i /k"})
    assert pdsh.argv == ("/usr/bin/pdsh", "-S", "-t", "3", "-R", "ssh", "-w", "h2", "-l", "me", "true")
    assert (pdsh.hosts, dict(pdsh.env)) == (("h2",), {
        "PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": "-i /k -o BatchMode=yes -o ConnectTimeout=3 -p 2222"})
    with pytest.raises(LauncherError, match=r"^no reachability probe for --launcher 'slurm': elastic jobs run under "
                                            r"pdsh or ssh only$"):
        probe_command("slurm", "h1", launcher_args=(), ssh_port=None)


def test_only_pdsh_and_ssh_agents_watch_stdin_and_their_ssh_notices_a_dead_link() -> None:
    """mpirun and srun forward stdin to their first process only: an agent there that watched its stdin
    would see its end at once and stop. ssh (pdsh's too) never prompts and gives up on a silent link
    within 3 x 5 s."""
    for runner in ("openmpi", "mpich", "slurm"):
        (launch,) = _launches(runner)
        assert not any("--watch_stdin" in word for word in launch.argv), runner
    assert all(launch.argv[-1].endswith(f"--watch_stdin --node_rank={rank}")
               for rank, launch in enumerate(_launches("ssh")))
    (pdsh,) = _launches("pdsh")
    assert pdsh.argv[-1].endswith("--watch_stdin --node_host=%h")
    keep_alive = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=5",
                  "-o", "ServerAliveCountMax=3")
    for launch in (*_launches("ssh"), *stop_commands(SPEC, "ssh", launcher_args=(), ssh_port=None)):
        assert launch.argv[1:9] == keep_alive
    for launch in (pdsh, *stop_commands(SPEC, "pdsh", launcher_args=(), ssh_port=None)):
        assert launch.env["PDSH_SSH_ARGS_APPEND"] == " ".join(keep_alive)


def test_stop_commands_kill_this_jobs_agents_by_pid_through_the_runner() -> None:
    def stop(runner: str, **extra: object) -> list[tuple[str, ...]]:
        return [launch.argv for launch in stop_commands(SPEC, runner, launcher_args=(), ssh_port=None,
                                                        **extra)]  # type: ignore[arg-type]

    assert stop("pdsh") == [("pdsh", "-S", "-f", "1024", "-R", "ssh", "-w", "h0,h1,h2", STOP)]
    assert stop("ssh") == [(*SSH, host, STOP) for host in ("h0", "h1", "h2")]
    assert stop("openmpi", executable="mpirun.openmpi") == [
        ("mpirun.openmpi", "-n", "3", "--host", "h0,h1,h2", "--map-by", "ppr:1:node", "sh", "-c", STOP)]
    assert stop("mpich") == [("mpirun", "-n", "3", "-ppn", "1", "-hosts", "h0,h1,h2", "sh", "-c", STOP)]
    assert stop("slurm") == [("srun", "--nodes=3", "--ntasks=3", "--ntasks-per-node=1", "--nodelist=h0,h1,h2",
                              "--overlap", "sh", "-c", STOP)]
    assert "pkill" not in STOP and stop_script("abc123def456") == STOP


def test_runner_executable_prefers_the_binary_that_names_one_mpi() -> None:
    both = {"mpirun", "mpirun.openmpi", "mpirun.mpich", "srun", "pdsh", "ssh"}
    assert runner_executable("openmpi", lambda name: name if name in both else None) == "mpirun.openmpi"
    assert runner_executable("mpich", lambda name: name if name in both else None) == "mpirun.mpich"
    assert runner_executable("mpich", lambda name: name if name in {"mpiexec.hydra", "mpirun"} else None) == (
        "mpiexec.hydra")
    assert runner_executable("openmpi", lambda name: name if name == "mpirun" else None) == "mpirun"
    assert runner_executable("slurm", lambda name: name if name in both else None) == "srun"
    with pytest.raises(LauncherError) as info:
        runner_executable("pdsh", lambda name: None)
    assert str(info.value) == ("--launcher pdsh needs 'pdsh' on PATH, and it is not there; install it (Debian: "
                               "apt install pdsh) or pick another --launcher (pdsh, openmpi, mpich, slurm, ssh)")


def test_exports_must_be_shell_names() -> None:
    with pytest.raises(LauncherError, match=r"^cannot export variable 'A-B' to the hosts: not a shell variable"):
        launches(SPEC, "ssh", launcher_args=(), ssh_port=None, exports={"A-B": "1"}, cwd="/", python="py")


FILE_EXPORTS = ForwardedEnvironment({"NCCL_DEBUG": "$HOME", "LD_LIBRARY_PATH": "/opt/nccl/lib:$LD_LIBRARY_PATH",
                                     "Q": 'a"b\\c`d` e'}, expand={"LD_LIBRARY_PATH", "Q"})


def test_env_file_values_are_double_quoted_for_pdsh_and_ssh_and_literal_elsewhere() -> None:
    exports_shell = ("export NCCL_DEBUG='$HOME'; export LD_LIBRARY_PATH=\"/opt/nccl/lib:$LD_LIBRARY_PATH\"; "
                     "export Q=\"a\\\"b\\\\c\\`d\\` e\";")
    assert remote_shell(FILE_EXPORTS, "/w", ("true",)) == f"{exports_shell} cd /w && exec true"
    assert remote_shell(dict(FILE_EXPORTS), "/w", ("true",)) == (  # a plain dict: every value literal
        "export NCCL_DEBUG='$HOME'; export LD_LIBRARY_PATH='/opt/nccl/lib:$LD_LIBRARY_PATH'; "
        "export Q='a\"b\\c`d` e'; cd /w && exec true")

    def argv(runner: str) -> tuple[str, ...]:
        (launch,) = launches(SPEC, runner, launcher_args=(), ssh_port=None, exports=FILE_EXPORTS, cwd="/w",
                             python="py")[:1]
        return launch.argv

    assert argv("pdsh")[-1].startswith(f"{exports_shell} cd /w && exec py -u -m zerospeed.launcher.node")
    assert argv("ssh")[-1].startswith(f"{exports_shell} cd /w && exec py -u -m zerospeed.launcher.node")
    assert argv("openmpi")[7:13] == ("-x", "NCCL_DEBUG=$HOME", "-x",
                                     "LD_LIBRARY_PATH=/opt/nccl/lib:$LD_LIBRARY_PATH", "-x", 'Q=a"b\\c`d` e')
    assert argv("mpich")[7:16] == ("-genv", "NCCL_DEBUG", "$HOME", "-genv", "LD_LIBRARY_PATH",
                                   "/opt/nccl/lib:$LD_LIBRARY_PATH", "-genv", "Q", 'a"b\\c`d` e')
    assert argv("slurm")[7] == (
        '--export=ALL,NCCL_DEBUG=$HOME,LD_LIBRARY_PATH=/opt/nccl/lib:$LD_LIBRARY_PATH,Q=a"b\\c`d` e')


def test_the_stop_script_looks_in_the_exported_temporary_folder() -> None:
    exports = ForwardedEnvironment({"NCCL_DEBUG": "INFO", "TMP": "/t p", "TMPDIR": "$SCRATCH/tmp"},
                                   expand={"TMPDIR"})

    def stop(runner: str) -> str:
        return stop_commands(SPEC, runner, launcher_args=(), ssh_port=None, exports=exports)[0].argv[-1]

    assert stop("ssh") == "TMPDIR=\"$SCRATCH/tmp\"; TMP='/t p'; " + STOP
    assert stop("pdsh") == "TMPDIR=\"$SCRATCH/tmp\"; TMP='/t p'; " + STOP.replace("%", "%%")
    for runner in ("openmpi", "mpich", "slurm"):  # passed literally there, so looked up literally
        assert stop(runner) == "TMPDIR='$SCRATCH/tmp'; TMP='/t p'; " + STOP
    assert stop_script("abc123def456", {"TEMP": "/x"}) == "TEMP=/x; " + STOP
    assert stop_script("abc123def456", {"NCCL_DEBUG": "INFO"}) == STOP


# --- real shells and processes -------------------------------------------------------------------------


def test_the_remote_shell_expands_env_file_values_on_the_host_only(tmp_path: Path) -> None:
    show = "import json, os; print(json.dumps([os.environ[k] for k in ('NCCL_DEBUG', 'LD_LIBRARY_PATH', 'Q')]))"
    shell = remote_shell(FILE_EXPORTS, str(tmp_path), (sys.executable, "-c", show))
    env = {"PATH": os.environ["PATH"], "HOME": "/home/u", "LD_LIBRARY_PATH": "/host/lib"}
    done = subprocess.run(["sh", "-c", shell], env=env, capture_output=True, text=True, timeout=30, check=True)
    assert json.loads(done.stdout) == ["$HOME", "/opt/nccl/lib:/host/lib", 'a"b\\c`d` e']


def test_the_remote_shell_string_gives_the_program_its_exact_arguments_and_variables(tmp_path: Path) -> None:
    show = "import json, os, sys; print(json.dumps([sys.argv[1:], os.getcwd(), os.environ['Q'], os.environ['P']]))"
    args = ("a b", "$HOME", "it's", "%n", "")
    shell = remote_shell({"Q": "x y'z\"$HOME", "P": "%h"}, str(tmp_path), (sys.executable, "-c", show, *args))
    done = subprocess.run(["sh", "-c", shell], capture_output=True, text=True, timeout=30, check=True)
    assert json.loads(done.stdout) == [list(args), str(tmp_path), "x y'z\"$HOME", "%h"]
    missing = remote_shell({}, str(tmp_path / "absent"), ("true",))
    assert subprocess.run(["sh", "-c", missing], capture_output=True, timeout=30).returncode != 0


@pytest.mark.skipif(shutil.which("pdsh") is None, reason="pdsh is not installed")
def test_pdsh_substitutes_the_host_and_keeps_our_percent_signs(tmp_path: Path) -> None:
    """pdsh runs a stand-in ``ssh`` (first on PATH) that records what it was asked to run per host."""
    fake = tmp_path / "ssh"  # writes its last argument (the remote command) to $OUT/<the host before it>
    fake.write_text(f"#!{sys.executable}\nimport os, sys\n"
                    "open(os.path.join(os.environ['OUT'], sys.argv[-2]), 'w').write(sys.argv[-1])\n")
    fake.chmod(0o755)
    (launch,) = _launches("pdsh")
    env = {**os.environ, **launch.env, "PATH": f"{tmp_path}:{os.environ['PATH']}", "OUT": str(tmp_path)}
    subprocess.run(launch.argv, env=env, timeout=30, check=True, capture_output=True)
    for host in ("h0", "h1", "h2"):
        assert (tmp_path / host).read_text() == (
            f"{EXPORT_SHELL} cd '/work dir' && exec {' '.join(NODE)} --watch_stdin --node_host={host}")


@pytest.mark.skipif(shutil.which("pdsh") is None, reason="pdsh is not installed")
def test_the_pdsh_probe_exits_with_ssh_code_and_a_3_s_connect_timeout(tmp_path: Path) -> None:
    """A stand-in ``ssh`` records its arguments and exits with $CODE: pdsh -S passes 255 (host down) on."""
    fake = tmp_path / "ssh"
    fake.write_text(f"#!{sys.executable}\nimport os, sys\n"
                    "open(os.path.join(os.environ['OUT'], 'args'), 'w').write(' '.join(sys.argv[1:]))\n"
                    "sys.exit(int(os.environ['CODE']))\n")
    fake.chmod(0o755)
    probe = probe_command("pdsh", "h1", launcher_args=(), ssh_port=2222)
    for code in (0, 255):
        env = {**os.environ, **probe.env, "PATH": f"{tmp_path}:{os.environ['PATH']}", "OUT": str(tmp_path),
               "CODE": str(code)}
        assert subprocess.run(probe.argv, env=env, timeout=30, capture_output=True).returncode == code
        words = (tmp_path / "args").read_text().split()
        # pdsh's own -oConnectTimeout (from -t) comes first, and ssh keeps the first value it reads
        assert words[0] == "-oConnectTimeout=3" and words[-2:] == ["h1", "true"], words
        assert "BatchMode=yes" in words and words[words.index("-p") + 1] == "2222"


def _sleeper(tmp_path: Path, marker: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])


def test_the_stop_script_signals_only_this_jobs_agent(tmp_path: Path) -> None:
    agent = _sleeper(tmp_path, "zerospeed.launcher.node")  # its command line names the agent module
    stranger = _sleeper(tmp_path, "something-else")
    try:
        folder = tmp_path / f"zerospeed-job-abc123def456-{os.uname().nodename}-n1"
        folder.mkdir()
        other_host = tmp_path / "zerospeed-job-abc123def456-another-host-n0"  # a shared /tmp: never read
        other_host.mkdir()
        (other_host / "agent.pid").write_text(str(agent.pid))
        env = {"PATH": os.environ["PATH"], "TMPDIR": str(tmp_path)}
        (folder / "agent.pid").write_text(str(stranger.pid))  # a PID recycled by another program
        assert subprocess.run(["sh", "-c", STOP], env=env, timeout=30).returncode == 0
        time.sleep(0.2)
        assert stranger.poll() is None
        (folder / "agent.pid").write_text(str(agent.pid))
        assert subprocess.run(["sh", "-c", STOP], env=env, timeout=30).returncode == 0
        assert agent.wait(timeout=10) == -signal.SIGTERM
        (folder / "agent.pid").unlink()  # the agent is gone and removed its file: nothing to do, exit 0
        assert subprocess.run(["sh", "-c", STOP], env=env, timeout=30).returncode == 0
        # the job exported TMPDIR (a .deepspeed_env line): the agent wrote there, whatever the login shell says
        agent = _sleeper(tmp_path, "zerospeed.launcher.node")
        scratch = tmp_path / "scratch"
        (scratch / "tmp" / folder.name).mkdir(parents=True)
        (scratch / "tmp" / folder.name / "agent.pid").write_text(str(agent.pid))
        script = stop_script("abc123def456", ForwardedEnvironment({"TMPDIR": "$SCRATCH/tmp"}, expand={"TMPDIR"}))
        env = {"PATH": os.environ["PATH"], "TMPDIR": str(tmp_path), "SCRATCH": str(scratch)}
        assert subprocess.run(["sh", "-c", script], env=env, timeout=30).returncode == 0
        assert agent.wait(timeout=10) == -signal.SIGTERM
    finally:
        for process in (agent, stranger):
            process.kill()
            process.wait()


# --- the forwarded environment -------------------------------------------------------------------------


def test_forwarded_environment_families_pythonpath_and_files_in_deepspeeds_order() -> None:
    environ = {"HOME": "/home/u", "NCCL_IB_HCA": "mlx5", "PYTHONPATH": "/lib", "PATH": "/bin",
               "UCX_TLS": "tcp", "MLFLOW_RUN": "r", "MV2_X": "1", "ZEROSPEED_LOG": "info", "NCCL.BAD": "x",
               "PYTHONHASHSEED": "0"}
    files = (("/home/u/.deepspeed_env", "# cluster\nNCCL_SOCKET_IFNAME=eth0\n\nUCX_TLS = rc \n"),
             ("/w/.deepspeed_env", "NCCL_SOCKET_IFNAME=ib0\nMY_VAR=a=b\n"))
    assert list(forwarded_environment(environ, files, cwd="/w").items()) == [
        ("NCCL_IB_HCA", "mlx5"), ("PYTHONPATH", "/w:/lib"), ("UCX_TLS", "rc"), ("MLFLOW_RUN", "r"),
        ("MV2_X", "1"), ("ZEROSPEED_LOG", "info"), ("PYTHONHASHSEED", "0"), ("NCCL_SOCKET_IFNAME", "ib0"),
        ("MY_VAR", "a=b"),
    ]
    # no PYTHONPATH of our own: the launch folder alone, appended; AISC nodes set NCCL_IB_HCA themselves
    assert forwarded_environment({"AISC_JOB_NAME": "j", "NCCL_IB_HCA": "m", "NCCL_A": "1"}, (), cwd="/w") == {
        "NCCL_A": "1", "PYTHONPATH": "/w"}


def test_env_file_errors_name_file_and_line() -> None:
    with pytest.raises(LauncherError) as info:
        parse_env_file("A=1\nexport B C=2\n", source="/home/u/.deepspeed_env")
    assert str(info.value) == (
        "/home/u/.deepspeed_env:2: expected 'NAME=VALUE' (or 'export NAME=VALUE') with NAME made of letters, "
        "digits and '_' (not starting with a digit), got 'export B C=2'; fix the line or remove it")
    for garbage in ("NO_EQUALS_SIGN", "export NO_VALUE", "export 1A=2", "exportA B=1", "=1"):
        with pytest.raises(LauncherError, match=r"^f:1: expected 'NAME=VALUE'"):
            parse_env_file(garbage, source="f")


def test_env_file_lines_take_an_export_prefix_and_one_pair_of_matching_quotes() -> None:
    text = ("export NCCL_SOCKET_IFNAME=\"eth0\"\nexport\tUCX_TLS = 'rc' \nexport=1\nA=\"x\"y\"\n"
            "B='$HOME'\nC=\"$HOME\"\nD=\"unmatched'\nE=\"\nF=''\nG=\"a b\"\n")
    assert parse_env_lines(text, source="f") == (
        ("NCCL_SOCKET_IFNAME", "eth0", False), ("UCX_TLS", "rc", True), ("export", "1", False),
        ("A", 'x"y', False), ("B", "$HOME", True), ("C", "$HOME", False), ("D", "\"unmatched'", False),
        ("E", '"', False), ("F", "", True), ("G", "a b", False))
    assert parse_env_file("export NCCL_SOCKET_IFNAME='eth0'\n", source="f") == {"NCCL_SOCKET_IFNAME": "eth0"}


def test_only_env_file_values_are_marked_for_the_remote_shell_to_expand() -> None:
    environ = {"NCCL_DEBUG": "INFO", "NCCL_HOME": "/opt/$x", "LD_LIBRARY_PATH": "/host"}
    files = (("/h/.deepspeed_env", "LD_LIBRARY_PATH=/opt/nccl/lib:$LD_LIBRARY_PATH\nNCCL_DEBUG=WARN\n"
                                   "LITERAL=\"a\"\nLATER='$y'\n"),
             ("/w/.deepspeed_env", "export LATER=\"$z\"\nLITERAL='$q'\n"))
    exports = forwarded_environment(environ, files, cwd="/w")
    assert isinstance(exports, ForwardedEnvironment)
    assert dict(exports) == {"NCCL_DEBUG": "WARN", "NCCL_HOME": "/opt/$x", "PYTHONPATH": "/w",
                             "LD_LIBRARY_PATH": "/opt/nccl/lib:$LD_LIBRARY_PATH", "LITERAL": "$q", "LATER": "$z"}
    # a file's value replaces a forwarded one (NCCL_DEBUG) and is expanded; the last file decides the quoting
    assert exports.expand == {"LD_LIBRARY_PATH", "NCCL_DEBUG", "LATER"}
    assert forwarded_environment(environ, (), cwd="/w").expand == frozenset()


def test_env_file_paths_home_then_cwd_and_ds_env_file(tmp_path: Path) -> None:
    assert env_file_paths({}, home="/h", cwd="/w") == ("/h/.deepspeed_env", "/w/.deepspeed_env")
    assert env_file_paths({"DS_ENV_FILE": "job.env"}, home="/h", cwd="/w") == ("/h/job.env", "/w/job.env")
    assert env_file_paths({"DS_ENV_FILE": "/etc/job.env"}, home="/h", cwd="/w") == ("/etc/job.env",)
    assert env_file_paths({}, home="/w", cwd="/w") == ("/w/.deepspeed_env",)
    (tmp_path / ".deepspeed_env").write_text("A=1\n")
    assert read_env_files([str(tmp_path / "absent"), str(tmp_path / ".deepspeed_env")]) == (
        (str(tmp_path / ".deepspeed_env"), "A=1\n"),)


def test_commands_import_without_torch() -> None:
    code = ("import sys\nimport zerospeed.launcher.commands, zerospeed.launcher.environment, "
            "zerospeed.launcher.cli\nassert 'torch' not in sys.modules, 'torch'\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]


def test_an_srun_node_missing_from_the_hostfile_is_told_to_use_slurms_node_names() -> None:
    from zerospeed.launcher.job import node_rank_of

    spec = JobSpec("j", (("n1.cluster", (0,)), ("n2.cluster", (0,))), "n1.cluster", 29500, Program("t.py"))
    with pytest.raises(LauncherError) as info:
        node_rank_of(spec, host="n1", environ={"SLURMD_NODENAME": "n1"})
    assert str(info.value) == (
        "host 'n1' (this node's SLURMD_NODENAME) is not in this job's hosts (n1.cluster, n2.cluster); under "
        "--launcher slurm the hostfile must name each host exactly as Slurm does (the short node names of "
        "'sinfo -N -h -o %N'), not an FQDN or IP address")
    with pytest.raises(LauncherError, match=r"^host 'n3' is not in this job's hosts \(n1.cluster, n2.cluster\)$"):
        node_rank_of(spec, host="n3", environ={})
