"""Summary helpers for the demo: peak memory per rank and the config settings that differ from defaults."""

from __future__ import annotations

import copy
import json
import resource
import sys
import warnings
from typing import Any

import torch

import zerospeed

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def peak_memory_mb(device: torch.device) -> float:
    """Peak device memory on CUDA; the process's peak resident set on CPU (what the OS charged us)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def non_default_settings(cfg: zerospeed.Config, world_size: int) -> dict[str, Any]:
    """Dotted key -> value for everything the resolved config sets beyond DeepSpeed's defaults.

    Defaults come from a config holding only the batch keys, so derived batch values and defaults
    that the config merely restates are not reported. Sections that exist only when written
    (``optimizer``, ``scheduler``) have defaults that depend on their ``type`` (a scheduler's
    ``last_batch_iteration``, an optimizer's ``legacy_fusion``): a key there is a default when the
    config without it resolves to the same value.
    """
    resolved = cfg.to_dict()
    baseline = zerospeed.load_config({k: resolved[k] for k in BATCH_KEYS}, world_size=world_size).to_dict()
    flat, base = _flatten(resolved), _flatten(baseline)
    return {key: value for key, value in flat.items()
            if (base[key] != value if key in base else not _resolves_without(resolved, key, value, world_size))}


def _resolves_without(resolved: dict[str, Any], key: str, value: Any, world_size: int) -> bool:
    """Whether ``resolved`` with dotted ``key`` left out still resolves to ``value`` there (a required
    key, whose removal is refused, is the user's)."""
    *path, leaf = key.split(".")
    trimmed = copy.deepcopy(resolved)
    section = trimmed
    for name in path:
        section = section[name]
    del section[leaf]
    try:
        with warnings.catch_warnings():  # e.g. a default warmup longer than the run: not the question here
            warnings.simplefilter("ignore")
            again = _flatten(zerospeed.load_config(trimmed, world_size=world_size).to_dict())
    except (zerospeed.ConfigError, ValueError):
        return False
    return key in again and again[key] == value


def format_settings(settings: dict[str, Any], indent: str) -> str:
    return "\n".join(f"{indent}{key} = {json.dumps(value)}" for key, value in settings.items())
