"""Pipeline schedules (pure): exact lists, counts, no deadlock, dependencies, bubble and memory vs theory.

Cost model (``simulate.Costs``): per stage and micro-batch F = 1, B (input gradient) = 1, W (weight
gradient) = 1, a fused backward = B + W = 2, communication 0; a chunk of an interleaved stage costs 1/v of
each. Theories (idle share of the makespan; exact, checked with fractions):
- GPipe, 1F1B: each stage idles (p-1)(F + B + W) of makespan (m + p - 1)(F + B + W): (p-1)/(m+p-1).
- Interleaved 1F1B (Megatron): the ramp is paid in chunks of 1/v: (p-1)/(v m + p - 1).
- ZB-H1: B alone is on the critical path and deferred W fill the cool-down, leaving (p-1)(F + B - W) idle:
  (p-1)/(3m + p - 1) for m >= p (a third of 1F1B's idle time). For m < p there are too few W to fill it;
  the makespan is the critical path p F + (p-1) B + m (B + W), so the share is 1 - 3m/(2m + 2p - 1).
In-flight activations (forwards whose B / fused backward has not run; chunk activations for interleaved):
GPipe m; 1F1B and ZB-H1 min(p-s, m); interleaved min(v m, 2(p-s-1) + (v-1)p + 1). ZB-H1's forwards
awaiting W stay within 1F1B's peak: min(p, m) on every stage.
"""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from zerospeed.pipe import (SCHEDULES, Backward, BackwardInput, BackwardWeight, Costs, Deadlock, Forward,
                            LoadMicroBatch, OptimizerStep, RecvActivation, RecvGrad, ReduceGrads,
                            ReduceTiedGrads, Schedule, ScheduleError, ScheduleViolation, SendActivation,
                            SendGrad, gpipe, inference, interleaved_1f1b, one_f_one_b, schedule_for,
                            simulate, zero_bubble_h1)

