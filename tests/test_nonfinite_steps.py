"""Steps whose gradients are not finite (issue 32, item 5): skipped in fp32, bf16 and fp16 with nothing
changed (parameters, masters and optimizer state bitwise, no LR step), a rate-limited warning naming the
step, the reason and the loss scale, the progress line going on with the skipped count, and
``skipped_steps.raise_after_consecutive`` stopping the run. In-process, one rank; the agreement across
ranks is in ``test_nonfinite_steps_ranks.py``."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import zerospeed
from zerospeed.config import ConfigError, load_config
from zerospeed.precision import NonFinitePolicy, NonFiniteSteps, NonFiniteStepsError, policy_from_config
from zerospeed.precision.nonfinite import NonFiniteStep, Reason, classify
from zerospeed.testing import log_messages
from zerospeed.testing.models import TanhMLP

NAN = float("nan")


def _config(**top: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05,
                                                          "warmup_num_steps": 10, "warmup_type": "linear"}},
            **top}


def _batch(step: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(2, 6, generator=torch.Generator().manual_seed(step)).to(dtype)


def _train_step(engine: Any, step: int, dtype: torch.dtype, poison: str | None = None) -> None:
    """One step; ``poison``: "loss" puts a NaN in the input (so the loss is NaN), "grad" a NaN (or, for
    "inf", an inf) into the gradient of the first layer's output while the loss stays finite."""
    x = _batch(step, dtype)
    if poison == "loss":
        x[0, 0] = NAN
    out = engine(x)
    if poison in ("grad", "inf"):
        bad = NAN if poison == "grad" else float("inf")
        out.register_hook(lambda g: torch.full_like(g, bad))
    engine.backward(out.float().pow(2).mean())
    engine.step()


def _snapshot(engine: Any, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Model parameters, the optimizer's parameters (masters, or this rank's pieces) and every state
    tensor, copied."""
    out = [p.detach().clone() for p in engine.module.parameters()]
    for group in optimizer.param_groups:
        for p in group["params"]:
            out.append(p.detach().clone())
            out += [torch.as_tensor(v).clone() for _, v in sorted(optimizer.state[p].items())]
    return out


def _skip_case(stage: int, precision: str, poison: str) -> tuple[list[str], dict[str, Any]]:
    """Two clean steps, a poisoned third, a clean fourth; what changed over the third and its warnings."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    extra = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    engine, optimizer, _, scheduler = zerospeed.initialize(
        model=TanhMLP(6, 11, 3), config=_config(zero_optimization={"stage": stage}, **extra))
    for step in range(2):
        _train_step(engine, step, dtype)
    before, lr = _snapshot(engine, optimizer), engine.get_lr()
    with log_messages(logging.WARNING) as warnings:
        _train_step(engine, 2, dtype, poison)
    after = _snapshot(engine, optimizer)
    facts = {"unchanged": len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after)),
             "lr_kept": engine.get_lr() == lr, "applied": engine.was_step_applied(),
             "overflow": optimizer.overflow, "skipped": engine.skipped_steps, "steps": engine.global_steps}
    _train_step(engine, 3, dtype)
    facts["next_applied"] = engine.was_step_applied() and engine.get_lr() != lr
    return warnings, facts


@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_nan_loss_skips_the_step_and_changes_nothing(stage: int, precision: str) -> None:
    warnings, facts = _skip_case(stage, precision, "loss")
    assert facts == {"unchanged": True, "lr_kept": True, "applied": False, "overflow": True, "skipped": 1,
                     "steps": 3, "next_applied": True}
    assert warnings == ["step 3 skipped: NaN loss (gradient norm nan, loss scale 1); 1 in a row, 1 in the run"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_nan_gradient_under_a_finite_loss_is_named_so(precision: str) -> None:
    warnings, facts = _skip_case(1, precision, "grad")
    assert facts["unchanged"] and facts["skipped"] == 1 and not facts["applied"]
    assert warnings == ["step 3 skipped: NaN gradient (gradient norm nan, loss scale 1); 1 in a row, 1 in the run"]


def test_fp16_overflow_names_the_loss_scale() -> None:
    fp16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "hysteresis": 1}
    engine, optimizer, *_ = zerospeed.initialize(model=TanhMLP(6, 11, 3), config=_config(fp16=fp16))
    _train_step(engine, 0, torch.float16)
    before = _snapshot(engine, optimizer)
    with log_messages(logging.WARNING) as warnings:
        _train_step(engine, 1, torch.float16, "inf")
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(engine, optimizer), strict=True))
    assert warnings == ["step 2 skipped: overflow (gradient norm nan, loss scale 256 -> 128); 1 in a row, "
                        "1 in the run"]
    assert engine.cur_scale == 128.0 and engine.skipped_steps == 1


