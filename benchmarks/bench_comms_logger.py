"""What the communication logger costs a collective, measured on Comm's per-call bookkeeping (no wire).

On one gloo rank, interleaved rounds of 100k calls, best round kept: the counters alone (Comm's
bookkeeping before the logger existed), ``_enter`` with a disabled logger (the default), and
``_enter`` plus the timer's stop with an enabled one (clock reads, bandwidth formula, record).
A gloo collective itself costs tens of microseconds or more, so these are its added overhead.

    python benchmarks/bench_comms_logger.py [--calls 100000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))  # so ranks can import this module by name

from zerospeed.distributed import Comm
from zerospeed.distributed.comms_logger import CommsLogger
from zerospeed.testing import run_distributed


def _counters_only(comm: Comm) -> None:
    """The body of ``Comm._enter`` without the logger: the sequence number and the counters."""
    comm._seq += 1
    comm.stats.record("all_reduce", 4, 4)


def _measure(calls: int, rounds: int) -> dict[str, float]:
    off, on = Comm(comms_logger=CommsLogger()), Comm(comms_logger=CommsLogger(enabled=True))

    def logged() -> None:
        on._enter("all_reduce", 4, 4)
        probe, on._probe = on._probe, None
        assert probe is not None
        probe.stop()

    runs: dict[str, Callable[[], object]] = {
        "counters only": lambda: _counters_only(off),
        "logger disabled": lambda: off._enter("all_reduce", 4, 4),
        "logger enabled": logged,
    }
    best = {name: float("inf") for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / calls * 1e9)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    best = run_distributed(_measure, 1, args.calls, args.rounds, threads_per_rank=1)[0]
    for name, ns in best.items():
        print(f"{name:<16} {ns:8.0f} ns per call (best of {args.rounds} rounds of {args.calls})")


if __name__ == "__main__":
    main()
