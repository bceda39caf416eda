"""Pipeline checkpoints (issue 18) reshard across the pipeline degree as well as TP and DP.

The GPT pipeline (embedding tied to the head, 4 MLP blocks, hidden 16) trains at pp=2 x tp=2 (4 ranks,
dp=1; AdamW, clipping, ZeRO stage 1) for 3 steps, saves, and trains 2 more: the uninterrupted run. The
checkpoint must describe the whole model (each stage wrote its own layers, the tie once) and loads at
pp=1 x tp=1 (1 rank), at pp=4 x tp=1 (4 ranks) and at dp=2 x pp=2 (4 ranks, ZeRO-1 shards over the
replicas); the next 2 steps on the same data must give the uninterrupted run's losses within 1e-5 (Adam's
moments and step are restored by global name, the tied copies on the first and last stages each from the
one stored tensor). Every run sees the same global batch: 4 micro-batches of 2 rows (at dp=2, each
replica takes 2 of them per step, and the run resumes at the start of a window of 2). A save that fails on one stage raises on every rank and leaves
the previous ``latest`` in place. Real gloo processes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import zerospeed
from zerospeed.checkpoint import get_fp32_state_dict
from zerospeed.checkpoint.layout import CheckpointError
from zerospeed.checkpoint.model_record import merge_records
from zerospeed.distributed.groups import group_size
from zerospeed.distributed.mesh import ParallelDims
from zerospeed.testing import run_distributed
from zerospeed.testing.pipe_models import gpt_pipeline, plain_reference, token_batches

pytestmark = pytest.mark.spawns

LR, CLIP, BLOCKS, MICRO, SAVE_AT, MORE, ATOL = 1e-2, 0.5, 4, 4, 3, 2, 1e-5
TAG = f"global_step{SAVE_AT}"
BATCHES = token_batches(SAVE_AT + MORE, MICRO, 2)  # [step][micro][dp rank]: dp=1 in every run


def _engine(pp: int, tp: int, dp: int = 1) -> Any:
    mesh = ParallelDims(group_size(), tp=tp, pp=pp).build() if tp > 1 else None
    module = gpt_pipeline(pp, blocks=BLOCKS, tp_group=mesh)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": MICRO // dp,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
              "gradient_clipping": CLIP, "zero_optimization": {"stage": 1}, "steps_per_print": 1000}
    engine, *_ = zerospeed.initialize(model=module, config=config, mpu=mesh)
    assert engine.comm.world_size == dp
    return engine


def _train(engine: Any, steps: range) -> list[float]:
    """One loss per step; data-parallel rank ``r`` of ``dp`` takes micro-batches ``r, r + dp, ...``."""
    dp, rank = engine.comm.world_size, engine.comm.rank
    it = iter([micro[0] for step in BATCHES[steps.start: steps.stop] for micro in step[rank::dp]])
    return [float(engine.train_batch(it)) for _ in steps]


def _save_pp2_tp2(save_dir: str) -> list[float]:
    """3 steps, save, 2 more: the uninterrupted run's last 2 losses."""
    engine = _engine(2, 2)
    _train(engine, range(SAVE_AT))
    engine.save_checkpoint(save_dir)
    return _train(engine, range(SAVE_AT, SAVE_AT + MORE))


def _resume(pp: int, dp: int, load_dir: str) -> list[float]:
    engine = _engine(pp, 1, dp)
    path, _ = engine.load_checkpoint(load_dir)
    assert path is not None and engine.global_steps == SAVE_AT and engine.micro_steps == SAVE_AT * MICRO // dp
    return _train(engine, range(SAVE_AT, SAVE_AT + MORE))


