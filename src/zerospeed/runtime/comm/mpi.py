"""``deepspeed.runtime.comm.mpi``: DeepSpeed's mpi4py 1-bit backend, answered over torch.distributed.

DeepSpeed builds it as ``MpiBackend(cuda_aware)`` over ``MPI.COMM_WORLD``; here it is the
:class:`~zerospeed.runtime.comm.compressed.CompressedBackend` over every rank of the default
process group (no mpi4py), and ``cuda_aware`` is kept only as an attribute.
"""

from __future__ import annotations

from zerospeed.runtime.comm.compressed import CompressedBackend


class MpiBackend(CompressedBackend):
    """The compressed backend over the whole world, with DeepSpeed's ``MpiBackend(cuda_aware)`` signature."""

    def __init__(self, cuda_aware: bool = False) -> None:
        super().__init__(mpu=None)
        self.cuda_aware = bool(cuda_aware)


__all__ = ["MpiBackend"]
