"""Activation checkpointing: trade a recompute in backward for the memory of stored activations.

The API is :class:`Checkpointer` (one per configuration); :mod:`zerospeed.checkpointing` adds
DeepSpeed's module-level ``configure``/``checkpoint`` on top of a default one.
"""

from zerospeed.activation.checkpoint import (
    CheckpointTimings,
    Checkpointer,
    HostOffloadHooks,
    HostOffloadStats,
)
from zerospeed.activation.settings import CheckpointingSettings, SettingsSource

__all__ = [
    "CheckpointTimings",
    "Checkpointer",
    "CheckpointingSettings",
    "HostOffloadHooks",
    "HostOffloadStats",
    "SettingsSource",
]
