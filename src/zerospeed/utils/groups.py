"""``deepspeed.utils.groups``: the process-group queries transformers and Accelerate make.

transformers (``integrations/deepspeed.py``, sequence-parallel loss) and Accelerate (``_prepare_deepspeed``
with Ulysses) call ``_get_sequence_parallel_group/_world_size/_rank``; DeepSpeed's ZeRO code and user
scripts also ask for the data-parallel group. zerospeed trains data parallel only here (sequence and
model parallelism are refused by ``initialize``), so the answers are DeepSpeed's for a job without an
``mpu``: the data-parallel group is every rank, sequence and model parallel sizes are 1, and asking for
the sequence-parallel group raises ``KeyError`` as DeepSpeed does when there is none. Each call reads
``torch.distributed``; nothing is cached.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def _require_initialized() -> None:
    if not dist.is_initialized():
        raise RuntimeError("deepspeed.utils.groups: the process group is not started yet "
                           "(deepspeed.init_distributed() or deepspeed.initialize(...) start it)")


def _get_data_parallel_group() -> Any:
    """The group gradients are averaged over: every rank."""
    _require_initialized()
    return dist.group.WORLD


def _get_data_parallel_world_size() -> int:
    _require_initialized()
    return dist.get_world_size()


def _get_data_parallel_rank() -> int:
    _require_initialized()
    return dist.get_rank()


def _get_model_parallel_world_size() -> int:
    return 1


def _get_sequence_parallel_world_size() -> int:
    return 1


def _get_sequence_parallel_rank() -> int:
    return 0


def _get_sequence_parallel_group() -> Any:
    raise KeyError("No sequence parallel group found (zerospeed does not implement sequence parallelism)")


def _get_sequence_data_parallel_group() -> Any:
    return _get_data_parallel_group()


def _get_sequence_data_parallel_world_size() -> int:
    return _get_data_parallel_world_size()


def _get_sequence_data_parallel_rank() -> int:
    return _get_data_parallel_rank()


__all__ = [
    "_get_data_parallel_group", "_get_data_parallel_rank", "_get_data_parallel_world_size",
    "_get_model_parallel_world_size", "_get_sequence_data_parallel_group", "_get_sequence_data_parallel_rank",
    "_get_sequence_data_parallel_world_size", "_get_sequence_parallel_group", "_get_sequence_parallel_rank",
    "_get_sequence_parallel_world_size",
]
