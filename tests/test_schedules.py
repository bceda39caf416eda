"""LR schedules: every step of a 50-step run equals DeepSpeed 0.19.8's formula, written out here.

The expected values are computed in closed form from the formulas (not by calling DeepSpeed), so
these tests pin the arithmetic; construction-time values (the lr a fresh schedule writes before
its first ``step()``) are checked too, since DeepSpeed applies them.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

import zerospeed.lr_schedules as lr_schedules
from zerospeed.config import ConfigError, load_config
from zerospeed.config.specs import SchedulerSpec
from zerospeed.optim import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

STEPS = 50
Trace = list[tuple[list[float], list[Any]]]


def make_opt(kind: str = "adam", lrs: tuple[float, ...] = (0.01,)) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lrs[0], momentum=0.9)
    return torch.optim.Adam(groups, lr=lrs[0], betas=(0.9, 0.999))


def snapshot(opt: torch.optim.Optimizer) -> tuple[list[float], list[Any]]:
    return ([float(g["lr"]) for g in opt.param_groups],
            [tuple(g["betas"]) if "betas" in g else g.get("momentum") for g in opt.param_groups])


def trace(sched: Any, opt: torch.optim.Optimizer, steps: int = STEPS) -> Trace:
    """The optimizer's (lrs, betas) after construction, then after each step."""
    out = [snapshot(opt)]
    for _ in range(steps):
        sched.step()
        out.append(snapshot(opt))
        assert [float(x) for x in sched.get_last_lr()] == out[-1][0]
    return out


def assert_lrs(got: Trace, expected: Callable[[int, int], float]) -> None:
    """``expected(i, group)`` is the lr at batch index ``i`` (-1: after construction)."""
    for k, (lrs, _) in enumerate(got):
        want = [expected(k - 1, g) for g in range(len(lrs))]
        assert lrs == pytest.approx(want, rel=1e-12, abs=1e-15), f"step index {k - 1}"


def per_group(value: Any, g: int) -> float:
    return value[g] if isinstance(value, (list, tuple)) else value


# ----------------------------------------------------------------------------- formulas


def warmup_gamma(i: int, warmup: int, kind: str) -> float:
    n = max(2, warmup)
    if i >= n:
        return 1.0
    return math.log(i + 1) / math.log(n) if kind == "log" else i / n


def warmup_lr(p: dict[str, Any], base: tuple[float, ...]) -> Callable[[int, int], float]:
    def f(i: int, g: int) -> float:
        lo = per_group(p.get("warmup_min_lr", 0.0), g)
        hi = per_group(p["warmup_max_lr"], g) if "warmup_max_lr" in p else base[g]
        if i < 0:
            return lo
        return lo + (hi - lo) * warmup_gamma(i, p.get("warmup_num_steps", 1000),
                                             p.get("warmup_type", "log"))
    return f


def warmup_decay_lr(p: dict[str, Any]) -> Callable[[int, int], float]:
    def f(i: int, g: int) -> float:
        lo = per_group(p.get("warmup_min_lr", 0.0), g)
        hi = per_group(p.get("warmup_max_lr", 0.001), g)
        n, total = max(2, p.get("warmup_num_steps", 1000)), p["total_num_steps"]
        if i < 0:
            return lo
        if i < n:
            gamma = warmup_gamma(i, n, p.get("warmup_type", "log"))
        else:  # linear from 1 at the end of warmup to 0 at total_num_steps, then 0
            gamma = max(0.0, (total - i) / max(1, total - n))
        return lo + (hi - lo) * gamma
    return f


def warmup_cosine_lr(p: dict[str, Any], base: tuple[float, ...]) -> Callable[[int, int], float]:
    def f(i: int, g: int) -> float:
        n, total = max(2, p.get("warmup_num_steps", 1000)), p["total_num_steps"]
        r0, rmin = p.get("warmup_min_ratio", 0.0), p.get("cos_min_ratio", 0.0001)
        if i < 0:
            return 0.0
        if i < n:
            ratio = r0 + (1 - r0) * warmup_gamma(i, n, p.get("warmup_type", "log"))
        else:
            progress = min(1.0, (i - n + 1) / max(1, total - n))
            ratio = max(0.0, rmin + (1 - rmin) * (1 + math.cos(math.pi * progress)) / 2)
        return base[g] * ratio
    return f


