"""ZeRO-Infinity's optimizer tier: ``offload_optimizer.device: nvme`` against the same run in memory.

Masters and Adam states of every unit live in swap files under ``nvme_path`` and stream through
memory at each step. Stages 1-3 on 1 and 2 ranks with accumulation and clipping must equal the run
without offload to 1e-6 (fp32); a checkpoint saved from an NVMe run loads into an in-memory run;
the swap files live in a directory of their own and are gone when the engine is.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.testing import run_distributed
from zerospeed.testing.configs import adamw, train_config, zero_section
from zerospeed.testing.data import seeded_regression_batch
from zerospeed.testing.models import seeded_mlp

STEPS = 3


def _model() -> nn.Module:
    return seeded_mlp(12, 24, 24, 5)


def _config(stage: int, nvme: str | None) -> dict[str, Any]:
    zero = zero_section(stage, reduce_bucket_size=200, persistence_threshold=10)
    if nvme is not None:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "pipeline_read": True,
                                     "buffer_count": 4}
    return train_config(micro=2, accum=2, clip=0.05, optimizer=adamw(3e-3), zero=zero,
                        aio={"block_size": 4096, "queue_depth": 4})


def _train(engine: Any) -> list[float]:
    rank = torch.distributed.get_rank()
    losses = []
    for step in range(STEPS * 2):
        x, y = seeded_regression_batch(step, rank, rows=2, inputs=12, outputs=5)
        loss = (engine(x) - y).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _full_state(engine: Any) -> list[float]:
    out = []
    for p in engine.module.parameters():
        out.append(zerospeed.utils.safe_get_full_fp32_param(p).reshape(-1))
        out.append(zerospeed.utils.safe_get_full_optimizer_state(p, "exp_avg_sq").reshape(-1))
    return torch.cat(out).tolist()


def _compare(root: str) -> list[dict[str, Any]]:
    rank = torch.distributed.get_rank()
    out = []
    for stage in (1, 2, 3):
        plain, *_ = zerospeed.initialize(model=_model(), config=_config(stage, None))
        nvme_dir = os.path.join(root, f"nvme{stage}")
        os.makedirs(nvme_dir, exist_ok=True)
        swapped, optimizer, *_ = zerospeed.initialize(model=_model(), config=_config(stage, nvme_dir))
        losses_plain, losses_nvme = _train(plain), _train(swapped)
        # this rank's own directory only: the other rank may be removing its own meanwhile
        own = swapped.state.zero_optimizer.swapped.directory.path
        files = sorted(str(p.relative_to(nvme_dir)) for p in own.glob("*.bin"))
        resident = swapped.state.zero_optimizer.swapped.slabs.resident
        memory = swapped.memory_breakdown()
        ckpt = os.path.join(root, f"ckpt{stage}")
        swapped.save_checkpoint(ckpt, tag="t")
        loaded, *_ = zerospeed.initialize(model=_model(), config=_config(stage, None))
        loaded.load_checkpoint(ckpt, tag="t")
        out.append({"stage": stage, "losses": [losses_plain, losses_nvme], "optimizer": type(optimizer).__name__,
                    "state": [_full_state(plain), _full_state(swapped), _full_state(loaded)],
                    "files": [f for f in files if f"rank{rank}" in f], "resident": sum(resident),
                    "moved": list(swapped.state.zero_optimizer.swapped.bytes_moved),
                    "grad_bytes": memory["grads"], "state_bytes": memory["optimizer_states"]})
        swapped.destroy()
        out[-1]["left"] = [str(own)] if own.exists() else []
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_nvme_optimizer_matches_in_memory(world: int, tmp_path: Path) -> None:
    results = run_distributed(_compare, world, str(tmp_path), timeout=300)
    for rank, cases in enumerate(results):
        for case in cases:
            what = f"stage {case['stage']} on {world} ranks, rank {rank}"
            assert case["optimizer"] == "CPUAdam", what
            plain, nvme = (torch.tensor(v) for v in case["losses"])
            torch.testing.assert_close(nvme, plain, rtol=1e-6, atol=1e-7, msg=what)
            state_plain, state_nvme, state_loaded = (torch.tensor(v) for v in case["state"])
            scale = state_plain.abs().max().item()
            torch.testing.assert_close(state_nvme, state_plain, rtol=1e-6, atol=1e-6 * scale, msg=what)
            assert torch.equal(state_loaded, state_nvme), what  # the checkpoint of the NVMe run, exactly
            # one file per unit in this rank's own directory; nothing resident between steps
            assert case["files"] and all(f"rank{rank}/unit" in f for f in case["files"]), (what, case["files"])
            assert case["resident"] == 0, what
            assert case["state_bytes"] == 0, what  # masters and Adam states: only in the swap files
            if case["stage"] > 1:  # stages 2-3: the gradient shards live in the slabs' gradient regions
                assert case["grad_bytes"] == 0, (what, case["grad_bytes"])
            read, written = case["moved"]
            assert read > 0 and written > 0, what
            assert case["left"] == [], (what, case["left"])  # removed with the engine


def test_swap_files_are_removed_when_the_process_exits(tmp_path: Path) -> None:
    """Without destroy(): the run directory goes at interpreter exit (a finalizer), not only at GC."""
    script = ("import sys, torch; from zerospeed.offload.nvme import RunDirectory, SwappedSlabs\n"
              "from zerospeed.ops.aio import AsyncIOHandle\n"
              "d = RunDirectory(sys.argv[1], 'exit-test', 0)\n"
              "s = SwappedSlabs([torch.ones(1000)], d, AsyncIOHandle())\n"
              "print(len(list(d.path.iterdir())))\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"  # the slab's file existed while the process ran
    assert list(tmp_path.iterdir()) == []


def _bf16_edits_and_loads(root: str) -> list[Any]:
    """bf16, stage 3: NVMe equals CPU offload exactly (same CPUAdam, same data); a GatheredParameters
    edit reaches the swapped master; a checkpoint loads into an NVMe engine."""
    def config(device: str) -> dict[str, Any]:
        cfg = _config(3, None)
        cfg["bf16"] = {"enabled": True}
        cfg["zero_optimization"]["offload_optimizer"] = (
            {"device": "cpu"} if device == "cpu" else {"device": "nvme", "nvme_path": root})
        return cfg

    def run(engine: Any) -> None:
        rank = torch.distributed.get_rank()
        for step in range(4):
            g = torch.Generator().manual_seed(step + 10 * rank)
            engine.backward(engine(torch.randn(2, 12, generator=g).bfloat16()).float().pow(2).mean())
            engine.step()

    cpu, *_ = zerospeed.initialize(model=_model(), config=config("cpu"))
    nvme, *_ = zerospeed.initialize(model=_model(), config=config("nvme"))
    both_cfg = config("nvme")
    both_cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": root, "max_in_cpu": 0}
    both, *_ = zerospeed.initialize(model=_model(), config=both_cfg)  # parameters on NVMe as well
    # max_in_cpu: the first unit's shard fits and stays in memory, the others go to NVMe
    first_unit = next(u for u in cpu.state.units if not u.persistent)
    part_cfg = config("nvme")
    part_cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": root,
                                                      "max_in_cpu": first_unit.plan.shard_numel}
    part, *_ = zerospeed.initialize(model=_model(), config=part_cfg)
    kept = [u.shard_lease is None for u in part.state.units if not u.persistent]
    run(cpu)
    run(nvme)
    run(both)
    run(part)
    same = _full_state(cpu) == _full_state(nvme) == _full_state(both) == _full_state(part)
    both.destroy()
    part.destroy()
    first = next(nvme.module.parameters())
    with zerospeed.zero.GatheredParameters(first, modifier_rank=0):
        with torch.no_grad():
            first.fill_(0.25)
    edited = bool((zerospeed.utils.safe_get_full_fp32_param(first) == 0.25).all())
    cpu.save_checkpoint(os.path.join(root, "ckpt"), tag="t")
    loaded, *_ = zerospeed.initialize(model=_model(), config=config("nvme"))
    loaded.load_checkpoint(os.path.join(root, "ckpt"), tag="t")
    reloaded = _full_state(loaded) == _full_state(cpu)
    run(cpu)
    run(loaded)  # and training goes on identically from there
    continued = _full_state(loaded) == _full_state(cpu)
    for engine in (nvme, loaded):
        engine.destroy()
    return [same, edited, reloaded, continued, kept]


def test_nvme_bf16_edits_and_loading_into_an_nvme_engine(tmp_path: Path) -> None:
    for rank, (same, edited, reloaded, continued, kept) in enumerate(run_distributed(_bf16_edits_and_loads, 2,
                                                                                      str(tmp_path), timeout=300)):
        assert kept[0] and not all(kept), f"rank {rank}: max_in_cpu should keep exactly the first unit: {kept}"
        assert same, f"rank {rank}: NVMe (parameters also on NVMe, or partly kept by max_in_cpu) and CPU offload differ in bf16"
        assert edited, f"rank {rank}: a GatheredParameters edit did not reach the swapped master"
        assert reloaded and continued, f"rank {rank}: loading into an NVMe engine (reloaded={reloaded})"


def _params_on_nvme(root: str) -> list[Any]:
    """Stage 3 with offload_param nvme (and the optimizer on NVMe or CPU): equal to the in-memory run;
    no parameter shard stays in memory between steps."""
    out = []
    for optimizer_device in ("cpu", "nvme"):
        plain, *_ = zerospeed.initialize(model=_model(), config=_config(3, None))
        cfg = _config(3, None)
        cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": root, "max_in_cpu": 0}
        cfg["zero_optimization"]["offload_optimizer"] = (
            {"device": "cpu"} if optimizer_device == "cpu" else {"device": "nvme", "nvme_path": root})
        swapped, *_ = zerospeed.initialize(model=_model(), config=cfg)
        losses = [_train(plain), _train(swapped)]
        resident = sum(swapped.state.param_swap.resident)
        on_nvme = swapped.memory_breakdown()["on_nvme"]
        ckpt = os.path.join(root, f"ckpt-{optimizer_device}")
        swapped.save_checkpoint(ckpt, tag="t")
        loaded, *_ = zerospeed.initialize(model=_model(), config=cfg)
        loaded.load_checkpoint(ckpt, tag="t")
        out.append({"device": optimizer_device, "losses": losses, "resident": resident, "on_nvme": on_nvme,
                    "state": [_full_state(plain), _full_state(swapped), _full_state(loaded)]})
        swapped.destroy()
        loaded.destroy()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_stage3_parameters_on_nvme_match_in_memory(world: int, tmp_path: Path) -> None:
    for rank, cases in enumerate(run_distributed(_params_on_nvme, world, str(tmp_path), timeout=300)):
        for case in cases:
            what = f"offload_param nvme, optimizer on {case['device']}, {world} ranks, rank {rank}"
            plain, nvme = (torch.tensor(v) for v in case["losses"])
            torch.testing.assert_close(nvme, plain, rtol=1e-6, atol=1e-7, msg=what)
            state_plain, state_nvme, state_loaded = (torch.tensor(v) for v in case["state"])
            scale = state_plain.abs().max().item()
            torch.testing.assert_close(state_nvme, state_plain, rtol=1e-6, atol=1e-6 * scale, msg=what)
            assert torch.equal(state_loaded, state_nvme), what
            assert case["resident"] == 0 and case["on_nvme"] > 0, (what, case["resident"], case["on_nvme"])
    assert not any(tmp_path.rglob("*.bin"))  # every swap file went with destroy()


def _one_rank_has_no_path(root: str) -> str:
    rank = torch.distributed.get_rank()
    path = root if rank == 0 else os.path.join(root, "missing")
    try:
        zerospeed.initialize(model=_model(), config=_config(2, path))
    except (OSError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_swap_path_missing_on_one_rank_fails_every_rank(tmp_path: Path) -> None:
    ok_rank, bad_rank = run_distributed(_one_rank_has_no_path, 2, str(tmp_path), timeout=120)
    assert bad_rank.startswith("FileNotFoundError") and "does not exist" in bad_rank
    assert ok_rank.startswith("RuntimeError") and "failed on other ranks: rank 1: FileNotFoundError" in ok_rank


def _no_optimizer(root: str) -> list[Any]:
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": root}}}
    engine, optimizer, *_ = zerospeed.initialize(model=_model(), config=cfg)
    out = engine(torch.randn(2, 12))
    return [optimizer is None, tuple(out.shape), sorted(os.listdir(root))]


def test_without_an_optimizer_nothing_goes_to_nvme(tmp_path: Path) -> None:
    """An inference engine from a training config: no optimizer states, so no swap files (not an error)."""
    no_optimizer, shape, files = run_distributed(_no_optimizer, 1, str(tmp_path), timeout=120)[0]
    assert no_optimizer and shape == (2, 5) and files == []
