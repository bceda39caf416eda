"""Kernel injection (``zerospeed.inference.fused``): the fused model, driven by Hugging Face's own
``generate()``, gives HF's tokens and logits for tiny GPT-2, Llama and Mixtral models built from configs.

Each case builds the same seeded model twice: the reference runs Hugging Face's code (``DynamicCache``,
its masks and attention), the other is injected. Greedy tokens must be equal exactly, logits within
1e-5 at the prefill and at every decode step, in fp32; bf16 agrees loosely.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from zerospeed.inference.fused import (CacheOverflowError, FusedKVCache, FusedReport, UnsupportedModelError,
                                       inject_fused)
from zerospeed.testing import run_distributed
from zerospeed.testing.hf_models import VOCAB, tiny_gpt2_config, tiny_llama_config

@pytest.fixture(autouse=True)
def one_thread() -> Any:
    """Tiny models: one thread is fastest, and it spares these tests the OpenMP barrier waits of a busy
    machine (each parallel op waits for a second, descheduled thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


FAMILIES = ["gpt2", "llama", "mixtral"]
TOL = 1e-5
NEW = 32


def tiny(kind: str, *, seed: int = 0, positions: int = 96) -> Any:
    """A seeded tiny causal LM of ``kind`` with room for ``positions`` positions."""
    from transformers import AutoModelForCausalLM, MistralConfig, MixtralConfig

    if kind == "gpt2":
        config = tiny_gpt2_config(n_positions=positions)
    elif kind == "llama":
        config = tiny_llama_config(max_position_embeddings=positions)
    elif kind == "mixtral":
        config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                               num_experts_per_tok=2, max_position_embeddings=positions, bos_token_id=0,
                               eos_token_id=1, pad_token_id=1)
    elif kind == "mistral":  # a sliding window as long as the positions: the fused cache must not exceed it
        config = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                               sliding_window=positions, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def pair(kind: str, *, max_out_tokens: int = 80, **kw: Any) -> tuple[Any, Any, FusedReport]:
    ref = tiny(kind, **kw)
    fused = copy.deepcopy(ref)
    report = inject_fused(fused, max_out_tokens=max_out_tokens)
    return ref, fused, report


