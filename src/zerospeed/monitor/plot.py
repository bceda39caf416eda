"""``zerospeed plot RUN_DIR``: a run's loss, learning rate, throughput and memory in one PNG.

``RUN_DIR`` is a CSV monitor's directory (``csv_monitor.output_path/job_name``): one file per event,
``step`` being ``global_samples``. A file that a second run appended to holds a second header; the
last run's rows are drawn. The figure is made without pyplot on matplotlib's Agg canvas (headless, no
process-wide state), and :func:`plot_run` returns the series read back from the drawn lines, so what
the picture shows can be checked against the CSV files.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from zerospeed.monitor.csv_monitor import csv_file_name

# (panel title, event name, y label); a panel whose file is missing says so.
PANELS = (
    ("loss", "Train/Samples/train_loss", "train loss"),
    ("learning rate", "Train/Samples/lr", "lr"),
    ("throughput", "Train/Samples/samples_per_sec", "samples/s"),
    ("memory", "Train/Samples/memory_total_bytes", "model states (MiB, rank 0)"),
)
DEFAULT_NAME = "training.png"


@dataclass(frozen=True)
class Series:
    """One event's points, in file order."""

    steps: list[int]
    values: list[float]


@dataclass(frozen=True)
class PlotResult:
    """The PNG written, and per event name the points its line was drawn through."""

    path: Path
    drawn: dict[str, Series]


def read_series(path: str | os.PathLike[str]) -> Series:
    """One CSV monitor file's ``step,value`` rows (the last run's, after its last header row)."""
    steps: list[int] = []
    values: list[float] = []
    with open(path, newline="") as handle:
        for row in csv.reader(handle):
            if not row:
                continue
            if row[0] == "step":  # a (new) run's header
                steps, values = [], []
                continue
            if len(row) != 2:
                raise ValueError(f"{path}: expected rows 'step,value' (a CSV monitor file), got {row!r}")
            steps.append(int(float(row[0])))
            values.append(float(row[1]))
    return Series(steps, values)


def read_run(run_dir: str | os.PathLike[str]) -> dict[str, Series]:
    """The panels' series found in ``run_dir``, by event name."""
    root = Path(run_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"run directory {str(root)!r} does not exist; pass a CSV monitor's directory "
                                f"(csv_monitor.output_path/job_name)")
    found = {name: read_series(root / csv_file_name(name)) for _, name, _ in PANELS
             if (root / csv_file_name(name)).is_file()}
    if not found:
        wanted = ", ".join(csv_file_name(name) for _, name, _ in PANELS)
        raise FileNotFoundError(f"{str(root)!r} holds none of the CSV monitor files {wanted}; enable "
                                f"\"csv_monitor\" in the config and pass its output_path/job_name directory")
    return found


def plot_run(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> PlotResult:
    """Draw ``run_dir``'s loss, learning rate, throughput and memory over ``global_samples`` into
    ``out`` (default ``run_dir/training.png``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    series = read_run(run_dir)
    path = Path(out) if out is not None else Path(run_dir) / DEFAULT_NAME
    figure = Figure(figsize=(10, 7), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(2, 2, sharex=True).flatten()
    drawn: dict[str, Series] = {}
    for ax, (title, name, label) in zip(axes, PANELS):
        ax.set_title(title)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        data = series.get(name)
        if data is None:
            ax.text(0.5, 0.5, f"no {csv_file_name(name)}", ha="center", va="center", transform=ax.transAxes)
            continue
        (line,) = ax.plot(data.steps, data.values, linewidth=1.2)
        drawn[name] = Series([int(x) for x in line.get_xdata()], [float(y) for y in line.get_ydata()])
        if name.endswith("_bytes"):  # bytes drawn as they are, ticks shown in MiB
            ax.yaxis.set_major_formatter(FuncFormatter(_mib))
    for ax in axes[2:]:
        ax.set_xlabel("samples (global_samples)")
    figure.suptitle(f"zerospeed run {Path(run_dir).resolve().name}")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    return PlotResult(path=path, drawn=drawn)


def _mib(value: float, _position: Any) -> str:
    return f"{value / 2**20:.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    """``zerospeed plot RUN_DIR [-o OUT]``: prints the PNG's path; exit code 2 on a missing run."""
    # Plain text: the module docstring is reST (double backticks) and would show its markup in --help.
    parser = argparse.ArgumentParser(
        prog="zerospeed plot",
        description="Draw a run's loss, learning rate, throughput and memory over global_samples into one "
        "PNG, from the files of a CSV monitor (the \"csv_monitor\" config section). Prints the PNG's path.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help="a CSV monitor's directory: csv_monitor.output_path/job_name")
    parser.add_argument("-o", "--output", default=None, metavar="OUT",
                        help=f"the PNG to write (default: RUN_DIR/{DEFAULT_NAME})")
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        result = plot_run(args.run_dir, args.output)
    except (FileNotFoundError, ValueError) as exc:
        print(f"zerospeed plot: error: {exc}", file=sys.stderr)
        return 2
    print(result.path)
    return 0


__all__ = ["PANELS", "PlotResult", "Series", "main", "plot_run", "read_run", "read_series"]
