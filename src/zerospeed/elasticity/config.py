"""The elasticity errors and the ``elasticity`` section read from a raw config dict (``deepspeed.elasticity.config``).

:func:`~zerospeed.elasticity.compute_elastic_config` is called by resource schedulers on a plain JSON dict,
before any engine or typed :class:`~zerospeed.config.Config` exists, so it reads the section itself,
with DeepSpeed's rules: ``max_train_batch_size`` and ``micro_batch_sizes`` are required once the
section is enabled, and every other key has DeepSpeed's default. The exception classes are
DeepSpeed's hierarchy (``ElasticityConfigError`` and ``ElasticityIncompatibleWorldSize`` are
``ElasticityError``), so ``except deepspeed.elasticity.config.ElasticityError`` catches them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .constants import (
    ENABLED,
    ENABLED_DEFAULT,
    IGNORE_NON_ELASTIC_BATCH_INFO,
    IGNORE_NON_ELASTIC_BATCH_INFO_DEFAULT,
    MAX_ACCEPTABLE_BATCH_SIZE,
    MAX_ACCEPTABLE_BATCH_SIZE_DEFAULT,
    MAX_GPUS,
    MAX_GPUS_DEFAULT,
    MICRO_BATCHES,
    MICRO_BATCHES_DEFAULT,
    MIN_GPUS,
    MIN_GPUS_DEFAULT,
    MIN_TIME,
    MIN_TIME_DEFAULT,
    MODEL_PARALLEL_SIZE,
    MODEL_PARALLEL_SIZE_DEFAULT,
    NUM_GPUS_PER_NODE,
    NUM_GPUS_PER_NODE_DEFAULT,
    PREFER_LARGER_BATCH,
    PREFER_LARGER_BATCH_DEFAULT,
    VERSION,
    VERSION_DEFAULT,
)


class ElasticityError(Exception):
    """Base class of every elasticity error."""


class ElasticityConfigError(ElasticityError):
    """The ``elasticity`` section is missing, disabled, or holds a value elasticity cannot use."""


class ElasticityIncompatibleWorldSize(ElasticityError):
    """The job runs at a world size that the elasticity section's batch arithmetic does not allow."""


def _key(name: str) -> str:
    return f"elasticity.{name}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _whole(value: Any, name: str, minimum: int) -> int:
    """``value`` as an int >= ``minimum``, else :class:`ElasticityConfigError` naming the key."""
    if not _is_int(value) or value < minimum:
        raise ElasticityConfigError(f"{_key(name)}: {value!r} is not valid; expected an integer >= {minimum}")
    return int(value)


