"""The ZeRO paper's model-state accounting, exactly (Ψ parameters, N ranks)."""

from __future__ import annotations

import pytest

from zerospeed.profiling import model_state_bytes

PSI, N = 100_000_000, 4


@pytest.mark.parametrize("stage, expected", [
    (0, 16 * PSI), (1, 4 * PSI + 12 * PSI // N), (2, 2 * PSI + 14 * PSI // N), (3, 16 * PSI // N)])
def test_paper_figures_for_mixed_precision_adam(stage: int, expected: int) -> None:
    assert model_state_bytes(PSI, stage=stage, world_size=N).total == expected


@pytest.mark.parametrize("stage, extra", [(0, 2 * PSI), (1, 2 * PSI), (2, 2 * PSI // N), (3, 2 * PSI // N)])
def test_fp32_gradient_accumulation_adds_two_bytes_per_gradient(stage: int, extra: int) -> None:
    base = model_state_bytes(PSI, stage=stage, world_size=N).total
    assert model_state_bytes(PSI, stage=stage, world_size=N, grad_bytes=4).total == base + extra


def test_parts_fp32_training_and_rounding() -> None:
    plan = model_state_bytes(PSI, stage=2, world_size=N)
    assert (plan.params, plan.grads, plan.optimizer_states) == (2 * PSI, 2 * PSI // N, 12 * PSI // N)
    fp32 = model_state_bytes(10, stage=0, world_size=3, param_bytes=4, grad_bytes=4, master_weights=False)
    assert (fp32.params, fp32.grads, fp32.optimizer_states) == (40, 40, 80)  # Adam: two fp32 moments
    odd = model_state_bytes(10, stage=3, world_size=3, optimizer="sgd_momentum")
    assert (odd.params, odd.grads, odd.optimizer_states) == (8, 8, 32)  # ceil(10/3) = 4 elements a rank


@pytest.mark.parametrize("kwargs, message", [
    (dict(stage=4, world_size=2), "stage=4 is not a ZeRO stage"),
    (dict(stage=1, world_size=0), "world_size=0 must be >= 1"),
    (dict(stage=1, world_size=2, optimizer="rmsprop"), "optimizer='rmsprop' is not one of"),
])
def test_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model_state_bytes(10, **kwargs)
