"""The preallocated key/value cache the fused attention writes into, as a transformers ``Cache``.

Hugging Face's default ``DynamicCache`` grows every layer's keys and values with ``torch.cat`` at each
generated token: on CPU each step allocates (and page-faults in) two fresh tensors per layer, which
costs more than the attention itself. Here each layer's buffers ``[batch, kv_heads, max_out_tokens,
head_dim]`` are allocated once (sized by ``max_out_tokens``) and written in place; attention reads the
filled prefix ``[:, :, :length]``. The buffers are kept across ``generate()`` calls and reallocated
only when the batch size, dtype or device changes.

``generate()`` keeps passing back whatever cache the model returned, so the fused model returns this
object as ``past_key_values`` and continues from it; a fresh (empty) transformers cache or none means
a new sequence, and :meth:`FusedKVCache.start` rewinds to zero.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class CacheOverflowError(ValueError):
    """More tokens than ``max_out_tokens`` would be held in the preallocated cache."""


class FusedLayerCache(CacheLayerMixin):
    """One layer's preallocated keys and values; ``length`` lives in the owning :class:`FusedKVCache`."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, owner: FusedKVCache) -> None:
        super().__init__()
        self._owner = owner

    def allocate(self, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        shape = (batch, kv_heads, capacity, head_dim)
        if self.keys is None or tuple(self.keys.shape) != shape or self.keys.dtype != dtype or self.keys.device != device:
            self.keys = torch.zeros(shape, dtype=dtype, device=device)
            self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.is_initialized = True

    def write(self, start: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``key``/``value`` ``[batch, seq, kv_heads, head_dim]`` at ``start``; return the filled prefix
        ``[batch, kv_heads, start + seq, head_dim]`` (views of the buffers, no copy)."""
        assert self.keys is not None and self.values is not None, "allocate() before write()"
        end = start + key.shape[1]
        self.keys[:, :, start:end].copy_(key.transpose(1, 2))
        self.values[:, :, start:end].copy_(value.transpose(1, 2))
        return self.keys[:, :, :end], self.values[:, :, :end]

    # transformers' CacheLayerMixin interface (used by generate and by users inspecting the cache)
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("the fused cache is allocated by the fused model (FusedKVCache.start), not lazily")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("the fused cache is written by the fused attention only; a model that calls "
                           "Cache.update() on it was not injected (zerospeed.inference.fused.inject_fused)")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._owner.length + query_length, 0

    def get_seq_length(self) -> int:
        return self._owner.length

    def get_max_length(self) -> int:
        return self._owner.capacity

    def reset(self) -> None:
        """Rewind (the buffers are overwritten by the next sequence, so nothing is zeroed)."""
        self._owner.length = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.keys is not None and self.values is not None:
            self.keys.copy_(self.keys.index_select(0, beam_idx.to(self.keys.device)))
            self.values.copy_(self.values.index_select(0, beam_idx.to(self.values.device)))


class FusedKVCache(Cache):
    """Every layer's preallocated keys and values, the number of positions filled (``length``) and the
    capacity (``max_out_tokens``)."""

    def __init__(self, num_layers: int, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"max_out_tokens={capacity} must be >= 1 (prompt plus generated tokens per sequence)")
        self.capacity = capacity
        self.length = 0
        self.batch = 0
        super().__init__(layers=[FusedLayerCache(self) for _ in range(num_layers)])

    @property
    def fused_layers(self) -> list[FusedLayerCache]:
        return self.layers  # type: ignore[return-value]

    def start(self, batch: int, kv_heads: list[int], head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """Begin a new sequence of ``batch`` rows: (re)allocate if the shape changed, rewind to 0."""
        for layer, heads in zip(self.fused_layers, kv_heads, strict=True):
            layer.allocate(batch, heads, self.capacity, head_dim, dtype, device)
        self.batch = batch
        self.length = 0

    def reserve(self, new_tokens: int) -> int:
        """Claim room for ``new_tokens`` more positions; return where they start. Refuses, naming
        ``max_out_tokens``, when the cache would overflow."""
        needed = self.length + new_tokens
        if needed > self.capacity:
            raise CacheOverflowError(
                f"max_out_tokens={self.capacity} is too small: this step needs {needed} cached positions "
                f"({self.length} already held + {new_tokens} new). max_out_tokens bounds prompt plus generated "
                f"tokens per sequence; raise it (init_inference(..., max_out_tokens=N) or inject_fused(..., "
                f"max_out_tokens=N)) or generate fewer tokens (max_new_tokens)")
        return self.length

    def advance(self, new_tokens: int) -> None:
        self.length += new_tokens

    # transformers' Cache interface
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.capacity

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def reset(self) -> None:
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``tokens_to_remove`` positions (negative: keep that many), as transformers does."""
        keep = self.length - tokens_to_remove if tokens_to_remove >= 0 else -tokens_to_remove
        self.length = max(0, min(self.length, keep))

    @property
    def is_compileable(self) -> bool:  # generate() must not build 4-D masks for us
        return False

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def is_initialized(self) -> bool:
        return self.batch > 0

    @property
    def batch_size(self) -> int:
        return self.batch


__all__ = ["CacheOverflowError", "FusedKVCache", "FusedLayerCache"]
