"""End-to-end: ``python -m zerospeed`` starting real ranks on this machine.

Each test runs the launcher as a subprocess with a hard timeout; ranks report back by writing JSON
files into a temporary directory named by $ZS_TEST_OUT (an env var, so script argv stays exactly
what the test passed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zerospeed.testing import free_port

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "launcher_scripts"
# Upper bound for one launcher run; well above the few seconds a healthy run takes.
RUN_TIMEOUT_S = 60


def _env(out_dir: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO / "src"), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["ZS_TEST_OUT"] = str(out_dir)
    env.pop("OMP_NUM_THREADS", None)
    env.update(extra)
    return env


def _launch(args: list[str], env: dict[str, str],
            timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run the launcher; on timeout stop it with SIGTERM (its agent then stops the ranks) and fail."""
    cmd = [sys.executable, "-m", "zerospeed", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"launcher did not finish within {timeout}s\nstdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _records(out_dir: Path, world: int) -> list[dict]:
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world)]


def _check_ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"


USER_ARGS = ["--foo", "bar", "--num_procs", "9", "x.json"]


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_three_ranks_get_env_and_untouched_argv(tmp_path: Path) -> None:
    port = free_port()
    result = _launch(["--num_procs", "3", "--master_port", str(port),
                      "tests/launcher_scripts/record_env.py", *USER_ARGS], _env(tmp_path))
    _check_ok(result)
    for rank, record in enumerate(_records(tmp_path, 3)):
        assert record["env"] == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "3",
            "LOCAL_WORLD_SIZE": "3",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        assert record["argv"] == USER_ARGS


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_append_local_rank_and_free_port(tmp_path: Path) -> None:
    args = [*USER_ARGS, "--", "$HOME", "${local_rank}", "$$"]
    result = _launch(["--num_gpus", "3", "--master_port", "0", "--append_local_rank",
                      "tests/launcher_scripts/record_env.py", *args],
                     _env(tmp_path, OMP_NUM_THREADS="2"))
    _check_ok(result)
    records = _records(tmp_path, 3)
    ports = {record["env"]["MASTER_PORT"] for record in records}
    assert len(ports) == 1 and int(ports.pop()) > 0
    for rank, record in enumerate(records):
        assert record["argv"] == [*args, f"--local_rank={rank}"]
        assert record["env"]["OMP_NUM_THREADS"] == "2"  # a user's setting wins


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_module_mode(tmp_path: Path) -> None:
    env = _env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), env["PYTHONPATH"]])
    result = _launch(["--num_procs", "2", "--master_port", str(free_port()), "--module",
                      "record_env", "-m", "x"], env)
    _check_ok(result)
    records = _records(tmp_path, 2)
    assert [r["name"] for r in records] == ["__main__", "__main__"]
    assert [r["argv"] for r in records] == [["-m", "x"], ["-m", "x"]]
    assert [r["env"]["WORLD_SIZE"] for r in records] == ["2", "2"]


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_failing_rank_stops_the_job_with_its_traceback(tmp_path: Path) -> None:
    start = time.monotonic()
    result = _launch(["--num_procs", "3", "--master_port", str(free_port()),
                      "tests/launcher_scripts/fail_rank1.py"], _env(tmp_path), timeout=30)
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert elapsed < 30
    assert "Traceback (most recent call last)" in output
    assert "ValueError: boom from rank 1" in output
    assert "zerospeed: rank 1 (local_rank 1" in result.stderr
    assert "stopped the remaining rank(s) 0, 2" in result.stderr


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_exit_code_of_failed_rank_is_returned(tmp_path: Path) -> None:
    result = _launch(["--num_procs", "2", "--master_port", str(free_port()),
                      "tests/launcher_scripts/exit_code.py"], _env(tmp_path, ZS_EXIT_CODE="3"))
    assert result.returncode == 3, result.stderr
    assert "zerospeed: rank 1 (local_rank 1" in result.stderr
    assert "exited with code 3" in result.stderr


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_ranks_form_a_gloo_group(tmp_path: Path) -> None:
    result = _launch(["--num_procs", "3", "--master_port", str(free_port()),
                      "tests/launcher_scripts/gloo_allreduce.py"], _env(tmp_path))
    _check_ok(result)
    assert _records(tmp_path, 3) == [
        {"rank": rank, "world_size": 3, "sum": 6.0} for rank in range(3)
    ]


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_user_error_is_one_line_exit_2_without_traceback(tmp_path: Path) -> None:
    result = _launch(["--num_procs", "2", "no_such_script.py", "--x"], _env(tmp_path))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == "zerospeed: error: script 'no_such_script.py' not found\n"
