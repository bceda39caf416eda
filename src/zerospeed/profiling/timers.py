"""``wall_clock_breakdown``: where the training time goes, under DeepSpeed 0.19.6's timer names.

As DeepSpeed's switch, it times every micro-batch's forward and backward, the backward's two parts
(``backward_inner``: autograd through the model; ``backward_allreduce``: the engine waiting on the
gradient reduction, at the end of backward and when the window's reduced gradients are collected at
the step) and every step. The engine logs, every ``steps_per_print`` optimizer steps, DeepSpeed's two
lines: the ``*_microstep`` timers as a mean per micro-batch and the global ones (``fwd``, ``bwd``,
``bwd_inner``, ``bwd_allreduce``, ``step``) as a mean per optimizer step, in milliseconds; and with a
monitor it writes each optimizer step's times as ``Train/Samples/elapsed_time_ms_*`` events. On an
accelerator each phase is bracketed by a device synchronize, so the times are the device's, not the
kernel launches' (which costs overlap: the switch is off by default). Without the switch the engine
holds :class:`NoTimers`, whose phases are one shared null context.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, ContextManager, Iterator, Protocol

PHASES = ("forward", "backward", "backward_inner", "backward_allreduce", "step")
# DeepSpeed's timer names (deepspeed/utils/timer.py): per optimizer step, and per micro-batch.
GLOBAL_NAMES = {"forward": "fwd", "backward": "bwd", "backward_inner": "bwd_inner",
                "backward_allreduce": "bwd_allreduce", "step": "step"}
MICRO_NAMES = {phase: f"{name}_microstep" for phase, name in GLOBAL_NAMES.items()}


class PhaseTimers(Protocol):
    """What the engine asks of its timers: bracket a phase, each optimizer step's times, and the
    report lines of a print interval."""

    def phase(self, name: str) -> ContextManager[None]: ...

    def window_ms(self) -> dict[str, float] | None: ...

    def report(self, steps: int, micro_steps: int | None = None) -> str | None: ...


class NoTimers:
    """``wall_clock_breakdown`` off: no timing, no synchronization, no report."""

    def __init__(self) -> None:
        self._null: ContextManager[None] = contextlib.nullcontext()  # reusable: one object for every phase

    def phase(self, name: str) -> ContextManager[None]:
        return self._null

    def window_ms(self) -> dict[str, float] | None:
        return None

    def report(self, steps: int, micro_steps: int | None = None) -> str | None:
        return None


class WallClockTimers:
    """Sums each phase's wall time, both since the last report and since the last optimizer step."""

    def __init__(self, *, synchronize: Callable[[], None], clock: Callable[[], float] = time.perf_counter):
        self._synchronize = synchronize
        self._clock = clock
        self._totals = dict.fromkeys(PHASES, 0.0)  # seconds since the last report
        self._window = dict.fromkeys(PHASES, 0.0)  # seconds since the last window_ms()

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
            elapsed = self._clock() - start
            self._totals[name] += elapsed
            self._window[name] += elapsed

    def totals(self) -> dict[str, float]:
        """Seconds per phase since the last report."""
        return dict(self._totals)

    def window_ms(self) -> dict[str, float]:
        """Milliseconds per phase since the last call (called once per optimizer step: that step's
        window, as DeepSpeed's global timers between two boundaries)."""
        out = {name: 1000.0 * seconds for name, seconds in self._window.items()}
        self._window = dict.fromkeys(PHASES, 0.0)
        return out

    def report(self, steps: int, micro_steps: int | None = None) -> str:
        """DeepSpeed's two lines over the last ``steps`` optimizer steps (``micro_steps`` micro-batches,
        default ``steps``): ``*_microstep`` as mean milliseconds per micro-batch, then the global
        timers as mean milliseconds per optimizer step. Starts the next interval."""
        micro = micro_steps if micro_steps is not None else steps
        per_micro = " | ".join(f"{MICRO_NAMES[name]}: {1000.0 * total / max(micro, 1):.2f}"
                               for name, total in self._totals.items())
        per_step = " | ".join(f"{GLOBAL_NAMES[name]}: {1000.0 * total / max(steps, 1):.2f}"
                              for name, total in self._totals.items())
        self._totals = dict.fromkeys(PHASES, 0.0)
        return f"time (ms) | {per_micro}\ntime (ms) | {per_step}"
