"""Smoke run of ``benchmarks/bench_inference.py --quick``: for a small Llama, the ``hf`` and ``fused`` sides each
report prefill and decode throughput, and the fused side's greedy tokens equal Hugging Face's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_inference.py"


def test_bench_inference_quick_reports_both_sides_and_equal_tokens() -> None:
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, str(BENCH), "--quick", "--models", "llama", "--dtypes", "fp32",
                          "--batches", "2", "--threads", "1"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "llama fp32 batch 2: prompt 32, 8 new tokens, 1 rounds" in out.stdout, out.stdout
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line.startswith(("hf ", "fused "))}
    assert set(rows) == {"hf", "fused"}, out.stdout
    for side, cells in rows.items():  # ttft ms, prefill tok/s, decode ms/tok, decode tok/s > 0
        assert all(float(x) > 0 for x in cells[1:5]), (side, out.stdout)
    assert rows["hf"][-1] == "equal" and rows["fused"][-1] == "equal", out.stdout
