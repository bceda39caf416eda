"""The int8 x float matmul of weight-only quantized linears against float ``F.linear`` on the CPU.

For each weight shape ``[N, K]`` (out, in) and rows of input M (decode: 1 and 4; prefill: 256), at 1
and 2 threads, in one invocation:

  fp32            F.linear(x, W) with fp32 x and W (the baseline of the ratios)
  bf16            F.linear with bf16 x and W
  int8pack        torch._weight_int8pack_mm (torch's own CPU int8 weights: one scale per output row)
  zs int8         zerospeed's int8_linear, group-wise (group 128), native kernel (built at install)
  zs int8 torch   the same through the PyTorch fallback (dequantize, then F.linear); with --fallback

Rounds rotate over the implementations (each round times every one ``--calls`` times) and the figure
is the median over ``--rounds`` rounds, so a noisy neighbour hurts all alike. Decode rows print the
weight bytes each implementation must read per call divided by the time (GB/s: fp32 4 bytes a weight,
bf16 2, int8 1 plus scales); prefill rows print GFLOP/s (2 M N K). ``x fp32`` is fp32's time over this
one's (above 1: faster); ``best x fp32`` compares the fastest rounds instead (on a shared, loaded
machine the least disturbed samples). A peer whose warm-up call takes over 8x fp32's and 0.5 s is timed by that
one call (marked), so the slow int8pack and bf16 prefill do not take the run's whole budget.

    python benchmarks/bench_int8.py [--quick] [--rounds 7] [--calls 5] [--group-size 128] [--fallback]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
from torch.nn import functional as F

from zerospeed.ops import int8

Run = Callable[[], torch.Tensor]
SLOW_FACTOR, SLOW_SECONDS = 8.0, 0.5


def _median_seconds(runs: dict[str, Run], rounds: int, calls: int
                    ) -> tuple[dict[str, float], dict[str, float], set[str]]:
    """Median and best (fastest round) seconds per call, and the peers timed by their warm-up call alone: those over
    ``SLOW_FACTOR`` times fp32's warm-up and ``SLOW_SECONDS`` (torch's int8pack and bf16 prefill here)."""
    warm: dict[str, float] = {}
    for name, run in runs.items():  # warm-up: first touch, thread pools
        start = time.perf_counter()
        run()
        warm[name] = time.perf_counter() - start
    slow = {name for name, sec in warm.items() if sec > SLOW_SECONDS and sec > SLOW_FACTOR * warm["fp32"]}
    samples: dict[str, list[float]] = {name: [warm[name]] if name in slow else [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            if name in slow:
                continue
            start = time.perf_counter()
            for _ in range(calls):
                run()
            samples[name].append((time.perf_counter() - start) / calls)
    return ({name: statistics.median(values) for name, values in samples.items()},
            {name: min(values) for name, values in samples.items()}, slow)


def _runs(m: int, k: int, n: int, group: int, fallback: bool) -> tuple[dict[str, Run], dict[str, float]]:
    """The implementations for one shape and the bytes of weights each reads per call."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) * 0.02
    x = torch.randn(m, k, generator=gen)
    w16, x16 = w.bfloat16(), x.bfloat16()
    q, s = int8.quantize_groupwise(w, group)
    q_row, s_row = int8.quantize_groupwise(w, k)  # per output row, the layout int8pack takes
    s_row = s_row.reshape(n).contiguous()
    native, torch_path = int8.kernels("auto"), int8.kernels("torch")
    runs: dict[str, Run] = {
        "fp32": lambda: F.linear(x, w),
        "bf16": lambda: F.linear(x16, w16),
        "int8pack": lambda: torch._weight_int8pack_mm(x, q_row, s_row),
        "zs int8": lambda: int8.int8_linear(x, q, s, group, kernels=native),
    }
    if fallback:
        runs["zs int8 torch"] = lambda: int8.int8_linear(x, q, s, group, kernels=torch_path)
    nk = n * k
    weight_bytes = {"fp32": 4.0 * nk, "bf16": 2.0 * nk, "int8pack": nk + 4.0 * n, "zs int8": nk + 4.0 * s.numel(),
                    "zs int8 torch": nk + 4.0 * s.numel()}
    return runs, weight_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="K,N in 768 and 2048 only, 3 rounds")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--fallback", action="store_true", help="also time the PyTorch fallback")
    args = parser.parse_args()
    shapes = [(768, 768), (2048, 2048), (4096, 4096), (4096, 11008)]
    rounds = args.rounds
    if args.quick:
        shapes, rounds = shapes[:2], min(rounds, 3)
    kernels = int8.kernels("auto")
    features = kernels.module.features() if kernels.module is not None else ("-", 0)
    print(f"int8 kernels: {kernels.name} {features} ({kernels.reason}); torch {torch.__version__}; "
          f"group {args.group_size}; median of {rounds} rotating rounds x {args.calls} calls")
    threads_before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            print(f"\n== {threads} thread(s)")
            print(f"{'K x N':>12} {'M':>4} {'impl':>14} {'us/call':>10} {'figure':>14} {'x fp32':>7} {'best x fp32':>11}")
            for k, n in shapes:
                for m in (1, 4, 256):
                    runs, weight_bytes = _runs(m, k, n, args.group_size, args.fallback)
                    seconds, best, slow = _median_seconds(runs, rounds, args.calls)
                    for name, sec in seconds.items():
                        if m <= 16:
                            figure = f"{weight_bytes[name] / sec / 1e9:8.2f} GB/s"
                        else:
                            figure = f"{2 * m * n * k / sec / 1e9:6.1f} GFLOP/s"
                        print(f"{k:>5} x {n:<5} {m:>4} {name:>14} {sec * 1e6:>10.1f} {figure:>14} "
                              f"{seconds['fp32'] / sec:>7.2f} {best['fp32'] / best[name]:>11.2f}"
                              f"{'  (one call: slow peer)' if name in slow else ''}")
    finally:
        torch.set_num_threads(threads_before)


if __name__ == "__main__":
    main()
