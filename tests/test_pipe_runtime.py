"""PipelineEngine at run time: measured bubbles against the schedules' simulated theory, random train/eval
interleavings that must not hang, a failing stage that every stage reports, and eval_batch's answers.
Real gloo processes."""

from __future__ import annotations

import random
import time
from fractions import Fraction
from typing import Any

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.pipe.module import LayerSpec, PipelineModule
from zerospeed.pipe.schedules import schedule_for
from zerospeed.pipe.simulate import Costs, simulate
from zerospeed.testing import run_distributed
from zerospeed.testing.device_time import DeviceTime, DeviceWeightTime
from zerospeed.testing.pipe_models import PlainGPT, gpt_pipeline, lm_loss, rank_iterator, token_batches


# -- layers of fixed, known cost --------------------------------------------------------------------
class TimedLayer(nn.Module):
    """Forward, input-gradient and weight-gradient costs fixed by sleeping (no CPU use, so the 2 cores
    of the machine do not distort a 4-stage pipeline)."""

    def __init__(self, forward_s: float, input_s: float, weight_s: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        self.costs = (forward_s, input_s, weight_s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        forward_s, input_s, weight_s = self.costs
        return DeviceTime.apply(x, forward_s, input_s) + DeviceWeightTime.apply(self.w, weight_s)


STAGE_COST = 0.1  # seconds per stage per micro-batch for each of F, B and W (large against the per-instruction
# overhead, which a loaded machine inflates)


def _timed(schedule: str, micro_batches: int) -> dict:
    stages = torch.distributed.get_world_size()
    chunks = 2 if schedule == "interleaved_1f1b" else 1
    per_layer = STAGE_COST / chunks
    module = PipelineModule([LayerSpec(TimedLayer, per_layer, per_layer, per_layer) for _ in range(stages * chunks)],
                            num_stages=stages, loss_fn=lambda out, labels: out.sum(), partition_method="uniform",
                            chunks=chunks)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": micro_batches,
              "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "pipeline": {"schedule": schedule}}
    engine, *_ = zerospeed.initialize(model=module, config=config)
    # inputs that require grad: the first stage pays the input-gradient cost like the others (the theory's model)
    data = iter([(torch.ones(1, 4, requires_grad=True), torch.zeros(1))] * (3 * micro_batches))
    engine.train_batch(data)  # warm-up: the first window lays the gradient buckets out
    torch.distributed.barrier()
    engine.train_batch(data)
    run = engine.last_run
    assert run is not None
    return {"trace": [(code, start, end) for code, _, _, start, end in run.trace], "peak": run.peak_in_flight,
            "bound": engine.schedule.in_flight_bound[engine.stage_id]}


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved_1f1b", "zb_h1"])
def test_measured_bubble_matches_the_schedule_theory(schedule: str) -> None:
    stages, micro = 4, 8
    results = run_distributed(_timed, stages, schedule, micro, timeout=180, threads_per_rank=1)
    start = min(r["trace"][0][1] for r in results)
    end = max(r["trace"][-1][2] for r in results)
    theory = simulate(schedule_for(schedule, stages=stages, micro_batches=micro), Costs(1, 1, 1))
    measured = []
    for stage, result in enumerate(results):
        busy = sum(e - s for _, s, e in result["trace"])
        idle = 1 - busy / (end - start)
        measured.append(idle)
        assert abs(idle - float(theory.idle_share(stage))) < 0.05, (stage, idle, float(theory.idle_share(stage)))
        assert result["peak"] <= result["bound"]
    if schedule == "1f1b":  # DeepSpeed's: (p - 1) / (m + p - 1) on every stage
        assert theory.idle_share(0) == Fraction(stages - 1, micro + stages - 1)


# -- random interleavings of train_batch and eval_batch ----------------------------------------------
def _interleave(seed: int, rounds: int, schedule: str) -> dict:
    stages = torch.distributed.get_world_size()
    chunks = 2 if schedule == "interleaved_1f1b" else 1
    module = gpt_pipeline(stages, blocks=4, chunks=chunks)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2 * stages,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "pipeline": {"schedule": schedule}}
    engine, *_ = zerospeed.initialize(model=module, config=config)
    rng = random.Random(seed)  # the same choices on every rank
    data = rank_iterator(token_batches(rounds * 2, 8, 2), 0)
    done = {"train": 0, "eval": 0}
    for _ in range(rounds):
        if rng.random() < 0.5:
            loss = engine.train_batch(data)
            done["train"] += 1
        else:
            micro = rng.randint(1, 5) * (stages if chunks > 1 else 1)
            loss = engine.eval_batch(data, num_micro_batches=micro)
            done["eval"] += 1
        assert torch.isfinite(loss)
    return {**done, "steps": engine.global_steps}


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_random_train_and_eval_interleavings_do_not_hang(schedule: str) -> None:
    results = run_distributed(_interleave, 2, 7, 100, schedule, timeout=240, pg_timeout=60)
    assert results[0] == results[1]
    assert results[0]["train"] + results[0]["eval"] == 100 and results[0]["train"] > 20 and results[0]["eval"] > 20
    assert results[0]["steps"] == results[0]["train"]


# -- a failing stage --------------------------------------------------------------------------------
class Exploding(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 3:
            raise ValueError("this layer explodes on a batch of 3")
        return super().forward(x)


def _failing() -> dict:
    module = PipelineModule([LayerSpec(nn.Linear, 4, 4), LayerSpec(Exploding, 4, 4), LayerSpec(nn.Linear, 4, 4)],
                            num_stages=3, loss_fn=lambda out, labels: ((out - labels) ** 2).mean(),
                            partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 4,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = zerospeed.initialize(model=module, config=config)
    start = time.perf_counter()
    try:
        engine.train_batch(iter([(torch.ones(3, 4), torch.zeros(3, 4))] * 4))
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - start}
    return {"error": None, "seconds": time.perf_counter() - start}


def test_a_failing_stage_fails_every_stage_within_the_timeout_naming_it() -> None:
    results = run_distributed(_failing, 3, timeout=120, pg_timeout=4)
    assert all(r["error"] is not None for r in results), results
    assert "pipeline stage 1 failed at Forward(micro=0, chunk=0)" in results[1]["error"]
    assert "this layer explodes" in results[1]["error"]
    for stage in (0, 2):  # the neighbours time out waiting for stage 1 (or see it gone), and say so
        error = results[stage]["error"]
        assert f"pipeline stage {stage} failed at" in error and "from stage 1" in error
        assert "did not post the matching transfer in time" in error or "stage 1 may have died" in error
        assert results[stage]["seconds"] < 30


# -- eval_batch ------------------------------------------------------------------------------------
def _evaluate() -> dict:
    module = gpt_pipeline(2, blocks=4)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = zerospeed.initialize(model=module, config=config)
    batches = token_batches(1, 3, 2)
    mean = engine.eval_batch(rank_iterator(batches, 0), num_micro_batches=3)
    last_only = engine.eval_batch(rank_iterator(batches, 0), num_micro_batches=3, bcast_loss=False)
    outputs = engine.eval_batch(rank_iterator(batches, 0), num_micro_batches=3, reduce_output=None)
    loss, logits = engine.eval_batch(rank_iterator(batches, 0), num_micro_batches=3, return_logits=True)
    return {"mean": float(mean), "last_only": None if last_only is None else float(last_only),
            "outputs": None if outputs is None else [float(o) for o in outputs],
            "logits": None if logits is None else [tuple(t.shape) for t in logits], "loss": float(loss),
            "training": module.training}


def test_eval_batch_answers_as_deepspeed() -> None:
    results = run_distributed(_evaluate, 2)
    batches = token_batches(1, 3, 2)
    plain = PlainGPT(blocks=4)
    with torch.no_grad():
        expected = [float(lm_loss(plain(ids), labels)) for ids, labels in (m[0] for m in batches[0])]
    for result in results:
        assert result["mean"] == pytest.approx(sum(expected) / 3, abs=1e-6)
        assert result["loss"] == pytest.approx(sum(expected) / 3, abs=1e-6)
        assert result["training"]  # the module is back in training mode
    assert results[0]["last_only"] is None and results[1]["last_only"] == pytest.approx(sum(expected) / 3, abs=1e-6)
    assert results[0]["outputs"] is None and results[1]["outputs"] == pytest.approx(expected, abs=1e-6)
    assert results[0]["logits"] is None and results[1]["logits"] == [(2, 8, 32)] * 3


# -- refusals (one process) -----------------------------------------------------------------------------
def _one_stage(**kwargs: Any) -> PipelineModule:
    return PipelineModule([LayerSpec(nn.Linear, 4, 4), LayerSpec(nn.Linear, 4, 4)], num_stages=1, **kwargs)


@pytest.mark.parametrize(("config", "module_kwargs", "error"), [
    ({"zero_optimization": {"stage": 3}}, {}, r"zero_optimization.stage=3: pipeline parallelism runs with ZeRO "
                                              r"stages 0, 1 and 2"),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}, {},
     r"zero_optimization.offload_optimizer: offloading is not supported with pipeline parallelism"),
    ({"pipeline": {"schedule": "interleaved_1f1b"}}, {}, r"build the PipelineModule with chunks=2"),
    ({"pipeline": {"chunks": 2}}, {}, r"pipeline.chunks=2 but the PipelineModule was built with chunks=1"),
    ({}, {"chunks": 2}, r"chunks=2 \(virtual stages\), which only pipeline.schedule=\"interleaved_1f1b\" runs"),
    ({"pipeline": {"schedule": "zb_h1"}}, {"activation_checkpoint_interval": 1},
     r"zb_h1.* with activation checkpointing is not supported"),
    ({"pipeline": {"schedule": "1f1b_interleaved"}}, {}, r"pipeline.schedule.*interleaved_1f1b"),
    ({"pipeline": {"stages": 2}}, {}, r"pipeline.stages=2 but the PipelineModule has 1 stages"),
])
def test_pipeline_configs_it_cannot_run_are_refused_by_key(config: dict, module_kwargs: dict, error: str) -> None:
    from zerospeed.config import ConfigError

    base = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with pytest.raises(ConfigError, match=error):
        zerospeed.initialize(model=_one_stage(**module_kwargs), config={**base, **config})


def test_training_data_given_to_initialize_feeds_train_batch_and_batch_fn_applies() -> None:
    data = [(torch.randn(4), torch.randn(4)) for _ in range(16)]
    module = _one_stage(loss_fn=lambda out, labels: ((out - labels) ** 2).mean())
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, loader, _ = zerospeed.initialize(model=module, config=config, training_data=data)
    assert loader is not None
    first = float(engine.train_batch())
    seen: list[int] = []

    def batch_fn(batch: Any) -> Any:
        seen.append(len(batch[0]))
        return batch

    engine.set_batch_fn(batch_fn)
    for _ in range(5):
        last = float(engine.train_batch())
    assert seen == [2] * 10 and engine.global_steps == 6 and last < first
    with pytest.raises(Exception, match=r"a micro-batch must be a pair \(inputs, labels\)"):
        engine.train_batch(iter([torch.zeros(2, 4)] * 2))
