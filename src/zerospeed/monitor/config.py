"""DeepSpeed's ``deepspeed.monitor.config``: the four monitor sections as one value.

The sections themselves are parsed (strictly) with the rest of the config (``config/schema_features.py``);
this module gathers them under DeepSpeed's names so ``MonitorMaster`` takes what DeepSpeed's takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zerospeed.config.schema_features import CometConfig, CSVMonitorConfig, TensorBoardConfig, WandbConfig

if TYPE_CHECKING:
    from zerospeed.config import Config

CSVConfig = CSVMonitorConfig  # DeepSpeed's name for the csv_monitor section

SECTIONS = ("tensorboard", "wandb", "csv_monitor", "comet")


@dataclass(frozen=True)
class DeepSpeedMonitorConfig:
    """The ``tensorboard``, ``comet``, ``wandb`` and ``csv_monitor`` sections; ``enabled`` when any is."""

    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    comet: CometConfig = field(default_factory=CometConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    csv_monitor: CSVMonitorConfig = field(default_factory=CSVMonitorConfig)

    @property
    def enabled(self) -> bool:
        return any(getattr(self, name).enabled for name in SECTIONS)

    @classmethod
    def from_config(cls, cfg: "Config") -> "DeepSpeedMonitorConfig":
        return cls(tensorboard=cfg.tensorboard, comet=cfg.comet, wandb=cfg.wandb, csv_monitor=cfg.csv_monitor)


def get_monitor_config(param_dict: dict[str, Any]) -> DeepSpeedMonitorConfig:
    """DeepSpeed's helper: the monitor sections of a config dict (absent ones at their defaults)."""
    return DeepSpeedMonitorConfig(
        tensorboard=TensorBoardConfig.model_validate(param_dict.get("tensorboard", {})),
        comet=CometConfig.model_validate(param_dict.get("comet", {})),
        wandb=WandbConfig.model_validate(param_dict.get("wandb", {})),
        csv_monitor=CSVMonitorConfig.model_validate(param_dict.get("csv_monitor", {})))


__all__ = ["CSVConfig", "CometConfig", "DeepSpeedMonitorConfig", "TensorBoardConfig", "WandbConfig",
           "get_monitor_config"]
