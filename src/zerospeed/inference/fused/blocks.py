"""Fused attention and decoder layers for Hugging Face GPT-2 and Llama-style models (Llama, Mistral, Mixtral).

Each fused module is built from the original one and keeps its projections as submodules it calls:
plain ``nn.Linear`` q/k/v (or GPT-2's ``Conv1D`` ``c_attn``) become one fused QKV ``nn.Linear`` (one
matmul instead of three, and later transforms such as int8 quantization still find a linear to swap);
tensor-parallel projections placed by AutoTP are kept as they are and called one by one (they do
their own communication), and the head counts are this rank's, read off the projections' sizes.
Norms, MLPs and MoE blocks are the original modules, called unchanged.

Per layer and step the fused attention does: one QKV matmul, rotary on q and k together (they are
adjacent in the fused output), one in-place write of k/v into the preallocated cache, one SDPA call over
the filled prefix (grouped-query attention without repeating k/v), the output projection.
"""

from __future__ import annotations

import torch
from torch import nn

from zerospeed.inference.fused.attention import StepContext, apply_rotary, attend
from zerospeed.inference.fused.cache import FusedLayerCache
from zerospeed.tensor_parallel.autotp_plan import is_hf_conv1d


def child(module: nn.Module, name: str) -> nn.Module:
    """``module.<name>``, which must be a submodule (a clear error names what is missing)."""
    sub = getattr(module, name, None)
    if not isinstance(sub, nn.Module):
        raise TypeError(f"{type(module).__name__}.{name} is not a module; kernel injection expects the Hugging Face "
                        f"layout of this family")
    return sub


