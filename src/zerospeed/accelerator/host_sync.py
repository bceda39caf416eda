"""Streams and events for a device whose work is done by the time a call returns (the CPU).

DeepSpeed's CPU accelerator answers ``Stream``/``Event``/``current_stream`` with ``None``, so a script
written for CUDA (``s = acc.Stream(); with acc.stream(s): ...; acc.current_stream().wait_stream(s)``)
crashes on the CPU. torch's own CPU pieces do not fill the gap either: ``torch.cpu.Stream`` has no
``synchronize``/``query`` and ``torch.Event(device="cpu").record()`` raises "cpu backend doesn't
support events". These classes give the CUDA stream/event surface with the only semantics a
synchronous device can have: everything is already complete, so waits return at once, and events
record a host timestamp so ``elapsed_time`` still measures the host-side span between them.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class HostEvent:
    """A point in host time; ``elapsed_time`` gives milliseconds like ``torch.cuda.Event``."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._recorded_at: float | None = None

    def record(self, stream: "HostStream | None" = None) -> None:
        self._recorded_at = time.perf_counter()

    def wait(self, stream: "HostStream | None" = None) -> None:
        """Nothing to wait for: the work before ``record`` finished when it was issued."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Nothing to wait for (see :meth:`wait`)."""

    def elapsed_time(self, end_event: "HostEvent") -> float:
        if self._recorded_at is None or end_event._recorded_at is None:
            raise RuntimeError("HostEvent.elapsed_time: record() both events first "
                               "(start.record(); ...; end.record(); start.elapsed_time(end))")
        return (end_event._recorded_at - self._recorded_at) * 1000.0


class HostStream:
    """An in-order queue on the host: already drained, so every wait returns immediately."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = torch.device("cpu")
        self.priority = priority

    def synchronize(self) -> None:
        """Nothing queued: host work runs as it is issued."""

    def query(self) -> bool:
        return True

    def wait_stream(self, stream: "HostStream") -> None:
        """Ordering between host streams is program order already."""

    def wait_event(self, event: HostEvent) -> None:
        """The event's work is finished (see :meth:`HostEvent.wait`)."""

    def record_event(self, event: HostEvent | None = None) -> HostEvent:
        event = HostEvent() if event is None else event
        event.record(self)
        return event

    def __repr__(self) -> str:
        return f"<zerospeed HostStream device=cpu priority={self.priority}>"


DEFAULT_HOST_STREAM = HostStream()
"""The stream ``current_stream()``/``default_stream()`` answer on the CPU (it holds no state)."""
