"""Launcher logic without launching: argv splitting, plan resolution, worker commands, ports, and
the CLI's user-error path (one line on stderr, exit code 2)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from zerospeed.launcher import (
    LauncherError,
    LaunchRequest,
    Program,
    resolve_plan,
)
from zerospeed.launcher.cli import main, plan_from_args, split_script, subcommands
from zerospeed.launcher.runners import choose_master_port, local_command, port_is_free

SCRIPT = Program(script="train.py")


@pytest.fixture()
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


@pytest.fixture()
def held_port() -> Iterator[int]:
    """A port some other process is listening on, for the duration of the test."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        sock.listen(1)
        yield int(sock.getsockname()[1])


# --- argv splitting ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--num_procs", "3", "s.py", "--foo", "bar", "--num_procs", "9", "x.json"],
            (["--num_procs", "3"], "s.py", ["--foo", "bar", "--num_procs", "9", "x.json"]),
        ),
        (["--num_procs=3", "s.py", "--", "-h"], (["--num_procs=3"], "s.py", ["--", "-h"])),
        (["-m", "--append_local_rank", "pkg.mod", "-m"],
         (["-m", "--append_local_rank"], "pkg.mod", ["-m"])),
        (["-H", "hosts", "-i", "localhost:0", "s.py"],
         (["-H", "hosts", "-i", "localhost:0"], "s.py", [])),
        (["--", "-weird.py", "a"], (["--"], "-weird.py", ["a"])),
        (["--num_procs", "2"], (["--num_procs", "2"], None, [])),
        (["--num_procs"], (["--num_procs"], None, [])),
        ([], ([], None, [])),
    ],
)
def test_split_script(argv: list[str], expected: tuple[list[str], str | None, list[str]]) -> None:
    assert split_script(argv) == expected


def test_plan_from_args_keeps_script_args_verbatim(script: str) -> None:
    args = ["--", "--foo", "bar", "--num_procs", "9", "--deepspeed_config", "x.json", "-h", "$$x"]
    plan = plan_from_args(["--num_procs", "3", "--master_port", "0", script, *args], environ={})
    assert plan.program == Program(script=script, args=tuple(args))
    assert dict(plan.resources) == {"localhost": (0, 1, 2)}
    assert plan.nproc_per_node == 3
    assert plan.master_port == 0
    assert plan.master_addr == "127.0.0.1"
    assert plan.visible_devices is None


def test_num_gpus_is_num_procs_and_defaults(script: str) -> None:
    assert plan_from_args(["--num_gpus", "2", script], environ={}).nproc_per_node == 2
    default = plan_from_args([script], environ={})
    assert default.master_port is None
    assert default.program.append_local_rank is False


# --- resolve_plan -----------------------------------------------------------------------------


def _resolve(hosts: dict[str, int] | None = None, **request: object):
    return resolve_plan(
        LaunchRequest(program=SCRIPT, **request),  # type: ignore[arg-type]
        hostfile_resources=hosts,
        default_local_slots=1,
    )


def test_resolve_local_defaults() -> None:
    assert dict(_resolve().resources) == {"localhost": (0,)}
    assert dict(_resolve(num_procs=4).resources) == {"localhost": (0, 1, 2, 3)}
    assert dict(_resolve(num_procs=2, num_nodes=1).resources) == {"localhost": (0, 1)}


def test_resolve_hostfile_single_host() -> None:
    hosts = {"worker-0": 4}
    assert dict(_resolve(hosts).resources) == {"worker-0": (0, 1, 2, 3)}
    assert dict(_resolve(hosts, num_procs=2).resources) == {"worker-0": (0, 1)}
    assert dict(_resolve(hosts, include="worker-0:1,3").resources) == {"worker-0": (1, 3)}


def test_resolve_num_nodes_takes_first_hosts() -> None:
    plan = _resolve({"b": 2, "a": 3}, num_nodes=1)
    assert dict(plan.resources) == {"b": (0, 1)}
    plan = _resolve({"b": 2, "a": 3}, include="a:2")
    assert dict(plan.resources) == {"a": (2,)}


