"""The ``flops_profiler`` config section inside training: the engine brackets its forward, backward and
step with a :class:`StepProfiler`, which profiles the step ``profile_step`` (DeepSpeed: the forward at
``global_steps == profile_step`` starts the profile, the following ``step()`` prints and ends it).

Unlike DeepSpeed, every rank profiles that step (not only rank 0), so the totals can be summed over the
model-parallel ranks (one all-reduce per model-parallel Comm) before global rank 0 prints them; the
backward between forward and step is counted as it runs. Only the first micro-batch of the step is
profiled (DeepSpeed would restart and print again on each micro-batch of that step).
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, ContextManager, Iterator, Protocol, Sequence

from torch import nn

from zerospeed.lifecycle import Transitions
from zerospeed.profiling.flops_profiler.profiler import FlopsProfiler, ModelTotals, device_synchronize
from zerospeed.profiling.flops_profiler.report import RunFacts
from zerospeed.profiling.timers import WallClockTimers

if TYPE_CHECKING:
    from zerospeed.distributed.comm import Comm


class StepProfiler(Protocol):
    """What the engine asks: bracket each forward, backward and step (``global_steps`` before the step)."""

    def forward(self, global_steps: int) -> ContextManager[None]: ...

    def backward(self) -> ContextManager[None]: ...

    def step(self, global_steps: int) -> ContextManager[None]: ...


class NoFlopsProfiler:
    """``flops_profiler`` off: the brackets cost nothing."""

    def forward(self, global_steps: int) -> ContextManager[None]:
        return contextlib.nullcontext()

    def backward(self) -> ContextManager[None]:
        return contextlib.nullcontext()

    def step(self, global_steps: int) -> ContextManager[None]:
        return contextlib.nullcontext()


@dataclass(frozen=True)
class ProfileSettings:
    """The ``flops_profiler`` section as plain values."""

    profile_step: int = 1
    module_depth: int = -1
    top_modules: int = 1
    detailed: bool = True
    output_file: str | None = None


class ProfilePhase(enum.Enum):
    WAITING = "waiting for profile_step"
    RUNNING = "profiling"
    DONE = "done"


_PHASES = Transitions({ProfilePhase.WAITING: frozenset({ProfilePhase.RUNNING}),
                       ProfilePhase.RUNNING: frozenset({ProfilePhase.DONE})})


class EngineFlopsProfiler(FlopsProfiler):
    """A :class:`FlopsProfiler` run by the engine at ``settings.profile_step`` (``engine.flops_profiler``).

    ``across``: the model-parallel Comms the totals are summed over; ``counted_elsewhere``: parameter
    names another rank counts (replicated over tensor parallelism, tied across pipeline stages);
    ``prints``: whether this rank prints (global rank 0). After the step, :attr:`last_profile` holds
    this rank's totals and :attr:`model_profile` the sums over ``across``."""

    def __init__(self, model: nn.Module, *, settings: ProfileSettings, facts: RunFacts, across: Sequence["Comm"] = (),
                 counted_elsewhere: frozenset[str] = frozenset(), prints: bool = True,
                 recompute_fwd_factor: float = 0.0):
        super().__init__(model, None, recompute_fwd_factor)
        self.settings = settings
        self.facts = facts
        self.across = tuple(across)
        self.counted_elsewhere = counted_elsewhere
        self.prints = prints
        self.phase = ProfilePhase.WAITING
        self.last_profile: ModelTotals | None = None
        self.model_profile: ModelTotals | None = None
        self._timers = WallClockTimers(synchronize=device_synchronize())

    def _facts(self) -> RunFacts:
        return self.facts

    def _move(self, new: ProfilePhase) -> None:
        self.phase = _PHASES.check("the flops profiler", self.phase, new)

    def _timed(self, name: str) -> ContextManager[None]:
        """The phase timed while profiling (device-synchronized), nothing otherwise."""
        return self._timers.phase(name) if self.phase is ProfilePhase.RUNNING else contextlib.nullcontext()

    @contextlib.contextmanager
    def forward(self, global_steps: int) -> Iterator[None]:
        if self.phase is ProfilePhase.WAITING and global_steps == self.settings.profile_step:
            self._move(ProfilePhase.RUNNING)
            self.start_profile()
        if self.phase is not ProfilePhase.RUNNING:
            yield
            return
        with self._timed("forward"), self.charging_the_model():
            yield

    def backward(self) -> ContextManager[None]:
        return self._timed("backward")

    @contextlib.contextmanager
    def step(self, global_steps: int) -> Iterator[None]:
        timed = self.phase is ProfilePhase.RUNNING
        with self._timed("step"):
            yield
        if self.phase is ProfilePhase.RUNNING:
            self._finish(step_timed=timed)

    def _finish(self, *, step_timed: bool) -> None:
        """Stop counting, sum over the model-parallel ranks (collective), print on one rank, forget."""
        self.stop_profile()
        self.last_profile = self.totals()
        self.model_profile = self.sum_over(self.across, self.counted_elsewhere)
        if self.prints:
            latency = self._timers.totals()
            # a pipeline runs its whole batch inside the forward bracket: no separate backward or step time
            bwd = latency["backward"] if latency["backward"] > 0 else None
            summary = self.summary(self.model_profile, fwd_latency=latency["forward"], bwd_latency=bwd,
                                   step_latency=latency["step"] if step_timed and bwd is not None else None)
            s = self.settings
            self.print_model_profile(profile_step=s.profile_step, module_depth=s.module_depth,
                                     top_modules=s.top_modules, detailed=s.detailed, output_file=s.output_file,
                                     summary=summary)
        self.end_profile()
        self._move(ProfilePhase.DONE)


__all__ = ["StepProfiler", "NoFlopsProfiler", "ProfileSettings", "ProfilePhase", "EngineFlopsProfiler"]
