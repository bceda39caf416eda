"""Tensor-parallel layers (issue 17): exact parity with their plain torch counterparts, the
collectives each block issues (counted at the comm door), the vocabulary-parallel loss, the layout
record, and the errors. Pure pieces run in-process; layer parity runs on real gloo ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from zerospeed.distributed.mesh import ParallelDims
from zerospeed.tensor_parallel import (ColumnParallelLinear, ParamSplit, RowParallelLinear, TPLayout,
                                       VocabParallelEmbedding, tp_layout, vocab_parallel_cross_entropy)
from zerospeed.tensor_parallel.setup import declared_dims
from zerospeed.testing import run_distributed
from zerospeed.testing.tp_models import GPTConfig, TinyGPT, token_batch
from zerospeed.zero.step_grads import StepGrads, counted_norm


# -- pure -----------------------------------------------------------------------------------------
def test_param_split_shapes_and_blocks() -> None:
    split = ParamSplit(dim=1, rank=1, degree=4)
    assert split.full_shape((6, 3)) == (6, 12)
    assert split.blocks((6, 12)) == (6, 12, 1)
    assert ParamSplit(0, 0, 2).blocks((8, 5, 3)) == (1, 8, 15)
    with pytest.raises(ValueError, match="rank 2 outside degree 2"):
        ParamSplit(0, 2, 2)


def test_layout_counts_replicated_parameters_on_rank_zero_only() -> None:
    layout = TPLayout(degree=2, rank=1, splits={"a.weight": ParamSplit(0, 1, 2)})
    assert layout.counted_elsewhere(["a.weight", "norm.weight"]) == frozenset({"norm.weight"})
    assert TPLayout(degree=2, rank=0, splits={}).counted_elsewhere(["norm.weight"]) == frozenset()
    assert layout.to_json() == {"degree": 2, "splits": {"a.weight": 0}}


def test_counted_norm_leaves_out_ranges() -> None:
    t = torch.arange(10, dtype=torch.float32)
    keep = torch.cat([t[:2], t[5:7]])
    assert counted_norm(t, [(2, 5), (7, 10)]) == pytest.approx(float(keep.norm()))
    assert float(counted_norm(t, [(0, 10)])) == 0.0
    grads = StepGrads.in_memory([t.clone(), t.clone()], skip=[[(0, 9)], []])
    assert float(grads.local_norm()) == pytest.approx(float(torch.stack([t[9:].norm(), t.norm()]).norm()))


def test_plain_model_builds_without_a_group() -> None:
    """tp_group=None: the layers are their plain counterparts (and draw the same initial weights)."""
    torch.manual_seed(3)
    linear = nn.Linear(6, 4)
    torch.manual_seed(3)
    column = ColumnParallelLinear(6, 4)
    torch.manual_seed(3)
    row = RowParallelLinear(6, 4)
    for layer in (column, row):
        assert torch.equal(layer.weight, linear.weight) and torch.equal(layer.bias, linear.bias)
    torch.manual_seed(5)
    emb = nn.Embedding(10, 3, padding_idx=2)
    torch.manual_seed(5)
    vemb = VocabParallelEmbedding(10, 3, padding_idx=2)
    assert torch.equal(vemb.weight, emb.weight)
    x = torch.randn(2, 6)
    assert torch.equal(column(x), linear(x))
    ids = torch.tensor([[1, 2, 9]])
    assert torch.equal(vemb(ids), emb(ids))
    assert tp_layout(TinyGPT(GPTConfig())).splits == {}


def test_vocab_cross_entropy_on_one_rank_is_torchs() -> None:
    logits, target = torch.randn(3, 5, 7), torch.randint(0, 7, (3, 5))
    target[0, 0] = -100
    expected = F.cross_entropy(logits.reshape(-1, 7), target.reshape(-1))
    assert float(vocab_parallel_cross_entropy(logits, target)) == pytest.approx(float(expected), abs=1e-6)
    with pytest.raises(ValueError, match="reduction='avg'"):
        vocab_parallel_cross_entropy(logits, target, reduction="avg")
    with pytest.raises(ValueError, match="disagree"):
        vocab_parallel_cross_entropy(logits, target[:, :2])


def test_conflicting_degrees_are_refused() -> None:
    class MPU:
        def get_data_parallel_world_size(self) -> int:
            return 2

        def get_model_parallel_world_size(self) -> int:
            return 2

    with pytest.raises(ValueError, match=r"conflicting tensor-parallel sizes \(mpu: 2, tensor_parallel.autotp_size: 4\)"):
        declared_dims(8, model=nn.Linear(2, 2), mpu=MPU(), autotp_size=4)
    assert declared_dims(8, model=nn.Linear(2, 2), mpu=MPU(), autotp_size=0).dp == 4
    with pytest.raises(TypeError, match="get_data_parallel_world_size"):
        declared_dims(8, model=nn.Linear(2, 2), mpu=object(), autotp_size=0)


# -- on ranks -------------------------------------------------------------------------------------
def _grad_slices(par: nn.Module, ref: nn.Module) -> float:
    """Worst difference between each parameter's gradient and the reference's (sliced as split)."""
    layout, refs, worst = tp_layout(par), dict(ref.named_parameters()), 0.0
    for name, p in par.named_parameters():
        full = refs[name].grad
        split = layout.splits.get(name)
        want = full if split is None else full.chunk(split.degree, split.dim)[split.rank]
        worst = max(worst, (p.grad - want).abs().max().item())
    return worst


def _counts(tp: int, sequence_parallel: bool) -> dict[str, Any]:
    import torch.distributed as dist

    mesh = ParallelDims(world_size=dist.get_world_size(), tp=tp).build()
    cfg = GPTConfig(layers=3)
    torch.manual_seed(0)
    ref = TinyGPT(cfg)
    torch.manual_seed(0)
    par = TinyGPT(cfg, tp_group=mesh, sequence_parallel=sequence_parallel)
    ids, targets = token_batch(0, 4, cfg)
    ref_loss = ref(ids, targets)
    ref_loss.backward()
    comm = mesh.comm("tp")
    block = par.blocks[1]
    seen: dict[str, dict[str, int]] = {}

    def start(*_: Any) -> None:
        comm.stats.reset()

    def record(phase: str) -> Any:
        def hook(*_: Any) -> None:
            seen.setdefault(phase, dict(comm.stats.calls))
        return hook

    block.register_forward_pre_hook(start)
    block.register_forward_hook(record("forward"))
    # backward of block 1: from the gradient reaching its output to the one leaving its input
    block.register_full_backward_pre_hook(start)
    block.register_full_backward_hook(record("backward"))
    loss = par(ids, targets)
    loss.backward()
    return {"loss": loss.item(), "ref_loss": ref_loss.item(), "grad_err": _grad_slices(par, ref), **seen}


@pytest.mark.spawns
@pytest.mark.smoke
def test_block_collectives_and_parity_tp2() -> None:
    plain, sp = run_distributed(_counts, 2, 2, False), run_distributed(_counts, 2, 2, True)
    for r in plain + sp:
        assert r["loss"] == pytest.approx(r["ref_loss"], abs=1e-5)
        assert r["grad_err"] < 1e-5
    for r in plain:  # one all-reduce per attention block and per MLP block, each way
        assert r["forward"] == {"all_reduce": 2}
        assert r["backward"] == {"all_reduce": 2}
    for r in sp:  # the same bytes as all-gather + reduce-scatter; the norms' and row biases' gradients
        assert r["forward"] == {"all_gather": 2, "reduce_scatter": 2}  # are summed in one small all-reduce each
        assert r["backward"] == {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 4}


def _layers(tp: int) -> dict[str, float]:
    import torch.distributed as dist

    mesh = ParallelDims(world_size=dist.get_world_size(), tp=tp).build()
    out: dict[str, float] = {}
    torch.manual_seed(1)
    x = torch.randn(3, 5, 8, requires_grad=True)
    # gather_output and a row layer that splits its own (replicated) input
    torch.manual_seed(2)
    lin1, lin2 = nn.Linear(8, 12), nn.Linear(12, 8)
    col = ColumnParallelLinear.from_linear(lin1, tp_group=mesh, gather_output=True)
    row = RowParallelLinear.from_linear(lin2, tp_group=mesh, input_is_parallel=False)
    xp = x.detach().clone().requires_grad_(True)
    (lin2(lin1(x)).square().sum()).backward()
    (row(col(xp)).square().sum()).backward()
    out["row_col_out"] = (xp.grad - x.grad).abs().max().item()
    out["col_w_grad"] = (col.weight.grad - lin1.weight.grad.chunk(tp, 0)[mesh.comm("tp").rank]).abs().max().item()
    out["row_w_grad"] = (row.weight.grad - lin2.weight.grad.chunk(tp, 1)[mesh.comm("tp").rank]).abs().max().item()
    # the embedding with a padding row on one rank and ids on every rank
    torch.manual_seed(3)
    emb = nn.Embedding(16, 4, padding_idx=13)
    vemb = VocabParallelEmbedding.from_embedding(emb, tp_group=mesh)
    ids = torch.tensor([[0, 13, 5, 15], [8, 7, 13, 1]])
    emb(ids).pow(3).sum().backward()
    vemb(ids).pow(3).sum().backward()
    out["emb_grad"] = (vemb.weight.grad - emb.weight.grad.chunk(tp, 0)[mesh.comm("tp").rank]).abs().max().item()
    # the vocabulary-parallel loss with ignored tokens, every reduction
    torch.manual_seed(4)
    logits = torch.randn(2, 6, 16, requires_grad=True)
    target = torch.randint(0, 16, (2, 6))
    target[1, 2:4] = -100
    mine = logits.detach().chunk(tp, -1)[mesh.comm("tp").rank].clone().requires_grad_(True)
    for reduction in ("mean", "sum", "none"):
        want = F.cross_entropy(logits.reshape(-1, 16), target.reshape(-1), reduction=reduction)
        got = vocab_parallel_cross_entropy(mine, target, mesh, reduction=reduction)
        out[f"ce_{reduction}"] = (got.reshape(-1) - want.reshape(-1)).abs().max().item()
    logits.grad = None
    F.cross_entropy(logits.reshape(-1, 16), target.reshape(-1)).backward()
    vocab_parallel_cross_entropy(mine, target, mesh).backward()
    out["ce_grad"] = (mine.grad - logits.grad.chunk(tp, -1)[mesh.comm("tp").rank]).abs().max().item()
    return out


@pytest.mark.spawns
def test_layers_match_their_plain_counterparts_tp2() -> None:
    for result in run_distributed(_layers, 2, 2):
        for key, err in result.items():
            assert err < 1e-5, key


def _refusals() -> list[str]:
    import torch.distributed as dist

    mesh = ParallelDims(world_size=dist.get_world_size(), tp=2).build()
    errors = []
    for make in (lambda: ColumnParallelLinear(4, 5, tp_group=mesh), lambda: RowParallelLinear(3, 4, tp_group=mesh),
                 lambda: VocabParallelEmbedding(7, 2, tp_group=mesh),
                 lambda: RowParallelLinear(4, 4, input_is_parallel=False, sequence_parallel=True, tp_group=mesh)):
        try:
            make()
        except ValueError as exc:
            errors.append(str(exc))
    return errors


@pytest.mark.spawns
def test_uneven_splits_are_refused_with_the_fix() -> None:
    errors = run_distributed(_refusals, 2)[0]
    assert errors[0].startswith("ColumnParallelLinear out_features = 5 is not divisible by the tensor-parallel size 2")
    assert "RowParallelLinear in_features = 3" in errors[1]
    assert "VocabParallelEmbedding num_embeddings = 7" in errors[2]
    assert "needs input_is_parallel=True" in errors[3]


def test_an_mpu_with_pipeline_stages_needs_a_pipeline_module() -> None:
    class MPU:
        def get_data_parallel_world_size(self) -> int:
            return 2

        def get_model_parallel_world_size(self) -> int:
            return 2

        def get_pipe_parallel_world_size(self) -> int:
            return 2

    with pytest.raises(ValueError, match=r"pipeline-parallel size is 2 but the model is not a PipelineModule; "
                       r"give initialize zerospeed.pipe.PipelineModule\(layers, num_stages=2\)"):
        declared_dims(8, model=nn.Linear(2, 2), mpu=MPU(), autotp_size=0)
    with pytest.raises(ValueError, match="pipeline-parallel size is 2"):
        declared_dims(8, model=nn.Linear(2, 2), mpu=MPU(), autotp_size=0, pipeline_stages=4)
    assert declared_dims(8, model=nn.Linear(2, 2), mpu=MPU(), autotp_size=0, pipeline_stages=2).pp == 2


def test_fused_parts_are_outer_rows_of_a_plain_split() -> None:
    """GPT-2's c_attn ([in, 3h], q/k/v each split): the slice's values are chunk r of the middle axis of
    the (outer, split, inner) view, which is what checkpoints reshard by."""
    full = torch.arange(4 * 12).reshape(4, 12)
    for rank in (0, 1):
        split = ParamSplit(dim=1, rank=rank, degree=2, parts=3)
        outer, middle, inner = split.blocks(tuple(full.shape))
        assert (outer, middle, inner) == (12, 4, 1)
        view = full.reshape(outer, middle, inner)
        assert torch.equal(split.local_slice(full).reshape(-1), view.chunk(2, dim=1)[rank].reshape(-1))
