"""The one place that decides device, collective backend, pinned memory and streams.

Everything else asks the accelerator instead of testing ``torch.cuda.is_available()`` itself, so CPU
(gloo) and CUDA (NCCL) runs share every other line of code. The module answers what DeepSpeed's
``deepspeed.accelerator`` package does (``get_accelerator``, ``set_accelerator``,
``is_current_accelerator_supported``, ``DeepSpeedAccelerator``, and submodules of the same names),
so it can stand in for it unchanged.
"""

from zerospeed.accelerator.abstract_accelerator import AcceleratorFeatureUnsupported, DeepSpeedAccelerator
from zerospeed.accelerator.real_accelerator import (
    accelerator_for,
    get_accelerator,
    is_current_accelerator_supported,
    set_accelerator,
)

Accelerator = DeepSpeedAccelerator
"""zerospeed's own name for the interface in type hints."""

__all__ = [
    "Accelerator",
    "AcceleratorFeatureUnsupported",
    "DeepSpeedAccelerator",
    "accelerator_for",
    "get_accelerator",
    "is_current_accelerator_supported",
    "set_accelerator",
]
