"""Checkpoints of an NVMe-tier run stream unit by unit (issue 7).

Saving and loading an engine whose optimizer state lives in NVMe slab files makes one unit resident
at a time, never all of them: the save of a 1- and a 2-rank stage-3 run (optimizer on NVMe, in one
case the parameters too) sees at most one slab resident, its files hold exactly the tensors the same
run saves with its state in CPU memory, and a fresh NVMe engine and an in-memory one that load it
continue exactly like the uninterrupted run. An asynchronous save writes the NVMe-tier part before
returning (and says so), and what it commits loads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch import nn

import zerospeed
from zerospeed.testing import log_messages, run_distributed
from zerospeed.testing.configs import adamw, train_config, zero_section
from zerospeed.testing.data import seeded_regression_batch
from zerospeed.testing.models import seeded_mlp
from zerospeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

BEFORE, AFTER = 2, 2  # steps before the save, steps after it


def _model() -> nn.Module:
    return seeded_mlp(12, 24, 24, 5)


def _config(root: str, optimizer: str, params_on_nvme: bool = False) -> dict[str, Any]:
    zero = zero_section(3, reduce_bucket_size=200, persistence_threshold=10,
                        offload_optimizer={"device": optimizer, **({"nvme_path": root} if optimizer == "nvme" else {})})
    if params_on_nvme:
        zero["offload_param"] = {"device": "nvme", "nvme_path": root, "max_in_cpu": 0}
    return train_config(micro=2, optimizer=adamw(3e-3), zero=zero, aio={"block_size": 4096, "queue_depth": 4})


def _train(engine: Any, steps: range) -> list[float]:
    rank = torch.distributed.get_rank()
    losses = []
    for step in steps:
        x, y = seeded_regression_batch(step, rank, rows=2, inputs=12, outputs=5)
        loss = (engine(x) - y).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _state(engine: Any) -> list[float]:
    """Every parameter's fp32 master and Adam moments, whole (collective)."""
    out = []
    for p in engine.module.parameters():
        out.append(safe_get_full_fp32_param(p).reshape(-1))
        for key in ("exp_avg", "exp_avg_sq"):
            out.append(safe_get_full_optimizer_state(p, key).reshape(-1))
    return torch.cat(out).tolist()


class ResidencyWatch:
    """Counts the resident optimizer slabs each time one is read in (the most seen at once)."""

    def __init__(self, engine: Any):
        self.slabs = engine.state.zero_optimizer.swapped.slabs
        self.most = 0
        self.reads = 0
        original = self.slabs.swap_in

        def swap_in(indices: Any) -> None:
            original(indices)
            self.reads += 1
            self.most = max(self.most, sum(self.slabs.resident))

        self.slabs.swap_in = swap_in


def _rank_tensors(ckpt: str) -> dict[str, list[float]]:
    rank = torch.distributed.get_rank()
    with safe_open(os.path.join(ckpt, f"rank{rank:05d}.safetensors"), "pt") as f:
        return {key: f.get_tensor(key).tolist() for key in f.keys()}


