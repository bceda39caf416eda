"""DeepSpeed's Weights & Biases monitor: ``wandb.init(project, group, entity)`` on rank 0, then
``wandb.log({name: value}, step=step)`` per event. W&B's own variables apply: ``WANDB_MODE=offline``
keeps the run on disk, ``WANDB_DIR`` says where (the tests use both)."""

from __future__ import annotations

from typing import Any, Sequence

from zerospeed.config.schema_features import WandbConfig
from zerospeed.monitor.base import Event, Monitor
from zerospeed.monitor.utils import check_wandb_availability


class WandbMonitor(Monitor):
    def __init__(self, wandb_config: WandbConfig, *, rank: int | None = None) -> None:
        super().__init__(wandb_config, rank=rank)
        check_wandb_availability()
        self.group = wandb_config.group
        self.team = wandb_config.team
        self.project = wandb_config.project
        self.run: Any = None
        if self.writes:
            import wandb

            self.run = wandb.init(project=self.project, group=self.group, entity=self.team)

    def log(self, data: dict[str, Any], step: int | None = None, commit: bool | None = None) -> Any:
        if self.run is not None:
            return self.run.log(data, step=step, commit=commit)
        return None

    def write_events(self, event_list: Sequence[Event]) -> None:
        for name, value, step in event_list:
            self.log({name: value}, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


__all__ = ["WandbMonitor"]
