"""ZeRO-Offload (``offload_optimizer`` / ``offload_param``: cpu) against the same run without it.

Stages 1-3 on 2 and 3 ranks with gradient accumulation: the configured AdamW becomes ``CPUAdam`` on
fp32 masters in CPU memory, and losses and parameters must equal the run without offload to 1e-6
(fp32). Variants: with clipping (the step runs after backward); stage 3 with the parameter shards
offloaded too; stage 3 with ``ratio: 0.5`` (half the optimizer stays on the device); and without
clipping in small sub-groups, where the step overlaps backward (and must still be exact). In bf16
the CPU optimizer writes the bf16 shards in its own pass: the model's parameters must be exactly the
masters rounded to bf16.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.config import ConfigError
from zerospeed.testing import log_messages, run_distributed
from zerospeed.testing.configs import adamw, train_config, zero_section
from zerospeed.testing.data import seeded_regression_batch
from zerospeed.testing.models import seeded_mlp

STEPS = 4
OFFLOAD = {"device": "cpu"}
# (name, stages, gradient_clipping, zero_optimization entries of the offloaded run)
VARIANTS = [
    ("optimizer", (1, 2, 3), 0.05, {"offload_optimizer": OFFLOAD}),
    ("optimizer+param", (3,), 0.05, {"offload_optimizer": OFFLOAD, "offload_param": OFFLOAD}),
    ("ratio 0.5", (3,), 0.05, {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}),
    ("overlapped", (1, 2, 3), 0.0, {"offload_optimizer": OFFLOAD, "sub_group_size": 100}),
]


def _model() -> nn.Module:
    return seeded_mlp(12, 24, 24, 5)


def _config(stage: int, bf16: bool, clip: float = 0.05, zero_extra: dict[str, Any] | None = None) -> dict[str, Any]:
    zero = zero_section(stage, reduce_bucket_size=200, persistence_threshold=10, **(zero_extra or {}))
    return train_config(micro=2, accum=2, clip=clip, optimizer=adamw(3e-3), zero=zero, bf16={"enabled": bf16})


def _train(config: dict[str, Any]) -> dict[str, Any]:
    rank = torch.distributed.get_rank()
    bf16 = config["bf16"]["enabled"]
    engine, optimizer, *_ = zerospeed.initialize(model=_model(), config=config)
    losses = []
    for step in range(STEPS * 2):
        x, y = seeded_regression_batch(step, rank, rows=2, inputs=12, outputs=5)
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
    state = engine.state
    breakdown = engine.memory_breakdown()
    tiers = [tier.name for tier in state.zero_optimizer.tiers]
    return {"losses": losses, "masters": torch.cat(masters).tolist(), "params": torch.cat(params).tolist(),
            "optimizer": type(optimizer).__name__, "early_jobs": state.eager.jobs_run,
            "early_during_backward": state.eager.jobs_during_backward,
            "offloaded_elems": sum(u.plan.shard_numel for u, t in zip(state.units, tiers, strict=True) if t == "cpu"),
            "elems": sum(u.plan.shard_numel for u in state.units),
            "param_tiers": sorted({"cpu" if u.shard.device.type == "cpu" and not u.persistent else "device"
                                   for u in state.units}),
            "param_tier": state.store.params.name,
            "offloaded_bytes": breakdown["offloaded"], "state_bytes": breakdown["optimizer_states"],
            "grad_bytes": breakdown["grads"]}


def _compare() -> list[dict[str, Any]]:
    out = []
    for name, stages, clip, extra in VARIANTS:
        for stage in stages:
            for bf16 in (False, True):
                plain, offloaded = _config(stage, bf16, clip), _config(stage, bf16, clip, extra)
                if name == "overlapped":  # the non-finite check (on by default) must see every gradient first
                    plain["bf16"]["check_grad_overflow"] = offloaded["bf16"]["check_grad_overflow"] = False
                    plain["skipped_steps"] = offloaded["skipped_steps"] = {"check_fp32": False}
                plain, offloaded = _train(plain), _train(offloaded)
                out.append({"variant": name, "stage": stage, "bf16": bf16, "plain": plain, "offloaded": offloaded})
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_offloaded_optimizer_matches_the_run_without(world: int) -> None:
    results = run_distributed(_compare, world, timeout=400)
    assert len(results[0]) == 2 * (3 + 1 + 1 + 3)
    for case in results[0]:
        plain, offloaded = case["plain"], case["offloaded"]
        what = f"{case['variant']}: stage {case['stage']} {'bf16' if case['bf16'] else 'fp32'} on {world} ranks"
        assert plain["optimizer"] == "AdamW" and offloaded["optimizer"] == "CPUAdam", what
        assert plain["early_jobs"] == 0, what
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
        # where the state lived (and what memory_breakdown says), and whether the step overlapped backward
        assert plain["offloaded_bytes"] == 0, what
        if case["variant"] == "ratio 0.5":
            share = offloaded["offloaded_elems"] / offloaded["elems"]
            assert 0.2 < share < 0.8, (what, share)
            assert 0 < offloaded["offloaded_bytes"] < offloaded["state_bytes"] + offloaded["grad_bytes"], what
        else:
            assert offloaded["offloaded_elems"] == offloaded["elems"], what
            # masters and states, the gradient shards of stages 2-3, and the stage-3 shards of offload_param
            grads = offloaded["grad_bytes"] if case["stage"] >= 2 else 0
            extra = offloaded["offloaded_bytes"] - offloaded["state_bytes"] - grads
            assert extra > 0 if case["variant"] == "optimizer+param" else extra == 0, (what, extra)
        assert offloaded["param_tier"] == ("cpu" if case["variant"] == "optimizer+param" else "device"), what
        early = offloaded["early_jobs"]
        if case["variant"] != "overlapped":
            assert early == 0, what
        elif case["bf16"] or case["stage"] == 3:
            # sub-group jobs every window, at least one of them started while backward still ran; fp32
            # stages 1-2 update the computed shards in place, which must wait for backward's end
            assert early >= 2 * STEPS and offloaded["early_during_backward"] >= STEPS, (what, offloaded)
        else:
            assert early == 0, what


def _stage0_offload() -> str:
    try:
        zerospeed.initialize(model=_model(), config=_config(0, False, zero_extra={"offload_optimizer": OFFLOAD}))
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_offload_needs_a_zero_stage() -> None:
    message = run_distributed(_stage0_offload, 1)[0]
    assert "offload_optimizer" in message and "stage 1, 2 or 3" in message


def _offload_round_trip(root: str) -> list[float]:
    """Save with the optimizer offloaded (CPUAdam), load without offload (AdamW): states carry over."""
    engine, *_ = zerospeed.initialize(model=_model(), config=_config(2, False, zero_extra={"offload_optimizer": OFFLOAD}))
    for step in range(2):
        x = torch.randn(2, 12, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    engine.save_checkpoint(root, tag="t")
    saved = zerospeed.utils.safe_get_full_optimizer_state(next(engine.module.parameters()), "exp_avg_sq")
    plain, *_ = zerospeed.initialize(model=_model(), config=_config(1, False))
    plain.load_checkpoint(root, tag="t")
    loaded = zerospeed.utils.safe_get_full_optimizer_state(next(plain.module.parameters()), "exp_avg_sq")
    return [float((saved - loaded).abs().max()), float(saved.abs().max())]


def test_a_checkpoint_moves_between_offloaded_and_not(tmp_path: Any) -> None:
    difference, magnitude = run_distributed(_offload_round_trip, 2, str(tmp_path))[0]
    assert magnitude > 0 and difference == 0.0


def _overlap_misuse() -> list[str]:
    """A second backward on the window's last micro-batch is refused once the step has begun; a window
    abandoned after it keeps the early updates, with a warning."""
    import logging

    config = _config(3, True, 0.0, {"offload_optimizer": OFFLOAD, "sub_group_size": 100})
    config["bf16"]["check_grad_overflow"] = False
    config["gradient_accumulation_steps"] = 1
    engine, *_ = zerospeed.initialize(model=_model(), config=config)
    x = torch.randn(2, 12, generator=torch.Generator().manual_seed(0)).bfloat16()
    out = []
    engine.backward(engine(x).float().pow(2).mean())
    try:
        engine.backward(engine(x).float().pow(2).mean())
        out.append("no error")
    except RuntimeError as exc:
        out.append(str(exc))
    before = zerospeed.utils.safe_get_full_fp32_param(next(engine.module.parameters())).clone()
    with log_messages(logging.WARNING) as records:
        engine.zero_grad()
    out.append(" | ".join(records))
    engine.backward(engine(x).float().pow(2).mean())  # the next window works normally
    engine.step()
    after = zerospeed.utils.safe_get_full_fp32_param(next(engine.module.parameters()))
    out.append(str(bool((after != before).any())))
    return out


def test_overlapped_step_refuses_a_second_backward_and_warns_on_an_abandoned_window() -> None:
    second, warning, moved = run_distributed(_overlap_misuse, 2)[0]
    assert "second engine.backward()" in second and "add the losses first" in second
    assert "ended without engine.step()" in warning and "updates are kept" in warning
    assert moved == "True"