@pytest.mark.parametrize(
    ("hostfile", "request_", "message"),
    [
        (None, {"num_procs": 0}, "--num_procs/--num_gpus must be at least 1, got 0"),
        (None, {"num_nodes": 0}, "--num_nodes must be at least 1, got 0"),
        (None, {"master_port": 70000},
         "--master_port must be in 0..65535 (0 = pick a free port), got 70000"),
        (None, {"num_procs": 2, "include": "localhost:0"},
         "--num_procs/--num_gpus/--num_nodes cannot be combined with --include/--exclude; "
         "select slots with one or the other"),
        ({"w": 2}, {"num_procs": 3},
         "--num_procs/--num_gpus 3 exceeds the 2 slots of host 'w' in the hostfile; lower it or "
         "raise that host's slots="),
    ],
)
def test_resolve_errors(hostfile: dict[str, int] | None, request_: dict[str, object],
                        message: str) -> None:
    with pytest.raises(LauncherError) as info:
        _resolve(hostfile, **request_)
    assert str(info.value) == message


def test_several_hosts_make_a_multi_node_plan_and_num_nodes_needs_a_hostfile() -> None:
    plan = _resolve({"worker-0": 2, "worker-1": 2}, hostfile="hosts")
    assert (dict(plan.resources), plan.multi_node) == ({"worker-0": (0, 1), "worker-1": (0, 1)}, True)
    assert (plan.master_addr, plan.master_port) == ("worker-0", 29500)
    with pytest.raises(LauncherError) as info:
        _resolve(num_nodes=2)
    assert str(info.value) == (
        "--num_nodes 2 needs a hostfile listing the hosts (-H/--hostfile; /job/hostfile when it exists); "
        "without one zerospeed runs on this machine only"
    )


def test_visible_devices_only_with_cuda_and_a_filter() -> None:
    def resolve(include: str | None, cuda: bool, inherited: str | None = None):
        return resolve_plan(
            LaunchRequest(program=SCRIPT, include=include),
            hostfile_resources=None,
            default_local_slots=4,
            cuda_available=cuda,
            inherited_visible_devices=inherited,
        ).visible_devices

    assert resolve("localhost:1,3", cuda=True) == ("1", "3")
    assert resolve("localhost:1,3", cuda=True, inherited="4,5,6,7") == ("5", "7")
    assert resolve("localhost:1,3", cuda=False) is None
    assert resolve(None, cuda=True) is None


def test_module_and_no_python_conflict() -> None:
    with pytest.raises(LauncherError, match="--module and --no_python cannot be used together"):
        Program(script="x", module=True, no_python=True)


# --- worker command ---------------------------------------------------------------------------


def test_local_command_python_script() -> None:
    program = Program(script="t.py", args=("--a", "$x", "${local_rank}", "$$"))
    entry, args = local_command(program, python="py")
    assert entry == "py"
    # '$' is doubled because torch's agent applies string.Template to every argument.
    assert args == ["-u", "t.py", "--a", "$$x", "$${local_rank}", "$$$$"]


def test_local_command_variants() -> None:
    assert local_command(Program(script="pkg.mod", module=True), python="py") == (
        "py", ["-u", "-m", "pkg.mod"])
    assert local_command(Program(script="./run.sh", args=("a",), no_python=True)) == (
        "./run.sh", ["a"])
    assert local_command(Program(script="t.py", args=("a",), append_local_rank=True), "py") == (
        "py", ["-u", "t.py", "a", "--local_rank=${local_rank}"])


# --- ports ------------------------------------------------------------------------------------


def test_choose_master_port(held_port: int) -> None:
    assert not port_is_free(held_port)
    free = choose_master_port(0)
    assert free > 0 and port_is_free(free)
    # Unspecified: the default when free, otherwise some free port (with a note).
    assert choose_master_port(None, default=free) == free
    fallback = choose_master_port(None, default=held_port)
    assert fallback not in (0, held_port)
    with pytest.raises(LauncherError) as info:
        choose_master_port(held_port)
    assert str(info.value) == (
        f"--master_port {held_port} is already in use on this machine; pass another port, "
        "--master_port 0 for any free port, or omit it"
    )


# --- CLI user errors: one line, exit code 2 ---------------------------------------------------


