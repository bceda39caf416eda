"""``"auto"``: an explicit value, listed, resolved in one place, and required to be gone."""

from __future__ import annotations

import json
import pathlib

import pytest

from zerospeed.config import AUTO, Auto, ConfigError, OffloadDevice, load_config

DATA = pathlib.Path(__file__).parent / "data"

HF_VALUES = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 4,
    "optimizer.params.lr": 1e-4,
    "optimizer.params.betas": (0.9, 0.98),
    "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0,
    "scheduler.params.warmup_min_lr": 0,
    "scheduler.params.warmup_max_lr": 1e-4,
    "scheduler.params.warmup_num_steps": 100,
    "scheduler.params.total_num_steps": 1000,
    "gradient_clipping": 1.0,
    "fp16.enabled": False,
    "bf16.enabled": True,
    "zero_optimization.reduce_bucket_size": 1_000_000,
    "zero_optimization.stage3_prefetch_bucket_size": 900_000,
    "zero_optimization.stage3_param_persistence_threshold": 10_000,
}

HF_AUTO_PATHS = [
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps",
    "optimizer.params.weight_decay", "scheduler.params.warmup_min_lr",
    "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps",
    "scheduler.params.total_num_steps", "gradient_clipping", "fp16.enabled", "bf16.enabled",
    "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
]


def hf_config(world_size: int = 2):
    return load_config(DATA / "ds_hf_zero3_auto.json", world_size=world_size)


def test_auto_is_a_typed_sentinel() -> None:
    cfg = hf_config()
    assert cfg.train_batch_size is AUTO
    assert isinstance(cfg.gradient_clipping, Auto)
    assert cfg.optimizer is not None and cfg.optimizer.params["lr"] is AUTO
    assert cfg.zero_optimization.prefetch_bucket_size is AUTO
    assert cfg.zero_optimization.stage3_prefetch_bucket_size is AUTO
    assert repr(AUTO) == "AUTO" and str(AUTO) == "auto"


def test_unresolved_auto_lists_every_auto_key() -> None:
    assert hf_config().unresolved_auto() == HF_AUTO_PATHS


def test_require_resolved_lists_every_auto_key() -> None:
    with pytest.raises(ConfigError) as err:
        hf_config().require_resolved()
    assert err.value.problems == tuple(f'{p}: "auto" has not been resolved' for p in HF_AUTO_PATHS)


def test_resolve_auto_returns_a_new_resolved_config() -> None:
    cfg = hf_config()
    resolved = cfg.resolve_auto(HF_VALUES)
    assert resolved is not cfg
    assert cfg.train_batch_size is AUTO  # the original is untouched
    assert resolved.unresolved_auto() == []
    resolved.require_resolved()
    assert resolved.world_size == 2
    assert (resolved.train_batch_size, resolved.train_micro_batch_size_per_gpu,
            resolved.gradient_accumulation_steps) == (64, 8, 4)
    assert resolved.optimizer is not None and dict(resolved.optimizer.params) == {
        "lr": 1e-4, "betas": (0.9, 0.98), "eps": 1e-8, "weight_decay": 0.0}
    assert resolved.scheduler is not None and dict(resolved.scheduler.params) == {
        "warmup_min_lr": 0.0, "warmup_max_lr": 1e-4, "warmup_num_steps": 100,
        "total_num_steps": 1000, "warmup_type": "log", "last_batch_iteration": -1}
    assert resolved.precision == "bf16"
    assert resolved.gradient_clipping == 1.0
    zero = resolved.zero_optimization
    assert (zero.reduce_bucket_size, zero.prefetch_bucket_size,
            zero.param_persistence_threshold) == (1_000_000, 900_000, 10_000)
    assert zero.offload_param.device == OffloadDevice.CPU


def test_resolve_auto_reruns_batch_arithmetic() -> None:
    values = {**HF_VALUES, "train_batch_size": 60}
    with pytest.raises(ConfigError, match=r"^train_batch_size: 60 != "):
        hf_config().resolve_auto(values)


def test_resolve_auto_validates_the_new_values() -> None:
    with pytest.raises(ConfigError) as err:
        hf_config().resolve_auto({**HF_VALUES, "gradient_clipping": -1})
    assert str(err.value) == "gradient_clipping: -1 is out of range; expected a number >= 0"


def test_resolve_auto_accepts_alias_paths() -> None:
    values = dict(HF_VALUES)
    values.pop("bf16.enabled")
    values.pop("zero_optimization.stage3_prefetch_bucket_size")
    values["bfloat16.enabled"] = True
    values["zero_optimization.prefetch_bucket_size"] = 123
    resolved = hf_config().resolve_auto(values)
    assert resolved.bf16.enabled is True
    assert resolved.zero_optimization.prefetch_bucket_size == 123


def test_resolve_auto_rejects_keys_that_are_not_auto() -> None:
    with pytest.raises(ConfigError) as err:
        hf_config().resolve_auto({"steps_per_print": 3, "zero_optimization.stage": 2,
                                  "nope.x": 1})
    assert err.value.problems == (
        'steps_per_print: 2000 is not "auto"; only "auto" values can be resolved',
        'zero_optimization.stage: 3 is not "auto"; only "auto" values can be resolved',
        'nope.x: no such key in this config; only keys whose value is "auto" can be resolved',
    )


def test_partial_resolution_keeps_other_autos() -> None:
    resolved = hf_config().resolve_auto({"gradient_clipping": 0.5, "fp16.enabled": False})
    assert resolved.gradient_clipping == 0.5
    assert "gradient_clipping" not in resolved.unresolved_auto()
    assert "bf16.enabled" in resolved.unresolved_auto()


def test_auto_allowed_places() -> None:
    cfg = load_config({
        "train_batch_size": "auto", "gradient_clipping": "auto",
        "fp16": {"enabled": "auto"}, "amp": {"enabled": "auto", "opt_level": "auto"},
        "zero_optimization": {"stage": "auto", "reduce_bucket_size": "auto",
                              "stage3_gather_16bit_weights_on_model_save": "auto",
                              "offload_optimizer": {"device": "auto"}},
        "pipeline": {"stages": "auto"},
    })
    assert cfg.unresolved_auto() == [
        "train_batch_size", "gradient_clipping", "fp16.enabled", "amp.enabled",
        "amp.opt_level", "zero_optimization.stage", "zero_optimization.reduce_bucket_size",
        "zero_optimization.offload_optimizer.device",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save", "pipeline.stages"]
    # An "auto" stage leaves the stage-dependent overlap_comm default undecided too.
    assert cfg.zero_optimization.overlap_comm is None
    resolved = cfg.resolve_auto({"train_batch_size": 4, "zero_optimization.stage": 3})
    assert resolved.zero_optimization.overlap_comm is True


def test_pipeline_stages_defaults_to_auto() -> None:
    cfg = load_config({"train_batch_size": 4, "pipeline": {}})
    assert cfg.pipeline is not None and cfg.pipeline.stages is AUTO
    assert cfg.unresolved_auto() == ["pipeline.stages"]
    assert cfg.resolve_auto({"pipeline.stages": 2}).pipeline.stages == 2  # type: ignore[union-attr]


def test_auto_survives_to_json_round_trip() -> None:
    cfg = hf_config(world_size=1)
    text = cfg.to_json()
    assert json.loads(text)["optimizer"]["params"]["lr"] == "auto"
    assert load_config(json.loads(text)) == cfg
