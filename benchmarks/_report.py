"""The step-time table the training benchmarks print (shared by ``bench_ddp.py`` and ``bench_tp.py``)."""

from __future__ import annotations

import statistics
from typing import Mapping, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def print_step_table(times: Mapping[str, list[list[float]]], rounds: Mapping[str, list[float]], sides: Sequence[str],
                     labels: Mapping[str, str] | None = None, width: int = 11) -> dict[str, float]:
    """One row per side: median, p10, p90, min, max of the step times (each step the sum of its phases,
    seconds in, ms out) and the range of the per-round medians. Returns each side's median (ms)."""
    names = labels or {side: side for side in sides}
    print(f"{'side':<{width}}{'median':>9}{'p10':>9}{'p90':>9}{'min':>9}{'max':>9}{'round medians (min-max)':>27}")
    medians = {}
    for side in sides:
        steps = [sum(t) * 1e3 for t in times[side]]
        per_round = [t * 1e3 for t in rounds[side]]
        medians[side] = statistics.median(steps)
        print(f"{names[side]:<{width}}{medians[side]:>9.1f}{percentile(steps, 0.1):>9.1f}"
              f"{percentile(steps, 0.9):>9.1f}{min(steps):>9.1f}{max(steps):>9.1f}"
              f"{min(per_round):>18.1f} - {max(per_round):.1f}")
    return medians


def print_ratio(label: str, side_rounds: Sequence[float], peer_rounds: Sequence[float], side_median: float,
                peer_median: float) -> None:
    """``ratio <label>``: the median of the per-round ratios side / peer (each round ran both), their
    range, and the ratio of the pooled medians."""
    per_round = [s / p for p, s in zip(peer_rounds, side_rounds, strict=True)]
    print(f"ratio {label}: {statistics.median(per_round):.3f} (median of the {len(per_round)} per-round ratios, "
          f"range {min(per_round):.3f} - {max(per_round):.3f}); {side_median / peer_median:.3f} from the pooled medians")


def phase_medians(times: Sequence[Sequence[float]]) -> list[float]:
    """Each phase's median over the steps (seconds in, ms out)."""
    return [statistics.median(t[i] for t in times) * 1e3 for i in range(len(times[0]))]
