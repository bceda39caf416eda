"""DeepSpeed's ``MonitorMaster``: one object fanning each event list out to the configured monitors.

Every rank holds one (``engine.monitor``) and agrees on ``enabled``; only rank 0 builds monitors and
writes, so ``engine.monitor.write_events([(name, value, step)])`` may be called on every rank. Each
enabled section's package is checked on every rank first, so a missing one fails the whole job.
"""

from __future__ import annotations

from typing import Sequence

from zerospeed.monitor.base import Event, Monitor
from zerospeed.monitor.comet import CometMonitor
from zerospeed.monitor.config import DeepSpeedMonitorConfig
from zerospeed.monitor.csv_monitor import csvMonitor
from zerospeed.monitor.tensorboard import TensorBoardMonitor
from zerospeed.monitor.utils import check_availability
from zerospeed.monitor.wandb import WandbMonitor


class MonitorMaster(Monitor):
    def __init__(self, monitor_config: DeepSpeedMonitorConfig | None = None, *, rank: int | None = None) -> None:
        monitor_config = monitor_config if monitor_config is not None else DeepSpeedMonitorConfig()
        # no monitor enabled: rank 0 without asking the process group
        super().__init__(monitor_config, rank=0 if rank is None and not monitor_config.enabled else rank)
        self.tb_monitor: TensorBoardMonitor | None = None
        self.wandb_monitor: WandbMonitor | None = None
        self.csv_monitor: csvMonitor | None = None
        self.comet_monitor: CometMonitor | None = None
        for section in ("tensorboard", "wandb", "comet"):
            if getattr(monitor_config, section).enabled:
                check_availability(section)
        if self.rank != 0:
            return
        if monitor_config.tensorboard.enabled:
            self.tb_monitor = TensorBoardMonitor(monitor_config.tensorboard, rank=self.rank)
        if monitor_config.wandb.enabled:
            self.wandb_monitor = WandbMonitor(monitor_config.wandb, rank=self.rank)
        if monitor_config.csv_monitor.enabled:
            self.csv_monitor = csvMonitor(monitor_config.csv_monitor, rank=self.rank)
        if monitor_config.comet.enabled:
            self.comet_monitor = CometMonitor(monitor_config.comet, rank=self.rank)

    def monitors(self) -> list[Monitor]:
        """The monitors this rank writes to (none off rank 0)."""
        found = (self.tb_monitor, self.wandb_monitor, self.csv_monitor, self.comet_monitor)
        return [m for m in found if m is not None]

    def write_events(self, event_list: Sequence[Event]) -> None:
        for monitor in self.monitors():
            monitor.write_events(event_list)

    def flush(self) -> None:
        for monitor in self.monitors():
            monitor.flush()

    def close(self) -> None:
        for monitor in self.monitors():
            monitor.close()


__all__ = ["CometMonitor", "Monitor", "MonitorMaster", "TensorBoardMonitor", "WandbMonitor", "csvMonitor"]
