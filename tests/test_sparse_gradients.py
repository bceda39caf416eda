"""``sparse_gradients`` (issue 21): lookup-table gradients exchanged as the rows a window touched.

Every case trains the same model twice on the same ranks and data, once with ``sparse_gradients``
and once densely, and compares the averaged gradients of every window and the parameters after
several Adam steps *exactly*. The data make that fair on 3 ranks too: gloo's all-reduce may add the
ranks in another order than the row exchange (rank order), so every table gradient is a small
multiple of a power of two (dyadic loss weights times small lookup counts, divided by a power-of-two
accumulation count), whose sums are exact in fp32 and bf16 in any order. Each row's gradient
values sum to zero (DeepSpeed's ``SparseTensor`` dropped such rows), indices repeat within and
across micro-batches, padding and most rows are never looked up, and micro-batches of a window
touch different rows (the exchange sends their union).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.config import ConfigError
from zerospeed.testing import run_distributed
from zerospeed.utils import safe_get_full_grad
from zerospeed.zero.reducer import plan_buckets
from zerospeed.zero.sparse_rows import refuse_unsupported

VOCAB, BAG_VOCAB, DIM, BATCH, SEQ, STEPS = 512, 384, 16, 4, 5, 4
# each row's gradient sums to zero; dyadic, so sums are exact in any order
BASE = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.25, -0.25] * (DIM // 8))


class Lookups(nn.Module):
    """An Embedding (summed over the sequence) and an EmbeddingBag, plus a dense layer on other inputs."""

    def __init__(self, sparse: bool = False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, padding_idx=0, sparse=sparse)
        self.bag = nn.EmbeddingBag(BAG_VOCAB, DIM, mode="sum", sparse=sparse)
        self.dense = nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor, bag_ids: torch.Tensor, offsets: torch.Tensor,
                feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.emb(ids).sum(1) + self.bag(bag_ids, offsets), self.dense(feats)


class HeadOnWeight(Lookups):
    """A sparse=True embedding whose weight is also used densely in ``forward`` (an output head)."""

    def __init__(self) -> None:
        super().__init__(sparse=True)

    def forward(self, ids: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.emb(ids).sum(1) @ self.emb.weight.T


def _batch(step: int, micro: int, rank: int) -> dict[str, torch.Tensor]:
    """Rows 1..40 shifted by 24 per micro-batch (windows touch different rows), repeats forced, padding (0)
    looked up; bags of uneven length; loss weights small integers times ``BASE``."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    ids = torch.randint(1, 41, (BATCH, SEQ), generator=g) + 24 * micro
    ids[:, 0] = ids[:, 1]  # a repeat in every sample
    ids[0, -1] = 0  # padding_idx: no gradient
    bag_ids = torch.randint(0, 30, (11,), generator=g) + 16 * micro
    bag_ids[3] = bag_ids[2]
    offsets = torch.tensor([0, 2, 5, 9])
    scale = torch.randint(-3, 4, (BATCH, 1), generator=g).float()
    return {"ids": ids, "bag_ids": bag_ids, "offsets": offsets, "feats": torch.randn(BATCH, DIM, generator=g),
            "weights": scale * BASE}


def _touched(step: int, micro_batches: int, rank: int) -> tuple[int, int]:
    """How many rows of each table this rank's window looks up (padding left out)."""
    batches = [_batch(step, m, rank) for m in range(micro_batches)]
    emb = torch.cat([b["ids"].reshape(-1) for b in batches]).unique()
    bag = torch.cat([b["bag_ids"] for b in batches]).unique()
    return int((emb != 0).sum()), bag.numel()


def _config(accum: int, sparse: bool, extra: dict[str, Any]) -> dict[str, Any]:
    # reduce_bucket_size 1: every parameter in a bucket of its own in both runs, so the dense layer's
    # all-reduce is the same collective (same size, same summation order) with and without sparse_gradients
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": accum,
            "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "sparse_gradients": sparse,
            "zero_optimization": {"stage": 0, "reduce_bucket_size": 1}, **extra}


def _train(accum: int, sparse: bool, modules_sparse: bool, extra: dict[str, Any]) -> dict[str, Any]:
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = Lookups(sparse=modules_sparse)
    engine, *_ = zerospeed.initialize(model=model, config=_config(accum, sparse, extra))
    grads, table_bytes = [], []
    for step in range(STEPS):
        engine.comm.stats.reset()
        for m in range(accum):
            b = _batch(step, m, rank)
            h, out = engine(b["ids"], b["bag_ids"], b["offsets"], b["feats"])
            loss = (h.float() * b["weights"]).sum() + out.float().square().mean()
            engine.backward(loss)
            if m == accum - 1:
                grads.append([_plain(safe_get_full_grad(p)) for p in engine.module.parameters()])
            engine.step()
        table_bytes.append((dict(engine.comm.stats.bytes), dict(engine.comm.stats.calls)))
    return {"grads": grads, "params": [_plain(p.detach()) for p in engine.module.parameters()],
            "stats": table_bytes}


