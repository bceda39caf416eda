"""Megatron-style tensor-parallel layers: column- and row-parallel linears, a vocabulary-parallel
embedding, and norms for sequence parallelism.

Each layer holds only its rank's slice of the weights and declares how it was split
(:meth:`TensorParallelLayer.partition_dims`), which checkpoints and the gradient norm read. A layer
built from scratch draws the *full* weights exactly as its plain torch counterpart would (same
calls on the same generator, in the same order) and keeps its slice, so a tensor-parallel model
and the unsharded one seeded alike start identical, at any tensor-parallel size (the full weight
exists once, briefly, per layer). ``from_linear``/``from_embedding`` split an existing layer.

``sequence_parallel=True`` (Megatron's sequence parallelism): activations outside the
column/row pair are split along ``sequence_dim``; the column layer all-gathers its input (backward:
reduce-scatter) and the row layer reduce-scatters its output (backward: all-gather) instead of the
all-reduce pair. Norms and the row layer's bias then see one sequence shard each, so their
gradients are summed over the group (one all-reduce per layer, in backward).
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, TypeVar

import torch
from torch import nn
from torch.nn import functional as F

from zerospeed.distributed.comm import Comm
from zerospeed.tensor_parallel import regions
from zerospeed.tensor_parallel.group import TPGroup, degree, divide, rank, tp_comm

InitMethod = Callable[[torch.Tensor], object]


class TensorParallelLayer(nn.Module):
    """A module whose parameters are slices of a larger tensor split over a tensor-parallel group."""

    tp: Comm | None
    #: Equal tensors fused along the split dimension, each split on its own (AutoTP's GPT-2 ``c_attn``:
    #: q, k and v), so a rank's slice is its piece of each; 1 for a plain split.
    fused_parts: int = 1

    @property
    def tp_size(self) -> int:
        return degree(self.tp)

    @property
    def tp_rank(self) -> int:
        return rank(self.tp)

    def partition_dims(self) -> Mapping[str, int]:
        """Local parameter name -> the dimension split over the group (absent: replicated)."""
        raise NotImplementedError


def _linear_init(weight: torch.Tensor, bias: torch.Tensor | None, init_method: InitMethod | None) -> None:
    """``nn.Linear.reset_parameters`` on the full tensors (same draws), or ``init_method`` and zero bias."""
    if init_method is not None:
        init_method(weight)
        if bias is not None:
            nn.init.zeros_(bias)
        return
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        fan_in = weight.shape[1]
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        nn.init.uniform_(bias, -bound, bound)


def _full_linear(in_features: int, out_features: int, bias: bool, init_method: InitMethod | None,
                 device: torch.device | str | None, dtype: torch.dtype | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The full weight and bias an ``nn.Linear(in_features, out_features)`` would start with (on the
    meta device: shapes only, no draw from the generator)."""
    weight = torch.empty(out_features, in_features, device=device, dtype=dtype)
    full_bias = torch.empty(out_features, device=device, dtype=dtype) if bias else None
    _linear_init(weight, full_bias, init_method)
    return weight, full_bias


def _slice(full: torch.Tensor, dim: int, comm: Comm | None) -> torch.Tensor:
    return full.detach().chunk(degree(comm), dim=dim)[rank(comm)].clone()


def _parameter(value: torch.Tensor, like: torch.Tensor) -> nn.Parameter:
    """``value`` as a parameter, trainable when the tensor it was cut from is (fresh tensors are)."""
    return nn.Parameter(value, requires_grad=like.requires_grad or not isinstance(like, nn.Parameter))


_L = TypeVar("_L", bound="_ParallelLinear")


