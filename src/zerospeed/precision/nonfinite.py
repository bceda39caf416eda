"""Steps whose gradients are not finite: why, what happens, and what is said about it.

The engine measures the global gradient norm at every step anyway (for clipping); it is summed over
every rank, so one rank's inf or nan makes it non-finite everywhere, and every rank takes the same
decision without another collective. Checking ``math.isfinite`` on that one number costs nothing.

What happens to such a step (the precision policy's ``check_overflow``): it is *skipped* — no
optimizer update, no LR-scheduler step, gradients dropped, the step still counted in ``global_steps``
and in ``skipped_steps`` (DeepSpeed's fp16 rule) — in fp16 always, in bf16 unless
``bf16.check_grad_overflow`` is false, in fp32 unless ``skipped_steps.check_fp32`` is false. Where the
switch is off the step is applied (DeepSpeed's behaviour) but still reported.

What is said (:class:`NonFiniteSteps`, one per engine), on rank 0 — and on a rank whose own loss was
not finite, so the rank with the bad data names itself — as ``WARNING`` on the ``zerospeed`` logger:

* each of the first :attr:`NonFinitePolicy.log_first` (5) non-finite steps of the run gets its own
  line: the step, the reason, the gradient norm and the loss scale (before -> after for fp16);
* after that, one summary line when :attr:`NonFinitePolicy.summary_every` (100) more have happened
  since the last line, or when a non-finite step comes :attr:`NonFinitePolicy.summary_seconds` (60 s)
  or more after the last line (so an isolated one late in a run is always reported): how many, the
  step range, the count per reason, and the last one's details;
* and a burst that ended unreported (say 40 within a minute, then finite steps) is summarized at the
  first finite step :attr:`NonFinitePolicy.summary_seconds` or more after the last line
  (:meth:`NonFiniteSteps.clean_step`): every non-finite step is told within about that time, and
  intermittent ones still make at most one line per interval.

The reasons (:class:`Reason`): ``NaN loss`` / ``inf loss`` when this rank's loss in the window was not
finite; else in fp16 ``overflow`` (the scaled gradients overflowed: the loss scale drops); else
``NaN gradient`` / ``inf gradient`` from the norm. A NaN loss on another rank shows on rank 0 as a NaN
gradient; that rank's own line names the loss.

``skipped_steps.raise_after_consecutive = K`` (> 0) raises :class:`NonFiniteStepsError` at the K-th
consecutive non-finite step, on every rank at the same step.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass
from enum import Enum
from typing import Callable


class NonFiniteStepsError(RuntimeError):
    """``skipped_steps.raise_after_consecutive`` steps in a row had a non-finite gradient norm."""


class Reason(str, Enum):
    """Why a step's gradients were not finite (as rank-local as the loss, as global as the norm)."""

    OVERFLOW = "overflow"
    NAN_LOSS = "NaN loss"
    INF_LOSS = "inf loss"
    NAN_GRADIENT = "NaN gradient"
    INF_GRADIENT = "inf gradient"


def classify(norm: float, *, loss: float, loss_scaled: bool) -> Reason:
    """The reason for a non-finite ``norm``: this rank's window ``loss`` (a sum; nan or inf when any
    of its micro-batch losses was), else ``overflow`` under fp16 loss scaling, else the norm's kind."""
    if math.isnan(loss):
        return Reason.NAN_LOSS
    if math.isinf(loss):
        return Reason.INF_LOSS
    if loss_scaled:
        return Reason.OVERFLOW
    return Reason.NAN_GRADIENT if math.isnan(norm) else Reason.INF_GRADIENT


@dataclass(frozen=True)
class NonFinitePolicy:
    """How non-finite steps are reported and when they stop the run (the skip itself is the precision
    policy's ``check_overflow``).

    ``switch``: the config key that turns skipping off, named in messages (empty for fp16, which always
    skips). ``raise_after_consecutive``: raise at this many non-finite steps in a row, 0 never. The
    rate limit: the first ``log_first`` get a line each, then one summary per ``summary_every`` of them
    or per ``summary_seconds`` (checked when one happens)."""

    switch: str = ""
    raise_after_consecutive: int = 0
    log_first: int = 5
    summary_every: int = 100
    summary_seconds: float = 60.0


@dataclass(frozen=True)
class NonFiniteStep:
    """One step with a non-finite global gradient norm."""

    step: int  # the optimizer step's number (global_steps once counted)
    reason: Reason
    norm: float
    loss_scale: float  # the scale the step ran at
    next_scale: float  # the scale after the scaler's update (fp16 dynamic: lower)
    skipped: bool  # False where the precision's switch is off and the step was applied

    def describe(self) -> str:
        scale = (f"loss scale {self.loss_scale:g}" if self.next_scale == self.loss_scale
                 else f"loss scale {self.loss_scale:g} -> {self.next_scale:g}")
        return f"{self.reason.value} (gradient norm {self.norm}, {scale})"


