"""Weight-only int8 quantization of a model's linear layers, in place (issue 20, ``quant`` in inference).

:func:`quantize_linears` replaces every linear-like module — ``nn.Linear``, transformers' ``Conv1D``
(GPT-2, weight ``[in, out]``) and zerospeed's tensor-parallel linears and Conv1Ds — by one holding
its (local) weight as group-wise symmetric int8 (:mod:`zerospeed.ops.int8`), at about a quarter of
fp32's bytes. Activations stay in their dtype (fp32, bf16): products are formed in fp32 from the
dequantized weights and the result is cast back, so a quantized layer differs from the float one only
by the weights' rounding. Tensor-parallel layers keep their communication and quantize their own slice.

A weight shared with another module (a language-model head tied to the token embedding) is left alone
by default: quantizing it in one place would change it in the other, or keep two copies. The report
says which modules were skipped and why.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch
from torch import nn

from zerospeed.ops import int8
from zerospeed.tensor_parallel import regions
from zerospeed.tensor_parallel.conv1d import ColumnParallelConv1D, RowParallelConv1D
from zerospeed.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, TensorParallelLayer

DEFAULT_GROUP_SIZE = int8.DEFAULT_GROUP_SIZE

Skip = Callable[[str, nn.Module], bool]


class _Int8Weight(nn.Module):
    """The int8 storage and matmul every quantized layer shares: ``qweight [out, in]`` (this rank's
    slice), ``scales [out, groups]`` fp32, an optional ``bias`` parameter kept in its dtype."""

    qweight: torch.Tensor
    scales: torch.Tensor
    bias: nn.Parameter | None
    #: GPT-2 Conv1D sources expose ``weight`` as ``[in, out]``
    transposed_weight: bool = False

    def _store(self, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int) -> None:
        q, scales = int8.quantize_groupwise(weight, group_size)
        self.register_buffer("qweight", q.to(weight.device))
        self.register_buffer("scales", scales.to(weight.device))
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        self.group_size = group_size
        self.weight_dtype = weight.dtype

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized (local) weight in the source's layout and dtype: a fresh copy each time, for
        scripts that read it (nothing here uses it; assigning to it is refused)."""
        w = int8.dequantize_groupwise(self.qweight, self.scales, self.group_size).to(self.weight_dtype)
        return w.t().contiguous() if self.transposed_weight else w

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[-1] != self.qweight.shape[1] or not x.is_floating_point():
            raise ValueError(f"{type(self).__name__}: expected a floating input with last dimension "
                             f"{self.qweight.shape[1]} (this rank's in_features); got {x.dtype} {tuple(x.shape)}")
        return int8.matmul(x, self.qweight, self.scales, self.group_size, bias, int8.auto_kernels())

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        """``model.to(dtype)`` casts the bias and the dequantized view but keeps the scales fp32 (a
        device move still moves them)."""
        scales = self.scales
        super()._apply(fn, recurse)
        if self.scales.dtype != torch.float32:
            self.scales = scales.to(self.scales.device)
        self.weight_dtype = fn(torch.empty(0, dtype=self.weight_dtype)).dtype
        return self

    def _sizes(self) -> str:
        return f"group_size={self.group_size}, bias={self.bias is not None}"


