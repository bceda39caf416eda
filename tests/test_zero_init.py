"""zero.Init, GatheredParameters and the safe_get/set helpers on real gloo ranks."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.testing import run_distributed
from zerospeed.testing.models import ResidualBlock
from zerospeed.utils import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                             safe_set_full_fp32_param)


class Net(nn.Module):
    def __init__(self, width: int = 12, depth: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(17, width)
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 17, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _config(stage: int, lr: float = 0.05) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": lr}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def _train(engine: zerospeed.Engine, steps: int) -> list[float]:
    rank = engine.comm.rank
    losses = []
    for step in range(steps):
        idx = torch.randint(0, 17, (2, 6), generator=torch.Generator().manual_seed(100 * step + rank))
        loss = nn.functional.cross_entropy(engine(idx).reshape(-1, 17), idx.roll(1, 1).reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _init_cases() -> dict:
    zerospeed.init_distributed()
    rank = torch.distributed.get_rank()
    out: dict = {}
    torch.manual_seed(0)
    plain = Net()
    reference = {n: p.detach().clone() for n, p in plain.named_parameters()}
    torch.manual_seed(rank)  # every rank draws different values: Init must start them all from rank 0's
    if rank == 0:
        torch.manual_seed(0)
    with zerospeed.zero.Init():
        model = Net()
    out["shapes_outside"] = sorted({tuple(p.shape) for p in model.parameters()})
    with zerospeed.zero.GatheredParameters(list(model.parameters())):
        out["init_matches_rank0"] = all(torch.equal(p, reference[n]) for n, p in model.named_parameters())
    out["tied_kept"] = model.head.weight is model.emb.weight
    for stage in (3, 2):
        torch.manual_seed(0)
        with zerospeed.zero.Init(enabled=stage == 3):
            built = Net()
        engine, *_ = zerospeed.initialize(model=built, config=_config(stage))
        torch.manual_seed(0)
        twin, *_ = zerospeed.initialize(model=Net(), config=_config(stage))
        out[f"losses_{stage}"] = (_train(engine, 3), _train(twin, 3))
        with zerospeed.zero.GatheredParameters(list(built.parameters()) + list(twin.module.parameters())):
            out[f"params_equal_{stage}"] = all(torch.equal(a, b) for a, b in
                                               zip(built.parameters(), twin.module.parameters(), strict=True))
    # modifier_rank: rank 1's in-place edit becomes every rank's shard and fp32 master
    engine, *_ = zerospeed.initialize(model=Net(), config=_config(3, lr=0.0))
    target = engine.module.blocks[1].fc.weight
    with zerospeed.zero.GatheredParameters(target, modifier_rank=1):
        out["full_shape_inside"] = tuple(target.shape)
        if rank == 1:
            with torch.no_grad():
                target.fill_(0.5)
    out["empty_outside"] = tuple(target.shape)
    _train(engine, 1)  # lr 0: the master must hold the edit, or the step would write the old values back
    out["edit_kept"] = bool((safe_get_full_fp32_param(target) == 0.5).all())
    safe_set_full_fp32_param(target, torch.full((12, 12), -2.0))
    _train(engine, 1)
    with zerospeed.zero.GatheredParameters(target):
        out["set_kept"] = bool((target == -2.0).all())
    return out


def test_init_partitions_at_construction_and_trains_like_a_plain_model() -> None:
    results = run_distributed(_init_cases, 3, timeout=200)
    for rank, out in enumerate(results):
        assert out["shapes_outside"] == [(0,)], rank
        assert out["init_matches_rank0"] and out["tied_kept"], rank
        for stage in (3, 2):
            a, b = out[f"losses_{stage}"]
            assert a == b and out[f"params_equal_{stage}"], (rank, stage, a, b)
        assert out["full_shape_inside"] == (12, 12) and out["empty_outside"] == (0,), rank
        assert out["edit_kept"] and out["set_kept"], rank


def _safe_get(stage: int) -> dict:
    torch.manual_seed(0)
    engine, *_ = zerospeed.initialize(model=Net(), config=_config(stage))
    _train(engine, 2)
    rank = engine.comm.rank
    idx = torch.randint(0, 17, (2, 6), generator=torch.Generator().manual_seed(7 + rank))
    engine.backward(nn.functional.cross_entropy(engine(idx).reshape(-1, 17), idx.roll(1, 1).reshape(-1)))
    named = list(engine.module.named_parameters())
    out = {name: {"fp32": safe_get_full_fp32_param(p).tolist(), "grad": safe_get_full_grad(p).tolist(),
                  "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").tolist()} for name, p in named}
    engine.step()
    return out


def test_safe_get_reads_the_same_full_tensors_at_every_stage() -> None:
    results = {stage: run_distributed(_safe_get, 2, stage, timeout=200) for stage in (0, 1, 3)}
    for stage, per_rank in results.items():
        assert per_rank[0] == per_rank[1], stage  # every rank reads the whole tensor
        for name, values in per_rank[0].items():
            for key, value in values.items():
                expected = torch.tensor(results[0][0][name][key])
                assert torch.allclose(torch.tensor(value), expected, atol=1e-6), (stage, name, key)


def _big_init() -> dict:
    """A ~1.07B-parameter model (16 blocks of 4 x 4096x4096) built under zero.Init on 4 ranks, every
    collective's wait outlasting Comm's patience as many do on a busy machine (where this build once peaked
    at 1.97 GiB: each such wait kept a whole parameter's broadcast buffer until a gc pass): the peak must
    not depend on how long the waits take."""
    import datetime

    from zerospeed.distributed import comm

    torch.set_num_threads(1)
    comm._PATIENCE = datetime.timedelta(milliseconds=1)  # this rank's process only; it exits after the test
    zerospeed.init_distributed()

    class Big(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(
                nn.Sequential(*(nn.Linear(4096, 4096, bias=False) for _ in range(4))) for _ in range(16))

    torch.manual_seed(0)
    with zerospeed.zero.Init():
        model = Big()
    numel = sum(p._zerospeed_owner.numel for p in model.parameters())
    first = model.blocks[0][0].weight
    with zerospeed.zero.GatheredParameters(first):
        inside = tuple(first.shape)
        torch.manual_seed(0)
        expected = nn.Linear(4096, 4096, bias=False).weight
        same = torch.equal(first, expected)
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    return {"numel": numel, "peak": peak, "inside": inside, "same": same, "outside": tuple(first.shape)}


@pytest.mark.slow
def test_a_1b_model_builds_under_init_within_45_percent_of_its_fp32_size_per_rank() -> None:
    results = run_distributed(_big_init, 4, timeout=280)
    full_fp32 = results[0]["numel"] * 4
    assert results[0]["numel"] > 1_000_000_000
    for rank, out in enumerate(results):
        assert out["inside"] == (4096, 4096) and out["outside"] == (0,) and out["same"], rank
        assert out["peak"] < 0.45 * full_fp32, f"rank {rank} peaked at {out['peak'] / 2**30:.2f} GiB, " \
                                                f"45% of {full_fp32 / 2**30:.2f} GiB is the limit"


def _one_rank_skips(stage: int) -> str:
    import time

    torch.manual_seed(0)
    engine, *_ = zerospeed.initialize(model=Net(), config=_config(stage))
    if engine.comm.rank == 1:
        time.sleep(6)  # alive but never enters the collective rank 0 waits in
        return "skipped"
    idx = torch.zeros(2, 6, dtype=torch.long)
    try:
        engine.backward(engine(idx).float().mean())
    except zerospeed.distributed.comm.CollectiveTimeout as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(("stage", "operation"), [(3, "all_gather"), (2, "reduce_scatter")])
def test_a_collective_only_some_ranks_enter_fails_within_the_timeout(stage: int, operation: str) -> None:
    import time

    start = time.monotonic()
    message = run_distributed(_one_rank_skips, 2, stage, timeout=60, pg_timeout=3)[0]
    assert message.startswith(operation) and "did not complete within 3s" in message, message
    assert "ranks that did not arrive: [1]" in message, message
    assert time.monotonic() - start < 40


def _init_on_nvme(root: str) -> dict:
    """zero.Init with offload_param on NVMe: the partitions wait in swap files (nothing in memory), a
    GatheredParameters edit reaches them, initialize takes them (deleting each file) and training equals
    the same model built in memory."""
    zerospeed.init_distributed()
    rank = torch.distributed.get_rank()
    cfg = _config(3)
    cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": root, "max_in_cpu": 0}
    out: dict = {}
    torch.manual_seed(0)
    with zerospeed.zero.Init(config=cfg) as init:
        model = Net()
    stash = init._stash
    gc.collect()  # the head's own weight, replaced by the tied one: its file goes with it
    partitions = [p._zerospeed_owner for p in model.parameters()]
    out["swapped"] = all(part._lease is not None and part.shard.numel() == 0 for part in partitions)
    out["files"] = len(list(stash.slabs.directory.path.glob("init*.bin")))
    out["params"] = len(partitions)
    with zerospeed.zero.GatheredParameters(model.blocks[0].fc.bias, modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                model.blocks[0].fc.bias.fill_(0.125)
    torch.manual_seed(0)
    with zerospeed.zero.Init():
        twin = Net()
    with zerospeed.zero.GatheredParameters(twin.blocks[0].fc.bias, modifier_rank=0):
        with torch.no_grad():
            twin.blocks[0].fc.bias.fill_(0.125)
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    out["files_left"] = len(list(stash.slabs.directory.path.glob("init*.bin")))
    reference, *_ = zerospeed.initialize(model=twin, config=_config(3))
    out["losses"] = (_train(engine, 3), _train(reference, 3))
    engine.destroy()
    return out


def test_init_partitions_wait_on_nvme_when_parameters_are_offloaded_there(tmp_path) -> None:
    for rank, out in enumerate(run_distributed(_init_on_nvme, 2, str(tmp_path), timeout=200)):
        assert out["swapped"] and out["files"] == out["params"] == 13, (rank, out)  # one file per parameter
        assert out["files_left"] == 0, rank  # each partition's file went as initialize took it
        nvme, memory = out["losses"]
        torch.testing.assert_close(torch.tensor(nvme), torch.tensor(memory), rtol=1e-6, atol=1e-7)


def test_init_remote_device_errors() -> None:
    with pytest.raises(ValueError, match="remote_device='gpu'.*expected 'cpu' or 'nvme'"):
        zerospeed.zero.Init(remote_device="gpu", enabled=False)
    with pytest.raises(ValueError, match="needs the config's zero_optimization.offload_param"):
        zerospeed.zero.Init(remote_device="nvme", config=_config(3), enabled=False)


def test_init_frees_each_broadcast_buffer_at_once_whoever_still_holds_it(monkeypatch) -> None:
    """Each parameter's broadcast buffer (a whole parameter) is released as soon as this rank's slice is
    cut from it, even while something still references it (a caught timeout's traceback, a comms logger):
    the build's peak is one module's parameters plus the shards, whenever those references go."""
    from zerospeed.testing.dist import one_process_group

    held: list[torch.Tensor] = []
    with one_process_group():
        real = torch.distributed.broadcast

        def keep(tensor: torch.Tensor, *args, **kwargs):
            held.append(tensor)
            return real(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.distributed, "broadcast", keep)
        torch.manual_seed(0)
        with zerospeed.zero.Init():
            model = nn.Linear(64, 32)
        torch.manual_seed(0)
        reference = nn.Linear(64, 32)
        with zerospeed.zero.GatheredParameters(list(model.parameters())):
            same = torch.equal(model.weight, reference.weight) and torch.equal(model.bias, reference.bias)
    assert [tuple(t.shape) for t in held] == [(64 * 32,), (32,)]
    assert [t.untyped_storage().nbytes() for t in held] == [0, 0]  # freed, though `held` still refers to them
    assert same and tuple(model.weight.shape) == (0,)