def prompts(batch: int, length: int, *, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def left_padded(lengths: list[int], *, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of different lengths, left-padded with the pad id 1, and their attention mask."""
    ids = prompts(len(lengths), max(lengths), seed=seed)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, ids.shape[1] - n:] = 1
    return ids.masked_fill(mask == 0, 1), mask


def greedy(model: Any, ids: torch.Tensor, mask: torch.Tensor | None = None, new: int = NEW) -> Any:
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask if mask is not None else torch.ones_like(ids),
                              max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                              pad_token_id=1, output_logits=True, return_dict_in_generate=True)


def assert_same_generation(ref_out: Any, out: Any) -> None:
    assert torch.equal(out.sequences, ref_out.sequences)
    assert len(out.logits) == len(ref_out.logits) == NEW
    for step, (got, want) in enumerate(zip(out.logits, ref_out.logits, strict=True)):
        torch.testing.assert_close(got, want, atol=TOL, rtol=0, msg=f"step {step}")


@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_single_prompt_equals_hf_tokens_and_logits_at_every_step(kind: str) -> None:
    ref, fused, _ = pair(kind)
    ids = prompts(1, 11)
    assert_same_generation(greedy(ref, ids), greedy(fused, ids))


@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_left_padded_batch_equals_hf(kind: str) -> None:
    ref, fused, _ = pair(kind)
    ids, mask = left_padded([12, 7, 3, 12])
    assert_same_generation(greedy(ref, ids, mask), greedy(fused, ids, mask))


def test_mistral_left_padded_batch_equals_hf_and_a_cache_beyond_its_sliding_window_is_refused() -> None:
    ref, fused, report = pair("mistral")
    assert report.family == "mistral"
    ids, mask = left_padded([12, 6])
    assert_same_generation(greedy(ref, ids, mask), greedy(fused, ids, mask))
    with pytest.raises(UnsupportedModelError, match="max_out_tokens=97 exceeds the model's sliding_window=96"):
        inject_fused(tiny("mistral"), max_out_tokens=97)


@pytest.mark.parametrize("kind", FAMILIES)
def test_beam_search_reorders_the_fused_cache_as_hf_does(kind: str) -> None:
    """Beam search reorders the cache rows every step (``FusedKVCache.reorder_cache``): same beams, same scores."""
    ref, fused, _ = pair(kind)
    ids, mask = left_padded([9, 5, 9])
    outs = []
    for model in (ref, fused):
        with torch.no_grad():
            outs.append(model.generate(ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, num_beams=3,
                                       num_return_sequences=2, do_sample=False, eos_token_id=None, pad_token_id=1,
                                       output_scores=True, return_dict_in_generate=True))
    assert torch.equal(outs[1].sequences, outs[0].sequences)
    torch.testing.assert_close(outs[1].sequences_scores, outs[0].sequences_scores, atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", FAMILIES)
def test_prefill_logits_at_every_position_equal_hf(kind: str) -> None:
    ref, fused, _ = pair(kind)
    ids = prompts(2, 20)
    with torch.no_grad():
        want, got = ref(ids).logits, fused(ids).logits
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    ids, mask = left_padded([20, 9])
    with torch.no_grad():
        want, got = ref(ids, attention_mask=mask).logits, fused(ids, attention_mask=mask).logits
    real = mask.bool()  # padding rows' outputs are never read
    torch.testing.assert_close(got[real], want[real], atol=TOL, rtol=0)


def test_chunked_continuation_through_the_returned_cache_equals_one_pass() -> None:
    """A forward of several new tokens after a cached prefix needs the causal mask with an offset."""
    ref, fused, _ = pair("llama")
    ids = prompts(2, 16)
    with torch.no_grad():
        want = ref(ids).logits
        first = fused(ids[:, :10], use_cache=True)
        assert isinstance(first.past_key_values, FusedKVCache) and first.past_key_values.get_seq_length() == 10
        rest = fused(ids[:, 10:], past_key_values=first.past_key_values, use_cache=True)
    torch.testing.assert_close(torch.cat([first.logits, rest.logits], dim=1), want, atol=TOL, rtol=0)


def test_sampling_with_a_fixed_seed_equals_hf() -> None:
    ref, fused, _ = pair("llama")
    ids, mask = left_padded([9, 5])
    outs = []
    for model in (ref, fused):
        torch.manual_seed(123)
        with torch.no_grad():
            outs.append(model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                                       do_sample=True, top_k=20, temperature=0.9, eos_token_id=None,
                                       pad_token_id=1))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_bf16_runs_and_agrees_loosely(kind: str) -> None:
    ref = tiny(kind).to(torch.bfloat16)
    fused = copy.deepcopy(tiny(kind))
    report = inject_fused(fused, max_out_tokens=80, dtype=torch.bfloat16)
    assert report.dtype == torch.bfloat16 and next(fused.parameters()).dtype == torch.bfloat16
    ids = prompts(1, 11)
    with torch.no_grad():
        want, got = ref(ids).logits.float(), fused(ids).logits.float()
    assert got.dtype == want.dtype and (got - want).abs().max() <= 0.05 * want.abs().max()
    a, b = greedy(ref, ids).sequences, greedy(fused, ids).sequences
    assert (a == b).float().mean() >= 0.75


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_overflow_past_max_out_tokens_is_refused_naming_the_key(kind: str) -> None:
    ref, fused, _ = pair(kind, max_out_tokens=20)
    ids = prompts(1, 10)
    # 10 prompt + 11 new tokens: the last generated token is never fed back, so 20 positions suffice
    assert torch.equal(greedy(fused, ids, new=11).sequences, greedy(ref, ids, new=11).sequences)
    with pytest.raises(CacheOverflowError, match=r"max_out_tokens=20 is too small: this step needs 21 cached "
                                                 r"positions \(20 already held \+ 1 new\).*raise it"):
        greedy(fused, ids, new=12)
    with pytest.raises(CacheOverflowError, match=r"max_out_tokens=20 .* needs 25"):
        fused(prompts(1, 25))


def test_cache_resets_between_generate_calls_with_new_prompts_and_batch_sizes() -> None:
    ref, fused, _ = pair("llama")
    cases: list[tuple[torch.Tensor, torch.Tensor | None]] = [
        (prompts(1, 14, seed=5), None), (prompts(1, 6, seed=6), None), left_padded([10, 4, 7], seed=7),
        (prompts(1, 14, seed=5), None)]
    keys = fused.model.cache.fused_layers[0].keys
    for ids, mask in cases:
        want, got = greedy(ref, ids, mask), greedy(fused, ids, mask)
        assert torch.equal(got.sequences, want.sequences)
    assert fused.model.cache.fused_layers[0].keys is not keys  # batch 3 came between: reallocated once...
    keys = fused.model.cache.fused_layers[0].keys
    greedy(fused, prompts(1, 9, seed=8))
    assert fused.model.cache.fused_layers[0].keys is keys  # ...same batch: the buffers are reused


def test_filled_foreign_cache_and_unsupported_outputs_are_refused() -> None:
    from transformers import DynamicCache

    ref, fused, _ = pair("llama")
    ids = prompts(1, 6)
    with torch.no_grad():
        filled = ref(ids, use_cache=True).past_key_values
        assert isinstance(filled, DynamicCache)
        with pytest.raises(ValueError, match="past_key_values is a filled DynamicCache"):
            fused(ids[:, -1:], past_key_values=filled)
        with pytest.raises(ValueError, match="output_attentions=True is not supported"):
            fused(ids, output_attentions=True)
        with pytest.raises(ValueError, match="attention_mask has 4 dims"):
            fused(ids, attention_mask=torch.ones(1, 1, 6, 6))


def test_report_structure_and_linear_projections_for_later_transforms() -> None:
    _, fused, report = pair("llama")
    assert report == FusedReport(family="llama", layers=2, fused_qkv=True, tensor_parallel=False, heads_per_rank=4,
                                 kv_heads_per_rank=2, max_out_tokens=80, dtype=torch.float32)
    attn = fused.model.layers[0].self_attn
    assert type(attn.qkv) is torch.nn.Linear and attn.qkv.weight.shape == (4 * 8 + 2 * 2 * 8, 32)
    assert type(attn.out_proj) is torch.nn.Linear
    _, gpt2, report = pair("gpt2")
    assert report.family == "gpt2" and report.fused_qkv and report.kv_heads_per_rank == 4
    assert type(gpt2.transformer.h[0].attn.qkv) is torch.nn.Linear
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight  # still tied


def test_refusals_name_the_family_argument_and_fix() -> None:
    from transformers import AutoModelForCausalLM, OPTConfig

    opt = AutoModelForCausalLM.from_config(OPTConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                                                     ffn_dim=32, num_attention_heads=2, word_embed_proj_dim=16))
    with pytest.raises(UnsupportedModelError, match=r"does not support OPTForCausalLM \(model_type='opt'\); "
                                                    r"supported: \['gpt2', 'llama', 'mistral', 'mixtral'\]"):
        inject_fused(opt, max_out_tokens=16)
    with pytest.raises(ValueError, match=r"max_out_tokens=0 must be an integer >= 1"):
        inject_fused(tiny("llama"), max_out_tokens=0)
    with pytest.raises(UnsupportedModelError, match="max_out_tokens=200 exceeds the model's max_position_embeddings=96"):
        inject_fused(tiny("llama"), max_out_tokens=200)
    with pytest.raises(UnsupportedModelError, match="max_out_tokens=200 exceeds the model's n_positions=96"):
        inject_fused(tiny("gpt2"), max_out_tokens=200)
    with pytest.raises(ValueError, match="dtype=torch.int8 must be a floating-point"):
        inject_fused(tiny("llama"), max_out_tokens=16, dtype=torch.int8)
    model = tiny("gpt2")
    inject_fused(model, max_out_tokens=16)
    with pytest.raises(ValueError, match="already kernel-injected"):
        inject_fused(model, max_out_tokens=16)


# -- two ranks: AutoTP split first, then injection with per-rank heads ---------------------------------------------
def _tp_generation(kind: str) -> tuple[list[list[int]], float]:
    from zerospeed.distributed.mesh import ParallelDims
    from zerospeed.tensor_parallel.autotp import apply_autotp

    ref = tiny(kind)
    model = copy.deepcopy(ref)
    apply_autotp(model, ParallelDims(world_size=2, tp=2).build().comm("tp"))
    report = inject_fused(model, max_out_tokens=80)
    assert report.tensor_parallel and not report.fused_qkv
    assert report.heads_per_rank == 2 and report.kv_heads_per_rank == (2 if kind == "gpt2" else 1)
    ids, mask = left_padded([12, 5])
    want, got = greedy(ref, ids, mask), greedy(model, ids, mask)
    assert torch.equal(got.sequences, want.sequences)
    diff = max((g - w).abs().max().item() for g, w in zip(got.logits, want.logits, strict=True))
    assert diff <= TOL, diff
    return got.sequences.tolist(), diff


@pytest.mark.spawns
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_tensor_parallel_split_then_injected_equals_single_process_hf(kind: str) -> None:
    ranks = run_distributed(_tp_generation, 2, kind, timeout=240)
    assert ranks[0][0] == ranks[1][0]
