"""A pure discrete-event simulator of a ``Schedule``: all stages' instruction lists run together.

Why: a schedule is only worth having if it cannot hang and keeps its bubble and memory promises; this
checks both without processes. Semantics are the interpreter's contract (``instructions.py``): sends are
non-blocking and arrive ``comm`` later, receives block until the matching message is at the head of its
``(sender, receiver, kind)`` channel, ``ReduceTiedGrads`` is a barrier of all stages. Each stage has its own
clock; a message carries its arrival time, so timings do not depend on the order stages are visited.

Cost model: ``Costs`` gives one stage's full share of the model (all its chunks): a chunk's forward costs
``forward / chunks``, likewise ``B`` and ``W``; a fused ``Backward`` costs ``B + W``. Loads, sends and
batch-end instructions take no compute time. Exact arithmetic (``Fraction``) makes exact theories testable.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from fractions import Fraction

from .instructions import (Backward, BackwardInput, BackwardWeight, Forward, Instruction, LoadMicroBatch,
                           OptimizerStep, RecvActivation, RecvGrad, ReduceGrads, ReduceTiedGrads,
                           SendActivation, SendGrad)
from .schedules import Schedule

Time = Fraction


class ScheduleViolation(AssertionError):
    """A schedule breaks a data dependency or a channel's order; the message names stage and instruction."""


class Deadlock(ScheduleViolation):
    """No stage can progress; the message lists each waiting stage and what it waits on."""


@dataclass(frozen=True)
class Costs:
    """Per-stage costs of one micro-batch (see the module's cost model); ``comm`` is the transfer latency."""

    forward: Fraction | int = 1
    backward_input: Fraction | int = 1
    backward_weight: Fraction | int = 1
    comm: Fraction | int = 0


@dataclass(frozen=True)
class SimResult:
    """Timings and memory of one simulated batch."""

    makespan: Time
    busy: tuple[Time, ...]  # per stage, compute time
    finish: tuple[Time, ...]  # per stage, when its last instruction ended
    max_in_flight: tuple[int, ...]  # per stage: chunk forwards whose Backward/BackwardInput had not run
    max_held: tuple[int, ...]  # per stage: chunk forwards whose weight gradient (W or fused) had not run

    def idle_share(self, stage: int) -> Fraction:
        return Fraction(self.makespan - self.busy[stage]) / self.makespan if self.makespan else Fraction(0)

    @property
    def bubble(self) -> Fraction:
        """Idle share of all stages' time: ``sum(idle) / (stages * makespan)``."""
        if not self.makespan:
            return Fraction(0)
        return Fraction(len(self.busy) * self.makespan - sum(self.busy)) / (len(self.busy) * self.makespan)


@dataclass
class _Stage:
    program: tuple[Instruction, ...]
    pc: int = 0
    clock: Time = Fraction(0)
    busy: Time = Fraction(0)
    done: set[tuple[str, int, int]] = field(default_factory=set)
    arrived: set[tuple[str, int, int]] = field(default_factory=set)
    in_flight: int = 0
    held: int = 0
    max_in_flight: int = 0
    max_held: int = 0

    @property
    def current(self) -> Instruction | None:
        return self.program[self.pc] if self.pc < len(self.program) else None


def simulate(schedule: Schedule, costs: Costs = Costs()) -> SimResult:
    """Run ``schedule`` under ``costs``; raise ``Deadlock``/``ScheduleViolation`` on a broken schedule."""
    return _Simulator(schedule, costs).run()


