"""ZeRO-Offload of the optimizer (``offload_optimizer.device: cpu``) against the same run without it.

Stages 1-3 on 2 and 3 ranks with gradient accumulation and clipping: the configured AdamW becomes
``CPUAdam`` on fp32 masters in CPU memory, and losses and parameters must equal the run without
offload to 1e-6 (fp32). In bf16 the CPU optimizer writes the bf16 shards in its own pass: the model's
parameters must be exactly the masters rounded to bf16.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.config import ConfigError
from zerospeed.testing import run_distributed

STEPS = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 24), nn.GELU(), nn.Linear(24, 5))


def _config(stage: int, offload: bool, bf16: bool) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 200, "stage3_param_persistence_threshold": 10}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**9,
            "gradient_clipping": 0.05, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
            "bf16": {"enabled": bf16}, "zero_optimization": zero}


def _train(stage: int, offload: bool, bf16: bool) -> dict[str, Any]:
    rank = torch.distributed.get_rank()
    engine, optimizer, *_ = zerospeed.initialize(model=_model(), config=_config(stage, offload, bf16))
    losses = []
    for step in range(STEPS * 2):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(2, 12, generator=g), torch.randn(2, 5, generator=g)
        out = engine(x.bfloat16() if bf16 else x)
        loss = (out.float() - y).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    masters = [zerospeed.utils.safe_get_full_fp32_param(p).reshape(-1) for p in engine.module.parameters()]
    params = []
    for p in engine.module.parameters():  # the compute-dtype values the model computes with
        unit, index = p._zerospeed_owner.unit, p._zerospeed_owner.index
        unit.gather()
        params.append(unit.param_slice(unit.full, index).float().reshape(-1))
    return {"losses": losses, "masters": torch.cat(masters).tolist(), "params": torch.cat(params).tolist(),
            "optimizer": type(optimizer).__name__}


def _compare() -> list[dict[str, Any]]:
    out = []
    for stage in (1, 2, 3):
        for bf16 in (False, True):
            plain = _train(stage, False, bf16)
            offloaded = _train(stage, True, bf16)
            out.append({"stage": stage, "bf16": bf16, "plain": plain, "offloaded": offloaded})
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_offloaded_optimizer_matches_the_run_without(world: int) -> None:
    results = run_distributed(_compare, world, timeout=240)
    for case in results[0]:
        plain, offloaded = case["plain"], case["offloaded"]
        what = f"stage {case['stage']} {'bf16' if case['bf16'] else 'fp32'} on {world} ranks"
        assert plain["optimizer"] == "AdamW" and offloaded["optimizer"] == "CPUAdam", what
        masters_plain, masters_off = torch.tensor(plain["masters"]), torch.tensor(offloaded["masters"])
        scale = masters_plain.abs().max().item()
        if not case["bf16"]:
            torch.testing.assert_close(torch.tensor(offloaded["losses"]), torch.tensor(plain["losses"]),
                                       rtol=1e-6, atol=1e-7, msg=what)
            torch.testing.assert_close(masters_off, masters_plain, rtol=1e-6, atol=1e-6 * scale, msg=what)
        else:
            # bf16 rounding of ulp-level differences may flip a compute value; masters stay close, and
            # the bf16 parameters the CPU optimizer wrote are exactly its masters rounded.
            torch.testing.assert_close(masters_off, masters_plain, rtol=1e-3, atol=1e-3 * scale, msg=what)
            assert torch.equal(torch.tensor(offloaded["params"]), masters_off.bfloat16().float()), what


def _stage0_offload() -> str:
    try:
        zerospeed.initialize(model=_model(), config=_config(0, True, False))
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_offload_needs_a_zero_stage() -> None:
    message = run_distributed(_stage0_offload, 1)[0]
    assert "offload_optimizer" in message and "stage 1, 2 or 3" in message


def _offload_round_trip(root: str) -> list[float]:
    """Save with the optimizer offloaded (CPUAdam), load without offload (AdamW): states carry over."""
    engine, *_ = zerospeed.initialize(model=_model(), config=_config(2, True, False))
    for step in range(2):
        x = torch.randn(2, 12, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    engine.save_checkpoint(root, tag="t")
    saved = zerospeed.utils.safe_get_full_optimizer_state(next(engine.module.parameters()), "exp_avg_sq")
    plain, *_ = zerospeed.initialize(model=_model(), config=_config(1, False, False))
    plain.load_checkpoint(root, tag="t")
    loaded = zerospeed.utils.safe_get_full_optimizer_state(next(plain.module.parameters()), "exp_avg_sq")
    return [float((saved - loaded).abs().max()), float(saved.abs().max())]


def test_a_checkpoint_moves_between_offloaded_and_not(tmp_path: Any) -> None:
    difference, magnitude = run_distributed(_offload_round_trip, 2, str(tmp_path))[0]
    assert magnitude > 0 and difference == 0.0
