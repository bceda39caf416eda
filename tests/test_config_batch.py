"""Batch arithmetic: train = micro * grad_accum * world_size, as a pure function and via load."""

from __future__ import annotations

import pytest

from zerospeed.config import BatchSizes, ConfigError, load_config, resolve_batch


def sizes(train: int | None, micro: int | None, gas: int | None, ws: int) -> tuple[int, int, int]:
    out = resolve_batch(train, micro, gas, ws)
    assert out.world_size == ws
    return out.train_batch_size, out.train_micro_batch_size_per_gpu, out.gradient_accumulation_steps


@pytest.mark.parametrize("triple", [(32, 16, 1), (32, 8, 2)])
def test_consistent_triples_at_world_size_2(triple: tuple[int, int, int]) -> None:
    assert sizes(*triple, 2) == triple


def test_inconsistent_33_17_2() -> None:
    with pytest.raises(ConfigError) as err:
        resolve_batch(33, 17, 2, 2)
    assert str(err.value) == (
        "train_batch_size: 33 != train_micro_batch_size_per_gpu (17) * "
        "gradient_accumulation_steps (2) * world_size (2) = 68; consistent choices: "
        "train_batch_size = 68; or give only two of the three and let the third be derived")


def test_inconsistent_32_18_1() -> None:
    with pytest.raises(ConfigError) as err:
        resolve_batch(32, 18, 1, 2)
    assert str(err.value) == (
        "train_batch_size: 32 != train_micro_batch_size_per_gpu (18) * "
        "gradient_accumulation_steps (1) * world_size (2) = 36; consistent choices: "
        "train_batch_size = 36 or train_micro_batch_size_per_gpu = 16; or give only two of "
        "the three and let the third be derived")


def test_inconsistent_suggests_grad_accum_too() -> None:
    with pytest.raises(ConfigError, match=r"or gradient_accumulation_steps = 4;"):
        resolve_batch(32, 4, 3, 2)


def test_each_value_derived_from_the_other_two() -> None:
    assert sizes(None, 8, 2, 2) == (32, 8, 2)      # train from micro and accumulation
    assert sizes(32, None, 2, 2) == (32, 8, 2)     # micro from train and accumulation
    assert sizes(32, 8, None, 2) == (32, 8, 2)     # accumulation from train and micro
    assert sizes(32, 16, None, 2) == (32, 16, 1)


def test_single_value_means_accumulation_one() -> None:
    assert sizes(32, None, None, 2) == (32, 16, 1)
    assert sizes(None, 16, None, 2) == (32, 16, 1)
    assert sizes(None, 3, None, 1) == (3, 3, 1)


def test_not_divisible_when_deriving_accumulation() -> None:
    with pytest.raises(ConfigError) as err:
        resolve_batch(30, 4, None, 2)
    assert str(err.value) == (
        "train_batch_size: 30 is not divisible by train_micro_batch_size_per_gpu (4) * "
        "world_size (2) = 8, so gradient_accumulation_steps cannot be derived; consistent "
        "choices: train_batch_size = 24 (gradient_accumulation_steps = 3), "
        "train_batch_size = 32 (gradient_accumulation_steps = 4)")


def test_not_divisible_when_deriving_micro() -> None:
    with pytest.raises(ConfigError) as err:
        resolve_batch(33, None, 2, 2)
    assert str(err.value) == (
        "train_batch_size: 33 is not divisible by gradient_accumulation_steps (2) * "
        "world_size (2) = 4, so train_micro_batch_size_per_gpu cannot be derived; consistent "
        "choices: train_batch_size = 32 (train_micro_batch_size_per_gpu = 8), "
        "train_batch_size = 36 (train_micro_batch_size_per_gpu = 9)")


def test_train_alone_not_divisible_by_world_size() -> None:
    with pytest.raises(ConfigError) as err:
        resolve_batch(3, None, None, 2)
    assert str(err.value) == (
        "train_batch_size: 3 is not divisible by gradient_accumulation_steps (1, implied) * "
        "world_size (2) = 2, so train_micro_batch_size_per_gpu cannot be derived; consistent "
        "choices: train_batch_size = 2 (train_micro_batch_size_per_gpu = 1), "
        "train_batch_size = 4 (train_micro_batch_size_per_gpu = 2)")


def test_smaller_than_one_step_suggests_only_the_first_multiple() -> None:
    with pytest.raises(ConfigError, match=r"choices: train_batch_size = 8 "
                                          r"\(gradient_accumulation_steps = 1\)$"):
        resolve_batch(5, 4, None, 2)


def test_grad_accum_alone_is_an_error() -> None:
    with pytest.raises(ConfigError) as err:
        resolve_batch(None, None, 4, 2)
    assert str(err.value) == (
        "gradient_accumulation_steps: 4 alone does not determine the batch size; also give "
        "train_batch_size or train_micro_batch_size_per_gpu")


def test_nothing_given_is_an_error() -> None:
    with pytest.raises(ConfigError) as err:
        resolve_batch(None, None, None, 1)
    assert str(err.value) == (
        "train_batch_size: the batch size is not set; give train_batch_size and/or "
        'train_micro_batch_size_per_gpu (or "auto" for a caller to fill in)')


@pytest.mark.parametrize("ws", [0, -2])
def test_world_size_below_one(ws: int) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_batch(8, None, None, ws)
    assert str(err.value) == f"world_size: {ws} is out of range; expected an integer >= 1"


def test_batch_sizes_is_frozen_value() -> None:
    out = resolve_batch(32, 8, None, 2)
    assert out == BatchSizes(32, 8, 2, 2)
    with pytest.raises(Exception):
        out.train_batch_size = 1  # type: ignore[misc]


def test_load_config_runs_batch_arithmetic() -> None:
    cfg = load_config({"train_batch_size": 32, "gradient_accumulation_steps": 2}, world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == (32, 8, 2)
    with pytest.raises(ConfigError, match=r"^train_batch_size: 33 != "):
        load_config({"train_batch_size": 33, "train_micro_batch_size_per_gpu": 17,
                     "gradient_accumulation_steps": 2}, world_size=2)


def test_schema_rejects_non_positive_batch_values() -> None:
    with pytest.raises(ConfigError) as err:
        load_config({"train_batch_size": 0})
    assert str(err.value) == "train_batch_size: 0 is out of range; expected an integer >= 1"


def test_auto_batch_skips_arithmetic_until_resolved() -> None:
    cfg = load_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4},
                      world_size=2)
    assert cfg.train_batch_size is not None and str(cfg.train_batch_size) == "auto"
    assert cfg.gradient_accumulation_steps is None
    resolved = cfg.resolve_auto({"train_batch_size": 16})
    assert (resolved.train_batch_size, resolved.train_micro_batch_size_per_gpu,
            resolved.gradient_accumulation_steps) == (16, 4, 2)
    with pytest.raises(ConfigError, match=r"^train_batch_size: 15 is not divisible"):
        cfg.resolve_auto({"train_batch_size": 15})
