"""What ``wall_clock_breakdown`` costs: step time with the switch on vs off, same model, same run.

Two engines over two copies of the example GPT (``examples/gpt.py``, same seed, same random token
batches), identical configs but for ``wall_clock_breakdown`` (stage 0, AdamW, fp32, gradient
accumulation 2, ``steps_per_print`` 10, so the on side also formats and logs its breakdown lines, to a
logger nobody reads). They live in the same ``--world`` gloo rank processes (1 torch thread each) and
train in interleaved rounds of ``--steps`` optimizer steps (default 1: each round is two adjacent steps,
one per side), alternating which side goes first, so machine load falls on both alike. A step's time is rank 0's wall time for its micro-batches' forward, backward
and step calls.

Prints each side's step-time table (median, p10, p90, min, max, per-round medians), then ``ratio on/off``:
the median of the per-round ratios of the medians (the target: within 2% of 1). On a shared machine that
ratio carries the machine's noise, so the timers' own cost is also measured directly: the time of one
phase bracket (enter and exit) of ``NoTimers`` and of ``WallClockTimers`` (CPU: its synchronize is the
accelerator's, a no-op), times the brackets an optimizer step opens, as a share of the median step.

    python benchmarks/bench_wall_clock.py [--quick] [--world 2] [--rounds 150] [--steps 1] [--layers 4]
        [--width 128] [--seq 64] [--batch 8]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

SEED = 1234
SIDES = ("off", "on")


def _config(spec: dict[str, Any], breakdown: bool) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": spec["batch"], "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1}},
        "gradient_clipping": 1.0, "zero_optimization": {"stage": 0}, "steps_per_print": 10,
        "wall_clock_breakdown": breakdown,
    }


class Side:
    """One engine and the step times it ran, per round."""

    def __init__(self, name: str, spec: dict[str, Any]) -> None:
        import zerospeed
        from gpt import GPT, GPTConfig

        torch.manual_seed(SEED)
        model = GPT(GPTConfig(vocab_size=256, seq_len=spec["seq"], d_model=spec["width"], n_layers=spec["layers"],
                              n_heads=max(1, spec["width"] // 32)))
        self.engine, *_ = zerospeed.initialize(model=model, config=_config(spec, name == "on"))
        self.spec = spec
        self.data = torch.Generator().manual_seed(SEED + self.engine.comm.rank)
        self.times: list[list[float]] = []

    def run(self, steps: int) -> None:
        """``steps`` optimizer steps, each timed."""
        spec, engine = self.spec, self.engine
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            for _ in range(engine.gradient_accumulation_steps()):
                ids = torch.randint(0, 256, (spec["batch"], spec["seq"] + 1), generator=self.data)
                loss = engine(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
                engine.backward(loss)
                engine.step()
            times.append(time.perf_counter() - start)
        self.times.append(times)


def run_rank(spec: dict[str, Any]) -> dict[str, Any]:
    logging.getLogger("zerospeed").addHandler(logging.NullHandler())
    logging.getLogger("zerospeed").propagate = False  # the on side's lines are formatted, not shown
    sides = {name: Side(name, spec) for name in SIDES}
    for side in sides.values():  # warm-up: first steps allocate and re-lay buckets
        side.run(3)
        side.times.clear()
    for round_ in range(spec["rounds"]):
        order = SIDES if round_ % 2 == 0 else SIDES[::-1]
        for name in order:
            sides[name].run(spec["steps"])
    return {name: side.times for name, side in sides.items()}


def bracket_ns(timers: Any, repeats: int = 200_000) -> float:
    """Nanoseconds per ``with timers.phase("forward")`` (enter and exit)."""
    start = time.perf_counter()
    for _ in range(repeats):
        with timers.phase("forward"):
            pass
    return 1e9 * (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="30 rounds")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--steps", type=int, default=1, help="optimizer steps per side per round")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    if args.quick:
        args.rounds = 30
    spec = vars(args)
    from _report import print_step_table
    from zerospeed.testing import run_distributed

    out = run_distributed(run_rank, args.world, spec, timeout=3600, threads_per_rank=1)[0]
    print(f"wall_clock_breakdown on vs off: GPT {args.layers} layers, d_model {args.width}, seq {args.seq}, "
          f"micro-batch {args.batch} x accumulation 2 x {args.world} gloo ranks; {args.rounds} interleaved rounds "
          f"of {args.steps} steps per side (ms per optimizer step, rank 0)")
    times = {name: [[t] for round_ in out[name] for t in round_] for name in SIDES}
    rounds = {name: [statistics.median(round_) for round_ in out[name]] for name in SIDES}
    medians = print_step_table(times, rounds, SIDES)
    per_round = [on / off for on, off in zip(rounds["on"], rounds["off"], strict=True)]
    ratio = statistics.median(per_round)
    print(f"ratio on/off: {ratio:.4f} (median of the {len(per_round)} per-round ratios, range "
          f"{min(per_round):.3f} - {max(per_round):.3f}); {medians['on'] / medians['off']:.4f} from the pooled "
          f"medians; difference {100 * (ratio - 1):+.2f}% (target: within 2%)")
    from zerospeed.accelerator import get_accelerator
    from zerospeed.profiling.timers import NoTimers, WallClockTimers

    off_ns = min(bracket_ns(NoTimers()) for _ in range(3))
    on_ns = min(bracket_ns(WallClockTimers(synchronize=get_accelerator().synchronize)) for _ in range(3))
    brackets = 2 * 5 + 1  # per micro-batch: forward, backward, its two parts, step; plus the boundary's reduction wait
    extra_us = brackets * (on_ns - off_ns) / 1e3
    print(f"timer cost: {off_ns:.0f} ns per phase bracket off, {on_ns:.0f} ns on; {brackets} brackets per step -> "
          f"{extra_us:.1f} us more per step with the switch on = {100 * extra_us / (1e3 * medians['off']):.4f}% of "
          f"the median step")


if __name__ == "__main__":
    main()
