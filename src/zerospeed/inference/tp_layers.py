"""Forward-only tensor-parallel layers for serving: the vocabulary-split LM head and input embedding,
and a rank's share of a fused-experts module (Hugging Face Mixtral).

They differ from the training layers of :mod:`zerospeed.tensor_parallel.layers` in two ways:
the vocabulary may split unevenly (GPT-2's 50257 tokens over 2 ranks: each rank holds
``ceil(V/tp)`` rows, the last fewer, and the gathered logits are padded then trimmed), and no
autograd region is needed. Every collective goes through the tensor-parallel ``Comm``.

Exactness: the head gathers each rank's columns of the logits (no arithmetic), the embedding sums
one real row with zeros, and expert contributions are summed once by an all-reduce, so with
top-2 routing the result equals the unsplit model's bit for bit (``a + b`` is commutative).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from zerospeed.distributed.comm import Comm


def vocab_range(vocab: int, tp_size: int, tp_rank: int) -> tuple[int, int, int]:
    """``(start, end, per_rank)``: this rank's rows of a ``vocab``-row matrix split over ``tp_size`` ranks
    (``per_rank = ceil(vocab / tp_size)``; the last ranks may hold fewer, even none)."""
    per = math.ceil(vocab / tp_size)
    start = min(tp_rank * per, vocab)
    return start, min(start + per, vocab), per


class VocabParallelHead(nn.Module):
    """An LM head holding this rank's vocabulary rows; ``forward`` returns the full logits on every rank
    (each rank's columns all-gathered), so ``generate`` and losses see what the unsplit head gives."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, *, vocab_size: int, comm: Comm) -> None:
        super().__init__()
        self.comm, self.vocab_size = comm, vocab_size
        self.start, self.end, self.per_rank = vocab_range(vocab_size, comm.world_size, comm.rank)
        self.weight, self.bias = weight, bias
        self.in_features, self.out_features = weight.shape[1], vocab_size

    @classmethod
    def from_linear(cls, linear: nn.Linear, comm: Comm, weight: nn.Parameter | None = None) -> "VocabParallelHead":
        """This rank's rows of ``linear`` (or the given, already sliced, ``weight`` shared with the embedding)."""
        start, end, _ = vocab_range(linear.out_features, comm.world_size, comm.rank)
        if weight is None:
            weight = nn.Parameter(linear.weight.detach()[start:end].clone(), requires_grad=False)
        bias = None
        if linear.bias is not None:
            bias = nn.Parameter(linear.bias.detach()[start:end].clone(), requires_grad=False)
        return cls(weight, bias, vocab_size=linear.out_features, comm=comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight, self.bias)
        short = self.per_rank - local.shape[-1]
        if short:
            local = F.pad(local, (0, short))
        front = local.movedim(-1, 0).contiguous()
        out = torch.empty((self.comm.world_size * self.per_rank, *front.shape[1:]), dtype=local.dtype,
                          device=local.device)
        self.comm.all_gather(out, front)
        return out[: self.vocab_size].movedim(0, -1)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, vocab={self.vocab_size} (rows {self.start}:{self.end} on this "
                f"rank), bias={self.bias is not None}")


class VocabParallelInputEmbedding(nn.Module):
    """An input embedding holding this rank's vocabulary rows (the same tensor as a tied head's):
    ids outside them look up zeros, and one all-reduce sums the ranks' rows."""

    def __init__(self, embedding: nn.Embedding, comm: Comm) -> None:
        super().__init__()
        self.comm = comm
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.start, self.end, _ = vocab_range(self.num_embeddings, comm.world_size, comm.rank)
        self.weight = nn.Parameter(embedding.weight.detach()[self.start:self.end].clone(), requires_grad=False)
        self.padding_idx = embedding.padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        if self.end == self.start:  # this rank holds no rows
            out = torch.zeros((*ids.shape, self.embedding_dim), dtype=self.weight.dtype, device=ids.device)
        else:
            out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        self.comm.all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim} (rows {self.start}:{self.end} on this rank)"


class ExpertShard(nn.Module):
    """This rank's experts of a fused-experts module (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``,
    as transformers' Mixtral keeps them): the router runs on every rank, each rank adds the weighted
    outputs of its own experts for the tokens routed there, and one all-reduce sums the ranks."""

    def __init__(self, experts: nn.Module, comm: Comm, *, name: str) -> None:
        super().__init__()
        gate_up, down = getattr(experts, "gate_up_proj"), getattr(experts, "down_proj")
        total = int(gate_up.shape[0])
        if total % comm.world_size:
            raise ValueError(f"{name}: {total} experts are not divisible by the tensor-parallel size "
                             f"{comm.world_size}: each rank must hold whole experts; choose a tensor-parallel size "
                             f"that divides {total}")
        self.comm, self.num_experts = comm, total
        self.num_local = total // comm.world_size
        self.first = comm.rank * self.num_local
        take = slice(self.first, self.first + self.num_local)
        self.gate_up_proj = nn.Parameter(gate_up.detach()[take].clone(), requires_grad=False)
        self.down_proj = nn.Parameter(down.detach()[take].clone(), requires_grad=False)
        self.act_fn = getattr(experts, "act_fn")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for local in range(self.num_local):
            hits = (top_k_index == self.first + local).transpose(0, 1)  # [top_k, tokens], as the eager loop
            top_k_pos, token_idx = torch.where(hits)
            if token_idx.numel() == 0:
                continue
            gate, up = F.linear(hidden_states[token_idx], self.gate_up_proj[local]).chunk(2, dim=-1)
            part = F.linear(self.act_fn(gate) * up, self.down_proj[local])
            part = part * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, part.to(out.dtype))
        self.comm.all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return f"experts {self.first}:{self.first + self.num_local} of {self.num_experts} on this rank"


def is_fused_experts(module: nn.Module) -> bool:
    """A transformers fused-experts module (3-D ``gate_up_proj`` and ``down_proj``)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3
            and down.dim() == 3)


def check_fused_experts(module: nn.Module, name: str) -> None:
    """Refuse a fused-experts layout :class:`ExpertShard` does not compute (bias, transposed, ungated...)."""
    layout = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
              "has_post_expert_norm": False}
    for attr, expected in layout.items():
        value = getattr(module, attr, expected)
        if value != expected:
            raise ValueError(f"{name} ({type(module).__name__}): {attr}={value} is an experts layout the "
                             f"tensor-parallel expert split does not compute (it expects {layout}); keep "
                             f"tensor_parallel.tp_size 1 for this model")
    if not callable(getattr(module, "act_fn", None)):
        raise ValueError(f"{name} ({type(module).__name__}): no act_fn; the expert split needs the activation")


__all__ = ["ExpertShard", "VocabParallelHead", "VocabParallelInputEmbedding", "check_fused_experts",
           "is_fused_experts", "vocab_range"]
