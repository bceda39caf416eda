"""Smoke run of ``benchmarks/bench_moe.py --quick``: the zerospeed MoE layer (dropless and capacity-based) and the
naive per-expert loop each report a throughput, and the first forward of zerospeed and the naive loop agree (the
DeepSpeed sides need /tmp/dsvenv and are left out)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_moe.py"


def test_bench_moe_quick_runs_every_side() -> None:
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, str(BENCH), "--quick", "--no-deepspeed", "--train-steps", "10"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    for k in (1, 2):
        for side in (f"zs-dropless-k{k}", f"zs-cap1.0-k{k}", f"zs-cap1.25-k{k}", f"naive-k{k}"):
            rows = [line.split() for line in lines if line.startswith(side + " ")]
            assert rows and float(rows[0][1]) > 0, out.stdout
        assert f"check k={k}: outputs agree" in lines, out.stdout
        assert f"ratio zs-dropless-k{k} / naive-k{k}: " in out.stdout, out.stdout
    assert not any(line.startswith("ds-") for line in lines), out.stdout
    assert "k=1: dropless train mse" in out.stdout, out.stdout
