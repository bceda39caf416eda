"""Loss scalers: exact scale sequences for scripted overflow patterns (DeepSpeed 0.19.8's
``DynamicLossScaler``; the sequences were cross-checked against it), overflow detection
and config construction."""

from __future__ import annotations

import pytest
import torch

from zerospeed.config import load_config
from zerospeed.precision.loss_scale import (
    DynamicScaler,
    LossScaleAtMinimumError,
    NoScaler,
    StaticScaler,
    find_inf_or_nan,
    from_config,
    has_inf_or_nan,
)

T, F = True, False


def run(scaler, pattern):
    """Scale after each update of ``pattern``."""
    out = []
    for overflow in pattern:
        scaler.update(overflow)
        out.append(scaler.cur_scale)
    return out


# -- all overflow / min scale ------------------------------------------------------------

def test_all_overflow_halves_each_step_then_raises_at_min_scale():
    s = DynamicScaler(init_scale=16, scale_window=1000, min_scale=1, delayed_shift=1)
    assert run(s, [T] * 4) == [8, 4, 2, 1]
    with pytest.raises(LossScaleAtMinimumError, match="min_loss_scale = 1"):
        s.update(True)
    assert s.cur_scale == 1 and s.cur_iter == 4  # the failed update changed nothing


def test_all_overflow_never_goes_below_min_scale_without_raising():
    s = DynamicScaler(init_scale=16, min_scale=1, delayed_shift=1,
                      raise_error_at_min_scale=False)
    assert run(s, [T] * 7) == [8, 4, 2, 1, 1, 1, 1]


def test_min_scale_that_is_not_a_power_of_two_is_a_floor():
    s = DynamicScaler(init_scale=16, min_scale=3, delayed_shift=1)
    assert run(s, [T] * 3) == [8, 4, 3]
    with pytest.raises(LossScaleAtMinimumError):
        s.update(True)


def test_all_overflow_with_default_hysteresis_waits_one_step_first():
    s = DynamicScaler(init_scale=16, min_scale=1, delayed_shift=2)
    assert run(s, [T] * 5) == [16, 8, 4, 2, 1]
    assert s.cur_hysteresis == 1


def test_hysteresis_left_at_min_scale_decrements_instead_of_raising():
    s = DynamicScaler(init_scale=4, min_scale=4, delayed_shift=2)
    s.update(True)
    assert (s.cur_scale, s.cur_hysteresis) == (4, 1)
    with pytest.raises(LossScaleAtMinimumError):
        s.update(True)


# -- window growth ----------------------------------------------------------------------

def test_window_growth_from_the_start():
    # DeepSpeed counts the clean run as cur_iter - last_overflow_iter - 1 with
    # last_overflow_iter = -1 at start: the first doubling comes at update 4 (index 3)
    # for scale_window 3, then every 3 updates.
    s = DynamicScaler(init_scale=16, scale_window=3)
    assert run(s, [F] * 10) == [16, 16, 16, 32, 32, 32, 64, 64, 64, 128]


def test_window_growth_after_an_overflow():
    s = DynamicScaler(init_scale=16, scale_window=3, delayed_shift=1)
    assert run(s, [T] + [F] * 8) == [8, 8, 8, 8, 16, 16, 16, 32, 32]
    assert s.last_overflow_iter == 0


def test_overflow_restarts_the_window():
    s = DynamicScaler(init_scale=16, scale_window=3, delayed_shift=1)
    assert run(s, [F, F, T, F, F, F, F]) == [16, 16, 8, 8, 8, 8, 16]


def test_window_growth_refills_hysteresis():
    s = DynamicScaler(init_scale=16, scale_window=2, delayed_shift=2)
    assert run(s, [T, F, F, F]) == [16, 16, 16, 32]
    assert s.cur_hysteresis == 2
    assert run(s, [T]) == [32]  # hysteresis absorbs the next overflow again


# -- hysteresis -------------------------------------------------------------------------

def test_hysteresis_needs_that_many_overflows_before_halving():
    s = DynamicScaler(init_scale=1024, scale_window=100, delayed_shift=3)
    assert run(s, [T, T, T, T]) == [1024, 1024, 512, 256]
    assert s.cur_hysteresis == 1


def test_plain_hysteresis_is_not_restored_by_a_clean_step():
    s = DynamicScaler(init_scale=1024, scale_window=100, delayed_shift=3)
    assert run(s, [T, F, T, F, T, F, T]) == [1024, 1024, 1024, 1024, 512, 512, 256]


def test_consecutive_hysteresis_is_restored_by_a_clean_step():
    s = DynamicScaler(init_scale=1024, scale_window=100, delayed_shift=3,
                      consecutive_hysteresis=True)
    assert run(s, [T, F, T, F, T, F, T]) == [1024] * 7
    assert s.cur_hysteresis == 2
    assert run(s, [T, T]) == [1024, 512]


def test_delayed_shift_one_halves_on_every_overflow():
    s = DynamicScaler(init_scale=1024, scale_window=100, delayed_shift=1,
                      consecutive_hysteresis=True)
    assert run(s, [T, F, T]) == [512, 512, 256]


# -- static / none ----------------------------------------------------------------------

def test_static_scaler_never_changes():
    s = StaticScaler(128.0)
    assert run(s, [T, T, F, T] + [F] * 50) == [128.0] * 54
    assert s.cur_iter == 54 and not s.dynamic


