"""DeepSpeed's own example scripts run unchanged on zerospeed: ``ZEROSPEED_AS_DEEPSPEED=1`` makes their
``import deepspeed`` zerospeed, 2 ranks through zerospeed's launcher, data generated (no downloads; see
tests/deepspeed_examples/README.md). The loss falls and the test accuracy beats chance."""

from __future__ import annotations

import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from zerospeed.testing import free_port
from zerospeed.testing.alias import alias_env

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "tests" / "deepspeed_examples"
CLASSES = 10


def _write_cifar(root: Path, *, train_per_file: int, test_images: int, seed: int = 0) -> None:
    """CIFAR-10's python format (pickled dicts of uint8 rows + labels): each class is a fixed random
    pattern plus noise, so a small CNN can learn it within one short epoch."""
    rng = np.random.default_rng(seed)
    patterns = rng.integers(0, 256, size=(CLASSES, 3 * 32 * 32)).astype(np.float32)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)

    def batch(n: int) -> dict:
        labels = rng.integers(0, CLASSES, size=n)
        noise = rng.integers(0, 256, size=(n, 3 * 32 * 32)).astype(np.float32)
        data = (0.75 * patterns[labels] + 0.25 * noise).astype(np.uint8)
        return {"data": data, "labels": labels.tolist()}

    for name, n in [*((f"data_batch_{i}", train_per_file) for i in range(1, 6)), ("test_batch", test_images)]:
        with open(folder / name, "wb") as f:
            pickle.dump(batch(n), f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(CLASSES)]}, f)


def _launcher(name: str) -> list[str]:
    """2 ranks through zerospeed's launcher, or through torchrun (given a free port: it has no port 0)."""
    if name == "zerospeed":
        return [sys.executable, "-m", "zerospeed", "--num_procs", "2", "--master_port", "0"]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]


def _run_cifar(tmp_path: Path, stage: int, dtype: str, launcher: str = "zerospeed", extra: tuple[str, ...] = ()) -> str:
    _write_cifar(tmp_path / "data", train_per_file=512, test_images=64)
    env = alias_env(EXAMPLES / "offline")
    done = subprocess.run(
        [*_launcher(launcher), str(EXAMPLES / "cifar" / "cifar10_deepspeed.py"), "--deepspeed", "--epochs", "1",
         "--dtype", dtype, "--stage", str(stage), "--log-interval", "32", *extra],
        cwd=tmp_path, capture_output=True, text=True, env=env, timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    return out


# as DeepSpeedExamples' MoE run script: experts split over both ranks, RSample gate, separate expert groups
MOE = ("--moe", "--ep-world-size", "2", "--num-experts", "2", "--top-k", "1", "--noisy-gate-policy", "RSample",
       "--moe-param-group")


@pytest.mark.parametrize(("stage", "dtype", "launcher", "extra"), [
    *((stage, "fp32", "zerospeed", ()) for stage in (0, 1, 2, 3)),
    *((stage, "bf16", "zerospeed", ()) for stage in (1, 3)),  # bf16 through the replicated and sharded masters
    (2, "fp32", "torchrun", ()),  # the environment switch needs no zerospeed launcher
    (2, "fp32", "zerospeed", MOE),  # DeepSpeed's MoE layer with expert parallelism, under ZeRO-2
], ids=lambda v: "moe" if v == MOE else None)
def test_cifar10_example_trains_unchanged(tmp_path: Path, stage: int, dtype: str, launcher: str,
                                          extra: tuple[str, ...]) -> None:
    out = _run_cifar(tmp_path, stage, dtype, launcher, extra)
    # 2560 images, 16 per step (8 per rank x 2 ranks): 160 steps, rank 0 prints the mean loss of every 32
    losses = [float(x) for x in re.findall(r"\[ 1,\s+\d+\] loss:\s+([\d.]+)", out)]
    assert len(losses) == 5, out[-3000:]
    assert losses[-1] < 0.8 * losses[0], losses
    assert out.count("Finished Training") == 2  # both ranks
    accuracy = float(re.search(r"Accuracy of the network on the 64 test images:\s+(\d+) %", out).group(1))
    assert accuracy > 30, (accuracy, out[-2000:])  # chance is 10 %
    # the resolved config zerospeed logged, as one line at INFO (the whole of it is at DEBUG), once
    assert out.count("zerospeed config (resolved): ") == 1 and f", ZeRO stage {stage}; " in out, out[-3000:]
