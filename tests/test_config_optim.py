"""``optimizer`` and ``scheduler``: type names, strict params, defaults, torch classes."""

from __future__ import annotations

from typing import Any

import pytest

from zerospeed.config import (
    AUTO,
    DEEPSPEED_OPTIMIZERS,
    DEEPSPEED_SCHEDULERS,
    ConfigError,
    FrozenDict,
    load_config,
)

BATCH = {"train_batch_size": 8}


def load(extra: dict[str, Any]):
    return load_config({**BATCH, **extra})


def problems(extra: dict[str, Any]) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as err:
        load(extra)
    return err.value.problems


@pytest.mark.parametrize("spelling,canonical", [
    ("Adam", "Adam"), ("adam", "Adam"), ("ADAMW", "AdamW"), ("AdamW", "AdamW"),
    ("lamb", "Lamb"), ("OneBitAdam", "OneBitAdam"), ("onebitadam", "OneBitAdam"),
    ("ZeroOneAdam", "ZeroOneAdam"), ("OneBitLamb", "OneBitLamb"), ("Adagrad", "Adagrad"),
    ("Lion", "Lion"), ("MuAdam", "MuAdam"), ("muadamw", "MuAdamW"), ("MuSGD", "MuSGD"),
    ("Muon", "Muon"),
])
def test_deepspeed_optimizer_names_case_insensitive(spelling: str, canonical: str) -> None:
    cfg = load({"optimizer": {"type": spelling}})
    assert cfg.optimizer is not None
    assert cfg.optimizer.type == canonical
    assert cfg.optimizer.is_deepspeed_type
    assert cfg.optimizer.params == {}


def test_torch_optimizer_class_names() -> None:
    cfg = load({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9,
                                                        "nesterov": True}}})
    assert cfg.optimizer is not None
    assert cfg.optimizer.type == "SGD"
    assert not cfg.optimizer.is_deepspeed_type
    assert dict(cfg.optimizer.params) == {"lr": 0.1, "momentum": 0.9, "nesterov": True}
    rms = load({"optimizer": {"type": "RMSprop"}}).optimizer
    assert rms is not None and rms.type == "RMSprop"


def test_torch_optimizer_params_checked_against_signature() -> None:
    assert problems({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentun": 0.9}}}) == (
        "optimizer.params.momentun: unknown key; did you mean momentum?",)
    assert problems({"optimizer": {"type": "SGD", "params": {"nesterov": "yes"}}}) == (
        'optimizer.params.nesterov: "yes" is a string; expected true or false',)
    assert problems({"optimizer": {"type": "RMSprop", "params": {"alpha": True}}}) == (
        "optimizer.params.alpha: true is a boolean; expected a number",)


def test_unknown_optimizer_type() -> None:
    assert problems({"optimizer": {"type": "Adamm"}}) == (
        'optimizer.type: "Adamm" is not a DeepSpeed optimizer nor a torch class; '
        "did you mean Adam?",)
    # torch class names are case-sensitive, as in DeepSpeed; the right spelling is suggested.
    assert problems({"optimizer": {"type": "sgd"}}) == (
        'optimizer.type: "sgd" is not a DeepSpeed optimizer nor a torch class; '
        "did you mean SGD?",)


def test_optimizer_type_required() -> None:
    assert problems({"optimizer": {"params": {"lr": 1}}}) == (
        "optimizer.type: required key is missing",)


def test_known_optimizer_params_are_strict() -> None:
    assert problems({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decya": 0.1,
                                                               "betas": [0.9, 1.5]}}}) == (
        "optimizer.params.weight_decya: unknown key; did you mean weight_decay?",
        "optimizer.params.betas: 1.5 is out of range; expected a number >= 0 and < 1",
    )
    assert problems({"optimizer": {"type": "Adam", "params": {"lr": -1}}}) == (
        "optimizer.params.lr: -1 is out of range; expected a number >= 0",)
    assert problems({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}) == (
        "optimizer.params.betas: [0.9] is not a pair; expected an array of two numbers, each "
        ">= 0 and < 1",)


