"""Kernel injection on CPU: Hugging Face GPT-2 / Llama / Mistral / Mixtral decoding with fused attention
over a preallocated KV cache, driven by the model's own ``generate()`` (see ``inject.inject_fused``)."""

from zerospeed.inference.fused.cache import CacheOverflowError, FusedKVCache
from zerospeed.inference.fused.inject import SUPPORTED, FusedReport, UnsupportedModelError, inject_fused

__all__ = ["SUPPORTED", "CacheOverflowError", "FusedKVCache", "FusedReport", "UnsupportedModelError", "inject_fused"]
