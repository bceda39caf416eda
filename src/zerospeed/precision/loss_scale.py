"""Loss scaling with DeepSpeed 0.19.8's semantics (``DynamicLossScaler`` / ``LossScaler``).

fp16 gradients underflow unless the loss is multiplied by a large factor before backward.
:class:`DynamicScaler` rides the edge: it starts high, halves on overflow (once hysteresis is
used up) and doubles again after ``scale_window`` clean iterations. :class:`StaticScaler`
keeps a fixed factor and :class:`NoScaler` is the identity used by fp32 and bf16.

The engine detects overflow (:func:`find_inf_or_nan`, reduced across ranks), skips the step,
and reports the result to :meth:`LossScaler.update` once per optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..config.policies import LossScalePolicy
from ..config.schema_precision import FP16Config


class LossScaleAtMinimumError(RuntimeError):
    """An overflow happened while the dynamic scale already sat at ``min_loss_scale``.

    DeepSpeed stops the run here: scaling cannot go lower, so further steps would keep
    overflowing and silently skip forever.
    """


def find_inf_or_nan(tensors: Iterable[torch.Tensor],
                    device: torch.device | str | None = None) -> torch.Tensor:
    """A 0-d bool tensor, True if any element of any tensor is inf or nan.

    One fused ``_foreach_norm(inf)`` over the list (max-abs propagates inf and nan) and one
    ``isfinite`` over the stacked norms; the result stays on the device so it can be
    all-reduced across ranks without a host sync per tensor. All tensors must share a device;
    ``device`` places the False returned for an empty list (default: CPU).
    """
    nonempty = [t.detach() for t in tensors if t.numel() > 0]
    if any(t.is_sparse for t in nonempty):
        nonempty = [t.coalesce().values() if t.is_sparse else t for t in nonempty]
        nonempty = [t for t in nonempty if t.numel() > 0]
    if not nonempty:
        return torch.tensor(False, device=device)
    norms = torch._foreach_norm(nonempty, math.inf, dtype=torch.float32)
    return torch.stack(norms).isfinite().all().logical_not()


def has_inf_or_nan(tensors: Iterable[torch.Tensor]) -> bool:
    """Python-bool form of :func:`find_inf_or_nan` (syncs with the device once)."""
    return bool(find_inf_or_nan(tensors))


class LossScaler:
    """Base: a current scale, an iteration counter and the overflow-update hook."""

    dynamic: bool = False

    def __init__(self, scale: float) -> None:
        if not (scale > 0 and math.isfinite(scale)):
            raise ValueError(f"loss scale must be a positive finite number, got {scale!r}")
        self.cur_scale: float = float(scale)
        self.cur_iter: int = 0

    @property
    def loss_scale(self) -> float:
        """The factor the loss is multiplied by (DeepSpeed's name)."""
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale``; skipped entirely at scale 1 to keep the fp32 graph unchanged."""
        return loss if self.cur_scale == 1.0 else loss * self.cur_scale

    def has_overflow(self, tensors: Iterable[torch.Tensor]) -> bool:
        """Whether any of ``tensors`` (typically gradients) holds an inf or nan."""
        return has_inf_or_nan(tensors)

    def update(self, overflow: bool) -> None:
        """Record one optimizer step; a fixed scale only counts iterations."""
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        return {"cur_scale": self.cur_scale, "cur_iter": self.cur_iter}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.cur_scale = float(_need(state, "cur_scale", type(self).__name__))
        self.cur_iter = int(_need(state, "cur_iter", type(self).__name__))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cur_scale={self.cur_scale}, cur_iter={self.cur_iter})"


class NoScaler(LossScaler):
    """Scale 1.0 for fp32 and bf16: the loss and gradients pass through untouched."""

    def __init__(self) -> None:
        super().__init__(1.0)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.cur_iter = int(state.get("cur_iter", self.cur_iter))


class StaticScaler(LossScaler):
    """A fixed scale (``fp16.loss_scale > 0``): overflowing steps are skipped, scale kept."""


class DynamicScaler(LossScaler):
    """DeepSpeed's ``DynamicLossScaler``.

    On overflow: if hysteresis is used up (``delayed_shift == 1`` or ``cur_hysteresis == 1``)
    the scale becomes ``max(scale / scale_factor, min_scale)`` (raising
    :class:`LossScaleAtMinimumError` if it already equals ``min_scale`` and
    ``raise_error_at_min_scale``), otherwise ``cur_hysteresis`` drops by one. On a clean
    step: ``consecutive_hysteresis`` refills hysteresis; when the clean run since the last
    overflow reaches a positive multiple of ``scale_window`` (counted as DeepSpeed does,
    ``cur_iter - last_overflow_iter - 1``) the scale is multiplied by ``scale_factor`` and
    hysteresis is refilled.
    """

    dynamic = True

    def __init__(self, init_scale: float = 2.0**16, scale_factor: float = 2.0,
                 scale_window: int = 1000, min_scale: float = 1.0, delayed_shift: int = 2,
                 consecutive_hysteresis: bool = False,
                 raise_error_at_min_scale: bool = True) -> None:
        super().__init__(init_scale)
        if not scale_factor > 1:
            raise ValueError(f"scale_factor must be > 1, got {scale_factor!r}")
        if scale_window < 1:
            raise ValueError(f"scale_window (fp16.loss_scale_window) must be >= 1, "
                             f"got {scale_window!r}")
        if not min_scale > 0:
            raise ValueError(f"min_scale (fp16.min_loss_scale) must be > 0, got {min_scale!r}")
        if delayed_shift < 1:
            raise ValueError(f"delayed_shift (fp16.hysteresis) must be >= 1, "
                             f"got {delayed_shift!r}")
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.delayed_shift = int(delayed_shift)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        self.cur_hysteresis = self.delayed_shift
        self.last_overflow_iter = -1

    def update(self, overflow: bool) -> None:
        if overflow:
            self._on_overflow()
        else:
            self._on_clean_step()
        self.cur_iter += 1

    def _on_overflow(self) -> None:
        if self.delayed_shift == 1 or self.cur_hysteresis == 1:
            if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                raise LossScaleAtMinimumError(
                    f"gradient overflow at iteration {self.cur_iter} with the loss scale already "
                    f"at fp16.min_loss_scale = {self.min_scale:g}; it cannot decrease further. "
                    "Check the model/data for inf or nan, or lower fp16.min_loss_scale.")
            self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
        else:
            self.cur_hysteresis -= 1
        self.last_overflow_iter = self.cur_iter

    def _on_clean_step(self) -> None:
        if self.consecutive_hysteresis:
            self.cur_hysteresis = self.delayed_shift
        stable_interval = self.cur_iter - self.last_overflow_iter - 1
        if stable_interval > 0 and stable_interval % self.scale_window == 0:
            self.cur_hysteresis = self.delayed_shift
            self.cur_scale *= self.scale_factor

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "last_overflow_iter": self.last_overflow_iter,
                "cur_hysteresis": self.cur_hysteresis}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.last_overflow_iter = int(_need(state, "last_overflow_iter", "DynamicScaler"))
        self.cur_hysteresis = int(_need(state, "cur_hysteresis", "DynamicScaler"))

    def __repr__(self) -> str:
        return (f"DynamicScaler(cur_scale={self.cur_scale}, cur_iter={self.cur_iter}, "
                f"cur_hysteresis={self.cur_hysteresis}, "
                f"last_overflow_iter={self.last_overflow_iter})")


def scaler_for(policy: LossScalePolicy | None) -> LossScaler:
    """A fresh scaler for a loss-scale policy: None -> :class:`NoScaler`, a fixed scale ->
    :class:`StaticScaler`, dynamic -> :class:`DynamicScaler` from ``initial_scale``."""
    if policy is None:
        return NoScaler()
    if not policy.dynamic:
        return StaticScaler(policy.initial_scale)
    return DynamicScaler(
        init_scale=policy.initial_scale,
        scale_window=policy.scale_window,
        min_scale=policy.min_scale,
        delayed_shift=policy.hysteresis,
        consecutive_hysteresis=policy.consecutive_hysteresis,
    )


def from_config(fp16: FP16Config) -> LossScaler:
    """The scaler an ``fp16`` section asks for: disabled -> :class:`NoScaler`,
    ``loss_scale: 0`` -> :class:`DynamicScaler` from ``2**initial_scale_power``,
    ``loss_scale > 0`` -> :class:`StaticScaler` (an unresolved ``"auto"`` is a ``ConfigError``)."""
    return scaler_for(LossScalePolicy.from_fp16(fp16))


def _need(state: Mapping[str, Any], key: str, owner: str) -> Any:
    try:
        return state[key]
    except KeyError:
        raise ValueError(f"{owner}.load_state_dict: the state has no {key!r} "
                         f"(keys: {sorted(state)}); was it saved by another kind of "
                         "loss scaler?") from None
