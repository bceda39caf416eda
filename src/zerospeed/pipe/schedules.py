"""Pipeline schedules as pure data: per-stage instruction lists for one batch, built without processes.

Every schedule is written in two steps, so that only the first differs between schedules:
1. a *compute order* per stage, a sequence of ``(op, micro, chunk)`` with ``op`` one of ``F``, ``BW``
   (fused backward), ``B``, ``W`` -- this is where GPipe, 1F1B, interleaved 1F1B and ZB-H1 differ;
2. one expansion (``_expand``) adding loads, sends and receives around each computation by the rule in
   ``instructions.py`` (receive right before the consumer, non-blocking send right after the producer)
   and the batch end (``ReduceTiedGrads``, ``ReduceGrads``, ``OptimizerStep``).

Each schedule also declares ``in_flight_bound``: per stage, the most forwards whose (input-)backward has
not run, counted in chunk activations (one chunk is ``1/chunks`` of the stage's layers). The interpreter
sizes its activation buffers with it; the tests check the simulator's measurement against it.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .instructions import (BATCH_END, Backward, BackwardInput, BackwardWeight, Forward, Instruction,
                           LoadMicroBatch, RecvActivation, RecvGrad, SendActivation, SendGrad)

Op = tuple[str, int, int]  # (op code, micro-batch, chunk)


class ScheduleError(ValueError):
    """A schedule cannot be built for these arguments; the message names the value and the fix."""


@dataclass(frozen=True)
class Schedule:
    """One batch's instructions for every stage: ``programs[s]`` is what stage ``s`` executes, in order."""

    name: str
    stages: int
    micro_batches: int
    chunks: int
    programs: tuple[tuple[Instruction, ...], ...]
    in_flight_bound: tuple[int, ...]  # per stage, chunk activations awaiting their (input-)backward
    training: bool = True

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks


def _check(stages: int, micro_batches: int, chunks: int) -> None:
    for name, value in (("stages", stages), ("micro_batches", micro_batches), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name}={value!r}: expected an integer >= 1")


def _expand(ops: Iterator[Op] | list[Op], stage: int, stages: int, chunks: int,
            training: bool = True) -> tuple[Instruction, ...]:
    """Stage ``stage``'s compute order -> its instruction list (the one communication rule for all)."""
    last = stages * chunks - 1
    prev_peer, next_peer = (stage - 1) % stages, (stage + 1) % stages
    out: list[Instruction] = []
    for op, micro, chunk in ops:
        virtual = chunk * stages + stage
        if op == "F":
            if virtual > 0:
                out.append(RecvActivation(micro, chunk, prev_peer))
            if virtual in (0, last):
                out.append(LoadMicroBatch(micro, chunk))
            out.append(Forward(micro, chunk))
            if virtual < last:
                out.append(SendActivation(micro, chunk, next_peer))
        elif op in ("BW", "B"):
            if virtual < last:
                out.append(RecvGrad(micro, chunk, next_peer))
            out.append(Backward(micro, chunk) if op == "BW" else BackwardInput(micro, chunk))
            if virtual > 0:
                out.append(SendGrad(micro, chunk, prev_peer))
        elif op == "W":
            out.append(BackwardWeight(micro, chunk))
        else:  # pragma: no cover - compute orders are built in this module
            raise AssertionError(f"unknown op {op!r}")
    return tuple(out) + (BATCH_END if training else ())


def _build(name: str, stages: int, micro_batches: int, chunks: int,
           order: Callable[[int], list[Op]], bound: Callable[[int], int],
           training: bool = True) -> Schedule:
    programs = tuple(_expand(order(s), s, stages, chunks, training) for s in range(stages))
    return Schedule(name, stages, micro_batches, chunks, programs,
                    tuple(bound(s) for s in range(stages)), training)


def _single_chunk(name: str, chunks: int) -> None:
    if chunks != 1:
        raise ScheduleError(f"schedule {name!r} takes chunks=1, got chunks={chunks}: virtual stages need "
                            "schedule 'interleaved_1f1b'")


def gpipe(stages: int, micro_batches: int, chunks: int = 1) -> Schedule:
    """GPipe: all forwards, then all backwards in micro-batch order; holds all ``m`` activations."""
    _check(stages, micro_batches, chunks)
    _single_chunk("gpipe", chunks)
    m = micro_batches

    def order(s: int) -> list[Op]:
        return [("F", i, 0) for i in range(m)] + [("BW", i, 0) for i in range(m)]

    return _build("gpipe", stages, m, 1, order, lambda s: m)


def _one_f_one_b(s: int, p: int, m: int, split: bool) -> list[Op]:
    """Warm-up forwards, then F/B pairs, then the remaining backwards. Split (ZB-H1, as torch's ZB1P with one
    chunk): stage ``s`` runs its first ``s`` steady-state ``W`` late, each later ``W`` right after its
    ``B``, the rest at the end, so the later stages' ``W`` fill the cool-down bubble."""
    warm = min(p - 1 - s, m)
    ops: list[Op] = [("F", i, 0) for i in range(warm)]
    pending_w: list[int] = []
    backward = "B" if split else "BW"
    for k in range(m):  # k-th backward, paired with forward warm + k while there is one
        if warm + k < m:
            ops.append(("F", warm + k, 0))
        ops.append((backward, k, 0))
        if split:
            pending_w.append(k)
            if k >= s:
                ops.append(("W", pending_w.pop(0), 0))
    ops.extend(("W", i, 0) for i in pending_w)
    return ops


