"""AutoTP: the pure plan (exact assignments, refusals) without processes, and 2-rank runs where a split
Hugging Face Llama / GPT-2 matches the unsharded model in loss, gradients (slice-wise) and AdamW steps."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerospeed.tensor_parallel import AutoTPError, apply_autotp, describe_model, plan_autotp, tp_layout
from zerospeed.tensor_parallel.autotp import autotp_size_of, tp_model_init
from zerospeed.testing import run_distributed
from zerospeed.testing.hf_models import lm_batch, tiny_causal_lm, token_rows

pytest.importorskip("transformers")

TOL = 1e-5


def assignments(kind: str, tp: int = 2, overrides: dict | None = None, **plan_kwargs: Any) -> dict[str, tuple[str, int]]:
    plan = plan_autotp(describe_model(tiny_causal_lm(kind, **(overrides or {}))), tp, **plan_kwargs)
    return {name: (p.split.value, p.parts) for name, p in plan.layers.items()}



LLAMA_EXPECTED = {f"model.layers.{i}.{name}": v for i in range(2) for name, v in (
    ("self_attn.q_proj", ("column", 1)), ("self_attn.k_proj", ("column", 1)), ("self_attn.v_proj", ("column", 1)),
    ("self_attn.o_proj", ("row", 1)), ("mlp.gate_proj", ("column", 1)), ("mlp.up_proj", ("column", 1)),
    ("mlp.down_proj", ("row", 1)))} | {"lm_head": ("skip", 1)}
GPT2_EXPECTED = {f"transformer.h.{i}.{name}": v for i in range(2) for name, v in (
    ("attn.c_attn", ("column", 3)), ("attn.c_proj", ("row", 1)), ("mlp.c_fc", ("column", 1)),
    ("mlp.c_proj", ("row", 1)))} | {"lm_head": ("skip", 1)}


# -- the plan: exact assignments ---------------------------------------------------------------------------------
def test_llama_default_plan() -> None:
    assert assignments("llama") == LLAMA_EXPECTED
    plan = plan_autotp(describe_model(tiny_causal_lm("llama")), 2)
    assert {n: (h.num_heads, h.num_kv_heads, h.split_size) for n, h in plan.heads.items()} == {
        "model.layers.0.self_attn": (2, 1, None), "model.layers.1.self_attn": (2, 1, None)}


def test_gpt2_default_plan_splits_q_k_v_of_the_fused_c_attn_each() -> None:
    assert assignments("gpt2") == GPT2_EXPECTED
    plan = plan_autotp(describe_model(tiny_causal_lm("gpt2")), 2)
    assert {n: (h.num_heads, h.split_size) for n, h in plan.heads.items()} == {
        "transformer.h.0.attn": (2, 16), "transformer.h.1.attn": (2, 16)}


def test_llama_preset_equals_the_default_and_tp1_plans_the_same_splits() -> None:
    assert assignments("llama", preset_model="LLaMA") == LLAMA_EXPECTED
    assert assignments("llama", tp=1) == LLAMA_EXPECTED


def test_user_specs_come_first_and_defaults_follow() -> None:
    found = assignments("llama", overrides=dict(vocab_size=96), partition_config={"layer_specs": [
        {"patterns": [r".*\.mlp\..*"], "partition_type": "skip"},
        {"patterns": [r"lm_head\.weight$"], "partition_type": "column", "gather_output": True}]})
    expected = {n: (("skip", 1) if ".mlp." in n else v) for n, v in LLAMA_EXPECTED.items()}
    assert found == expected | {"lm_head": ("column", 1)}


def test_without_default_specs_only_the_users_rules_apply() -> None:
    found = assignments("llama", partition_config={"use_default_specs": False, "layer_specs": [
        {"patterns": [r".*\.mlp\.(gate|up)_proj\.weight$"], "partition_type": "column"},
        {"patterns": [r".*\.mlp\.down_proj\.weight$"], "partition_type": "row"}]})
    assert found == {n: (v if ".mlp." in n else ("skip", 1)) for n, v in LLAMA_EXPECTED.items()}


def test_model_types_restrict_a_spec() -> None:
    found = assignments("llama", partition_config={"use_default_specs": False, "layer_specs": [
        {"patterns": [r".*down_proj\.weight$"], "partition_type": "row", "model_types": ["gpt2"]}]})
    assert set(found.values()) == {("skip", 1)}


# -- the plan: refusals naming the layer and the fix ---------------------------------------------------------------
def refusal(kind: str, tp: int = 2, overrides: dict | None = None, **plan_kwargs: Any) -> str:
    model = tiny_causal_lm(kind, **(overrides or {}))
    with pytest.raises(AutoTPError) as info:
        plan_autotp(describe_model(model), tp, **plan_kwargs)
    return str(info.value)


def test_heads_not_divisible() -> None:
    msg = refusal("llama", overrides=dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=3))
    assert "'model.layers.0.self_attn' has 3 attention heads" in msg and "divides 3" in msg
    msg = refusal("gpt2", overrides=dict(n_embd=48, n_head=3))
    assert "'transformer.h.0.attn' has 3 attention heads" in msg


def test_kv_heads_not_divisible() -> None:
    msg = refusal("llama", overrides=dict(num_key_value_heads=1))
    assert "has 1 key/value heads, not divisible by the tensor-parallel size 2" in msg


def test_dimension_not_divisible() -> None:
    msg = refusal("llama", overrides=dict(intermediate_size=63))
    assert "layer 'model.layers.0.mlp.gate_proj' (Linear, in=32, out=63)" in msg
    assert "output size 63 is not divisible by the tensor-parallel size 2" in msg and "skip" in msg


def test_pattern_demanding_a_layer_with_no_rule() -> None:
    msg = refusal("llama", partition_config={"layer_specs": [
        {"patterns": [r".*embed_tokens\.weight$"], "partition_type": "column"}]})
    assert "model.embed_tokens.weight of a Embedding, which AutoTP cannot split" in msg
    assert 'partition_type "skip"' in msg


def test_unknown_partition_type_and_typo_in_a_layer_spec() -> None:
    msg = refusal("llama", partition_config={"layer_specs": [{"patterns": ["x"], "partition_type": "diagonal"}]})
    assert msg == ('partition_config.layer_specs[0].partition_type: "diagonal" is not allowed; expected one of '
                   '"column", "row", "skip"')
    msg = refusal("llama", partition_config={"layer_specs": [{"pattern": ["x"]}]})
    assert "partition_config.layer_specs[0].pattern: unknown key; did you mean patterns?" in msg


def test_unknown_preset_and_unknown_model_type() -> None:
    msg = refusal("llama", preset_model="gpt9")
    assert "preset_model='gpt9' is not a preset; choose one of" in msg and "'llama'" in msg
    with pytest.raises(AutoTPError, match="no built-in rules for model_type=None"):
        plan_autotp(describe_model(torch.nn.Sequential(torch.nn.Linear(4, 4))), 2)


def test_tied_lm_head_and_lm_head_without_gather_and_strict_mode() -> None:
    msg = refusal("gpt2", partition_config={"layer_specs": [
        {"patterns": [r"lm_head\.weight$"], "partition_type": "column", "gather_output": True}]})
    assert "layer 'lm_head'" in msg and "tied embeddings" in msg
    msg = refusal("llama", partition_config={"layer_specs": [{"patterns": [r"lm_head\.weight$"]}]})
    assert "is the LM head" in msg and "gather_output: true" in msg
    msg = refusal("llama", partition_config={"strict_mode": True})
    assert "strict_mode: no layer spec matches lm_head.weight" in msg


def test_tp_model_init_refuses_mismatched_config_before_starting_anything() -> None:
    model = tiny_causal_lm("llama")
    with pytest.raises(ValueError, match="autotp_size is 4"):
        tp_model_init(model, 2, torch.float32, config={"tensor_parallel": {"autotp_size": 4}})
    with pytest.raises(ValueError, match="tensor_parallel.dtype is bf16"):
        tp_model_init(model, 2, torch.float32, config={"tensor_parallel": {"dtype": "bf16"}})
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['mpu'\\]"):
        tp_model_init(model, 2, torch.float32, mpu=object())


def test_one_rank_apply_marks_the_model_and_changes_nothing() -> None:
    model = tiny_causal_lm("llama")
    before = {n: p.clone() for n, p in model.state_dict().items()}
    assert apply_autotp(model, None) is model and autotp_size_of(model) == 1
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())
    assert isinstance(model.model.layers[0].self_attn.q_proj, torch.nn.Linear)


# -- two ranks: the split model equals the unsharded one -----------------------------------------------------------
def _parity(kind: str, via_tp_model_init: bool) -> list[float]:
    from zerospeed.distributed.mesh import ParallelDims

    ref, model = tiny_causal_lm(kind, seed=0), tiny_causal_lm(kind, seed=0)
    names = sorted(n for n, _ in model.named_parameters())
    if via_tp_model_init:
        model = tp_model_init(model, tp_size=2, dtype=torch.float32)
    else:
        comm = ParallelDims(world_size=2, tp=2).build().comm("tp")
        assert apply_autotp(model, comm) is model
        assert apply_autotp(model, comm) is model  # already parsed at this size: a no-op
        with pytest.raises(AutoTPError, match="already split by AutoTP at tensor-parallel size 2, not 1"):
            apply_autotp(model, None)
    assert getattr(model, "ds_autotp_parsed") and sorted(n for n, _ in model.named_parameters()) == names
    layout = tp_layout(model)
    assert layout.degree == 2 and len(layout.splits) > 0
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():  # the split weights are the right slices
        split = layout.splits.get(name)
        expect = split.local_slice(ref_params[name].detach()) if split else ref_params[name].detach()
        assert param.shape == expect.shape and torch.equal(param.detach(), expect), name

    ids = token_rows(4, seed=1)
    ref_loss, loss = ref(**lm_batch(ids)).loss, model(**lm_batch(ids)).loss
    ref_loss.backward()
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) < TOL, (loss.item(), ref_loss.item())
    for name, param in model.named_parameters():
        full = ref_params[name].grad
        split = layout.splits.get(name)
        expect = split.local_slice(full) if split else full
        torch.testing.assert_close(param.grad, expect, atol=TOL, rtol=0, msg=name)

    losses = []
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    for step in range(3):
        batch = lm_batch(token_rows(4, seed=10 + step))
        pair = []
        for m, opt in zip((ref, model), opts):
            opt.zero_grad()
            out = m(**batch).loss
            out.backward()
            opt.step()
            pair.append(out.item())
        assert abs(pair[0] - pair[1]) < TOL, (step, pair)
        losses.append(pair[1])
    return losses


@pytest.mark.spawns
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_split_model_matches_the_unsharded_one_on_two_ranks(kind: str) -> None:
    losses = run_distributed(_parity, 2, kind, False, timeout=240)
    assert losses[0] == losses[1]


def _tp_model_init_bf16() -> str:
    model = tp_model_init(tiny_causal_lm("gpt2"), 2, torch.bfloat16)
    attn = model.transformer.h[0].attn
    return f"{attn.c_attn.weight.dtype} {tuple(attn.c_attn.weight.shape)} {attn.num_heads} {attn.split_size}"


@pytest.mark.spawns
def test_tp_model_init_shards_at_once_on_two_ranks() -> None:
    run_distributed(_parity, 2, "llama", True, timeout=240)
    assert run_distributed(_tp_model_init_bf16, 2, timeout=120) == ["torch.bfloat16 (32, 48) 2 16"] * 2


# -- through the engine: tensor_parallel.autotp_size ---------------------------------------------------------------
ENGINE_STEPS, ENGINE_LR, ENGINE_EPS, ENGINE_CLIP, ENGINE_MICRO = 5, 1e-2, 1e-6, 1.0, 2


def _engine_config(stage: int) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": ENGINE_MICRO, "gradient_accumulation_steps": 1,
            "gradient_clipping": ENGINE_CLIP, "steps_per_print": 10**6, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": ENGINE_LR, "eps": ENGINE_EPS, "weight_decay": 0.01}},
            "tensor_parallel": {"autotp_size": 2}}


def _engine_rows() -> torch.Tensor:
    return token_rows(ENGINE_STEPS * ENGINE_MICRO, seed=3)


def _engine_runs(cases: list[tuple[str, int]]) -> list[list[float]]:
    """Each (kind, stage): a fresh unsharded model through ``zerospeed.initialize`` at autotp_size 2 (both
    ranks are one tensor-parallel group, so they see the same rows), 5 steps, the losses."""
    import zerospeed

    out = []
    for kind, stage in cases:
        model = tiny_causal_lm(kind, seed=0)
        engine, *_ = zerospeed.initialize(model=model, config=_engine_config(stage),
                                          model_parameters=model.parameters())
        assert getattr(engine.module, "ds_autotp_parsed") and tp_layout(engine.module).degree == 2
        rows, losses = _engine_rows(), []
        for step in range(ENGINE_STEPS):
            loss = engine(**lm_batch(rows[step * ENGINE_MICRO:(step + 1) * ENGINE_MICRO])).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out.append(losses)
    return out


def _unsharded_losses(kind: str) -> list[float]:
    """The same model, rows, AdamW and clipping in one plain process."""
    model = tiny_causal_lm(kind, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=ENGINE_LR, eps=ENGINE_EPS, weight_decay=0.01)
    rows, losses = _engine_rows(), []
    for step in range(ENGINE_STEPS):
        loss = model(**lm_batch(rows[step * ENGINE_MICRO:(step + 1) * ENGINE_MICRO])).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), ENGINE_CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.spawns
def test_initialize_with_autotp_size_trains_like_the_unsharded_model() -> None:
    cases = [("llama", 0), ("llama", 1), ("gpt2", 0)]
    ranks = run_distributed(_engine_runs, 2, cases, timeout=300)
    for i, (kind, _) in enumerate(cases):
        ref = _unsharded_losses(kind)
        for rank_losses in ranks:
            assert max(abs(a - b) for a, b in zip(rank_losses[i], ref)) < TOL, (cases[i], rank_losses[i], ref)
        assert ref[-1] < ref[0]


def _autotp_checkpoint(save_dir: str) -> dict[str, Any]:
    """GPT-2 split by AutoTP (fused c_attn: q, k, v each split) at stage 1, two steps, saved; then a
    fresh split model loads it back. Returns this rank's slices (trained and reloaded) and their splits."""
    import zerospeed

    model = tiny_causal_lm("gpt2", seed=0)
    engine, *_ = zerospeed.initialize(model=model, config=_engine_config(1), model_parameters=model.parameters())
    rows = _engine_rows()
    for step in range(2):
        engine.backward(engine(**lm_batch(rows[step * ENGINE_MICRO:(step + 1) * ENGINE_MICRO])).loss)
        engine.step()
    engine.save_checkpoint(save_dir, tag="t")
    layout = tp_layout(engine.module)
    # (plain lists: tensors sent over the result pipe would be shared through file descriptors)
    mine = {n: p.detach().float().tolist() for n, p in engine.module.named_parameters()}
    fresh = tiny_causal_lm("gpt2", seed=1)  # other values: all of them must come from the checkpoint
    again, *_ = zerospeed.initialize(model=fresh, config=_engine_config(1), model_parameters=fresh.parameters())
    again.load_checkpoint(save_dir, tag="t")
    reloaded = {n: p.detach().float().tolist() for n, p in again.module.named_parameters()}
    splits = {n: (s.dim, s.rank, s.degree, s.parts) for n, s in layout.splits.items()}
    return {"mine": mine, "reloaded": reloaded, "splits": splits}


@pytest.mark.spawns
def test_autotp_checkpoint_with_fused_parts_converts_and_reloads(tmp_path: Any) -> None:
    """The checkpoint of a fused split joins into the unsplit tensors: each rank's slice is exactly
    ``ParamSplit.local_slice`` of the converted full tensor, and a fresh split model reloads it."""
    from zerospeed.checkpoint import get_fp32_state_dict
    from zerospeed.tensor_parallel import ParamSplit

    ranks = run_distributed(_autotp_checkpoint, 2, str(tmp_path), timeout=300)
    full = get_fp32_state_dict(str(tmp_path / "t"))
    assert any(parts == 3 for *_, parts in ranks[0]["splits"].values())  # c_attn is fused
    for result in ranks:
        for name, values in result["mine"].items():
            split = result["splits"].get(name)
            expected = full[name] if split is None else ParamSplit(*split).local_slice(full[name])
            assert torch.equal(torch.tensor(values), expected.float()), name
            assert result["reloaded"][name] == values, name
