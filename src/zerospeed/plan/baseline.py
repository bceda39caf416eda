"""What a training rank holds before its model: the Python/torch/zerospeed baseline, measured.

On the CPU a rank's peak resident memory starts from the interpreter with torch and zerospeed
imported and the gloo process group up (a few hundred MB), and the first training step adds a
fixed cost of its own (autograd's engine, the optimizer and engine modules, kernel workspaces)
that does not grow with the model. Neither can be computed from shapes, so the plan measures both
in a fresh process (:func:`measure_baseline`) and shows them as named lines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

from zerospeed.accelerator.host_memory import peak_rss_bytes

__all__ = ["Baseline", "idle_then_tiny_step", "measure_baseline"]


@dataclass(frozen=True)
class Baseline:
    """Peak RSS of an idle rank (``idle``) and what a tiny model's first training steps add (``runtime``)."""

    idle: int
    runtime: int


def idle_then_tiny_step() -> dict[str, int]:
    """In a rank whose process group is up: the peak RSS now (torch and zerospeed's engine imported),
    then after two training steps of a one-layer model through ``zerospeed.initialize``."""
    import logging

    import torch

    import zerospeed
    import zerospeed.engine  # noqa: F401  (what initialize imports: part of the baseline)
    import zerospeed.entry  # noqa: F401

    idle = peak_rss_bytes()
    logging.getLogger("zerospeed").setLevel(logging.WARNING)
    model = torch.nn.Linear(16, 16)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = zerospeed.initialize(model=model, config=config)
    x = torch.zeros(1, 16)
    for _ in range(2):
        engine.backward(engine(x).square().mean())
        engine.step()
    return {"idle": idle, "runtime": peak_rss_bytes() - idle}


_SCRIPT = """
import json, os, torch
torch.set_num_threads(1)
from zerospeed.distributed.env import init_distributed
init_distributed(dist_backend="gloo")
from zerospeed.plan.baseline import idle_then_tiny_step
print("BASELINE " + json.dumps(idle_then_tiny_step()), flush=True)
"""


def measure_baseline(timeout: float = 120.0) -> Baseline:
    """Run :func:`idle_then_tiny_step` in a fresh one-rank gloo process (a few seconds)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.pop("ZEROSPEED_AS_DEEPSPEED", None)
    done = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=timeout)
    for line in done.stdout.splitlines():
        if line.startswith("BASELINE "):
            values = json.loads(line[len("BASELINE "):])
            return Baseline(idle=int(values["idle"]), runtime=int(values["runtime"]))
    raise RuntimeError(f"measuring the baseline failed (exit {done.returncode}): {done.stderr[-2000:]}")
