"""The fused decoder stacks that replace Hugging Face's ``GPT2Model`` / ``LlamaModel`` (and Mistral's, Mixtral's).

They take the same keyword arguments as the modules they replace, so the unchanged ``*ForCausalLM``
head and ``generate()`` drive them. Per forward they work out once what every layer needs
(:class:`StepContext`: cache position, mask only when there is padding, rotary rows gathered from a
table computed at injection with the model's own rotary module) instead of per layer, and return the
model-owned :class:`FusedKVCache` as ``past_key_values`` so ``generate()`` hands it back next step.

Children keep Hugging Face's attribute names (``embed_tokens``, ``layers``, ``norm``; ``wte``, ``wpe``,
``h``, ``ln_f``), so embeddings, norms and MLPs keep their parameter names and GPT-2's LM head stays
tied to ``wte``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions, MoeModelOutputWithPast

from zerospeed.inference.fused.attention import StepContext, rotary_rows, step_mask
from zerospeed.inference.fused.blocks import FusedAttention, FusedGPT2Block, FusedLlamaLayer, child
from zerospeed.inference.fused.cache import FusedKVCache

#: Output flags the fused stack cannot honour (it records no per-layer attentions or hidden states).
_UNSUPPORTED_OUTPUTS = ("output_attentions", "output_hidden_states", "output_router_logits")


class FusedStack(nn.Module):
    """What both families share: the cache, the step bookkeeping, the refusals."""

    layers_attr = "layers"
    cache: FusedKVCache

    def __init__(self, *, max_out_tokens: int, num_layers: int) -> None:
        super().__init__()
        self.cache = FusedKVCache(num_layers, max_out_tokens)

    def _attentions(self) -> list[FusedAttention]:
        raise NotImplementedError

    def _begin(self, past: Cache | None, batch: int, seq: int, dtype: torch.dtype, device: torch.device,
               kwargs: dict[str, Any]) -> FusedKVCache:
        """The cache this forward continues (a fresh sequence when ``past`` is None or an empty
        transformers cache), with room reserved for ``seq`` new tokens."""
        for flag in _UNSUPPORTED_OUTPUTS:
            if kwargs.get(flag):
                raise ValueError(f"{flag}=True is not supported by the fused (kernel-injected) model; run the "
                                 f"model without replace_with_kernel_inject to get them")
        if isinstance(past, FusedKVCache) and past.length > 0:
            if past is not self.cache:
                raise ValueError("past_key_values is a FusedKVCache of another model; pass this model's own "
                                 "(the one its last forward returned) or none")
            if past.batch != batch:
                raise ValueError(f"past_key_values holds {past.batch} rows but input has {batch}; continue with "
                                 f"the same batch or start a new sequence (past_key_values=None)")
        elif past is not None and not isinstance(past, FusedKVCache) and past.get_seq_length() > 0:
            raise ValueError(f"past_key_values is a filled {type(past).__name__}; the fused model keeps its own "
                             f"preallocated cache: pass the FusedKVCache it returned, or none to start over")
        else:
            attns = self._attentions()
            self.cache.start(batch, [a.kv_heads for a in attns], attns[0].head_dim, dtype, device)
        self.cache.reserve(seq)
        return self.cache

    def _run(self, hidden: torch.Tensor, ctx: StepContext, cache: FusedKVCache) -> torch.Tensor:
        layers = getattr(self, self.layers_attr)
        for layer, layer_cache in zip(layers, cache.fused_layers, strict=True):
            hidden = layer(hidden, ctx, layer_cache)
        cache.advance(ctx.seq)
        return hidden


def _positions(position_ids: torch.Tensor | None, start: int, batch: int, seq: int,
               device: torch.device) -> torch.Tensor:
    if position_ids is not None:
        return position_ids
    return torch.arange(start, start + seq, device=device)[None].expand(batch, seq)


class FusedLlamaModel(FusedStack):
    """``LlamaModel`` / ``MistralModel`` / ``MixtralModel`` with fused layers over a preallocated cache."""

    embed_tokens: nn.Module
    norm: nn.Module
    rotary_table: torch.Tensor

    def __init__(self, base: nn.Module, *, max_out_tokens: int, rotary_table: torch.Tensor) -> None:
        layers = list(child(base, "layers").children())
        super().__init__(max_out_tokens=max_out_tokens, num_layers=len(layers))
        self.config = base.config
        self.embed_tokens = child(base, "embed_tokens")
        self.layers = nn.ModuleList(FusedLlamaLayer(layer) for layer in layers)
        self.norm = child(base, "norm")
        self.register_buffer("rotary_table", rotary_table, persistent=False)

    def _attentions(self) -> list[FusedAttention]:
        return [layer.self_attn for layer in self.layers if isinstance(layer, FusedLlamaLayer)]

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                **kwargs: Any) -> MoeModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        batch, seq = hidden.shape[0], hidden.shape[1]
        cache = self._begin(past_key_values, batch, seq, hidden.dtype, hidden.device, kwargs)
        start = cache.length
        cos, sin = rotary_rows(self.rotary_table, _positions(position_ids, start, batch, seq, hidden.device))
        ctx = StepContext(start=start, seq=seq, mask=step_mask(attention_mask, start, seq), cos=cos, sin=sin)
        hidden = self.norm(self._run(hidden, ctx, cache))
        return MoeModelOutputWithPast(last_hidden_state=hidden, past_key_values=cache if use_cache is not False else None)


class FusedGPT2Model(FusedStack):
    """``GPT2Model`` with fused blocks over a preallocated cache (absolute position embeddings)."""

    layers_attr = "h"
    wte: nn.Module
    wpe: nn.Module
    ln_f: nn.Module

    def __init__(self, base: nn.Module, *, max_out_tokens: int) -> None:
        blocks = list(child(base, "h").children())
        super().__init__(max_out_tokens=max_out_tokens, num_layers=len(blocks))
        self.config = base.config
        self.wte = child(base, "wte")
        self.wpe = child(base, "wpe")
        self.h = nn.ModuleList(FusedGPT2Block(block) for block in blocks)
        self.ln_f = child(base, "ln_f")

    def _attentions(self) -> list[FusedAttention]:
        return [block.attn for block in self.h if isinstance(block, FusedGPT2Block)]

    def get_input_embeddings(self) -> nn.Module:
        return self.wte

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor | None = None, past_key_values: Cache | None = None,
                attention_mask: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None, encoder_attention_mask: torch.Tensor | None = None,
                use_cache: bool | None = None, **kwargs: Any) -> BaseModelOutputWithPastAndCrossAttentions:
        if encoder_hidden_states is not None:
            raise ValueError("encoder_hidden_states: the fused GPT-2 has no cross-attention")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        hidden = self.wte(input_ids) if inputs_embeds is None else inputs_embeds
        batch, seq = hidden.shape[0], hidden.shape[1]
        cache = self._begin(past_key_values, batch, seq, hidden.dtype, hidden.device, kwargs)
        start = cache.length
        hidden = hidden + self.wpe(_positions(position_ids, start, batch, seq, hidden.device))
        if token_type_ids is not None:
            hidden = hidden + self.wte(token_type_ids)
        ctx = StepContext(start=start, seq=seq, mask=step_mask(attention_mask, start, seq))
        hidden = self.ln_f(self._run(hidden, ctx, cache))
        return BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=hidden, past_key_values=cache if use_cache is not False else None)


__all__ = ["FusedGPT2Model", "FusedLlamaModel", "FusedStack"]
