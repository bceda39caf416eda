"""``wall_clock_breakdown``: where the training time goes (forward, backward, optimizer step).

As DeepSpeed's switch, it times every micro-batch's forward and backward and every boundary step, and
the engine logs their means per optimizer step each ``steps_per_print`` steps, in milliseconds. On an
accelerator each phase is bracketed by a device synchronize, so the times are the device's, not the
kernel launches' (which costs overlap: the switch is off by default). Without the switch the engine
holds :class:`NoTimers`, whose phases cost nothing.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, ContextManager, Iterator, Protocol

PHASES = ("forward", "backward", "step")


class PhaseTimers(Protocol):
    """What the engine asks of its timers: bracket a phase, and a report line per print interval."""

    def phase(self, name: str) -> ContextManager[None]: ...

    def report(self, steps: int) -> str | None: ...


class NoTimers:
    """``wall_clock_breakdown`` off: no timing, no synchronization, no report."""

    def phase(self, name: str) -> ContextManager[None]:
        return contextlib.nullcontext()

    def report(self, steps: int) -> str | None:
        return None


class WallClockTimers:
    """Sums each phase's wall time since the last report."""

    def __init__(self, *, synchronize: Callable[[], None], clock: Callable[[], float] = time.perf_counter):
        self._synchronize = synchronize
        self._clock = clock
        self._totals = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in self._totals:
            raise ValueError(f"unknown timed phase {name!r}; the phases are {', '.join(PHASES)}")
        self._synchronize()
        start = self._clock()
        try:
            yield
        finally:
            self._synchronize()
            self._totals[name] += self._clock() - start

    def totals(self) -> dict[str, float]:
        """Seconds per phase since the last report."""
        return dict(self._totals)

    def report(self, steps: int) -> str:
        """Mean milliseconds per optimizer step over the last ``steps`` steps (a step's forward and
        backward summed over its micro-batches); starts the next interval."""
        per_step = {name: 1000.0 * total / max(steps, 1) for name, total in self._totals.items()}
        self._totals = dict.fromkeys(PHASES, 0.0)
        return f"time (ms) per step, mean of {steps} | " + " | ".join(
            f"{name}: {ms:.2f}" for name, ms in per_step.items())
