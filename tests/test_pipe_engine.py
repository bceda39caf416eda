"""PipelineEngine: every schedule at pp=2 and pp=4 (and 3D, dp x pp x tp) against plain torch gradient
accumulation on the same data: per-step losses, global gradient norms (tied weights counted once) and
the final parameters within 1e-5 in fp32. Real gloo processes."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import zerospeed
from zerospeed.distributed.groups import group_size
from zerospeed.distributed.mesh import ParallelDims
from zerospeed.tensor_parallel.layout import tp_layout
from zerospeed.testing import log_messages, run_distributed
from zerospeed.testing.pipe_models import gpt_pipeline, lm_loss, plain_reference, rank_iterator, token_batches

LR, CLIP, STEPS = 1e-2, 0.5, 5


def _config(micro_batches: int, schedule: str, zero: int, micro_size: int = 2, **pipeline: Any) -> dict:
    return {"train_micro_batch_size_per_gpu": micro_size, "gradient_accumulation_steps": micro_batches,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "gradient_clipping": CLIP, "zero_optimization": {"stage": zero},
            "pipeline": {"schedule": schedule, **pipeline}, "steps_per_print": 1000}


def _train(pp: int, tp: int, schedule: str, zero: int, micro_batches: int, chunks: int, blocks: int,
           **pipeline: Any) -> dict:
    world = group_size()
    mesh = ParallelDims(world, tp=tp, pp=pp).build() if tp > 1 else None
    module = gpt_pipeline(pp, blocks=blocks, tp_group=mesh, chunks=chunks)
    engine, *_ = zerospeed.initialize(model=module, config=_config(micro_batches, schedule, zero, **pipeline), mpu=mesh)
    dp = engine.comm.world_size
    batches = token_batches(STEPS, micro_batches, 2, dp=dp)
    it = rank_iterator(batches, engine.comm.rank)
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(float(engine.train_batch(it)))
        norms.append(engine.get_global_grad_norm())
    layout = tp_layout(module, tp, mesh.comm("tp").rank if mesh is not None else 0)
    params = {}
    for name, p in module.named_parameters():
        split = layout.splits.get(name)
        params[name] = (p.detach().tolist(), None if split is None else (split.dim, split.rank, split.degree))
    return {"losses": losses, "norms": norms, "params": params, "dp": dp,
            "peak": engine.last_run.peak_in_flight if engine.last_run else -1,
            "bound": engine.schedule.in_flight_bound[engine.stage_id], "stage": engine.stage_id}


def _check(results: list[dict], micro_batches: int, blocks: int) -> None:
    dp = results[0]["dp"]
    batches = token_batches(STEPS, micro_batches, 2, dp=dp)
    losses, norms, params = plain_reference(batches, lr=LR, clip=CLIP, blocks=blocks)
    seen = set()
    for result in results:
        assert result["losses"] == pytest.approx(losses, abs=1e-5, rel=1e-5)
        assert result["norms"] == pytest.approx(norms, abs=1e-5, rel=1e-5)
        assert 0 < result["peak"] <= result["bound"]
        for name, (value, split) in result["params"].items():
            expected = params[name]
            if split is not None:
                dim, rank, degree = split
                expected = expected.chunk(degree, dim=dim)[rank]
            torch.testing.assert_close(torch.tensor(value), expected, atol=1e-5, rtol=1e-5, msg=name)
            seen.add(name)
    assert seen == set(params), f"parameters held by no stage: {set(params) - seen}"


CASES = [  # (pp, schedule, micro_batches, chunks)
    (2, "1f1b", 4, 1), (2, "gpipe", 4, 1), (2, "interleaved_1f1b", 4, 2), (2, "zb_h1", 4, 1),
    (4, "1f1b", 8, 1), (4, "gpipe", 8, 1), (4, "interleaved_1f1b", 8, 2), (4, "zb_h1", 8, 1),
]


@pytest.mark.parametrize(("pp", "schedule", "micro_batches", "chunks"), CASES,
                         ids=[f"pp{c[0]}-{c[1]}" for c in CASES])
def test_pipeline_matches_plain_gradient_accumulation(pp: int, schedule: str, micro_batches: int, chunks: int) -> None:
    blocks = 6
    results = run_distributed(_train, pp, pp, 1, schedule, 0, micro_batches, chunks, blocks, timeout=240)
    _check(results, micro_batches, blocks)


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_pipeline_with_zero_and_data_parallelism(zero: int, schedule: str) -> None:
    """dp=2 x pp=2: ZeRO-1 and ZeRO-2 shard each stage's optimizer (and gradients) over its replicas."""
    results = run_distributed(_train, 4, 2, 1, schedule, zero, 4, 1, 4, timeout=240)
    _check(results, 4, 4)


