"""Tensor-parallel inference (issue 20, acceptance): tiny GPT-2, Llama and Mixtral built from configs generate
exactly the tokens of single-process Hugging Face ``generate()`` at tp=2, logits within 1e-5; a custom
(non-HF) model split by a DeepSpeed-style ``injection_policy``; refusals naming the layer."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from zerospeed.testing import run_distributed

NEW_TOKENS = 32


def _tiny(kind: str, **overrides: Any) -> nn.Module:
    """A seeded tiny causal LM of ``kind`` (positions for a 4-token prompt plus 32 new tokens)."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    from zerospeed.testing.hf_models import tiny_gpt2_config, tiny_llama_config

    if kind == "gpt2":
        config = tiny_gpt2_config(n_positions=64, **overrides)
    elif kind == "llama":
        config = tiny_llama_config(max_position_embeddings=64, **overrides)
    else:
        fields: dict[str, Any] = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                      num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False,
                                      bos_token_id=0, eos_token_id=1, pad_token_id=1)
        config = MixtralConfig(**{**fields, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = None  # always 32 new tokens
    return model.eval()


PROMPTS = torch.tensor([[5, 17, 42, 8], [60, 3, 3, 71]])


class Attention(nn.Module):
    """A plain multi-head self-attention whose reshapes read ``num_heads`` and ``embed_dim``."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.num_heads, self.embed_dim, self.head_dim = heads, dim, dim // heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, self.embed_dim))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = nn.Sequential()
        self.mlp.fc1, self.mlp.act, self.mlp.fc2 = nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """A small non-HF language model (no ``config``): AutoTP needs an ``injection_policy`` for it."""

    def __init__(self, vocab: int = 97, dim: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def _greedy(model: nn.Module, ids: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def _hf_case(kind: str, overrides: dict[str, Any], **engine_kwargs: Any) -> dict[str, Any]:
    import zerospeed

    model = _tiny(kind, **overrides)
    reference = copy.deepcopy(model)
    want = reference.generate(PROMPTS, max_new_tokens=NEW_TOKENS, do_sample=False)
    want_logits = reference(want).logits
    engine = zerospeed.init_inference(model, tensor_parallel={"tp_size": 2}, **{"dtype": torch.float32, **engine_kwargs})
    got = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, do_sample=False)
    got_logits = engine(want).logits
    split = sorted({type(m).__name__ for m in engine.module.modules()
                    if type(m).__name__.endswith(("Parallel", "ParallelLinear", "ParallelConv1D", "ParallelHead",
                                                  "ParallelInputEmbedding", "ExpertShard"))})
    return {"tokens_equal": torch.equal(got, want), "new_tokens": got.shape[1] - PROMPTS.shape[1],
            "max_logit_diff": (got_logits - want_logits).abs().max().item(), "split": split,
            "tp": (engine.tp_size, engine.mp_world_size), "params": sum(p.numel() for p in engine.module.parameters())
            , "full_params": sum(p.numel() for p in reference.parameters())}


def zerospeed_int8_tokens() -> list[list[int]]:
    """Split, injected and int8 at tp=2: the tokens (every rank must produce the same ones)."""
    import zerospeed

    engine = zerospeed.init_inference(_tiny("llama"), tensor_parallel={"tp_size": 2}, dtype=torch.int8,
                                      replace_with_kernel_inject=True, max_out_tokens=64)
    return engine.generate(PROMPTS, max_new_tokens=8, do_sample=False).tolist()


def _policy_case() -> dict[str, Any]:
    import zerospeed

    torch.manual_seed(0)
    model = TinyLM().eval()
    reference = copy.deepcopy(model)
    with torch.no_grad():
        want = _greedy(reference, PROMPTS, NEW_TOKENS)
        want_logits = reference(want)
    engine = zerospeed.init_inference(model, config={"tensor_parallel": {"tp_size": 2}, "dtype": "fp32"},
                                      injection_policy={Block: ("attn.out_proj", "mlp.fc2")})
    got = _greedy(engine, PROMPTS, NEW_TOKENS)
    attn = engine.module.blocks[0].attn
    return {"tokens_equal": torch.equal(got, want), "max_logit_diff": (engine(want) - want_logits).abs().max().item(),
            "heads": (attn.num_heads, attn.embed_dim, attn.head_dim),
            "kinds": [type(m).__name__ for m in (attn.q, attn.out_proj, engine.module.blocks[1].mlp.fc1,
                                                  engine.module.blocks[1].mlp.fc2, engine.module.lm_head)]}


def _all_cases() -> dict[str, Any]:
    out: dict[str, Any] = {kind: _hf_case(kind, {}) for kind in ("gpt2", "llama", "mixtral")}
    out["gpt2_odd_vocab"] = _hf_case("gpt2", {"vocab_size": 101})
    # the whole serving path at tp=2: split, then the fused KV-cached decoder over the split projections
    out["llama_injected"] = _hf_case("llama", {}, replace_with_kernel_inject=True, max_out_tokens=64)
    out["gpt2_injected"] = _hf_case("gpt2", {}, replace_with_kernel_inject=True, max_out_tokens=64)
    int8 = zerospeed_int8_tokens()
    out["int8_injected_tokens"] = int8
    out["policy"] = _policy_case()
    out["refusals"] = _refusals()
    out["group_and_sampling"] = _group_and_sampling()
    return out


class _WorldMpu:
    """A Megatron-style ``mpu`` whose model-parallel group is the whole (2-rank) world."""

    def get_model_parallel_world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size()

    def get_model_parallel_group(self) -> Any:
        import torch.distributed as dist

        return dist.group.WORLD


def _group_and_sampling() -> dict[str, Any]:
    """``tensor_parallel.tp_group`` (a torch group) or a Megatron ``mpu`` (deprecated top-level key) sets the degree;
    beam search matches HF's; sampling draws the same tokens on every rank although each rank seeded its generator
    differently before ``init_inference`` (rank 0's state is shared)."""
    import torch.distributed as dist

    import zerospeed

    model = _tiny("llama")
    reference = copy.deepcopy(model)
    engine = zerospeed.init_inference(model, tensor_parallel={"tp_group": dist.group.WORLD}, dtype="fp32")
    greedy = engine.generate(PROMPTS, max_new_tokens=8, do_sample=False)
    beams = engine.generate(PROMPTS, max_new_tokens=8, num_beams=3, do_sample=False)
    with pytest.warns(DeprecationWarning, match="mpu is deprecated; use tensor_parallel.mpu instead"):
        by_mpu = zerospeed.init_inference(_tiny("gpt2"), mpu=_WorldMpu(), dtype="fp32")
    mpu_equal = torch.equal(by_mpu.generate(PROMPTS, max_new_tokens=8, do_sample=False),
                            _tiny("gpt2").generate(PROMPTS, max_new_tokens=8, do_sample=False))
    unsplit = _tiny("gpt2")  # (seeds the generator itself)
    torch.manual_seed(100 + dist.get_rank())
    sampler = zerospeed.init_inference(unsplit, tensor_parallel={"tp_size": 2}, dtype="fp32")
    sampled = sampler.generate(PROMPTS, max_new_tokens=16, do_sample=True, top_k=0)
    return {"tp": engine.tp_size, "greedy_equal": torch.equal(greedy, reference.generate(PROMPTS, max_new_tokens=8,
                                                                                          do_sample=False)),
            "beams_equal": torch.equal(beams, reference.generate(PROMPTS, max_new_tokens=8, num_beams=3,
                                                                 do_sample=False)),
            "mpu": (by_mpu.tp_size, mpu_equal), "sampled": sampled.tolist()}


def _refused(model: nn.Module, **kwargs: Any) -> str:
    import zerospeed

    try:
        zerospeed.init_inference(model, dtype=torch.float32, **{"tensor_parallel": {"tp_size": 2}, **kwargs})
    except (ValueError, NotImplementedError) as err:
        return str(err)
    return "not refused"


def _refusals() -> dict[str, str]:
    meta = TinyLM()
    meta.lm_head.to_empty(device="meta")
    return {
        "gpt2_heads": _refused(_tiny("gpt2", n_embd=36, n_head=3)),
        "mixtral_experts": _refused(_tiny("mixtral", num_local_experts=3)),
        "no_rules": _refused(TinyLM()),
        "policy_name": _refused(TinyLM(), injection_policy={Block: ("attn.o_proj",)}),
        "policy_class": _refused(TinyLM(), injection_policy={Attention: ("out_proj",), Block: ("mlp.fc2",)}),
        "policy_heads": _refused(TinyLM(heads=3, dim=36), injection_policy={Block: ("attn.out_proj", "mlp.fc2")}),
        "meta": _refused(meta, injection_policy={Block: ("attn.out_proj", "mlp.fc2")}),
        "tp3": _refused(TinyLM(), tensor_parallel={"tp_size": 3}),
    }


@pytest.mark.spawns
def test_tp2_generation_matches_single_process_hf() -> None:
    ranks = run_distributed(_all_cases, 2, timeout=300)
    assert ranks[0]["refusals"] == ranks[1]["refusals"]
    for rank in ranks:
        for kind in ("gpt2", "llama", "mixtral", "gpt2_odd_vocab", "llama_injected", "gpt2_injected"):
            case = rank[kind]
            assert case["tokens_equal"], (kind, case)
            assert case["new_tokens"] == NEW_TOKENS
            assert case["max_logit_diff"] <= 1e-5, (kind, case)
            assert case["tp"] == (2, 2)
            assert case["params"] < case["full_params"], (kind, case)  # each rank holds less than the model
        assert rank["gpt2"]["split"] == ["ColumnParallelConv1D", "RowParallelConv1D", "VocabParallelHead",
                                         "VocabParallelInputEmbedding"]
        assert rank["llama"]["split"] == ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelHead"]
        assert rank["mixtral"]["split"] == ["ColumnParallelLinear", "ExpertShard", "RowParallelLinear",
                                            "VocabParallelHead"]
        policy = rank["policy"]
        assert policy["tokens_equal"] and policy["max_logit_diff"] <= 1e-5, policy
        assert policy["heads"] == (2, 16, 8)
        assert policy["kinds"] == ["ColumnParallelLinear", "RowParallelLinear", "ColumnParallelLinear",
                                   "RowParallelLinear", "VocabParallelHead"]

    assert ranks[0]["int8_injected_tokens"] == ranks[1]["int8_injected_tokens"]
    assert len(ranks[0]["int8_injected_tokens"][0]) == PROMPTS.shape[1] + 8
    sampling = [rank["group_and_sampling"] for rank in ranks]
    assert all(case["tp"] == 2 and case["greedy_equal"] and case["beams_equal"] for case in sampling), sampling
    assert all(case["mpu"] == (2, True) for case in sampling), sampling
    assert sampling[0]["sampled"] == sampling[1]["sampled"]
    refusals = ranks[0]["refusals"]
    assert refusals["gpt2_heads"] == (
        "attention 'transformer.h.0.attn' has 3 attention heads, not divisible by the tensor-parallel size 2: each "
        "rank must hold whole heads; choose a tensor-parallel size that divides 3")
    assert refusals["mixtral_experts"] == (
        "model.layers.0.mlp.experts: 3 experts are not divisible by the tensor-parallel size 2: each rank must hold "
        "whole experts; choose a tensor-parallel size that divides the expert count")
    assert refusals["no_rules"] == (
        "tensor-parallel inference has no built-in rules for model_type=None (TinyLM; it knows ['gpt2', 'llama', "
        "'mistral', 'mixtral', 'qwen2']); give injection_policy={BlockClass: ('<attention output linear>', "
        "'<MLP output linear>')} naming the row-parallel linears of the model's transformer block")
    assert refusals["policy_name"] == (
        "injection_policy: Block at 'blocks.0' has no linear layer 'attn.o_proj' (its linears: ['attn.k', "
        "'attn.out_proj', 'attn.q', 'attn.v', 'mlp.fc1', 'mlp.fc2']); name the row-parallel linears relative to "
        "the block")
    assert refusals["policy_class"] == (
        "injection_policy: 'blocks.0.attn.out_proj' is row-parallel under Attention but column-parallel under Block "
        "(one block holds the other); describe each linear once: drop one of the two entries")
    assert refusals["policy_heads"] == (
        "blocks.0.attn (Attention): num_heads = 3 is not divisible by the tensor-parallel size 2; each rank must "
        "hold whole heads: choose a tensor-parallel size that divides it")
    assert refusals["meta"] == ("the model has parameters on the meta device; build it on the host "
                                "(set_empty_params loading is not built)")
    assert refusals["tp3"] == ("tensor_parallel.tp_size: 3 does not divide the 2 ranks of this job; launch a "
                               "multiple of 3 ranks or change tp_size")


def test_vocab_range_splits_unevenly() -> None:
    from zerospeed.inference.tp_layers import vocab_range

    assert [vocab_range(97, 2, r) for r in range(2)] == [(0, 49, 49), (49, 97, 49)]
    assert [vocab_range(50257, 2, r) for r in range(2)] == [(0, 25129, 25129), (25129, 50257, 25129)]
    assert [vocab_range(5, 4, r) for r in range(4)] == [(0, 2, 2), (2, 4, 2), (4, 5, 2), (5, 5, 2)]  # last: none
