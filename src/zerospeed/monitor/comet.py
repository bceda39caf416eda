"""DeepSpeed's Comet monitor: ``comet_ml.start(...)`` on rank 0, each event logged at most once per
``samples_log_interval`` samples. ``comet_ml`` is not a dependency of zerospeed: without it, enabling
the section stops ``initialize`` with the pip command."""

from __future__ import annotations

from typing import Any, Sequence

from zerospeed.config.schema_features import CometConfig
from zerospeed.monitor.base import Event, Monitor
from zerospeed.monitor.utils import check_comet_availability


class EventsLogScheduler:
    """Whether an event is due: its first value, then once ``samples_log_interval`` samples have passed."""

    def __init__(self, samples_log_interval: int) -> None:
        self._samples_log_interval = samples_log_interval
        self._last_logged: dict[str, int] = {}

    def needs_logging(self, name: str, current_sample: int) -> bool:
        last = self._last_logged.get(name)
        if last is None or current_sample - last >= self._samples_log_interval:
            self._last_logged[name] = current_sample
            return True
        return False


class CometMonitor(Monitor):
    def __init__(self, comet_config: CometConfig, *, rank: int | None = None) -> None:
        super().__init__(comet_config, rank=rank)
        check_comet_availability()
        self._samples_log_interval = comet_config.samples_log_interval
        self._experiment: Any = None
        if self.writes:
            import comet_ml  # type: ignore[import-not-found]

            self._experiment = comet_ml.start(api_key=comet_config.api_key, project=comet_config.project,
                                              workspace=comet_config.workspace,
                                              experiment_key=comet_config.experiment_key, mode=comet_config.mode,
                                              online=comet_config.online)
            if comet_config.experiment_name is not None:
                self._experiment.set_name(comet_config.experiment_name)
        self._events_log_scheduler = EventsLogScheduler(comet_config.samples_log_interval)

    @property
    def experiment(self) -> Any:
        return self._experiment

    @property
    def samples_log_interval(self) -> int:
        return self._samples_log_interval

    def write_events(self, event_list: Sequence[Event]) -> None:
        if self._experiment is None:
            return
        for name, value, step in event_list:
            if self._events_log_scheduler.needs_logging(name, step):
                self._experiment.__internal_api__log_metric__(name=name, value=value, step=step)

    def close(self) -> None:
        if self._experiment is not None:
            self._experiment.end()
            self._experiment = None


__all__ = ["CometMonitor", "EventsLogScheduler"]
