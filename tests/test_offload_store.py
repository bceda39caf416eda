"""StateStore tiers and the overlap decision: pure values, no processes."""

from __future__ import annotations

from typing import Any

import torch

from zerospeed.accelerator.cpu_accelerator import CPU_Accelerator
from zerospeed.config import load_config
from zerospeed.config.policies import ZeroPolicy
from zerospeed.offload.store import StateStore, Tier
from zerospeed.zero.eager import StepOverlap

CPU = torch.device("cpu")


def _zero(**zero: Any) -> ZeroPolicy:
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}, world_size=1)
    return ZeroPolicy.from_config(cfg.zero_optimization)


def test_tiers_follow_the_config() -> None:
    plain = StateStore.from_config(_zero(stage=3), CPU, CPU_Accelerator())
    assert not plain.offloads_optimizer and not plain.offloads_params
    assert plain.optimizer == plain.params == plain.compute == Tier("device", CPU)
    both = StateStore.from_config(_zero(stage=3, offload_optimizer={"device": "cpu"},
                                        offload_param={"device": "cpu", "pin_memory": True}), CPU, CPU_Accelerator())
    assert both.offloads_optimizer and both.offloads_params
    assert both.optimizer == both.params == Tier("cpu", CPU, pinned=False)  # nothing to pin for without CUDA
    assert "optimizer state: cpu (cpu)" in both.describe() and "parameter shards: cpu (cpu)" in both.describe()
    # parameters are only offloaded by stage 3 (DeepSpeed warns and ignores it below)
    stage2 = StateStore.from_config(_zero(stage=2, offload_optimizer={"device": "cpu"}), CPU, CPU_Accelerator())
    assert stage2.offloads_optimizer and not stage2.offloads_params and stage2.offload_ratio == 1.0


def test_ratio_keeps_the_first_units_on_the_device() -> None:
    store = StateStore.from_config(_zero(stage=3, offload_optimizer={"device": "cpu", "ratio": 0.25}), CPU,
                                   CPU_Accelerator())
    tiers = store.optimizer_tiers([10] * 8)
    assert [t.name for t in tiers] == ["device"] * 6 + ["cpu"] * 2
    assert [t.name for t in store.optimizer_tiers([70, 10, 10, 10])] == ["device", "cpu", "cpu", "cpu"]
    assert "for 25% of the elements" in store.describe()
    none = StateStore.from_config(_zero(stage=3, offload_optimizer={"device": "cpu", "ratio": 0.0}), CPU,
                                  CPU_Accelerator())
    assert {t.name for t in none.optimizer_tiers([5, 5, 5])} == {"device"}
    full = StateStore.from_config(_zero(stage=3, offload_optimizer={"device": "cpu"}), CPU, CPU_Accelerator())
    assert {t.name for t in full.optimizer_tiers([5, 5, 5])} == {"cpu"}


def test_tier_place_copies_only_when_needed() -> None:
    tier = Tier("cpu", CPU)
    t = torch.arange(4.0)
    assert tier.place(t) is t
    half = tier.place(t, torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half.float(), t)


def test_overlap_needs_nothing_global_before_the_update() -> None:
    ok = StepOverlap.decide(offloaded=True, clipping=0.0, loss_scaled=False, overflow_checked=False,
                            sub_group_size=1000)
    assert ok.enabled and ok.sub_group_elems == 1000 and "1,000 elements" in ok.reason
    clip = StepOverlap.decide(offloaded=True, clipping=1.0, loss_scaled=False, overflow_checked=False,
                              sub_group_size=1000)
    assert not clip.enabled and "gradient_clipping=1.0" in clip.reason
    for scaled, checked in ((True, True), (False, True)):
        no = StepOverlap.decide(offloaded=True, clipping=0.0, loss_scaled=scaled, overflow_checked=checked,
                                sub_group_size=1000)
        assert not no.enabled and ("fp16 loss scaling" if scaled else "check_grad_overflow") in no.reason
    assert not StepOverlap.decide(offloaded=False, clipping=0.0, loss_scaled=False, overflow_checked=False,
                                  sub_group_size=1000).enabled
    assert ok.without("Lamb").reason == "Lamb" and not ok.without("Lamb").enabled
