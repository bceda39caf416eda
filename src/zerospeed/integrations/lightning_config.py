"""Lightning's flags (precision, accumulation, clipping) folded into a DeepSpeed config.

Kept free of Lightning imports so the mapping, and its refusals, can be checked without a Trainer. A
flag and a config key that disagree are refused rather than one silently winning: the engine, not
Lightning, applies accumulation, clipping and mixed precision, so both must mean the same thing.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import Any, Protocol

from zerospeed.config.errors import ConfigError
from zerospeed.config.load import read_source

# Lightning precision flag -> the config section that turns it on (None: fp32 everywhere).
PRECISION_SECTIONS: dict[str, str | None] = {"32-true": None, "bf16-mixed": "bf16", "16-mixed": "fp16"}

# Used when the strategy gets no config (as Lightning's "deepspeed" strategy defaults to stage 2).
DEFAULT_CONFIG: dict[str, Any] = {"zero_optimization": {"stage": 2}}

ConfigSource = Mapping[str, Any] | str | os.PathLike[str] | None

CHECKPOINT_TAG = "checkpoint"  # the engine's tag inside the directory trainer.save_checkpoint / fabric.save name


class StrategyRegistry(Protocol):
    """What Lightning's and Fabric's strategy registries offer (``_StrategyRegistry``)."""

    def __contains__(self, name: object) -> bool: ...

    def register(self, name: str, strategy: Any = None, description: str | None = None,
                 override: bool = False, **init_params: Any) -> Any: ...


def zero_config(stage: int, *, offload: bool = False) -> dict[str, Any]:
    """The config a registry name stands for (offload: optimizer, and parameters at stage 3, to CPU)."""
    zero: dict[str, Any] = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {"zero_optimization": zero}


def register_strategy_names(strategy: type, registry: StrategyRegistry) -> None:
    """Register ``strategy`` as ``"zerospeed"`` (ZeRO stage 2 unless ``config=``), one name per stage, and the
    offload variants, in Lightning's or Fabric's registry (names already there are left alone)."""
    entries: list[tuple[str, str, dict[str, Any]]] = [("zerospeed", "zerospeed (ZeRO stage 2 by default)", {})]
    entries += [(f"zerospeed_stage_{s}", f"zerospeed, ZeRO stage {s}", {"config": zero_config(s)}) for s in range(4)]
    entries += [(f"zerospeed_stage_{s}_offload", f"zerospeed, ZeRO stage {s} with CPU offload",
                 {"config": zero_config(s, offload=True)}) for s in (2, 3)]
    for name, description, params in entries:
        if name not in registry:
            registry.register(name, strategy, description=description, **params)


def export_rank_environment(*, rank: int, world_size: int, local_rank: int, main_address: str,
                            main_port: int) -> None:
    """Publish the ranks as torchrun does (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).

    ``zerospeed.initialize`` reads them even when Lightning already started the process group, and
    Lightning's own launcher sets only some (as Lightning's DeepSpeed strategy, we set the rest).
    """
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank),
                       "MASTER_ADDR": main_address, "MASTER_PORT": str(main_port)})


def check_device(lightning_device: str, *, owner: str) -> None:
    """Refuse a Lightning accelerator other than the one zerospeed picked (the engine moves the model there)."""
    from zerospeed.accelerator import get_accelerator

    ours = get_accelerator().device_type
    if ours != lightning_device:
        raise RuntimeError(f"{owner}: Lightning runs on {lightning_device!r} but zerospeed's accelerator is "
                           f"{ours!r}; make them agree (accelerator={ours!r}, or ZEROSPEED_ACCELERATOR="
                           f"{lightning_device} in the environment)")


def check_precision(precision: str, *, owner: str = "ZeroSpeedStrategy") -> str:
    """``precision`` if the engine can honour it; a ValueError naming the supported flags otherwise."""
    if precision in PRECISION_SECTIONS:
        return precision
    hint = ""
    if precision in ("bf16-true", "16-true"):
        hint = (f" zerospeed keeps fp32 master weights, which is Lightning's '{precision.split('-')[0]}-mixed';"
                " use that")
    raise ValueError(f"{owner} does not support precision={precision!r}; use one of "
                     f"{', '.join(map(repr, PRECISION_SECTIONS))}.{hint}")


def _enabled(section: Any) -> Any:
    """A precision section's ``enabled`` value (True/False/"auto"), or None when the section is absent."""
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise ConfigError(f"config section must be a mapping, got {section!r}")
    return section.get("enabled", False)


