"""Plain, frozen policies built once from a resolved :class:`Config` for the components.

The config sections keep DeepSpeed's shapes (``int | Auto``, aliases, passthrough keys); the
components below ``config/`` must not see any of that. Each policy here is the part of the config
one component reads, with every value a plain ``int``/``float``/``bool``; building one from a
section that still holds ``"auto"`` raises :class:`ConfigError` naming the key, so no ``Auto`` and
no cast ever reaches a component.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from .errors import ConfigError
from .schema_precision import FP16Config
from .schema_zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig
from .values import Auto, OffloadDevice

if TYPE_CHECKING:
    from .schema import Config

T = TypeVar("T")


def resolved(value: T | Auto, path: str) -> T:
    """``value`` itself, or a :class:`ConfigError` naming ``path`` when it is still ``"auto"``."""
    if isinstance(value, Auto):
        raise ConfigError(f'{path}: "auto" is not resolved yet; set it in the config or call '
                          "resolve_auto first")
    return value


@dataclass(frozen=True)
class _OffloadTarget:
    """What both offload sections share: the device, its NVMe directory, pinning."""

    device: OffloadDevice = OffloadDevice.NONE
    nvme_path: pathlib.Path | None = None
    pin_memory: bool = True

    @property
    def enabled(self) -> bool:
        return self.device != OffloadDevice.NONE


@dataclass(frozen=True)
class OptimizerOffload(_OffloadTarget):
    """``zero_optimization.offload_optimizer``: where masters and optimizer states live."""

    buffer_count: int = 4
    ratio: float = 1.0
    pipeline_read: bool = False

    @classmethod
    def from_config(cls, section: OffloadOptimizerConfig) -> OptimizerOffload:
        return cls(resolved(section.device, "zero_optimization.offload_optimizer.device"), section.nvme_path,
                   section.pin_memory, buffer_count=section.buffer_count, ratio=section.ratio,
                   pipeline_read=section.pipeline_read)


@dataclass(frozen=True)
class ParamOffload(_OffloadTarget):
    """``zero_optimization.offload_param``: where stage-3 parameter shards live between uses."""

    buffer_count: int = 5
    max_in_cpu: int = 1_000_000_000

    @classmethod
    def from_config(cls, section: OffloadParamConfig) -> ParamOffload:
        return cls(resolved(section.device, "zero_optimization.offload_param.device"), section.nvme_path,
                   section.pin_memory, buffer_count=section.buffer_count, max_in_cpu=section.max_in_cpu)


@dataclass(frozen=True)
class ZeroPolicy:
    """What the ZeRO model state and the state store read of ``zero_optimization``.

    Field names are DeepSpeed's (short forms of the ``stage3_*`` keys); sizes count elements.
    ``overlap_comm`` is settled: DeepSpeed's unset value means on (it is on where it matters).
    """

    stage: int = 0
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    prefetch_bucket_size: int = 50_000_000
    param_persistence_threshold: int = 100_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    overlap_comm: bool = True
    sub_group_size: int = 1_000_000_000
    offload_optimizer: OptimizerOffload = OptimizerOffload()
    offload_param: ParamOffload = ParamOffload()

    @property
    def offloads_optimizer(self) -> bool:
        """Optimizer state offloaded to CPU memory or NVMe."""
        return self.offload_optimizer.enabled

    @classmethod
    def from_config(cls, zero: ZeroConfig) -> ZeroPolicy:
        path = "zero_optimization."
        return cls(
            stage=resolved(zero.stage, path + "stage"),
            reduce_bucket_size=resolved(zero.reduce_bucket_size, path + "reduce_bucket_size"),
            allgather_bucket_size=zero.allgather_bucket_size,
            prefetch_bucket_size=resolved(zero.prefetch_bucket_size,
                                          path + "stage3_prefetch_bucket_size"),
            param_persistence_threshold=resolved(zero.param_persistence_threshold,
                                                 path + "stage3_param_persistence_threshold"),
            max_live_parameters=zero.max_live_parameters,
            max_reuse_distance=zero.max_reuse_distance,
            overlap_comm=zero.overlap_comm is not False,
            sub_group_size=zero.sub_group_size,
            offload_optimizer=OptimizerOffload.from_config(zero.offload_optimizer),
            offload_param=ParamOffload.from_config(zero.offload_param),
        )


@dataclass(frozen=True)
class LossScalePolicy:
    """fp16 loss scaling as plain values: a fixed scale, or DeepSpeed's dynamic rule from
    ``initial_scale`` (``scale_window``, ``min_scale``, ``hysteresis`` apply when dynamic)."""

    dynamic: bool
    initial_scale: float
    scale_window: int = 1000
    min_scale: float = 1.0
    hysteresis: int = 2
    consecutive_hysteresis: bool = False

    @classmethod
    def from_fp16(cls, fp16: FP16Config) -> LossScalePolicy | None:
        """The scaling an ``fp16`` section asks for; None when fp16 is off."""
        if isinstance(fp16.enabled, Auto):
            raise ConfigError('fp16.enabled: "auto" is not resolved yet; the loss scaler is '
                              "undecided (call resolve_auto first)")
        if not fp16.enabled:
            return None
        if not fp16.dynamic_loss_scale:
            return cls(dynamic=False, initial_scale=fp16.loss_scale)
        return cls(dynamic=True, initial_scale=fp16.initial_dynamic_scale,
                   scale_window=fp16.loss_scale_window, min_scale=fp16.min_loss_scale,
                   hysteresis=fp16.hysteresis, consecutive_hysteresis=fp16.consecutive_hysteresis)


@dataclass(frozen=True)
class TrainingPolicy:
    """What the engine reads each step: the batch triple, clipping and reporting."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    gradient_clipping: float = 0.0
    steps_per_print: int | None = None  # None: never print

    @classmethod
    def from_config(cls, cfg: Config) -> TrainingPolicy:
        return cls(train_batch_size=_batch(cfg.train_batch_size, "train_batch_size"),
                   train_micro_batch_size_per_gpu=_batch(cfg.train_micro_batch_size_per_gpu,
                                                         "train_micro_batch_size_per_gpu"),
                   gradient_accumulation_steps=_batch(cfg.gradient_accumulation_steps,
                                                      "gradient_accumulation_steps"),
                   gradient_clipping=resolved(cfg.gradient_clipping, "gradient_clipping"),
                   steps_per_print=cfg.steps_per_print)


def _batch(value: int | Auto | None, key: str) -> int:
    number = resolved(value, key)
    if number is None:
        raise ConfigError(f"{key}: not derived for this config; give train_batch_size and/or "
                          "train_micro_batch_size_per_gpu, or enable the elasticity section to have them chosen")
    return number


__all__ = ["LossScalePolicy", "OptimizerOffload", "ParamOffload", "TrainingPolicy", "ZeroPolicy",
           "resolved"]
