"""examples/infinity: the ZeRO-Infinity example at a small size, against the same run in memory.

The script runs in a subprocess as a user would (``--json`` for its numbers): with parameters and
optimizer states on NVMe it must give exactly the in-memory run's losses (same model, data and
optimizer; only where the state lives differs), move bytes through the swap files in every phase
that should, and leave no swap file behind. The sizing and the memory verdict are checked in-process.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "infinity"
SMALL = ["--params", "2e6", "--vocab", "512", "--seq-len", "16", "--steps", "3", "--quiet"]


@pytest.fixture(scope="module")
def train_module() -> Any:
    """examples/infinity/train.py imported under a name of its own (it adds its folder to sys.path)."""
    spec = importlib.util.spec_from_file_location("infinity_train", EXAMPLE / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _start(args: list[str], out: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(EXAMPLE / "train.py"), *SMALL, *args, "--json", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(run: subprocess.Popen[str], out: Path, code: int = 0) -> tuple[str, dict[str, Any]]:
    stdout, stderr = run.communicate(timeout=120)
    assert run.returncode == code, stdout + stderr
    return stdout, json.loads(out.read_text())


def test_nvme_run_equals_in_memory_run(tmp_path: Path) -> None:
    swap = tmp_path / "swap"  # does not exist yet: the script makes it, and removes it when empty
    # both at once (they share nothing but the disk): half the wall time on two cores
    runs = {name: _start(args, tmp_path / f"{name}.json")
            for name, args in (("nvme", ["--nvme-path", str(swap)]), ("memory", ["--in-memory"]))}
    nvme_out, nvme = _finish(runs["nvme"], tmp_path / "nvme.json")
    _, memory = _finish(runs["memory"], tmp_path / "memory.json")

    assert nvme["mode"] == "nvme" and memory["mode"] == "in-memory"
    assert nvme["losses"] == memory["losses"]  # bit for bit: the NVMe tier only moves bytes
    assert len(nvme["losses"]) == 3 and nvme["losses"][-1] < nvme["losses"][0] - 0.5  # it trains
    assert not swap.exists(), list(swap.iterdir())

    params = nvme["params"]
    assert params == memory["params"] and 1.5e6 < params < 4e6
    assert nvme["training_state_bytes"] == 16 * params
    assert nvme["state_to_ram"] == pytest.approx(16 * params / nvme["ram_bytes"])
    assert 0 < nvme["peak_rss_bytes"] < nvme["ram_bytes"] / 2
    assert len(nvme["step_seconds"]) == 3 and all(t > 0 for t in nvme["step_seconds"])
    # parameters stream in for forward; the step reads and writes the optimizer states and parameters
    for step in nvme["phases"]:
        assert step["forward"]["bytes_read"] > 0, step
        opt = step["optimizer (read/update/write)"]
        assert opt["bytes_read"] > 12 * params * 0.9 and opt["bytes_written"] > 12 * params * 0.9, step
    assert all(b > 0 for b in nvme["bytes_read_per_step"] + nvme["bytes_written_per_step"])
    assert all(0 <= w <= 1 for w in nvme["io_wait_share_per_step"])
    assert nvme["memory_breakdown"]["on_nvme"] > 12 * params * 0.9
    # activation checkpointing: each block ran checkpointed in every forward and was recomputed in backward
    assert nvme["checkpointed_forwards"] == nvme["recomputed_blocks"] == 3 * nvme["shape"]["n_layers"]

    assert memory["bytes_read_per_step"] == [0, 0, 0] and memory["bytes_written_per_step"] == [0, 0, 0]
    assert memory["memory_breakdown"]["on_nvme"] == 0
    assert "summary" in nvme_out and "I/O-wait share" in nvme_out
    assert nvme_out.rstrip().endswith("result               OK")


def test_check_memory_fails_a_run_that_fits_in_ram(tmp_path: Path) -> None:
    out = tmp_path / "small.json"
    stdout, summary = _finish(_start(["--steps", "1", "--check-memory", "--in-memory"], out), out, code=1)
    assert "FAILED: the training state is only 0.00 x RAM" in stdout
    assert len(summary["problems"]) == 1 and summary["problems"][0].startswith("the training state is only 0.00 x RAM")


def test_default_shape_is_the_2_5b_gpt(train_module: Any) -> None:
    shape = train_module.shape_for(2.5e9, 8192, 64)
    assert (shape.d_model, shape.n_layers, shape.n_heads) == (2560, 32, 20)
    with torch.device("meta"):  # the formula is the model's exact count (nothing allocated)
        model = train_module.InfinityGPT(shape)
    assert sum(p.numel() for p in model.parameters()) == shape.num_params()
    assert 2.5e9 <= shape.num_params() < 2.6e9


def test_user_errors_name_the_argument(train_module: Any) -> None:
    with pytest.raises(ValueError, match=r"--params -1: the parameter budget must be positive"):
        train_module.shape_for(-1, 8192, 64)
    with pytest.raises(SystemExit, match=r"--in-memory with --params 1e\+13: the training state .* "
                                         r"does not fit in RAM .*; drop --in-memory"):
        train_module.main(["--params", "1e13", "--in-memory"])


def test_memory_verdict(train_module: Any) -> None:
    gib = 2 ** 30
    good = {"peak_rss_bytes": 4 * gib, "ram_bytes": 24 * gib, "peak_rss_share_of_ram": 4 / 24, "state_to_ram": 1.6}
    assert train_module.memory_verdict(good) == []
    bad = good | {"peak_rss_bytes": 12 * gib, "peak_rss_share_of_ram": 0.5, "state_to_ram": 1.2}
    problems = train_module.memory_verdict(bad)
    assert problems[0] == "peak RSS 12.00 GiB is not below half of RAM (12.00 GiB)"
    assert problems[1].startswith("the training state is only 1.20 x RAM")
