"""Model factories for ``zerospeed plan`` (see docs/memory_plan.md).

A factory takes no arguments and returns the model, or ``(model, example_inputs)``: the inputs of one
forward (a tensor, a tuple of positional inputs or a dict of keyword inputs), batch dimension first.
The plan builds the model under ``torch.device("meta")`` and resizes the batch to the config's
``train_micro_batch_size_per_gpu``, so a factory may allocate nothing real.

    zerospeed plan examples/demo_config.json --model examples/plan_models.py:demo_gpt --world-size 2
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt import GPT, GPTConfig  # noqa: E402


def _tokens(cfg: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(1, cfg.seq_len, dtype=torch.long)
    return ids, ids  # (inputs, targets): the GPT's forward returns the loss


def demo_gpt() -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    """The demo's GPT (examples/demo.py: 4 layers, width 128, 64-token windows)."""
    cfg = GPTConfig(seq_len=64)
    return GPT(cfg), _tokens(cfg)


def gpt_98m() -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    """benchmarks/bench_zero.py's GPT: 12 layers, width 768, vocabulary 16384, 128 tokens (98M parameters)."""
    cfg = GPTConfig(vocab_size=16384, seq_len=128, d_model=768, n_layers=12, n_heads=12)
    return GPT(cfg), _tokens(cfg)