def _out_features(layer: nn.Module) -> int:
    """Output features this rank computes: ``nn.Linear``-like weight ``[out, in]``, ``Conv1D``-like ``[in, out]``."""
    weight = getattr(layer, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TypeError(f"{type(layer).__name__} has no 2-D weight; the fused attention needs linear projections")
    return int(weight.shape[0] if isinstance(layer, nn.Linear) or _is_linear_layout(layer) else weight.shape[1])


def _is_linear_layout(layer: nn.Module) -> bool:
    """zerospeed's column/row-parallel linears hold ``[out, in]`` like ``nn.Linear``; Conv1D-likes ``[in, out]``."""
    from zerospeed.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return isinstance(layer, (ColumnParallelLinear, RowParallelLinear))


def _plain_linear(layer: nn.Module) -> bool:
    return type(layer) is nn.Linear


def fuse_linears(*layers: nn.Linear) -> nn.Linear:
    """One ``nn.Linear`` whose output is the given linears' outputs side by side (same input)."""
    first = layers[0]
    bias = first.bias is not None
    fused = nn.Linear(first.in_features, sum(l.out_features for l in layers), bias=bias,
                      device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([l.weight for l in layers], dim=0))
        if bias:
            fused.bias.copy_(torch.cat([l.bias for l in layers], dim=0))
    fused.weight.requires_grad_(first.weight.requires_grad)
    return fused


def conv1d_as_linear(conv: nn.Module) -> nn.Linear:
    """transformers' ``Conv1D`` (``y = x W + b``, ``W: [in, out]``) as an ``nn.Linear`` (weight transposed once)."""
    weight, bias = conv.weight, conv.bias
    if not isinstance(weight, torch.Tensor) or not isinstance(bias, torch.Tensor):
        raise TypeError(f"{type(conv).__name__} is not a Conv1D (weight [in, out] and bias [out] expected)")
    linear = nn.Linear(weight.shape[0], weight.shape[1], device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight.t())
        linear.bias.copy_(bias)
    return linear


def _int_attr(module: nn.Module, name: str) -> int:
    value = getattr(module, name, None)
    if not isinstance(value, int):
        raise TypeError(f"{type(module).__name__}.{name} is {value!r}, not an int; kernel injection expects the "
                        f"Hugging Face layout of this family")
    return value


def _float_attr(module: nn.Module, name: str) -> float:
    value = getattr(module, name, None)
    if not isinstance(value, (int, float)):
        raise TypeError(f"{type(module).__name__}.{name} is {value!r}, not a number; kernel injection expects the "
                        f"Hugging Face layout of this family")
    return float(value)


class FusedAttention(nn.Module):
    """Causal self-attention over a :class:`FusedLayerCache`, optionally with rotary embedding.

    Either ``qkv`` (one projection, output ``[q | k | v]``) or ``q_proj``/``k_proj``/``v_proj`` is set.
    """

    def __init__(self, *, heads: int, kv_heads: int, head_dim: int, scale: float, out_proj: nn.Module,
                 qkv: nn.Module | None = None, q_proj: nn.Module | None = None, k_proj: nn.Module | None = None,
                 v_proj: nn.Module | None = None, rotary: bool) -> None:
        super().__init__()
        self.qkv: nn.Module | None
        self.q_proj: nn.Module | None
        self.k_proj: nn.Module | None
        self.v_proj: nn.Module | None
        self.out_proj: nn.Module
        if (qkv is None) == (q_proj is None):
            raise ValueError("FusedAttention takes either a fused qkv projection or q_proj/k_proj/v_proj")
        if heads % kv_heads:
            raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} key/value heads")
        self.heads, self.kv_heads, self.head_dim, self.scale, self.rotary = heads, kv_heads, head_dim, scale, rotary
        self.qkv = qkv
        self.q_proj, self.k_proj, self.v_proj = q_proj, k_proj, v_proj
        self.out_proj = out_proj

    def forward(self, x: torch.Tensor, ctx: StepContext, cache: FusedLayerCache) -> torch.Tensor:
        batch, seq = x.shape[0], x.shape[1]
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        if self.qkv is not None:
            y = self.qkv(x).view(batch, seq, heads + 2 * kv_heads, head_dim)
            qk, v = y[:, :, :heads + kv_heads], y[:, :, heads + kv_heads:]
            if self.rotary:
                assert ctx.cos is not None and ctx.sin is not None
                qk = apply_rotary(qk, ctx.cos, ctx.sin)
            q, k = qk[:, :, :heads], qk[:, :, heads:]
        else:
            assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
            q = self.q_proj(x).view(batch, seq, heads, head_dim)
            k = self.k_proj(x).view(batch, seq, kv_heads, head_dim)
            v = self.v_proj(x).view(batch, seq, kv_heads, head_dim)
            if self.rotary:
                assert ctx.cos is not None and ctx.sin is not None
                q, k = apply_rotary(q, ctx.cos, ctx.sin), apply_rotary(k, ctx.cos, ctx.sin)
        keys, values = cache.write(ctx.start, k, v)
        return self.out_proj(attend(q, keys, values, ctx, self.scale))

    @classmethod
    def from_llama(cls, attn: nn.Module) -> FusedAttention:
        """From a Llama/Mistral/Mixtral attention module (q/k/v/o_proj, ``head_dim``, ``scaling``)."""
        head_dim, scale = _int_attr(attn, "head_dim"), _float_attr(attn, "scaling")
        q, k, v, o = (child(attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
        heads, kv_heads = _out_features(q) // head_dim, _out_features(k) // head_dim
        if isinstance(q, nn.Linear) and isinstance(k, nn.Linear) and isinstance(v, nn.Linear) and \
                all(_plain_linear(p) for p in (q, k, v)) and len({p.bias is None for p in (q, k, v)}) == 1:
            return cls(heads=heads, kv_heads=kv_heads, head_dim=head_dim, scale=scale, out_proj=o,
                       qkv=fuse_linears(q, k, v), rotary=True)
        return cls(heads=heads, kv_heads=kv_heads, head_dim=head_dim, scale=scale, out_proj=o, q_proj=q, k_proj=k,
                   v_proj=v, rotary=True)

    @classmethod
    def from_gpt2(cls, attn: nn.Module) -> FusedAttention:
        """From GPT-2's attention (``c_attn`` with ``[q | k | v]`` outputs, ``c_proj``): plain ``Conv1D``
        becomes ``nn.Linear``; AutoTP's column/row-parallel Conv1D are kept (their output is this rank's
        ``[q_r | k_r | v_r]``)."""
        head_dim, scale = _int_attr(attn, "head_dim"), _float_attr(attn, "scaling")
        c_attn, c_proj = child(attn, "c_attn"), child(attn, "c_proj")
        qkv = conv1d_as_linear(c_attn) if is_hf_conv1d(c_attn) else c_attn
        out = conv1d_as_linear(c_proj) if is_hf_conv1d(c_proj) else c_proj
        heads = _out_features(c_attn) // (3 * head_dim)
        return cls(heads=heads, kv_heads=heads, head_dim=head_dim, scale=scale, out_proj=out, qkv=qkv, rotary=False)


class FusedLlamaLayer(nn.Module):
    """A Llama-style decoder layer (pre-norm, attention, pre-norm, MLP or MoE block) with fused attention;
    attribute names are Hugging Face's, so the norms' and MLP's parameter names do not change."""

    input_layernorm: nn.Module
    self_attn: FusedAttention
    post_attention_layernorm: nn.Module
    mlp: nn.Module

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = child(layer, "input_layernorm")
        self.self_attn = FusedAttention.from_llama(child(layer, "self_attn"))
        self.post_attention_layernorm = child(layer, "post_attention_layernorm")
        self.mlp = child(layer, "mlp")

    def forward(self, hidden: torch.Tensor, ctx: StepContext, cache: FusedLayerCache) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), ctx, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class FusedGPT2Block(nn.Module):
    """GPT-2's block (``ln_1``, attention, ``ln_2``, MLP) with fused attention; dropout is gone (inference)."""

    ln_1: nn.Module
    attn: FusedAttention
    ln_2: nn.Module
    mlp: nn.Module

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.ln_1 = child(block, "ln_1")
        self.attn = FusedAttention.from_gpt2(child(block, "attn"))
        self.ln_2 = child(block, "ln_2")
        self.mlp = child(block, "mlp")
        if type(getattr(self.mlp, "act", None)).__name__ == "NewGELUActivation":
            # GPT-2's "gelu_new" spelled out in five ops, one of them MKL's threaded tanh (which waits
            # for a busy second core at every call); the same tanh-approximated GELU in one kernel
            self.mlp.act = nn.GELU(approximate="tanh")

    def forward(self, hidden: torch.Tensor, ctx: StepContext, cache: FusedLayerCache) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden), ctx, cache)
        return hidden + self.mlp(self.ln_2(hidden))


__all__ = ["FusedAttention", "FusedGPT2Block", "FusedLlamaLayer", "conv1d_as_linear", "fuse_linears"]
