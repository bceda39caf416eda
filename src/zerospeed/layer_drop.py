"""Progressive layer dropping (PLD; Zhang & He 2020, "Accelerating Training of Transformer-Based Language
Models with Progressive Layer Dropping", arXiv:2010.13369), DeepSpeed's ``progressive_layer_drop``.

Two halves, both plain values:

- :class:`LayerDropSchedule`, which the engine keeps: the global keep ratio
  ``theta(t) = (1 - theta_bar) * exp(-gamma * t) + theta_bar``, ``t`` counting optimizer steps, and the
  forward keywords (``progressive_layer_drop=True, pld_theta=theta``) the engine passes to the model in
  training mode, as DeepSpeed 0.19.6 does (0.19.8 removed the feature).
- the model's half: :func:`keep_probability` gives block ``l`` of ``L`` the paper's depth-scaled keep
  probability ``p_l = 1 - (l / L) * (1 - theta)`` (deeper blocks are dropped more; the last one is kept with
  probability ``theta``), and :class:`LayerDropPlan` draws one training forward's decisions: a block is
  skipped (identity) with probability ``1 - p_l``; a kept block's residual branches are multiplied by
  ``1 / p_l`` (the paper's ``G_i * f(x) / p_i``, and DeepSpeedExamples' ``bing_bert`` layer-drop BERT), so the
  expected output of a block is the full block's and evaluation runs every block unscaled.

Imports only torch: example models use it without the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class LayerDropSchedule:
    """theta(t) of the PLD paper with DeepSpeed's timing (see :meth:`theta_during`).

    ``theta`` is the paper's theta-bar, the limit of theta(t) in [0, 1] (lower: more dropping, faster
    steps); ``gamma`` >= 0 is how fast theta(t) falls from 1 towards it.
    """

    theta: float
    gamma: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.theta <= 1.0:
            raise ValueError(f"LayerDropSchedule(theta={self.theta}): theta is the keep ratio theta(t) tends to; "
                             "give a value in [0, 1] (0.5 in the PLD paper)")
        if not self.gamma >= 0.0 or math.isinf(self.gamma):
            raise ValueError(f"LayerDropSchedule(gamma={self.gamma}): gamma is the decay rate of theta(t); give "
                             "a finite value >= 0 (0.001 in the PLD paper)")

    def theta_at(self, step: int) -> float:
        """theta(step) = (1 - theta_bar) * exp(-gamma * step) + theta_bar."""
        return (1.0 - self.theta) * math.exp(-self.gamma * step) + self.theta

    def theta_during(self, global_steps: int) -> float:
        """The theta a forward sees after ``global_steps`` optimizer steps. DeepSpeed updates it at each
        accumulation boundary *before* counting that step (``update_state(global_steps)``) and starts at
        1.0, so the window after step ``k`` sees theta(k - 1): theta(max(global_steps - 1, 0)). A function
        of the counter alone, so a run resumed from a checkpoint sees what the uninterrupted run saw."""
        return self.theta_at(max(global_steps - 1, 0))

    def forward_kwargs(self, global_steps: int) -> dict[str, Any]:
        """What the engine adds to a training forward's keywords (DeepSpeed's ``get_state()``)."""
        return {"progressive_layer_drop": True, "pld_theta": self.theta_during(global_steps)}


def keep_probability(index: int, num_layers: int, theta: float) -> float:
    """The keep probability of block ``index`` (0-based) of ``num_layers``: ``1 - ((index + 1) / L)(1 - theta)``,
    the paper's ``p_l`` with ``l = index + 1`` (the first block is kept with ``1 - (1 - theta) / L``, the last
    with ``theta``). DeepSpeedExamples' BERT draws with ``p_(l-1)`` but scales by ``p_l``; this uses ``p_l``
    for both, as the paper writes it."""
    if not 0 <= index < num_layers:
        raise ValueError(f"keep_probability(index={index}, num_layers={num_layers}): index must be in "
                         f"[0, {num_layers})")
    if not 0.0 <= theta <= 1.0:
        raise ValueError(f"keep_probability(theta={theta}): pld_theta must be in [0, 1] (the engine's theta(t))")
    return 1.0 - (index + 1) / num_layers * (1.0 - theta)


@dataclass(frozen=True)
class LayerDropPlan:
    """One forward's decisions: per block, ``None`` when it is skipped, else the factor its residual
    branches are multiplied by (``1 / p_l`` in a training forward with PLD, 1.0 otherwise).

    The draws must agree across ranks that run a block together: at ZeRO stage 3 a skipped block's
    parameters are not gathered, and expert-parallel layers exchange tokens; draw from a generator seeded
    the same on every rank (the example GPT keeps one) rather than from per-rank random state.
    """

    scales: tuple[float | None, ...]

    @classmethod
    def keep_all(cls, num_layers: int) -> LayerDropPlan:
        """Every block runs unscaled (evaluation, or PLD off)."""
        return cls((1.0,) * num_layers)

    @classmethod
    def draw(cls, num_layers: int, theta: float, *, generator: torch.Generator | None = None) -> LayerDropPlan:
        """Skip block ``l`` with probability ``1 - p_l``; a kept block gets ``1 / p_l``. ``generator``: a CPU
        generator (default: torch's global one)."""
        probs = [keep_probability(i, num_layers, theta) for i in range(num_layers)]
        draws = torch.rand(num_layers, generator=generator, dtype=torch.float64).tolist()
        return cls(tuple(1.0 / p if u < p else None for u, p in zip(draws, probs, strict=True)))

    @classmethod
    def for_forward(cls, num_layers: int, *, training: bool, progressive_layer_drop: bool = False,
                    pld_theta: float = 1.0, generator: torch.Generator | None = None) -> LayerDropPlan:
        """The plan for a model's forward given the engine's keywords: drawn in training with PLD on, else
        every block (evaluation is deterministic)."""
        if training and progressive_layer_drop:
            return cls.draw(num_layers, pld_theta, generator=generator)
        return cls.keep_all(num_layers)

    def kept(self, index: int) -> bool:
        return self.scales[index] is not None

    def scale(self, index: int) -> float:
        """The residual-branch factor of a kept block (asking it of a skipped block is a caller's bug)."""
        value = self.scales[index]
        if value is None:
            raise ValueError(f"LayerDropPlan.scale({index}): block {index} is skipped in this forward; check "
                             "kept(index) first")
        return value

    def apply(self, index: int, block: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Run a residual block ``x -> x + f(x)`` under the plan: ``x`` when skipped, ``block(x)`` at scale
        1.0, else ``x + (block(x) - x) * scale``. This scales the block's whole residual update; a block
        that scales each branch itself (attention, then MLP on the scaled sum: the paper's form) should
        take ``scale(index)`` as an argument instead."""
        factor = self.scales[index]
        if factor is None:
            return x
        if factor == 1.0:
            return block(x)
        return x + (block(x) - x) * factor

    @property
    def fraction_kept(self) -> float:
        """Share of blocks this plan runs."""
        return sum(s is not None for s in self.scales) / max(len(self.scales), 1)


__all__ = ["LayerDropPlan", "LayerDropSchedule", "keep_probability"]
