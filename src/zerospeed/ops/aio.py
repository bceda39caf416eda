"""DeepSpeed's public path of the async I/O engine (``deepspeed.ops.aio``): the same objects as
:mod:`zerospeed.offload.aio`, where the engine lives next to the NVMe tier that uses it."""

from zerospeed.offload.aio import AioShortReadError, AsyncIOHandle, IORequest, worker_count

__all__ = ["AsyncIOHandle", "AioShortReadError", "IORequest", "worker_count"]
