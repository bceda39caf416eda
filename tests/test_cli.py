"""The ``zerospeed`` command's own surface: help that lists the subcommands, ``--version``, subcommands that
parse their arguments (``report --help`` does not run the report), help texts without markup and with their
defaults, usage errors answered before torch is imported, and a directory given as the script."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import zerospeed
from zerospeed.launcher.cli import main, plan_from_args, subcommands
from zerospeed.launcher.plan import Program

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _wide_help(monkeypatch: pytest.MonkeyPatch) -> None:
    """argparse wraps help at the terminal's width: a fixed, wide one makes the lines exact."""
    monkeypatch.setenv("COLUMNS", "200")


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The help a subcommand prints (argparse exits 0 after it)."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: zerospeed [options] script [script args ...]\n"
                          "       zerospeed {convert,report,plot,plan} ...\n")
    table = out[out.index("subcommands (zerospeed <subcommand> --help for each):\n"):].split("\n\n")[0]
    assert table.splitlines()[1:] == [
        "  convert   a checkpoint (any world size, ZeRO stage) to safetensors",
        "  report    what this installation runs: versions, backend, kernels",
        "  plot      a CSV monitor run's loss, lr, throughput and memory as a PNG",
        "  plan      a config's per-rank peak memory, before running it",
    ]
    assert [line.split()[0] for line in table.splitlines()[1:]] == list(subcommands())
    assert "  --version             print zerospeed's, torch's and Python's versions and exit\n" in out


def test_version_names_zerospeed_torch_and_python(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    torch_version = importlib.metadata.version("torch")
    assert capsys.readouterr().out == (f"zerospeed {zerospeed.__version__} (torch {torch_version}, "
                                       f"Python {platform.python_version()})\n")
    import torch

    assert torch.__version__ == torch_version  # the metadata read instead of importing torch is torch's own


def test_report_help_does_not_run_the_report(capsys: pytest.CaptureFixture[str]) -> None:
    out = _help(["report", "--help"], capsys)
    assert out.startswith("usage: zerospeed report [-h]\n\nPrint what this installation runs: ")
    assert not [line for line in out.splitlines() if line.startswith(("zerospeed 0", "accelerator: ", "CPU "))]


def test_report_refuses_unknown_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["report", "--bogus"])
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "usage: zerospeed report [-h]\nzerospeed report: error: unrecognized arguments: --bogus\n"


def test_convert_help_gives_dtype_and_shard_size_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    out = _help(["convert", "--help"], capsys)
    text = " ".join(out.split())  # an option's help may start on the line after the option
    assert ("--dtype {fp32,bf16,fp16} dtype of the floating-point tensors written (default: fp32, the master "
            "weights unrounded; integer buffers keep their dtype) --max_shard_size") in text
    assert "--max_shard_size MAX_SHARD_SIZE largest output file, e.g. 5GB or 500MB (default: 5GB)" in text


def test_plot_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    out = _help(["plot", "--help"], capsys)
    assert "``" not in out and ":func:" not in out
    assert out.startswith("usage: zerospeed plot [-h] [-o OUT] RUN_DIR\n\nDraw a run's loss, learning rate, "
                          "throughput and memory over global_samples into one PNG, from the files of a CSV monitor "
                          "(the \"csv_monitor\" config section). Prints the PNG's path.\n")


# Each is refused with exit code 2 (or answered with 0) and torch still not imported.
_NO_TORCH = textwrap.dedent("""
    import os, socket, sys, tempfile
    from zerospeed.launcher.cli import main
    from zerospeed.plan.cli import plan_main

    work = tempfile.mkdtemp()
    script = os.path.join(work, "train.py")
    open(script, "w").close()
    two_hosts = os.path.join(work, "hosts")
    with open(two_hosts, "w") as f:
        f.write("worker-0 slots=2\\nworker-1 slots=2\\n")
    bad_hosts = os.path.join(work, "bad")
    with open(bad_hosts, "w") as f:
        f.write("worker-0 slots=x\\n")
    cases = [
        (["--num_procs", "0", script], 2),
        (["--num_gpus", "-1", script], 2),
        (["--num_nodes", "0", script], 2),
        (["--num_nodes", "2", script], 2),
        (["--master_port", "70000", script], 2),
        (["--include", "localhost:0", "--num_procs", "1", script], 2),
        (["--bogus", script], 2),
        ([], 2),
        ([os.path.join(work, "missing.py")], 2),
        ([work], 2),
        (["-H", bad_hosts, script], 2),
        (["-H", two_hosts, "--master_port", "0", script], 2),  # several hosts cannot share a free port
        (["-H", two_hosts, "--include", "worker-0:5", script], 2),
        # a malformed or impossible filter without a hostfile or --num_procs (this machine's pool is
        # sized by the CUDA count): refused before the count
        (["--include", "localhost:x", script], 2),
        (["--exclude", "worker-0", script], 2),
        (["--exclude", "localhost", script], 2),
        (["--help"], 0),
        (["--version"], 0),
    ]
    for argv, code in cases:
        got = main(argv)
        assert got == code, (argv, got)
        assert "torch" not in sys.modules, argv
    with socket.socket() as busy:  # a --master_port in use: refused before the runner imports torch
        busy.bind(("", 0))
        busy.listen()
        argv = ["--num_procs", "1", "--master_port", str(busy.getsockname()[1]), script]
        assert main(argv) == 2, argv
        assert "torch" not in sys.modules, argv
    assert plan_main(["c.json", "--model", "m:f", "--world-size", "0"]) == 2
    try:
        plan_main(["--help"])
    except SystemExit as exc:
        assert exc.code == 0
    assert "torch" not in sys.modules, "plan"
    print("no torch")
""")


