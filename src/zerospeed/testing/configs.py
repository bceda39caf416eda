"""Builders for the small DeepSpeed-style configs the parity tests train with.

They spell out the keys every such test sets the same way (a quiet log, AdamW with weight decay,
the ZeRO knobs that make a tiny model shard), so a test states only what its case is about.
"""

from __future__ import annotations

from typing import Any

QUIET_STEPS_PER_PRINT = 10**9  # no periodic step log during a test


def adamw(lr: float, weight_decay: float = 0.01) -> dict[str, Any]:
    """An ``optimizer`` section: AdamW."""
    return {"type": "AdamW", "params": {"lr": lr, "weight_decay": weight_decay}}


def zero_section(stage: int, *, reduce_bucket_size: int, persistence_threshold: int,
                 **extra: Any) -> dict[str, Any]:
    """A ``zero_optimization`` section with the bucket and persistence sizes a small model needs to
    be split into several units (the defaults would keep it whole)."""
    return {"stage": stage, "reduce_bucket_size": reduce_bucket_size,
            "stage3_param_persistence_threshold": persistence_threshold, **extra}


def train_config(*, micro: int, accum: int = 1, clip: float | None = None, optimizer: dict[str, Any],
                 zero: dict[str, Any], **top: Any) -> dict[str, Any]:
    """A whole config that trains quietly; ``clip=None`` leaves ``gradient_clipping`` out, ``top`` adds
    other top-level sections (``bf16``, ``aio``, ...)."""
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
                              "steps_per_print": QUIET_STEPS_PER_PRINT, "optimizer": optimizer,
                              "zero_optimization": zero, **top}
    if clip is not None:
        config["gradient_clipping"] = clip
    return config
