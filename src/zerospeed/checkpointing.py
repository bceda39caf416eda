"""Activation checkpointing under DeepSpeed's module name (``deepspeed.checkpointing``).

``configure(...)`` then ``checkpoint(fn, *args)`` work as in DeepSpeed; they share one default
:class:`~zerospeed.activation.Checkpointer`. Code that can should create its own
``Checkpointer(CheckpointingSettings(...))`` rather than rely on that shared one.
"""

from zerospeed.activation import Checkpointer, CheckpointingSettings, CheckpointTimings
from zerospeed.activation.compat import (
    checkpoint,
    configure,
    get_checkpointer,
    is_configured,
    model_parallel_cuda_manual_seed,
    reset,
)

__all__ = [
    "CheckpointTimings",
    "Checkpointer",
    "CheckpointingSettings",
    "checkpoint",
    "configure",
    "get_checkpointer",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "reset",
]