def one_cycle_scale(i: int, p: dict[str, Any]) -> float:
    """0 at the cycle's ends, 1 at its peak, for batch index i inside the cycle."""
    s1 = p.get("cycle_first_step_size", 2000)
    s2 = s1 if p.get("cycle_second_step_size") is None else p["cycle_second_step_size"]
    n1 = p.get("cycle_first_stair_count", 0)
    n2 = p.get("cycle_second_stair_count", n1)
    c = (i + 1) % (s1 + s2)
    if c <= s1:
        return math.floor(c * n1 / s1) / n1 if n1 else c / s1
    return math.floor((s1 + s2 - c) * n2 / s2) / n2 if n2 else (s1 + s2 - c) / s2


def one_cycle(p: dict[str, Any]) -> tuple[Callable[[int, int], float],
                                         Callable[[int, int], float]]:
    s1 = p.get("cycle_first_step_size", 2000)
    s2 = p.get("cycle_second_step_size")
    total = s1 + (s1 if s2 is None else s2)
    dss = p.get("decay_step_size", 0)

    def lr(i: int, g: int) -> float:
        lo, hi = per_group(p["cycle_min_lr"], g), per_group(p["cycle_max_lr"], g)
        if i < 0:
            return lo
        if i < total:
            return lo + (hi - lo) * one_cycle_scale(i, p)
        rate = p.get("decay_lr_rate", 0.0)
        return lo / (1 + rate * (i - total + 1) / dss) if dss and rate else lo

    def beta1(i: int, g: int) -> float:
        lo, hi = per_group(p.get("cycle_min_mom", 0.8), g), per_group(p.get("cycle_max_mom", 0.9), g)
        if i < 0:
            return lo
        if i < total:
            return hi - (hi - lo) * one_cycle_scale(i, p)
        rate = p.get("decay_mom_rate", 0.0)
        return hi * (1 + rate * (i - total + 1) / dss) if dss and rate else hi

    return lr, beta1


def range_test_lr(p: dict[str, Any]) -> Callable[[int, int], float]:
    def f(i: int, g: int) -> float:
        interval = (i + 1) / p.get("lr_range_test_step_size", 2000)
        if p.get("lr_range_test_staircase", False):
            interval = math.floor(interval)
        return per_group(p.get("lr_range_test_min_lr", 1e-3), g) * (
            1 + p.get("lr_range_test_step_rate", 1.0) * interval)
    return f


# ----------------------------------------------------------------------------- formulas per step

