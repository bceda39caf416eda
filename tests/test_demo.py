"""The demo trains its GPT on 2 ranks through the launcher, prints its summary, and the loss falls; its CSV
monitor files and training picture are written, the picture's loss curve being the printed losses."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_short_run_learns(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", "zerospeed", "--num_procs", "2", "--master_port", "0",
         str(ROOT / "examples" / "demo.py"), "--steps", "16", "--corpus_bytes", "300000",
         "--val_windows", "16", "--sample_tokens", "16", "--monitor_dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=240,
    )
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "2 ranks, bf16" in out
    assert "batch 16 x 64 tokens = micro 4 x accumulation 2 x world 2" in out
    for line in ("tokens/s", "peak memory          rank 0:", "rank 1:", "ZeRO stage 0)", "optimizer.type = \"AdamW\"",
                 "scheduler.type = \"WarmupCosineLR\"", "scheduler.params.total_num_steps = 16",
                 "bf16.enabled = true", "sample ", "OK: the loss fell"):
        assert line in out, line
    first, last = map(float, re.search(r"train loss\s+([\d.]+) -> ([\d.]+)", out).groups())
    assert 5.0 < first < 6.0 and last < first - 1.0, (first, last)
    before, after = map(float, re.search(r"validation loss\s+([\d.]+) -> ([\d.]+)", out).groups())
    assert after < before - 1.0, (before, after)
    # the CSV monitor's run and the picture drawn from it, whose loss curve the demo checked against its losses
    run = tmp_path / "demo"
    assert f"monitor (csv)        {run}" in out
    png = re.search(r"training plot\s+(\S+\.png) \(its loss curve = the 16 per-step losses above", out)
    assert png is not None, out[-2000:]
    assert Path(png.group(1)) == run / "training.png" and Path(png.group(1)).read_bytes()[:4] == b"\x89PNG"
    from zerospeed.monitor.plot import read_series

    losses = read_series(run / "Train_Samples_train_loss.csv")
    assert losses.steps == [16 * (i + 1) for i in range(16)]  # x: global_samples, 16 per step
    assert round(losses.values[0], 3) == first  # the summary's first-step loss