class ElasticityConfig:
    """The ``elasticity`` section of a raw DeepSpeed config dict, with DeepSpeed's defaults.

    Attribute names are DeepSpeed's (``max_acceptable_batch_size`` for ``max_train_batch_size``,
    ``micro_batches`` for ``micro_batch_sizes``, ``prefer_larger_batch_size`` for
    ``prefer_larger_batch``), since schedulers written for DeepSpeed read them.
    """

    def __init__(self, param_dict: Mapping[str, Any]):
        if not isinstance(param_dict, Mapping):
            raise ElasticityConfigError(f"elasticity: {param_dict!r} is not an object; expected the elasticity "
                                        "section, e.g. {\"enabled\": true, \"max_train_batch_size\": 2000, "
                                        "\"micro_batch_sizes\": [2, 4, 6]}")
        self.enabled: bool = bool(param_dict.get(ENABLED, ENABLED_DEFAULT))
        if self.enabled:
            for required in (MAX_ACCEPTABLE_BATCH_SIZE, MICRO_BATCHES):
                if required not in param_dict:
                    raise ElasticityConfigError(
                        f"{_key(required)}: missing; an enabled elasticity section needs both "
                        f"{MAX_ACCEPTABLE_BATCH_SIZE} (the largest global batch) and {MICRO_BATCHES} (the "
                        f"micro batches per GPU to choose from), e.g. \"{MAX_ACCEPTABLE_BATCH_SIZE}\": 2000, "
                        f"\"{MICRO_BATCHES}\": [2, 4, 6]")
        self.max_acceptable_batch_size: int = param_dict.get(MAX_ACCEPTABLE_BATCH_SIZE,
                                                             MAX_ACCEPTABLE_BATCH_SIZE_DEFAULT)
        micro = param_dict.get(MICRO_BATCHES, list(MICRO_BATCHES_DEFAULT))
        if not isinstance(micro, (list, tuple)):
            raise ElasticityConfigError(f"{_key(MICRO_BATCHES)}: {micro!r} is {type(micro).__name__}; expected a "
                                        "list of micro batch sizes, e.g. [2, 4, 6]")
        if not all(_is_int(m) for m in micro):
            raise ElasticityConfigError(f"{_key(MICRO_BATCHES)}: {list(micro)!r} holds a non-integer; expected "
                                        "only positive integers")
        if not all(m > 0 for m in micro):
            raise ElasticityConfigError(f"{_key(MICRO_BATCHES)}: {list(micro)!r} holds a value < 1; expected "
                                        "only positive integers")
        if not micro:
            raise ElasticityConfigError(f"{_key(MICRO_BATCHES)}: [] is empty; give at least one micro batch size")
        self.micro_batches: list[int] = [int(m) for m in micro]
        if not _is_int(self.max_acceptable_batch_size) or self.max_acceptable_batch_size < 1:
            raise ElasticityConfigError(f"{_key(MAX_ACCEPTABLE_BATCH_SIZE)}: {self.max_acceptable_batch_size!r} is "
                                        "not valid; expected an integer >= 1")

        self.min_gpus: int = param_dict.get(MIN_GPUS, MIN_GPUS_DEFAULT)
        self.max_gpus: int = param_dict.get(MAX_GPUS, MAX_GPUS_DEFAULT)
        if not (_is_int(self.min_gpus) and _is_int(self.max_gpus)) or self.min_gpus < 1 or self.max_gpus < 1:
            raise ElasticityConfigError(f"{_key(MIN_GPUS)}/{MAX_GPUS}: min_gpus {self.min_gpus!r}, max_gpus "
                                        f"{self.max_gpus!r}; both must be integers >= 1")
        if self.max_gpus < self.min_gpus:
            raise ElasticityConfigError(f"{_key(MIN_GPUS)}: {self.min_gpus} is greater than {MAX_GPUS} "
                                        f"{self.max_gpus}; lower min_gpus or raise max_gpus")
        self.model_parallel_size: int = _whole(param_dict.get(MODEL_PARALLEL_SIZE, MODEL_PARALLEL_SIZE_DEFAULT),
                                               MODEL_PARALLEL_SIZE, 1)
        self.num_gpus_per_node: int = _whole(param_dict.get(NUM_GPUS_PER_NODE, NUM_GPUS_PER_NODE_DEFAULT),
                                             NUM_GPUS_PER_NODE, 1)
        self.min_time: Any = param_dict.get(MIN_TIME, MIN_TIME_DEFAULT)
        if isinstance(self.min_time, bool) or not isinstance(self.min_time, (int, float)) or self.min_time < 0:
            raise ElasticityConfigError(f"{_key(MIN_TIME)}: {self.min_time!r} is not valid; expected a number of "
                                        "minutes >= 0 (0: unknown)")
        self.version: Any = param_dict.get(VERSION, VERSION_DEFAULT)
        try:
            float(self.version)
        except (TypeError, ValueError):
            raise ElasticityConfigError(f"{_key(VERSION)}: {self.version!r} is not a number; expected 0.1 or "
                                        "0.2") from None
        self.prefer_larger_batch_size: bool = bool(param_dict.get(PREFER_LARGER_BATCH, PREFER_LARGER_BATCH_DEFAULT))
        self.ignore_non_elastic_batch_info: bool = bool(param_dict.get(IGNORE_NON_ELASTIC_BATCH_INFO,
                                                                       IGNORE_NON_ELASTIC_BATCH_INFO_DEFAULT))

    @property
    def version_number(self) -> float:
        """``version`` as a float (DeepSpeed accepts ``0.2`` and ``"0.2"`` alike)."""
        return float(self.version)

    def repr(self) -> dict[str, Any]:
        """The attributes as a dict (DeepSpeed's name for it)."""
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True, indent=4)


__all__ = ["ElasticityConfig", "ElasticityConfigError", "ElasticityError", "ElasticityIncompatibleWorldSize"]
