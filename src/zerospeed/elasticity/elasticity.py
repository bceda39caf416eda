"""``compute_elastic_config`` and its companions (``deepspeed.elasticity.elasticity``).

Called by a resource scheduler (which GPU counts may this job be given?) and by the engine at start-up
(which batch sizes at the current world size?), on the same config dict, with the same answer: the
global batch is one number for every valid world size, and only the micro batch and the gradient
accumulation change with it. That is what lets an elastic job shrink or grow between restarts and
keep training the same optimization problem.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from typing import Any, Union

from .batch import _get_compatible_gpus_v01, _get_compatible_gpus_v02, largest_micro_batch
from .config import ElasticityConfig, ElasticityConfigError, ElasticityError, ElasticityIncompatibleWorldSize
from .constants import (
    DEEPSPEED_ELASTICITY_CONFIG,
    ELASTICITY,
    ENABLED,
    ENABLED_DEFAULT,
    LATEST_ELASTICITY_VERSION,
    MAX_ACCEPTABLE_BATCH_SIZE,
    MICRO_BATCHES,
    MINIMUM_DEEPSPEED_VERSION,
    VERSION,
)

log = logging.getLogger("zerospeed")

ElasticResult = Union[tuple[int, list[int]], tuple[int, list[int], int]]

_RELEASE = re.compile(r"^\s*v?(?:\d+!)?(\d+(?:\.\d+)*)(.*)$", re.IGNORECASE)
_PRE_RELEASE = re.compile(r"^[._-]?(a|b|c|rc|alpha|beta|pre|preview|dev)", re.IGNORECASE)


def _version_key(text: str) -> tuple[tuple[int, ...], int]:
    """A PEP 440 version's release numbers, and -1 for a pre-/dev release of it (0 otherwise): enough
    to compare against :data:`MINIMUM_DEEPSPEED_VERSION` as ``packaging.version`` would."""
    match = _RELEASE.match(str(text))
    if match is None:
        raise ElasticityError(f"target_deepspeed_version: {text!r} is not a version number; pass the DeepSpeed "
                              f"version the job will run, e.g. \"0.19.7\"")
    release = tuple(int(part) for part in match.group(1).split("."))
    while len(release) > 1 and release[-1] == 0:
        release = release[:-1]
    return release, -1 if _PRE_RELEASE.match(match.group(2)) else 0


def _compatible_ds_version_check(target_deepspeed_version: str) -> bool:
    """Refuse a target DeepSpeed older than the first release with elasticity."""
    if _version_key(target_deepspeed_version) < _version_key(MINIMUM_DEEPSPEED_VERSION):
        raise ElasticityError(f"target_deepspeed_version: {target_deepspeed_version} is older than "
                              f"{MINIMUM_DEEPSPEED_VERSION}, the first DeepSpeed with elasticity; the job's "
                              f"runtime would not honour the elasticity section: target {MINIMUM_DEEPSPEED_VERSION} "
                              "or newer")
    return True


def elasticity_enabled(ds_config: Mapping[str, Any]) -> bool:
    """Whether ``ds_config`` has an ``elasticity`` section with ``enabled`` true."""
    if ELASTICITY not in ds_config:
        return False
    return bool(ds_config[ELASTICITY].get(ENABLED, ENABLED_DEFAULT))


def ensure_immutable_elastic_config(runtime_elastic_config_dict: Mapping[str, Any]) -> None:
    """Refuse to run when the resource scheduler planned with another elasticity section.

    A scheduler that chose this job's GPU counts from ``compute_elastic_config`` passes the section it
    used in the environment variable ``DEEPSPEED_ELASTICITY_CONFIG`` (JSON); if its
    ``max_train_batch_size``, ``micro_batch_sizes`` or ``version`` differ from the running config's,
    the counts it will scale the job to may not be valid here, so this raises
    :class:`ElasticityConfigError`. Without the variable nothing can be checked (DeepSpeed warns; logged at DEBUG:
    zerospeed's own launcher restarts at any size and the engine checks that size itself).
    """
    raw = os.environ.get(DEEPSPEED_ELASTICITY_CONFIG)
    if raw is None:
        log.debug("%s is not set: no resource scheduler's elasticity section to compare with; the world size "
                 "is checked against this config's valid sizes at start-up", DEEPSPEED_ELASTICITY_CONFIG)
        return
    try:
        scheduler_dict = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ElasticityConfigError(f"{DEEPSPEED_ELASTICITY_CONFIG}: not valid JSON ({err}); it must hold the "
                                    "elasticity section the resource scheduler planned with") from None
    scheduler = ElasticityConfig(scheduler_dict)
    runtime = ElasticityConfig(runtime_elastic_config_dict)
    compared = ((MAX_ACCEPTABLE_BATCH_SIZE, scheduler.max_acceptable_batch_size, runtime.max_acceptable_batch_size),
                (MICRO_BATCHES, scheduler.micro_batches, runtime.micro_batches),
                (VERSION, scheduler.version_number, runtime.version_number))
    for key, planned, running in compared:
        if planned != running:
            raise ElasticityConfigError(
                f"elasticity.{key}: the resource scheduler planned with {planned!r} ({DEEPSPEED_ELASTICITY_CONFIG}) "
                f"but this run's config has {running!r}; the GPU counts it scales the job to would follow another "
                "batch arithmetic: give the scheduler and the job the same elasticity section")


def _world_size_from_env(version: Any, purpose: str) -> int:
    text = os.getenv("WORLD_SIZE")
    if text is not None and text.isnumeric():
        return int(text)
    raise ElasticityConfigError(f"world_size: elasticity version {version} needs the world size {purpose}; pass "
                                f"world_size= to compute_elastic_config or set WORLD_SIZE (WORLD_SIZE is {text!r})")


def _incompatible(world_size: int, valid_gpus: list[int] | None, final_batch_size: int) -> ElasticityIncompatibleWorldSize:
    return ElasticityIncompatibleWorldSize(
        f"World size ({world_size}) is not valid with the current list of valid GPU counts: {valid_gpus} "
        f"(global batch {final_batch_size}); run with one of those data-parallel sizes, or change "
        "elasticity.min_gpus / max_gpus / micro_batch_sizes / max_train_batch_size")


def _micro_batch(final_batch_size: int, world_size: int, micro_batches: list[int]) -> int:
    micro = largest_micro_batch(final_batch_size, world_size, micro_batches)
    if micro is None:
        raise ElasticityError(f"elasticity.micro_batch_sizes: none of {micro_batches} divides the per-rank batch "
                              f"{final_batch_size} // {world_size}; add a micro batch size that divides it")
    return micro


def compute_elastic_config(ds_config: Mapping[str, Any], target_deepspeed_version: str, world_size: int = 0,
                           return_microbatch: bool = False) -> ElasticResult:
    """DeepSpeed's elasticity API: the global batch and the GPU counts it is valid at.

    Args:
        ds_config: a DeepSpeed config dict with an enabled ``elasticity`` section.
        target_deepspeed_version: the DeepSpeed (API) version the job runs; older than 0.3.8 is refused.
        world_size: the current data-parallel size; when > 0 it must be one of the valid sizes, and the
            micro batch for it is returned too. Version 0.2 reads ``WORLD_SIZE`` when it is 0.
        return_microbatch: also return a micro batch without a ``world_size`` (version 0.1 then reads
            ``WORLD_SIZE``).

    Returns:
        ``(final_batch_size, valid_gpus)``, or ``(final_batch_size, valid_gpus, micro_batch_size)`` when
        ``world_size > 0`` or ``return_microbatch``. The same config always gives the same answer.

    Raises:
        ElasticityConfigError: no or a disabled ``elasticity`` section, a bad value in it, model
            parallelism with version 0.1, a version newer than 0.2, no world size for version 0.2.
        ElasticityError: ``target_deepspeed_version`` older than 0.3.8.
        ElasticityIncompatibleWorldSize: ``world_size`` is not one of the valid sizes.
        ValueError: ``ds_config`` is not a dict, or a micro batch exceeds ``max_train_batch_size``.
        NotImplementedError: a version below 0.2 other than 0.1.
    """
    if not isinstance(ds_config, Mapping):
        raise ValueError(f"ds_config: expected a config dict but received {type(ds_config).__name__}: {ds_config!r}")
    if ELASTICITY not in ds_config:
        raise ElasticityConfigError(f"'{ELASTICITY}' is missing from the config; add an elasticity section "
                                    "(\"enabled\": true, max_train_batch_size, micro_batch_sizes) to run an elastic job")
    section = ds_config[ELASTICITY]
    if not isinstance(section, Mapping) or not section.get(ENABLED, ENABLED_DEFAULT):
        raise ElasticityConfigError("elasticity.enabled: elasticity is disabled; set \"enabled\": true in the "
                                    "elasticity section to run an elastic job")
    config = ElasticityConfig(section)
    version = config.version_number
    if config.model_parallel_size > 1 and version != 0.2:
        raise ElasticityConfigError(f"elasticity.model_parallel_size: {config.model_parallel_size} needs elasticity "
                                    f"version 0.2 (version {config.version} does not support model-parallel training)")
    if version > LATEST_ELASTICITY_VERSION:
        raise ElasticityConfigError(f"elasticity.version: {config.version} is newer than this runtime supports "
                                    f"({LATEST_ELASTICITY_VERSION}); use 0.1 or 0.2")
    _compatible_ds_version_check(target_deepspeed_version)

    candidate_micro_batch: int | None = None
    valid_gpus: list[int] | None
    if version == 0.1:
        final, valid_gpus = _get_compatible_gpus_v01(
            micro_batches=config.micro_batches, max_acceptable_batch_size=config.max_acceptable_batch_size,
            min_gpus=config.min_gpus, max_gpus=config.max_gpus, prefer_larger=config.prefer_larger_batch_size)
        final_batch_size = int(final)
    elif version == 0.2:
        current = world_size if world_size != 0 else _world_size_from_env(config.version, "to compute a valid batch size")
        final_f, valid_gpus, candidate_micro_batch = _get_compatible_gpus_v02(
            micro_batches=config.micro_batches, max_acceptable_batch_size=config.max_acceptable_batch_size,
            current_num_gpus=current, min_gpus=config.min_gpus, max_gpus=config.max_gpus,
            prefer_larger=config.prefer_larger_batch_size, num_gpus_per_node=config.num_gpus_per_node,
            model_parallel_size=config.model_parallel_size)
        final_batch_size = int(final_f)
    else:
        raise NotImplementedError(f"elasticity.version: no elastic batch logic for version {config.version}; "
                                  "use 0.1 or 0.2")
    log.debug("Valid World Size (GPUs / Model Parallel Size): %s", valid_gpus)
    valid = list(valid_gpus or [])

    if world_size > 0:
        if world_size not in valid:
            raise _incompatible(world_size, valid_gpus, final_batch_size)
        return final_batch_size, valid, _micro_batch(final_batch_size, world_size, config.micro_batches)
    if return_microbatch:
        if version == 0.2:
            return final_batch_size, valid, candidate_micro_batch  # type: ignore[return-value]  # None as DeepSpeed
        current = _world_size_from_env(config.version, "to compute a micro batch size")
        if current not in valid:
            raise _incompatible(current, valid_gpus, final_batch_size)
        return final_batch_size, valid, _micro_batch(final_batch_size, current, config.micro_batches)
    return final_batch_size, valid


__all__ = ["compute_elastic_config", "elasticity_enabled", "ensure_immutable_elastic_config"]
