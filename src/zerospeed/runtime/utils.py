"""``deepspeed.runtime.utils``: the helpers scripts call (memory report, seeding, moving batches)."""

from __future__ import annotations

import logging
import random
from typing import Any

import torch

from zerospeed.tensor_tree import map_tensors

log = logging.getLogger("zerospeed")


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log this process's device and host memory (only with ``force``, as in DeepSpeed; rank 0 only)."""
    if not force:
        return
    from zerospeed.accelerator import get_accelerator
    from zerospeed.accelerator import host_memory
    from zerospeed.distributed import groups

    if groups.is_initialized() and groups.group_rank() != 0:
        return
    gib = float(1 << 30)
    parts = [message]
    accelerator = get_accelerator()
    if not accelerator.is_cpu:
        parts.append(f"device allocated {accelerator.memory_allocated() / gib:.2f} GiB, max "
                     f"{accelerator.max_memory_allocated() / gib:.2f} GiB, reserved "
                     f"{accelerator.memory_reserved() / gib:.2f} GiB")
    total = host_memory.total_bytes()
    parts.append(f"host used {(total - host_memory.available_bytes()) / gib:.2f} GiB of {total / gib:.2f} GiB, "
                 f"this process {host_memory.rss_bytes() / gib:.2f} GiB")
    log.info(" | ".join(parts))


def set_random_seed(seed: int) -> None:
    """Seed Python's, numpy's and torch's generators (every device's too)."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device as well


def move_to_device(item: Any, device: torch.device | str, criterion_func: Any = None) -> Any:
    """``item`` with every tensor in it (through tuples, lists and mappings) moved to ``device``; with
    ``criterion_func``, only the tensors it accepts."""
    return map_tensors(item, lambda t: t.to(device) if criterion_func is None or criterion_func(t) else t)


__all__ = ["move_to_device", "see_memory_usage", "set_random_seed"]
