"""``deepspeed.runtime.pipe.module``: re-exports of :mod:`zerospeed.pipe.module`."""

from zerospeed.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec"]
