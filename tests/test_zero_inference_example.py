"""examples/zero_inference at a small size, run as a user would (a subprocess, ``--json`` for its numbers).

The parity instance (fewer layers, same width) must give the in-memory run's tokens, every decode
step must read the weights (about) once, nothing may stay in the swap directory, and a run whose weights
do not fit the disk is refused before anything is built, naming the option and the sizes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "zero_inference" / "generate.py"
SMALL = ["--layers", "3", "--hidden", "384", "--intermediate", "768", "--heads", "4", "--vocab", "512",
         "--new-tokens", "4", "--check-layers", "2", "--read-sample-gb", "0.01", "--quiet"]


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent / "src"))
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=240,
                          env=env)


def test_small_run_matches_in_memory_and_cleans_up(tmp_path: Path) -> None:
    swap, out = tmp_path / "swap", tmp_path / "out.json"
    run = _run([*SMALL, "--nvme-path", str(swap), "--json", str(out)])
    assert run.returncode == 0, run.stdout + run.stderr
    summary = json.loads(out.read_text())
    assert summary["parity"]["equal"] and summary["parity"]["layers"] == 2
    assert len(summary["tokens"]) == 4 and summary["problems"] == []
    # every weight is on disk but the norms (below stage3_param_persistence_threshold: kept in memory)
    model_bytes = summary["bytes_read_per_token"]
    assert 0.99 * summary["weights_bytes"] < model_bytes < summary["weights_bytes"]
    assert all(step["bytes_read"] >= model_bytes for step in summary["per_forward"][1:])
    assert summary["prefetch"]["prefetched"] > 0 and summary["disk_read_rate"] > 0
    assert "result               OK" in run.stdout
    assert not swap.exists()  # made by the run, emptied and removed


def test_refuses_when_the_disk_is_too_small(tmp_path: Path) -> None:
    run = _run(["--layers", "100000", "--nvme-path", str(tmp_path), "--quiet"])
    assert run.returncode != 0
    assert f"--nvme-path {tmp_path}: the swap files need about" in run.stderr
    assert "free there; free space, point --nvme-path at a larger disk, or lower --layers" in run.stderr
    assert list(tmp_path.iterdir()) == []
