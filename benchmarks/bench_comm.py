"""Collective throughput through zerospeed's Comm against raw torch.distributed, same run.

Both sides run on the same gloo ranks, interleaved round by round so machine noise hits both
alike. Prints MB/s per op and size and the ratio Comm / raw (1.00 = no overhead).

    python benchmarks/bench_comm.py [--world-size 2] [--sizes 4096,262144,4194304] [--rounds 5]

``--reduce-scatter`` instead compares Comm's two ways of running a reduce_scatter whose inputs
may be clobbered (``inputs_writable=True``): the native collective and an in-place all_reduce
plus this rank's slice, per dtype and size (the total input's elements), to place the crossover
that ``ReduceScatterPolicy.for_backend`` encodes. MB/s is the whole input's bytes per second.

    python benchmarks/bench_comm.py --reduce-scatter [--world-size 2] [--dtypes float32,bfloat16]
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

from zerospeed.distributed import Comm
from zerospeed.distributed.comm import ALL_REDUCE_REDUCE_SCATTER, NATIVE_REDUCE_SCATTER
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


def _bench_reduce_scatter(sizes: list[int], dtypes: list[str], rounds: int) -> list[dict]:
    ws = dist.get_world_size()
    ways = {"native": Comm(reduce_scatter_policy=NATIVE_REDUCE_SCATTER),
            "all_reduce": Comm(reduce_scatter_policy=ALL_REDUCE_REDUCE_SCATTER)}
    rows = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for numel in sizes:
            numel -= numel % ws
            # zeros: the all_reduce way keeps summing into the same buffer, which must not overflow
            # into inf or sink into denormals (either would time something other than the network)
            big, small = torch.zeros(numel, dtype=dtype), torch.zeros(numel // ws, dtype=dtype)
            iters = max(3, min(200, 20_000_000 // max(numel, 1)))
            times: dict[str, list[float]] = {way: [] for way in ways}
            fns = {way: (lambda b, s, c=comm: c.reduce_scatter(s, b, inputs_writable=True)) for way, comm in ways.items()}
            for way in ways:  # warm up
                _time(fns[way], big, small, 2)
            for r in range(rounds):
                order = list(ways) if r % 2 == 0 else list(ways)[::-1]
                for way in order:
                    times[way].append(_time(fns[way], big, small, iters))
            rows.append({"dtype": dtype_name, "numel": numel, "bytes": numel * big.element_size(),
                         **{w: statistics.median(t) for w, t in times.items()}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--sizes", default="4096,262144,4194304")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reduce-scatter", action="store_true",
                        help="compare native reduce_scatter with in-place all_reduce + slice instead")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="for --reduce-scatter")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.reduce_scatter:
        dtypes = args.dtypes.split(",")
        rows = run_distributed(_bench_reduce_scatter, args.world_size, sizes, dtypes, args.rounds, timeout=3600)[0]
        print(f"gloo, {args.world_size} ranks, torch {torch.__version__}; reduce_scatter with inputs_writable=True, "
              f"median of {args.rounds} interleaved rounds; MB/s of the whole input")
        print(f"{'dtype':<10}{'elements':>10}{'native MB/s':>13}{'all_reduce MB/s':>17}{'ar/native':>11}")
        for row in rows:
            mb = row["bytes"] / 1e6
            native, via_ar = mb / row["native"], mb / row["all_reduce"]
            print(f"{row['dtype']:<10}{row['numel']:>10}{native:>13.1f}{via_ar:>17.1f}{via_ar / native:>11.2f}")
        return
    rows = run_distributed(_bench, args.world_size, sizes, args.rounds, timeout=1800)[0]
    print(f"gloo, {args.world_size} ranks, torch {torch.__version__}; median of {args.rounds} interleaved rounds")
    print(f"{'op':<15}{'elements':>10}{'raw MB/s':>11}{'comm MB/s':>11}{'comm/raw':>10}")
    for row in rows:
        mb = row["numel"] * 4 / 1e6
        raw, comm = mb / row["raw"], mb / row["comm"]
        print(f"{row['op']:<15}{row['numel']:>10}{raw:>11.1f}{comm:>11.1f}{comm / raw:>10.2f}")


if __name__ == "__main__":
    main()