@pytest.mark.parametrize("kind", ["Adam", "Lamb", "SGD"])
def test_max_grad_norm_is_the_old_spelling_of_gradient_clipping(kind: str) -> None:
    """DeepSpeed's 2020 configs clip with optimizer.params.max_grad_norm: read as gradient_clipping."""
    with pytest.warns(DeprecationWarning, match=r"optimizer\.params\.max_grad_norm is deprecated.*"
                                                r'"gradient_clipping": 0\.5'):
        cfg = load({"optimizer": {"type": kind, "params": {"lr": 0.1, "max_grad_norm": 0.5}}})
    assert cfg.gradient_clipping == 0.5
    assert cfg.optimizer is not None and dict(cfg.optimizer.params) == {"lr": 0.1}
    with pytest.warns(DeprecationWarning):  # the same value in both places is fine
        same = load({"gradient_clipping": 0.5, "optimizer": {"type": kind, "params": {"max_grad_norm": 0.5}}})
    assert same.gradient_clipping == 0.5 and "max_grad_norm" not in same.optimizer.params


def test_max_grad_norm_that_disagrees_or_is_not_a_norm_is_an_error() -> None:
    assert problems({"gradient_clipping": 1.0, "optimizer": {"type": "Adam", "params": {"max_grad_norm": 2}}}) == (
        "optimizer.params.max_grad_norm (2) and gradient_clipping (1.0) disagree; max_grad_norm is the old "
        "spelling of gradient_clipping: remove it and keep the value you want in gradient_clipping",)
    assert problems({"optimizer": {"type": "Lamb", "params": {"max_grad_norm": -1}}}) == (
        "optimizer.params.max_grad_norm: -1 is not a norm; expected a number >= 0 (it is the old spelling "
        "of the top-level gradient_clipping)",)


def test_optimizer_params_are_immutable_and_only_what_was_given() -> None:
    cfg = load({"optimizer": {"type": "Adam", "params": {"lr": 1, "betas": [0.9, 0.999],
                                                         "torch_adam": True}}})
    params = cfg.optimizer.params  # type: ignore[union-attr]
    assert isinstance(params, FrozenDict)
    assert dict(params) == {"lr": 1.0, "betas": (0.9, 0.999), "torch_adam": True}
    assert isinstance(params["lr"], float)
    with pytest.raises(TypeError):
        params["lr"] = 2  # type: ignore[index]
    assert hash(params) == hash(FrozenDict({"lr": 1.0, "betas": (0.9, 0.999), "torch_adam": True}))


def test_optimizer_params_accept_auto() -> None:
    cfg = load({"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}}})
    assert cfg.optimizer is not None and cfg.optimizer.params["lr"] is AUTO
    assert cfg.optimizer.params["betas"] is AUTO


def test_onebit_optimizers_run_at_zero_stages_0_to_2_and_refuse_stage_3_and_offload() -> None:
    for stage in (0, 1, 2):
        load({"optimizer": {"type": "OneBitLamb"}, "zero_optimization": {"stage": stage}})
    assert problems({"optimizer": {"type": "OneBitLamb"}, "zero_optimization": {"stage": 3}}) == (
        'optimizer.type: "OneBitLamb" cannot be combined with ZeRO stage 3: once it compresses, every rank '
        "needs the whole momentum and updates its whole parameters, which stage 3 never holds; use "
        "zero_optimization.stage 0, 1 or 2",)
    load({"optimizer": {"type": "ZeroOneAdam"},  # no effect below stage 3: accepted as for any optimizer
          "zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}}})
    assert problems({"optimizer": {"type": "ZeroOneAdam"},
                     "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}) == (
        'zero_optimization.offload_optimizer.device: "cpu" cannot be combined with "ZeroOneAdam": once it '
        "compresses, its state is whole on every rank and steps there; remove zero_optimization.offload_optimizer",)


def test_every_deepspeed_optimizer_declares_lr() -> None:
    assert all("lr" in spec for _, spec in DEEPSPEED_OPTIMIZERS.values())


def test_warmup_lr_defaults_filled_in() -> None:
    cfg = load({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.001}}})
    assert cfg.scheduler is not None
    assert cfg.scheduler.type == "WarmupLR"
    assert dict(cfg.scheduler.params) == {"warmup_max_lr": 0.001, "warmup_min_lr": 0.0,
                                          "warmup_num_steps": 1000, "warmup_type": "log",
                                          "last_batch_iteration": -1}
    # warmup_max_lr defaults to the optimizer's lr (None), so it is left out when absent.
    bare = load({"scheduler": {"type": "WarmupLR"}}).scheduler
    assert bare is not None and "warmup_max_lr" not in bare.params


def test_warmup_decay_and_cosine_defaults() -> None:
    decay = load({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10000}}})
    assert dict(decay.scheduler.params) == {  # type: ignore[union-attr]
        "total_num_steps": 10000, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
        "warmup_num_steps": 1000, "warmup_type": "log", "last_batch_iteration": -1}
    with pytest.warns(UserWarning, match=r"total_num_steps \(10\) is less than"):
        cosine = load({"scheduler": {"type": "WarmupCosineLR",
                                     "params": {"total_num_steps": 10}}})
    assert dict(cosine.scheduler.params) == {  # type: ignore[union-attr]
        "total_num_steps": 10, "warmup_min_ratio": 0.0, "cos_min_ratio": 0.0001,
        "warmup_num_steps": 1000, "warmup_type": "log", "last_batch_iteration": -1}


def test_one_cycle_and_range_test_defaults() -> None:
    one = load({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.001,
                                                             "cycle_max_lr": 0.01}}})
    assert dict(one.scheduler.params) == {  # type: ignore[union-attr]
        "cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "decay_lr_rate": 0.0,
        "cycle_first_step_size": 2000, "cycle_first_stair_count": 0, "decay_step_size": 0,
        "cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9,
        "decay_mom_rate": 0.0, "last_batch_iteration": -1}
    rng = load({"scheduler": {"type": "LRRangeTest"}})
    assert dict(rng.scheduler.params) == {  # type: ignore[union-attr]
        "lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 2000,
        "lr_range_test_step_rate": 1.0, "lr_range_test_staircase": False,
        "last_batch_iteration": -1}