END = [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
CASES = [(name, p, m, v) for name in SCHEDULES for p in (1, 2, 4) for m in range(1, 13)
         for v in ((2, 3) if name == "interleaved_1f1b" else (1,))
         if name != "interleaved_1f1b" or (p > 1 and m % p == 0)]


def theory(name: str, p: int, m: int, v: int) -> Fraction:
    if name in ("1f1b", "gpipe"):
        return Fraction(p - 1, m + p - 1)
    if name == "interleaved_1f1b":
        return Fraction(p - 1, v * m + p - 1)
    return Fraction(p - 1, 3 * m + p - 1) if m >= p else 1 - Fraction(3 * m, 2 * m + 2 * p - 1)


def in_flight_theory(name: str, p: int, m: int, v: int, s: int) -> int:
    if name == "gpipe":
        return m
    if name == "interleaved_1f1b":
        return min(v * m, 2 * (p - s - 1) + (v - 1) * p + 1)
    return min(p - s, m)


def test_one_f_one_b_p2_m3_exact() -> None:
    s = one_f_one_b(2, 3)
    assert list(s.programs[0]) == [
        LoadMicroBatch(0), Forward(0), SendActivation(0, 0, 1),
        LoadMicroBatch(1), Forward(1), SendActivation(1, 0, 1),
        RecvGrad(0, 0, 1), Backward(0),
        LoadMicroBatch(2), Forward(2), SendActivation(2, 0, 1),
        RecvGrad(1, 0, 1), Backward(1),
        RecvGrad(2, 0, 1), Backward(2), *END]
    assert list(s.programs[1]) == [
        RecvActivation(0, 0, 0), LoadMicroBatch(0), Forward(0), Backward(0), SendGrad(0, 0, 0),
        RecvActivation(1, 0, 0), LoadMicroBatch(1), Forward(1), Backward(1), SendGrad(1, 0, 0),
        RecvActivation(2, 0, 0), LoadMicroBatch(2), Forward(2), Backward(2), SendGrad(2, 0, 0), *END]
    assert s.in_flight_bound == (2, 1)


def test_gpipe_p2_m3_exact() -> None:
    s = gpipe(2, 3)
    assert list(s.programs[0]) == [
        LoadMicroBatch(0), Forward(0), SendActivation(0, 0, 1),
        LoadMicroBatch(1), Forward(1), SendActivation(1, 0, 1),
        LoadMicroBatch(2), Forward(2), SendActivation(2, 0, 1),
        RecvGrad(0, 0, 1), Backward(0), RecvGrad(1, 0, 1), Backward(1), RecvGrad(2, 0, 1), Backward(2),
        *END]
    assert list(s.programs[1]) == [
        RecvActivation(0, 0, 0), LoadMicroBatch(0), Forward(0),
        RecvActivation(1, 0, 0), LoadMicroBatch(1), Forward(1),
        RecvActivation(2, 0, 0), LoadMicroBatch(2), Forward(2),
        Backward(0), SendGrad(0, 0, 0), Backward(1), SendGrad(1, 0, 0), Backward(2), SendGrad(2, 0, 0),
        *END]


def test_zb_h1_stage_order() -> None:
    """Stage s runs its first s weight gradients late (as torch's ZB1P, one chunk)."""
    s = zero_bubble_h1(2, 3)
    compute = [[f"{i.code}{i.micro}" for i in prog if isinstance(i, (Forward, BackwardInput, BackwardWeight))]
               for prog in s.programs]
    assert compute == [["F0", "F1", "B0", "W0", "F2", "B1", "W1", "B2", "W2"],
                       ["F0", "B0", "F1", "B1", "W0", "F2", "B2", "W1", "W2"]]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_schedule_grid(name: str, p: int, m: int, v: int) -> None:
    s = schedule_for(name, stages=p, micro_batches=m, chunks=v)
    split = name == "zb_h1"
    for prog in s.programs:
        for kinds in ((Forward, BackwardInput, BackwardWeight) if split else (Forward, Backward)):
            ran = sorted((i.micro, i.chunk) for i in prog if type(i) is kinds)
            assert ran == [(mb, c) for mb in range(m) for c in range(v)], (kinds, ran)
        assert list(prog[-3:]) == END
    result = simulate(s)  # raises on deadlock, broken dependency or channel order
    assert result.bubble == theory(name, p, m, v)
    for stage in range(p):  # equal work per stage: each stage's idle share is the bubble, exactly
        assert result.idle_share(stage) == theory(name, p, m, v)
        bound = in_flight_theory(name, p, m, v, stage)
        assert result.max_in_flight[stage] == s.in_flight_bound[stage] == bound
        if split:
            assert result.max_held[stage] == min(p, m)
    if p > 1 and name != "1f1b":
        one = simulate(one_f_one_b(p, m))
        assert result.bubble < one.bubble or name == "gpipe"


@pytest.mark.parametrize("p,m", [(2, 2), (2, 7), (4, 4), (4, 9), (4, 12)])
def test_zb_h1_paper_bubble_uneven_costs(p: int, m: int) -> None:
    """The paper's ZB-H1 idle time (p-1)(F + B - W), here F=2, B=3, W=1 and m >= p; 1F1B unchanged."""
    f, b, w = 2, 3, 1
    zb = simulate(zero_bubble_h1(p, m), Costs(f, b, w))
    assert zb.bubble == Fraction((p - 1) * (f + b - w), m * (f + b + w) + (p - 1) * (f + b - w))
    assert simulate(one_f_one_b(p, m), Costs(f, b, w)).bubble == Fraction(p - 1, m + p - 1)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("costs", [Costs(2, 3, 1, Fraction(1, 2)), Costs(1, 1, 1, 5), Costs(3, 1, 2, 0)])
def test_other_costs_finish(name: str, costs: Costs) -> None:
    """Timing must not change correctness: uneven costs and slow links still finish with every check."""
    for p, m in ((2, 4), (4, 8), (4, 12)):
        result = simulate(schedule_for(name, stages=p, micro_batches=m), costs)
        assert 0 < result.bubble < 1


def test_inference() -> None:
    s = inference(2, 3)
    assert list(s.programs[0]) == [x for i in range(3)
                                   for x in (LoadMicroBatch(i), Forward(i), SendActivation(i, 0, 1))]
    assert list(s.programs[1]) == [x for i in range(3)
                                   for x in (RecvActivation(i, 0, 0), LoadMicroBatch(i), Forward(i))]
    assert simulate(s).makespan == 4  # m + p - 1 forwards
    for p, m, v in ((1, 5, 1), (4, 7, 1), (4, 8, 2)):
        assert simulate(inference(p, m, v)).max_held == (0,) * p


def test_train_eval_interleavings_drain() -> None:
    """Every schedule leaves all channels empty (simulate checks), so any sequence of batches composes."""
    rng = random.Random(0)
    for _ in range(200):
        p = rng.choice((1, 2, 4))
        names = ["eval", *(n for n in SCHEDULES if p > 1 or n != "interleaved_1f1b")]
        name = rng.choice(names)
        m = p * rng.randint(1, 3)
        s = inference(p, m) if name == "eval" else schedule_for(name, stages=p, micro_batches=m)
        simulate(s, Costs(comm=Fraction(rng.randint(0, 3), 2)))


def _replace(s: Schedule, stage: int, program: list) -> Schedule:
    programs = list(s.programs)
    programs[stage] = tuple(program)
    return Schedule(s.name, s.stages, s.micro_batches, s.chunks, tuple(programs), s.in_flight_bound)


def test_deadlock_named() -> None:
    s = one_f_one_b(2, 2)
    prog = list(s.programs[0])  # stage 0 waits for a gradient before sending the activation it needs
    broken = [RecvGrad(0, 0, 1)] + [i for i in prog if i != RecvGrad(0, 0, 1)]
    with pytest.raises(Deadlock, match=r"stage 0 waits at #0 RecvGrad\(micro=0, chunk=0, peer=1\); "
                                       r"stage 1 waits at #0 RecvActivation\(micro=0"):
        simulate(_replace(s, 0, broken))


def test_violations_named() -> None:
    s = one_f_one_b(2, 3)
    prog = list(s.programs[1])
    swapped = prog[:]
    swapped[0], swapped[5] = prog[5], prog[0]  # receive micro-batch 1 before 0
    with pytest.raises(ScheduleViolation, match="stage 1 instruction #0 .*receives must follow"):
        simulate(_replace(s, 1, swapped))
    no_recv = [i for i in prog if i != RecvActivation(2, 0, 0)]
    with pytest.raises(ScheduleViolation, match=r"needs RA of micro-batch 2"):
        simulate(_replace(s, 1, no_recv))
    zb = zero_bubble_h1(2, 2)
    prog0 = list(zb.programs[0])
    early_w = [BackwardWeight(0)] + [i for i in prog0 if i != BackwardWeight(0)]
    with pytest.raises(ScheduleViolation, match="needs F of micro-batch 0"):
        simulate(_replace(zb, 0, early_w))
    no_w = [i for i in prog0 if i != BackwardWeight(1)]
    with pytest.raises(ScheduleViolation, match="needs W of micro-batch 1"):
        simulate(_replace(zb, 0, no_w))
    extra_send = prog[:3] + [SendGrad(0, 0, 0)] + prog[3:]
    with pytest.raises(ScheduleViolation, match="needs B of micro-batch 0"):
        simulate(_replace(s, 1, extra_send))


def test_refusals_name_the_fix() -> None:
    with pytest.raises(ScheduleError, match="did you mean '1f1b'"):
        schedule_for("1fb1", stages=2, micro_batches=4)
    with pytest.raises(ScheduleError, match="did you mean 'zb_h1'"):
        schedule_for("zb-h1", stages=2, micro_batches=4)
    with pytest.raises(ScheduleError, match="use 4 or 8 micro-batches"):
        interleaved_1f1b(4, 6)
    with pytest.raises(ScheduleError, match="use 4 micro-batches"):
        interleaved_1f1b(4, 3)
    with pytest.raises(ScheduleError, match="use schedule '1f1b'"):
        interleaved_1f1b(1, 4)
    with pytest.raises(ScheduleError, match="chunks=2.*interleaved_1f1b"):
        one_f_one_b(2, 4, 2)
    with pytest.raises(ScheduleError, match="micro_batches=0"):
        gpipe(2, 0)
    assert schedule_for("interleaved_1f1b", stages=2, micro_batches=4).chunks == 2
