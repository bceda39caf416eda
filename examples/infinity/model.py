"""The GPT that ``train.py`` builds under ``zerospeed.zero.Init``, sized from a parameter budget.

``examples/gpt.py`` initialises its weights after construction (``self.apply``), which under
``zero.Init`` would touch already-partitioned (empty) parameters. Here each layer initialises
itself inside its own ``__init__`` (``reset_parameters``), in bf16, so ``zero.Init`` partitions
values that are already final and no full fp32 model ever exists. Every block is run under
activation checkpointing, so backward keeps one block's activations at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from zerospeed import checkpointing

#: d_model per layer of the chosen shapes (GPT-3 2.7B: 2560 wide, 32 deep).
WIDTH_PER_LAYER = 80
#: d_model is a multiple of this (and heads are at most this wide).
WIDTH_STEP = 64


@dataclass(frozen=True)
class Shape:
    """A GPT's size: vocabulary, context, width, depth, heads."""

    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int

    @property
    def n_heads(self) -> int:
        return max(1, self.d_model // 128)

    def num_params(self) -> int:
        """Exact parameter count of :class:`InfinityGPT` with this shape (untied head)."""
        d = self.d_model
        block = 12 * d * d + 13 * d  # qkv, proj, two MLP matrices, their biases, two LayerNorms
        return self.n_layers * block + (2 * self.vocab_size + self.seq_len) * d + 2 * d


def shape_for(params: float, vocab_size: int, seq_len: int) -> Shape:
    """The shape whose parameter count is closest to ``params``, about 80 wide per layer."""
    if params <= 0:
        raise ValueError(f"--params {params:g}: the parameter budget must be positive, e.g. --params 2.5e9")
    best: Shape | None = None
    for d in range(WIDTH_STEP, 65536 + 1, WIDTH_STEP):
        shape = Shape(vocab_size, seq_len, d, max(1, round(d / WIDTH_PER_LAYER)))
        if best is None or abs(shape.num_params() - params) < abs(best.num_params() - params):
            best = shape
        if shape.num_params() > params:
            break
    assert best is not None
    return best


class NormalLinear(nn.Linear):
    """A Linear drawn from N(0, std) with zero bias as it is constructed (before zero.Init partitions it)."""

    def __init__(self, d_in: int, d_out: int, std: float, dtype: torch.dtype, bias: bool = True):
        self.std = std  # read by reset_parameters, which nn.Linear.__init__ calls
        super().__init__(d_in, d_out, bias=bias, dtype=dtype)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class NormalEmbedding(nn.Embedding):
    """An Embedding drawn from N(0, 0.02) as it is constructed (torch's default N(0, 1) is GPT-unfriendly)."""

    def __init__(self, num: int, dim: int, dtype: torch.dtype):
        super().__init__(num, dim, dtype=dtype)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention (SDPA) and a GELU MLP."""

    def __init__(self, shape: Shape, dtype: torch.dtype):
        super().__init__()
        d, residual_std = shape.d_model, 0.02 / math.sqrt(2 * shape.n_layers)  # GPT-2's scaled residual init
        self.n_heads = shape.n_heads
        self.ln1 = nn.LayerNorm(d, dtype=dtype)
        self.qkv = NormalLinear(d, 3 * d, 0.02, dtype)
        self.proj = NormalLinear(d, d, residual_std, dtype)
        self.ln2 = nn.LayerNorm(d, dtype=dtype)
        self.fc = NormalLinear(d, 4 * d, 0.02, dtype)
        self.out = NormalLinear(4 * d, d, residual_std, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, c // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class InfinityGPT(nn.Module):
    """``forward(idx, targets)`` returns the mean next-token cross-entropy (fp32)."""

    def __init__(self, shape: Shape, dtype: torch.dtype = torch.bfloat16, checkpoint_blocks: bool = True):
        super().__init__()
        self.shape = shape
        self.checkpoint_blocks = checkpoint_blocks
        self.tok = NormalEmbedding(shape.vocab_size, shape.d_model, dtype)
        self.pos = NormalEmbedding(shape.seq_len, shape.d_model, dtype)
        self.blocks = nn.ModuleList(Block(shape, dtype) for _ in range(shape.n_layers))
        self.ln_f = nn.LayerNorm(shape.d_model, dtype=dtype)
        self.head = NormalLinear(shape.d_model, shape.vocab_size, 0.02, dtype, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            # recomputed in backward: only each block's input stays alive between forward and backward
            x = checkpointing.checkpoint(block, x) if self.checkpoint_blocks and self.training else block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def synthetic_batch(batch: int, shape: Shape, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic token rows that follow a learnable rule: each row counts up by its own stride
    (mod vocab) from a random start. Nothing is downloaded, and every run with ``seed`` sees the same."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, shape.vocab_size, (batch, 1), generator=g)
    stride = torch.randint(1, 8, (batch, 1), generator=g)
    tokens = (start + stride * torch.arange(shape.seq_len + 1)) % shape.vocab_size
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