class NonFiniteSteps:
    """The run's non-finite steps: counts, the rate-limited warning lines, and the raise (one per
    engine; rank-local state, but every rank records the same steps, so the raise is agreed)."""

    def __init__(self, policy: NonFinitePolicy, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._clock = clock
        self.total = 0  # non-finite steps in the run (skipped or applied)
        self.consecutive = 0
        self._run_reasons: Counter[Reason] = Counter()  # ...of the current run of consecutive ones
        self._run_first = 0
        self._pending: list[NonFiniteStep] = []  # since the last line
        self._last_line = -math.inf

    def clean_step(self) -> str | None:
        """A step with a finite norm ends a run of consecutive non-finite steps. Returns the summary of the
        non-finite steps not yet reported, once :attr:`NonFinitePolicy.summary_seconds` have passed since
        the last line (the log's rate), for the engine to log now: without it a burst that ended between two
        summaries would never be told, as only a later non-finite step would report it."""
        self.restart_run()
        if not self._pending or self._clock() - self._last_line < self.policy.summary_seconds:
            return None
        return self.flush()

    def flush(self) -> str | None:
        """The summary of the non-finite steps not yet reported, whatever the rate (the run is ending, so
        no later line would tell them), or None when every one was reported."""
        if not self._pending:
            return None
        self._last_line = self._clock()
        pending, self._pending = self._pending, []
        return self._line(pending[0]) if len(pending) == 1 else self._summary(pending)

    def restart_run(self) -> None:
        """Start counting consecutive non-finite steps afresh (a finite step; a resume from a checkpoint,
        whose steps are not the ones before it), for ``raise_after_consecutive``."""
        self.consecutive = 0
        self._run_reasons.clear()

    @property
    def last_unreported(self) -> NonFiniteStep | None:
        """The latest non-finite step no line has reported yet (what :meth:`clean_step` would summarize)."""
        return self._pending[-1] if self._pending else None

    def record(self, event: NonFiniteStep) -> str | None:
        """Count ``event``; the warning line to log now (None: rate-limited). Raises
        :class:`NonFiniteStepsError` when it completes ``raise_after_consecutive`` in a row."""
        self.total += 1
        if self.consecutive == 0:
            self._run_first = event.step
        self.consecutive += 1
        self._run_reasons[event.reason] += 1
        self._pending.append(event)
        limit = self.policy.raise_after_consecutive
        if limit and self.consecutive >= limit:
            raise NonFiniteStepsError(self._error(event, limit))
        now = self._clock()
        if not (self.total <= self.policy.log_first or len(self._pending) >= self.policy.summary_every
                or now - self._last_line >= self.policy.summary_seconds):
            return None
        self._last_line = now
        pending, self._pending = self._pending, []
        return self._line(event) if len(pending) == 1 else self._summary(pending)

    def _line(self, event: NonFiniteStep) -> str:
        tail = f"{self._run()}, {self.total} in the run"
        if not event.skipped:
            return (f"step {event.step} was applied with {event.describe()} because {self.policy.switch} is "
                    f"false: parameters and optimizer state may now hold NaN/inf ({tail})")
        return f"step {event.step} skipped: {event.describe()}; {tail}{self._limit_note()}"

    def _summary(self, pending: list[NonFiniteStep]) -> str:
        counts = Counter(e.reason for e in pending)
        skipped = sum(e.skipped for e in pending)
        what = "skipped" if skipped == len(pending) else f"non-finite ({skipped} skipped)"
        per_reason = ", ".join(f"{n} {reason.value}" for reason, n in counts.most_common())
        last = pending[-1]
        return (f"{len(pending)} steps {what} since the last report, steps {pending[0].step}-{last.step} "
                f"({per_reason}); the last, step {last.step}: {last.describe()}; {self._run()}, "
                f"{self.total} in the run (after the first {self.policy.log_first} these are summarized every "
                f"{self.policy.summary_every} steps or {self.policy.summary_seconds:g} s){self._limit_note()}")

    def _run(self) -> str:
        """The current run of consecutive non-finite steps (none: a finite step came since the last one)."""
        return f"{self.consecutive} in a row" if self.consecutive else "finite steps since"

    def _limit_note(self) -> str:
        limit = self.policy.raise_after_consecutive
        return f"; skipped_steps.raise_after_consecutive = {limit} stops the run" if limit else ""

    def _error(self, event: NonFiniteStep, limit: int) -> str:
        per_reason = ", ".join(f"{n} {reason.value}" for reason, n in self._run_reasons.most_common())
        return (f"skipped_steps.raise_after_consecutive = {limit}: {self.consecutive} steps in a row had a "
                f"non-finite gradient norm, steps {self._run_first}-{event.step} ({per_reason}); the last, step "
                f"{event.step}: {event.describe()}. Look for NaN/inf in the data or the model starting at step "
                f"{self._run_first} (a lower learning rate or gradient_clipping may help), or raise "
                f"skipped_steps.raise_after_consecutive (0 never raises)")


__all__ = ["NonFinitePolicy", "NonFiniteStep", "NonFiniteSteps", "NonFiniteStepsError", "Reason", "classify"]
