"""Small deterministic models the tests share, so parity cases train the same network everywhere.

Parameter creation order (and so the values drawn from torch's global RNG) and parameter names are
part of each model's contract: tests seed, build, and compare by name against a plain reference.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn


def seeded_mlp(*widths: int, activation: type[nn.Module] = nn.GELU, seed: int | None = 0) -> nn.Sequential:
    """``Linear(widths[0], widths[1]), activation(), ..., Linear(widths[-2], widths[-1])``, built right
    after ``torch.manual_seed(seed)`` (``seed=None``: from the RNG as it stands), so every rank and the
    reference get the same weights."""
    if len(widths) < 2:
        raise ValueError(f"seeded_mlp needs at least 2 widths (inputs, outputs), got {widths}")
    if seed is not None:
        torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
        if i:
            layers.append(activation())
        layers.append(nn.Linear(fan_in, fan_out))
    return nn.Sequential(*layers)


class TanhMLP(nn.Module):
    """``b(tanh(a(x)))``: the smallest model with a nonlinearity between two sharded layers."""

    def __init__(self, inputs: int, hidden: int, outputs: int) -> None:
        super().__init__()
        self.a = nn.Linear(inputs, hidden)
        self.b = nn.Linear(hidden, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class ResidualBlock(nn.Module):
    """``h + tanh(fc(norm(h)))``: a pre-norm residual block, the unit ZeRO-3 gathers and releases."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(self.norm(h)))
