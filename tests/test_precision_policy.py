"""MixedPrecisionPolicy: dtypes chosen from the config, scaler construction, input casting."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple

import pytest
import torch

from zerospeed.config import ConfigError, DType, load_config
from zerospeed.precision import (
    DynamicScaler,
    MixedPrecisionPolicy,
    NoScaler,
    StaticScaler,
    policy_from_config,
)

BATCH = {"train_batch_size": 4}
f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16


def policy(**sections):
    return policy_from_config(load_config({**BATCH, **sections}))


def dtypes(p):
    return (p.param_dtype, p.master_dtype, p.grad_accum_dtype, p.reduce_dtype)


def test_fp32_default():
    p = policy()
    assert p.precision == "fp32"
    assert dtypes(p) == (f32, f32, f32, f32)
    assert not p.needs_master_copy and p.check_overflow  # skipped_steps.check_fp32 (issue 32)
    assert isinstance(p.make_scaler(), NoScaler)


def test_bf16():
    p = policy(bf16={"enabled": True})
    assert p.precision == "bf16"
    assert dtypes(p) == (bf16, f32, f32, f32)
    assert p.needs_master_copy and p.check_overflow
    assert isinstance(p.make_scaler(), NoScaler)


def test_bf16_alias_and_check_grad_overflow_off():
    p = policy(bfloat16={"enabled": True, "check_grad_overflow": False})
    assert p.param_dtype == bf16 and not p.check_overflow


def test_fp16_dynamic():
    p = policy(fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1})
    assert p.precision == "fp16"
    assert dtypes(p) == (f16, f32, f32, f32)
    assert p.needs_master_copy and p.check_overflow
    s = p.make_scaler()
    assert isinstance(s, DynamicScaler) and s.cur_scale == 256 and s.delayed_shift == 1


def test_fp16_static_and_fresh_scaler_each_call():
    p = policy(fp16={"enabled": True, "loss_scale": 1024})
    a, b = p.make_scaler(), p.make_scaler()
    assert isinstance(a, StaticScaler) and a.cur_scale == 1024 and a is not b


def test_communication_data_type_sets_reduce_dtype():
    assert policy(bf16={"enabled": True}, communication_data_type="bf16").reduce_dtype == bf16
    assert policy(fp16={"enabled": True}, communication_data_type="fp16").reduce_dtype == f16
    assert policy(communication_data_type="bfloat16").reduce_dtype == bf16


def test_grad_accum_dtype_sets_accumulation_and_default_reduction():
    p = policy(bf16={"enabled": True}, data_types={"grad_accum_dtype": "bf16"})
    assert (p.grad_accum_dtype, p.reduce_dtype) == (bf16, bf16)
    p = policy(bf16={"enabled": True}, data_types={"grad_accum_dtype": "bf16"},
               communication_data_type="fp32")
    assert (p.grad_accum_dtype, p.reduce_dtype) == (bf16, f32)


def test_param_dtype_must_agree_with_precision():
    assert policy(bf16={"enabled": True}, data_types={"param_dtype": "bf16"}).param_dtype == bf16
    with pytest.raises(ConfigError, match="data_types.param_dtype"):
        policy(bf16={"enabled": True}, data_types={"param_dtype": "fp16"})


def test_unresolved_auto_is_an_error():
    with pytest.raises(ConfigError, match="auto"):
        policy(bf16={"enabled": "auto"})


def test_policy_is_frozen_and_hashable():
    p = policy(fp16={"enabled": True})
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.param_dtype = f32  # type: ignore[misc]
    assert p == policy(fp16={"enabled": True}) and hash(p) == hash(policy(fp16={"enabled": True}))


# -- casting ----------------------------------------------------------------------------

Pair = namedtuple("Pair", "x ids")


@pytest.mark.parametrize("precision, dtype", [("bf16", bf16), ("fp16", f16)])
def test_cast_inputs_nested(precision, dtype):
    p = policy(**{precision: {"enabled": True}})
    ids = torch.tensor([1, 2, 3])
    mask = torch.tensor([True, False])
    x = torch.randn(2, 3)
    inputs = (x, [ids, {"m": mask, "y": x.double(), "n": 7, "s": "text"}],
              Pair(x, ids), OrderedDict(z=x))
    out = p.cast_inputs(inputs)
    assert isinstance(out, tuple) and isinstance(out[1], list)
    assert out[0].dtype == dtype and torch.equal(out[0], x.to(dtype))
    assert out[1][0] is ids and out[1][1]["m"] is mask
    assert out[1][1]["y"].dtype == dtype and out[1][1]["n"] == 7 and out[1][1]["s"] == "text"
    assert isinstance(out[2], Pair) and out[2].x.dtype == dtype and out[2].ids is ids
    assert isinstance(out[3], OrderedDict) and out[3]["z"].dtype == dtype
    assert x.dtype == f32  # the caller's tensors are not modified


def test_cast_inputs_fp32_is_a_no_op():
    p = policy()
    inputs = (torch.randn(2).double(), {"a": torch.randn(2)})
    assert p.cast_inputs(inputs) is inputs
    args, kwargs = (torch.randn(1),), {"k": torch.randn(1)}
    assert p.cast_forward_args(args, kwargs) == (args, kwargs)


def test_cast_forward_args():
    p = policy(bf16={"enabled": True})
    args, kwargs = p.cast_forward_args((torch.randn(2), torch.tensor([1])),
                                       {"labels": torch.tensor([0]), "w": torch.ones(1)})
    assert [a.dtype for a in args] == [bf16, torch.int64]
    assert kwargs["labels"].dtype == torch.int64 and kwargs["w"].dtype == bf16


@pytest.mark.parametrize("precision, dtype", [("fp32", f32), ("bf16", bf16), ("fp16", f16)])
def test_cast_module_and_forward_on_cpu(precision, dtype):
    sections = {} if precision == "fp32" else {precision: {"enabled": True}}
    p = policy(**sections)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 4))
    assert p.cast_module(model) is model
    assert {t.dtype for t in model.parameters()} == {dtype}
    (ids,), _ = p.cast_forward_args((torch.tensor([[1, 2, 3]]),), {})
    out = model(ids)
    assert out.dtype == dtype and torch.isfinite(out).all()
    # The fp16 default scale 2**16 overflows this model's fp16 gradients; the scaler backs off
    # (hysteresis 2: one overflow absorbed, then halving) until a clean backward.
    scaler = p.make_scaler()
    for _ in range(20):
        model.zero_grad(set_to_none=True)
        scaler.scale_loss(model(ids).float().sum()).backward()
        grads = [t.grad for t in model.parameters()]
        assert all(g is not None and g.dtype == dtype for g in grads)
        overflow = scaler.has_overflow(grads)
        scaler.update(overflow)
        if not overflow:
            break
    assert not overflow
    if precision == "fp16":
        assert scaler.cur_iter >= 3 and scaler.cur_scale <= 2.0**15
    else:
        assert scaler.cur_iter == 1 and scaler.cur_scale == 1.0


def test_direct_construction_without_config():
    p = MixedPrecisionPolicy(precision=DType.BF16, param_dtype=bf16, master_dtype=f32,
                             grad_accum_dtype=f32, reduce_dtype=bf16, check_overflow=False)
    assert p.needs_master_copy and isinstance(p.make_scaler(), NoScaler)
    assert p.input_dtype == bf16
