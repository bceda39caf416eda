"""Config ``optimizer`` section -> a ``torch.optim.Optimizer``, as DeepSpeed 0.19.8 builds it.

Follows ``DeepSpeedEngine._configure_basic_optimizer``: ``Adam`` means AdamW (decoupled weight
decay) unless ``adam_w_mode`` is false, ``AdamW`` always means AdamW, missing Adam params take
DeepSpeed FusedAdam's defaults (notably ``weight_decay`` 0, where torch's AdamW would use 0.01)
unless ``torch_adam`` asks for torch's optimizer with torch's defaults, ``Lamb`` is our
:class:`~zerospeed.optim.lamb.Lamb`, ``Adagrad`` and any other ``torch.optim`` class name are
torch's class with the params as given. User parameter groups (dicts with their own ``lr``,
``weight_decay``...) reach the optimizer unchanged, so their overrides win over the config.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch.optim import Optimizer

from ..config.errors import ConfigError
from ..config.specs import OptimizerSpec
from .lamb import Lamb

__all__ = ["OPTIMIZERS", "UNIMPLEMENTED", "build_optimizer"]

Params = Iterable[torch.Tensor] | Iterable[dict[str, Any]]

#: DeepSpeed FusedAdam / DeepSpeedCPUAdam defaults (deepspeed/ops/adam), used for ``Adam``/``AdamW``.
FUSED_ADAM_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0})

#: DeepSpeed optimizer types we accept in the config but do not implement yet.
UNIMPLEMENTED: tuple[str, ...] = ("Lion", "MuAdam", "MuAdamW", "MuSGD", "Muon")


def _adam(name: str) -> Callable[..., Optimizer]:
    """Builder for DeepSpeed's ``Adam``/``AdamW`` types (engine.get_optimizer_configuration); under CPU
    offload, as in DeepSpeed, ``CPUAdam`` (one pass with the low-precision copy-out)."""

    def build(params: Params, kwargs: dict[str, Any], cpu_offload: bool = False) -> Optimizer:
        adam_w_mode = kwargs.pop("adam_w_mode", True)
        torch_adam = kwargs.pop("torch_adam", False)
        kwargs.pop("set_grad_none", None)  # torch's zero_grad() already sets grads to None
        if cpu_offload and not torch_adam:
            from ..ops.adam import CPUAdam

            kwargs.pop("fp32_optimizer_states", None)
            return CPUAdam(params, **{**FUSED_ADAM_DEFAULTS, **kwargs},
                           adamw_mode=name == "AdamW" or adam_w_mode)
        kwargs.pop("fp32_optimizer_states", None)  # DeepSpeed CPU Adam only; states are fp32
        if not kwargs.pop("bias_correction", True):
            raise NotImplementedError(
                "optimizer.params.bias_correction: false (Adam without bias correction, "
                "supported by DeepSpeed's FusedAdam) is not implemented; remove the key or "
                "set it to true")
        if not torch_adam:
            kwargs = {**FUSED_ADAM_DEFAULTS, **kwargs}
        decoupled = name == "AdamW" or adam_w_mode
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        return cls(params, **kwargs)

    return build


def _adagrad(params: Params, kwargs: dict[str, Any]) -> Optimizer:
    """torch's Adagrad, as DeepSpeed uses without CPU offload; CPU-Adagrad-only keys dropped."""
    kwargs.pop("fp32_optimizer_states", None)
    if kwargs.pop("amsgrad", False):
        raise NotImplementedError("optimizer.params.amsgrad: Adagrad has no AMSGrad variant; "
                                  "remove the key")
    return torch.optim.Adagrad(params, **kwargs)


def _lamb(params: Params, kwargs: dict[str, Any]) -> Optimizer:
    return Lamb(params, **kwargs)


def _onebit_adam(params: Params, kwargs: dict[str, Any]) -> Optimizer:
    """The replica group is bound when the engine adopts it (``ExchangingOptimizer``)."""
    from .onebit.adam import OnebitAdam

    return OnebitAdam(params, **kwargs)


def _zero_one_adam(params: Params, kwargs: dict[str, Any]) -> Optimizer:
    """The replica group is bound when the engine adopts it, as for 1-bit Adam."""
    from .onebit.zoadam import ZeroOneAdam

    return ZeroOneAdam(params, **kwargs)


def _onebit_lamb(params: Params, kwargs: dict[str, Any]) -> Optimizer:
    """The replica group is bound when the engine adopts it, as for 1-bit Adam."""
    from .onebit.lamb import OnebitLamb

    return OnebitLamb(params, **kwargs)


#: DeepSpeed optimizer types we build ourselves; every other name is a ``torch.optim`` class.
OPTIMIZERS: Mapping[str, Callable[[Params, dict[str, Any]], Optimizer]] = MappingProxyType({
    "Adam": _adam("Adam"), "AdamW": _adam("AdamW"), "Adagrad": _adagrad, "Lamb": _lamb,
    "OneBitAdam": _onebit_adam, "ZeroOneAdam": _zero_one_adam, "OneBitLamb": _onebit_lamb})


def build_optimizer(spec: OptimizerSpec | None, params: Params, cpu_offload: bool = False) -> Optimizer | None:
    """The configured optimizer (``OptimizerSpec.from_config(cfg.optimizer)``) over ``params``.

    ``params`` is what ``model_parameters`` holds: tensors, ``module.parameters()`` or parameter
    group dicts. Returns None when no optimizer is configured. Raises ``ConfigError`` for
    arguments the optimizer rejects (unresolved ``"auto"`` values were refused by the spec),
    ``NotImplementedError`` for DeepSpeed optimizers and options zerospeed does not implement.
    """
    if spec is None:
        return None
    name = spec.type
    if name in UNIMPLEMENTED:
        raise NotImplementedError(
            f"optimizer.type: {name!r} is a DeepSpeed optimizer zerospeed does not implement "
            f"yet; use one of {', '.join(OPTIMIZERS)} or a torch.optim class name")
    kwargs = spec.kwargs()  # (a config's max_grad_norm became gradient_clipping)
    build = OPTIMIZERS.get(name) or _torch_class(name)
    try:
        if cpu_offload and name in ("Adam", "AdamW"):
            return _adam(name)(params, kwargs, cpu_offload=True)
        return build(params, kwargs)
    except TypeError as err:  # an argument the class does not take
        raise ConfigError(f"optimizer.params ({name}): {err}") from err
    except ValueError as err:  # torch's range checks ("Invalid learning rate: -1")
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"optimizer.params ({name}): {err}") from err


def _torch_class(name: str) -> Callable[[Params, dict[str, Any]], Optimizer]:
    """Builder for ``torch.optim.<name>``; a name that is not an optimizer class is an error."""
    cls = getattr(torch.optim, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Optimizer)):
        raise ConfigError(f"optimizer.type: {name!r} is neither a DeepSpeed optimizer "
                          f"({', '.join(OPTIMIZERS)}) nor a torch.optim optimizer class")
    return lambda params, kwargs: cls(params, **kwargs)
