"""Deterministic batches for parity tests: every rank and the reference derive the same rows.

Two schemes the tests use: a shared data set cut into micro-batches by (step, rank, micro-step), as a
data-parallel sampler would; and a fresh batch per (step, rank) from a seeded generator, so a resumed
or re-run engine sees exactly the data of the uninterrupted one.
"""

from __future__ import annotations

from typing import Any

import torch

_STEP_STRIDE = 100  # seed = 100 * step + rank: distinct for every (step, rank) with fewer than 100 ranks


def micro_batch_rows(step: int, rank: int, micro_step: int, *, world: int, accum: int, micro: int) -> slice:
    """Rows of a shared data set that ``rank`` trains on in micro-step ``micro_step`` of ``step``: each
    step takes the next ``world * accum * micro`` rows, rank by rank, micro-batch by micro-batch."""
    start = step * world * accum * micro + (rank * accum + micro_step) * micro
    return slice(start, start + micro)


def seeded_regression_batch(step: int, rank: int, *, rows: int, inputs: int,
                            outputs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` of standard normal values, ``rows x inputs`` and ``rows x outputs``, drawn from a
    generator seeded by ``(step, rank)`` alone."""
    gen = torch.Generator().manual_seed(_STEP_STRIDE * step + rank)
    return torch.randn(rows, inputs, generator=gen), torch.randn(rows, outputs, generator=gen)


def train_on_regression_batches(engine: Any, steps: int, *, accum: int, start: int, rows: int, inputs: int,
                                outputs: int) -> list[float]:
    """Optimizer steps ``start .. start + steps - 1`` of ``engine`` (a model mapping ``inputs`` to ``outputs``
    features), each over ``accum`` micro-batches of :func:`seeded_regression_batch` (seeded by the
    micro-batch's global index and the rank), with an MSE loss; returns every micro-batch's loss."""
    losses = []
    for step in range(start, start + steps):
        for micro in range(accum):
            x, y = seeded_regression_batch(step * accum + micro, engine.comm.rank, rows=rows, inputs=inputs,
                                           outputs=outputs)
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses
