"""Small units are coalesced at ZeRO stages 1-2 (issue 13, part 4): a model of many small blocks pays a few
collectives per step, not one reduce-scatter and one all-gather per block, and still trains exactly like plain
PyTorch. Stage 3 keeps one unit per block (its modules gather and release them).

One spawn of 2 gloo ranks runs every case; the collectives of each step are counted through ``engine.comm.stats``
and the parameters compared with a single-process reference trained on the same global batches.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.sharding.units import coalesce
from zerospeed.testing import run_distributed
from zerospeed.testing.data import micro_batch_rows
from zerospeed.testing.parity import assert_close_tree
from zerospeed.testing.reference import train_reference
from zerospeed.zero import GatheredParameters
from zerospeed.zero.layout import build_units

IN, DIM, BLOCKS = 4, 8, 8  # units: inp 40, 8 blocks of 88, out 9 elements (753 in all)
WORLD, MICRO, ACCUM, STEPS = 2, 3, 2, 3
ADAMW = {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01}}
ATOL = 1e-5


class Tower(nn.Module):
    """Ten small units: an input layer, a stack of small blocks, an output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, DIM)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, DIM), nn.Tanh())
                                    for _ in range(BLOCKS))
        self.out = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h).squeeze(-1)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(STEPS * WORLD * ACCUM * MICRO, IN, generator=gen)
    return x, torch.sin(x.sum(-1))


def _rows(step: int, rank: int, micro_step: int) -> slice:
    return micro_batch_rows(step, rank, micro_step, world=WORLD, accum=ACCUM, micro=MICRO)


def _run_case(stage: int, zero: dict) -> dict:
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM,
              "gradient_clipping": 0.5, "optimizer": ADAMW,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero}}
    engine, *_ = zerospeed.initialize(model=Tower(), config=config)
    x, y = _data()
    per_step = []
    for step in range(STEPS):
        before = dict(engine.comm.stats.calls)
        for m in range(ACCUM):
            rows = _rows(step, rank, m)
            engine.backward(nn.functional.mse_loss(engine(x[rows]), y[rows]))
            engine.step()
        per_step.append({op: n - before.get(op, 0) for op, n in engine.comm.stats.calls.items()
                         if n != before.get(op, 0)})
    with GatheredParameters(list(engine.module.parameters())) if stage == 3 else contextlib.nullcontext():
        params = {name: p.detach().clone().tolist() for name, p in engine.module.named_parameters()}
    return {"units": len(engine.state.units), "calls": per_step, "params": params}


CASES = {  # name -> (stage, zero_optimization keys)
    "s1 default buckets": (1, {}),
    "s2 default buckets": (2, {}),
    "s2 buckets of 300": (2, {"reduce_bucket_size": 300}),
    "s3": (3, {}),
}


def _run_cases() -> dict[str, dict]:
    logging.getLogger("zerospeed").addHandler(logging.NullHandler())  # keep the config dump out of the output
    logging.getLogger("zerospeed").setLevel(logging.WARNING)
    return {name: _run_case(stage, zero) for name, (stage, zero) in CASES.items()}


def _reference() -> dict[str, torch.Tensor]:
    """Plain PyTorch on the same global batches: mean over ranks and micro-batches, clipping 0.5."""
    torch.manual_seed(0)
    model = Tower()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW["params"])
    x, y = _data()

    def batch(step: int, rank: int, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = _rows(step, rank, micro_step)
        return x[rows], y[rows]

    train_reference(model, opt, batch=batch, loss_fn=nn.functional.mse_loss, steps=STEPS, world=WORLD, accum=ACCUM,
                    clip=0.5)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    per_rank = run_distributed(_run_cases, WORLD, timeout=300.0)
    return {name: [ranks[name] for ranks in per_rank] for name in CASES}


@pytest.mark.parametrize("name, units, reduce_scatters", [
    ("s1 default buckets", 1, 1),  # stage 1 reduces once per window
    ("s2 default buckets", 1, ACCUM),  # stage 2 reduces every micro-batch
    ("s2 buckets of 300", 3, 3 * ACCUM),  # [inp, b0, b1] [b2, b3, b4] [b5, b6, b7, out]: 216, 264, 273 elements
])
def test_small_units_cost_one_reduce_scatter_and_one_all_gather_per_coalesced_unit(
        results: dict, name: str, units: int, reduce_scatters: int) -> None:
    for rank, got in enumerate(results[name]):
        assert got["units"] == units, f"{name} rank {rank}: {got['units']} units"
        # every step after the first (which also agrees on the order units complete in): the units'
        # reductions and all-gathers, and one all-reduce for the clipping norm
        expected = {"reduce_scatter": reduce_scatters, "all_gather": units, "all_reduce": 1}
        assert got["calls"][1:] == [expected] * (STEPS - 1), f"{name} rank {rank}"


def test_stage3_keeps_one_unit_per_block(results: dict) -> None:
    assert [got["units"] for got in results["s3"]] == [2 + BLOCKS] * WORLD


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.smoke) if name == "s2 default buckets" else name
                                  for name in CASES])  # smoke: a quick 2-rank stage-2 parity case
def test_coalesced_units_train_like_plain_pytorch(results: dict, name: str) -> None:
    reference = _reference()
    for rank, got in enumerate(results[name]):
        params = {pname: torch.tensor(value) for pname, value in got["params"].items()}
        assert_close_tree(params, reference, rtol=0.0, atol=ATOL, path=f"{name} rank {rank}")


def test_coalesce_joins_small_neighbours_of_one_kind_up_to_the_maximum() -> None:
    assert coalesce([40, 88, 88, 88, 9], "aaaaa", min_elems=300, max_elems=300) == [[0, 1, 2], [3, 4]]
    # a group closes once it holds the minimum; large items stay alone, also next to small ones
    assert coalesce([60, 50, 40, 30], "aaaa", min_elems=100, max_elems=10**6) == [[0, 1], [2, 3]]
    assert coalesce([500, 3, 4, 500, 5], "aaaaa", min_elems=100, max_elems=10**6) == [[0], [1, 2], [3], [4]]
    assert coalesce([60, 60], "aa", min_elems=100, max_elems=110) == [[0], [1]]  # never above the maximum
    assert coalesce([3, 3, 3, 3], "aabb", min_elems=100, max_elems=10**6) == [[0, 1], [2, 3]]  # kinds apart
    assert coalesce([], "", min_elems=100, max_elems=100) == []
    with pytest.raises(ValueError, match="3 sizes for 2 kinds"):
        coalesce([1, 2, 3], "ab", min_elems=1, max_elems=1)


def test_frozen_units_and_other_dtypes_are_not_joined_with_trainable_ones() -> None:
    model = Tower()
    for p in model.blocks[3].parameters():
        p.requires_grad_(False)
    model.out.to(torch.float64)
    units = build_units(model, bucket_elems=10**9, min_unit_elems=10**6)
    assert [u.name for u in units] == ["inp..blocks.2", "blocks.3", "blocks.4..blocks.7", "out"]
    assert [u.module_path for u in units] == [None, "blocks.3", None, None]  # no module gathers a joined unit
    assert [u.name for u in build_units(model, bucket_elems=10**9)][:3] == ["inp", "blocks.0", "blocks.1"]
