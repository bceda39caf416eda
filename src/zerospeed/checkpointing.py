"""Activation checkpointing under DeepSpeed's module name (``deepspeed.checkpointing``).

``configure(...)`` then ``checkpoint(fn, *args)`` work as in DeepSpeed; they share one default
:class:`~zerospeed.activation.Recomputer`. Code that can should create its own
``Recomputer(RecomputeSettings(...))`` rather than rely on that shared one.
"""

from zerospeed.activation import Recomputer, RecomputeSettings, RecomputeTimings
from zerospeed.activation.compat import (
    checkpoint,
    configure,
    get_recomputer,
    is_configured,
    model_parallel_cuda_manual_seed,
    reset,
)

__all__ = [
    "RecomputeTimings",
    "Recomputer",
    "RecomputeSettings",
    "checkpoint",
    "configure",
    "get_recomputer",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "reset",
]
