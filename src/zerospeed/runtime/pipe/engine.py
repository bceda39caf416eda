"""``deepspeed.runtime.pipe.engine``: re-exports of :mod:`zerospeed.pipe.engine`."""

from zerospeed.pipe.engine import PipelineEngine, PipelineError

__all__ = ["PipelineEngine", "PipelineError"]
