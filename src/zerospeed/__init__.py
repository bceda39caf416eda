"""zerospeed: ZeRO data parallelism, offload and mixed precision for PyTorch, DeepSpeed-compatible.

Heavy pieces are imported lazily so ``import zerospeed`` stays cheap for the launcher.
"""

from __future__ import annotations

from zerospeed._lazy_submodules import lazy_attributes as _lazy_attributes

__version__ = "0.1.0.dev0"

_LAZY = {
    "initialize": "zerospeed.entry",
    "add_config_arguments": "zerospeed.entry",
    "Engine": "zerospeed.engine",
    "load_config": "zerospeed.config",
    "Config": "zerospeed.config",
    "ConfigError": "zerospeed.config",
    "init_distributed": "zerospeed.distributed.env",
    "ParallelDims": "zerospeed.distributed.mesh",
    "Comm": "zerospeed.distributed.comm",
    "get_accelerator": "zerospeed.accelerator",
    "install_as_deepspeed": "zerospeed.deepspeed_alias",
    "uninstall_as_deepspeed": "zerospeed.deepspeed_alias",
    # DeepSpeed's top-level names (``deepspeed.X`` once installed as deepspeed)
    "DeepSpeedEngine": "zerospeed.runtime.engine",
    "DeepSpeedOptimizer": "zerospeed.runtime.base_optimizer",
    "log_dist": "zerospeed.utils.logging",
    "logger": "zerospeed.utils.logging",
    "init_inference": "zerospeed.inference",
    "InferenceEngine": "zerospeed.inference",
    "DeepSpeedInferenceConfig": "zerospeed.inference",
    "default_inference_config": "zerospeed.inference",
    "tp_model_init": "zerospeed.tensor_parallel.autotp",
}

# Subpackages reachable as attributes after a bare ``import zerospeed`` (``zerospeed.zero.Init``).
_SUBMODULES = ("zero", "utils", "checkpoint", "ops", "checkpointing", "comm", "runtime", "moe", "accelerator",
               "profiling", "monitor", "elasticity")

__all__ = ["__version__", *_LAZY, *_SUBMODULES]

__getattr__, __dir__ = _lazy_attributes(__name__, _LAZY, submodules=_SUBMODULES, public=__all__)
