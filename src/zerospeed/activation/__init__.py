"""Activation recompute (DeepSpeed calls it activation checkpointing; its public module is
:mod:`zerospeed.checkpointing`): trade a recompute in backward for the memory of stored activations.

The API is :class:`Recomputer` (one per configuration); :mod:`zerospeed.checkpointing` adds
DeepSpeed's module-level ``configure``/``checkpoint`` on top of a default one.
"""

from zerospeed.activation.recompute import (
    RecomputeTimings,
    Recomputer,
    HostOffloadHooks,
    HostOffloadStats,
)
from zerospeed.activation.settings import RecomputeSettings, SettingsSource

__all__ = [
    "RecomputeTimings",
    "Recomputer",
    "RecomputeSettings",
    "HostOffloadHooks",
    "HostOffloadStats",
    "SettingsSource",
]
