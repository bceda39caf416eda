"""Train two steps and save them (``global_step2``), train one more and start saving again, slowly.

Writes $ZS_TEST_OUT/step2.json (rank 0: the parameters saved at step 2) and, once the second save
is inside its tensor file, $ZS_TEST_OUT/saving<RANK> holding this rank's PID; every chunk of that
save then takes a minute, so the launcher is killed while both ranks are mid-save.
"""

import json
import os
import time
from typing import Any

import torch
from torch import nn

import zerospeed
from zerospeed.checkpoint import safetensors_io
from zerospeed.testing.data import seeded_regression_batch
from zerospeed.testing.models import seeded_mlp

CONFIG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
          "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "zero_optimization": {"stage": 1}}


def train(engine: Any, steps: int) -> None:
    for _ in range(steps):
        x, y = seeded_regression_batch(engine.global_steps, engine.comm.rank, rows=2, inputs=6, outputs=3)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()


def slow_down_saves(marker: str) -> None:
    original = safetensors_io.StreamingWriter.write

    def write(self: Any, chunk: torch.Tensor) -> None:
        original(self, chunk)
        if not os.path.exists(marker):
            with open(marker, "w", encoding="utf-8") as fh:
                fh.write(str(os.getpid()))
        time.sleep(60)
    safetensors_io.StreamingWriter.write = write  # type: ignore[method-assign]


if __name__ == "__main__":
    out, save_dir = os.environ["ZS_TEST_OUT"], os.environ["ZS_SAVE_DIR"]
    torch.set_num_threads(1)
    engine, *_ = zerospeed.initialize(model=seeded_mlp(6, 16, 3, activation=nn.Tanh), config=CONFIG)
    train(engine, 2)
    engine.save_checkpoint(save_dir)
    if engine.comm.rank == 0:
        params = {n: p.detach().reshape(-1).tolist() for n, p in engine.module.named_parameters()}
        with open(os.path.join(out, "step2.json"), "w", encoding="utf-8") as fh:
            json.dump(params, fh)
    train(engine, 1)
    slow_down_saves(os.path.join(out, f"saving{engine.comm.rank}"))
    engine.save_checkpoint(save_dir)
    raise AssertionError("the slowed-down save finished; the test should have stopped this rank")
