"""The mixed-precision policy: every dtype decision of a run, made once from the config.

The engine, the gradient reducer and the optimizer wrapper read dtypes from one frozen
:class:`MixedPrecisionPolicy` and get their loss scaler from :meth:`make_scaler`, so no
``if fp16:`` chain appears anywhere else. The three precisions differ only in the values:

=========  ===========  ============  ================  ====================  ==========
precision  param_dtype  master_dtype  grad_accum_dtype  reduce_dtype          scaler
=========  ===========  ============  ================  ====================  ==========
fp32       fp32         fp32          fp32              grad_accum_dtype      none
bf16       bf16         fp32          fp32              grad_accum_dtype      none
fp16       fp16         fp32          fp32              grad_accum_dtype      fp16 section
=========  ===========  ============  ================  ====================  ==========

A step whose global gradient norm is not finite is skipped (``check_overflow``) in fp16 always, in
bf16 unless ``bf16.check_grad_overflow`` is false (DeepSpeed's key and meaning), in fp32 unless
``skipped_steps.check_fp32`` is false (zerospeed's: DeepSpeed applies such an fp32 step);
``nonfinite`` says how such steps are reported (see :mod:`zerospeed.precision.nonfinite`).

``data_types.grad_accum_dtype`` and ``communication_data_type`` override their columns.
(DeepSpeed 0.19.8 defaults both to the model dtype; accumulating and reducing in fp32 by
default costs bandwidth but keeps bf16/fp16 runs close to fp32, which the engine's parity
tests rely on. Set ``communication_data_type`` to trade that back.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..config.errors import ConfigError
from ..config.schema import Config
from ..config.policies import LossScalePolicy
from ..config.values import DType
from ..tensor_tree import map_tensors
from .loss_scale import LossScaler, scaler_for
from .nonfinite import NonFinitePolicy


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Which dtype each kind of state lives in, and how the loss is scaled.

    ``param_dtype`` is the model's compute dtype (parameters as the forward sees them);
    ``master_dtype`` is what the optimizer updates; ``grad_accum_dtype`` holds gradients
    summed over micro-batches; ``reduce_dtype`` goes over the wire. ``check_overflow``
    says whether a non-finite gradient skips the step. ``loss_scaling`` is the fp16 loss
    scaling that :meth:`make_scaler` follows, None for no scaling. ``nonfinite``: how
    non-finite steps are reported, and after how many in a row the run stops.
    """

    precision: DType
    param_dtype: torch.dtype
    master_dtype: torch.dtype
    grad_accum_dtype: torch.dtype
    reduce_dtype: torch.dtype
    check_overflow: bool
    loss_scaling: LossScalePolicy | None = None
    nonfinite: NonFinitePolicy = NonFinitePolicy()

    @property
    def needs_master_copy(self) -> bool:
        """Whether the optimizer needs its own higher-precision copy of the parameters."""
        return self.param_dtype != self.master_dtype

    @property
    def input_dtype(self) -> torch.dtype | None:
        """Floating inputs are cast to this before forward; None leaves them alone (fp32:
        a user's fp64 inputs are theirs to keep)."""
        return None if self.param_dtype == torch.float32 else self.param_dtype

    def make_scaler(self) -> LossScaler:
        """A fresh loss scaler (mutable, so one per engine, never shared)."""
        return scaler_for(self.loss_scaling)

    def cast_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Cast the module's floating parameters and buffers to ``param_dtype`` in place."""
        return module.to(dtype=self.param_dtype)

    def cast_inputs(self, inputs: Any) -> Any:
        """``inputs`` with every floating tensor cast to :attr:`input_dtype`.

        Walks tuples (named ones too), lists and mappings; integer, bool and complex
        tensors and non-tensors are returned unchanged, so token ids and masks survive.
        """
        dtype = self.input_dtype
        return inputs if dtype is None else _cast_floating(inputs, dtype)

    def cast_forward_args(self, args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """:meth:`cast_inputs` applied to one forward call's ``*args`` and ``**kwargs``."""
        return self.cast_inputs(args), self.cast_inputs(kwargs)


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    return map_tensors(value, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t)


def policy_from_config(cfg: Config) -> MixedPrecisionPolicy:
    """The policy ``cfg`` asks for (``"auto"`` in fp16/bf16.enabled must be resolved)."""
    precision = cfg.precision
    compute = precision.torch_dtype
    asked = cfg.data_types.param_dtype
    if asked is not None and asked != precision:
        raise ConfigError(f"data_types.param_dtype: {asked} does not match the precision "
                          f"{precision} chosen by fp16/bf16.enabled; drop it or make them agree")
    accum = cfg.data_types.grad_accum_dtype
    grad_accum = torch.float32 if accum is None else accum.torch_dtype
    comm = cfg.communication_data_type
    check_overflow = {DType.FP32: cfg.skipped_steps.check_fp32, DType.BF16: cfg.bf16.check_grad_overflow,
                      DType.FP16: True}[precision]
    switch = {DType.FP32: "skipped_steps.check_fp32", DType.BF16: "bf16.check_grad_overflow",
              DType.FP16: ""}[precision]
    return MixedPrecisionPolicy(
        precision=precision,
        param_dtype=compute,
        master_dtype=torch.float32,
        grad_accum_dtype=grad_accum,
        reduce_dtype=grad_accum if comm is None else comm.torch_dtype,
        check_overflow=check_overflow,
        loss_scaling=LossScalePolicy.from_fp16(cfg.fp16) if precision == DType.FP16 else None,
        nonfinite=NonFinitePolicy(switch=switch,
                                  raise_after_consecutive=cfg.skipped_steps.raise_after_consecutive),
    )


__all__ = ["MixedPrecisionPolicy", "policy_from_config"]
