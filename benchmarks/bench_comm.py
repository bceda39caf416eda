"""Collective throughput through zerospeed's Comm against raw torch.distributed, same run.

Both sides run on the same gloo ranks, interleaved round by round so machine noise hits both
alike. Prints MB/s per op and size and the ratio Comm / raw (1.00 = no overhead).

    python benchmarks/bench_comm.py [--world-size 2] [--sizes 4096,262144,4194304] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # so ranks can import this module by name

import torch
import torch.distributed as dist

from zerospeed.dist import Comm
from zerospeed.testing import run_distributed


def _raw_ops(ws: int):
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return {
        "all_reduce": lambda big, small: dist.all_reduce(big),
        "reduce_scatter": lambda big, small: rs(small, big),
        "all_gather": lambda big, small: ag(big, small),
    }


def _comm_ops(comm: Comm):
    return {
        "all_reduce": lambda big, small: comm.all_reduce(big),
        "reduce_scatter": lambda big, small: comm.reduce_scatter(small, big),
        "all_gather": lambda big, small: comm.all_gather(big, small),
    }


def _time(fn, big, small, iters: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn(big, small)
    dist.barrier()
    return (time.perf_counter() - start) / iters


def _bench(sizes: list[int], rounds: int) -> list[dict]:
    ws = dist.get_world_size()
    sides = {"raw": _raw_ops(ws), "comm": _comm_ops(Comm())}
    rows = []
    for numel in sizes:
        numel -= numel % ws
        big, small = torch.randn(numel), torch.randn(numel // ws)
        iters = max(3, min(200, 20_000_000 // max(numel, 1)))
        for op in ("all_reduce", "reduce_scatter", "all_gather"):
            times: dict[str, list[float]] = {side: [] for side in sides}
            for side in sides:  # warm up
                _time(sides[side][op], big, small, 2)
            for _ in range(rounds):
                for side in sides:
                    times[side].append(_time(sides[side][op], big, small, iters))
            rows.append({"op": op, "numel": numel, **{s: statistics.median(t) for s, t in times.items()}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--sizes", default="4096,262144,4194304")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = run_distributed(_bench, args.world_size, sizes, args.rounds, timeout=1800)[0]
    print(f"gloo, {args.world_size} ranks, torch {torch.__version__}; median of {args.rounds} interleaved rounds")
    print(f"{'op':<15}{'elements':>10}{'raw MB/s':>11}{'comm MB/s':>11}{'comm/raw':>10}")
    for row in rows:
        mb = row["numel"] * 4 / 1e6
        raw, comm = mb / row["raw"], mb / row["comm"]
        print(f"{row['op']:<15}{row['numel']:>10}{raw:>11.1f}{comm:>11.1f}{comm / raw:>10.2f}")


if __name__ == "__main__":
    main()
