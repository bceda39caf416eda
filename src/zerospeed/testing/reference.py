"""The single-process PyTorch reference a distributed run must match.

Data parallelism with gradient averaging is, up to float rounding, one process that sums every rank's
micro-batch losses scaled by ``1 / (accum * world)`` before each optimizer step; this loop does exactly
that (rank by rank, micro-step by micro-step), so a test only supplies the model, the optimizer and the
batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]
BatchFn = Callable[[int, int, int], Batch]  # (step, rank, micro_step) -> (inputs, targets)
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (model output, targets) -> loss


@dataclass(frozen=True)
class ReferenceRun:
    """What the reference saw: each rank's unscaled micro-batch losses in order, and each step's
    gradient norm before clipping (empty when the run does not clip)."""

    losses: list[list[float]] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)


def train_reference(model: nn.Module, optimizer: torch.optim.Optimizer, *, batch: BatchFn, loss_fn: LossFn,
                    steps: int, world: int = 1, accum: int = 1, clip: float | None = None,
                    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                    after_step: Callable[[int], None] | None = None) -> ReferenceRun:
    """Train ``model`` for ``steps`` optimizer steps as ``world`` ranks with ``accum`` micro-batches each
    would, all in this process. ``clip`` clips the trainable parameters' global gradient norm;
    ``after_step(step)`` runs after each step (and the scheduler's step), e.g. to snapshot states."""
    if steps < 1 or world < 1 or accum < 1:
        raise ValueError(f"steps={steps}, world={world} and accum={accum} must all be >= 1")
    trainable = [p for p in model.parameters() if p.requires_grad]
    run = ReferenceRun(losses=[[] for _ in range(world)])
    for step in range(steps):
        for rank in range(world):
            for micro_step in range(accum):
                inputs, targets = batch(step, rank, micro_step)
                loss = loss_fn(model(inputs), targets)
                run.losses[rank].append(loss.item())
                (loss / accum / world).backward()
        if clip is not None:
            run.grad_norms.append(float(nn.utils.clip_grad_norm_(trainable, clip)))
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        if after_step is not None:
            after_step(step)
    return run