def test_the_progress_line_goes_on_through_skipped_steps() -> None:
    engine, *_ = zerospeed.initialize(model=TanhMLP(6, 11, 3), config=_config(steps_per_print=2))
    with log_messages(logging.INFO) as lines:
        for step in range(6):  # steps 2, 3 and 4 are skipped; 4 and 6 end a progress interval
            _train_step(engine, step, torch.float32, "loss" if step in (1, 2, 3) else None)
    progress = [line.split("  ") for line in lines if line.startswith("step ") and "samples/s" in line]
    assert [(fields[0], fields[1], fields[4]) for fields in progress] == [
        ("step 2", "loss nan", "skipped 1 (1 of the last 2)"),
        ("step 4", "loss nan", "skipped 3 (2 of the last 2)"),
        ("step 6", progress[2][1], "skipped 3 (0 of the last 2)")]
    assert progress[2][1] != "loss nan"


def test_raise_after_consecutive_skips_names_the_key() -> None:
    config = _config(skipped_steps={"raise_after_consecutive": 3})
    engine, *_ = zerospeed.initialize(model=TanhMLP(6, 11, 3), config=config)
    _train_step(engine, 0, torch.float32, "loss")
    _train_step(engine, 1, torch.float32)  # a finite step ends the run of skipped ones
    _train_step(engine, 2, torch.float32, "loss")
    _train_step(engine, 3, torch.float32, "grad")
    with pytest.raises(NonFiniteStepsError) as caught:
        _train_step(engine, 4, torch.float32, "loss")
    assert str(caught.value) == (
        "skipped_steps.raise_after_consecutive = 3: 3 steps in a row had a non-finite gradient norm, steps 3-5 "
        "(2 NaN loss, 1 NaN gradient); the last, step 5: NaN loss (gradient norm nan, loss scale 1). Look for "
        "NaN/inf in the data or the model starting at step 3 (a lower learning rate or gradient_clipping may "
        "help), or raise skipped_steps.raise_after_consecutive (0 never raises)")
    assert (engine.skipped_steps, engine.global_steps) == (4, 5)


def test_fp32_skipping_switched_off_applies_the_step_and_says_so() -> None:
    engine, optimizer, *_ = zerospeed.initialize(model=TanhMLP(6, 11, 3),
                                                 config=_config(skipped_steps={"check_fp32": False}))
    with log_messages(logging.WARNING) as warnings:
        _train_step(engine, 0, torch.float32, "grad")
    assert engine.was_step_applied() and engine.skipped_steps == 0 and not optimizer.overflow
    assert all(bool(p.isnan().all()) for p in engine.module.parameters())  # DeepSpeed's fp32 behaviour
    assert warnings == ["step 1 was applied with NaN gradient (gradient norm nan, loss scale 1) because "
                        "skipped_steps.check_fp32 is false: parameters and optimizer state may now hold NaN/inf "
                        "(1 in a row, 1 in the run)"]


def test_the_policy_follows_the_keys() -> None:
    def policy(**sections: Any) -> Any:
        return policy_from_config(load_config({"train_batch_size": 4, **sections}))

    assert policy().check_overflow and policy().nonfinite == NonFinitePolicy(switch="skipped_steps.check_fp32")
    assert not policy(skipped_steps={"check_fp32": False}).check_overflow
    bf16 = policy(bf16={"enabled": True, "check_grad_overflow": False}, skipped_steps={"raise_after_consecutive": 7})
    assert not bf16.check_overflow
    assert bf16.nonfinite == NonFinitePolicy(switch="bf16.check_grad_overflow", raise_after_consecutive=7)
    assert policy(fp16={"enabled": True}).nonfinite.switch == ""
    with pytest.raises(ConfigError) as caught:
        load_config({"train_batch_size": 4, "skipped_steps": {"raise_after_consecutive": -1}})
    assert "skipped_steps.raise_after_consecutive: -1" in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        load_config({"train_batch_size": 4, "skipped_steps": {"raise_after": 3}})
    assert "raise_after_consecutive" in str(caught.value)  # did you mean


def test_classify() -> None:
    assert classify(NAN, loss=NAN, loss_scaled=True) == Reason.NAN_LOSS
    assert classify(NAN, loss=float("-inf"), loss_scaled=False) == Reason.INF_LOSS
    assert classify(float("inf"), loss=1.0, loss_scaled=True) == Reason.OVERFLOW
    assert classify(NAN, loss=1.0, loss_scaled=False) == Reason.NAN_GRADIENT
    assert classify(float("inf"), loss=0.0, loss_scaled=False) == Reason.INF_GRADIENT