@pytest.mark.parametrize("zero", [1, 2])
def test_3d_parallelism_dp2_pp2_tp2(zero: int) -> None:
    """8 ranks: dp=2 x pp=2 x tp=2, tensor-parallel blocks inside the stages."""
    results = run_distributed(_train, 8, 2, 2, "1f1b", zero, 4, 1, 4, timeout=400, threads_per_rank=1)
    _check(results, 4, 4)


def test_activation_checkpointing_by_interval_keeps_parity() -> None:
    """``pipeline.activation_checkpoint_interval`` (as DeepSpeed: the config sets the module's interval)."""
    results = run_distributed(_train, 2, 2, 1, "1f1b", 0, 4, 1, 4, activation_checkpoint_interval=1, timeout=240)
    _check(results, 4, 4)


def _fp16(dtype: str) -> dict:
    module = gpt_pipeline(2, blocks=2)
    poison = [False]
    module.loss_fn = lambda logits, labels: lm_loss(logits, labels) * (float("nan") if poison[0] else 1.0)
    config = _config(4, "1f1b", 1)
    config[dtype] = {"enabled": True, **({"initial_scale_power": 24} if dtype == "fp16" else {})}
    engine, *_ = zerospeed.initialize(model=module, config=config)
    it = rank_iterator(token_batches(13, 4, 2), 0)
    losses = [float(engine.train_batch(it)) for _ in range(12)]
    out = {"losses": losses, "skipped": engine.skipped_steps, "scale": engine.cur_scale,
           "dtype": str(next(module.parameters()).dtype)}
    # a NaN loss on the last stage only: both stages skip the step (the norm is summed over the pipeline)
    before = [p.detach().clone() for p in module.parameters()]
    poison[0] = True
    with log_messages(logging.WARNING) as warnings:
        engine.train_batch(it)
    out["nan_step"] = {"skipped": engine.skipped_steps - out["skipped"], "applied": engine.was_step_applied(),
                       "unchanged": all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True)),
                       "warnings": warnings}
    return out


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_one_loss_scale_agreed_by_every_stage(dtype: str) -> None:
    """An overflow anywhere skips the step on every stage (the norm is summed over the pipeline), so the
    stages keep one loss scale; training goes on and the loss falls."""
    first, last = run_distributed(_fp16, 2, dtype)
    assert first["skipped"] == last["skipped"] and first["scale"] == last["scale"]
    assert first["losses"] == last["losses"]
    assert first["dtype"] == last["dtype"] == ("torch.float16" if dtype == "fp16" else "torch.bfloat16")
    if dtype == "fp16":
        assert 0 < first["skipped"] < 12 and first["scale"] < 2 ** 24
    assert first["losses"][-1] < first["losses"][first["skipped"]]
    for stage in (first, last):
        assert {k: v for k, v in stage["nan_step"].items() if k != "warnings"} == {
            "skipped": 1, "applied": False, "unchanged": True}
    if dtype == "bf16":  # the first stage sees a NaN gradient, the last its NaN loss
        assert first["nan_step"]["warnings"] == [
            "step 13 skipped: NaN gradient (gradient norm nan, loss scale 1); 1 in a row, 1 in the run"]
        assert last["nan_step"]["warnings"] == [
            "rank 1: step 13 skipped: NaN loss (gradient norm nan, loss scale 1); 1 in a row, 1 in the run"]
