"""Tensor-parallel checkpoints (issue 17) reshard across the tensor-parallel degree.

TinyGPT trains at tp=2 x dp=2 with ZeRO stage 1 for 3 steps, saves, and trains 2 more (the
uninterrupted run). The checkpoint then loads into a plain TinyGPT on 1 rank (tp=1: parts joined),
which saves it again as a plain checkpoint, and into TinyGPT at tp=4 on 4 ranks (parts split
further, along dim 1 for the row-parallel weights; saved again at tp=4, which loads back at tp=2 under
ZeRO stage 3), as does the plain checkpoint; after each load
the next 2 steps' losses must match the uninterrupted run's within 1e-5 (Adam's moments and step
are resharded with the weights). Every run sees the same global batch of 4 rows
(``token_batch``): each data-parallel rank takes its rows, tensor-parallel peers the same rows.
``zerospeed convert`` of the tp=2 checkpoint must equal a plain single-process PyTorch run's
state dict after 3 steps, and ``save_16bit_model`` at tp=4 (slices joined) must equal the conversion.
Saves at ZeRO stages 0 and 3 (other fragment layouts of the same parts) must convert to it too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import zerospeed
from zerospeed.checkpoint import convert_checkpoint, get_fp32_state_dict, load_state_dict_from_checkpoint
from zerospeed.distributed.mesh import ParallelDims
from zerospeed.testing import run_distributed
from zerospeed.testing.tp_models import GPTConfig, TinyGPT, token_batch

pytestmark = pytest.mark.spawns

CFG = GPTConfig()
ROWS, SAVE_AT, MORE, LR, ATOL = 4, 3, 2, 0.01, 1e-5
CLIP = 1.0  # gradients are clipped by the global norm (each parameter counted once across TP ranks)
TAG = f"global_step{SAVE_AT}"


def _engine(tp: int, world: int, stage: int = 1) -> tuple[Any, int]:
    """An engine over TinyGPT at ``tp`` (plain TinyGPT at tp=1, no mesh) and its data-parallel rank."""
    torch.manual_seed(0)
    mesh = ParallelDims(world_size=world, tp=tp).build() if tp > 1 else None
    model = TinyGPT(CFG, tp_group=mesh) if mesh is not None else TinyGPT(CFG)
    dp = world // tp
    config = {"train_batch_size": ROWS, "train_micro_batch_size_per_gpu": ROWS // dp,
              "zero_optimization": {"stage": stage}, "gradient_clipping": CLIP}
    engine, *_ = zerospeed.initialize(model=model, config=config, mpu=mesh,
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=LR))
    return engine, engine.comm.rank


def _step(engine: Any, step: int, dp_rank: int, dp: int) -> float:
    ids, targets = token_batch(step, ROWS, CFG)
    rows = slice(dp_rank * ROWS // dp, (dp_rank + 1) * ROWS // dp)
    loss = engine(ids[rows], targets[rows])
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def _train(engine: Any, steps: range, save_dir: str | None = None) -> list[float]:
    """Each step's global-batch loss (mean over data-parallel ranks); saves before step 3 if asked."""
    dp, losses = engine.comm.world_size, []
    for step in steps:
        if step == SAVE_AT and save_dir is not None:
            engine.save_checkpoint(save_dir)
        loss = torch.tensor(_step(engine, step, engine.comm.rank, dp))
        engine.comm.all_reduce(loss)
        losses.append(float(loss) / dp)
    return losses


def _resume(engine: Any, load_dir: str) -> list[float]:
    path, _ = engine.load_checkpoint(load_dir)
    assert path is not None and engine.global_steps == SAVE_AT
    return _train(engine, range(SAVE_AT, SAVE_AT + MORE))


def _save_tp2(save_dir: str) -> list[float]:
    """tp=2 x dp=2: 3 steps, save, 2 more (the uninterrupted run)."""
    engine, _ = _engine(2, 4)
    return _train(engine, range(SAVE_AT + MORE), save_dir)[-MORE:]


def _load_plain(tp2_dir: str, plain_dir: str) -> list[float]:
    """One rank, plain TinyGPT: load the tp=2 checkpoint (parts joined), save it again (a checkpoint
    without tensor parallelism) and train on."""
    engine, _ = _engine(1, 1)
    engine.load_checkpoint(tp2_dir)
    engine.save_checkpoint(plain_dir, tag=TAG)
    return _train(engine, range(SAVE_AT, SAVE_AT + MORE))


