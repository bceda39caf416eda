"""Typed, frozen DeepSpeed-style configuration.

``load_config`` is the only door: it accepts a dict, a JSON/hjson file path or a base64
string, and returns a :class:`Config` whose attributes mirror DeepSpeed's JSON keys.
Nothing outside this package should need to look at a dict or a string key.
"""

from .auto import parse_path
from .batch import BatchSizes, resolve_batch
from .errors import ConfigError
from .features import check_implemented, features_in_use
from .load import ConfigSource, load_config
from .schema import Config
from .schema_optim import DEEPSPEED_OPTIMIZERS, DEEPSPEED_SCHEDULERS
from .values import AUTO, Auto, DType, FrozenDict, OffloadDevice

__all__ = [
    "AUTO",
    "Auto",
    "BatchSizes",
    "Config",
    "ConfigError",
    "ConfigSource",
    "DEEPSPEED_OPTIMIZERS",
    "DEEPSPEED_SCHEDULERS",
    "DType",
    "FrozenDict",
    "OffloadDevice",
    "check_implemented",
    "features_in_use",
    "load_config",
    "parse_path",
    "resolve_batch",
]
