"""What the engine writes to its monitors at each optimizer step (applied or skipped for overflow).

DeepSpeed 0.19.6's events, at x = ``global_samples`` after the step:

- ``Train/Samples/train_loss``: the window's loss, the mean of its micro-batch losses averaged over
  the data-parallel ranks (as DeepSpeed's pipeline engine writes it; one 1-element all-reduce per
  step, only when a monitor is enabled, and none for the pipeline engine, whose batch loss already is);
- ``Train/Samples/lr``: the first parameter group's learning rate after the step (and its schedule);
- ``Train/Samples/loss_scale``: with fp16 only;
- with ``wall_clock_breakdown``: ``Train/Samples/elapsed_time_ms_{forward,backward,backward_inner,
  backward_allreduce,step}``, the step's window in milliseconds (summed over its micro-batches).

zerospeed's own (see docs/monitor.md): ``Train/Samples/samples_per_sec`` (``train_batch_size`` over
the wall time since the previous optimizer step, or since ``initialize`` for the first) and
``Train/Samples/memory_total_bytes`` (``engine.memory_breakdown()["total"]``: this rank's model-state
bytes, rank 0's).
"""

from __future__ import annotations

import math
import time
from typing import Callable, Protocol

import torch

from zerospeed.distributed.comm import Comm
from zerospeed.monitor.base import Event
from zerospeed.monitor.monitor import MonitorMaster
from zerospeed.profiling.timers import PHASES, PhaseTimers

PREFIX = "Train/Samples/"
TRAIN_LOSS = PREFIX + "train_loss"
LR = PREFIX + "lr"
LOSS_SCALE = PREFIX + "loss_scale"
ELAPSED = {phase: f"{PREFIX}elapsed_time_ms_{phase}" for phase in PHASES}
SAMPLES_PER_SEC = PREFIX + "samples_per_sec"
MEMORY_TOTAL = PREFIX + "memory_total_bytes"


class SteppedEngine(Protocol):
    """What the events read of an engine after its step."""

    global_samples: int
    timers: PhaseTimers

    def get_lr(self) -> list[float]: ...

    def train_batch_size(self) -> int: ...

    def memory_breakdown(self) -> dict[str, int]: ...

    @property
    def cur_scale(self) -> float: ...


class StepEvents:
    """Collects the window's losses and writes the step's events to ``master`` (rank 0 writes; every
    rank takes part in the loss average).

    ``comm``: the ranks the window's loss is averaged over; ``None`` when the engine's losses are
    already averaged over them (the pipeline engine's batch loss), so no collective is repeated."""

    def __init__(self, master: MonitorMaster, *, comm: Comm | None, fp16: bool,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.master = master
        self._comm = comm
        self._fp16 = fp16
        self._clock = clock
        self._losses: list[torch.Tensor] = []
        self._last = clock()

    @property
    def averaged_over(self) -> Comm | None:
        """The ranks the window's loss is averaged over (None: the engine's losses already are)."""
        return self._comm

    def add_loss(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss, as given to backward (kept as a tensor: no device sync here)."""
        self._losses.append(loss.detach().reshape(()))

    def window_loss(self) -> float:
        """The window's mean loss averaged over the data-parallel ranks (NaN when no loss was given);
        collective over ``comm`` unless it is None."""
        if self._losses:
            mean = torch.stack([t.float() for t in self._losses]).mean().reshape(1)
        else:
            mean = torch.full((1,), math.nan)
        self._losses = []
        if self._comm is not None and self._comm.world_size > 1:
            self._comm.all_reduce(mean, op="avg")
        return float(mean[0])

    def after_step(self, engine: SteppedEngine) -> list[Event]:
        """Write this optimizer step's events (every rank calls it); returns them."""
        loss = self.window_loss()
        now = self._clock()
        seconds, self._last = now - self._last, now
        x = engine.global_samples
        events: list[Event] = [(TRAIN_LOSS, loss, x), (LR, engine.get_lr()[0], x)]
        if self._fp16:
            events.append((LOSS_SCALE, engine.cur_scale, x))
        elapsed = engine.timers.window_ms()
        if elapsed is not None:
            events += [(ELAPSED[phase], elapsed[phase], x) for phase in PHASES]
        events.append((SAMPLES_PER_SEC, engine.train_batch_size() / max(seconds, 1e-9), x))
        events.append((MEMORY_TOTAL, engine.memory_breakdown()["total"], x))
        self.master.write_events(events)
        return events


class NoStepEvents:
    """No monitor enabled: the engine's calls cost nothing (``master`` still answers ``write_events``)."""

    def __init__(self) -> None:
        self.master = MonitorMaster()

    def add_loss(self, loss: torch.Tensor) -> None:
        pass

    def after_step(self, engine: SteppedEngine) -> list[Event]:
        return []


def step_events(master: MonitorMaster, *, comm: Comm | None, fp16: bool) -> StepEvents | NoStepEvents:
    """The engine's collaborator: events when any monitor is enabled, nothing otherwise (``comm``: see
    :class:`StepEvents`)."""
    return StepEvents(master, comm=comm, fp16=fp16) if master.enabled else NoStepEvents()


__all__ = ["ELAPSED", "LOSS_SCALE", "LR", "MEMORY_TOTAL", "NoStepEvents", "SAMPLES_PER_SEC", "StepEvents",
           "SteppedEngine", "TRAIN_LOSS", "step_events"]
