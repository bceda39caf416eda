"""``deepspeed.runtime.comm.compressed``: DeepSpeed's ``CompressedBackend`` for scripts that call it directly.

DeepSpeed's 1-bit optimizers hold one of these and call
``compressed_allreduce(exp_avg, worker_error, server_error, local_rank)``. Here it is a thin
adapter over :func:`zerospeed.distributed.compressed.compressed_allreduce`: DeepSpeed's calling
conventions (any shape, a buffer shorter than the padded error buffers, the result returned) on
the strict 1-D function, every collective through a :class:`~zerospeed.distributed.comm.Comm`.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed.distributed.comm import Comm
from zerospeed.distributed.compressed import compressed_allreduce, padded_size
from zerospeed.distributed.mesh import Mesh


class CompressedBackend:
    """The 1-bit compressed all-reduce over the data-parallel group of ``mpu`` (or every rank).

    ``mpu`` is Megatron's interface (``get_data_parallel_group()``); a zerospeed :class:`Mesh`
    lends its own data-parallel Comm, so the compressed bytes show in that Comm's ``stats``.
    """

    def __init__(self, mpu: Any = None) -> None:
        self.mpu = mpu
        if mpu is None:
            self.comm = Comm(name="compressed")
        elif isinstance(mpu, Mesh):
            self.comm = mpu.dp
        elif callable(getattr(mpu, "get_data_parallel_group", None)):
            self.comm = Comm(mpu.get_data_parallel_group(), name="compressed_dp")
        else:
            raise TypeError(f"mpu={mpu!r} has no get_data_parallel_group(); pass a Megatron-style mpu, "
                            f"a zerospeed Mesh, or None for every rank")
        self.world_group = self.comm.group
        self.size = self.comm.world_size
        self.rank = self.comm.rank

    def compressed_allreduce(self, buffer_m: torch.Tensor, worker_error: torch.Tensor,
                             server_error: torch.Tensor, local_rank: int | None = None) -> torch.Tensor:
        """The compressed average of ``buffer_m`` over the group, written into it and returned.

        As in DeepSpeed: ``buffer_m`` has any shape and at most ``worker_error.numel()`` elements
        (the rest counts as zeros); ``worker_error`` is the padded length
        (``padded_size(numel, world)``) and ``server_error`` that over the world size, both updated
        in place. ``local_rank`` (DeepSpeed's cupy device choice) is not needed and ignored.
        """
        del local_rank
        if not isinstance(buffer_m, torch.Tensor):
            raise TypeError(f"buffer_m must be a torch.Tensor, got {type(buffer_m).__name__}")
        numel, padded = buffer_m.numel(), worker_error.numel()
        if numel == 0:  # DeepSpeed's answer for an empty buffer: the errors start over, nothing is sent
            worker_error.zero_()
            server_error.zero_()
            return buffer_m
        if buffer_m.dtype != torch.float32:
            raise TypeError(f"buffer_m is {buffer_m.dtype}; the 1-bit all-reduce works on float32 "
                            f"(DeepSpeed's 1-bit optimizers keep exp_avg in fp32): pass buffer_m.float()")
        if padded < numel:
            raise ValueError(f"worker_error has {padded} elements, fewer than buffer_m's {numel}; size it "
                             f"padded_size({numel}, {self.size}) = {padded_size(numel, self.size)}")
        flat = buffer_m.reshape(-1)
        in_place = padded == numel and flat.is_contiguous() and flat.data_ptr() == buffer_m.data_ptr()
        work = flat if in_place else torch.cat([flat, flat.new_zeros(padded - numel)])
        compressed_allreduce(self.comm, work, worker_error, server_error)
        if not in_place:
            buffer_m.copy_(work[:numel].view(buffer_m.shape))
        return buffer_m


__all__ = ["CompressedBackend"]