def test_usage_errors_are_answered_before_torch_is_imported() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _NO_TORCH], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.endswith("no torch\n")
    errors = [line for line in done.stderr.splitlines() if line.startswith("zerospeed: error: ")]
    assert len(errors) == 17, done.stderr
    assert "zerospeed: error: --num_procs/--num_gpus must be at least 1, got 0" in errors
    assert errors[-4:-1] == [
        "zerospeed: error: --include 'localhost:x': slot 'x' on host 'localhost' is not a non-negative integer",
        "zerospeed: error: --exclude 'worker-0': unknown host 'worker-0'; available hosts: localhost",
        "zerospeed: error: --exclude 'localhost' removes every slot on every host; nothing is left to run on",
    ]
    assert re.fullmatch(r"zerospeed: error: --master_port \d+ is already in use on this machine; pass another "
                        r"port, --master_port 0 for any free port, or omit it", errors[-1]), errors[-1]


def test_a_plan_with_its_rank_count_given_needs_no_torch() -> None:
    code = ("import sys\nfrom zerospeed.launcher.cli import plan_from_args\n"
            "plan = plan_from_args(['--num_procs', '3', '--master_port', '0', '-m', 'pkg.train'], environ={})\n"
            "assert plan.nproc_per_node == 3 and 'torch' not in sys.modules\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]


def test_packages_load_their_names_on_use_through_one_helper() -> None:
    """``zerospeed`` and ``zerospeed.distributed`` share ``_lazy_submodules.lazy_attributes`` (a refactor:
    the behaviour is the one the launcher's torch-free imports rely on)."""
    import zerospeed.distributed as distributed
    from zerospeed.distributed.comm import Comm

    assert dir(zerospeed) == sorted(zerospeed.__all__) and dir(distributed) == sorted(distributed.__all__)
    assert distributed.Comm is Comm and zerospeed.Comm is Comm
    assert zerospeed.zero is importlib.import_module("zerospeed.zero")
    for package, name in ((zerospeed, "zerospeed"), (distributed, "zerospeed.distributed")):
        with pytest.raises(AttributeError) as info:
            getattr(package, "no_such_name")
        assert str(info.value) == f"module {name!r} has no attribute 'no_such_name'"


def test_the_request_is_checked_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher checks the request before it may import torch; the plan it then resolves (twice when
    --include picks devices from a hostfile) does not check it again."""
    from zerospeed.launcher import cli, plan

    checked: list[object] = []
    real = plan.check_request

    def counting(request: plan.LaunchRequest) -> None:
        checked.append(request)
        real(request)

    monkeypatch.setattr(cli, "check_request", counting)
    monkeypatch.setattr(plan, "check_request", counting)
    hosts, script = tmp_path / "hosts", tmp_path / "train.py"
    hosts.write_text("localhost slots=2\n")
    script.touch()
    resolved = plan_from_args(["-H", str(hosts), "--include", "localhost:1", str(script)], environ={})
    assert dict(resolved.resources) == {"localhost": (1,)} and len(checked) == 1


def test_a_directory_as_the_script_names_the_scripts_inside(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("train.py", "eval.py", "_private.py", "notes.txt"):
        (tmp_path / name).touch()
    assert main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"zerospeed: error: script '{tmp_path}' is a directory, not a file (and has no __main__.py); pass one of "
        f"the scripts inside it: '{tmp_path / 'eval.py'}', '{tmp_path / 'train.py'}', or run a package with "
        f"--module\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(empty)]) == 2
    assert capsys.readouterr().err == (
        f"zerospeed: error: script '{empty}' is a directory, not a file (and has no __main__.py); pass the .py "
        f"file to run, or run a package with --module\n")


def test_a_directory_with_a_main_runs_as_python_runs_it(tmp_path: Path) -> None:
    (tmp_path / "__main__.py").touch()
    plan = plan_from_args(["--num_procs", "1", str(tmp_path), "--x"], environ={})
    assert plan.program == Program(script=str(tmp_path), args=("--x",))
