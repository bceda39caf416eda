"""Mixed precision as values: a :class:`MixedPrecisionPolicy` chosen once from the config,
and the :class:`LossScaler` it makes. The engine asks these objects; it never branches on
fp16/bf16 itself."""

from .loss_scale import (
    DynamicScaler,
    LossScaleAtMinimumError,
    LossScaler,
    NoScaler,
    StaticScaler,
    find_inf_or_nan,
    has_inf_or_nan,
    scaler_for,
)
from .loss_scale import from_config as scaler_from_config
from .nonfinite import NonFinitePolicy, NonFiniteSteps, NonFiniteStepsError
from .policy import MixedPrecisionPolicy, policy_from_config

__all__ = [
    "DynamicScaler",
    "LossScaleAtMinimumError",
    "LossScaler",
    "MixedPrecisionPolicy",
    "NoScaler",
    "NonFinitePolicy",
    "NonFiniteSteps",
    "NonFiniteStepsError",
    "StaticScaler",
    "find_inf_or_nan",
    "has_inf_or_nan",
    "policy_from_config",
    "scaler_for",
    "scaler_from_config",
]
