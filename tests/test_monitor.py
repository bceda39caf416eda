"""Monitors (DeepSpeed's ``deepspeed.monitor``): the CSV layout, TensorBoard read back with its own
event reader, W&B offline files, rank 0 alone writing, DeepSpeed's event names and one value per
optimizer step equal to the engine's losses, learning rates and loss scales."""

from __future__ import annotations

import csv
import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.monitor import MonitorMaster, csvMonitor, get_monitor_config
from zerospeed.monitor.plot import read_series
from zerospeed.monitor.utils import MonitorUnavailable
from zerospeed.testing import run_distributed

pytestmark = pytest.mark.spawns

DEEPSPEED_EVENTS = {
    "Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/loss_scale",
    "Train/Samples/elapsed_time_ms_forward", "Train/Samples/elapsed_time_ms_backward",
    "Train/Samples/elapsed_time_ms_backward_inner", "Train/Samples/elapsed_time_ms_backward_allreduce",
    "Train/Samples/elapsed_time_ms_step",
}
OWN_EVENTS = {"Train/Samples/samples_per_sec", "Train/Samples/memory_total_bytes"}
STEPS, ACCUM, MICRO = 4, 2, 3


def _rows(path: Path) -> list[list[str]]:
    with open(path, newline="") as handle:
        return list(csv.reader(handle))


