"""Column- and row-parallel versions of transformers' ``Conv1D`` (GPT-2's linear layer, weight ``[in, out]``).

They keep Conv1D's transposed layout and its parameter names (``weight``, ``bias``), so a split GPT-2
has the same state-dict keys and orientation as the Hugging Face one and its checkpoints stay
interchangeable; :meth:`partition_dims` says which dimension of that layout is split. Converting to
``nn.Linear`` instead would transpose every saved weight. Communication is the linear layers':
the same autograd regions, so the forward and backward match :mod:`zerospeed.tensor_parallel.layers`.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from zerospeed.tensor_parallel import regions
from zerospeed.tensor_parallel.group import TPGroup, degree, divide, rank, tp_comm
from zerospeed.tensor_parallel.layers import TensorParallelLayer
from zerospeed.tensor_parallel.layout import ParamSplit


def fused_slice(full: torch.Tensor, dim: int, parts: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Slice ``tp_rank`` of ``full`` along ``dim`` when ``parts`` equal tensors are fused there: this rank's
    piece of each, concatenated (GPT-2's ``c_attn``: ``[q_r, k_r, v_r]``)."""
    return ParamSplit(dim, tp_rank, tp_size, parts).local_slice(full.detach()).clone()


def _param(value: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(value, requires_grad=like.requires_grad)


def _conv1d_params(conv: nn.Module) -> tuple[nn.Parameter, nn.Parameter]:
    """``Conv1D``'s ``weight [in, out]`` and ``bias [out]`` (it always has a bias)."""
    weight, bias = getattr(conv, "weight", None), getattr(conv, "bias", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 2 or not isinstance(bias, nn.Parameter):
        raise TypeError(f"{type(conv).__name__} is not a Conv1D (weight [in, out] and bias [out] expected)")
    return weight, bias


class ColumnParallelConv1D(TensorParallelLayer):
    """``y = x W + b`` with ``W: [in, out]`` split along ``out`` (its columns; bias split alike)."""

    def __init__(self, conv: nn.Module, *, tp_group: TPGroup, parts: int = 1, gather_output: bool = False):
        super().__init__()
        self.tp = tp_comm(tp_group)
        weight, bias = _conv1d_params(conv)
        nx, nf = weight.shape
        self.nx, self.nf, self.gather_output, self.fused_parts = int(nx), int(nf), gather_output, parts
        self.nf_per_rank = divide(self.nf, degree(self.tp) * parts, "output features of the Conv1D") * parts
        self.weight = _param(fused_slice(weight, 1, parts, rank(self.tp), degree(self.tp)), weight)
        self.bias = _param(fused_slice(bias, 0, parts, rank(self.tp), degree(self.tp)), bias)

    def partition_dims(self) -> Mapping[str, int]:
        return {"weight": 1, "bias": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:
            x = regions.copy_to_tensor_parallel_region(x, self.tp)
        y = torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.nf_per_rank)
        if self.tp is not None and self.gather_output:
            return regions.gather_from_tensor_parallel_region(y, self.tp, -1)
        return y

    def extra_repr(self) -> str:
        return (f"nf={self.nf} ({self.nf_per_rank} on this rank, {self.fused_parts} fused), nx={self.nx}, "
                f"gather_output={self.gather_output}")


class RowParallelConv1D(TensorParallelLayer):
    """``y = x W + b`` with ``W: [in, out]`` split along ``in`` (its rows); the partial products are
    summed over the group and the replicated bias is added once, after the sum."""

    def __init__(self, conv: nn.Module, *, tp_group: TPGroup):
        super().__init__()
        self.tp = tp_comm(tp_group)
        weight, bias = _conv1d_params(conv)
        nx, nf = weight.shape
        self.nx, self.nf = int(nx), int(nf)
        self.nx_per_rank = divide(self.nx, degree(self.tp), "input features of the Conv1D")
        self.weight = _param(fused_slice(weight, 0, 1, rank(self.tp), degree(self.tp)), weight)
        self.bias = _param(bias.detach().clone(), bias)

    def partition_dims(self) -> Mapping[str, int]:
        return {"weight": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, self.weight)
        if self.tp is not None:
            y = regions.reduce_from_tensor_parallel_region(y, self.tp)
        return y + self.bias

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx} ({self.nx_per_rank} on this rank)"


__all__ = ["ColumnParallelConv1D", "RowParallelConv1D", "fused_slice"]
