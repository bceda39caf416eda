"""A small GPT for tensor-parallel tests: one class, plain torch layers or tensor-parallel ones.

``TinyGPT(cfg)`` is a plain PyTorch model (``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``,
``F.cross_entropy``): the reference. ``TinyGPT(cfg, tp_group=mesh)`` builds the same model with
column/row-parallel attention and MLP, a vocabulary-parallel embedding, LM head and loss (and
Megatron sequence parallelism with ``sequence_parallel=True``). Both draw their initial weights in
the same order, so the same seed gives the same model; parameter names are the same too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from zerospeed.tensor_parallel import (ColumnParallelLinear, LayerNorm, RowParallelLinear, TPGroup,
                                       VocabParallelEmbedding, gather_sequence, scatter_to_sequence_parallel_region,
                                       tp_comm, vocab_parallel_cross_entropy)


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    seq: int = 8
    hidden: int = 32
    heads: int = 4
    layers: int = 2
    ffn: int = 64


class _Linears:
    """Column/row layers for the tensor-parallel model, plain ``nn.Linear`` for the reference."""

    def __init__(self, tp_group: TPGroup, sequence_parallel: bool):
        self.tp = tp_comm(tp_group)
        self.sp = sequence_parallel

    def column(self, i: int, o: int, bias: bool = True) -> nn.Module:
        if self.tp is None:
            return nn.Linear(i, o, bias=bias)
        return ColumnParallelLinear(i, o, bias=bias, tp_group=self.tp, sequence_parallel=self.sp)

    def row(self, i: int, o: int) -> nn.Module:
        if self.tp is None:
            return nn.Linear(i, o)
        return RowParallelLinear(i, o, tp_group=self.tp, sequence_parallel=self.sp)

    def norm(self, n: int) -> nn.Module:
        if self.tp is None:
            return nn.LayerNorm(n)
        return LayerNorm(n, tp_group=self.tp, sequence_parallel=self.sp)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, make: _Linears):
        super().__init__()
        tp = 1 if make.tp is None else make.tp.world_size
        self.heads = cfg.heads // tp  # heads on this rank
        self.head_dim = cfg.hidden // cfg.heads
        # one fused projection, its rows laid out per head as [head][q, k, v][head_dim] (Megatron's
        # layout), so a contiguous slice of rows is whole heads: one collective for q, k and v. No bias:
        # the key bias's true gradient is zero (softmax ignores a per-query constant), so Adam would
        # turn its rounding noise into full-size steps and runs could not be compared.
        self.qkv = make.column(cfg.hidden, 3 * cfg.hidden, bias=False)
        self.o = make.row(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        b, s, _ = qkv.shape
        q, k, v = qkv.view(b, s, self.heads, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, make: _Linears):
        super().__init__()
        self.fc1 = make.column(cfg.hidden, cfg.ffn)
        self.fc2 = make.row(cfg.ffn, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, make: _Linears):
        super().__init__()
        self.ln1 = make.norm(cfg.hidden)
        self.attn = Attention(cfg, make)
        self.ln2 = make.norm(cfg.hidden)
        self.mlp = MLP(cfg, make)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """``model(ids, targets)`` -> mean next-token cross-entropy (``ids``, ``targets``: ``[batch, seq]``)."""

    def __init__(self, cfg: GPTConfig, tp_group: TPGroup = None, sequence_parallel: bool = False):
        super().__init__()
        make = _Linears(tp_group, sequence_parallel)
        self.tp, self.sequence_parallel = make.tp, sequence_parallel and make.tp is not None
        self.wte = (nn.Embedding(cfg.vocab, cfg.hidden) if make.tp is None
                    else VocabParallelEmbedding(cfg.vocab, cfg.hidden, tp_group=make.tp))
        self.wpe = nn.Embedding(cfg.seq, cfg.hidden)
        self.blocks = nn.ModuleList([Block(cfg, make) for _ in range(cfg.layers)])
        self.ln_f = make.norm(cfg.hidden)
        self.head = (nn.Linear(cfg.hidden, cfg.vocab, bias=False) if make.tp is None
                     else ColumnParallelLinear(cfg.hidden, cfg.vocab, bias=False, tp_group=make.tp,
                                               sequence_parallel=sequence_parallel))

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(positions)
        if self.sequence_parallel:
            assert self.tp is not None
            x = scatter_to_sequence_parallel_region(x, self.tp, 1)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # the head all-gathers the sequence under sequence parallelism
        if self.tp is None:
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return vocab_parallel_cross_entropy(logits, targets, self.tp)


def token_batch(step: int, rows: int, cfg: GPTConfig, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic ``(ids, targets)`` for ``step``: the same on every rank that asks."""
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    ids = torch.randint(0, cfg.vocab, (rows, cfg.seq + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


__all__ = ["GPTConfig", "TinyGPT", "token_batch", "gather_sequence"]
