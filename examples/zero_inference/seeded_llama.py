"""A Llama whose weights are a pure function of (seed, parameter name, shape), built without ever
being whole in memory.

Why name-seeded: each parameter is drawn from its own generator, seeded from the run's seed and its
name, so a model with fewer layers (same width and vocabulary) holds exactly the first layers,
embedding, final norm and head of a larger one. A small instance, small enough to run in memory with
plain Hugging Face, then checks the very weights the large run streams from NVMe.

Why the meta device: the model is made on ``meta`` (shapes only, no memory), then each module's own
parameters are materialised on the CPU, filled, and handed to ``partition`` (``zero.Init(...).partition``,
which writes them to swap files), one module at a time.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

INIT_STD = 0.02  # Hugging Face's initializer_range for Llama


@dataclass(frozen=True)
class Shape:
    """The size of the Llama: width, depth, MLP width, heads, vocabulary."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    vocab: int
    context: int = 256

    def config(self) -> LlamaConfig:
        return LlamaConfig(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.heads, max_position_embeddings=self.context,
                           tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)

    def layer_params(self) -> int:
        d = self.hidden
        return 4 * d * d + 3 * d * self.intermediate + 2 * d

    def num_params(self) -> int:
        """Exact parameter count (untied head)."""
        return self.layers * self.layer_params() + 2 * self.vocab * self.hidden + self.hidden

    def with_layers(self, layers: int) -> "Shape":
        return Shape(self.hidden, layers, self.intermediate, self.heads, self.vocab, self.context)


def param_seed(seed: int, name: str) -> int:
    return (zlib.crc32(name.encode()) * 1_000_003 + seed) % (2 ** 63)


def fill_(param: torch.Tensor, name: str, seed: int) -> None:
    """The value of parameter ``name``: ones for norms, N(0, 0.02) drawn from its own generator otherwise."""
    with torch.no_grad():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            return
        g = torch.Generator().manual_seed(param_seed(seed, name))
        values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, INIT_STD, generator=g)
        param.copy_(values)


def build(shape: Shape, dtype: torch.dtype, seed: int,
          partition: Callable[[nn.Module], None] | None = None,
          progress: Callable[[str], None] | None = None) -> nn.Module:
    """The Llama of ``shape`` in ``dtype`` with name-seeded weights. With ``partition``, every module is
    partitioned as soon as its parameters are filled (so at most one module is whole at a time);
    without, the model is an ordinary in-memory one (the reference)."""
    config = shape.config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=config)  # its buffers, computed for real on the CPU
    for path, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        if not own:
            continue
        module.to_empty(device="cpu", recurse=False)
        for pname, param in own:
            fill_(getattr(module, pname), f"{path}.{pname}", seed)
        if partition is not None:
            partition(module)
        if progress is not None:
            progress(path)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise AssertionError(f"internal error: {left[0]!r} was not materialised")
    return model.eval()
