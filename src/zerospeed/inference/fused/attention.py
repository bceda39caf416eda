"""The fused attention pieces: per-step attention context, rotary embedding, masks and the attention call.

Pure functions over tensors, shared by every model family. The step's context (:class:`StepContext`)
is computed once per forward by the fused stack and handed to every layer, so what Hugging Face
recomputes per layer or builds as a 4-D float mask (``create_causal_mask``) is done once, and only
when there is padding: without it, prefill uses ``is_causal`` and a one-token decode needs no mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F


@dataclass(frozen=True)
class StepContext:
    """What every layer needs for one forward: where the new tokens go in the cache, the mask, and the
    rotary ``cos``/``sin`` rows of the new positions (``[batch, seq, 1, head_dim]``; None for GPT-2)."""

    start: int  # cache position of the first new token
    seq: int  # new tokens per row
    mask: torch.Tensor | None  # bool [batch, 1, seq, start + seq], True = attend; None = plain causal
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None

    @property
    def causal(self) -> bool:
        """SDPA's ``is_causal`` is right only when queries and keys start together (no past)."""
        return self.mask is None and self.start == 0 and self.seq > 1


def step_mask(attention_mask: torch.Tensor | None, start: int, seq: int) -> torch.Tensor | None:
    """The boolean mask ``[batch, 1, seq, start + seq]`` (True = attend) for this step, or None when
    causality alone decides and SDPA needs none: no padding (no ``attention_mask``, or all ones) and
    either a fresh prefill (``is_causal``) or one new token (it sees the whole cache).

    A query may see key ``j`` when ``j`` is at or before its own position and ``j`` is not padding. A
    padding query sees itself as well, so its row is never empty (an all-masked row would make SDPA
    return NaN, and a NaN value times a zero weight still poisons later rows); padding rows' outputs are
    never read.
    """
    total = start + seq
    keys: torch.Tensor | None = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(f"attention_mask has {attention_mask.dim()} dims; the fused model takes the 2-D "
                             f"[batch, past + new tokens] mask generate() passes (1 = token, 0 = padding)")
        if attention_mask.shape[1] != total:
            raise ValueError(f"attention_mask covers {attention_mask.shape[1]} positions but the cache holds "
                             f"{start} and {seq} are new; pass the mask of the whole sequence so far")
        keys = attention_mask.to(torch.bool)
        if bool(keys.all()):
            keys = None
    if keys is None and (start == 0 or seq == 1):
        return None
    device = attention_mask.device if attention_mask is not None else None
    query_pos = torch.arange(start, total, device=device)[:, None]
    key_pos = torch.arange(total, device=device)[None, :]
    causal = key_pos <= query_pos  # [seq, total]
    if keys is None:
        return causal[None, None]
    itself = key_pos == query_pos
    return (causal[None] & (keys[:, None, :] | itself[None]))[:, None]


def rotary_rows(table: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` ``[batch, seq, 1, head_dim]`` for ``position_ids`` from a ``[positions, 2,
    head_dim]`` table (one gather for both)."""
    rows = table[position_ids]  # [batch, seq, 2, head_dim]
    return rows[:, :, 0:1], rows[:, :, 1:2]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[batch, seq, heads, head_dim]`` with Hugging Face's ``rotate_half``
    convention and the same rounding (``x*cos + rotate_half(x)*sin``), without building
    ``rotate_half(x)``: each half's correction is added in place."""
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half] -= x[..., half:] * sin[..., :half]
    out[..., half:] += x[..., :half] * sin[..., half:]
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext, scale: float) -> torch.Tensor:
    """Attention of ``q`` ``[batch, seq, heads, head_dim]`` over the cache prefix ``k``/``v``
    ``[batch, kv_heads, length, head_dim]``; returns ``[batch, seq, heads * head_dim]``."""
    batch, seq, heads, head_dim = q.shape
    gqa = heads != k.shape[1]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=ctx.mask, is_causal=ctx.causal,
                                         scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2).reshape(batch, seq, heads * head_dim)


__all__ = ["StepContext", "apply_rotary", "attend", "step_mask", "rotary_rows"]
