"""``deepspeed.checkpointing``-style module functions, as a thin facade over one Recomputer.

DeepSpeed (and Megatron code written for it) calls ``checkpointing.configure(...)`` once and
``checkpointing.checkpoint(fn, *args)`` anywhere, so the facade must remember a configuration
between calls: that one default :class:`Recomputer`, created lazily, is the only process-wide
state here, and exists only for that compatibility. New code should hold its own
``Recomputer(settings)`` instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zerospeed.activation.recompute import Recomputer
from zerospeed.activation.settings import RecomputeSettings, SettingsSource


class _DefaultRecomputer:
    """Holder of the facade's Recomputer (the one documented piece of module state)."""

    def __init__(self) -> None:
        self.recomputer: Recomputer | None = None
        self.configured = False

    def get(self) -> Recomputer:
        if self.recomputer is None:
            self.recomputer = Recomputer()
        return self.recomputer


_DEFAULT = _DefaultRecomputer()


def configure(mpu_: Any = None, deepspeed_config: SettingsSource | None = None,
              partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None,
              num_checkpoints: int | None = None, checkpoint_in_cpu: bool | None = None,
              synchronize: bool | None = None, profile: bool | None = None) -> Recomputer:
    """Set what :func:`checkpoint` does, with DeepSpeed's argument names.

    Starts from the defaults (each call replaces the previous configuration, as in DeepSpeed),
    then the ``activation_checkpointing`` section of ``deepspeed_config`` (dict, JSON path or
    parsed Config), then every explicit argument that is not ``None``. ``mpu_`` is accepted
    for compatibility and unused: it only serves ``partition_activations``, which is refused.
    Returns the Recomputer now behind the facade (its ``timings`` start at zero).
    """
    del mpu_  # only model-parallel partitioning would use it
    settings = RecomputeSettings()
    if deepspeed_config is not None:
        settings = RecomputeSettings.from_config(deepspeed_config)
    settings = settings.overridden(
        partition_activations=partition_activations,
        contiguous_memory_optimization=contiguous_checkpointing,
        number_checkpoints=num_checkpoints,
        cpu_checkpointing=checkpoint_in_cpu,
        synchronize_checkpoint_boundary=synchronize,
        profile=profile,
    )
    _DEFAULT.recomputer = Recomputer(settings)
    _DEFAULT.configured = True
    return _DEFAULT.recomputer


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` with its activations recomputed in backward, using the
    configuration of the last :func:`configure` (defaults if none)."""
    return _DEFAULT.get().checkpoint(function, *args, **kwargs)


def is_configured() -> bool:
    """Whether :func:`configure` has been called in this process."""
    return _DEFAULT.configured


def get_recomputer() -> Recomputer:
    """The Recomputer behind the facade, e.g. to read ``timings`` after ``profile=True``."""
    return _DEFAULT.get()


def reset() -> None:
    """DeepSpeed frees its contiguous-checkpointing buffers here (needed after forwards without
    backward). zerospeed keeps no such buffers, so there is nothing to free; the configuration
    and timings are left alone, as in DeepSpeed."""


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the CPU and every CUDA device. Without model parallelism every rank's model-parallel
    region draws from the same stream as the rest, so Megatron's per-rank offset does not apply."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: {seed!r} is not an int; pass an integer seed")
    torch.manual_seed(seed)  # also seeds every CUDA device when CUDA is present


__all__ = ["checkpoint", "configure", "get_recomputer", "is_configured",
           "model_parallel_cuda_manual_seed", "reset"]