def test_warnings_are_rate_limited() -> None:
    """The first 5 each; then a summary per 100 or when 60 s have passed since the last line."""
    now = [0.0]
    steps = NonFiniteSteps(NonFinitePolicy(switch="x"), clock=lambda: now[0])

    def skip(step: int, reason: Reason = Reason.NAN_GRADIENT) -> str | None:
        return steps.record(NonFiniteStep(step=step, reason=reason, norm=NAN, loss_scale=1.0, next_scale=1.0,
                                          skipped=True))

    lines = [skip(n) for n in range(1, 6)]
    assert lines[4] == "step 5 skipped: NaN gradient (gradient norm nan, loss scale 1); 5 in a row, 5 in the run"
    assert all(line is not None for line in lines)
    quiet = [skip(n, Reason.NAN_LOSS if n % 2 else Reason.NAN_GRADIENT) for n in range(6, 105)]
    assert quiet == [None] * 99
    assert skip(105) == (
        "100 steps skipped since the last report, steps 6-105 (51 NaN gradient, 49 NaN loss); the last, step "
        "105: NaN gradient (gradient norm nan, loss scale 1); 105 in a row, 105 in the run (after the first 5 "
        "these are summarized every 100 steps or 60 s)")
    steps.clean_step()
    assert skip(200) is None
    now[0] = 60.0  # an isolated one long after the last line is reported at once, as a single line
    assert skip(300) == ("2 steps skipped since the last report, steps 200-300 (2 NaN gradient); the last, step "
                         "300: NaN gradient (gradient norm nan, loss scale 1); 2 in a row, 107 in the run (after the "
                         "first 5 these are summarized every 100 steps or 60 s)")
    now[0] = 200.0
    assert skip(301) == "step 301 skipped: NaN gradient (gradient norm nan, loss scale 1); 3 in a row, 108 in the run"


def test_the_pipeline_engine_follows_the_same_policy() -> None:
    """``train_batch`` steps through the engine's shared step: a NaN loss skips the batch's step, warns, and
    the progress line goes on (one stage in-process; the agreement over stages is the norm's, summed over
    the pipeline, as ``test_pipe_engine.py``'s fp16 case checks)."""
    from zerospeed.testing.pipe_models import gpt_pipeline, lm_loss, rank_iterator, token_batches

    zerospeed.init_distributed()
    poison = [False]

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(logits, labels)
        return loss * NAN if poison[0] else loss

    module = gpt_pipeline(1, blocks=2)
    module.loss_fn = loss_fn
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "pipeline": {"schedule": "1f1b"}}
    engine, optimizer, *_ = zerospeed.initialize(model=module, config=config)
    batches = rank_iterator(token_batches(3, 2, 2), 0)
    engine.train_batch(batches)
    before = _snapshot(engine, optimizer)
    poison[0] = True
    with log_messages(logging.INFO) as lines:
        engine.train_batch(batches)
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(engine, optimizer), strict=True))
    assert not engine.was_step_applied() and engine.skipped_steps == 1
    assert lines[0] == "step 2 skipped: NaN loss (gradient norm nan, loss scale 1); 1 in a row, 1 in the run"
    assert lines[1].startswith("step 2  loss nan  lr 0.01  loss scale 1  skipped 1 (1 of the last 2)  ")
    poison[0] = False
    engine.train_batch(batches)
    assert engine.was_step_applied()
    # the loss value a non-finite step is named by records no autograd op, even on losses that carry a graph
    # (the interpreter keeps them detached; this must not depend on it)
    weight = next(module.parameters())
    assert engine.last_run is not None
    engine.last_run.losses = [weight.sum() * NAN, (weight.sum(),)]
    with _GraphOps() as ops:
        value = engine._window_loss_value()
    assert math.isnan(value) and ops.recorded == []


class _GraphOps(TorchFunctionMode):
    """Records the torch functions called in it whose result is part of an autograd graph."""

    def __init__(self) -> None:
        super().__init__()
        self.recorded: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.requires_grad:
            self.recorded.append(getattr(func, "__name__", str(func)))
        return out


