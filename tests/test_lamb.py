"""Lamb against a reference written from the LAMB paper's formulas (You et al. 2019, Algorithm 2)
with DeepSpeed FusedLamb's choices: trust ratio clamped to [min_coeff, max_coeff], 1.0 when a norm
is zero, bias correction folded into the step size, optional per-group gradient clipping."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from zerospeed.optim.lamb import Lamb


def reference_lamb(params, grads_per_step, *, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                   weight_decay=0.0, bias_correction=True, eps_inside_sqrt=False,
                   max_coeff=10.0, min_coeff=0.01, max_grad_norm=0.0, scale=1.0):
    """Plain per-tensor LAMB; returns final params and the trust ratios of every step."""
    b1, b2 = betas
    xs = [p.detach().clone() for p in params]
    ms = [torch.zeros_like(x) for x in xs]
    vs = [torch.zeros_like(x) for x in xs]
    all_coeffs = []
    for t, grads in enumerate(grads_per_step, start=1):
        divisor = scale
        if max_grad_norm > 0:
            norm = math.sqrt(sum(float((g * g).sum()) for g in grads))  # of the scaled grads
            clip = (norm / scale + 1e-6) / max_grad_norm
            if clip > 1:
                divisor = clip * scale
        if bias_correction:  # eta_t = lr * sqrt(1 - b2^t) / (1 - b1^t)
            eta = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        else:
            eta = lr
        coeffs = []
        for x, m, v, g in zip(xs, ms, vs, grads, strict=True):
            g = g / divisor
            m.copy_(b1 * m + (1 - b1) * g)
            v.copy_(b2 * v + (1 - b2) * g * g)
            denom = torch.sqrt(v + eps) if eps_inside_sqrt else torch.sqrt(v) + eps
            r = m / denom + weight_decay * x
            x_norm, r_norm = float(torch.sqrt((x * x).sum())), float(torch.sqrt((r * r).sum()))
            if x_norm == 0 or r_norm == 0:
                phi = 1.0
            else:
                phi = min(max(x_norm / r_norm, min_coeff), max_coeff)
            coeffs.append(phi)
            x.copy_(x - eta * phi * r)
        all_coeffs.append(coeffs)
    return xs, all_coeffs


def make_case(dtype=torch.float64, steps=6, seed=0, shapes=((4, 3), (5,), (2, 2, 3))):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=dtype) for s in shapes] for _ in range(steps)]
    return params, grads


def run_lamb(params, grads_per_step, *, step_kwargs=None, **hyper):
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = Lamb(ps, **hyper)
    coeffs = []
    for grads in grads_per_step:
        for p, g in zip(ps, grads, strict=True):
            p.grad = g.clone()
        opt.step(**(step_kwargs or {}))
        coeffs.append(opt.get_lamb_coeffs())
    return [p.detach() for p in ps], coeffs, opt


def flat(nested):
    return [c for step in nested for c in step]


def max_diff(a, b):
    return max(float((x.detach() - y.detach()).abs().max()) for x, y in zip(a, b, strict=True))


CASES = {
    "defaults": {},
    "weight_decay": {"lr": 1e-2, "weight_decay": 0.1},
    "no_bias_correction": {"lr": 1e-2, "bias_correction": False, "weight_decay": 0.01},
    "eps_inside_sqrt": {"lr": 5e-3, "eps": 1e-3, "eps_inside_sqrt": True},
    "betas": {"lr": 2e-2, "betas": (0.8, 0.95), "weight_decay": 0.05},
}


@pytest.mark.parametrize("hyper", CASES.values(), ids=CASES.keys())
def test_matches_reference_fp64(hyper):
    params, grads = make_case()
    got, got_coeffs, _ = run_lamb(params, grads, **hyper)
    want, want_coeffs = reference_lamb(params, grads, **hyper)
    assert max_diff(got, want) <= 1e-6
    assert flat(got_coeffs) == pytest.approx(flat(want_coeffs), abs=1e-9)
    assert max_diff(got, params) > 1e-4  # the parameters did move


@pytest.mark.parametrize("hyper", CASES.values(), ids=CASES.keys())
def test_matches_reference_fp32(hyper):
    params, grads = make_case(dtype=torch.float32, seed=1)
    got, _, _ = run_lamb(params, grads, **hyper)
    want, _ = reference_lamb([p.double() for p in params],
                             [[g.double() for g in gs] for gs in grads], **hyper)
    assert max_diff([g.double() for g in got], want) <= 1e-5


def test_max_coeff_clamps():
    # ||p|| huge against a unit-size update: the ratio would be ~1e3, clamped to 2.0.
    params, grads = make_case(steps=5)
    params = [p * 1e3 for p in params]
    got, coeffs, _ = run_lamb(params, grads, lr=1e-3, max_coeff=2.0)
    want, want_coeffs = reference_lamb(params, grads, lr=1e-3, max_coeff=2.0)
    assert all(c == pytest.approx(2.0) for step in coeffs for c in step)
    assert max_diff(got, want) <= 1e-6 * 1e3  # relative 1e-6 at this scale
    assert flat(want_coeffs) == pytest.approx(flat(coeffs))


def test_min_coeff_clamps():
    # tiny parameters against a unit-size update: the ratio would be ~1e-4, clamped to 0.01.
    params, grads = make_case(steps=5)
    params = [p * 1e-4 for p in params]
    got, coeffs, _ = run_lamb(params, grads, lr=1e-6)
    want, _ = reference_lamb(params, grads, lr=1e-6)
    assert all(c == pytest.approx(0.01) for step in coeffs for c in step)
    assert max_diff(got, want) <= 1e-12


def test_zero_norms_give_coefficient_one():
    # A zero parameter: ||p|| == 0 -> ratio 1.0 (not clamped), even with min_coeff above 1.
    # A zero gradient on a zero-initialised moment: ||update|| == 0 -> 1.0, nothing moves.
    zero_p = torch.zeros(3, dtype=torch.float64)
    other = torch.ones(2, dtype=torch.float64)
    grads = [[torch.full((3,), 0.5, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)]
             for _ in range(5)]
    hyper = {"lr": 1e-2, "min_coeff": 2.0, "max_coeff": 3.0}
    got, coeffs, _ = run_lamb([zero_p, other], grads, **hyper)
    want, want_coeffs = reference_lamb([zero_p, other], grads, **hyper)
    assert coeffs[0] == [1.0, 1.0]
    assert coeffs[1][0] == pytest.approx(2.0)  # p is non-zero from step 2 on: clamped again
    assert coeffs[1][1] == 1.0
    assert torch.equal(got[1], other)
    assert flat(want_coeffs) == pytest.approx(flat(coeffs))
    assert max_diff(got, want) <= 1e-12


def test_loss_scale_and_max_grad_norm():
    params, grads = make_case(steps=5)
    scaled = [[g * 128.0 for g in gs] for gs in grads]
    hyper = {"lr": 1e-2, "max_grad_norm": 0.5, "weight_decay": 0.01}
    got, _, _ = run_lamb(params, scaled, step_kwargs={"scale": 128.0}, **hyper)
    want, _ = reference_lamb(params, scaled, scale=128.0, **hyper)
    assert max_diff(got, want) <= 1e-6
    unclipped, _ = reference_lamb(params, scaled, scale=128.0, lr=1e-2, weight_decay=0.01)
    assert max_diff(want, unclipped) > 1e-6  # clipping did change the result


def test_grad_norms_argument_used_when_given():
    params, grads = make_case(steps=1)
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    for p, g in zip(ps, grads[0], strict=True):
        p.grad = g.clone()
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads[0]))
    opt = Lamb(ps, lr=1e-2, max_grad_norm=1.0)
    opt.step(grad_norms=[norm])
    want, _ = reference_lamb(params, grads, lr=1e-2, max_grad_norm=1.0)
    assert max_diff([p.detach() for p in ps], want) <= 1e-9
    with pytest.raises(ValueError, match="grad_norms"):
        opt.step(grad_norms=[1.0, 2.0])


def test_param_groups_and_skipped_params():
    params, grads = make_case(steps=5)
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = Lamb([{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "lr": 1e-2}],
               lr=1e-3)
    for gs in grads:
        ps[0].grad, ps[1].grad, ps[2].grad = gs[0].clone(), None, gs[2].clone()
        opt.step()
        assert len(opt.get_lamb_coeffs()) == 2
    want0, _ = reference_lamb(params[:1], [gs[:1] for gs in grads], weight_decay=0.1)
    want2, _ = reference_lamb(params[2:], [gs[2:] for gs in grads], lr=1e-2)
    assert max_diff([ps[0].detach(), ps[2].detach()], want0 + want2) <= 1e-6
    assert torch.equal(ps[1].detach(), params[1])
    assert opt.state[ps[0]]["step"] == 5 and ps[1] not in opt.state


def test_mixed_dtypes_in_one_group_keep_coefficient_order():
    # Values fixed (not drawn from the global generator, which earlier tests move): the large parameter's
    # trust ratio clips at max_coeff 10, the tiny one's at min_coeff 0.01.
    gen = torch.Generator().manual_seed(0)
    p64 = torch.nn.Parameter(torch.randn(4, dtype=torch.float64, generator=gen))
    p32 = torch.nn.Parameter(torch.full((3,), 100.0))
    p64b = torch.nn.Parameter(torch.full((2,), 1e-4, dtype=torch.float64))
    opt = Lamb([p64, p32, p64b], lr=1e-3)
    for p in (p64, p32, p64b):
        p.grad = torch.ones_like(p)
    opt.step()
    coeffs = opt.get_lamb_coeffs()
    assert coeffs[1] == pytest.approx(10.0) and coeffs[2] == pytest.approx(0.01)


def test_state_dict_round_trip():
    params, grads = make_case(steps=6)
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = Lamb(ps, lr=1e-2, weight_decay=0.1)
    for gs in grads[:3]:
        for p, g in zip(ps, gs, strict=True):
            p.grad = g.clone()
        opt.step()
    copies = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    resumed = Lamb(copies, lr=1e-2, weight_decay=0.1)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch shares tensors
    for gs in grads[3:]:
        for a, b, g in zip(ps, copies, gs, strict=True):
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        resumed.step()
    assert max_diff(ps, copies) == 0.0


@pytest.mark.parametrize("kwargs, match", [
    ({"amsgrad": True}, "AMSGrad"),
    ({"lr": -1.0}, "lr"),
    ({"betas": (0.9, 1.0)}, "betas"),
    ({"eps": -1e-8}, "eps"),
    ({"weight_decay": -0.1}, "weight_decay"),
    ({"min_coeff": 2.0, "max_coeff": 1.0}, "max_coeff"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Lamb([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_sparse_gradients_rejected():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.zeros(3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        Lamb([p]).step()


def test_closure_and_training_reduces_loss():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    opt = Lamb(model.parameters(), lr=0.1)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    first = opt.step(closure).item()
    for _ in range(50):
        last = opt.step(closure).item()
    assert last < 0.8 * first


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_step(dtype):
    params, grads = make_case(dtype=torch.float32, steps=3)
    got, coeffs, opt = run_lamb([p.to(dtype) for p in params],
                                [[g.to(dtype) for g in gs] for gs in grads], lr=1e-2)
    want, _ = reference_lamb([p.double() for p in params],
                             [[g.double() for g in gs] for gs in grads], lr=1e-2)
    assert all(p.dtype == dtype for p in got)
    assert all(s["exp_avg"].dtype == dtype for s in opt.state.values())
    assert max_diff([p.double() for p in got], want) <= 5e-2  # bf16 has ~3 significant digits
