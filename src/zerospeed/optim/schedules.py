"""DeepSpeed's learning-rate schedules, step for step.

Each schedule reproduces DeepSpeed 0.19.8's ``deepspeed.runtime.lr_schedules`` arithmetic and
defaults, including when the optimizer's param groups are written: at construction (only when
``last_batch_iteration == -1``, i.e. a fresh run) and on every ``step()``. A resumed run
(``load_state_dict`` or ``last_batch_iteration >= 0``) leaves the optimizer alone until the next
``step()``, as DeepSpeed does, so checkpoints move between the two libraries.

Where DeepSpeed silently accepts nonsense (an unknown ``warmup_type``, ``cycle_min_lr`` above
``cycle_max_lr``) we raise ``ValueError`` naming the parameter, its value and the fix.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
from torch.optim import Optimizer

from ..config.errors import ConfigError
from ..config.specs import SchedulerSpec

Number = float | int
PerGroup = Number | Sequence[Number]

#: DeepSpeed cycles only beta1 and pairs it with this fixed beta2 (not the optimizer's own).
ONE_CYCLE_BETA2 = 0.99


def torch_optimizer(optimizer: object) -> Optimizer:
    """The ``torch.optim.Optimizer`` itself, unwrapping one ``.optimizer`` level (ZeRO/fp16 wrappers)."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, Optimizer):
        return inner
    raise TypeError(f"optimizer: {type(optimizer).__name__} is not a torch.optim.Optimizer "
                    "(nor wraps one as .optimizer); pass the optimizer the schedule should drive")


def _per_group(optimizer: Optimizer, value: Any, name: str) -> list[Any]:
    """One value per param group: a scalar is repeated, a list must match the group count."""
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"{name}={list(value)!r}: has {len(value)} values but the optimizer "
                             f"has {groups} param groups; give one number or {groups} numbers")
        return list(value)
    return [value] * groups


def _check_int(value: Any, name: str, *, minimum: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r}: must be an integer >= {minimum}; {fix}")
    return value


def _check_number(value: Any, name: str, *, minimum: float | None = None) -> Number:
    if isinstance(value, str) and value == "auto":  # a config's "auto" never gets here (see SchedulerSpec)
        raise ValueError(f"{name}='auto': must be resolved to a number before the schedule is "
                         "built; give a number")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r}: must be a finite number")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={value!r}: must be >= {minimum}")
    return value


def _check_warmup_type(value: Any) -> str:
    if value not in ("log", "linear"):
        raise ValueError(f"warmup_type={value!r}: unknown warmup shape; use 'log' (DeepSpeed's "
                         "default) or 'linear'")
    return value


def _set_lrs(optimizer: Optimizer, lrs: Sequence[Any]) -> list[Any]:
    """Write ``lrs`` into the param groups (in place for tensor lrs) and read them back."""
    for group, lr in zip(optimizer.param_groups, lrs):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in optimizer.param_groups]


class _Schedule:
    """Shared bookkeeping: the batch counter, applying lrs, and the state dict."""

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer = torch_optimizer(optimizer)
        self.last_batch_iteration = _check_int(
            last_batch_iteration, "last_batch_iteration", minimum=-1,
            fix="use -1 for a fresh run or the index of the last finished batch when resuming")
        self._last_lr: list[Any] | None = None

    def get_lr(self) -> list[Any]:
        """The lrs for ``self.last_batch_iteration`` (computed, not applied)."""
        raise NotImplementedError

    def get_last_lr(self) -> list[Any]:
        """The lrs most recently written to the optimizer by this schedule."""
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__}.get_last_lr(): no lr has been applied yet "
                               "(the schedule was resumed); call step() first")
        return self._last_lr

    def step(self, last_batch_iteration: int | None = None, *,
             batch_iteration: int | None = None) -> None:
        """Advance one batch (or jump to ``last_batch_iteration``) and apply the new lrs.

        ``batch_iteration`` is the keyword DeepSpeed's OneCycle and LRRangeTest use.
        """
        if last_batch_iteration is None:
            last_batch_iteration = batch_iteration
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _set_lrs(self.optimizer, self.get_lr())

    def state_dict(self) -> dict[str, Any]:
        """Only the batch counter, exactly DeepSpeed's format (so checkpoints interchange)."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume at the saved batch; the optimizer's lr changes on the next ``step()``."""
        self.last_batch_iteration = state_dict["last_batch_iteration"]


