"""Smoke run of ``benchmarks/bench_pipe.py --quick``: every zerospeed schedule and the torch.distributed.pipelining
sides train the tiny model on 4 ranks and report a throughput and a ratio (the DeepSpeed side needs /tmp/dsvenv and
is left out)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_pipe.py"


def test_bench_pipe_quick_runs_every_side() -> None:
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, str(BENCH), "--quick", "--no-deepspeed"], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    for side in ("zs-1f1b", "zs-gpipe", "zs-interleaved", "zs-zb_h1", "torch-1f1b", "torch-gpipe"):
        assert any(line.startswith(side + " ") for line in out.stdout.splitlines()), out.stdout
    for side in ("zs-1f1b", "zs-gpipe", "zs-interleaved", "zs-zb_h1"):
        assert f"ratio {side}: " in out.stdout, out.stdout
    losses = {line.split()[-1] for line in out.stdout.splitlines() if line.startswith(("zs-", "torch-"))}
    assert len(losses) == 1, f"the sides start from different weights: first losses {losses}"
