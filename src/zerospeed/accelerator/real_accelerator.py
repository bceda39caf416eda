"""Which accelerator this process uses: ``get_accelerator``, ``set_accelerator``.

Choice order: ``ZEROSPEED_ACCELERATOR`` (cpu|cuda), then DeepSpeed's ``DS_ACCELERATOR`` (same
values), else CUDA when torch sees a GPU, else the CPU.

Like DeepSpeed, the process keeps one accelerator object so state set on it (a compile backend,
the CPU's peak-memory mark) survives between ``get_accelerator()`` calls. That object lives in
:data:`_PROCESS` and nowhere else; it is filled on the first ``get_accelerator()`` or by
``set_accelerator``. Passing ``env`` asks what that environment would choose, building a fresh
object and leaving the process's choice alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

import torch

from zerospeed.accelerator.abstract_accelerator import DeepSpeedAccelerator

ENV_OVERRIDE = "ZEROSPEED_ACCELERATOR"
DS_ENV_OVERRIDE = "DS_ACCELERATOR"
SUPPORTED_ACCELERATOR_LIST = ("cpu", "cuda")


@dataclass
class _ProcessAccelerator:
    """The one mutable slot: the accelerator this process settled on (None until first asked)."""

    accelerator: DeepSpeedAccelerator | None = None


_PROCESS = _ProcessAccelerator()


def _chosen_kind(env: Mapping[str, str]) -> str:
    for name in (ENV_OVERRIDE, DS_ENV_OVERRIDE):
        kind = env.get(name, "").strip().lower()
        if not kind:
            continue
        if kind not in SUPPORTED_ACCELERATOR_LIST:
            raise ValueError(f"{name}={kind!r} is not a known accelerator; use 'cpu' or 'cuda' "
                             f"(zerospeed supports {', '.join(SUPPORTED_ACCELERATOR_LIST)})")
        if kind == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"{name}=cuda but torch.cuda.is_available() is False "
                               f"(torch {torch.__version__}); unset it to run on the CPU")
        return kind
    return "cuda" if torch.cuda.is_available() else "cpu"


def accelerator_for(kind: str) -> DeepSpeedAccelerator:
    """A new accelerator object of ``kind`` ('cpu' or 'cuda'); builds without touching the device."""
    if kind == "cuda":
        from zerospeed.accelerator.cuda_accelerator import CUDA_Accelerator

        return CUDA_Accelerator()
    if kind == "cpu":
        from zerospeed.accelerator.cpu_accelerator import CPU_Accelerator

        return CPU_Accelerator()
    raise ValueError(f"no accelerator named {kind!r}; zerospeed supports {', '.join(SUPPORTED_ACCELERATOR_LIST)}")


def get_accelerator(env: Mapping[str, str] | None = None) -> DeepSpeedAccelerator:
    """The process's accelerator (chosen once), or, given ``env``, a fresh one for that environment."""
    if env is not None:
        return accelerator_for(_chosen_kind(env))
    if _PROCESS.accelerator is None:
        _PROCESS.accelerator = accelerator_for(_chosen_kind(os.environ))
    return _PROCESS.accelerator


def set_accelerator(accel_obj: DeepSpeedAccelerator | None) -> None:
    """Make ``accel_obj`` the process's accelerator; ``None`` forgets it so the next ask chooses anew."""
    if accel_obj is not None and not isinstance(accel_obj, DeepSpeedAccelerator):
        raise TypeError(f"set_accelerator needs a DeepSpeedAccelerator subclass instance, got "
                        f"{type(accel_obj).__name__}; subclass deepspeed.accelerator.DeepSpeedAccelerator")
    _PROCESS.accelerator = accel_obj


def is_current_accelerator_supported() -> bool:
    """Whether the process's accelerator is one zerospeed knows (a custom one set by a user is not)."""
    return get_accelerator().device_name() in SUPPORTED_ACCELERATOR_LIST
