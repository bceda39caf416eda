"""Inference: ``init_inference`` and the ``InferenceEngine`` (DeepSpeed's ``deepspeed.inference``), the
inference config, and tensor-parallel serving (``autotp``)."""

from typing import Any

from zerospeed.inference.config import DeepSpeedInferenceConfig, default_inference_config
from zerospeed.inference.config import InferenceTPConfig as DeepSpeedTPConfig
from zerospeed.inference.engine import InferenceEngine, init_inference

#: DeepSpeed's FastGen (inference v2) names, reachable from ``deepspeed.inference``: not built.
FASTGEN_NAMES = ("RaggedInferenceEngineConfig", "InferenceEngineV2", "build_hf_engine")

__all__ = ["DeepSpeedInferenceConfig", "DeepSpeedTPConfig", "InferenceEngine", "default_inference_config",
           "init_inference"]


def __getattr__(name: str) -> Any:
    if name in FASTGEN_NAMES:
        raise NotImplementedError(f"deepspeed.inference.{name}: FastGen (DeepSpeed's inference v2, ragged batching "
                                  f"on CUDA kernels) is not built; use init_inference (its v1 engine)")
    raise AttributeError(f"module 'zerospeed.inference' has no attribute {name!r}")