def _manifest(ckpt: str) -> dict[str, Any]:
    with open(os.path.join(ckpt, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["fragments"] = sorted(json.dumps(frag, sort_keys=True) for frag in manifest["fragments"])
    for key in ("config", "created", "manifest_crc32"):  # the manifest's own checksum covers the first two
        manifest.pop(key)
    # the same tensors in another order: the header's offsets (so its length) may differ, not the data
    manifest["files"] = sorted(manifest["files"])
    return manifest


def _save_and_resume(root: str, params_on_nvme: bool) -> dict[str, Any]:
    """An NVMe run saved after BEFORE steps against the same run in CPU memory; both continue, and a
    fresh NVMe engine and a fresh in-memory engine load the NVMe run's checkpoint and continue."""
    rank = torch.distributed.get_rank()
    nvme = os.path.join(root, "swap")
    os.makedirs(nvme, exist_ok=True)
    cfg = _config(nvme, "nvme", params_on_nvme)
    run, *_ = zerospeed.initialize(model=_model(), config=cfg)
    memory, *_ = zerospeed.initialize(model=_model(), config=_config(nvme, "cpu", params_on_nvme))
    out: dict[str, Any] = {"before": [_train(run, range(BEFORE)), _train(memory, range(BEFORE))]}
    watch = ResidencyWatch(run)
    saved = run.save_checkpoint(os.path.join(root, "nvme"), tag="t")
    out["save_reads"], out["save_most"] = watch.reads, watch.most
    memory.save_checkpoint(os.path.join(root, "memory"), tag="t")
    out["files"] = [_rank_tensors(saved), _rank_tensors(os.path.join(root, "memory", "t"))]
    out["manifests"] = [_manifest(saved), _manifest(os.path.join(root, "memory", "t"))]
    out["resident_after_save"] = sum(watch.slabs.resident)
    out["after"] = [_train(run, range(BEFORE, BEFORE + AFTER))]
    out["state"] = [_state(run)]
    for optimizer in ("nvme", "cpu"):
        fresh, *_ = zerospeed.initialize(model=_model(), config=_config(nvme, optimizer, params_on_nvme))
        if optimizer == "nvme":
            watch = ResidencyWatch(fresh)
        fresh.load_checkpoint(os.path.join(root, "nvme"), tag="t")
        if optimizer == "nvme":
            out["load_reads"], out["load_most"] = watch.reads, watch.most
        out["after"].append(_train(fresh, range(BEFORE, BEFORE + AFTER)))
        out["state"].append(_state(fresh))
        fresh.destroy()
    run.destroy()
    memory.destroy()
    out["rank"] = rank
    return out


def _check_resumed(results: list[dict[str, Any]], what: str) -> None:
    for out in results:
        case = f"{what}, rank {out['rank']}"
        assert out["before"][0] == out["before"][1], case  # the NVMe and in-memory runs agree before the save
        # the save read every unit once, one at a time, twice (header, then data), and left none resident
        assert out["save_reads"] >= 2 and out["save_most"] == 1, (case, out["save_reads"], out["save_most"])
        assert out["resident_after_save"] == 0, case
        nvme_files, memory_files = out["files"]
        assert sorted(nvme_files) == sorted(memory_files) and nvme_files, case
        for key, values in memory_files.items():
            assert nvme_files[key] == values, (case, key)
        assert out["manifests"][0] == out["manifests"][1], case
        assert any(k.startswith("optim.exp_avg_sq:") for k in nvme_files), case
        uninterrupted, nvme_loaded, memory_loaded = (torch.tensor(v) for v in out["after"])
        assert torch.equal(nvme_loaded, uninterrupted), case
        torch.testing.assert_close(memory_loaded, uninterrupted, rtol=1e-6, atol=1e-7, msg=case)
        state, nvme_state, memory_state = (torch.tensor(v) for v in out["state"])
        assert torch.equal(nvme_state, state), case
        torch.testing.assert_close(memory_state, state, rtol=1e-6, atol=1e-6 * state.abs().max().item(), msg=case)
        assert out["load_reads"] >= 1, case
        assert out["load_most"] == 1, (case, out["load_most"])


@pytest.mark.parametrize("world,params_on_nvme", [(1, True), (2, False)])
def test_streamed_save_and_load_match_the_uninterrupted_run(world: int, params_on_nvme: bool, tmp_path: Path) -> None:
    results = run_distributed(_save_and_resume, world, str(tmp_path), params_on_nvme, timeout=180)
    _check_resumed(results, f"{world} rank(s), parameters on NVMe: {params_on_nvme}")


def _async_save(root: str) -> dict[str, Any]:
    nvme = os.path.join(root, "swap")
    os.makedirs(nvme, exist_ok=True)
    run, *_ = zerospeed.initialize(model=_model(), config=_config(nvme, "nvme"))
    _train(run, range(BEFORE))
    watch = ResidencyWatch(run)
    with log_messages() as messages:
        returned = run.save_checkpoint(os.path.join(root, "ckpt"), tag="a", async_save=True)
        reads_at_return = watch.reads
        kind = type(run._pending_save).__name__
        path = run.wait_for_checkpoint()
    loaded, *_ = zerospeed.initialize(model=_model(), config=_config(nvme, "cpu"))
    loaded.load_checkpoint(os.path.join(root, "ckpt"))
    out = {"kind": kind, "returned": returned, "path": path, "reads_at_return": reads_at_return,
           "reads": watch.reads, "most": watch.most, "messages": messages,
           "state": [_state(run), _state(loaded)],
           "losses": [_train(run, range(BEFORE, BEFORE + AFTER)), _train(loaded, range(BEFORE, BEFORE + AFTER))]}
    run.destroy()
    loaded.destroy()
    return out


def test_async_save_writes_the_nvme_state_before_returning(tmp_path: Path) -> None:
    out, = run_distributed(_async_save, 1, str(tmp_path), timeout=120)
    assert out["kind"] == "BackgroundSave"
    assert out["path"] == out["returned"] == os.path.join(str(tmp_path), "ckpt", "a")
    assert out["reads_at_return"] == out["reads"] >= 2 and out["most"] == 1, out  # all NVMe reads before returning
    assert any("NVMe-tier state" in m and "background" in m for m in out["messages"]), out["messages"]
    state, loaded = (torch.tensor(v) for v in out["state"])
    assert torch.equal(loaded, state)
    torch.testing.assert_close(torch.tensor(out["losses"][1]), torch.tensor(out["losses"][0]), rtol=1e-6, atol=1e-7)
