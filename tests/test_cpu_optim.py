"""CPUAdam / CPUAdagrad / CPULion against torch.optim (and Lion against the paper), on both paths.

Each case runs 20 steps on parameters of 1, 7, 64, 1000 and 10**6 + 3 elements, with and without a
bf16 / fp16 copy-out, and must match the reference to 1e-6 relative; the copy-out must equal the
updated fp32 parameter cast to its dtype exactly. The PyTorch fallback passes the same tests.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch

from zerospeed.ops import native
from zerospeed.ops.adagrad import CPUAdagrad
from zerospeed.ops.adam import CPUAdam, DeepSpeedCPUAdam
from zerospeed.ops.lion import CPULion

SIZES = (1, 7, 64, 1000, 10**6 + 3)
IMPLEMENTATIONS = ("native", "torch")
STEPS = 20


def _implementation(name: str) -> str:
    if name == "native" and native.choose("auto").module is None:
        pytest.fail("the native CPU optimizer kernels are not built: `make install` must build them")
    return name


class PaperLion(torch.optim.Optimizer):
    """Lion as written in Chen et al. 2023, Algorithm 2 (decoupled weight decay)."""

    def __init__(self, params: Any, lr: float, betas: tuple[float, float], weight_decay: float):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                c = beta1 * m + (1 - beta1) * p.grad
                p.mul_(1 - group["lr"] * group["weight_decay"]).sub_(group["lr"] * torch.sign(c))
                m.copy_(beta2 * m + (1 - beta2) * p.grad)


CASES: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "adamw": (lambda ps, impl: CPUAdam(ps, lr=1e-2, weight_decay=0.1, implementation=impl),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
    "adam_l2": (lambda ps, impl: CPUAdam(ps, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1, adamw_mode=False,
                                         implementation=impl),
                lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1)),
    "adam_no_bias_correction": (
        lambda ps, impl: CPUAdam(ps, lr=1e-3, bias_correction=False, implementation=impl),
        None),
    "adagrad": (lambda ps, impl: CPUAdagrad(ps, lr=1e-1, weight_decay=0.01, lr_decay=0.01,
                                            initial_accumulator_value=0.1, implementation=impl),
                lambda ps: torch.optim.Adagrad(ps, lr=1e-1, weight_decay=0.01, lr_decay=0.01,
                                               initial_accumulator_value=0.1, eps=1e-10)),
    "lion": (lambda ps, impl: CPULion(ps, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, implementation=impl),
             lambda ps: PaperLion(ps, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)),
}


def _no_bias_correction_reference(params: list[torch.Tensor]) -> Any:
    """Adam without bias correction, from the formula (torch has no switch for it)."""

    class Plain(torch.optim.Optimizer):
        def __init__(self, ps: Any):
            super().__init__(ps, {})

        @torch.no_grad()
        def step(self) -> None:
            for p in self.param_groups[0]["params"]:
                state = self.state[p]
                m = state.setdefault("m", torch.zeros_like(p))
                v = state.setdefault("v", torch.zeros_like(p))
                m.lerp_(p.grad, 1 - 0.9)
                v.mul_(0.999).addcmul_(p.grad, p.grad, value=1 - 0.999)
                p.addcdiv_(m, v.sqrt().add_(1e-8), value=-1e-3)
    return Plain(params)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_the_reference_for_every_size_and_copy_out(case: str, implementation: str) -> None:
    impl = _implementation(implementation)
    make_ours, make_ref = CASES[case]
    torch.manual_seed(0)
    start = [torch.randn(n) for n in SIZES]
    ours_params = [p.clone().requires_grad_() for p in start]
    ref_params = [p.clone().requires_grad_() for p in start]
    ours = make_ours([{"params": ours_params[:2]}, {"params": ours_params[2:]}], impl)
    ref = make_ref(ref_params) if make_ref is not None else _no_bias_correction_reference(ref_params)
    outs = [torch.empty(n, dtype=torch.bfloat16 if i % 2 else torch.float16) for i, n in enumerate(SIZES)]
    for step in range(STEPS):
        for a, b in zip(ours_params, ref_params, strict=True):
            grad = torch.randn(a.shape) * (1 + step % 3)
            a.grad, b.grad = grad.clone(), grad.clone()
        copy_out = step % 2 == 1  # with and without the copy-out
        ours.step(fp16_param_groups=[outs[:2], outs[2:]] if copy_out else None)
        ref.step()
        if copy_out:
            for p, out in zip(ours_params, outs, strict=True):
                assert torch.equal(out, p.detach().to(out.dtype)), f"{case}: copy-out differs from the cast"
    for n, a, b in zip(SIZES, ours_params, ref_params, strict=True):
        scale = b.detach().abs().max().clamp_min(1e-30)
        assert ((a - b).abs().max() / scale).item() <= 1e-6, f"{case} n={n}: {((a - b).abs().max() / scale).item():.2e}"
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * scale.item())


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_threads_split_a_large_parameter_exactly(implementation: str) -> None:
    impl = _implementation(implementation)
    torch.manual_seed(1)
    start = torch.randn(3 * 2**17 + 5)
    a, b = start.clone().requires_grad_(), start.clone().requires_grad_()
    one = CPUAdam([a], lr=1e-2, weight_decay=0.01, threads=1, implementation=impl)
    many = CPUAdam([b], lr=1e-2, weight_decay=0.01, threads=3, implementation=impl)
    out = torch.empty(start.numel(), dtype=torch.bfloat16)
    for _ in range(3):
        grad = torch.randn(start.shape)
        a.grad, b.grad = grad.clone(), grad.clone()
        one.step()
        many.step(fp16_param_groups=[[out]])
    assert torch.equal(a, b) and torch.equal(out, b.detach().bfloat16())
    assert torch.equal(one.state[a]["exp_avg_sq"], many.state[b]["exp_avg_sq"])


def test_state_is_torchs_so_a_state_dict_moves_to_torch_adamw() -> None:
    torch.manual_seed(2)
    start = torch.randn(100)
    a, b = start.clone().requires_grad_(), start.clone().requires_grad_()
    ours = CPUAdam([a], lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW([b], lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        grad = torch.randn(100)
        a.grad, b.grad = grad.clone(), grad.clone()
        ours.step()
        ref.step()
    moved = torch.optim.AdamW([a], lr=1e-2, weight_decay=0.1)
    state = copy.deepcopy(ours.state_dict())
    for key in ("bias_correction", "adamw_mode"):
        state["param_groups"][0].pop(key)
    moved.load_state_dict(state)
    grad = torch.randn(100)
    a.grad, b.grad = grad.clone(), grad.clone()
    moved.step()
    ref.step()
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert DeepSpeedCPUAdam is CPUAdam


def test_a_deep_copy_keeps_working() -> None:
    p = torch.ones(5, requires_grad=True)
    p.grad = torch.ones(5)
    opt = CPUAdam([p], lr=0.1, threads=3, implementation="torch")
    opt.step()
    twin = copy.deepcopy(opt)
    assert twin.implementation == "torch" and twin.threads == 3
    twin.param_groups[0]["params"][0].grad = torch.ones(5)
    twin.step()
    assert float(twin.state[twin.param_groups[0]["params"][0]]["step"]) == 2.0


def test_clear_errors() -> None:
    p = torch.zeros(4, requires_grad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        CPUAdam([p], amsgrad=True)
    with pytest.raises(ValueError, match="implementation='gpu'"):
        CPUAdam([p], implementation="gpu")
    opt = CPUAdam([p])
    p.grad = torch.zeros(4, dtype=torch.float32)
    with pytest.raises(ValueError, match="fp16_param_groups has 2 entries for 1"):
        opt.step(fp16_param_groups=[[], []])
    with pytest.raises(TypeError, match="copy-out target"):
        opt.step(fp16_param_groups=[[torch.empty(3, dtype=torch.bfloat16)]])
    half = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    half.grad = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="contiguous fp32 tensors; this parameter is torch.bfloat16"):
        CPUAdam([half]).step()


def test_native_requested_but_missing_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_native", lambda name: (None, "the native kernels were not built (test)"))
    with pytest.raises(RuntimeError, match="implementation='native': the native kernels were not built"):
        CPUAdam([torch.zeros(2, requires_grad=True)], implementation="native")
    fallback = CPUAdam([torch.zeros(2, requires_grad=True)])
    assert fallback.implementation == "torch"
    assert native.choose("torch").reason == "implementation='torch' was asked for"


def test_report_names_the_active_path() -> None:
    from zerospeed.report import lines

    text = "\n".join(lines())
    assert f"CPU optimizer kernels (CPUAdam, CPUAdagrad, CPULion): {native.choose('auto').name} - " in text


def test_nothing_is_compiled_at_run_time(tmp_path: Any) -> None:
    """With no compiler reachable (an empty PATH), the native kernels still load and step: they were
    built when the package was installed."""
    import subprocess
    import sys

    code = ("import torch; from zerospeed.ops.adam import CPUAdam\n"
            "p = torch.zeros(300000, requires_grad=True); p.grad = torch.ones(300000)\n"
            "opt = CPUAdam([p], implementation='native'); opt.step()\n"
            "print(opt.implementation, float(p[0]))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env={"PATH": str(tmp_path / "no-compilers-here"), "HOME": str(tmp_path)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    implementation, value = proc.stdout.split()
    assert implementation == "native" and float(value) == pytest.approx(-1e-3, rel=1e-6)
