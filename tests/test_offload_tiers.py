"""Offload tiers as values (memory vs NVMe), the NVMe run opened in one place, and the checked
lifecycles of slabs and leases."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import zerospeed.ops.aio as public_aio
from zerospeed.accelerator.cpu_accelerator import CPU_Accelerator
from zerospeed.config import load_config
from zerospeed.offload import (IoStats, MemoryStorage, MemoryTier, NvmeRun, NvmeTier, StateStore, Tier,
                               remote_device_tier)
from zerospeed.offload import aio as offload_aio
from zerospeed.lifecycle import IllegalTransition
from zerospeed.offload.nvme import LeaseState, RunDirectory, SlabState, SwappedSlabs
from zerospeed.testing import run_distributed

CPU = torch.device("cpu")


def _cfg(**zero: Any) -> Any:
    return load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}, world_size=1)


class _Write:
    """A write already performed, whose ``done()`` says False the first time it is asked (it lands
    between two asks, as a real one may)."""

    def __init__(self) -> None:
        self.asked = 0

    def done(self) -> bool:
        self.asked += 1
        return self.asked > 1

    def wait(self) -> int:
        return 0


class _Read:
    def done(self) -> bool:
        return True

    def wait(self) -> int:
        return 0


class LateIO:
    """Moves bytes at once; writes report done only from the second ask on."""

    def submit_pwrite(self, tensor: torch.Tensor, path: str, offset: int = 0) -> _Write:
        data = (ctypes.c_char * (tensor.numel() * tensor.element_size())).from_address(tensor.data_ptr())
        with open(path, "r+b" if Path(path).exists() else "wb") as f:
            f.seek(offset)
            f.write(bytes(data))
        return _Write()

    def submit_pread(self, tensor: torch.Tensor, path: str, offset: int = 0) -> _Read:
        nbytes = tensor.numel() * tensor.element_size()
        with open(path, "rb") as f:
            f.seek(offset)
            ctypes.memmove(tensor.data_ptr(), f.read(nbytes), nbytes)
        return _Read()


def _slabs(tmp_path: Path, count: int, lookahead: int = 1) -> SwappedSlabs:
    tensors = [torch.full((256,), float(i)) for i in range(count)]
    return SwappedSlabs(tensors, RunDirectory(tmp_path, "run", 0), LateIO(), lookahead=lookahead)


def test_the_public_aio_path_reexports_the_engine() -> None:
    for name in ("AsyncIOHandle", "IORequest", "AioShortReadError", "worker_count"):
        assert getattr(public_aio, name) is getattr(offload_aio, name)


def test_tiers_say_whether_they_swap_and_describe_themselves(tmp_path: Path) -> None:
    cfg = _cfg(stage=3, offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path)},
               offload_param={"device": "cpu"})
    store = StateStore.from_config(cfg.zero_optimization, CPU, CPU_Accelerator(), aio=cfg.aio)
    assert isinstance(store.optimizer, NvmeTier) and store.optimizer.swaps and store.swaps
    assert store.optimizer.aio is cfg.aio and store.optimizer.device == CPU
    assert store.params == MemoryTier("cpu", CPU) == Tier("cpu", CPU) and not store.params.swaps
    assert store.describe().startswith(f"optimizer state: nvme ({tmp_path})")
    assert not StateStore.on_device(CPU).swaps
    assert store.optimizer != store.compute and store.offloads_optimizer


def test_memory_storage_answers_with_nothing() -> None:
    storage = MemoryTier("device", CPU).open(None, purpose="x", what="x")  # type: ignore[arg-type]
    assert isinstance(storage, MemoryStorage) and not storage.swaps
    assert storage.io_stats() == IoStats() and storage.bytes_held() == 0
    storage.check_room(1 << 60, "anything")
    storage.close()
    with pytest.raises(AssertionError, match="a memory tier keeps no slabs"):
        storage.slabs("unit")


def test_remote_device_is_parsed_once(tmp_path: Path) -> None:
    nvme = _cfg(stage=3, offload_param={"device": "nvme", "nvme_path": str(tmp_path)})
    cpu = _cfg(stage=3, offload_param={"device": "cpu"})
    assert remote_device_tier(nvme, None) == NvmeTier(tmp_path)
    assert remote_device_tier(nvme, "nvme") == NvmeTier(tmp_path)
    assert remote_device_tier(nvme, "cpu") is None
    assert remote_device_tier(cpu, None) is None and remote_device_tier(None, None) is None
    with pytest.raises(ValueError, match=r"remote_device='disk'\): expected 'cpu' or 'nvme'"):
        remote_device_tier(nvme, "disk")
    with pytest.raises(ValueError, match="needs the config's zero_optimization.offload_param with device 'nvme'"):
        remote_device_tier(cpu, "nvme")


def test_a_write_landing_between_two_asks_is_still_waited_for(tmp_path: Path) -> None:
    """The stream asks each write once whether it is done: a write that completed between two asks
    used to be neither waited for nor kept, leaving its slab in memory after the pass."""
    slabs = _slabs(tmp_path, 5)
    seen = []
    for i in slabs.stream(range(5)):
        seen.append(float(slabs.slabs[i][0]))
        slabs.slabs[i].add_(10.0)
        assert sum(slabs.resident) <= slabs.lookahead + 2
    assert seen == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert slabs.states == [SlabState.OUT] * 5
    with slabs.resident_during(range(5), write_back=False):
        assert [float(s[0]) for s in slabs.slabs] == [10.0, 11.0, 12.0, 13.0, 14.0]


def test_slab_moves_are_checked(tmp_path: Path) -> None:
    slabs = _slabs(tmp_path, 2)
    request = slabs.start_read(0)
    assert slabs.states[0] is SlabState.READING
    with pytest.raises(IllegalTransition, match="slab 0: a slab cannot go from READING to WRITING"):
        slabs.swap_out([0])  # writing a buffer whose read has not landed would store garbage
    slabs.finish_read(0, request)
    assert slabs.states[0] is SlabState.RESIDENT
    with pytest.raises(RuntimeError, match="slab 0 is resident: use the slab in memory"):
        slabs.read_region(0, torch.empty(4), 0)
    slabs.swap_out([0])
    assert slabs.states == [SlabState.OUT, SlabState.OUT]
    slabs.discard(1)  # already out: nothing to do
    assert torch.equal(slabs.slabs[0], torch.empty(0))


def test_lease_lifecycle(tmp_path: Path) -> None:
    slabs = _slabs(tmp_path, 1)
    lease = slabs.lease(0)
    assert lease.state is LeaseState.FREE
    lease.acquire(wait=False)  # a prefetch: the read is in flight
    assert lease.state is LeaseState.HELD and slabs.states[0] is SlabState.READING
    with lease.held(write_back=True):
        slabs.slabs[0].fill_(7.0)
    assert lease.state is LeaseState.CHANGED and lease.dirty and lease.holders == 1
    lease.release()
    assert lease.state is LeaseState.FREE and not lease.dirty and slabs.states[0] is SlabState.OUT
    with pytest.raises(RuntimeError, match="slab 0: released more often than acquired"):
        lease.release()
    with lease.held():
        assert float(slabs.slabs[0][0]) == 7.0
    assert slabs.states[0] is SlabState.OUT


def _open_runs(root: str, broken_rank: int) -> dict:
    from zerospeed.distributed.comm import Comm

    comm = Comm()
    rank = comm.rank
    run = NvmeTier(Path(root)).open(comm, purpose="params", what="offload_param nvme")
    assert isinstance(run, NvmeRun)
    slabs = run.slabs("param", keep_buffers=3)
    slabs.add(torch.arange(100.0))
    out = {"dir": str(run.directory.path.relative_to(root)), "held": run.bytes_held(),
           "written": run.io_stats().bytes_written, "keep": slabs.buffers.keep}
    run.close()
    out["left"] = run.directory.path.exists()
    path = root if rank != broken_rank else os.path.join(root, "missing")
    try:
        NvmeTier(Path(path)).open(comm, purpose="", what="offload_optimizer nvme")
    except (FileNotFoundError, RuntimeError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def test_an_nvme_run_is_agreed_over_the_ranks_and_fails_together(tmp_path: Path) -> None:
    out = run_distributed(_open_runs, 2, str(tmp_path), 1, timeout=120)
    run_dirs = {Path(o["dir"]).parent for o in out}
    assert len(run_dirs) == 1 and str(run_dirs.pop()).endswith("-params")  # one run id for both ranks
    assert [Path(o["dir"]).name for o in out] == ["rank0", "rank1"]
    assert all(o["held"] == 400 and o["written"] == 400 and o["keep"] == 3 and not o["left"] for o in out)
    assert out[1]["error"].startswith("FileNotFoundError: [Errno 2] nvme_path")
    assert out[0]["error"].startswith("RuntimeError: offload_optimizer nvme failed on other ranks: rank 1: ")
