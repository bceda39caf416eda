"""``optimizer`` and ``scheduler`` sections.

The ``params`` of DeepSpeed's own optimizer and LR-schedule types are checked against the
keyword arguments DeepSpeed 0.19 passes on (``deepspeed/ops/*``, ``runtime/fp16/onebit``,
``runtime/lr_schedules.py``); a ``torch.optim`` optimizer or ``torch.optim.lr_scheduler``
class named by ``type`` is checked against its constructor signature. Optimizer params keep
only what the user gave (defaults differ between implementations); schedule params are
completed with DeepSpeed's defaults so the schedule code never guesses.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Annotated, Any

from pydantic import model_validator
from pydantic_core import PydanticCustomError

from .base import Section
from .values import (
    AUTO,
    Auto,
    FrozenDict,
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_str,
    fail,
    fail_many,
    freeze,
    json_kind,
    show,
    unknown_key_message,
    validator,
    zbool,
    zobject,
)

Check = Callable[[Any], Any]
Problems = list[tuple[tuple[str | int, ...], str]]

@dataclass(frozen=True)
class Param:
    """One accepted key of ``params``: how to check it and its default (if filled in)."""

    check: Check
    default: Any = None
    required: bool = False


def _nonneg(v: Any) -> float:
    return check_float(v, ge=0)


def _number(v: Any) -> int | float:
    """Any finite number, keeping ints as ints (torch arguments such as ``total_iters``)."""
    number = check_float(v)
    return v if isinstance(v, int) else number


def _count(v: Any) -> int:
    return check_int(v, ge=0)


def _positive_int(v: Any) -> int:
    return check_int(v, ge=1)


def _optional_bool(v: Any) -> bool | None:
    return None if v is None else check_bool(v)


def _betas(v: Any) -> tuple[float, ...]:
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        fail(f"{show(v)} is {json_kind(v) if not isinstance(v, (list, tuple)) else 'not a pair'}; "
             "expected an array of two numbers, each >= 0 and < 1")
    return tuple(check_float(b, ge=0, lt=1) for b in v)


def _number_or_list(v: Any) -> float | tuple[float, ...]:
    """A schedule bound may be one number or one number per parameter group."""
    if isinstance(v, (list, tuple)):
        return tuple(check_float(x, ge=0) for x in v)
    return check_float(v, ge=0)


def _warmup_type(v: Any) -> str:
    return check_choice(v, {"log": "log", "linear": "linear"}, ("log", "linear"))


def _last_batch_iteration(v: Any) -> int:
    return check_int(v, ge=-1)


def _any_json(v: Any) -> Any:
    return freeze(v)


_ADAM_COMMON = MappingProxyType({
    "lr": Param(_nonneg), "betas": Param(_betas), "eps": Param(_nonneg),
    "weight_decay": Param(_nonneg), "amsgrad": Param(check_bool),
})
_TORCH_ADAM_EXTRA = MappingProxyType({
    "foreach": Param(_optional_bool), "maximize": Param(check_bool),
    "capturable": Param(check_bool), "differentiable": Param(check_bool),
    "fused": Param(_optional_bool),
})
_ADAM = MappingProxyType({
    **_ADAM_COMMON, "bias_correction": Param(check_bool), "adam_w_mode": Param(check_bool),
    "torch_adam": Param(check_bool), "set_grad_none": Param(check_bool),
    "fp32_optimizer_states": Param(check_bool), **_TORCH_ADAM_EXTRA,
})
_ONEBIT_COMMON = MappingProxyType({
    "lr": Param(_nonneg), "bias_correction": Param(check_bool), "betas": Param(_betas),
    "eps": Param(_nonneg), "eps_inside_sqrt": Param(check_bool), "weight_decay": Param(_nonneg),
    "amsgrad": Param(check_bool),
    "cuda_aware": Param(check_bool), "comm_backend_name": Param(check_str),
})
_LAMB_COEFFS = MappingProxyType({"max_coeff": Param(_nonneg), "min_coeff": Param(_nonneg)})

#: DeepSpeed's optimizer names (matched case-insensitively) -> printed name and params.
DEEPSPEED_OPTIMIZERS: Mapping[str, tuple[str, Mapping[str, Param]]] = MappingProxyType({
    "adam": ("Adam", _ADAM),
    "adamw": ("AdamW", _ADAM),
    "lamb": ("Lamb", {
        "lr": Param(_nonneg), "bias_correction": Param(check_bool), "betas": Param(_betas),
        "eps": Param(_nonneg), "eps_inside_sqrt": Param(check_bool),
        "weight_decay": Param(_nonneg), **_LAMB_COEFFS,
        "amsgrad": Param(check_bool)}),
    "onebitadam": ("OneBitAdam", {**_ONEBIT_COMMON, "freeze_step": Param(_count)}),
    "zerooneadam": ("ZeroOneAdam", {
        **_ONEBIT_COMMON, "var_freeze_step": Param(_count), "var_update_scaler": Param(_count),
        "local_step_scaler": Param(_count), "local_step_clipper": Param(_count)}),
    "onebitlamb": ("OneBitLamb", {
        **_ONEBIT_COMMON, **_LAMB_COEFFS, "freeze_step": Param(_count),
        "coeff_beta": Param(_nonneg), "factor_max": Param(_nonneg),
        "factor_min": Param(_nonneg), "factor_threshold": Param(_nonneg)}),
    "adagrad": ("Adagrad", {
        "lr": Param(_nonneg), "eps": Param(_nonneg), "weight_decay": Param(_nonneg),
        "amsgrad": Param(check_bool), "fp32_optimizer_states": Param(check_bool),
        "lr_decay": Param(_nonneg), "initial_accumulator_value": Param(_nonneg),
        "foreach": Param(_optional_bool), "maximize": Param(check_bool),
        "differentiable": Param(check_bool), "fused": Param(_optional_bool)}),
    "lion": ("Lion", {
        "lr": Param(_nonneg), "betas": Param(_betas), "weight_decay": Param(_nonneg),
        "set_grad_none": Param(check_bool), "fp32_optimizer_states": Param(check_bool)}),
    "muadam": ("MuAdam", {**_ADAM_COMMON, **_TORCH_ADAM_EXTRA,
                          "decoupled_wd": Param(check_bool)}),
    "muadamw": ("MuAdamW", {**_ADAM_COMMON, **_TORCH_ADAM_EXTRA,
                            "decoupled_wd": Param(check_bool)}),
    "musgd": ("MuSGD", {
        "lr": Param(_nonneg), "momentum": Param(_nonneg), "dampening": Param(_nonneg),
        "weight_decay": Param(_nonneg), "nesterov": Param(check_bool),
        "foreach": Param(_optional_bool), "maximize": Param(check_bool),
        "differentiable": Param(check_bool), "fused": Param(_optional_bool),
        "decoupled_wd": Param(check_bool)}),
    "muon": ("Muon", {
        "lr": Param(_nonneg), "momentum": Param(_nonneg), "weight_decay": Param(_nonneg),
        "muon_lr": Param(_nonneg), "betas": Param(_betas), "eps": Param(_nonneg),
        "adam_lr": Param(_nonneg)}),
})
DEEPSPEED_OPTIMIZERS = MappingProxyType({  # inner specs read-only too
    key: (name, MappingProxyType(dict(spec)))
    for key, (name, spec) in DEEPSPEED_OPTIMIZERS.items()})

_WARMUP_COMMON = MappingProxyType({
    "warmup_num_steps": Param(_positive_int, 1000),
    "warmup_type": Param(_warmup_type, "log"),
    "last_batch_iteration": Param(_last_batch_iteration, -1),
})

#: DeepSpeed's LR schedules (case-sensitive, as in DeepSpeed) with DeepSpeed's defaults.
DEEPSPEED_SCHEDULERS: Mapping[str, Mapping[str, Param]] = MappingProxyType({
    "WarmupLR": {
        "warmup_min_lr": Param(_number_or_list, 0.0),
        "warmup_max_lr": Param(_number_or_list, None),  # None: the optimizer's lr
        **_WARMUP_COMMON,
    },
    "WarmupDecayLR": {
        "total_num_steps": Param(_positive_int, required=True),
        "warmup_min_lr": Param(_number_or_list, 0.0),
        "warmup_max_lr": Param(_number_or_list, 0.001),
        **_WARMUP_COMMON,
    },
    "WarmupCosineLR": {
        "total_num_steps": Param(_positive_int, required=True),
        "warmup_min_ratio": Param(_nonneg, 0.0),
        "cos_min_ratio": Param(_nonneg, 0.0001),
        **_WARMUP_COMMON,
    },
    "OneCycle": {
        "cycle_min_lr": Param(_nonneg, required=True),
        "cycle_max_lr": Param(_nonneg, required=True),
        "decay_lr_rate": Param(_nonneg, 0.0),
        "cycle_first_step_size": Param(_positive_int, 2000),
        "cycle_second_step_size": Param(lambda v: None if v is None else _positive_int(v), None),
        "cycle_first_stair_count": Param(_count, 0),
        "cycle_second_stair_count": Param(lambda v: None if v is None else _count(v), None),
        "decay_step_size": Param(_count, 0),
        "cycle_momentum": Param(check_bool, True),
        "cycle_min_mom": Param(_nonneg, 0.8),
        "cycle_max_mom": Param(_nonneg, 0.9),
        "decay_mom_rate": Param(_nonneg, 0.0),
        "last_batch_iteration": Param(_last_batch_iteration, -1),
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": Param(_number_or_list, 0.001),
        "lr_range_test_step_size": Param(_positive_int, 2000),
        "lr_range_test_step_rate": Param(_nonneg, 1.0),
        "lr_range_test_staircase": Param(check_bool, False),
        "last_batch_iteration": Param(_last_batch_iteration, -1),
    },
})
DEEPSPEED_SCHEDULERS = MappingProxyType({
    key: MappingProxyType(dict(spec)) for key, spec in DEEPSPEED_SCHEDULERS.items()})


def check_params(params: Mapping[str, Any], spec: Mapping[str, Param], *,
                 fill_defaults: bool) -> tuple[FrozenDict, Problems]:
    """Check ``params`` against ``spec``; ``"auto"`` is kept as :data:`AUTO` unchecked."""
    problems: Problems = []
    out: dict[str, Any] = {}
    for key, value in params.items():
        if key not in spec:
            problems.append((("params", key), unknown_key_message(key, tuple(spec))))
            continue
        if isinstance(value, Auto):
            out[key] = AUTO
            continue
        try:
            out[key] = spec[key].check(value)
        except PydanticCustomError as err:
            ctx = err.context or {}
            problems.append((("params", key, *ctx.get("sub", ())), str(ctx.get("msg", err))))
    for key, param in spec.items():
        if key in out or key in params:
            continue
        if param.required:
            problems.append((("params", key), "required key is missing"))
        elif fill_defaults and param.default is not None:
            out[key] = param.default
    return FrozenDict(out), problems


def _torch_classes(module_name: str, base_name: str) -> dict[str, type]:
    """Public classes of a torch module deriving from ``base_name`` (torch imported lazily)."""
    import importlib

    module = importlib.import_module(module_name)
    base = getattr(module, base_name)
    return {name: obj for name, obj in vars(module).items()
            if isinstance(obj, type) and issubclass(obj, base) and obj is not base
            and not name.startswith("_")}


def _signature_spec(cls: type, skip: tuple[str, ...]) -> dict[str, Param]:
    """A params spec from a constructor signature, typed by each argument's default."""
    spec: dict[str, Param] = {}
    init = getattr(cls, "__init__")  # the class's own constructor (not an instance's)
    for name, p in inspect.signature(init).parameters.items():
        if name in ("self", *skip) or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        default = p.default
        if isinstance(default, bool):
            check: Check = check_bool
        elif isinstance(default, (int, float)):
            check = _number
        elif isinstance(default, str):
            check = check_str
        elif isinstance(default, tuple) and all(isinstance(x, (int, float)) for x in default):
            n = len(default)

            def check(v: Any, n: int = n) -> tuple[float, ...]:
                if not isinstance(v, (list, tuple)) or len(v) != n:
                    fail(f"{show(v)} is {json_kind(v)}; expected an array of {n} numbers")
                return tuple(check_float(x) for x in v)
        else:
            check = _any_json
        spec[name] = Param(check, required=default is inspect.Parameter.empty)
    return spec