class _Simulator:
    def __init__(self, schedule: Schedule, costs: Costs) -> None:
        self.s = schedule
        v = Fraction(schedule.chunks)
        self.cost_f = Fraction(costs.forward) / v
        self.cost_b = Fraction(costs.backward_input) / v
        self.cost_w = Fraction(costs.backward_weight) / v
        self.comm = Fraction(costs.comm)
        self.stages = [_Stage(program) for program in schedule.programs]
        # (sender, receiver, kind) -> FIFO of (micro, destination virtual stage, arrival time)
        self.channels: dict[tuple[int, int, str], deque[tuple[int, int, Time]]] = {}

    def run(self) -> SimResult:
        while True:
            progressed = any([self._advance(i) for i in range(len(self.stages))])
            if all(st.current is None for st in self.stages):
                break
            if not progressed and not self._barrier():
                raise Deadlock(self._waiting())
        self._check_complete()
        finish = tuple(st.clock for st in self.stages)
        return SimResult(max(finish), tuple(st.busy for st in self.stages), finish,
                         tuple(st.max_in_flight for st in self.stages),
                         tuple(st.max_held for st in self.stages))

    def _advance(self, index: int) -> bool:
        st, moved = self.stages[index], False
        while (ins := st.current) is not None and not isinstance(ins, ReduceTiedGrads):
            if not self._execute(index, st, ins):
                break
            st.pc += 1
            moved = True
        return moved

    def _barrier(self) -> bool:
        """Release ``ReduceTiedGrads`` once every unfinished stage waits at it."""
        waiting = [st for st in self.stages if st.current is not None]
        if not waiting or not all(isinstance(st.current, ReduceTiedGrads) for st in waiting):
            return False
        if len(waiting) != len(self.stages):
            return False  # a stage finished without reaching the barrier: the others would hang
        for i, st in enumerate(self.stages):
            self._require_grads_complete(i, st, st.program[st.pc])
        now = max(st.clock for st in self.stages)
        for st in self.stages:
            st.clock, st.pc = now, st.pc + 1
        return True

    def _fail(self, index: int, st: _Stage, ins: Instruction, why: str) -> ScheduleViolation:
        return ScheduleViolation(f"stage {index} instruction #{st.pc} {ins}: {why}")

    def _virtual(self, index: int, chunk: int) -> int:
        return chunk * self.s.stages + index

    def _execute(self, index: int, st: _Stage, ins: Instruction) -> bool:
        """Run ``ins`` on stage ``index``; False when it must wait for a message."""
        last = self.s.virtual_stages - 1
        if isinstance(ins, (ReduceTiedGrads, ReduceGrads, OptimizerStep)):
            self._require_grads_complete(index, st, ins)
            return True
        micro, chunk = ins.micro, ins.chunk
        key = (micro, chunk)
        virtual = self._virtual(index, chunk)
        if isinstance(ins, (RecvActivation, RecvGrad)):
            return self._receive(index, st, ins)
        if isinstance(ins, (SendActivation, SendGrad)):
            return self._send(index, st, ins)
        if isinstance(ins, LoadMicroBatch):
            if virtual not in (0, last):
                raise self._fail(index, st, ins, f"virtual stage {virtual} is neither first nor last")
            self._once(index, st, ins, "L", key)
            return True
        if isinstance(ins, Forward):
            needs = ("L",) if virtual == 0 else ("RA", "L") if virtual == last else ("RA",)
            self._needs(index, st, ins, needs, key)
            self._once(index, st, ins, "F", key)
            kept = 1 if self.s.training else 0  # eval frees activations once they are sent
            self._compute(st, self.cost_f, in_flight=kept, held=kept)
            return True
        self._needs(index, st, ins, ("F",), key)
        if isinstance(ins, (Backward, BackwardInput)):
            if virtual < last:
                self._needs(index, st, ins, ("RG",), key)
            self._once(index, st, ins, "B", key)
            if isinstance(ins, Backward):
                self._once(index, st, ins, "W", key)
                self._compute(st, self.cost_b + self.cost_w, in_flight=-1, held=-1)
            else:
                self._compute(st, self.cost_b, in_flight=-1, held=0)
            return True
        if isinstance(ins, BackwardWeight):
            self._needs(index, st, ins, ("B",), key)
            self._once(index, st, ins, "W", key)
            self._compute(st, self.cost_w, in_flight=0, held=-1)
            return True
        raise self._fail(index, st, ins, "unknown instruction")  # pragma: no cover

    def _compute(self, st: _Stage, cost: Time, in_flight: int, held: int) -> None:
        st.clock += cost
        st.busy += cost
        st.in_flight += in_flight
        st.held += held
        st.max_in_flight = max(st.max_in_flight, st.in_flight)
        st.max_held = max(st.max_held, st.held)

    def _once(self, index: int, st: _Stage, ins: Instruction, what: str, key: tuple[int, int]) -> None:
        if (what, *key) in st.done:
            raise self._fail(index, st, ins, f"{what} of micro-batch {key[0]} chunk {key[1]} already ran")
        st.done.add((what, *key))

    def _needs(self, index: int, st: _Stage, ins: Instruction, whats: tuple[str, ...],
               key: tuple[int, int]) -> None:
        for what in whats:
            if (what, *key) not in st.done:
                raise self._fail(index, st, ins, f"needs {what} of micro-batch {key[0]} chunk {key[1]} first")

    def _require_grads_complete(self, index: int, st: _Stage, ins: Instruction) -> None:
        if not self.s.training:
            raise self._fail(index, st, ins, "a forward-only schedule has no batch end")
        for micro in range(self.s.micro_batches):
            for chunk in range(self.s.chunks):
                self._needs(index, st, ins, ("F", "B", "W"), (micro, chunk))

    def _send(self, index: int, st: _Stage, ins: SendActivation | SendGrad) -> bool:
        grad = isinstance(ins, SendGrad)
        self._needs(index, st, ins, ("B",) if grad else ("F",), (ins.micro, ins.chunk))
        target = self._virtual(index, ins.chunk) + (-1 if grad else 1)
        if not 0 <= target < self.s.virtual_stages or target % self.s.stages != ins.peer:
            raise self._fail(index, st, ins, f"virtual stage {target} is not held by stage {ins.peer}")
        self._once(index, st, ins, "SG" if grad else "SA", (ins.micro, ins.chunk))
        channel = self.channels.setdefault((index, ins.peer, "grad" if grad else "act"), deque())
        channel.append((ins.micro, target, st.clock + self.comm))
        return True

    def _receive(self, index: int, st: _Stage, ins: RecvActivation | RecvGrad) -> bool:
        grad = isinstance(ins, RecvGrad)
        channel = self.channels.get((ins.peer, index, "grad" if grad else "act"))
        if not channel:
            return False
        micro, target, arrival = channel[0]
        if (micro, target) != (ins.micro, self._virtual(index, ins.chunk)):
            raise self._fail(index, st, ins, f"next message from stage {ins.peer} is micro-batch {micro} for "
                             f"virtual stage {target}: receives must follow the sender's order")
        channel.popleft()
        self._once(index, st, ins, "RG" if grad else "RA", (ins.micro, ins.chunk))
        st.clock = max(st.clock, arrival)
        return True

    def _waiting(self) -> str:
        lines = [f"stage {i} waits at #{st.pc} {st.current}" for i, st in enumerate(self.stages)
                 if st.current is not None]
        return "pipeline deadlock: " + "; ".join(lines)

    def _check_complete(self) -> None:
        for (sender, receiver, kind), channel in self.channels.items():
            if channel:
                micro, target, _ = channel[0]
                raise ScheduleViolation(f"stage {sender} sent {kind} of micro-batch {micro} (virtual stage "
                                        f"{target}) to stage {receiver}, which never received it")
        for i, st in enumerate(self.stages):
            for micro in range(self.s.micro_batches):
                for chunk in range(self.s.chunks):
                    missing = [w for w in (("F", "B", "W") if self.s.training else ("F",))
                               if (w, micro, chunk) not in st.done]
                    if missing:
                        raise ScheduleViolation(f"stage {i} never ran {'/'.join(missing)} of micro-batch "
                                                f"{micro} chunk {chunk}")
