"""Tensor-parallel checkpoints (issue 17) reshard across the tensor-parallel degree.

TinyGPT trains at tp=2 x dp=2 with ZeRO stage 1 for 3 steps, saves, and trains 2 more (the
uninterrupted run). The checkpoint then loads into a plain TinyGPT on 1 rank (tp=1: parts joined)
and into TinyGPT at tp=4 on 4 ranks (parts split further, along dim 1 for the row-parallel
weights), and the next 2 steps' losses must match the uninterrupted run's within 1e-5 (Adam's
moments and step resharded with the weights). Every run sees the same global batch of 4 rows
(``token_batch``): each data-parallel rank takes its rows, tensor-parallel peers the same rows.
``zerospeed convert`` of the tp=2 checkpoint must equal a plain single-process PyTorch run's
state dict after 3 steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import zerospeed
from zerospeed.checkpoint import convert_checkpoint
from zerospeed.distributed.mesh import ParallelDims
from zerospeed.testing import run_distributed
from zerospeed.testing.tp_models import GPTConfig, TinyGPT, token_batch

pytestmark = pytest.mark.spawns

CFG = GPTConfig()
ROWS, SAVE_AT, MORE, LR, ATOL = 4, 3, 2, 0.01, 1e-5
# The key bias of attention gets a zero gradient (softmax ignores a shift of every score): only rounding
# noise of ~1e-9, which Adam with its default eps (1e-8) would turn into updates of any size, differing
# between reduction orders. A larger eps keeps those updates negligible.
EPS = 1e-4
TAG = f"global_step{SAVE_AT}"


def _engine(tp: int, world: int) -> tuple[Any, int]:
    """An engine over TinyGPT at ``tp`` (plain TinyGPT at tp=1) and this rank's data-parallel rank."""
    torch.manual_seed(0)
    mesh = ParallelDims(world_size=world, tp=tp).build() if tp > 1 else None
    model = TinyGPT(CFG, tp_group=mesh) if mesh is not None else TinyGPT(CFG)
    dp = world // tp
    config = {"train_batch_size": ROWS, "train_micro_batch_size_per_gpu": ROWS // dp,
              "zero_optimization": {"stage": 1}, "gradient_clipping": 0.0}  # the reference does not clip
    engine, *_ = zerospeed.initialize(model=model, config=config, mpu=mesh,
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS))
    return engine, engine.comm.rank


def _step(engine: Any, step: int, dp_rank: int, dp: int) -> float:
    ids, targets = token_batch(step, ROWS, CFG)
    rows = slice(dp_rank * ROWS // dp, (dp_rank + 1) * ROWS // dp)
    loss = engine(ids[rows], targets[rows])
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def _run(tp: int, save_dir: str, load: bool) -> list[float]:
    """Train (saving at step 3, then 2 more steps) or load and train 2 steps; each step's mean loss."""
    world = torch.distributed.get_world_size()
    engine, dp_rank = _engine(tp, world)
    dp = engine.comm.world_size
    if load:
        path, _ = engine.load_checkpoint(save_dir)
        assert path is not None and engine.global_steps == SAVE_AT
        steps = range(SAVE_AT, SAVE_AT + MORE)
    else:
        steps = range(SAVE_AT + MORE)
    losses = []
    for step in steps:
        if step == SAVE_AT and not load:
            engine.save_checkpoint(save_dir)
        loss = torch.tensor(_step(engine, step, dp_rank, dp))
        engine.comm.all_reduce(loss)  # the global batch's loss: mean over data-parallel ranks
        losses.append(float(loss) / dp)
    return losses[-MORE:]


def _reference_state() -> dict[str, torch.Tensor]:
    """Plain PyTorch, one process, the whole batch: the model after 3 steps."""
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    for step in range(SAVE_AT):
        loss = model(*token_batch(step, ROWS, CFG))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_tp_checkpoint_reshards_across_degrees(tmp_path: Path):
    save_dir = str(tmp_path / "ckpt")
    uninterrupted = run_distributed(_run, 4, 2, save_dir, False, timeout=300)[0]
    manifest = (tmp_path / "ckpt" / TAG / "manifest.json").read_text()
    assert '"tensor_parallel"' in manifest and "#tp1of2" in manifest

    plain = run_distributed(_run, 1, 1, save_dir, True, timeout=300)[0]
    assert plain == pytest.approx(uninterrupted, abs=ATOL)
    tp4 = run_distributed(_run, 4, 4, save_dir, True, timeout=300)
    assert all(losses == pytest.approx(uninterrupted, abs=ATOL) for losses in tp4)

    files = convert_checkpoint(save_dir, str(tmp_path / "model.safetensors"))
    from safetensors.torch import load_file
    converted = load_file(files[0])
    reference = _reference_state()
    assert sorted(converted) == sorted(reference)
    for name, value in reference.items():
        assert converted[name].shape == value.shape, name
        torch.testing.assert_close(converted[name], value, atol=ATOL, rtol=0, msg=name)
