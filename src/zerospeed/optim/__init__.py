"""Optimizers built from the config, our Lamb, and DeepSpeed's LR schedules."""

from .factory import build_optimizer
from .lamb import Lamb
from .schedules import (
    SCHEDULES,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

__all__ = ["SCHEDULES", "Lamb", "LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR",
           "build_optimizer", "build_scheduler"]
