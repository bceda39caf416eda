"""The offload optimizer step on the CPU: CPUAdam against torch's Adam (+ copy) and the memory ceiling.

What an offloaded Adam step must do per parameter: read the fp32 gradient, master, exp_avg and
exp_avg_sq (16 bytes), write the master, exp_avg and exp_avg_sq (12 bytes) and the bf16 copy of the
parameter that goes back to the compute device (2 bytes): 30 bytes in one pass. A separate copy after
the optimizer reads the master again and writes the copy: 34 bytes. In one invocation this measures:

  ceiling          the best of STREAM's copy / scale / add / triad done in place on all threads (torch):
                   the memory bandwidth a simple elementwise pass reaches here
  CPUAdam          zerospeed's one-pass step with the bf16 copy-out (fp16_param_groups)
  CPUAdam fp32     the same without the copy-out (plain fp32 Adam: 28 bytes)
  fused + copy     torch.optim.AdamW(fused=True).step() then bf16 copy
  fused fp32       torch.optim.AdamW(fused=True).step() alone
  foreach + copy   torch.optim.AdamW(foreach=True).step() then bf16 copy
  DeepSpeed + copy DeepSpeedCPUAdam (fp32 step) then bf16 copy, run by ``--deepspeed-python`` (an
                   interpreter with deepspeed installed; its op compiles on first use, minutes)

Seconds per step are the median of ``--repeats`` steps after one warm-up; GB/s counts the bytes the
step must move (30 with a copy, 28 without) whatever an implementation really moves, so a pipeline
that moves more shows a lower figure. Peers that would not fit in available memory are skipped.

    python benchmarks/bench_cpu_adam.py [--sizes 1e8 3e8 1e9] [--repeats 3] [--deepspeed-python PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch

from zerospeed.ops.adam import CPUAdam
from zerospeed.ops.native import choose

BYTES_COPY, BYTES_FP32 = 30, 28
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def _time(step: Callable[[], None], repeats: int) -> float:
    step()  # warm-up: first-touch page faults, thread pools, state allocation
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ceiling(n: int, repeats: int) -> tuple[float, str]:
    """The best bandwidth of STREAM's kernels done in place on all threads: (bytes/s, which one)."""
    a, b, c = torch.ones(n), torch.full((n,), 1e-3), torch.empty(n)
    kernels = {"copy c=a": (lambda: c.copy_(a), 8), "scale a*=s": (lambda: a.mul_(1.0), 8),
               "add a+=b": (lambda: a.add_(b), 12), "triad a+=s*b": (lambda: a.add_(b, alpha=0.5), 12)}
    rates = {name: nbytes * n / _time(fn, repeats) for name, (fn, nbytes) in kernels.items()}
    del a, b, c
    best = max(rates, key=lambda k: rates[k])
    return rates[best], best


def _setup(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    param = torch.randn(n).requires_grad_()
    param.grad = torch.randn(n) * 1e-2
    return param, torch.empty(n, dtype=torch.bfloat16)


def _measure(name: str, n: int, repeats: int) -> float | None:
    """Seconds per step of one pipeline on ``n`` parameters (None when it would not fit)."""
    need = {"foreach + copy": 6 * 4 * n, "CPUAdam": 4 * 4 * n + 2 * n}.get(name, 4 * 4 * n + 2 * n)
    if need > 0.9 * _available_bytes():
        return None
    param, out = _setup(n)
    if name == "CPUAdam":
        opt = CPUAdam([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        step = lambda: opt.step(fp16_param_groups=[[out]])  # noqa: E731
    elif name == "CPUAdam fp32":
        opt = CPUAdam([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        step = opt.step
    else:
        fused = name.startswith("fused")
        opt = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                **({"fused": True} if fused else {"foreach": True}))
        copy = name.endswith("+ copy")

        def step() -> None:
            opt.step()
            if copy:
                with torch.no_grad():
                    out.copy_(param)
    seconds = _time(step, repeats)
    del opt, param, out
    gc.collect()
    return seconds


_DEEPSPEED_SNIPPET = """
import json, statistics, sys, time, torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
n, repeats = int(sys.argv[1]), int(sys.argv[2])
param = torch.randn(n).requires_grad_(); param.grad = torch.randn(n) * 1e-2
out = torch.empty(n, dtype=torch.bfloat16)
opt = DeepSpeedCPUAdam([param], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, adamw_mode=True)
def step():
    opt.step()
    with torch.no_grad():
        out.copy_(param)
step()
times = []
for _ in range(repeats):
    start = time.perf_counter(); step(); times.append(time.perf_counter() - start)
print(json.dumps(statistics.median(times)))
"""


def _deepspeed(python: str, n: int, repeats: int) -> float | None:
    if 5 * 4 * n > 0.9 * _available_bytes():
        return None
    proc = subprocess.run([python, "-c", _DEEPSPEED_SNIPPET, str(n), str(repeats)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())})
    if proc.returncode != 0:
        print(f"  DeepSpeed run failed: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return float(json.loads(proc.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", type=float, default=[1e8, 3e8, 1e9])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--deepspeed-python", default=None,
                        help="a Python interpreter with deepspeed installed (e.g. /tmp/dsvenv/bin/python)")
    parser.add_argument("--quick", action="store_true", help="one size of 2e7 parameters")
    args = parser.parse_args()
    sizes = [2e7] if args.quick else args.sizes
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; CPUAdam kernels: {choose().name} "
          f"({choose().reason})")
    names = ["CPUAdam", "CPUAdam fp32", "fused + copy", "fused fp32", "foreach + copy"]
    for size in sizes:
        n = int(size)
        ceiling, which = _ceiling(n, args.repeats)
        print(f"\n{n:.0e} parameters; ceiling (best STREAM kernel on all threads: {which}): {ceiling / 1e9:.1f} GB/s")
        results: dict[str, float | None] = {name: _measure(name, n, args.repeats) for name in names}
        if args.deepspeed_python:
            results["DeepSpeed + copy"] = _deepspeed(args.deepspeed_python, n, args.repeats)
        print(f"{'pipeline':18} {'s/step':>8} {'B/param':>8} {'GB/s':>7} {'of ceiling':>10}")
        for name, seconds in results.items():
            if seconds is None:
                print(f"{name:18} {'skipped (memory or unavailable)':>36}")
                continue
            nbytes = BYTES_FP32 if "fp32" in name else BYTES_COPY
            rate = nbytes * n / seconds
            print(f"{name:18} {seconds:8.3f} {nbytes:8d} {rate / 1e9:7.1f} {rate / ceiling:9.0%}")
        ours = results["CPUAdam"]
        peers = {k: v for k, v in results.items() if k.endswith("+ copy") and v is not None}
        if ours and peers:
            fastest = min(peers, key=lambda k: peers[k])
            print(f"CPUAdam vs fastest peer pipeline ({fastest}): {peers[fastest] / ours:.2f}x faster"
                  f" (target >= 1.05x); " + ", ".join(f"vs {k}: {v / ours:.2f}x" for k, v in peers.items()))
        if results["CPUAdam fp32"] and results["fused fp32"]:
            print(f"plain fp32 CPUAdam vs torch fused AdamW: {results['fused fp32'] / results['CPUAdam fp32']:.2f}x")


if __name__ == "__main__":
    main()