def _resolve_type(value: Any, deepspeed: Mapping[str, str], torch_names: Callable[[], list[str]],
                  case_insensitive: bool, what: str) -> str:
    """Canonical type name; unknown -> error with a did-you-mean over both name sets."""
    name = check_str(value)
    key = name.lower() if case_insensitive else name
    if key in deepspeed:
        return deepspeed[key]
    candidates = list(deepspeed.values()) + torch_names()
    if name in candidates:
        return name
    hint = unknown_key_message(name, candidates)
    if "did you mean" in hint:
        hint = hint.replace("unknown key; ", "")
    else:
        hint = "expected one of " + ", ".join(sorted(candidates))
    fail(f"{show(name)} is not a DeepSpeed {what} nor a torch class; {hint}")


class OptimizerConfig(Section):
    """``optimizer``: ``type`` (DeepSpeed name, any case, or a ``torch.optim`` class) + params."""

    type: Annotated[str, validator(
        lambda v: _resolve_type(v, {k: n for k, (n, _) in DEEPSPEED_OPTIMIZERS.items()},
                                lambda: list(_torch_classes("torch.optim", "Optimizer")),
                                True, "optimizer"), "an optimizer name")]
    params: Annotated[FrozenDict, zobject()] = FrozenDict()
    legacy_fusion: Annotated[bool, zbool()] = False

    @property
    def is_deepspeed_type(self) -> bool:
        """True for DeepSpeed's own names (Adam, Lamb, OneBitAdam...), False for torch ones."""
        return self.type.lower() in DEEPSPEED_OPTIMIZERS

    @model_validator(mode="after")
    def _check_params(self) -> OptimizerConfig:
        if self.is_deepspeed_type:
            spec = DEEPSPEED_OPTIMIZERS[self.type.lower()][1]
        else:
            spec = _signature_spec(_torch_classes("torch.optim", "Optimizer")[self.type],
                                   ("params",))
        checked, problems = check_params(self.params, spec, fill_defaults=False)
        if problems:
            fail_many(problems)
        object.__setattr__(self, "params", checked)
        return self


