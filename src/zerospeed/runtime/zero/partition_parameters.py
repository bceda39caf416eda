"""``deepspeed.runtime.zero.partition_parameters``: ZeRO-3 construction and gathering.

Besides ``Init`` and ``GatheredParameters``, frameworks reach in here for DeepSpeed's parameter
status enum and its tensor-constructor wrapper: transformers' ``prevent_arange_dtype_change`` swaps
``zero_wrapper_for_fp_tensor_constructor`` for a version that leaves ``torch.arange`` alone (compared
with ``_orig_torch_arange``). zerospeed's ``zero.Init`` does not patch torch's constructors at all (it
casts parameters as each module is built; buffers keep the dtype they were made with), so swapping the
wrapper changes nothing here, which is the effect transformers wants.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from zerospeed.accelerator import get_accelerator
from zerospeed.zero import GatheredParameters, Init, register_external_parameter, unregister_external_parameter
from zerospeed.zero.ds_param import ZeroParameter, ZeroParamStatus

# torch's own constructors, as DeepSpeed keeps them (its Init patches these names on torch; ours does not)
_orig_torch_tensor = torch.tensor
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full
_orig_torch_arange = torch.arange
_orig_torch_eye = torch.eye
_orig_torch_randn = torch.randn


def zero_wrapper_for_fp_tensor_constructor(fn: Callable[..., torch.Tensor], target_fp_dtype: torch.dtype | None,
                                           target_device: torch.device | None = None) -> Callable[..., torch.Tensor]:
    """DeepSpeed's constructor wrapper: ``fn`` making its tensor on ``target_device`` unless a device is
    given, with floating results cast to ``target_fp_dtype``."""

    def wrapped_fn(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if target_fp_dtype is not None and tensor.is_floating_point():
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor

    return wrapped_fn


__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "get_accelerator", "ZeroParameter", "register_external_parameter",
           "unregister_external_parameter", "zero_wrapper_for_fp_tensor_constructor"]