def test_a_burst_that_ended_is_summarized_at_a_clean_step_once_the_interval_passed() -> None:
    """40 skips within 40 s, then finite steps: the 35 after the first 5 are summarized by the first finite
    step 60 s or more after the last line (not before: intermittent ones keep the log's rate), then nothing
    is left to say; an isolated later one is told the same way."""
    now = [0.0]
    steps = NonFiniteSteps(NonFinitePolicy(switch="x"), clock=lambda: now[0])

    def skip(step: int, at: float | None = None) -> str | None:
        now[0] = float(step) if at is None else at
        return steps.record(NonFiniteStep(step=step, reason=Reason.NAN_GRADIENT, norm=NAN, loss_scale=1.0,
                                          next_scale=1.0, skipped=True))

    assert [skip(n) is None for n in range(1, 41)] == [False] * 5 + [True] * 35
    assert steps.consecutive == 40
    now[0] = 41.0
    assert steps.clean_step() is None and steps.consecutive == 0
    now[0] = 64.9  # 59.9 s after the last line, at step 5
    assert steps.clean_step() is None
    now[0] = 65.0
    assert steps.clean_step() == (
        "35 steps skipped since the last report, steps 6-40 (35 NaN gradient); the last, step 40: NaN gradient "
        "(gradient norm nan, loss scale 1); finite steps since, 40 in the run (after the first 5 these are "
        "summarized every 100 steps or 60 s)")
    now[0] = 1000.0
    assert steps.clean_step() is None  # told once
    assert skip(41, at=200.0) == ("step 41 skipped: NaN gradient (gradient norm nan, loss scale 1); 1 in a row, 41 "
                                  "in the run")
    assert skip(42, at=201.0) is None
    now[0] = 259.0
    assert steps.clean_step() is None
    now[0] = 260.0
    assert steps.clean_step() == ("step 42 skipped: NaN gradient (gradient norm nan, loss scale 1); finite steps "
                                  "since, 42 in the run")


def test_the_engine_logs_the_summary_at_a_clean_step() -> None:
    """Seven NaN losses (5 lines), then a finite step a minute later: the engine logs the other two."""
    engine, *_ = zerospeed.initialize(model=TanhMLP(6, 11, 3), config=_config())
    now = [0.0]
    engine.nonfinite = NonFiniteSteps(engine.policy.nonfinite, clock=lambda: now[0])
    with log_messages(logging.WARNING) as warnings:
        for step in range(7):
            _train_step(engine, step, torch.float32, "loss")
        now[0] = 60.0
        _train_step(engine, 7, torch.float32)
    assert len(warnings) == 6 and warnings[-1] == (
        "2 steps skipped since the last report, steps 6-7 (2 NaN loss); the last, step 7: NaN loss (gradient norm "
        "nan, loss scale 1); finite steps since, 7 in the run (after the first 5 these are summarized every 100 "
        "steps or 60 s)")


def test_destroy_logs_the_skipped_steps_no_line_told_yet() -> None:
    """Seven NaN losses (5 lines, the rate limit holding back the rest), then the run ends: ``destroy``
    tells the other two, however little time has passed."""
    engine, *_ = zerospeed.initialize(model=TanhMLP(6, 11, 3), config=_config())
    engine.nonfinite = NonFiniteSteps(engine.policy.nonfinite, clock=lambda: 0.0)
    with log_messages(logging.WARNING) as warnings:
        for step in range(7):
            _train_step(engine, step, torch.float32, "loss")
        assert len(warnings) == 5
        engine.destroy()
    assert len(warnings) == 6 and warnings[-1].startswith(
        "2 steps skipped since the last report, steps 6-7 (2 NaN loss); the last, step 7: NaN loss"), warnings[-1]


def test_a_resume_restarts_the_count_of_consecutive_skips(tmp_path: Any) -> None:
    """Two skips, then a resume from a checkpoint: the run of skips counted for
    ``skipped_steps.raise_after_consecutive`` starts again at the resumed steps."""
    engine, *_ = zerospeed.initialize(model=TanhMLP(6, 11, 3),
                                      config=_config(skipped_steps={"raise_after_consecutive": 3}))
    _train_step(engine, 0, torch.float32)
    engine.save_checkpoint(str(tmp_path))
    _train_step(engine, 1, torch.float32, "loss")
    _train_step(engine, 2, torch.float32, "loss")
    assert engine.nonfinite.consecutive == 2
    engine.load_checkpoint(str(tmp_path))
    assert engine.nonfinite.consecutive == 0 and engine.global_steps == 1
    _train_step(engine, 1, torch.float32, "loss")
    _train_step(engine, 2, torch.float32, "loss")
    with pytest.raises(NonFiniteStepsError, match=r"3 steps in a row had a non-finite gradient norm, steps 2-4 "):
        _train_step(engine, 3, torch.float32, "loss")
