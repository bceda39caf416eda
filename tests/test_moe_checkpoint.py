"""Checkpoints hold experts by global index: saved at ep=2, resumed at ep=1 and ep=4 (same 4 ranks, so
every rank sees the same tokens), the next steps' losses equal the uninterrupted run's; and a checkpoint
converts to a plain state dict of all experts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from test_moe_engine import ACCUM, WORLD, _moe_batch, _moe_model, _Wrap
from zerospeed.testing import run_distributed

BEFORE, AFTER = 3, 2


def _engine(ep: int, stage: int):  # noqa: ANN202 - (engine, inner model)
    import zerospeed

    model = _moe_model(2, ep)
    config = {"train_micro_batch_size_per_gpu": 6, "gradient_accumulation_steps": ACCUM, "gradient_clipping": 0.5,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}},
              "zero_optimization": {"stage": stage}}
    engine, _, _, _ = zerospeed.initialize(model=_Wrap(model), config=config)
    return engine, model


def _train(engine, steps: range, rank: int) -> list[float]:  # noqa: ANN001
    losses = []
    for step in steps:
        for micro in range(ACCUM):
            loss = engine(*_moe_batch(step, micro, rank))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
    return losses


def _save_and_continue(path: str, stage: int) -> list[float]:
    import torch.distributed as dist

    engine, _ = _engine(2, stage)
    _train(engine, range(BEFORE), dist.get_rank())
    engine.save_checkpoint(path)
    return _train(engine, range(BEFORE, BEFORE + AFTER), dist.get_rank())


def _resume(path: str, ep: int, stage: int) -> list[float]:
    import torch.distributed as dist

    engine, _ = _engine(ep, stage)
    engine.load_checkpoint(path)
    assert engine.global_steps == BEFORE
    return _train(engine, range(BEFORE, BEFORE + AFTER), dist.get_rank())


@pytest.mark.spawns
@pytest.mark.parametrize("stage", [0, 2])
def test_a_checkpoint_saved_at_ep2_resumes_at_ep1_and_ep4(tmp_path: Path, stage: int) -> None:
    path = str(tmp_path / "ckpt")
    uninterrupted = run_distributed(_save_and_continue, WORLD, path, stage)
    for ep in (1, 4):
        resumed = run_distributed(_resume, WORLD, path, ep, stage)
        for rank in range(WORLD):
            assert resumed[rank] == pytest.approx(uninterrupted[rank], rel=1e-5, abs=1e-6), (ep, rank)
    from zerospeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(path)
    experts = sorted({name.split("deepspeed_experts.")[1].split(".")[0] for name in state if "deepspeed_experts." in name})
    assert experts == ["0", "1", "2", "3"]
    assert all(isinstance(v, torch.Tensor) for v in state.values())