def _plain(t: torch.Tensor | None) -> Any:
    """A result the rank can send: torch's pickling would share tensor memory with an exiting process."""
    assert t is not None
    return t.float().numpy().copy()


CASES: dict[str, tuple[int, bool, dict[str, Any]]] = {  # accum, sparse=True modules, config extras
    "fp32": (1, False, {}),
    "window": (4, False, {}),  # the union of four micro-batches' rows
    "coo": (2, True, {}),  # sparse=True modules: COO gradients
    "bf16": (2, False, {"bf16": {"enabled": True}, "communication_data_type": "bf16",
                        "gradient_predivide_factor": 2.0}),
    "fp16": (1, False, {"fp16": {"enabled": True, "initial_scale_power": 4}, "prescale_gradients": True}),
}


def _all_cases() -> dict[str, Any]:
    out = {}
    for name, (accum, modules_sparse, extra) in CASES.items():
        out[name] = {"sparse": _train(accum, True, modules_sparse, extra),
                     "dense": _train(accum, False, modules_sparse, extra)}
    out["refusals"] = _refusals()
    return out


def _refusals() -> list[str]:
    messages = []
    for stage in (1, 2, 3):
        try:
            zerospeed.initialize(model=Lookups(),
                                 config={**_config(1, True, {}), "zero_optimization": {"stage": stage}})
        except ConfigError as exc:
            messages.append(str(exc))
    tied = Lookups()
    tied.head = nn.Linear(DIM, VOCAB, bias=False)
    tied.head.weight = tied.emb.weight
    try:
        zerospeed.initialize(model=tied, config=_config(1, True, {}))
    except ConfigError as exc:
        messages.append(str(exc))
    engine, *_ = zerospeed.initialize(model=HeadOnWeight(), config=_config(1, True, {}))
    try:
        engine.backward(engine(_batch(0, 0, 0)["ids"]).sum())
    except RuntimeError as exc:
        messages.append(str(exc))
    return messages


@pytest.fixture(scope="module", params=[2, 3])
def runs(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    return request.param, run_distributed(_all_cases, request.param)


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_and_trained_parameters_equal_the_dense_exchange(runs: tuple[int, list[dict[str, Any]]],
                                                                   case: str) -> None:
    world, results = runs
    for rank_result in results:
        sparse, dense = rank_result[case]["sparse"], rank_result[case]["dense"]
        for step, (got, expected) in enumerate(zip(sparse["grads"], dense["grads"], strict=True)):
            for g, e in zip(got, expected, strict=True):
                assert (g == e).all(), f"{case}: step {step} gradient differs"
        for got, expected in zip(sparse["params"], dense["params"], strict=True):
            assert (got == expected).all(), f"{case}: trained parameters differ"
        emb_grad = torch.from_numpy(sparse["grads"][0][0])
        assert emb_grad[0].abs().sum() == 0  # padding
        assert emb_grad[200:].abs().sum() == 0  # never looked up
        touched = emb_grad.abs().sum(1) > 0
        assert touched.sum() > 10 and torch.all(emb_grad[touched].sum(1) == 0)  # rows DeepSpeed would drop
    assert all((a == b).all() for r in results[1:] for a, b in zip(r[case]["sparse"]["params"],
                                                                          results[0][case]["sparse"]["params"]))


@pytest.mark.parametrize("case", ["fp32", "window", "bf16"])
def test_bytes_are_the_touched_rows(runs: tuple[int, list[dict[str, Any]]], case: str) -> None:
    world, results = runs
    accum, _, extra = CASES[case]
    elem = 2 if "bf16" in extra else 4
    sparse, dense = results[0][case]["sparse"], results[0][case]["dense"]
    for step in range(1, STEPS):  # after the first window (its re-layout gathers rank 0's arrival order)
        (s_bytes, s_calls), (d_bytes, _) = sparse["stats"][step], dense["stats"][step]
        dense_tables = d_bytes["all_reduce"] - s_bytes["all_reduce"]
        assert dense_tables == (VOCAB + BAG_VOCAB) * DIM * elem  # the tables never go through all_reduce
        rows = [_touched(step, accum, r) for r in range(world)]
        emb_rows, bag_rows = sum(r[0] for r in rows), sum(r[1] for r in rows)
        # per table: the counts (int64 per rank), then int32 indices and the rows' values of every rank
        expected = 2 * world * 8 + (emb_rows + bag_rows) * (4 + DIM * elem)
        assert s_bytes["all_gather"] == expected and s_calls["all_gather"] == 6
        fraction = (emb_rows + bag_rows) / (VOCAB + BAG_VOCAB)
        assert fraction < 0.3 * accum * world / 3
        ratio = s_bytes["all_gather"] / dense_tables
        assert fraction <= ratio <= fraction * (1 + 4 / (DIM * elem)) + 0.01


def test_unsupported_setups_are_refused_by_key(runs: tuple[int, list[dict[str, Any]]]) -> None:
    messages = runs[1][0]["refusals"]
    assert len(messages) == 5
    for stage, message in zip((1, 2, 3), messages, strict=False):
        assert message.startswith(f"sparse_gradients: true needs zero_optimization.stage 0, got "
                                  f"zero_optimization.stage={stage}")
        assert "set zero_optimization.stage to 0 or sparse_gradients to false" in message
    assert "'head.weight' (tied weights)" in messages[3] and "Untie the weights or set sparse_gradients to false" \
        in messages[3]
    assert messages[4].startswith("sparse_gradients: true: the weight of Embedding 'emb' (sparse=True) received a "
                                  "dense gradient")


def test_tables_get_buckets_of_their_own() -> None:
    assert plan_buckets([3, 4, 100, 2, 2], 5, alone={2}) == [[0, 1], [2], [3, 4]]
    assert plan_buckets([100, 1], 5, alone={0, 1}) == [[0], [1]]
    assert plan_buckets([1, 1, 1], 5) == [[0, 1, 2]]


class EmbeddingMoE(nn.Module):
    """An embedding feeding a mixture of experts (expert parallelism 2): the table is a dense parameter."""

    def __init__(self) -> None:
        super().__init__()
        from zerospeed.moe.layer import MoE

        torch.manual_seed(3)
        self.emb = nn.Embedding(VOCAB, DIM)
        expert = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.moe = MoE(DIM, expert, num_experts=2, ep_size=2, k=1, drop_tokens=False)
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, l_aux, _ = self.moe(self.emb(ids).reshape(-1, DIM))
        return self.head(h).square().mean() + 0.01 * l_aux


def _train_moe(sparse: bool) -> dict[str, Any]:
    rank = torch.distributed.get_rank()
    engine, *_ = zerospeed.initialize(model=EmbeddingMoE(), config=_config(2, sparse, {}))
    grads = []
    for step in range(3):
        for m in range(2):
            engine.backward(engine(_batch(step, m, rank)["ids"]))
            if m == 1:
                grads.append(_plain(safe_get_full_grad(engine.module.emb.weight)))
            engine.step()
    return {"grads": grads, "params": {n: _plain(p.detach()) for n, p in engine.module.named_parameters()},
            "all_gather": engine.comm.stats.calls["all_gather"]}


def _moe_both() -> dict[str, Any]:
    return {"sparse": _train_moe(True), "dense": _train_moe(False)}


def test_an_embedding_beside_experts_equals_the_dense_exchange() -> None:
    """Two ranks: the dense all-reduce adds the two ranks' rows as the exchange does (a + b), exactly,
    whatever the values; experts keep their own (expert-data-parallel) state and exchange."""
    for result in run_distributed(_moe_both, 2):
        sparse, dense = result["sparse"], result["dense"]
        assert sparse["all_gather"] > dense["all_gather"]  # the table went as rows
        for got, expected in zip(sparse["grads"], dense["grads"], strict=True):
            assert (got == expected).all() and (got != 0).any()
        assert sparse["params"].keys() == dense["params"].keys()
        for name, value in sparse["params"].items():
            assert (value == dense["params"][name]).all(), name


def test_model_parallel_setups_are_refused_by_name() -> None:
    with pytest.raises(ConfigError) as caught:
        refuse_unsupported(stage=2, pipeline=True, tp=2)
    problems = caught.value.problems
    assert len(problems) == 3 and "zero_optimization.stage=2" in problems[0]
    assert problems[1].startswith("sparse_gradients: true is not supported with a PipelineModule")
    assert problems[2].startswith("sparse_gradients: true is not supported with tensor parallelism (tp size 2)")
    assert all(p.endswith("sparse_gradients to false") for p in problems)
    refuse_unsupported(stage=0, pipeline=False, tp=1)
