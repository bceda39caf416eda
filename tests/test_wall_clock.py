"""``wall_clock_breakdown``: forward, backward and step timed, their means per step logged each
``steps_per_print`` steps (DeepSpeed's switch; the 2020 BERT config turns it on)."""

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


def test_phases_are_summed_synchronized_and_reported_per_step() -> None:
    clock, syncs = FakeClock(), []
    timers = WallClockTimers(synchronize=lambda: syncs.append(clock.now), clock=clock)
    for _ in range(2):  # two steps of two micro-batches each
        for _ in range(2):
            with timers.phase("forward"):
                clock.now += 0.003
            with timers.phase("backward"):
                clock.now += 0.005
        with timers.phase("step"):
            clock.now += 0.010
    assert len(syncs) == 2 * 10  # before and after every phase
    assert timers.report(2) == "time (ms) per step, mean of 2 | forward: 6.00 | backward: 10.00 | step: 10.00"
    assert timers.report(2) == "time (ms) per step, mean of 2 | forward: 0.00 | backward: 0.00 | step: 0.00"
    with pytest.raises(ValueError, match="unknown timed phase 'optimizer'; the phases are forward, backward, step"):
        with timers.phase("optimizer"):
            pass


def test_no_timers_cost_nothing_and_report_nothing() -> None:
    timers = NoTimers()
    with timers.phase("forward"):
        pass
    assert timers.report(5) is None


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
    assert [line.split("  ")[0] for line in on["lines"]] == ["step 2", "step 4"]
    for line in on["lines"]:
        figures = re.fullmatch(r"step \d+  time \(ms\) per step, mean of 2 \| forward: ([\d.]+) \| "
                               r"backward: ([\d.]+) \| step: ([\d.]+)", line)
        assert figures is not None, line
        assert sum(float(x) for x in figures.groups()) > 0  # (each may round to 0.00 ms on a tiny model)