def test_pipeline_checkpoint_reshards_across_pp_and_tp(tmp_path: Path) -> None:
    save_dir = str(tmp_path / "pp2tp2")
    uninterrupted = run_distributed(_save_pp2_tp2, 4, save_dir, timeout=240)
    assert all(losses == uninterrupted[0] for losses in uninterrupted)  # every stage reports the batch loss

    manifest = json.loads((tmp_path / "pp2tp2" / TAG / "manifest.json").read_text())
    assert manifest["pipeline"] == {"degree": 2} and manifest["tensor_parallel"]["degree"] == 2
    _, _, reference = plain_reference(BATCHES[:SAVE_AT], lr=LR, clip=CLIP, blocks=BLOCKS)
    assert [p["name"] for p in manifest["params"]] == list(reference)  # the whole model, stage by stage
    tied = [f for f in manifest["fragments"] if f["param"] == "tied_modules.embed.weight" and f["kind"] == "master"]
    assert len(tied) == 1  # stored once, by the first stage (the last stage's copy is equal)
    weights = get_fp32_state_dict(save_dir)  # the parts joined: the plain run's parameters after 3 steps
    for name, value in reference.items():
        torch.testing.assert_close(weights[name], value, atol=ATOL, rtol=ATOL, msg=name)

    (one_rank,) = run_distributed(_resume, 1, 1, 1, save_dir, timeout=240)
    assert one_rank == pytest.approx(uninterrupted[0], abs=ATOL, rel=0)
    for pp, dp in ((4, 1), (2, 2)):
        for losses in run_distributed(_resume, 4, pp, dp, save_dir, timeout=240):
            assert losses == pytest.approx(uninterrupted[0], abs=ATOL, rel=0), (pp, dp)


def _failing_save(save_dir: str) -> dict[str, Any]:
    """pp=2: a good save, then one whose last stage cannot write its file (and save_16bit_model, which
    would write the first stage's layers only, refused on every rank)."""
    engine = _engine(2, 1)
    _train(engine, range(1))
    engine.save_checkpoint(save_dir, tag="good")
    with pytest.raises(CheckpointError, match="zerospeed convert"):
        engine.save_16bit_model(save_dir + "-weights")
    _train(engine, range(1, 2))
    if engine.stage_id == 1:
        from zerospeed.checkpoint import commit

        def fail(self: Any) -> None:
            raise OSError("disk full (injected)")

        commit.SaveJob.write_tensors = fail  # type: ignore[method-assign]  # this process only
    try:
        engine.save_checkpoint(save_dir, tag="bad")
    except Exception as exc:  # noqa: BLE001 - reported to the test
        error = f"{type(exc).__name__}: {exc}"
    else:
        error = ""
    return {"error": error, "stage": engine.stage_id}


def test_failed_stage_save_keeps_latest(tmp_path: Path) -> None:
    save_dir = str(tmp_path / "ckpt")
    results = run_distributed(_failing_save, 2, save_dir, timeout=240)
    assert all("disk full (injected)" in r["error"] for r in results), results
    assert (tmp_path / "ckpt" / "latest").read_text() == "good"
    assert sorted(os.listdir(save_dir)) == [".zerospeed-save.lock", "good", "latest"]  # and the folder's lock
    manifest = json.loads((tmp_path / "ckpt" / "good" / "manifest.json").read_text())
    assert "4.fc1.weight" in {p["name"] for p in manifest["params"]}  # the last stage's layers are in it


def test_tied_copies_are_stored_by_the_lowest_stage() -> None:
    """Pure: the last stage's copy of the embedding is written by the first stage."""
    assert gpt_pipeline(2, blocks=BLOCKS, stage_id=0).tied_copies_below() == frozenset()
    assert gpt_pipeline(2, blocks=BLOCKS, stage_id=1).tied_copies_below() == {"tied_modules.embed.weight"}


def test_merged_manifest_refuses_copies_built_differently() -> None:
    """Pure: two stages describing one tied name with different shapes is an error naming it."""
    def record(shape: list[int]) -> dict[str, Any]:
        return {"params": [{"name": "tied_modules.embed.weight", "shape": shape, "dtype": "float32",
                            "trainable": True}], "tensor_parallel": {"degree": 1, "splits": {}},
                "aliases": {}, "buffers": []}

    merged = merge_records([record([32, 16]), record([32, 16])])
    assert merged["version"] == 1 and len(merged["params"]) == 1 and "tensor_parallel" not in merged
    with pytest.raises(CheckpointError, match=r"rank 1 holds parameter tied_modules\.embed\.weight"):
        merge_records([record([32, 16]), record([32, 8])])