WARMUP_CASES = [
    ({"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 10}, (0.01,)),
    ({"warmup_min_lr": [0.001, 0.002], "warmup_max_lr": [0.01, 0.05], "warmup_num_steps": 30,
      "warmup_type": "linear"}, (0.1, 0.2)),
    ({"warmup_min_lr": 1e-4, "warmup_num_steps": 20}, (0.03, 0.07)),  # max: the optimizer's lr
    ({"warmup_num_steps": 1, "warmup_type": "linear"}, (0.02,)),  # 1 warmup step runs as 2
]


@pytest.mark.parametrize("params,base", WARMUP_CASES)
def test_warmup_lr(params: dict[str, Any], base: tuple[float, ...]) -> None:
    opt = make_opt(lrs=base)
    assert_lrs(trace(WarmupLR(opt, **params), opt), warmup_lr(params, base))


DECAY_CASES = [
    {"total_num_steps": 40, "warmup_num_steps": 10},
    {"total_num_steps": 45, "warmup_num_steps": 15, "warmup_type": "linear",
     "warmup_min_lr": 1e-4, "warmup_max_lr": [0.02, 0.03]},
    {"total_num_steps": 30, "warmup_num_steps": 30, "warmup_max_lr": 0.1},  # no decay window
]


@pytest.mark.parametrize("params", DECAY_CASES)
def test_warmup_decay_lr(params: dict[str, Any]) -> None:
    groups = max((len(v) for v in params.values() if isinstance(v, list)), default=1)
    opt = make_opt(lrs=(0.5,) * groups)
    got = trace(WarmupDecayLR(opt, **params), opt)
    assert_lrs(got, warmup_decay_lr(params))
    assert got[-1][0] == pytest.approx([per_group(params.get("warmup_min_lr", 0.0), g)
                                        for g in range(groups)])  # decayed to 0 above min


COSINE_CASES = [
    ({"total_num_steps": 40, "warmup_num_steps": 10}, (0.01,)),
    ({"total_num_steps": 35, "warmup_num_steps": 7, "warmup_type": "linear",
      "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05}, (0.02, 0.003)),
    ({"total_num_steps": 20, "warmup_num_steps": 1}, (0.1,)),
]


@pytest.mark.parametrize("params,base", COSINE_CASES)
def test_warmup_cosine_lr(params: dict[str, Any], base: tuple[float, ...]) -> None:
    opt = make_opt(lrs=base)
    got = trace(WarmupCosineLR(opt, **params), opt)
    assert_lrs(got, warmup_cosine_lr(params, base))
    floor = params.get("cos_min_ratio", 0.0001)
    assert got[-1][0] == pytest.approx([b * floor for b in base])  # stays at the floor


ONE_CYCLE_CASES = [
    {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 10},
    {"cycle_min_lr": [0.001, 0.002], "cycle_max_lr": [0.01, 0.02], "cycle_first_step_size": 8,
     "cycle_second_step_size": 12, "decay_step_size": 3, "decay_lr_rate": 0.5,
     "decay_mom_rate": 0.01, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95},
    {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 10,
     "cycle_second_step_size": 7, "cycle_first_stair_count": 3, "cycle_second_stair_count": 2,
     "decay_step_size": 5, "decay_lr_rate": 0.2},
    {"cycle_min_lr": 0.002, "cycle_max_lr": 0.004, "cycle_first_step_size": 12,
     "cycle_first_stair_count": 4},
]


@pytest.mark.parametrize("params", ONE_CYCLE_CASES)
def test_one_cycle_lr_and_momentum(params: dict[str, Any]) -> None:
    groups = max((len(v) for v in params.values() if isinstance(v, list)), default=1)
    opt = make_opt(lrs=(0.5,) * groups)
    sched = OneCycle(opt, **params)
    got = trace(sched, opt)
    want_lr, want_beta1 = one_cycle(params)
    assert_lrs(got, want_lr)
    for k, (_, betas) in enumerate(got):
        # DeepSpeed cycles beta1 and pairs it with a fixed beta2 of 0.99.
        want = [(want_beta1(k - 1, g), 0.99) for g in range(groups)]
        assert [b[0] for b in betas] == pytest.approx([w[0] for w in want], rel=1e-12)
        assert [b[1] for b in betas] == [0.99] * groups
    assert [m[0] for m in sched.get_mom()] == pytest.approx([b[0] for b in got[-1][1]])


def test_one_cycle_peak_and_trough() -> None:
    opt = make_opt()
    got = trace(OneCycle(opt, cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_step_size=10), opt)
    assert got[10][0] == pytest.approx([0.01]) and got[10][1][0][0] == pytest.approx(0.8)
    assert got[20][0] == pytest.approx([0.001]) and got[20][1][0][0] == pytest.approx(0.9)


def test_one_cycle_without_betas_leaves_momentum_alone() -> None:
    opt = make_opt("sgd")
    with pytest.warns(UserWarning, match="cycle_momentum"):
        sched = OneCycle(opt, cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_step_size=9)
    got = trace(sched, opt)
    assert_lrs(got, one_cycle({"cycle_min_lr": 0.001, "cycle_max_lr": 0.01,
                               "cycle_first_step_size": 9})[0])
    assert all(m == [0.9] for _, m in got) and sched.get_mom() is None
    opt = make_opt()
    OneCycle(opt, cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_momentum=False)
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)


RANGE_CASES = [
    {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 5, "lr_range_test_step_rate": 2.0},
    {"lr_range_test_min_lr": [0.001, 0.003], "lr_range_test_step_size": 7,
     "lr_range_test_step_rate": 0.5, "lr_range_test_staircase": True},
    {},  # all defaults
]


@pytest.mark.parametrize("params", RANGE_CASES)
def test_lr_range_test(params: dict[str, Any]) -> None:
    groups = max((len(v) for v in params.values() if isinstance(v, list)), default=1)
    opt = make_opt(lrs=(0.5,) * groups)
    got = trace(LRRangeTest(opt, **params), opt)
    assert_lrs(got, range_test_lr(params))
    if params.get("lr_range_test_staircase"):
        assert got[6][0] == got[1][0] and got[7][0] != got[6][0]  # flat within a stair


# ----------------------------------------------------------------------------- state and resume

ALL = [
    (WarmupLR, {"warmup_num_steps": 20, "warmup_max_lr": 0.05}),
    (WarmupDecayLR, {"total_num_steps": 40, "warmup_num_steps": 10, "warmup_type": "linear"}),
    (WarmupCosineLR, {"total_num_steps": 40, "warmup_num_steps": 10}),
    (OneCycle, {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 10,
                "decay_step_size": 4, "decay_lr_rate": 0.3, "decay_mom_rate": 0.02}),
    (LRRangeTest, {"lr_range_test_step_size": 4, "lr_range_test_staircase": True}),
]


@pytest.mark.parametrize("cls,params", ALL, ids=[c.__name__ for c, _ in ALL])
def test_state_dict_resume_gives_the_same_sequence(cls: type, params: dict[str, Any]) -> None:
    opt = make_opt(lrs=(0.02,))
    full = trace(cls(opt, **params), opt)

    opt = make_opt(lrs=(0.02,))
    sched = cls(opt, **params)
    trace(sched, opt, 20)
    state = sched.state_dict()
    assert state == {"last_batch_iteration": 19}

    resumed_opt = make_opt(lrs=(0.02,))
    resumed = cls(resumed_opt, **params)
    resumed.load_state_dict(state)
    assert trace(resumed, resumed_opt, STEPS - 20)[1:] == full[21:]

    # Resuming through the constructor leaves the optimizer alone until the next step.
    ctor_opt = make_opt(lrs=(0.02,))
    ctor = cls(ctor_opt, **{**params, "last_batch_iteration": 19})
    assert ctor_opt.param_groups[0]["lr"] == 0.02
    with pytest.raises(RuntimeError, match="call step"):
        ctor.get_last_lr()
    assert trace(ctor, ctor_opt, STEPS - 20)[1:] == full[21:]


@pytest.mark.parametrize("cls,params", ALL, ids=[c.__name__ for c, _ in ALL])
def test_step_jumps_to_a_given_iteration(cls: type, params: dict[str, Any]) -> None:
    opt = make_opt(lrs=(0.02,))
    full = trace(cls(opt, **params), opt)
    opt = make_opt(lrs=(0.02,))
    sched = cls(opt, **params)
    sched.step(33)
    assert snapshot(opt) == full[34]
    sched.step()
    assert snapshot(opt) == full[35]


def test_tensor_lr_is_filled_in_place_and_wrappers_are_unwrapped() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p], lr=torch.tensor(0.01))
    lr_tensor = opt.param_groups[0]["lr"]
    sched = WarmupCosineLR(types.SimpleNamespace(optimizer=opt), total_num_steps=20,
                           warmup_num_steps=5)
    for _ in range(8):
        sched.step()
    assert opt.param_groups[0]["lr"] is lr_tensor
    want = warmup_cosine_lr({"total_num_steps": 20, "warmup_num_steps": 5}, (0.01,))(7, 0)
    assert float(lr_tensor) == pytest.approx(want, rel=1e-6)


# ----------------------------------------------------------------------------- config


def config_scheduler(section: dict[str, Any]) -> SchedulerSpec:
    parsed = load_config({"train_batch_size": 8, "scheduler": section}).scheduler
    assert parsed is not None
    return SchedulerSpec.from_config(parsed)


@pytest.mark.parametrize("cls,params", ALL, ids=[c.__name__ for c, _ in ALL])
def test_build_scheduler_matches_direct_construction(cls: type, params: dict[str, Any]) -> None:
    opt = make_opt(lrs=(0.02,))
    direct = trace(cls(opt, **params), opt)
    opt = make_opt(lrs=(0.02,))
    sched = build_scheduler(config_scheduler({"type": cls.__name__, "params": params}), opt)
    assert type(sched) is cls
    assert trace(sched, opt) == direct


def test_build_scheduler_fills_deepspeed_defaults() -> None:
    opt = make_opt()
    sched = build_scheduler(config_scheduler({"type": "WarmupDecayLR",
                                              "params": {"total_num_steps": 3000}}), opt)
    assert (sched.warmup_num_steps, sched.warmup_type, sched.max_lrs) == (1000, "log", [0.001])
    assert build_scheduler(None, opt) is None


def test_build_scheduler_torch_class_by_name() -> None:
    opt = make_opt(lrs=(0.1,))
    sched = build_scheduler(config_scheduler(
        {"type": "StepLR", "params": {"step_size": 3, "gamma": 0.5}}), opt)
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)
    lrs = []
    for _ in range(10):
        opt.step()
        sched.step()
        lrs.append(sched.get_last_lr()[0])
    assert lrs == pytest.approx([0.1 * 0.5 ** ((k + 1) // 3) for k in range(10)])


def test_build_scheduler_rejects_unresolved_auto() -> None:
    with pytest.raises(ConfigError) as err:
        build_scheduler(config_scheduler({"type": "WarmupLR", "params": {"warmup_max_lr": "auto",
                                                                         "warmup_num_steps": "auto"}}),
                        make_opt())
    assert err.value.problems == tuple(
        f'scheduler.params.{key}: still "auto" when building the WarmupLR schedule; resolve it '
        "from the training arguments first or give a value in the config"
        for key in ("warmup_max_lr", "warmup_num_steps"))


def test_build_scheduler_reports_constructor_errors_as_config_errors() -> None:
    section = config_scheduler({"type": "OneCycle",
                                "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 0.01}})
    with pytest.raises(ConfigError, match=r"scheduler \(OneCycle\): cycle_min_lr=0.1 is above"):
        build_scheduler(section, make_opt())


def test_lr_schedules_module_reexports() -> None:
    assert lr_schedules.WarmupLR is WarmupLR and lr_schedules.OneCycle is OneCycle
    assert lr_schedules.VALID_LR_SCHEDULES == (
        "LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("make,message", [
    (lambda o: WarmupLR(o, warmup_num_steps=0), r"warmup_num_steps=0: must be an integer >= 1"),
    (lambda o: WarmupLR(o, warmup_num_steps=-5), r"warmup_num_steps=-5: must be an integer >= 1"),
    (lambda o: WarmupCosineLR(o, total_num_steps=10, warmup_num_steps=-1),
     r"warmup_num_steps=-1: must be an integer >= 1; give the number of batches"),
    (lambda o: WarmupLR(o, warmup_type="cosine"), r"warmup_type='cosine': .* 'log' .* 'linear'"),
    (lambda o: WarmupLR(o, warmup_min_lr=[0.1, 0.2]),
     r"warmup_min_lr=\[0.1, 0.2\]: has 2 values but the optimizer has 1 param groups"),
    (lambda o: OneCycle(o, cycle_min_lr=0.1, cycle_max_lr=0.01),
     r"cycle_min_lr=0.1 is above cycle_max_lr=0.01; .* make cycle_min_lr <= cycle_max_lr"),
    (lambda o: OneCycle(o, cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_min_mom=0.95),
     r"cycle_min_mom=0.95 is above cycle_max_mom=0.9"),
    (lambda o: OneCycle(o, cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_step_size=0),
     r"cycle_first_step_size=0: must be > 0"),
    (lambda o: OneCycle(o, cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_stair_count=-1),
     r"cycle_first_stair_count=-1: must be an integer >= 0"),
    (lambda o: LRRangeTest(o, lr_range_test_step_size=0),
     r"lr_range_test_step_size=0: must be an integer >= 1"),
    (lambda o: WarmupLR(o, last_batch_iteration=-2), r"last_batch_iteration=-2: must be an integer"),
    (lambda o: WarmupLR(o, warmup_max_lr="auto"), r"warmup_max_lr='auto': must be resolved"),
])
def test_clear_errors(make: Callable[[torch.optim.Optimizer], Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(make_opt())


def test_bad_optimizer_and_short_total() -> None:
    with pytest.raises(TypeError, match="optimizer: Linear is not a torch.optim.Optimizer"):
        WarmupLR(torch.nn.Linear(2, 2))
    # DeepSpeed accepts a schedule shorter than its warmup (and so do we), with a warning.
    with pytest.warns(UserWarning, match="total_num_steps=5 is less than warmup_num_steps=10"):
        WarmupDecayLR(make_opt(), total_num_steps=5, warmup_num_steps=10)
