"""``inject_fused``: swap a Hugging Face causal LM's decoder stack for the fused one, in place.

The engine calls it for ``replace_with_kernel_inject=True``, after any tensor-parallel split and before
int8 quantization and ZeRO-Inference placement. The causal-LM head module (``GPT2LMHeadModel``,
``LlamaForCausalLM``...) is kept, so ``model(...)`` and ``model.generate(...)`` are called as before;
only its ``transformer`` / ``model`` child changes. Supported families are named in
:data:`SUPPORTED`; anything else is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zerospeed.inference.fused.blocks import child
from zerospeed.inference.fused.stack import FusedGPT2Model, FusedLlamaModel, FusedStack

#: model_type -> the attribute of the causal-LM module holding the decoder stack.
SUPPORTED: dict[str, str] = {"gpt2": "transformer", "llama": "model", "mistral": "model", "mixtral": "model"}
#: Rotary variants whose frequencies depend on the sequence length seen so far (not a fixed table).
_DYNAMIC_ROPE = ("dynamic", "longrope")


class UnsupportedModelError(ValueError):
    """Kernel injection does not know this model family or one of its settings."""


@dataclass(frozen=True)
class FusedReport:
    """What :func:`inject_fused` did: the family, how many layers, whether q/k/v became one matmul, whether the
    projections are tensor-parallel (per-rank heads), the cache capacity and the compute dtype."""

    family: str
    layers: int
    fused_qkv: bool
    tensor_parallel: bool
    heads_per_rank: int
    kv_heads_per_rank: int
    max_out_tokens: int
    dtype: torch.dtype


def inject_fused(model: nn.Module, *, max_out_tokens: int, dtype: torch.dtype | None = None) -> FusedReport:
    """Replace ``model``'s decoder stack by the fused one over a cache of ``max_out_tokens`` positions per
    sequence (prompt plus generated tokens), in place; cast to ``dtype`` first when given."""
    if not isinstance(max_out_tokens, int) or isinstance(max_out_tokens, bool) or max_out_tokens < 1:
        raise ValueError(f"max_out_tokens={max_out_tokens!r} must be an integer >= 1 (prompt plus generated "
                         f"tokens per sequence)")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(f"dtype={dtype!r} must be a floating-point torch.dtype (torch.float32, torch.bfloat16...)")
    family, attr = _family(model)
    base = child(model, attr)
    if isinstance(base, FusedStack):
        raise ValueError(f"the model is already kernel-injected (its {attr!r} is a {type(base).__name__}); "
                         f"inject a fresh copy of the Hugging Face model instead")
    if dtype is not None:
        model.to(dtype)
    model.eval()
    compute_dtype = next(base.parameters()).dtype
    config = getattr(model, "config")
    stack: FusedStack
    if family == "gpt2":
        _check_gpt2(config)
        _check_positions(int(getattr(config, "n_positions")), max_out_tokens, "n_positions")
        stack = FusedGPT2Model(base, max_out_tokens=max_out_tokens)
    else:
        _check_llama(config, max_out_tokens)
        stack = FusedLlamaModel(base, max_out_tokens=max_out_tokens,
                                rotary_table=_rotary_table(base, max_out_tokens, compute_dtype))
    setattr(model, attr, stack)
    attn = stack._attentions()[0]
    from zerospeed.tensor_parallel.layers import TensorParallelLayer

    split = any(isinstance(m, TensorParallelLayer) for a in stack._attentions() for m in a.modules())
    return FusedReport(family=family, layers=len(stack._attentions()), fused_qkv=attn.qkv is not None and not split,
                       tensor_parallel=split, heads_per_rank=attn.heads, kv_heads_per_rank=attn.kv_heads,
                       max_out_tokens=max_out_tokens, dtype=compute_dtype)


def _family(model: nn.Module) -> tuple[str, str]:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    name = type(model).__name__
    if model_type not in SUPPORTED:
        raise UnsupportedModelError(
            f"kernel injection (replace_with_kernel_inject) does not support {name} (model_type={model_type!r}); "
            f"supported: {sorted(SUPPORTED)} causal LMs. Run it without replace_with_kernel_inject")
    attr = SUPPORTED[model_type]
    if not isinstance(getattr(model, attr, None), nn.Module) or not name.endswith(("ForCausalLM", "LMHeadModel")):
        raise UnsupportedModelError(
            f"kernel injection needs the causal-LM module (e.g. {model_type} ...ForCausalLM / LMHeadModel with a "
            f".{attr} decoder stack); got {name}")
    return str(model_type), attr


def _check_gpt2(config: object) -> None:
    if getattr(config, "add_cross_attention", False):
        raise UnsupportedModelError("kernel injection does not support GPT-2 with add_cross_attention=True")


def _check_llama(config: object, max_out_tokens: int) -> None:
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) and window is not None and max_out_tokens > window:
        raise UnsupportedModelError(
            f"max_out_tokens={max_out_tokens} exceeds the model's sliding_window={window}, and the fused attention "
            f"has no sliding window; use max_out_tokens <= {window}")
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
    if rope_type in _DYNAMIC_ROPE:
        raise UnsupportedModelError(f"kernel injection does not support rope_type={rope_type!r} (its frequencies "
                                    f"change with the sequence length); supported: fixed-table rotary types")
    _check_positions(getattr(config, "max_position_embeddings", max_out_tokens), max_out_tokens,
                     "max_position_embeddings")


def _check_positions(limit: int, max_out_tokens: int, key: str) -> None:
    if max_out_tokens > limit:
        raise UnsupportedModelError(f"max_out_tokens={max_out_tokens} exceeds the model's {key}={limit}; use "
                                    f"max_out_tokens <= {limit}")


def _rotary_table(base: nn.Module, positions: int, dtype: torch.dtype) -> torch.Tensor:
    """``[positions, 2, head_dim]`` cos/sin rows from the model's own rotary module, so each row is what it
    would compute for that position."""
    rotary = child(base, "rotary_emb")
    device = next(base.parameters()).device
    probe = torch.empty(1, dtype=dtype, device=device)
    with torch.no_grad():
        cos, sin = rotary(probe, torch.arange(positions, device=device)[None])
    return torch.stack((cos[0], sin[0]), dim=1).contiguous()


__all__ = ["SUPPORTED", "FusedReport", "UnsupportedModelError", "inject_fused"]
