"""DeepSpeed's TensorBoard monitor: scalars through torch's ``SummaryWriter`` into ``output_path/job_name``."""

from __future__ import annotations

import os
from typing import Any, Sequence

from zerospeed.config.schema_features import TensorBoardConfig
from zerospeed.monitor.base import Event, Monitor
from zerospeed.monitor.utils import check_tb_availability


class TensorBoardMonitor(Monitor):
    """``add_scalar(name, value, step)`` per event, flushed after each list (rank 0 only)."""

    def __init__(self, tensorboard_config: TensorBoardConfig, *, rank: int | None = None) -> None:
        super().__init__(tensorboard_config, rank=rank)
        check_tb_availability()
        self.output_path = tensorboard_config.output_path
        self.job_name = tensorboard_config.job_name
        self.summary_writer: Any = None
        if self.writes:
            self.get_summary_writer()

    def get_summary_writer(self) -> Any:
        if self.summary_writer is None and self.writes:
            from torch.utils.tensorboard import SummaryWriter

            log_dir = os.path.join(self.output_path, self.job_name)
            os.makedirs(log_dir, exist_ok=True)
            self.summary_writer = SummaryWriter(log_dir=log_dir)
        return self.summary_writer

    def write_events(self, event_list: Sequence[Event], flush: bool = True) -> None:
        if self.summary_writer is None:
            return
        for name, value, step in event_list:
            self.summary_writer.add_scalar(name, value, step)
        if flush:
            self.summary_writer.flush()

    def flush(self) -> None:
        if self.summary_writer is not None:
            self.summary_writer.flush()

    def close(self) -> None:
        if self.summary_writer is not None:
            self.summary_writer.close()
            self.summary_writer = None


__all__ = ["TensorBoardMonitor"]