class _ParallelLinear(TensorParallelLayer):
    """What the column and row layers share: the group, the sizes, sequence parallelism, and building
    from the full tensors (drawn as ``nn.Linear`` would, or an existing layer's)."""

    def __init__(self, in_features: int, out_features: int, *, tp_group: TPGroup, sequence_parallel: bool,
                 sequence_dim: int):
        super().__init__()
        self.tp = tp_comm(tp_group)
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel = sequence_parallel and degree(self.tp) > 1
        self.sequence_dim = sequence_dim

    def _take(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Keep this rank's part of the full ``weight`` and ``bias`` (their ``requires_grad`` too)."""
        raise NotImplementedError

    @classmethod
    def _split(cls: type[_L], linear: nn.Linear, *, tp_group: TPGroup, sequence_parallel: bool, sequence_dim: int,
               **options: bool) -> _L:
        """This rank's part of an existing ``nn.Linear``: the layer is made on the meta device (no draws
        from the generator), then takes its part of the linear's tensors."""
        make: Callable[..., _L] = cls  # a subclass: its constructor takes bias, device, options
        layer = make(linear.in_features, linear.out_features, linear.bias is not None, tp_group=tp_group,
                     sequence_parallel=sequence_parallel, sequence_dim=sequence_dim, device="meta", **options)
        layer._take(linear.weight, linear.bias)
        return layer


class ColumnParallelLinear(_ParallelLinear):
    """``y = x A^T + b`` with ``A`` split along its output rows: each rank computes its slice of ``y``.

    ``gather_output=True`` all-gathers ``y`` along its last dimension (otherwise the next layer,
    usually a :class:`RowParallelLinear`, consumes the slice). With ``sequence_parallel`` the input
    is this rank's sequence shard and is all-gathered first."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False, *,
                 tp_group: TPGroup = None, sequence_parallel: bool = False, sequence_dim: int = 1,
                 init_method: InitMethod | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, tp_group=tp_group, sequence_parallel=sequence_parallel,
                         sequence_dim=sequence_dim)
        self.out_per_rank = divide(out_features, degree(self.tp), "ColumnParallelLinear out_features")
        self.gather_output = gather_output
        self._take(*_full_linear(in_features, out_features, bias, init_method, device, dtype))

    def _take(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Keep this rank's rows of the full ``weight`` and ``bias`` (their ``requires_grad`` too)."""
        self.weight = _parameter(_slice(weight, 0, self.tp), weight)
        self.bias = _parameter(_slice(bias, 0, self.tp), bias) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, tp_group: TPGroup, gather_output: bool = False,
                    sequence_parallel: bool = False, sequence_dim: int = 1) -> "ColumnParallelLinear":
        """This rank's slice of an existing ``nn.Linear`` (AutoTP)."""
        return cls._split(linear, tp_group=tp_group, sequence_parallel=sequence_parallel, sequence_dim=sequence_dim,
                          gather_output=gather_output)

    def partition_dims(self) -> Mapping[str, int]:
        return {"weight": 0, "bias": 0} if self.bias is not None else {"weight": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.linear(x, self.weight, self.bias)
        if self.sequence_parallel:
            x = regions.gather_from_sequence_parallel_region(x, self.tp, self.sequence_dim)
        else:
            x = regions.copy_to_tensor_parallel_region(x, self.tp, grad_inplace=True)  # F.linear alone reads x
        y = F.linear(x, self.weight, self.bias)
        return regions.gather_from_tensor_parallel_region(y, self.tp, -1) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} ({self.out_per_rank} on this "
                f"rank), bias={self.bias is not None}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(_ParallelLinear):
    """``y = x A^T + b`` with ``A`` split along its input columns: each rank multiplies its slice of
    ``x`` and the partial results are summed (all-reduce; reduce-scatter along the sequence with
    ``sequence_parallel``). The bias is replicated and added once, after the sum.

    ``input_is_parallel=False`` splits a replicated input first (no communication)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True, *,
                 tp_group: TPGroup = None, sequence_parallel: bool = False, sequence_dim: int = 1,
                 init_method: InitMethod | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, tp_group=tp_group, sequence_parallel=sequence_parallel,
                         sequence_dim=sequence_dim)
        self.in_per_rank = divide(in_features, degree(self.tp), "RowParallelLinear in_features")
        self.input_is_parallel = input_is_parallel
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear(sequence_parallel=True) needs input_is_parallel=True "
                             "(its input is the column-parallel output, as in Megatron)")
        self._take(*_full_linear(in_features, out_features, bias, init_method, device, dtype))

    def _take(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Keep this rank's columns of the full ``weight`` and the whole ``bias``."""
        self.weight = _parameter(_slice(weight, 1, self.tp), weight)
        self.bias = _parameter(bias.detach().clone(), bias) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, tp_group: TPGroup, input_is_parallel: bool = True,
                    sequence_parallel: bool = False, sequence_dim: int = 1) -> "RowParallelLinear":
        """This rank's slice of an existing ``nn.Linear`` (AutoTP)."""
        return cls._split(linear, tp_group=tp_group, sequence_parallel=sequence_parallel, sequence_dim=sequence_dim,
                          input_is_parallel=input_is_parallel)

    def partition_dims(self) -> Mapping[str, int]:
        return {"weight": 1}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.linear(x, self.weight, self.bias)
        if not self.input_is_parallel:
            x = regions.scatter_to_tensor_parallel_region(x, self.tp, -1)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = regions.reduce_scatter_to_sequence_parallel_region(y, self.tp, self.sequence_dim)
            if self.bias is not None:
                (bias,) = regions.sum_grads_over_group(self.tp, self.bias)
                y = y + bias
            return y
        y = regions.reduce_from_tensor_parallel_region(y, self.tp, inplace=True)  # y: F.linear's, unsaved
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.in_per_rank} on this rank), out_features="
                f"{self.out_features}, bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(TensorParallelLayer):
    """An embedding whose rows (the vocabulary) are split over the group: each rank looks up the ids
    it holds, zeros the others, and the results are summed (all-reduce; reduce-scatter along the
    sequence with ``sequence_parallel``, giving this rank's sequence shard)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, *,
                 tp_group: TPGroup = None, sequence_parallel: bool = False, sequence_dim: int = 1,
                 init_method: InitMethod | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.tp = tp_comm(tp_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.padding_idx = padding_idx
        per_rank = divide(num_embeddings, degree(self.tp), "VocabParallelEmbedding num_embeddings")
        self.vocab_start, self.vocab_end = rank(self.tp) * per_rank, (rank(self.tp) + 1) * per_rank
        self.sequence_parallel = sequence_parallel and degree(self.tp) > 1
        self.sequence_dim = sequence_dim
        full = torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype)
        if init_method is not None:
            init_method(full)
        else:
            nn.init.normal_(full)  # nn.Embedding.reset_parameters
        if padding_idx is not None:
            with torch.no_grad():
                full[padding_idx].fill_(0)
        self.weight = _parameter(_slice(full, 0, self.tp), full)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, *, tp_group: TPGroup, sequence_parallel: bool = False,
                       sequence_dim: int = 1) -> "VocabParallelEmbedding":
        """This rank's rows of an existing ``nn.Embedding`` (AutoTP)."""
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx, tp_group=tp_group,
                    sequence_parallel=sequence_parallel, sequence_dim=sequence_dim, device="meta")
        layer.weight = _parameter(_slice(embedding.weight, 0, layer.tp), embedding.weight)
        return layer

    def partition_dims(self) -> Mapping[str, int]:
        return {"weight": 0}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.embedding(ids, self.weight, self.padding_idx)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        pad = self.padding_idx
        local_pad = pad - self.vocab_start if pad is not None and self.vocab_start <= pad < self.vocab_end else None
        out = F.embedding(local, self.weight, local_pad)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return regions.reduce_scatter_to_sequence_parallel_region(out, self.tp, self.sequence_dim)
        return regions.reduce_from_tensor_parallel_region(out, self.tp, inplace=True)  # masked_fill's, unsaved

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (rows {self.vocab_start}..{self.vocab_end} on "
                f"this rank), sequence_parallel={self.sequence_parallel}")