class SchedulerConfig(Section):
    """``scheduler``: a DeepSpeed LR schedule or a ``torch.optim.lr_scheduler`` class."""

    type: Annotated[str, validator(
        lambda v: _resolve_type(v, {k: k for k in DEEPSPEED_SCHEDULERS},
                                lambda: list(_torch_classes("torch.optim.lr_scheduler",
                                                            "LRScheduler")),
                                False, "LR schedule"), "a schedule name")]
    params: Annotated[FrozenDict, zobject()] = FrozenDict()

    @property
    def is_deepspeed_type(self) -> bool:
        return self.type in DEEPSPEED_SCHEDULERS

    @model_validator(mode="after")
    def _check_params(self) -> SchedulerConfig:
        if self.is_deepspeed_type:
            spec = DEEPSPEED_SCHEDULERS[self.type]
            checked, problems = check_params(self.params, spec, fill_defaults=True)
        else:
            cls = _torch_classes("torch.optim.lr_scheduler", "LRScheduler")[self.type]
            checked, problems = check_params(self.params, _signature_spec(cls, ("optimizer",)),
                                             fill_defaults=False)
        if problems:
            fail_many(problems)
        total, warm = checked.get("total_num_steps"), checked.get("warmup_num_steps")
        if isinstance(total, int) and isinstance(warm, int) and total < warm:
            warnings.warn(f"scheduler.params.total_num_steps ({total}) is less than "
                          f"warmup_num_steps ({warm})", UserWarning, stacklevel=2)
        object.__setattr__(self, "params", checked)
        return self