def _section_key(cfg: Mapping[str, Any], name: str) -> str:
    """The key actually used for ``name`` (DeepSpeed also spells bf16 as "bfloat16")."""
    if name == "bf16" and "bf16" not in cfg and "bfloat16" in cfg:
        return "bfloat16"
    return name


def _apply_precision(cfg: dict[str, Any], precision: str) -> None:
    wanted = PRECISION_SECTIONS[check_precision(precision)]
    for name in ("fp16", "bf16"):
        key = _section_key(cfg, name)
        enabled = _enabled(cfg.get(key))
        if enabled == "auto":
            cfg[key] = {**cfg[key], "enabled": name == wanted}
        elif name == wanted and enabled is False and key in cfg and "enabled" in cfg[key]:
            raise ConfigError(f"precision={precision!r} needs the config's {key}.enabled true, but it is false; "
                              f"set it to true (or \"auto\") or pick another precision")
        elif name == wanted:
            cfg[key] = {**(cfg.get(key) or {}), "enabled": True}
        elif enabled is True:
            raise ConfigError(f"the config enables {key} but the Lightning precision is {precision!r}; pass "
                              f"precision={'bf16-mixed' if name == 'bf16' else '16-mixed'!r} or remove the "
                              f"{key} section (or set its enabled to \"auto\")")


def _apply_accumulation(cfg: dict[str, Any], accumulate: int) -> None:
    given = cfg.get("gradient_accumulation_steps")
    if given in (None, "auto"):
        cfg["gradient_accumulation_steps"] = int(accumulate)
    elif int(given) != int(accumulate):
        raise ConfigError(f"the config's gradient_accumulation_steps={given!r} disagrees with "
                          f"accumulate_grad_batches={accumulate}; Lightning and the engine must count the same "
                          f"window: pass accumulate_grad_batches={given} or drop the config key")


def _apply_clipping(cfg: dict[str, Any], clip_val: float | None, clip_algorithm: str | None) -> None:
    if clip_val in (None, 0, 0.0):
        # No clipping asked: off, unless the config asks (DeepSpeed's default would clip at 1.0, which a
        # Lightning user who set no gradient_clip_val does not expect).
        if cfg.get("gradient_clipping") in (None, "auto"):
            cfg["gradient_clipping"] = 0.0
        return
    if clip_algorithm not in (None, "norm"):
        raise ConfigError(f"gradient_clip_algorithm={clip_algorithm!r} is not supported: the engine clips by "
                          f"global norm only (config gradient_clipping); use gradient_clip_algorithm='norm'")
    given = cfg.get("gradient_clipping")
    if given in (None, "auto"):
        cfg["gradient_clipping"] = float(clip_val)
    elif float(given) != float(clip_val):
        raise ConfigError(f"the config's gradient_clipping={given!r} disagrees with gradient_clip_val={clip_val}; "
                          f"keep one of them (or make them equal)")


def lightning_config(source: ConfigSource, *, precision: str, accumulate_grad_batches: int | None = None,
                     gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None,
                     micro_batch_size: int | None = None) -> dict[str, Any]:
    """A new config dict: ``source`` (dict, JSON/hjson path, base64; None: ZeRO stage 2) with Lightning's flags.

    ``accumulate_grad_batches`` becomes ``gradient_accumulation_steps``, ``gradient_clip_val`` becomes
    ``gradient_clipping`` (no value and no key: 0, clipping off, not DeepSpeed's default 1.0), the precision flag enables ``bf16``/``fp16``; a config key already set to
    another value raises :class:`ConfigError`. ``train_micro_batch_size_per_gpu`` defaults to
    ``micro_batch_size`` (or 1: the engine uses it only to count samples) unless the batch is given.
    """
    cfg = copy.deepcopy(dict(read_source(source))) if source is not None else copy.deepcopy(DEFAULT_CONFIG)
    _apply_precision(cfg, precision)
    if accumulate_grad_batches is not None:
        _apply_accumulation(cfg, accumulate_grad_batches)
    _apply_clipping(cfg, gradient_clip_val, gradient_clip_algorithm)
    if cfg.get("train_micro_batch_size_per_gpu") in (None, "auto") and cfg.get("train_batch_size") in (None, "auto"):
        cfg["train_micro_batch_size_per_gpu"] = int(micro_batch_size or 1)
        cfg.pop("train_batch_size", None)
    return cfg