def _load_tp4(tp2_dir: str, plain_dir: str, weights_dir: str, tp4_dir: str) -> dict[str, Any]:
    """tp=4 on 4 ranks: resume from the tp=2 checkpoint (parts split further; saved again at tp=4) and
    from the plain one (the full tensors split); a fresh tp=4 model reads the same slices without an
    engine; and ``save_16bit_model`` writes the tp=2 checkpoint's weights whole."""
    engine, _ = _engine(4, 4)
    engine.load_checkpoint(tp2_dir)
    engine.save_checkpoint(tp4_dir, tag=TAG)
    from_tp2 = _train(engine, range(SAVE_AT, SAVE_AT + MORE))
    from_plain = _resume(engine, plain_dir)
    torch.manual_seed(1)
    fresh = load_state_dict_from_checkpoint(TinyGPT(CFG, tp_group=engine.mesh), tp2_dir)
    engine.load_checkpoint(tp2_dir)
    same = all(torch.equal(a, b) for a, b in zip(fresh.parameters(), engine.module.parameters(), strict=True))
    engine.save_16bit_model(weights_dir, "model.safetensors")
    return {"from_tp2": from_tp2, "from_plain": from_plain, "standalone_load_matches": same}


def _load_tp2_stage3(tp4_dir: str) -> list[float]:
    """tp=2 x dp=2 at ZeRO stage 3: resume from the tp=4 checkpoint (pairs of parts joined)."""
    engine, _ = _engine(2, 4, stage=3)
    return _resume(engine, tp4_dir)


def _save_stages(save_dir: str) -> None:
    """tp=2 x dp=2 at ZeRO stages 0 (each data-parallel rank writes a share of every slice) and 3
    (each writes its shards' pieces): 3 steps, save."""
    for stage in (0, 3):
        engine, _ = _engine(2, 4, stage)
        _train(engine, range(SAVE_AT))
        engine.save_checkpoint(f"{save_dir}/stage{stage}")


def _reference_state() -> dict[str, torch.Tensor]:
    """Plain PyTorch, one process, the whole batch: the model after 3 steps (clipped as the engine clips)."""
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(SAVE_AT):
        loss = model(*token_batch(step, ROWS, CFG))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_tp_checkpoint_reshards_across_degrees(tmp_path: Path):
    tp2_dir, plain_dir = str(tmp_path / "tp2"), str(tmp_path / "plain")
    uninterrupted = run_distributed(_save_tp2, 4, tp2_dir, timeout=300)[0]
    manifest = json.loads((tmp_path / "tp2" / TAG / "manifest.json").read_text())
    assert manifest["version"] == 2 and manifest["tensor_parallel"]["degree"] == 2
    assert manifest["tensor_parallel"]["splits"]["blocks.0.mlp.fc2.weight"] == 1  # row-parallel: columns
    stored = {f["param"] for f in manifest["fragments"]}
    assert {"blocks.0.mlp.fc2.weight#tp0of2", "blocks.0.mlp.fc2.weight#tp1of2", "ln_f.weight"} <= stored

    plain = run_distributed(_load_plain, 1, tp2_dir, plain_dir, timeout=300)[0]
    assert plain == pytest.approx(uninterrupted, abs=ATOL)
    plain_manifest = json.loads((tmp_path / "plain" / TAG / "manifest.json").read_text())
    assert plain_manifest["version"] == 1 and "tensor_parallel" not in plain_manifest  # older readers read it

    weights_dir, tp4_dir = str(tmp_path / "weights"), str(tmp_path / "tp4")
    for rank in run_distributed(_load_tp4, 4, tp2_dir, plain_dir, weights_dir, tp4_dir, timeout=300):
        assert rank["from_tp2"] == pytest.approx(uninterrupted, abs=ATOL)
        assert rank["from_plain"] == pytest.approx(uninterrupted, abs=ATOL)
        assert rank["standalone_load_matches"]

    for losses in run_distributed(_load_tp2_stage3, 4, tp4_dir, timeout=300):
        assert losses == pytest.approx(uninterrupted, abs=ATOL)

    files = convert_checkpoint(tp2_dir, str(tmp_path / "model.safetensors"))
    converted = load_file(files[0])
    reference = _reference_state()
    assert sorted(converted) == sorted(reference)
    for name, value in reference.items():
        assert converted[name].shape == value.shape, name
        torch.testing.assert_close(converted[name], value, atol=ATOL, rtol=0, msg=name)
    assert load_file(str(tmp_path / "weights" / "model.safetensors")).keys() == converted.keys()
    for name, value in load_file(str(tmp_path / "weights" / "model.safetensors")).items():
        assert torch.equal(value, converted[name]), name  # fp32 compute: the masters themselves


def test_tp_checkpoint_at_stages_0_and_3(tmp_path: Path):
    run_distributed(_save_stages, 4, str(tmp_path), timeout=300)
    reference = _reference_state()
    for stage in (0, 3):
        weights = get_fp32_state_dict(str(tmp_path / f"stage{stage}"))
        assert sorted(weights) == sorted(reference)
        for name, value in reference.items():
            torch.testing.assert_close(weights[name], value, atol=ATOL, rtol=0, msg=f"stage {stage}: {name}")