def test_scheduler_required_params() -> None:
    assert problems({"scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 0.1}}}) == (
        "scheduler.params.cycle_min_lr: required key is missing",)
    assert problems({"scheduler": {"type": "WarmupDecayLR"}}) == (
        "scheduler.params.total_num_steps: required key is missing",)


def test_scheduler_params_strict() -> None:
    assert problems({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 5}}}) == (
        "scheduler.params.warmup_num_step: unknown key; did you mean warmup_num_steps?",)
    assert problems({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}) == (
        "scheduler.params.warmup_num_steps: 0 is out of range; expected an integer >= 1",)
    assert problems({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}}) == (
        'scheduler.params.warmup_type: "cosine" is not allowed; expected one of "log", '
        '"linear"',)


def test_scheduler_per_group_bounds() -> None:
    cfg = load({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": [0, 0.1],
                                                             "warmup_max_lr": [1, 2]}}})
    assert cfg.scheduler.params["warmup_min_lr"] == (0.0, 0.1)  # type: ignore[union-attr]
    assert cfg.scheduler.params["warmup_max_lr"] == (1.0, 2.0)  # type: ignore[union-attr]


def test_scheduler_type_is_case_sensitive_like_deepspeed() -> None:
    assert problems({"scheduler": {"type": "warmuplr"}}) == (
        'scheduler.type: "warmuplr" is not a DeepSpeed LR schedule nor a torch class; '
        "did you mean WarmupLR?",)


def test_torch_lr_scheduler_class() -> None:
    cfg = load({"scheduler": {"type": "StepLR", "params": {"step_size": 10, "gamma": 0.5}}})
    assert cfg.scheduler is not None and not cfg.scheduler.is_deepspeed_type
    assert dict(cfg.scheduler.params) == {"step_size": 10, "gamma": 0.5}
    assert problems({"scheduler": {"type": "StepLR", "params": {"gamma": 0.5}}}) == (
        "scheduler.params.step_size: required key is missing",)


def test_all_deepspeed_schedules_known() -> None:
    assert sorted(DEEPSPEED_SCHEDULERS) == ["LRRangeTest", "OneCycle", "WarmupCosineLR",
                                            "WarmupDecayLR", "WarmupLR"]


def test_unknown_type_without_close_match_lists_choices() -> None:
    (line,) = problems({"scheduler": {"type": "Zzzzz"}})
    assert line.startswith('scheduler.type: "Zzzzz" is not a DeepSpeed LR schedule nor a torch '
                           "class; expected one of ")
    assert "WarmupLR" in line and "StepLR" in line
