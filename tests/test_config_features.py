"""features_in_use / check_implemented: the engine can refuse what it does not implement."""

from __future__ import annotations

from typing import Any

import pytest

from zerospeed.config import check_implemented, features_in_use, load_config

BATCH = {"train_batch_size": 8, "gradient_clipping": 0.0}  # DeepSpeed 0.19.8 clips at 1.0 unless told


def test_default_config_clips_gradients_like_deepspeed() -> None:
    assert load_config({"train_batch_size": 8}).features_in_use() == ("gradient_clipping",)


def features(extra: dict[str, Any]) -> tuple[str, ...]:
    return load_config({**BATCH, **extra}).features_in_use()


def test_plain_config_uses_nothing() -> None:
    cfg = load_config(BATCH)
    assert cfg.features_in_use() == ()
    cfg.check_implemented(frozenset())


def test_precision_and_zero_features() -> None:
    assert features({"fp16": {"enabled": True, "auto_cast": True},
                     "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                           "offload_param": {"device": "nvme",
                                                             "nvme_path": "/n"}}}) == (
        "fp16", "fp16.auto_cast", "zero_optimization.stage=3",
        "zero_optimization.offload_optimizer.device=cpu",
        "zero_optimization.offload_param.device=nvme")


def test_optimizer_scheduler_and_training_features() -> None:
    assert features({"optimizer": {"type": "lamb"}, "scheduler": {"type": "OneCycle", "params": {
        "cycle_min_lr": 0, "cycle_max_lr": 1}}, "gradient_clipping": 1.0,
        "communication_data_type": "fp16", "prescale_gradients": True,
        "gradient_predivide_factor": 2.0, "sparse_gradients": True}) == (
        "optimizer.type=Lamb", "scheduler.type=OneCycle", "gradient_clipping",
        "communication_data_type=fp16", "gradient_predivide_factor", "prescale_gradients",
        "sparse_gradients")


def test_parallelism_monitoring_and_other_features() -> None:
    with pytest.warns(UserWarning):  # offload_param below stage 3 has no effect: warned
        found = features({
            "pipeline": {"stages": 2}, "activation_checkpointing": {"cpu_checkpointing": True},
            "flops_profiler": {"enabled": True}, "wall_clock_breakdown": True,
            "tensorboard": {"enabled": True}, "wandb": {"enabled": False},
            "csv_monitor": {"enabled": True}, "comms_logger": {"enabled": True},
            "progressive_layer_drop": {"enabled": True}, "compression_training": {},
            "checkpoint": {"load_universal": True},
            "zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}},
        })
    assert found == (
        "zero_optimization.stage=1", "pipeline",
        "activation_checkpointing.cpu_checkpointing", "flops_profiler", "tensorboard",
        "csv_monitor", "comms_logger", "wall_clock_breakdown", "checkpoint.load_universal",
        "progressive_layer_drop", "compression_training")


def test_defaults_are_not_features() -> None:
    # Present sections with default values ask for nothing.
    assert features({"zero_optimization": {"stage": 0, "overlap_comm": False},
                     "activation_checkpointing": {"partition_activations": False},
                     "tensorboard": {"enabled": False}, "fp16": {"enabled": False},
                     "aio": {"block_size": 1048576}, "gradient_clipping": 0}) == ()


def test_auto_counts_as_requested() -> None:
    assert features({"fp16": {"enabled": "auto"}, "zero_optimization": {"stage": "auto"}}) == (
        "fp16", "zero_optimization.stage=auto")


def test_check_implemented_raises_naming_every_missing_feature() -> None:
    cfg = load_config({**BATCH, "fp16": {"enabled": True}, "pipeline": {"stages": 2},
                       "flops_profiler": {"enabled": True},
                       "zero_optimization": {"stage": 2}})
    with pytest.raises(NotImplementedError) as err:
        cfg.check_implemented(frozenset({"fp16", "zero_optimization.stage=1"}))
    assert str(err.value) == (
        "zerospeed does not implement these requested config features yet: "
        "zero_optimization.stage=2, pipeline, flops_profiler")


def test_check_implemented_passes_when_everything_is_implemented() -> None:
    cfg = load_config({**BATCH, "fp16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    check_implemented(cfg, frozenset({"fp16", "zero_optimization.stage=2"}))
    check_implemented(cfg, {"fp16", "zero_optimization.stage=*"})  # wildcard over values
    assert features_in_use(cfg) == cfg.features_in_use() == ("fp16", "zero_optimization.stage=2")


def test_wildcard_does_not_cover_plain_keys() -> None:
    cfg = load_config({**BATCH, "pipeline": {"stages": 2}})
    with pytest.raises(NotImplementedError, match=r": pipeline$"):
        cfg.check_implemented(frozenset({"pipeline=*"}))


def test_elasticity_is_a_feature_and_derives_the_batch() -> None:
    # As DeepSpeed, the elasticity section decides the batch (zerospeed.elasticity; see test_elasticity.py),
    # and the feature is still reported by name (the engine lists it as implemented).
    cfg = load_config({"gradient_clipping": 0.0, "elasticity": {"enabled": True, "max_train_batch_size": 2000,
                                      "micro_batch_sizes": [2, 4, 6], "min_gpus": 1,
                                      "max_gpus": 10000, "version": 0.1}})
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (1680, 6, 280)
    assert cfg.features_in_use() == ("elasticity",)
    with pytest.raises(NotImplementedError, match=r": elasticity$"):
        cfg.check_implemented(frozenset())


def test_stage_specific_zero_knobs_only_count_at_their_stage() -> None:
    # HF-style stage-2 configs often carry stage-3 keys; DeepSpeed ignores them there.
    assert features({"zero_optimization": {
        "stage": 2, "stage3_gather_16bit_weights_on_model_save": True,
        "zero_quantized_weights": True, "round_robin_gradients": True}}) == (
        "zero_optimization.stage=2", "zero_optimization.round_robin_gradients")
    assert features({"zero_optimization": {
        "stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
        "zero_quantized_weights": True, "round_robin_gradients": True,
        "zero_hpz_partition_size": 8}}) == (
        "zero_optimization.stage=3", "zero_optimization.zero_quantized_weights",
        "zero_optimization.zero_hpz_partition_size",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save")
    # Optimizer offload is reported at every stage (DeepSpeed builds a CPU optimizer even
    # at stage 0), so an engine without it refuses instead of silently not offloading.
    assert features({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}
                    ) == ("zero_optimization.offload_optimizer.device=cpu",)
