"""``deepspeed.runtime.pipe``: re-exports of :mod:`zerospeed.pipe` under DeepSpeed's module path."""

from zerospeed.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from zerospeed.pipe.topology import ProcessTopology

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology"]