class _SequenceParallelNorm:
    """Mixin: the norm's parameters pass through :func:`regions.sum_grads_over_group` (one all-reduce of
    their gradients in backward) when the activations it normalizes are sequence shards."""

    tp: Comm | None
    sequence_parallel: bool

    def _params(self, *params: torch.Tensor | None) -> list[torch.Tensor | None]:
        present = [p for p in params if p is not None]
        if not self.sequence_parallel or self.tp is None or not present:
            return list(params)
        summed = iter(regions.sum_grads_over_group(self.tp, *present))
        return [next(summed) if p is not None else None for p in params]


class LayerNorm(_SequenceParallelNorm, nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters and state dict) that, with ``sequence_parallel``, sums its
    parameters' gradients over the tensor-parallel group."""

    def __init__(self, normalized_shape: int | tuple[int, ...], eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, *, tp_group: TPGroup = None, sequence_parallel: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        nn.LayerNorm.__init__(self, normalized_shape, eps, elementwise_affine, bias, device=device, dtype=dtype)
        self.tp = tp_comm(tp_group)
        self.sequence_parallel = sequence_parallel and degree(self.tp) > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self._params(self.weight, self.bias)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class RMSNorm(_SequenceParallelNorm, nn.RMSNorm):
    """``nn.RMSNorm`` that, with ``sequence_parallel``, sums its weight's gradient over the group."""

    def __init__(self, normalized_shape: int | tuple[int, ...], eps: float | None = None,
                 elementwise_affine: bool = True, *, tp_group: TPGroup = None, sequence_parallel: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        nn.RMSNorm.__init__(self, normalized_shape, eps, elementwise_affine, device=device, dtype=dtype)
        self.tp = tp_comm(tp_group)
        self.sequence_parallel = sequence_parallel and degree(self.tp) > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (weight,) = self._params(self.weight)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


__all__ = ["TensorParallelLayer", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "LayerNorm", "RMSNorm"]