def one_f_one_b(stages: int, micro_batches: int, chunks: int = 1) -> Schedule:
    """DeepSpeed's synchronous 1F1B: ``min(p-1-s, m)`` warm-up forwards, steady one-forward-one-backward,
    cool-down backwards; stage ``s`` holds at most ``min(p-s, m)`` activations."""
    _check(stages, micro_batches, chunks)
    _single_chunk("1f1b", chunks)
    p, m = stages, micro_batches
    return _build("1f1b", p, m, 1, lambda s: _one_f_one_b(s, p, m, False), lambda s: min(p - s, m))


def zero_bubble_h1(stages: int, micro_batches: int, chunks: int = 1) -> Schedule:
    """ZB-H1 (Qi et al., 2023): 1F1B's order with the backward split into ``B`` (input gradient, on the
    critical path) and ``W`` (weight gradient, deferred by ``s`` steps on stage ``s``). The forwards
    awaiting ``B`` stay 1F1B's ``min(p-s, m)``; those awaiting ``W`` stay within 1F1B's peak ``p``."""
    _check(stages, micro_batches, chunks)
    _single_chunk("zb_h1", chunks)
    p, m = stages, micro_batches
    return _build("zb_h1", p, m, 1, lambda s: _one_f_one_b(s, p, m, True), lambda s: min(p - s, m))


def _interleaved_op(k: int, p: int, v: int, forward: bool) -> tuple[int, int]:
    """Megatron's mapping of a stage's k-th forward (or backward) to (micro-batch, chunk): groups of ``p``
    micro-batches go through chunk 0, 1, ... (backwards: chunk v-1 first) before the next group starts."""
    in_group = k % (p * v)
    chunk = in_group // p
    return (k // (p * v)) * p + k % p, chunk if forward else v - 1 - chunk


def interleaved_warmup(stage: int, stages: int, micro_batches: int, chunks: int) -> int:
    """Megatron's warm-up forwards for interleaved 1F1B: ``2 (p-s-1) + (v-1) p``, at most ``v m``."""
    return min(2 * (stages - stage - 1) + (chunks - 1) * stages, chunks * micro_batches)


def interleaved_1f1b(stages: int, micro_batches: int, chunks: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B: stage ``s`` holds chunks (virtual stages) ``s, s+p, ...``; a chunk costs
    ``1/v`` of the stage, so the bubble shrinks about ``v``-fold. Needs ``m`` divisible by ``p``."""
    _check(stages, micro_batches, chunks)
    p, m, v = stages, micro_batches, chunks
    if p < 2:
        raise ScheduleError(f"interleaved_1f1b needs stages >= 2, got stages={p}: use schedule '1f1b'")
    if m % p:
        lower, upper = m - m % p, m - m % p + p
        hint = f"{lower} or {upper}" if lower else f"{upper}"
        raise ScheduleError(f"interleaved_1f1b needs micro_batches divisible by stages={p}, got "
                            f"micro_batches={m}: use {hint} micro-batches (gradient_accumulation_steps), "
                            "or schedule '1f1b'")
    total = v * m

    def order(s: int) -> list[Op]:
        warm = interleaved_warmup(s, p, m, v)
        ops: list[Op] = [("F", *_interleaved_op(k, p, v, True)) for k in range(warm)]
        for k in range(total - warm):
            ops.append(("F", *_interleaved_op(warm + k, p, v, True)))
            ops.append(("BW", *_interleaved_op(k, p, v, False)))
        ops.extend(("BW", *_interleaved_op(k, p, v, False)) for k in range(total - warm, total))
        return ops

    def bound(s: int) -> int:
        warm = interleaved_warmup(s, p, m, v)
        return warm + 1 if warm < total else total

    return _build("interleaved_1f1b", p, m, v, order, bound)


def inference(stages: int, micro_batches: int, chunks: int = 1) -> Schedule:
    """Evaluation: forwards only, micro-batch by micro-batch (with chunks, in Megatron's interleaved
    order); no backward, no batch end. Activations are not kept, so the bound is 0."""
    _check(stages, micro_batches, chunks)
    p, m, v = stages, micro_batches, chunks
    if v > 1 and m % p:
        raise ScheduleError(f"inference with chunks={v} needs micro_batches divisible by stages={p}, "
                            f"got micro_batches={m}")

    def order(s: int) -> list[Op]:
        return [("F", *_interleaved_op(k, p, v, True)) for k in range(v * m)]

    return _build("inference", p, m, v, order, lambda s: 0, training=False)


ScheduleFactory = Callable[[int, int, int], Schedule]
SCHEDULES: dict[str, ScheduleFactory] = {
    "1f1b": one_f_one_b,
    "gpipe": gpipe,
    "interleaved_1f1b": interleaved_1f1b,
    "zb_h1": zero_bubble_h1,
}
DEFAULT_SCHEDULE = "1f1b"


def schedule_for(name: str, *, stages: int, micro_batches: int, chunks: int | None = None) -> Schedule:
    """The training schedule registered as ``name`` (``pipeline.schedule``); ``chunks`` defaults to 2 for
    interleaved_1f1b and 1 otherwise. Unknown names are refused with the closest known one."""
    factory = SCHEDULES.get(name)
    if factory is None:
        close = difflib.get_close_matches(str(name), list(SCHEDULES), n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}?" if close else "known schedules: " + ", ".join(sorted(SCHEDULES))
        raise ScheduleError(f"unknown pipeline schedule {name!r}; {hint}")
    if chunks is None:
        chunks = 2 if name == "interleaved_1f1b" else 1
    return factory(stages, micro_batches, chunks)