class Int8Linear(_Int8Weight):
    """``nn.Linear`` with an int8 weight: ``in_features``, ``out_features`` and ``bias`` as before."""

    def __init__(self, linear: nn.Linear, group_size: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._store(linear.weight, linear.bias, group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self._sizes()}"


class Int8Conv1D(_Int8Weight):
    """transformers' ``Conv1D`` (``y = x W + b``, ``W: [nx, nf]``) with an int8 weight; ``nf``/``nx``
    and ``in_features``/``out_features`` are kept, ``weight`` reads back as ``[nx, nf]``."""

    transposed_weight = True

    def __init__(self, conv: nn.Module, group_size: int):
        super().__init__()
        weight, bias = getattr(conv, "weight"), getattr(conv, "bias", None)
        self.nx, self.nf = int(weight.shape[0]), int(weight.shape[1])
        self.in_features, self.out_features = self.nx, self.nf
        self._store(weight.t(), bias, group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, {self._sizes()}"


def _copy_attrs(dst: nn.Module, src: nn.Module, names: tuple[str, ...]) -> None:
    for name in names:
        if hasattr(src, name):
            setattr(dst, name, getattr(src, name))


class Int8ColumnParallel(_Int8Weight, TensorParallelLayer):
    """A :class:`ColumnParallelLinear` or :class:`ColumnParallelConv1D` with its output rows in int8:
    the same collectives (sequence-parallel gather, ``gather_output``) around the local matmul."""

    in_features: int
    out_features: int
    gather_output: bool = False
    sequence_parallel: bool = False
    sequence_dim: int = 1

    def __init__(self, layer: ColumnParallelLinear | ColumnParallelConv1D, group_size: int):
        super().__init__()
        self.tp = layer.tp
        self.fused_parts = layer.fused_parts
        self.transposed_weight = isinstance(layer, ColumnParallelConv1D)
        _copy_attrs(self, layer, ("in_features", "out_features", "out_per_rank", "gather_output", "sequence_parallel",
                                  "sequence_dim", "nx", "nf", "nf_per_rank"))
        if isinstance(layer, ColumnParallelConv1D):
            self.in_features, self.out_features = layer.nx, layer.nf
        self.sequence_parallel = bool(getattr(layer, "sequence_parallel", False))
        weight = layer.weight.t() if self.transposed_weight else layer.weight
        self._store(weight, layer.bias, group_size)

    def partition_dims(self) -> Mapping[str, int]:
        dims = {"qweight": 0, "scales": 0}
        return {**dims, "bias": 0} if self.bias is not None else dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self._matmul(x, self.bias)
        if self.sequence_parallel:
            x = regions.gather_from_sequence_parallel_region(x, self.tp, self.sequence_dim)
        else:
            x = regions.copy_to_tensor_parallel_region(x, self.tp)
        y = self._matmul(x, self.bias)
        return regions.gather_from_tensor_parallel_region(y, self.tp, -1) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} ({self.qweight.shape[0]} on this "
                f"rank), gather_output={self.gather_output}, {self._sizes()}")


class Int8RowParallel(_Int8Weight, TensorParallelLayer):
    """A :class:`RowParallelLinear` or :class:`RowParallelConv1D` with its input columns in int8: the
    partial products are summed (or reduce-scattered along the sequence) and the bias added after."""

    in_features: int
    out_features: int
    input_is_parallel: bool = True
    sequence_parallel: bool = False
    sequence_dim: int = 1

    def __init__(self, layer: RowParallelLinear | RowParallelConv1D, group_size: int):
        super().__init__()
        self.tp = layer.tp
        self.transposed_weight = isinstance(layer, RowParallelConv1D)
        _copy_attrs(self, layer, ("in_features", "out_features", "in_per_rank", "input_is_parallel",
                                  "sequence_parallel", "sequence_dim", "nx", "nf", "nx_per_rank"))
        if isinstance(layer, RowParallelConv1D):
            self.in_features, self.out_features = layer.nx, layer.nf
        self.input_is_parallel = bool(getattr(layer, "input_is_parallel", True))
        self.sequence_parallel = bool(getattr(layer, "sequence_parallel", False))
        weight = layer.weight.t() if self.transposed_weight else layer.weight
        self._store(weight, layer.bias, group_size)

    def partition_dims(self) -> Mapping[str, int]:
        return {"qweight": 1, "scales": 1}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self._matmul(x, self.bias)
        if not self.input_is_parallel:
            x = regions.scatter_to_tensor_parallel_region(x, self.tp, -1)
        y = self._matmul(x, None)
        if self.sequence_parallel:
            y = regions.reduce_scatter_to_sequence_parallel_region(y, self.tp, self.sequence_dim)
        else:
            y = regions.reduce_from_tensor_parallel_region(y, self.tp)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.qweight.shape[1]} on this rank), "
                f"out_features={self.out_features}, {self._sizes()}")


QUANTIZED = (Int8Linear, Int8Conv1D, Int8ColumnParallel, Int8RowParallel)


@dataclass(frozen=True)
class QuantizeReport:
    """What :func:`quantize_linears` did: the replaced modules, the skipped ones with the reason, and
    the bytes of the replaced weights before (their dtype) and after (int8 plus fp32 scales)."""

    group_size: int
    quantized: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]
    weight_bytes_before: int
    weight_bytes_after: int

    @property
    def modules(self) -> int:
        return len(self.quantized)

    @property
    def ratio(self) -> float:
        """Bytes after / bytes before (0.258 for fp32 weights at group size 128)."""
        return self.weight_bytes_after / self.weight_bytes_before if self.weight_bytes_before else 1.0


