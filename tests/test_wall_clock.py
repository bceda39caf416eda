"""``wall_clock_breakdown``: forward, backward (its inner autograd part and its wait on the gradient
reduction) and step timed under DeepSpeed 0.19.6's timer names, logged each ``steps_per_print`` steps
as DeepSpeed's two lines (per micro-batch, per optimizer step); each step's own times feed the monitors."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.profiling.timers import NoTimers, WallClockTimers
from zerospeed.testing import log_messages, run_distributed


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_phases_are_summed_synchronized_and_reported_under_deepspeeds_names() -> None:
    clock, syncs = FakeClock(), []
    timers = WallClockTimers(synchronize=lambda: syncs.append(clock.now), clock=clock)
    windows = []
    for _ in range(2):  # two steps of two micro-batches each, timed as the engine brackets them
        for _ in range(2):
            with timers.phase("forward"):
                clock.now += 0.003
            with timers.phase("backward"):
                with timers.phase("backward_inner"):
                    clock.now += 0.004
                with timers.phase("backward_allreduce"):
                    clock.now += 0.001
            with timers.phase("step"):
                clock.now += 0.001
        with timers.phase("step"):
            with timers.phase("backward_allreduce"):  # the wait on the window's reduction, in the step
                clock.now += 0.002
            clock.now += 0.008
        windows.append(timers.window_ms())
    assert len(syncs) == 2 * 2 * (2 * 5 + 2)  # before and after every phase: 12 per step
    per_step = {"forward": 6.0, "backward": 10.0, "backward_inner": 8.0, "backward_allreduce": 4.0, "step": 12.0}
    for window in windows:  # each optimizer step's own times (the monitors' elapsed_time_ms_*)
        assert window == pytest.approx(per_step)
    assert timers.window_ms() == dict.fromkeys(per_step, 0.0)
    assert timers.report(2, 4).splitlines() == [
        "time (ms) | fwd_microstep: 3.00 | bwd_microstep: 5.00 | bwd_inner_microstep: 4.00 | "
        "bwd_allreduce_microstep: 2.00 | step_microstep: 6.00",
        "time (ms) | fwd: 6.00 | bwd: 10.00 | bwd_inner: 8.00 | bwd_allreduce: 4.00 | step: 12.00"]
    assert timers.report(2).splitlines()[1] == ("time (ms) | fwd: 0.00 | bwd: 0.00 | bwd_inner: 0.00 | "
                                                "bwd_allreduce: 0.00 | step: 0.00")
    with pytest.raises(ValueError, match="unknown timed phase 'optimizer'; the phases are forward, backward, "
                                         "backward_inner, backward_allreduce, step"):
        with timers.phase("optimizer"):
            pass


def test_no_timers_cost_nothing_and_report_nothing() -> None:
    timers = NoTimers()
    assert timers.phase("forward") is timers.phase("step")  # one shared null context, nothing made per call
    with timers.phase("forward"):
        pass
    assert timers.report(5) is None and timers.window_ms() is None


def _train(breakdown: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    with log_messages() as records:
        engine, *_ = zerospeed.initialize(model=nn.Linear(8, 8), config={
            "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 2,
            "wall_clock_breakdown": breakdown, "optimizer": {"type": "Adam", "params": {"lr": 0.01}}})
        for _ in range(4 * 2):
            engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
            engine.step()
    return {"type": type(engine.timers).__name__, "lines": [r for r in records if "time (ms)" in r]}


def test_engine_logs_the_breakdown_every_steps_per_print() -> None:
    on, off = run_distributed(_train, 1, True)[0], run_distributed(_train, 1, False)[0]
    assert (on["type"], off["type"]) == ("WallClockTimers", "NoTimers")
    assert off["lines"] == []
    assert [line.split("  ")[0] for line in on["lines"]] == ["step 2", "step 2", "step 4", "step 4"]
    number = r"([\d.]+)"
    micro = re.compile(r"step \d+  time \(ms\) \| " + " \\| ".join(
        f"{name}_microstep: {number}" for name in ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")))
    whole = re.compile(r"step \d+  time \(ms\) \| " + " \\| ".join(
        f"{name}: {number}" for name in ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")))
    for micro_line, step_line in zip(on["lines"][::2], on["lines"][1::2]):
        per_micro, per_step = micro.fullmatch(micro_line), whole.fullmatch(step_line)
        assert per_micro is not None and per_step is not None, (micro_line, step_line)
        assert sum(float(x) for x in per_step.groups()) > 0  # (each may round to 0.00 ms on a tiny model)
        # two micro-batches per step: each global figure is twice its per-micro-batch mean (to rounding)
        for a, b in zip(per_micro.groups(), per_step.groups()):
            assert float(b) == pytest.approx(2 * float(a), abs=0.011)
