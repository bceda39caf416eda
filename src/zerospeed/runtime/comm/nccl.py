"""``deepspeed.runtime.comm.nccl``: DeepSpeed's NCCL+cupy 1-bit backend, here the one torch-only backend.

The same class as :class:`~zerospeed.runtime.comm.compressed.CompressedBackend`: it runs over any
process group the comm door supports (gloo on CPU, NCCL on GPUs), without cupy.
"""

from zerospeed.runtime.comm.compressed import CompressedBackend

NcclBackend = CompressedBackend

__all__ = ["NcclBackend"]
