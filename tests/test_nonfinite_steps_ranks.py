"""A NaN loss on one rank skips the step on every rank (fp32; ZeRO stage 2, stage 3, and stage 1 with the
optimizer offloaded to the CPU, in one 2-rank job: the gradient shards differ per rank, so the agreement is
the global gradient norm's all-reduce, which every step already does); rank 0 names the NaN gradient it
sees, the rank with the NaN loss names the loss. (The in-process cases are in ``test_nonfinite_steps.py``;
a NaN on a pipeline's last stage only is in ``test_pipe_engine.py``.)"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import zerospeed
from zerospeed.testing import log_messages, run_distributed
from zerospeed.testing.models import TanhMLP


CASES: dict[str, dict[str, Any]] = {
    "stage 2": {"stage": 2},
    "stage 3": {"stage": 3},
    "stage 1, optimizer offloaded": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
}


def _nan_on_rank_one() -> dict[str, dict[str, Any]]:
    return {name: _case(zero) for name, zero in CASES.items()}


def _full_params(engine: Any) -> list[torch.Tensor]:
    """Every parameter whole (gathered at stage 3: collective), copied."""
    return [value.detach().clone() for _, value in engine.state.full_param_values()]


def _case(zero: dict[str, Any]) -> dict[str, Any]:
    rank = torch.distributed.get_rank()
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.05}}, "zero_optimization": zero}
    engine, optimizer, *_ = zerospeed.initialize(model=TanhMLP(6, 11, 3), config=config)
    facts: dict[str, Any] = {}
    for step in range(3):
        x = torch.randn(2, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        if step == 1:
            before = _full_params(engine)
            if rank == 1:
                x[1, 2] = float("nan")  # only this rank's data is bad
        with log_messages(logging.WARNING) as warnings:
            engine.backward(engine(x).pow(2).mean())
            engine.step()
        if step == 1:
            facts["warnings"] = warnings
            facts["applied"] = engine.was_step_applied()
            facts["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, _full_params(engine), strict=True))
        if step == 2:
            facts["next_changed"] = not all(torch.equal(a, b) for a, b in zip(before, _full_params(engine),
                                                                              strict=True))
    facts["skipped"], facts["steps"] = engine.skipped_steps, engine.global_steps
    facts["finite"] = all(bool(p.isfinite().all()) for p in _full_params(engine))
    engine.destroy()
    return facts


@pytest.mark.smoke
def test_a_nan_loss_on_one_rank_skips_the_step_on_every_rank() -> None:
    rank0, rank1 = run_distributed(_nan_on_rank_one, 2)
    common = {"applied": False, "unchanged": True, "next_changed": True, "skipped": 1, "steps": 3, "finite": True}
    for case in CASES:
        assert rank0[case] == {**common, "warnings": [
            "step 2 skipped: NaN gradient (gradient norm nan, loss scale 1); 1 in a row, 1 in the run"]}, case
        assert rank1[case] == {**common, "warnings": [
            "rank 1: step 2 skipped: NaN loss (gradient norm nan, loss scale 1); 1 in a row, 1 in the run"]}, case
