"""The model transforms an inference engine applies, in order, built from the settings by one factory.

Each transform is a small policy object (:class:`ModelTransform`: a ``name`` and ``apply(model) ->
model``). :func:`build_transforms` is the one place that decides which run: load the checkpoint,
cast the dtype, split over the tensor-parallel group, move to the device, then kernel injection,
int8 weights and ZeRO-Inference placement (in that order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from zerospeed.distributed.comm import Comm
from zerospeed.inference.settings import InferenceSettings


class ModelTransform(Protocol):
    """One step of preparing a model for serving."""

    @property
    def name(self) -> str: ...

    def apply(self, model: nn.Module) -> nn.Module: ...


@dataclass(frozen=True)
class LoadCheckpoint:
    """Full weights from ``checkpoint=`` into the unsplit model."""

    path: str
    name: str = "load_checkpoint"

    def apply(self, model: nn.Module) -> nn.Module:
        from zerospeed.inference.weights import load_weights

        return load_weights(model, self.path)


@dataclass(frozen=True)
class ModuleTo:
    """``model.to(target)``: a dtype cast (floating parameters and buffers only, as DeepSpeed's ``half()``)
    or a move to the device."""

    target: torch.dtype | torch.device
    name: str

    def apply(self, model: nn.Module) -> nn.Module:
        return model.to(self.target)


@dataclass(frozen=True)
class TensorParallelSplit:
    """AutoTP for serving (or the ``injection_policy``'s split) over the tensor-parallel ``Comm``."""

    comm: Comm
    injection_policy: tuple[tuple[type, tuple[str, ...]], ...] | None = None
    name: str = "tensor_parallel"

    def apply(self, model: nn.Module) -> nn.Module:
        from zerospeed.inference.autotp import split_model

        return split_model(model, self.comm, injection_policy=self.injection_policy)


@dataclass(frozen=True)
class KernelInjection:
    """``replace_with_kernel_inject``: the decoder stack replaced by fused attention over a preallocated KV
    cache of ``max_out_tokens`` positions (its projections stay linear modules, so int8 still finds them)."""

    max_out_tokens: int
    dtype: torch.dtype | None = None
    name: str = "kernel_inject"

    def apply(self, model: nn.Module) -> nn.Module:
        from zerospeed.inference.fused import inject_fused

        inject_fused(model, max_out_tokens=self.max_out_tokens, dtype=self.dtype)
        return model


@dataclass(frozen=True)
class Int8Weights:
    """Group-wise int8 weights for every linear-like module (tied weights stay as they are)."""

    group_size: int
    name: str = "int8"

    def apply(self, model: nn.Module) -> nn.Module:
        from zerospeed.inference.quantize import quantize_linears

        quantize_linears(model, group_size=self.group_size)
        return model


class ZeroInferencePlacement:
    """ZeRO-Inference: the weights sharded (stage 3, in CPU memory or on NVMe per ``offload_param``) and
    streamed unit by unit through every forward. Keeps what it placed (``placed``), so the stage-3
    engine, its hooks and its swap files live as long as the inference engine holding this transform."""

    name = "zero_inference"

    def __init__(self, zero: dict[str, Any]) -> None:
        self.zero = zero
        self.placed: Any = None  # the ZeroInference, once applied

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ZeroInferencePlacement) and other.zero == self.zero

    __hash__ = None  # type: ignore[assignment]

    def apply(self, model: nn.Module) -> nn.Module:
        from zerospeed.inference.zero_inference import zero_inference

        if self.placed is not None:
            raise RuntimeError("ZeroInferencePlacement applies once; build the transforms again for another model")
        self.placed = zero_inference(model, self.zero)
        return self.placed.module


def build_transforms(settings: InferenceSettings, *, comm: Comm | None,
                     device: torch.device) -> tuple[ModelTransform, ...]:
    """The transforms ``settings`` ask for, in the order they run (``comm``: the tensor-parallel group,
    None at tp=1)."""
    out: list[ModelTransform] = []
    if settings.checkpoint is not None:
        out.append(LoadCheckpoint(settings.checkpoint))
    if settings.compute_dtype is not None:
        out.append(ModuleTo(settings.compute_dtype, "cast_dtype"))
    if comm is not None and comm.world_size > 1:
        out.append(TensorParallelSplit(comm, settings.injection_policy))
    if settings.zero is None and not settings.keep_module_on_host:
        out.append(ModuleTo(device, "to_device"))
    if settings.kernel_inject:
        out.append(KernelInjection(settings.max_out_tokens, settings.compute_dtype))
    if settings.int8 is not None:
        out.append(Int8Weights(settings.int8.group_size))
    if settings.zero is not None:
        out.append(ZeroInferencePlacement(settings.zero.to_dict()))
    return tuple(out)


__all__ = ["Int8Weights", "KernelInjection", "LoadCheckpoint", "ModelTransform", "ModuleTo", "TensorParallelSplit", "ZeroInferencePlacement",
           "build_transforms"]
