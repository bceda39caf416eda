"""The flagship demo runs end to end through the launcher and matches its single-process replay."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_two_ranks_matches_reference() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", "zerospeed", "--num_procs", "2", "--master_port", "0",
         str(ROOT / "examples" / "demo.py"), "--steps", "40"],
        capture_output=True, text=True, env=env, timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "batch 64 = micro 8 x accumulation 4 x world 2" in done.stdout
    assert "OK: data-parallel run matches the single-process reference" in done.stdout
