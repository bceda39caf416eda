"""What every monitor is: DeepSpeed's ``Monitor`` (``write_events(event_list)``), with its event shape."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

# DeepSpeed's event: (name, value, step); the engine's step is ``global_samples``.
Event = tuple[str, Any, int]


def process_rank() -> int:
    """This process's global rank (0 without a process group: a single process writes)."""
    from zerospeed.distributed.groups import group_rank, is_initialized

    return group_rank() if is_initialized() else 0


class Monitor(ABC):
    """A sink for scalar events. Writes happen on rank 0 only: every monitor is told its rank
    (default: this process's) and :attr:`writes` says whether this one opens files or runs."""

    @abstractmethod
    def __init__(self, monitor_config: Any, *, rank: int | None = None) -> None:
        self.monitor_config = monitor_config
        self.enabled: bool = monitor_config.enabled
        self.rank = process_rank() if rank is None else rank

    @property
    def writes(self) -> bool:
        """Enabled, and on rank 0."""
        return self.enabled and self.rank == 0

    @abstractmethod
    def write_events(self, event_list: Sequence[Event]) -> None:
        """Record each ``(name, value, step)``."""

    def flush(self) -> None:
        """Make what was written visible to readers (a no-op for monitors that write through)."""

    def close(self) -> None:
        """Flush and release files or runs (the engine's ``destroy()``; DeepSpeed leaves this to exit)."""
        self.flush()


__all__ = ["Event", "Monitor", "process_rank"]
