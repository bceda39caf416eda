"""Typed, frozen DeepSpeed-style configuration.

``load_config`` is the only door: it accepts a dict, a JSON/hjson file path or a base64
string, and returns a :class:`Config` whose attributes mirror DeepSpeed's JSON keys.
Nothing outside this package should need to look at a dict or a string key, nor at a config
section: components receive the plain, frozen policies of ``policies``/``specs`` built from it.
"""

from .auto import parse_path
from .batch import BatchSizes, resolve_batch
from .errors import ConfigError
from .features import check_implemented, features_in_use
from .load import ConfigSource, load_config
from .policies import LossScalePolicy, OptimizerOffload, ParamOffload, TrainingPolicy, ZeroPolicy
from .schema import Config
from .schema_features import (
    ActivationCheckpointingConfig,
    CheckpointConfig,
    CommsLoggerConfig,
    FlopsProfilerConfig,
    PipelineConfig,
)
from .schema_optim import (
    DEEPSPEED_OPTIMIZERS,
    DEEPSPEED_SCHEDULERS,
    OptimizerConfig,
    SchedulerConfig,
)
from .schema_precision import BF16Config, DataTypesConfig, FP16Config
from .schema_zero import AioConfig, OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig
from .specs import OptimizerSpec, SchedulerSpec
from .values import AUTO, Auto, DType, FrozenDict, OffloadDevice

__all__ = [
    "AUTO",
    "ActivationCheckpointingConfig",
    "AioConfig",
    "Auto",
    "BF16Config",
    "BatchSizes",
    "CheckpointConfig",
    "CommsLoggerConfig",
    "Config",
    "ConfigError",
    "ConfigSource",
    "DEEPSPEED_OPTIMIZERS",
    "DEEPSPEED_SCHEDULERS",
    "DType",
    "DataTypesConfig",
    "FP16Config",
    "FlopsProfilerConfig",
    "FrozenDict",
    "LossScalePolicy",
    "OffloadDevice",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "OptimizerOffload",
    "OptimizerSpec",
    "ParamOffload",
    "PipelineConfig",
    "SchedulerConfig",
    "SchedulerSpec",
    "TrainingPolicy",
    "ZeroConfig",
    "ZeroPolicy",
    "check_implemented",
    "features_in_use",
    "load_config",
    "parse_path",
    "resolve_batch",
]