def _conv1d_type() -> type | None:
    """transformers' ``Conv1D`` when transformers is already imported (a GPT-2 model imports it)."""
    if "transformers" not in sys.modules:
        return None
    from transformers.pytorch_utils import Conv1D

    return Conv1D


def _quantizer(module: nn.Module, conv1d: type | None) -> Callable[[int], _Int8Weight] | None:
    """How to quantize ``module`` (exact classes only: a subclass may have its own forward)."""
    kind = type(module)
    if kind is nn.Linear:
        return lambda g: Int8Linear(module, g)  # type: ignore[arg-type]
    if conv1d is not None and kind is conv1d:
        return lambda g: Int8Conv1D(module, g)
    if kind in (ColumnParallelLinear, ColumnParallelConv1D):
        return lambda g: Int8ColumnParallel(module, g)  # type: ignore[arg-type]
    if kind in (RowParallelLinear, RowParallelConv1D):
        return lambda g: Int8RowParallel(module, g)  # type: ignore[arg-type]
    return None


def _owners(model: nn.Module) -> dict[int, set[int]]:
    """Parameter id -> ids of the distinct modules holding it (more than one: tied)."""
    owners: dict[int, set[int]] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                owners.setdefault(id(param), set()).add(id(module))
    return owners


def _skip_reason(name: str, module: nn.Module, owners: Mapping[int, set[int]], skip: Skip | None) -> str | None:
    weight = getattr(module, "weight", None)
    if skip is not None and skip(name, module):
        return "skip() asked for it"
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        return "its weight is not a floating tensor"
    if weight.device.type == "meta":
        return "its weight is on the meta device (load the weights first)"
    if len(owners.get(id(weight), ())) > 1:
        return "its weight is tied to another module (e.g. the token embedding); quantizing it would change that one too"
    return None


def _parents(model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Module]]:
    for parent in model.modules():
        for child_name, child in parent._modules.items():
            if child is not None:
                yield parent, child_name, child


@torch.no_grad()
def quantize_linears(model: nn.Module, *, group_size: int = DEFAULT_GROUP_SIZE,
                     skip: Skip | None = None) -> QuantizeReport:
    """Replace, in place, every linear-like module of ``model`` by its int8 counterpart.

    ``group_size``: input elements per fp32 scale (a last shorter group when it does not divide a
    layer's input size; ``>= in_features`` is one scale per output row). ``skip(name, module)`` -> True
    keeps a module in float (e.g. ``lambda name, m: name == "lm_head"``). Weights tied to another
    module are always kept. A module shared at several places is replaced at every one of them."""
    int8.check_group_size(group_size)
    conv1d = _conv1d_type()
    if _quantizer(model, conv1d) is not None:
        raise TypeError(f"quantize_linears replaces layers inside a model; {type(model).__name__} is itself one: "
                        f"wrap it (nn.Sequential(layer)) or use {Int8Linear.__name__} directly")
    owners = _owners(model)
    replaced: dict[int, _Int8Weight] = {}
    quantized: list[str] = []
    skipped: list[tuple[str, str]] = []
    before = after = 0
    for name, module in model.named_modules():
        make = _quantizer(module, conv1d)
        if make is None:
            continue
        reason = _skip_reason(name, module, owners, skip)
        if reason is not None:
            skipped.append((name, reason))
            continue
        new = make(group_size)
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        before += weight.numel() * weight.element_size()
        after += new.qweight.numel() * new.qweight.element_size() + new.scales.numel() * new.scales.element_size()
        replaced[id(module)] = new
        quantized.append(name)
    for parent, child_name, child in list(_parents(model)):
        if id(child) in replaced:
            setattr(parent, child_name, replaced[id(child)])
    return QuantizeReport(group_size, tuple(quantized), tuple(skipped), before, after)


__all__ = ["DEFAULT_GROUP_SIZE", "Int8ColumnParallel", "Int8Conv1D", "Int8Linear", "Int8RowParallel", "QUANTIZED",
           "QuantizeReport", "quantize_linears"]
