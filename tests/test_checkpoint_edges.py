"""Checkpoint edge cases: several engines on one process group or one directory, asynchronous saves
that must snapshot everything, tied weights registered in the other order, empty and excluded
parameters, a load that fails on one rank only, and DeepSpeed's signatures."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.checkpoint.layout import CheckpointError
from zerospeed.testing import run_distributed


def _cfg(stage: int = 0) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
            "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "zero_optimization": {"stage": stage}}


def _step(engine: Any, seed: int, width: int = 4) -> None:
    x = torch.randn(2, width, generator=torch.Generator().manual_seed(seed))
    engine.backward(engine(x).pow(2).mean())
    engine.step()


class Tied(nn.Module):
    """Embedding and head sharing a weight, registered embedding-first or head-first."""

    def __init__(self, head_first: bool = False):
        super().__init__()
        if head_first:
            self.head = nn.Linear(4, 6, bias=False)
            self.emb = nn.Embedding(6, 4)
            self.emb.weight = self.head.weight
        else:
            self.emb = nn.Embedding(6, 4)
            self.head = nn.Linear(4, 6, bias=False)
            self.head.weight = self.emb.weight
        self.empty = nn.Parameter(torch.zeros(0, 4))  # a zero-element parameter
        self.frozen = nn.Parameter(torch.randn(4), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x) + self.frozen + self.empty.sum())


def _two_ranks(root: str) -> dict[str, Any]:
    rank = torch.distributed.get_rank()
    out: dict[str, Any] = {}
    # Two engines on the same process group: B's collectives (with a slow rank) must not make A's
    # save think a rank went elsewhere, and A's and B's saves must keep pairing up.
    torch.manual_seed(0)
    a, *_ = zerospeed.initialize(model=nn.Linear(4, 4), config=_cfg(1))
    b, *_ = zerospeed.initialize(model=nn.Linear(4, 4), config=_cfg(1))
    for i in range(6):
        if i == 5 and rank == 0:
            time.sleep(0.8)  # rank 1 waits in one of B's collectives long enough to announce it
        _step(b, i)
    _step(a, 100)
    if rank == 1:
        time.sleep(0.8)  # and reaches A's save a little later: legitimate
    out["two_engines"] = [a.save_checkpoint(os.path.join(root, "a"), tag="t"),
                          b.save_checkpoint(os.path.join(root, "b"), tag="t"),
                          a.save_checkpoint(os.path.join(root, "a"), tag="u")]
    # A save whose preparation fails on one rank (an optimizer state it cannot reshard) fails on every
    # rank at once, and the next save works.
    piece = a.optimizer.param_groups[0]["params"][0]
    if rank == 1:
        a.optimizer.state[piece]["odd"] = torch.zeros(2, 3)
    try:
        a.save_checkpoint(os.path.join(root, "odd"), tag="t")
        out["odd"] = "saved"
    except CheckpointError as exc:
        out["odd"] = str(exc)
    a.optimizer.state[piece].pop("odd", None)
    out["after_odd"] = os.path.basename(a.save_checkpoint(os.path.join(root, "odd"), tag="t2"))
    # A load that fails on one rank only (its shard file is damaged) fails on every rank, naming it.
    path = a.save_checkpoint(os.path.join(root, "damaged"), tag="t")
    torch.distributed.barrier()
    if rank == 0:
        file = os.path.join(path, "rank00001.safetensors")
        with open(file, "r+b") as f:
            f.seek(8)
            f.write(b"#")  # same size, unreadable header
    torch.distributed.barrier()
    try:
        a.load_checkpoint(os.path.join(root, "damaged"))
        out["damaged"] = "loaded"
    except CheckpointError as exc:
        out["damaged"] = str(exc)
    # Tied weights saved embedding-first load into a model tied head-first (stage 2 -> stage 3), with a
    # zero-element parameter and frozen parameters excluded from the save.
    torch.manual_seed(1)
    src, *_ = zerospeed.initialize(model=Tied(), config=_cfg(2))
    for i in range(2):
        _step_tokens(src, i)
    saved = {n: zerospeed.utils.safe_get_full_fp32_param(p).tolist() for n, p in src.module.named_parameters()}
    src.save_checkpoint(os.path.join(root, "tied"), exclude_frozen_parameters=True)
    torch.manual_seed(2)
    dst, *_ = zerospeed.initialize(model=Tied(head_first=True), config=_cfg(3))
    frozen_before = zerospeed.utils.safe_get_full_fp32_param(dst.module.frozen).tolist()
    dst.load_checkpoint(os.path.join(root, "tied"))
    out["tied"] = {n: zerospeed.utils.safe_get_full_fp32_param(p).tolist() for n, p in dst.module.named_parameters()}
    out["tied_saved"] = saved
    out["frozen_before"] = frozen_before
    return out


def _step_tokens(engine: Any, seed: int) -> None:
    x = torch.randint(0, 6, (2, 3), generator=torch.Generator().manual_seed(seed))
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_two_ranks, 2, str(tmp_path_factory.mktemp("edges")), pg_timeout=30, timeout=120)


def test_two_engines_on_one_group_keep_their_saves_apart(two_ranks: list[dict[str, Any]]) -> None:
    for result in two_ranks:
        assert [os.path.basename(p) for p in result["two_engines"]] == ["t", "t", "u"]


def test_a_save_failing_on_one_rank_fails_on_all_and_the_next_works(two_ranks: list[dict[str, Any]]) -> None:
    assert "'odd'" in two_ranks[1]["odd"] and "resharded" in two_ranks[1]["odd"]
    assert "rank 1 could not prepare" in two_ranks[0]["odd"]
    assert two_ranks[0]["after_odd"] == two_ranks[1]["after_odd"] == "t2"


def test_a_load_failing_on_one_rank_fails_on_all_naming_it(two_ranks: list[dict[str, Any]]) -> None:
    assert "rank00001.safetensors" in two_ranks[1]["damaged"]
    assert "failed on other ranks" in two_ranks[0]["damaged"] and "rank 1" in two_ranks[0]["damaged"]


@pytest.mark.smoke  # a 2-rank stage-3 save and load
def test_tied_weights_load_into_the_other_registration_order(two_ranks: list[dict[str, Any]]) -> None:
    result = two_ranks[0]
    saved, loaded = result["tied_saved"], result["tied"]
    assert loaded["head.weight"] == saved["emb.weight"]  # canonical name differs, the values do not
    assert loaded["empty"] == [] and saved["empty"] == []
    assert loaded["frozen"] == result["frozen_before"] != saved["frozen"]  # excluded: kept as it was


def _one_rank(root: str) -> dict[str, Any]:
    from zerospeed.checkpoint import commit

    out: dict[str, Any] = {}
    torch.manual_seed(0)
    gen, *_ = zerospeed.initialize(model=nn.Linear(4, 4), config=_cfg(0))
    disc, *_ = zerospeed.initialize(model=nn.Linear(4, 1), config=_cfg(0))
    original = commit.SaveJob._write_own

    def slow(self: Any) -> None:  # a large state still being written in the background
        time.sleep(0.6)
        original(self)

    commit.SaveJob._write_own = slow  # type: ignore[method-assign]
    ema = torch.zeros(3)
    client = {"step": 1, "ema": ema}
    gen.save_checkpoint(root, tag="gen", client_state=client, async_save=True)
    commit.SaveJob._write_own = original  # type: ignore[method-assign]
    client["step"] = 2  # training goes on while the save is written
    ema.add_(1.0)
    # Another engine saving into the same directory must not sweep the in-flight temporary directory.
    disc.save_checkpoint(root, tag="disc", save_latest=False)
    gen.wait_for_checkpoint()
    _, loaded = gen.load_checkpoint(root, tag="gen")
    out["client_state"] = {"step": loaded["step"], "ema": loaded["ema"].tolist()}
    out["tags"] = sorted(os.listdir(root))
    with open(os.path.join(root, "gen", "manifest.json")) as f:
        out["gen_params"] = [p["name"] for p in json.load(f)["params"]]
    # Rolling back in the same process: the optimizer already has states, which are refilled in place.
    _step(gen, 1)
    saved = {k: v.clone() for k, v in gen.optimizer.state[gen.optimizer.param_groups[0]["params"][0]].items()}
    gen.save_checkpoint(root, tag="roll")
    _step(gen, 2)
    gen.load_checkpoint(root, tag="roll")
    now = gen.optimizer.state[gen.optimizer.param_groups[0]["params"][0]]
    out["rollback"] = sorted(k for k in saved if not torch.equal(saved[k], now[k]))
    out["rollback_keys"] = sorted(now)
    errors = []
    for call in (lambda: gen.save_checkpoint(""),
                 lambda: gen.load_checkpoint(root, custom_load_fn=lambda *a: None)):
        try:
            call()
            errors.append("no error")
        except (ValueError, NotImplementedError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    out["errors"] = errors
    return out


def test_async_save_and_a_second_engine_in_the_same_directory(tmp_path: Any) -> None:
    result = run_distributed(_one_rank, 1, str(tmp_path), pg_timeout=30, timeout=120)[0]
    assert result["client_state"] == {"step": 1, "ema": [0.0, 0.0, 0.0]}  # as it was when save returned
    assert result["tags"] == [".zerospeed-save.lock", "disc", "gen", "latest"]  # the folder's save lock stays
    assert result["rollback"] == [] and result["rollback_keys"] == ["exp_avg", "exp_avg_sq", "step"]
    assert result["gen_params"] == ["weight", "bias"]
    empty, custom = result["errors"]
    assert empty.startswith("ValueError") and "save_dir" in empty
    assert custom.startswith("NotImplementedError") and "custom_load_fn" in custom
