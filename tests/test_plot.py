"""``zerospeed plot RUN_DIR``: the PNG of a CSV monitor run, its drawn lines equal to the CSV files."""

from __future__ import annotations

from pathlib import Path

import pytest

from zerospeed.launcher.cli import main as cli_main
from zerospeed.monitor import csvMonitor, get_monitor_config
from zerospeed.monitor.plot import PANELS, plot_run, read_run

pytest.importorskip("matplotlib")

LOSSES = [5.5, 4.25, 3.125, 2.75]
LRS = [1e-3, 2e-3, 3e-3, 2.5e-3]
RATES = [100.0, 180.5, 181.25, 179.0]
MEMORY = [2**20 * 3, 2**20 * 3, 2**20 * 3 + 512, 2**20 * 3 + 512]


def _write_run(root: Path, steps: int = 4, with_memory: bool = True) -> Path:
    cfg = get_monitor_config({"csv_monitor": {"enabled": True, "output_path": str(root), "job_name": "run"}})
    monitor = csvMonitor(cfg.csv_monitor, rank=0)
    for i in range(steps):
        x = 16 * (i + 1)
        events = [("Train/Samples/train_loss", LOSSES[i], x), ("Train/Samples/lr", LRS[i], x),
                  ("Train/Samples/samples_per_sec", RATES[i], x)]
        if with_memory:
            events.append(("Train/Samples/memory_total_bytes", MEMORY[i], x))
        monitor.write_events(events)
    return root / "run"


def test_the_plot_draws_exactly_the_csv_series(tmp_path: Path) -> None:
    run = _write_run(tmp_path)
    result = plot_run(run)
    assert result.path == run / "training.png"
    assert result.path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    xs = [16, 32, 48, 64]
    assert result.drawn == {name: read_run(run)[name] for _, name, _ in PANELS}
    drawn = {name: (s.steps, s.values) for name, s in result.drawn.items()}
    assert drawn == {"Train/Samples/train_loss": (xs, LOSSES), "Train/Samples/lr": (xs, LRS),
                     "Train/Samples/samples_per_sec": (xs, RATES),
                     "Train/Samples/memory_total_bytes": (xs, [float(m) for m in MEMORY])}


def test_a_missing_series_leaves_its_panel_empty_and_a_rerun_is_drawn_from_its_last_run(tmp_path: Path) -> None:
    run = _write_run(tmp_path, with_memory=False)
    _write_run(tmp_path, steps=2, with_memory=False)  # a second run appends below new headers
    result = plot_run(run, tmp_path / "out" / "p.png")
    assert result.path.is_file()
    assert set(result.drawn) == {"Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/samples_per_sec"}
    assert result.drawn["Train/Samples/train_loss"].values == LOSSES[:2]


def test_cli_prints_the_png_path_and_refuses_a_run_without_csv_files(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    run = _write_run(tmp_path)
    assert cli_main(["plot", str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "training.png")
    (tmp_path / "empty").mkdir()
    assert cli_main(["plot", str(tmp_path / "empty")]) == 2
    out = capsys.readouterr().err
    assert "holds none of the CSV monitor files Train_Samples_train_loss.csv" in out
    assert cli_main(["plot", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
