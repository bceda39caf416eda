"""``quantize_linears`` (issue 20): which modules it replaces and how (Linear, GPT-2's Conv1D, the
tensor-parallel layers on 2 gloo ranks), what it leaves alone (tied heads, ``skip``), the bytes it
reports, dtypes, and the acceptance on small GPT-2 and Llama models built from configs: logits' cosine
with fp32, weight bytes and greedy tokens.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from zerospeed.inference.quantize import (DEFAULT_GROUP_SIZE, Int8ColumnParallel, Int8Conv1D, Int8Linear,
                                          Int8RowParallel, quantize_linears)
from zerospeed.ops import int8
from zerospeed.testing import run_distributed


def _deq(module: Any) -> torch.Tensor:
    return int8.dequantize_groupwise(module.qweight, module.scales, module.group_size)


def test_linears_are_replaced_and_compute_with_their_dequantized_weights() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 10, bias=False))
    float_weights = [model[0].weight.detach().clone(), model[2].weight.detach().clone()]
    x = torch.randn(2, 5, 64)
    report = quantize_linears(model, group_size=32)
    first, last = model[0], model[2]
    assert isinstance(first, Int8Linear) and isinstance(last, Int8Linear)
    assert (first.in_features, first.out_features, last.in_features, last.out_features) == (64, 48, 48, 10)
    assert report.quantized == ("0", "2") and report.skipped == () and report.modules == 2
    assert report.weight_bytes_before == (64 * 48 + 48 * 10) * 4
    assert report.weight_bytes_after == 64 * 48 + 48 * 10 + 4 * (48 * 2 + 10 * 2)
    assert math.isclose(report.ratio, report.weight_bytes_after / report.weight_bytes_before)
    for module, w in zip((first, last), float_weights, strict=True):
        q, s = int8.quantize_groupwise(w, 32)
        assert torch.equal(module.qweight, q) and torch.equal(module.scales, s)
        assert torch.equal(module.weight, _deq(module)) and module.weight.dtype == torch.float32
    want = F.linear(F.relu(F.linear(x, _deq(first), first.bias)), _deq(last))
    assert torch.allclose(model(x), want, atol=1e-5)


def test_bf16_activations_and_casting_after_quantization() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(40, 24)).to(torch.bfloat16)
    quantize_linears(model, group_size=16)  # in_features 40: groups of 16, 16 and 8
    layer = model[0]
    assert layer.scales.shape == (24, 3) and layer.weight.dtype == torch.bfloat16
    x = torch.randn(3, 40).to(torch.bfloat16)
    y = model(x)
    assert y.dtype == torch.bfloat16
    want = F.linear(x.float(), _deq(layer), layer.bias.float()).to(torch.bfloat16)
    assert torch.allclose(y.float(), want.float(), rtol=2 ** -7, atol=1e-3)
    model.float()  # a dtype cast keeps the scales fp32 and casts the bias
    assert layer.scales.dtype == torch.float32 and layer.bias.dtype == torch.float32
    assert layer.weight.dtype == torch.float32 and model(x.float()).dtype == torch.float32


def test_gpt2_conv1d_keeps_its_layout_facts() -> None:
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(2)
    conv = Conv1D(24, 40)  # nf=24 outputs, nx=40 inputs, weight [40, 24]
    nn.init.normal_(conv.bias)
    model = nn.Sequential(conv)
    w = conv.weight.detach().clone()
    quantize_linears(model, group_size=8)
    layer = model[0]
    assert isinstance(layer, Int8Conv1D)
    assert (layer.nf, layer.nx, layer.in_features, layer.out_features) == (24, 40, 40, 24)
    assert layer.weight.shape == (40, 24) and torch.equal(layer.qweight, int8.quantize_groupwise(w.t(), 8)[0])
    x = torch.randn(2, 3, 40)
    assert torch.allclose(layer(x), x @ layer.weight + conv.bias, atol=1e-5)


class _TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        shared = nn.Linear(16, 16)
        self.block = nn.ModuleDict({"a": shared, "b": shared})  # one module at two places
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.head(self.block["b"](self.block["a"](h)))


def test_tied_head_is_kept_and_shared_modules_are_replaced_everywhere() -> None:
    torch.manual_seed(3)
    model = _TiedLM()
    embedding = model.embed.weight.detach().clone()
    report = quantize_linears(model)
    assert report.quantized == ("block.a",)
    assert report.skipped == (("head", "its weight is tied to another module (e.g. the token embedding); "
                                       "quantizing it would change that one too"),)
    assert type(model.head) is nn.Linear and model.head.weight is model.embed.weight
    assert torch.equal(model.embed.weight, embedding)
    assert isinstance(model.block["a"], Int8Linear) and model.block["b"] is model.block["a"]
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 50)


def test_skip_and_refusals() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    report = quantize_linears(model, skip=lambda name, module: name == "1")
    assert report.quantized == ("0",) and report.skipped == (("1", "skip() asked for it"),)
    assert type(model[1]) is nn.Linear and report.group_size == DEFAULT_GROUP_SIZE
    with pytest.raises(ValueError, match="group_size=0: pass a positive number"):
        quantize_linears(nn.Sequential(nn.Linear(8, 8)), group_size=0)
    with pytest.raises(TypeError, match=r"Linear is itself one: wrap it \(nn.Sequential\(layer\)\)"):
        quantize_linears(nn.Linear(8, 8))
    with pytest.raises(ValueError, match=r"Int8Linear: expected a floating input with last dimension 8 .*\(2, 7\)"):
        model[0](torch.randn(2, 7))
    again = quantize_linears(model)  # already quantized layers are not linear-like any more
    assert again.quantized == ("1",)


def _tensor_parallel(tp: int) -> dict[str, float]:
    import torch.distributed as dist
    from transformers.pytorch_utils import Conv1D

    from zerospeed.distributed.mesh import ParallelDims
    from zerospeed.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from zerospeed.tensor_parallel.conv1d import ColumnParallelConv1D, RowParallelConv1D

    mesh = ParallelDims(world_size=dist.get_world_size(), tp=tp).build()
    torch.manual_seed(5)
    lin1, lin2 = nn.Linear(64, 96), nn.Linear(96, 64)
    conv1, conv2 = Conv1D(3 * 32, 64), Conv1D(64, 32)  # a fused qkv-like column and its row partner
    nn.init.normal_(conv1.bias), nn.init.normal_(conv2.bias)
    x = torch.randn(2, 5, 64)
    # the single-process reference: each float layer quantized whole (the splits keep groups whole)
    ref = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64), Conv1D(96, 64), Conv1D(64, 32))
    ref.load_state_dict(nn.Sequential(lin1, lin2, conv1, conv2).state_dict())
    quantize_linears(ref, group_size=16)
    with torch.no_grad():
        want_lin = ref[1](ref[0](x))
        want_conv = ref[3](ref[2](x)[..., :32])  # the row conv reads q (its first fused part)
    par = nn.ModuleDict({
        "col": ColumnParallelLinear.from_linear(lin1, tp_group=mesh),
        "row": RowParallelLinear.from_linear(lin2, tp_group=mesh),
        "gathered": ColumnParallelLinear.from_linear(lin1, tp_group=mesh, gather_output=True),
        "row_split": RowParallelLinear.from_linear(lin2, tp_group=mesh, input_is_parallel=False),
        "qkv": ColumnParallelConv1D(conv1, tp_group=mesh, parts=3), "proj": RowParallelConv1D(conv2, tp_group=mesh)})
    report = quantize_linears(par, group_size=16)
    kinds = {name: type(module).__name__ for name, module in par.items()}
    with torch.no_grad():
        lin = par["row"](par["col"](x))
        lin_gathered = par["row_split"](par["gathered"](x))
        qkv = par["qkv"](x)  # this rank's [q_r, k_r, v_r]
        conv = par["proj"](qkv[..., : 32 // tp])
    rank = mesh.comm("tp").rank
    return {"modules": float(report.modules), "col": float(kinds["col"] == Int8ColumnParallel.__name__),
            "row": float(kinds["proj"] == Int8RowParallel.__name__),
            "out_features": float(par["col"].out_features), "local_rows": float(par["col"].qweight.shape[0]),
            "lin": (lin - want_lin).abs().max().item(), "lin_gathered": (lin_gathered - want_lin).abs().max().item(),
            "conv": (conv - want_conv).abs().max().item(),
            "q_slice": (qkv[..., : 32 // tp] - ref[2](x)[..., rank * 32 // tp:(rank + 1) * 32 // tp]).abs().max().item()}


@pytest.mark.spawns
def test_tensor_parallel_layers_keep_their_collectives_tp2() -> None:
    for result in run_distributed(_tensor_parallel, 2, 2):
        assert result["modules"] == 6 and result["col"] == 1 and result["row"] == 1
        assert result["out_features"] == 96 and result["local_rows"] == 48
        for key in ("lin", "lin_gathered", "conv", "q_slice"):
            assert result[key] < 1e-5, (key, result[key])


def _acceptance(kind: str, **overrides: Any) -> dict[str, float]:
    from zerospeed.testing.hf_models import tiny_causal_lm

    model = tiny_causal_lm(kind, seed=0, **overrides).eval()
    quant = tiny_causal_lm(kind, seed=0, **overrides).eval()
    quant.load_state_dict(model.state_dict())
    report = quantize_linears(quant)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(2, overrides.get("vocab_size", 97), (100, 8), generator=gen)
    with torch.no_grad():
        ref, got = model(prompts).logits, quant(prompts).logits
        greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=1)
        ref_tokens = model.generate(prompts, attention_mask=torch.ones_like(prompts), **greedy)
        got_tokens = quant.generate(prompts, attention_mask=torch.ones_like(prompts), **greedy)
    cos = F.cosine_similarity(got.flatten(1).double(), ref.flatten(1).double(), dim=-1)
    linear_bytes = sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
                       if type(m).__name__ in ("Linear", "Conv1D") and m.weight is not model.get_input_embeddings().weight)
    print(f"{kind}: cosine min {cos.min().item():.6f}, bytes {report.ratio:.4f}x, same greedy tokens "
          f"{(got_tokens == ref_tokens).all(dim=1).float().mean().item():.2f}")
    return {"cos_min": cos.min().item(), "ratio": report.ratio, "modules": float(report.modules),
            "covered": report.weight_bytes_before / linear_bytes,
            "same_tokens": (got_tokens == ref_tokens).all(dim=1).float().mean().item()}


def test_acceptance_gpt2_cosine_bytes_and_greedy_tokens() -> None:
    r = _acceptance("gpt2", n_embd=256, n_layer=2, n_head=4, vocab_size=1000, n_positions=64)
    assert r["modules"] == 8 and r["covered"] == 1.0  # 4 per block; the tied head is kept
    assert r["cos_min"] >= 0.999, r
    assert r["ratio"] <= 0.3, r
    # all 6 greedy tokens equal; random weights give near-flat logits, the hard case for argmax
    assert r["same_tokens"] >= 0.7, r


def test_acceptance_llama_quantizes_its_untied_head() -> None:
    r = _acceptance("llama", hidden_size=256, intermediate_size=640, num_hidden_layers=2, vocab_size=1000,
                    max_position_embeddings=64)
    assert r["modules"] == 2 * 7 + 1 and r["covered"] == 1.0
    assert r["cos_min"] >= 0.999, r
    assert r["ratio"] <= 0.3, r
    assert r["same_tokens"] >= 0.7, r
