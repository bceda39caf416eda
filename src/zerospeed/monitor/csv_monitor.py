"""DeepSpeed's CSV monitor: one file per event name under ``output_path/job_name``.

The layout is DeepSpeed's: the file is the event name with ``/`` and spaces turned into ``_`` plus
``.csv`` (``Train/Samples/train_loss`` -> ``Train_Samples_train_loss.csv``), its header is ``step`` and
the name's last ``/`` part, and rows are appended (``step,value``), so a second run into the same
directory appends below a second header (``zerospeed plot`` reads the last run).
"""

from __future__ import annotations

import csv
import os
from typing import Sequence

from zerospeed.config.schema_features import CSVMonitorConfig
from zerospeed.monitor.base import Event, Monitor


def csv_file_name(event_name: str) -> str:
    """The file an event's rows go to (DeepSpeed's sanitizing)."""
    return event_name.replace("/", "_").replace(" ", "_") + ".csv"


def csv_header(event_name: str) -> list[str]:
    return ["step", event_name.split("/")[-1]]


class csvMonitor(Monitor):  # noqa: N801 -- DeepSpeed's class name
    """Appends each event as a row of its own CSV file (rank 0 only)."""

    def __init__(self, csv_config: CSVMonitorConfig, *, rank: int | None = None) -> None:
        super().__init__(csv_config, rank=rank)
        self.output_path = csv_config.output_path
        self.job_name = csv_config.job_name
        self.filenames: list[str] = []
        self.log_dir = self.setup_log_dir()

    def setup_log_dir(self) -> str | None:
        """``output_path/job_name`` (an empty ``output_path`` is the working directory, as DeepSpeed's
        default), made on rank 0."""
        if not self.writes:
            return None
        log_dir = os.path.join(self.output_path, self.job_name)
        os.makedirs(log_dir, exist_ok=True)
        return log_dir

    def write_events(self, event_list: Sequence[Event]) -> None:
        if self.log_dir is None:
            return
        for name, value, step in event_list:
            filename = csv_file_name(name)
            with open(os.path.join(self.log_dir, filename), "a+", newline="") as handle:
                writer = csv.writer(handle)
                if filename not in self.filenames:
                    self.filenames.append(filename)
                    writer.writerow(csv_header(name))
                writer.writerow([step, value])


CSVMonitor = csvMonitor

__all__ = ["CSVMonitor", "csvMonitor", "csv_file_name", "csv_header"]