class LRRangeTest(_Schedule):
    """LR range test: ``lr = min_lr * (1 + step_rate * interval)``, for finding a usable max lr.

    ``interval`` is ``(iteration + 1) / step_size``, floored when ``lr_range_test_staircase``.
    """

    def __init__(self, optimizer: Any, lr_range_test_min_lr: PerGroup = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = _per_group(self.optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        for lr in self.min_lr:
            _check_number(lr, "lr_range_test_min_lr", minimum=0)
        self.step_size = _check_int(lr_range_test_step_size, "lr_range_test_step_size", minimum=1,
                                    fix="give the number of batches per lr increase")
        self.step_rate = _check_number(lr_range_test_step_rate, "lr_range_test_step_rate")
        self.staircase = bool(lr_range_test_staircase)
        if self.last_batch_iteration == -1:
            self._last_lr = _set_lrs(self.optimizer, self.min_lr)

    def _interval(self) -> float:
        ratio = float(self.last_batch_iteration + 1) / self.step_size
        return math.floor(ratio) if self.staircase else ratio

    def get_lr(self) -> list[Any]:
        increase = 1 + self.step_rate * self._interval()
        return [lr * increase for lr in self.min_lr]


class OneCycle(_Schedule):
    """1Cycle: lr rises min -> max -> min over one cycle while momentum (beta1) falls and rises.

    After the cycle, lr decays as ``min_lr / (1 + decay_lr_rate * t / decay_step_size)`` and
    beta1 grows as ``max_mom * (1 + decay_mom_rate * t / decay_step_size)`` (DeepSpeed's
    formulas), ``t`` counting batches since the cycle ended. Momentum is cycled only for
    optimizers with ``betas``; beta2 is then set to 0.99, as DeepSpeed does.
    """

    def __init__(self, optimizer: Any, cycle_min_lr: PerGroup, cycle_max_lr: PerGroup,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: int | None = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: int | None = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: PerGroup = 0.8,
                 cycle_max_mom: PerGroup = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self._init_cycle(cycle_first_step_size, cycle_second_step_size, cycle_first_stair_count,
                         cycle_second_stair_count, decay_step_size)
        self.min_lrs = self._bounds(cycle_min_lr, cycle_max_lr, "cycle_min_lr", "cycle_max_lr")[0]
        self.max_lrs = _per_group(self.optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = _check_number(decay_lr_rate, "decay_lr_rate")
        self.decay_mom_rate = _check_number(decay_mom_rate, "decay_mom_rate")
        # Decay applies only when both an interval and a rate are given.
        no_interval = math.isclose(self.decay_step_size, 0)
        self.skip_lr_decay = no_interval or math.isclose(self.decay_lr_rate, 0)
        self.skip_mom_decay = no_interval or math.isclose(self.decay_mom_rate, 0)
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum and "betas" not in self.optimizer.defaults:
            warnings.warn(f"OneCycle: cycle_momentum is off because {type(self.optimizer).__name__} "
                          "has no 'betas' (DeepSpeed cycles only Adam-style beta1); set "
                          "cycle_momentum: false to silence this", UserWarning, stacklevel=2)
            self.cycle_momentum = False
        self.min_moms: list[tuple[float, float]] = []
        self.max_moms: list[tuple[float, float]] = []
        if self.cycle_momentum:
            lo, hi = self._bounds(cycle_min_mom, cycle_max_mom, "cycle_min_mom", "cycle_max_mom")
            self.min_moms = [(m, ONE_CYCLE_BETA2) for m in lo]
            self.max_moms = [(m, ONE_CYCLE_BETA2) for m in hi]
        if self.last_batch_iteration == -1:
            self._last_lr = _set_lrs(self.optimizer, self.min_lrs)
            if self.cycle_momentum:
                self._set_moms(self.min_moms)

    def _init_cycle(self, first: Any, second: Any, first_stairs: Any, second_stairs: Any,
                    decay_step_size: Any) -> None:
        first = _check_number(first, "cycle_first_step_size")
        if first <= 0:
            raise ValueError(f"cycle_first_step_size={first!r}: must be > 0 (batches in the rising "
                             "half of the cycle)")
        second = first if second is None else _check_number(second, "cycle_second_step_size")
        if second < 0:
            raise ValueError(f"cycle_second_step_size={second!r}: must be >= 0 (batches in the "
                             "falling half); omit it to mirror cycle_first_step_size")
        self.first_step_size = float(first)
        self.second_step_size = float(second)
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        fix = "use 0 for a continuous cycle or the number of stairs"
        self.first_stair_count = _check_int(first_stairs, "cycle_first_stair_count", minimum=0,
                                            fix=fix)
        self.second_stair_count = (self.first_stair_count if second_stairs is None else
                                   _check_int(second_stairs, "cycle_second_stair_count",
                                              minimum=0, fix=fix))
        self.decay_step_size = _check_number(decay_step_size, "decay_step_size", minimum=0)

    def _bounds(self, low: PerGroup, high: PerGroup, low_name: str,
                high_name: str) -> tuple[list[Any], list[Any]]:
        """Per-group (low, high) bounds, checked to be numbers with low <= high."""
        lows = _per_group(self.optimizer, low, low_name)
        highs = _per_group(self.optimizer, high, high_name)
        for i, (lo, hi) in enumerate(zip(lows, highs)):
            _check_number(lo, low_name)
            _check_number(hi, high_name)
            if lo > hi:
                where = f" (param group {i})" if len(lows) > 1 else ""
                raise ValueError(f"{low_name}={lo!r} is above {high_name}={hi!r}{where}; the "
                                 f"cycle runs between them, so make {low_name} <= {high_name}")
        return lows, highs

    def _set_moms(self, moms: Sequence[tuple[float, float]]) -> None:
        for group, betas in zip(self.optimizer.param_groups, moms):
            group["betas"] = betas

    def _scale_factor(self) -> float:
        """Position in the cycle: 0 at the ends, 1 at the peak (stair-quantised if asked)."""
        batch = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch / self.total_size)
        x = 1.0 + batch / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            # Quantise from the integer offset: the float scale can sit just below a stair.
            offset = batch % self.total_size
            if offset <= self.first_step_size:
                position = offset * stairs / self.first_step_size
            else:
                position = (self.total_size - offset) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[Any]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * self._decay_interval()
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """The (beta1, beta2) pairs for the current batch; None when momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [(hi[0] - (hi[0] - lo[0]) * scale, lo[1])
                    for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * self._decay_interval()
        return [(b1 * factor, b2) for b1, b2 in self.max_moms]

    def step(self, last_batch_iteration: int | None = None, *,
             batch_iteration: int | None = None) -> None:
        super().step(last_batch_iteration, batch_iteration=batch_iteration)
        moms = self.get_mom()
        if moms is not None:
            self._set_moms(moms)


def _warmup_fraction(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """0 -> 1 over the warmup: ``log(i+1)/log(n)`` or ``i/n``; 1 once ``i >= n``."""
    if iteration >= warmup_num_steps:
        return 1.0
    if warmup_type == "log":
        return (1.0 / math.log(warmup_num_steps)) * math.log(iteration + 1)
    return iteration / warmup_num_steps


def _warmup_steps(value: Any) -> int:
    """DeepSpeed rejects < 1 and then runs at least 2 warmup steps (log(1) would divide by 0)."""
    _check_int(value, "warmup_num_steps", minimum=1,
               fix="give the number of batches to warm up over (DeepSpeed uses at least 2)")
    return max(2, value)


def _warn_short_total(total_num_steps: Number, warmup_num_steps: int) -> None:
    if total_num_steps < warmup_num_steps:
        warnings.warn(f"total_num_steps={total_num_steps} is less than warmup_num_steps="
                      f"{warmup_num_steps}: the schedule ends before warmup does; raise "
                      "total_num_steps or lower warmup_num_steps", UserWarning, stacklevel=3)


class WarmupLR(_Schedule):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr`` (default: the optimizer's lr), then hold."""

    def __init__(self, optimizer: Any, warmup_min_lr: PerGroup = 0.0,
                 warmup_max_lr: PerGroup | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.warmup_num_steps = _warmup_steps(warmup_num_steps)
        self.warmup_type = _check_warmup_type(warmup_type)
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in self.optimizer.param_groups]
        self.min_lrs = _per_group(self.optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(self.optimizer, warmup_max_lr, "warmup_max_lr")
        for lo, hi in zip(self.min_lrs, self.max_lrs):
            if not torch.is_tensor(lo):
                _check_number(lo, "warmup_min_lr")
            if not torch.is_tensor(hi):
                _check_number(hi, "warmup_max_lr")
        self.delta_lrs = [hi - lo for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.last_batch_iteration == -1:
            self._last_lr = _set_lrs(self.optimizer, self.get_lr())

    def _gamma(self) -> float:
        return _warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)

    def get_lr(self) -> list[Any]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at ``total_num_steps``:
    ``(total - i) / max(1, total - warmup)``, floored at 0."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: PerGroup = 0.0,
                 warmup_max_lr: PerGroup = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        self.total_num_steps = _check_number(total_num_steps, "total_num_steps", minimum=0)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)
        _warn_short_total(self.total_num_steps, self.warmup_num_steps)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._gamma()
        remaining = float(self.total_num_steps - self.last_batch_iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_Schedule):
    """Scale the optimizer's own lr: warm the ratio from ``warmup_min_ratio`` to 1, then follow a
    half cosine down to ``cos_min_ratio`` at ``total_num_steps`` and stay there."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = _check_number(total_num_steps, "total_num_steps", minimum=0)
        self.warmup_num_steps = _warmup_steps(warmup_num_steps)
        self.warmup_type = _check_warmup_type(warmup_type)
        self.warmup_min_ratio = _check_number(warmup_min_ratio, "warmup_min_ratio")
        self.cos_min_ratio = _check_number(cos_min_ratio, "cos_min_ratio")
        _warn_short_total(self.total_num_steps, self.warmup_num_steps)
        # The base lrs, captured once: the ratios apply to these, not to the scheduled lr.
        self.org_lrs = [group["lr"].clone() if torch.is_tensor(group["lr"]) else group["lr"]
                        for group in self.optimizer.param_groups]
        if self.last_batch_iteration == -1:
            self._last_lr = _set_lrs(self.optimizer, self.get_lr())

    def get_lr_ratio(self) -> float:
        """The factor applied to every group's base lr at the current batch."""
        i = self.last_batch_iteration
        if i < 0:
            return 0.0
        if i < self.warmup_num_steps:
            fraction = _warmup_fraction(i, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + fraction * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (i - self.warmup_num_steps + 1)
                       / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[Any]:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


#: DeepSpeed's schedule names (case-sensitive, as in DeepSpeed's config) -> class.
SCHEDULES: Mapping[str, type[_Schedule]] = MappingProxyType({
    "LRRangeTest": LRRangeTest,
    "OneCycle": OneCycle,
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
})


def build_scheduler(spec: SchedulerSpec | None, optimizer: object
                    ) -> _Schedule | torch.optim.lr_scheduler.LRScheduler | None:
    """The configured schedule (``SchedulerSpec.from_config(cfg.scheduler)``) driving ``optimizer``.

    DeepSpeed names build the classes above; any other name is a ``torch.optim.lr_scheduler``
    class constructed with the params (``"auto"`` params were refused by the spec).
    Returns None when no scheduler is configured.
    """
    if spec is None:
        return None
    name = spec.type
    kwargs = spec.kwargs()
    torch_opt = torch_optimizer(optimizer)
    try:
        if name in SCHEDULES:
            return SCHEDULES[name](torch_opt, **kwargs)
        cls = getattr(torch.optim.lr_scheduler, name, None)
        if not isinstance(cls, type):
            raise ConfigError(f"scheduler.type: {name!r} is neither a DeepSpeed schedule "
                              f"({', '.join(SCHEDULES)}) nor a torch.optim.lr_scheduler class")
        built: torch.optim.lr_scheduler.LRScheduler = cls(torch_opt, **kwargs)
        return built
    except (ValueError, TypeError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"scheduler ({name}): {err}") from err
