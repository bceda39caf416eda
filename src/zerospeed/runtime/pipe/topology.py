"""``deepspeed.runtime.pipe.topology``: re-exports of :mod:`zerospeed.pipe.topology`."""

from zerospeed.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = ["ProcessTopology", "PipeDataParallelTopology", "PipeModelDataParallelTopology"]
