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
    from_config,
    has_inf_or_nan,
)

__all__ = [
    "DynamicScaler",
    "LossScaleAtMinimumError",
    "LossScaler",
    "NoScaler",
    "StaticScaler",
    "find_inf_or_nan",
    "from_config",
    "has_inf_or_nan",
]
