"""The offloaded optimizer step, overlapped with backward: sub-groups step as their gradients become final.

On the last micro-batch of a window, a unit's gradient shard is final once its reduction has
completed (noticed when the next unit's reduction is launched, or at the end of backward). When
nothing global has to be known before the update — no clipping (the global norm), no fp16 loss
scaling and no check for non-finite gradients (every gradient must be seen before a step may be
skipped), and an elementwise optimizer (not Lamb, whose trust ratio needs whole-parameter norms) —
this rank's pieces of those units can be updated right away, on a worker thread, while backward goes
on with earlier layers. Units are collected into sub-groups of about ``sub_group_size`` shard elements (DeepSpeed's
knob) and each sub-group is one job; ``engine.step()`` waits for the jobs, steps whatever is left
and publishes.

The update is therefore committed when the window's last backward ends, and ``engine.step()`` only
finishes it: a learning rate changed between that backward and ``step()`` reaches only the units not
yet stepped (change it before the backward, or let the LR scheduler do it after ``step()``); a second
backward on that micro-batch is refused; a window abandoned after it (``zero_grad()`` without
``step()``) keeps the early updates, with a warning. Whatever reads or writes the masters or optimizer
states in between (``safe_get_full_*``, checkpoints) first waits for the running jobs.

A unit whose shard *is* what the model computes with (a persistent unit whose master is the shard
itself) is never updated early: its values may still be read by the rest of backward. The
low-precision copy of an early-updated unit is written in the same pass only where the shard is
separate from the computed parameters (stage 3); otherwise ``step()`` copies it when publishing.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from zerospeed.zero.optimizer import ZeroOptimizer


@dataclass(frozen=True)
class StepOverlap:
    """Whether the optimizer step may overlap backward, and why (or why not)."""

    enabled: bool
    sub_group_elems: int
    reason: str

    @classmethod
    def decide(cls, *, offloaded: bool, clipping: float, loss_scaled: bool, overflow_checked: bool,
               sub_group_size: int, swapped: bool = False) -> "StepOverlap":
        """``swapped``: the optimizer state is on NVMe (streamed through memory at ``step()``)."""
        elems = max(int(sub_group_size), 1)
        if swapped:
            return cls(False, elems, "the NVMe tier streams each unit's state through memory at step() (read "
                                     "ahead, written behind)")
        if not offloaded:
            return cls(False, elems, "the optimizer is not offloaded (it steps after backward)")
        if clipping > 0:
            return cls(False, elems, f"gradient_clipping={clipping} needs the global gradient norm before any "
                                     f"update, so the step runs after backward")
        if loss_scaled:
            return cls(False, elems, "fp16 loss scaling must unscale and check every gradient before a step may "
                                     "be applied or skipped, so the step runs after backward")
        if overflow_checked:
            return cls(False, elems, "skipping a step whose gradients are not finite (bf16.check_grad_overflow in "
                                     "bf16, skipped_steps.check_fp32 in fp32; both on by default) must see every "
                                     "gradient before a step may be applied or skipped; set it to false to overlap "
                                     "the step")
        return cls(True, elems, f"sub-groups of {elems:,} elements step while backward runs")

    def without(self, reason: str) -> "StepOverlap":
        return replace(self, enabled=False, reason=reason)


class EagerSteps:
    """Runs sub-group steps of a :class:`ZeroOptimizer` on one worker thread during backward."""

    def __init__(self, optimizer: "ZeroOptimizer", overlap: StepOverlap,
                 grad_of: Callable[[int], torch.Tensor]):
        """``grad_of(u)``: unit ``u``'s final gradient shard."""
        self.optimizer = optimizer
        self.overlap = overlap
        self.grad_of = grad_of
        self.eligible = optimizer.may_step_early()
        self._pending: list[int] = []
        self._pending_elems = 0
        self._jobs: list[Future] = []
        self._executor: ThreadPoolExecutor | None = None
        self.stepped: set[int] = set()  # units updated early in this window
        self.copied: set[int] = set()  # ...whose low-precision shard was written in the same pass
        self.spans: list[tuple[float, float]] = []  # (start, end) of this window's jobs (perf_counter)
        self.jobs_run = 0  # sub-group jobs started, over the run (for tests and reports)
        self.jobs_during_backward = 0  # ...of which were started before backward ended

    def ready(self, unit_index: int) -> None:
        """Unit ``unit_index``'s gradient shard is final for this window."""
        if not self.overlap.enabled or not self.eligible[unit_index] or unit_index in self.stepped:
            return
        self._pending.append(unit_index)
        self._pending_elems += self.optimizer.units[unit_index].plan.shard_numel
        if self._pending_elems >= self.overlap.sub_group_elems:
            self.flush()

    def flush(self, during_backward: bool = True) -> None:
        """Start the pending units as one sub-group (at the end of backward: whatever is left)."""
        if not self._pending:
            return
        units, self._pending, self._pending_elems = self._pending, [], 0
        grads = {u: self.grad_of(u) for u in units}
        copy_out = self.optimizer.copy_out_targets(units, early=True)
        self.stepped.update(units)
        self.copied.update(copy_out or {})
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerospeed-eager-step")
        self._jobs.append(self._executor.submit(self._job, units, grads, copy_out))
        self.jobs_run += 1
        self.jobs_during_backward += int(during_backward)

    def _job(self, units: list[int], grads: dict[int, torch.Tensor],
             copy_out: dict[int, dict[int, torch.Tensor]] | None) -> None:
        start = time.perf_counter()
        try:
            self.optimizer.step_units(units, grads, copy_out)
        finally:
            self.spans.append((start, time.perf_counter()))

    def wait(self) -> None:
        """Let the running jobs finish (their errors are raised by :meth:`drain`)."""
        for job in self._jobs:
            job.exception()

    def drain(self) -> tuple[set[int], set[int]]:
        """Wait for every job of this window; ``(units stepped, units whose shard was written)``.
        A job's error is raised here, after all jobs have ended."""
        self._pending, self._pending_elems = [], 0
        jobs, self._jobs = self._jobs, []
        errors = []
        for job in jobs:
            try:
                job.result()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, once every job ended
                errors.append(exc)
        stepped, copied = self.stepped, self.copied
        self.stepped, self.copied = set(), set()
        if errors:
            raise errors[0]
        return stepped, copied

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