def _run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["missing_script.py"], "zerospeed: error: script 'missing_script.py' not found\n"),
        (["train"], "zerospeed: error: script 'train' not found (did you mean --module?)\n"),
        (["--no_python", "no-such-exe-zs"],
         "zerospeed: error: executable 'no-such-exe-zs' not found (with --no_python)\n"),
        (["--num_procs", "x", "s.py"],
         "zerospeed: error: argument --num_procs/--num-procs/--nproc_per_node/--nproc-per-node: "
         "invalid int value: 'x' (see 'zerospeed --help')\n"),
        (["--include", "localhost:0", "--exclude", "localhost:1", "s.py"],
         "zerospeed: error: argument -e/--exclude: not allowed with argument -i/--include "
         "(see 'zerospeed --help')\n"),
        (["--bogus", "s.py"],
         "zerospeed: error: unrecognized arguments: --bogus (see 'zerospeed --help')\n"),
        ([], "zerospeed: error: missing the script to run; usage: zerospeed [options] script.py "
         "[args]\n"),
    ],
)
def test_cli_usage_errors(argv: list[str], message: str,
                          capsys: pytest.CaptureFixture[str]) -> None:
    assert _run_main(argv, capsys) == (2, message)


def test_cli_bad_hostfile(tmp_path: Path, script: str, capsys: pytest.CaptureFixture[str]) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("worker-0 slots=2\nworker-0 slots=2\n")
    code, err = _run_main(["--hostfile", str(hosts), script], capsys)
    assert code == 2
    assert err == (
        f"zerospeed: error: {hosts}:2: host 'worker-0' is listed twice (first on line 1); "
        "keep one line per host with its total slot count\n"
    )


def test_cli_bad_include_and_multi_node(tmp_path: Path, script: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("worker-0 slots=2\nworker-1 slots=2\n")
    code, err = _run_main(["-H", str(hosts), "--include", "worker-0:5", script], capsys)
    assert (code, err.count("\n")) == (2, 1)
    assert "slot 5 on host 'worker-0' is out of range" in err
    code, err = _run_main(["-H", str(hosts), "--master_port", "0", script], capsys)
    assert (code, err.count("\n")) == (2, 1)
    assert err.startswith("zerospeed: error: --master_port 0 (any free port) only works on one machine")


def test_cli_busy_master_port(script: str, held_port: int,
                              capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _run_main(["--master_port", str(held_port), script], capsys)
    assert code == 2
    assert err.startswith(f"zerospeed: error: --master_port {held_port} is already in use")


def test_cli_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "--append_local_rank" in capsys.readouterr().out


def test_subcommand_table_is_read_only() -> None:
    table = subcommands()
    with pytest.raises(TypeError):
        table["x"] = lambda argv: 0  # type: ignore[index]


def test_module_script_is_not_checked_on_disk() -> None:
    plan = plan_from_args(["-m", "some.module", "a"], environ={})
    assert plan.program == Program(script="some.module", args=("a",), module=True)


def test_no_python_accepts_executables_on_path() -> None:
    plan = plan_from_args(["--no_python", "true", "x"], environ={})
    assert plan.program == Program(script="true", args=("x",), no_python=True)


# --- failure summary --------------------------------------------------------------------------


def test_failure_summary_names_root_cause_and_maps_signals(tmp_path: Path) -> None:
    import io
    import signal

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from zerospeed.launcher.runners import _report_failure

    def failure(local_rank: int, exitcode: int, timestamp: int) -> ProcessFailure:
        item = ProcessFailure(local_rank=local_rank, pid=100 + local_rank, exitcode=exitcode,
                              error_file=str(tmp_path / "absent.json"))
        item.timestamp = timestamp
        return item

    failures = {
        0: failure(0, -int(signal.SIGTERM), 20),
        1: failure(1, -int(signal.SIGABRT), 10),
        2: failure(2, 5, 30),
        3: failure(3, -int(signal.SIGTERM), 20),
    }
    log = io.StringIO()
    assert _report_failure(ChildFailedError("job", failures), log) == 128 + int(signal.SIGABRT)
    assert log.getvalue() == (
        "zerospeed: rank 1 (local_rank 1, pid 101) was killed by SIGABRT; see its output above\n"
        "zerospeed: rank 2 also exited with code 5\n"
        "zerospeed: stopped the remaining rank(s) 0, 3\n"
    )


def test_no_python_executable_is_not_escaped_but_its_arguments_are() -> None:
    assert local_command(Program(script="./a$b.sh", args=("$x",), no_python=True)) == ("./a$b.sh", ["$$x"])
