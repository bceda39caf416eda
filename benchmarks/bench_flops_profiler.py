"""The flops profiler on the example GPT (``examples/gpt.py``): its cost and its counts against torch's
``FlopCounterMode``.

One process, 1 torch thread. The same forward + backward (mean cross-entropy, gradients dropped between
rounds) runs plain, under ``FlopsProfiler`` (start, run, stop, read, end) and under ``FlopCounterMode``,
interleaved round by round so machine load falls on all three alike; prints the median milliseconds and
the ratios to plain. Then the counts: forward and backward FLOPs/MACs and parameters (the head tied to the
embedding, counted once), torch's total, and ours without the scaled-dot-product attention that torch's
counter does not see on CPU (forward Q K^T + A V and the backward's four products, by their shapes),
which should equal torch's total.

    python benchmarks/bench_flops_profiler.py [--rounds 7] [--batch 8] [--layers 4] [--width 128] [--seq 128]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from gpt import GPT, GPTConfig  # noqa: E402

from zerospeed.profiling.flops_profiler import FlopsProfiler, ModelTotals  # noqa: E402


class Profiled(AbstractContextManager):
    """A whole profile around the block; ``totals`` after it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.prof = FlopsProfiler(model)
        self.totals: ModelTotals | None = None

    def __enter__(self) -> "Profiled":
        self.prof.start_profile()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.prof.stop_profile()
        self.totals = self.prof.totals()
        self.prof.end_profile()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = GPTConfig(seq_len=args.seq, d_model=args.width, n_layers=args.layers)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len))
    targets = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len))

    def run() -> None:
        model.zero_grad(set_to_none=True)
        model(idx, targets).backward()

    sides: dict[str, Callable[[], AbstractContextManager]] = {
        "plain": nullcontext, "FlopsProfiler": lambda: Profiled(model),
        "FlopCounterMode": lambda: FlopCounterMode(display=False)}
    run()
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            start = time.perf_counter()
            with sides[name]():
                run()
            times[name].append(time.perf_counter() - start)
    plain = statistics.median(times["plain"])
    print(f"GPT {args.layers} layers x {args.width}, seq {args.seq}, batch {args.batch}; fwd+bwd, median of "
          f"{args.rounds} interleaved rounds")
    for name in sides:
        ms = statistics.median(times[name])
        print(f"  {name:<16} {ms * 1e3:8.1f} ms  {ms / plain:5.2f}x")

    profiled = Profiled(model)
    with profiled:
        run()
    t = profiled.totals
    assert t is not None
    with FlopCounterMode(display=False) as counter:
        run()
    b, s, c = args.batch, cfg.seq_len, cfg.d_model
    sdpa = args.layers * 2 * b * s * s * c  # forward Q K^T + A V over all heads; backward twice that
    print(f"  forward  {t.fwd_flops:>16,} FLOPs {t.fwd_macs:>16,} MACs")
    print(f"  backward {t.bwd_flops:>16,} FLOPs {t.bwd_macs:>16,} MACs (measured; {t.bwd_macs / t.fwd_macs:.3f}x "
          f"the forward's MACs)")
    print(f"  params   {t.params:>16,} (tied head once; the model's own count {sum(p.numel() for p in model.parameters()):,})")
    print(f"  FlopCounterMode total {counter.get_total_flops():,}; ours as 2 x MACs without SDPA "
          f"{2 * (t.fwd_macs + t.bwd_macs - 3 * sdpa):,}; SDPA forward MACs {sdpa:,}")


if __name__ == "__main__":
    main()
