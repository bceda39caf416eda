"""The engine's side of elasticity: the batch sizes of an elastic config at the current world size.

DeepSpeed's ``DeepSpeedConfig`` does this when the ``elasticity`` section is enabled: it asks
:func:`compute_elastic_config` for the global batch and the micro batch at the current data-parallel
size, checks the resource scheduler's copy of the section, refuses batch keys given beside it (unless
``ignore_non_elastic_batch_info``, which overrides them with a warning), and derives the accumulation.
:func:`elastic_batch` is that step for :meth:`zerospeed.config.Config.build`, so every world size the
job restarts at gets the same global batch, or an error naming the sizes it may run at.

Its errors are both :class:`~zerospeed.config.ConfigError` (what ``load_config`` promises) and
DeepSpeed's elasticity errors (what DeepSpeed users catch around ``initialize``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zerospeed.config.errors import ConfigError

from .config import ElasticityConfig, ElasticityConfigError, ElasticityError, ElasticityIncompatibleWorldSize
from .constants import ELASTICITY, IGNORE_NON_ELASTIC_BATCH_INFO
from .elasticity import compute_elastic_config, ensure_immutable_elastic_config

log = logging.getLogger("zerospeed")

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


class ElasticConfigError(ConfigError, ElasticityConfigError):
    """An elasticity section the engine cannot run with (a ``ConfigError`` and an ``ElasticityConfigError``)."""


class ElasticWorldSizeError(ConfigError, ElasticityIncompatibleWorldSize):
    """The job started at a world size its elasticity section does not allow."""


@dataclass(frozen=True)
class ElasticBatch:
    """The batch triple elasticity chose for one data-parallel size, and every size it allows."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    valid_world_sizes: tuple[int, ...]


def elastic_batch(ds_config: Mapping[str, Any], world_size: int, *, target_version: str | None = None) -> ElasticBatch:
    """The batch sizes of the enabled ``elasticity`` section of ``ds_config`` (the config as written)
    at data-parallel size ``world_size``, with DeepSpeed's checks (see the module docstring)."""
    if target_version is None:
        from zerospeed.deepspeed_alias import DEEPSPEED_API_VERSION

        target_version = DEEPSPEED_API_VERSION
    section = ds_config[ELASTICITY]
    try:
        result = compute_elastic_config(dict(ds_config), target_version, world_size=world_size)
        ensure_immutable_elastic_config(section)
        ignore = ElasticityConfig(section).ignore_non_elastic_batch_info
    except ElasticityIncompatibleWorldSize as err:
        raise ElasticWorldSizeError(f"elasticity: data-parallel world size {world_size}: {err}") from None
    except ElasticityError as err:
        raise ElasticConfigError(str(err) if str(err).startswith("elasticity") else f"elasticity: {err}") from None
    except (ValueError, NotImplementedError) as err:  # a micro batch above max_train_batch_size, version 0.15
        raise ElasticConfigError(str(err)) from None
    final, valid = result[0], result[1]
    micro = int(result[2]) if len(result) > 2 and result[2] else 0  # world_size > 0: always a micro batch
    given = [key for key in _BATCH_KEYS if key in ds_config]
    if given and not ignore:
        raise ElasticConfigError(
            f"{', '.join(given)}: given beside an enabled elasticity section, which derives the batch sizes from "
            f"the world size (they would not be used); remove them, or set elasticity.{IGNORE_NON_ELASTIC_BATCH_INFO}"
            ": true to have them ignored")
    gas = final // (micro * world_size) if micro else 0
    if final < 1 or gas < 1 or final != micro * gas * world_size:
        raise ElasticConfigError(
            f"elasticity.max_train_batch_size: {section.get('max_train_batch_size')!r} gives global batch {final} at "
            f"data-parallel size {world_size} (micro batch {micro}), which is not micro batch x accumulation x "
            f"{world_size}; raise max_train_batch_size to at least {min(section.get('micro_batch_sizes') or [1]) * world_size}"
            " or run on fewer ranks")
    chosen = {"train_batch_size": final, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas}
    for key in given:
        log.warning("[Elasticity] overriding %s: %s -> %s", key, ds_config[key], chosen[key])
    # once per job (every rank builds its config): the sizes an elastic restart may use
    log.log(logging.INFO if os.environ.get("RANK", "0") == "0" else logging.DEBUG,
            "[Elasticity] valid data-parallel sizes: %s; at %d: train_batch_size %d = micro batch %d x accumulation %d "
            "x %d", valid, world_size, final, micro, gas, world_size)
    return ElasticBatch(final, micro, gas, tuple(valid))


__all__ = ["ElasticBatch", "ElasticConfigError", "ElasticWorldSizeError", "elastic_batch"]
