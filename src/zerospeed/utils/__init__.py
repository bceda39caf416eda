"""User-facing utilities, named as in ``deepspeed.utils``.

The ``safe_get_*`` / ``safe_set_*`` functions read or write one parameter's full fp32 master,
averaged gradient or optimizer state at any ZeRO stage. Under stages 1-3 they are collectives:
every rank calls them for the same parameter. Gradients are readable between the accumulation
window's last ``backward`` and ``step``.
"""

from __future__ import annotations

import torch

from zerospeed._lazy_submodules import submodule_getattr
from zerospeed.data.loader import RepeatingLoader
from zerospeed.utils.logging import log_dist, logger
from zerospeed.utils.z3_leaf_module import (get_z3_leaf_modules, set_z3_leaf_module, set_z3_leaf_modules,
                                            set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix,
                                            unset_z3_leaf_modules, z3_leaf_module, z3_leaf_parameter)
from zerospeed.zero.owner import engine_owner as _owner


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The full fp32 master of ``param`` (its own values, as fp32, when no engine trains it)."""
    owner = _owner(param)
    return owner.full_fp32() if owner is not None else param.detach().float().clone()


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite ``param``'s fp32 master and model copy with ``value`` (same value on every rank)."""
    owner = _owner(param)
    if owner is None:
        with torch.no_grad():
            param.copy_(value)
        return
    owner.set_full_fp32(value)


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The averaged fp32 gradient of ``param`` (None if it has none)."""
    owner = _owner(param)
    if owner is None:
        return None if param.grad is None else param.grad.detach().float().clone()
    return owner.full_grad()


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The optimizer's full ``optim_state_key`` state of ``param`` (e.g. ``"exp_avg"``), or None."""
    owner = _owner(param)
    return owner.full_optimizer_state(optim_state_key) if owner is not None else None


# ``deepspeed.utils.zero_to_fp32`` and the like, reached as attributes
__getattr__ = submodule_getattr(__name__)

__all__ = ["RepeatingLoader", "get_z3_leaf_modules", "log_dist", "logger", "set_z3_leaf_module",
           "set_z3_leaf_modules", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix",
           "unset_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter", "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_set_full_fp32_param"]