def test_csv_layout_is_deepspeeds_and_a_second_run_appends_below_a_new_header(tmp_path: Path) -> None:
    cfg = get_monitor_config({"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "job"}})
    first = csvMonitor(cfg.csv_monitor, rank=0)
    first.write_events([("Train/Samples/lr", 0.5, 8), ("my metric", 3, 8)])
    first.write_events([("Train/Samples/lr", 0.25, 16)])
    assert sorted(p.name for p in (tmp_path / "job").iterdir()) == ["Train_Samples_lr.csv", "my_metric.csv"]
    assert _rows(tmp_path / "job" / "Train_Samples_lr.csv") == [["step", "lr"], ["8", "0.5"], ["16", "0.25"]]
    assert _rows(tmp_path / "job" / "my_metric.csv") == [["step", "my metric"], ["8", "3"]]
    csvMonitor(cfg.csv_monitor, rank=0).write_events([("Train/Samples/lr", 0.125, 8)])
    assert _rows(tmp_path / "job" / "Train_Samples_lr.csv")[-2:] == [["step", "lr"], ["8", "0.125"]]
    series = read_series(tmp_path / "job" / "Train_Samples_lr.csv")  # the last run
    assert (series.steps, series.values) == ([8], [0.125])


def test_other_ranks_build_no_monitor_and_write_nothing(tmp_path: Path) -> None:
    cfg = get_monitor_config({"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "j"}})
    master = MonitorMaster(cfg, rank=1)
    assert master.enabled and master.monitors() == []
    master.write_events([("x", 1.0, 1)])
    assert list(tmp_path.iterdir()) == []
    assert not MonitorMaster(get_monitor_config({}), rank=0).enabled


@pytest.mark.skipif(importlib.util.find_spec("comet_ml") is not None, reason="comet_ml is installed here")
def test_comet_without_comet_ml_names_the_package_and_the_pip_command() -> None:
    cfg = get_monitor_config({"comet": {"enabled": True}})
    message = ('comet.enabled is true but the comet_ml package is not installed: pip install "comet_ml>=3.41.0", '
               'or set comet.enabled to false')
    with pytest.raises(MonitorUnavailable) as info:
        MonitorMaster(cfg, rank=1)  # every rank checks, so the whole job stops
    assert str(info.value) == message


def _train(tmp: str, fp16: bool) -> dict[str, Any]:
    rank = torch.distributed.get_rank()
    out_dir = os.path.join(tmp, f"rank{rank}")  # each rank is told its own directory: only rank 0's may appear
    os.environ["WANDB_MODE"] = "offline"
    os.environ["WANDB_DIR"] = os.path.join(out_dir, "wandb_dir")
    os.environ["WANDB_SILENT"] = "true"
    torch.manual_seed(0)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM, "steps_per_print": 1000,
        "wall_clock_breakdown": True,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                      "warmup_num_steps": 3, "warmup_type": "linear"}},
        "csv_monitor": {"enabled": True, "output_path": out_dir, "job_name": "csvjob"},
        "tensorboard": {"enabled": True, "output_path": out_dir, "job_name": "tbjob"},
        "wandb": {"enabled": True, "project": "zerospeed-test"},
    }
    if fp16:
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    else:
        os.environ.pop("WANDB_MODE")  # wandb only in the first run (it is slow to start)
        del config["wandb"]
    engine, *_ = zerospeed.initialize(model=nn.Linear(6, 3), config=config)
    losses, lrs, samples, scales = [], [], [], []
    gen = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        for _ in range(ACCUM):
            x = torch.randn(MICRO, 6, generator=gen)
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        lrs.append(engine.get_lr()[0])
        samples.append(engine.global_samples)
        scales.append(engine.cur_scale)
    engine.monitor.write_events([("Custom/user_metric", 2.5, 7)])
    engine.destroy()
    return {"losses": losses, "lrs": lrs, "samples": samples, "scales": scales,
            "files": sorted(str(p.relative_to(out_dir)) for p in Path(out_dir).rglob("*"))
            if os.path.isdir(out_dir) else []}


def _expected_losses(outs: list[dict[str, Any]]) -> list[float]:
    """Per optimizer step: the window's mean micro-batch loss, averaged over the ranks."""
    return [sum(sum(o["losses"][s * ACCUM:(s + 1) * ACCUM]) / ACCUM for o in outs) / len(outs)
            for s in range(STEPS)]


def _check_values(read: dict[str, tuple[list[int], list[float]]], outs: list[dict[str, Any]], names: set[str]) -> None:
    rank0 = outs[0]
    for name in names:
        steps, _ = read[name]
        assert steps == rank0["samples"], name  # one value per optimizer step, x = global_samples
    assert read["Train/Samples/train_loss"][1] == pytest.approx(_expected_losses(outs), rel=1e-6)
    assert read["Train/Samples/lr"][1] == pytest.approx(rank0["lrs"], rel=1e-6)
    if "Train/Samples/loss_scale" in names:
        assert read["Train/Samples/loss_scale"][1] == rank0["scales"]
    assert all(v > 0 for v in read["Train/Samples/memory_total_bytes"][1])
    assert all(v > 0 for v in read["Train/Samples/samples_per_sec"][1])
    assert all(v >= 0 for phase in ("forward", "backward", "step")
               for v in read[f"Train/Samples/elapsed_time_ms_{phase}"][1])


def _read_csv_dir(path: Path) -> dict[str, tuple[list[int], list[float]]]:
    out = {}
    for file in path.iterdir():
        rows = _rows(file)
        name = "Train/Samples/" + file.stem.removeprefix("Train_Samples_")
        assert rows[0] == ["step", name.split("/")[-1]], file
        out[name] = ([int(r[0]) for r in rows[1:]], [float(r[1]) for r in rows[1:]])
    return out


def _read_tensorboard(path: Path) -> dict[str, tuple[list[int], list[float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path))
    acc.Reload()
    return {tag: ([e.step for e in acc.Scalars(tag)], [e.value for e in acc.Scalars(tag)])
            for tag in acc.Tags()["scalars"]}


def test_two_ranks_write_deepspeeds_events_once_per_step_on_rank_0_only(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    outs = run_distributed(_train, 2, str(tmp_path), True)
    assert outs[1]["files"] == []  # rank 1 wrote nothing: no CSV, no event file, no W&B run
    names = DEEPSPEED_EVENTS | OWN_EVENTS
    root = tmp_path / "rank0"
    csv_dir = root / "csvjob"
    # the user's event went to the CSV file of its own name, next to the engine's
    custom = _rows(csv_dir / "Custom_user_metric.csv")
    assert custom == [["step", "user_metric"], ["7", "2.5"]]
    (csv_dir / "Custom_user_metric.csv").unlink()
    from_csv = _read_csv_dir(csv_dir)
    assert set(from_csv) == names
    _check_values(from_csv, outs, names)
    from_tb = _read_tensorboard(root / "tbjob")
    assert set(from_tb) == names | {"Custom/user_metric"}
    _check_values(from_tb, outs, names)
    assert from_tb["Custom/user_metric"] == ([7], [2.5])
    # W&B offline: the run's files under WANDB_DIR
    runs = list((root / "wandb_dir" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((root / "wandb_dir").rglob("*"))
    assert list(runs[0].glob("run-*.wandb")), list(runs[0].iterdir())


def test_without_fp16_there_is_no_loss_scale_event(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    outs = run_distributed(_train, 2, str(tmp_path), False)
    names = (DEEPSPEED_EVENTS - {"Train/Samples/loss_scale"}) | OWN_EVENTS
    csv_dir = tmp_path / "rank0" / "csvjob"
    (csv_dir / "Custom_user_metric.csv").unlink()
    from_csv = _read_csv_dir(csv_dir)
    assert set(from_csv) == names
    _check_values(from_csv, outs, names)
    assert outs[1]["files"] == []


def _train_pipeline(tmp: str) -> dict[str, Any]:
    from zerospeed.testing.pipe_models import gpt_pipeline, rank_iterator, token_batches

    rank = torch.distributed.get_rank()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "wall_clock_breakdown": True,
              "pipeline": {"schedule": "1f1b"},
              "csv_monitor": {"enabled": True, "output_path": os.path.join(tmp, f"rank{rank}"), "job_name": "pipe"}}
    engine, *_ = zerospeed.initialize(model=gpt_pipeline(2, blocks=2), config=config)
    it = rank_iterator(token_batches(3, 2, 2), 0)
    losses = [float(engine.train_batch(it)) for _ in range(3)]
    # its batch loss is already averaged over dp: the events average it over nothing again
    return {"losses": losses, "global_samples": engine.global_samples,
            "events_average_again": engine.step_events.averaged_over is not None}


def test_a_pipeline_writes_the_batch_loss_once_per_train_batch(tmp_path: Path) -> None:
    outs = run_distributed(_train_pipeline, 2, str(tmp_path))  # 2 stages, one data-parallel replica
    assert not (tmp_path / "rank1").exists()
    read = _read_csv_dir(tmp_path / "rank0" / "pipe")
    assert set(read) == (DEEPSPEED_EVENTS - {"Train/Samples/loss_scale"}) | OWN_EVENTS
    assert outs[0]["global_samples"] == 12
    assert not any(out["events_average_again"] for out in outs)
    assert read["Train/Samples/train_loss"] == ([4, 8, 12], pytest.approx(outs[0]["losses"], rel=1e-6))
    assert read["Train/Samples/lr"] == ([4, 8, 12], [0.01] * 3)


class _CountingComm:
    """A two-rank Comm stand-in whose all_reduce halves (the other rank gave 0) and counts its calls."""

    world_size = 2

    def __init__(self) -> None:
        self.calls = 0

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        assert op == "avg"
        self.calls += 1
        tensor.div_(2)


def test_the_window_loss_is_averaged_over_comm_unless_already_averaged() -> None:
    """The engine's events average the window's losses over data parallelism with one all-reduce; the
    pipeline engine's batch loss already is, so its events (comm=None) issue none."""
    from zerospeed.monitor.events import StepEvents

    comm = _CountingComm()
    events = StepEvents(MonitorMaster(), comm=comm, fp16=False)  # type: ignore[arg-type]
    events.add_loss(torch.tensor(1.0))
    events.add_loss(torch.tensor(3.0))
    assert events.window_loss() == 1.0 and comm.calls == 1  # mean 2.0, averaged with the other rank's 0
    averaged = StepEvents(MonitorMaster(), comm=None, fp16=False)
    averaged.add_loss(torch.tensor(2.5))
    assert averaged.window_loss() == 2.5
    assert averaged.window_loss() != averaged.window_loss()  # NaN: no loss given since