def test_no_scaler_is_identity():
    s = NoScaler()
    loss = torch.tensor(3.0, requires_grad=True)
    assert s.scale_loss(loss) is loss
    assert run(s, [T, F]) == [1.0, 1.0] and s.loss_scale == 1.0


def test_scale_loss_multiplies_by_current_scale():
    s = DynamicScaler(init_scale=2.0**10)
    assert s.scale_loss(torch.tensor(0.5)).item() == 512.0
    assert s.loss_scale == 1024.0


@pytest.mark.parametrize("kwargs", [dict(init_scale=0), dict(scale_window=0),
                                    dict(min_scale=0), dict(delayed_shift=0),
                                    dict(scale_factor=1)])
def test_bad_arguments_are_value_errors(kwargs):
    with pytest.raises(ValueError):
        DynamicScaler(**kwargs)


# -- state dict -------------------------------------------------------------------------

def test_state_dict_round_trip_continues_identically():
    pattern = [T, F, F, T, T, F, F, F, F, F, T, F, F, F, F, F, F]
    a = DynamicScaler(init_scale=256, scale_window=3, delayed_shift=2)
    run(a, pattern)
    state = a.state_dict()
    assert state == {"cur_scale": a.cur_scale, "cur_iter": 17, "last_overflow_iter": 10,
                     "cur_hysteresis": a.cur_hysteresis}
    b = DynamicScaler(init_scale=256, scale_window=3, delayed_shift=2)
    b.load_state_dict(state)
    assert run(a, pattern) == run(b, pattern)
    assert a.state_dict() == b.state_dict()


def test_static_state_round_trip_and_mismatch_error():
    a = StaticScaler(64)
    run(a, [F, T])
    b = StaticScaler(1)
    b.load_state_dict(a.state_dict())
    assert (b.cur_scale, b.cur_iter) == (64, 2)
    with pytest.raises(ValueError, match="last_overflow_iter"):
        DynamicScaler().load_state_dict(a.state_dict())


# -- overflow detection -----------------------------------------------------------------

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_has_overflow_finds_inf_and_nan(dtype, bad):
    grads = [torch.ones(5, dtype=dtype), torch.tensor([1.0, bad, 2.0], dtype=dtype)]
    for scaler in (NoScaler(), StaticScaler(8), DynamicScaler()):
        assert scaler.has_overflow(grads) is True
    flag = find_inf_or_nan(grads)
    assert flag.dtype == torch.bool and flag.dim() == 0 and bool(flag)


@pytest.mark.parametrize("dtype", DTYPES)
def test_has_overflow_false_for_finite(dtype):
    big = torch.finfo(dtype).max
    grads = [torch.full((4,), big, dtype=dtype), torch.full((3, 3), -big, dtype=dtype),
             torch.zeros(0, dtype=dtype)]
    assert has_inf_or_nan(grads) is False


def test_has_overflow_mixed_dtypes_and_empty():
    assert has_inf_or_nan([]) is False
    assert has_inf_or_nan([torch.zeros(0)]) is False
    mixed = [torch.ones(2, dtype=torch.float16), torch.ones(2, dtype=torch.bfloat16),
             torch.ones(2)]
    assert has_inf_or_nan(mixed) is False
    mixed.append(torch.tensor([float("nan")], dtype=torch.bfloat16))
    assert has_inf_or_nan(mixed) is True


def test_has_overflow_sparse():
    i = torch.tensor([[0, 2]])
    def sparse(values):
        return torch.sparse_coo_tensor(i, torch.tensor(values), (4,), check_invariants=True)

    ok, bad = sparse([1.0, 2.0]), sparse([1.0, float("inf")])
    assert has_inf_or_nan([ok]) is False
    assert has_inf_or_nan([ok, bad]) is True


# -- from config ------------------------------------------------------------------------

BATCH = {"train_batch_size": 4}


def test_from_config_dynamic():
    cfg = load_config({**BATCH, "fp16": {"enabled": True, "initial_scale_power": 12,
                                         "loss_scale_window": 50, "hysteresis": 3,
                                         "consecutive_hysteresis": True,
                                         "min_loss_scale": 0.5}})
    s = from_config(cfg.fp16)
    assert isinstance(s, DynamicScaler)
    assert (s.cur_scale, s.scale_window, s.delayed_shift, s.cur_hysteresis,
            s.consecutive_hysteresis, s.min_scale, s.scale_factor) == (4096, 50, 3, 3, True,
                                                                       0.5, 2.0)


def test_from_config_defaults_match_deepspeed():
    s = from_config(load_config({**BATCH, "fp16": {"enabled": True}}).fp16)
    assert isinstance(s, DynamicScaler)
    assert (s.cur_scale, s.scale_window, s.delayed_shift, s.min_scale,
            s.consecutive_hysteresis) == (65536, 1000, 2, 1.0, False)


def test_from_config_static_and_disabled():
    s = from_config(load_config({**BATCH, "fp16": {"enabled": True, "loss_scale": 128}}).fp16)
    assert isinstance(s, StaticScaler) and s.cur_scale == 128
    assert isinstance(from_config(load_config(BATCH).fp16), NoScaler)


def test_from_config_unresolved_auto_is_an_error():
    cfg = load_config({**BATCH, "fp16": {"enabled": "auto"}})
    with pytest.raises(ValueError, match="auto"):
        from_config(cfg.fp16)
