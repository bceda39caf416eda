"""Mixed-precision sections: ``fp16``, ``bf16`` (alias ``bfloat16``), ``amp``,
``torch_autocast`` and ``data_types``. Keys and defaults follow DeepSpeed 0.19."""

from __future__ import annotations

from typing import Annotated

from .base import LooseSection, Section
from .values import (
    Auto,
    DType,
    zbool,
    zdtype,
    zfloat,
    zint,
    zstrlist,
)


class FP16Config(Section):
    """``fp16``: fp16 mixed precision with (by default dynamic) loss scaling."""

    enabled: Annotated[bool | Auto, zbool(auto=True)] = False
    auto_cast: Annotated[bool, zbool()] = False
    #: 0 means dynamic loss scaling; any other value is a static scale.
    loss_scale: Annotated[float, zfloat(ge=0)] = 0.0
    initial_scale_power: Annotated[int, zint(ge=0)] = 16
    loss_scale_window: Annotated[int, zint(ge=1)] = 1000
    hysteresis: Annotated[int, zint(ge=1)] = 2
    consecutive_hysteresis: Annotated[bool, zbool()] = False
    min_loss_scale: Annotated[float, zfloat(gt=0)] = 1.0
    fp16_master_weights_and_grads: Annotated[bool, zbool()] = False

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == 0

    @property
    def initial_dynamic_scale(self) -> float:
        return float(2**self.initial_scale_power)


class BF16Config(Section):
    """``bf16`` (older name ``bfloat16``): bf16 mixed precision, no loss scaling."""

    enabled: Annotated[bool | Auto, zbool(auto=True)] = False
    immediate_grad_update: Annotated[bool, zbool()] = False
    check_grad_overflow: Annotated[bool, zbool()] = True  # DeepSpeed 0.19.8
    bf16_master_weights_and_grads: Annotated[bool, zbool()] = False
    bf16_optimizer_states: Annotated[bool, zbool()] = False


class SkippedStepsConfig(Section):
    """``skipped_steps`` (zerospeed's own section; DeepSpeed has none): steps whose global gradient norm
    is not finite (see ``docs/mixed_precision.md``).

    ``check_fp32``: in fp32, skip such a step as fp16 and bf16 do (DeepSpeed applies it; bf16 has its own
    switch, ``bf16.check_grad_overflow``, and fp16 always skips). ``raise_after_consecutive``: raise
    instead of skipping once this many steps in a row had a non-finite gradient norm (0: never raise)."""

    check_fp32: Annotated[bool, zbool()] = True
    raise_after_consecutive: Annotated[int, zint(ge=0)] = 0


class AmpConfig(LooseSection):
    """``amp``: NVIDIA Apex AMP; keys besides ``enabled`` go to ``amp.initialize`` verbatim."""

    enabled: Annotated[bool | Auto, zbool(auto=True)] = False


class TorchAutocastConfig(Section):
    """``torch_autocast``: run the forward pass under ``torch.autocast``."""

    enabled: Annotated[bool, zbool()] = False
    dtype: Annotated[DType | None, zdtype(nullable=True)] = None
    lower_precision_safe_modules: Annotated[tuple[str, ...] | None, zstrlist(nullable=True)] = None


class DataTypesConfig(Section):
    """``data_types``: dtypes for gradient accumulation, parameters and buffers."""

    grad_accum_dtype: Annotated[DType | None, zdtype(nullable=True)] = None
    param_dtype: Annotated[DType | None, zdtype(nullable=True)] = None
    buffer_dtype: Annotated[DType | None, zdtype(nullable=True)] = None
