"""``init_inference`` / ``InferenceEngine``: call, ``generate``, dtype, eval mode, DeepSpeed's attributes, the
``deepspeed.*`` paths, and ``checkpoint=`` loading (a zerospeed checkpoint saved by ``initialize`` +
``save_checkpoint`` at 2 ranks, loaded at tp=2 and tp=1, and plain state-dict files)."""

from __future__ import annotations

import copy
import importlib
from pathlib import Path
from typing import Any

import pytest
import torch

import zerospeed
from zerospeed.checkpoint.layout import CheckpointError
from zerospeed.deepspeed_alias import install_as_deepspeed, is_installed, uninstall_as_deepspeed
from zerospeed.inference import InferenceEngine, init_inference
from zerospeed.testing import run_distributed
from zerospeed.testing.hf_models import lm_batch, tiny_causal_lm, token_rows

PROMPT = torch.tensor([[5, 17, 42, 8], [60, 3, 3, 71]])


def _model(kind: str = "gpt2", seed: int = 0) -> Any:
    model = tiny_causal_lm(kind, seed=seed)
    model.generation_config.eos_token_id = None  # always max_new_tokens
    return model


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_call_and_generate_equal_the_model(kind: str) -> None:
    model = _model(kind)
    reference = copy.deepcopy(model).eval()
    model.train()
    engine = zerospeed.init_inference(model, dtype=torch.float32)
    assert isinstance(engine, InferenceEngine) and engine.module is model and not model.training
    assert (engine.tp_size, engine.mp_world_size, engine.mp_group, engine.dtype) == (1, 1, None, torch.float32)
    assert engine.config is model.config
    want = reference.generate(PROMPT, max_new_tokens=12, do_sample=False)
    assert torch.equal(engine.generate(PROMPT, max_new_tokens=12, do_sample=False), want)
    assert torch.equal(engine.generate(input_ids=PROMPT, max_new_tokens=12, do_sample=False), want)
    logits = engine(want).logits
    assert torch.equal(logits, reference(want).logits) and not logits.requires_grad  # run under no_grad


def test_dtype_cast_and_default() -> None:
    engine = init_inference(_model(), {"dtype": "bf16"})
    assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16} and engine.dtype is torch.bfloat16
    assert engine(PROMPT).logits.dtype is torch.bfloat16
    kept = init_inference(_model())  # no fp16 kernels on this CPU: DeepSpeed's fp16 default is not applied
    fp16 = torch.float16 in zerospeed.get_accelerator().supported_dtypes()
    assert {p.dtype for p in kept.module.parameters()} == {torch.float16 if fp16 else torch.float32}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_int8_dtype_quantizes_the_linears_through_the_engine(kind: str) -> None:
    """``dtype=torch.int8`` (DeepSpeed's switch) turns every untied linear into group-wise int8 weights with the
    configured group size; the logits stay close to fp32 and generation runs through the module's generate."""
    from zerospeed.inference.quantize import Int8Conv1D, Int8Linear

    reference = _model(kind).eval()
    engine = init_inference(_model(kind), dtype=torch.int8, quant={"weight": {"group_size": 32}})
    quantized = [m for m in engine.module.modules() if isinstance(m, (Int8Linear, Int8Conv1D))]
    assert quantized and {m.group_size for m in quantized} == {32}
    assert not any(type(m) is torch.nn.Linear and m.weight is not engine.module.get_input_embeddings().weight
                   for m in engine.module.modules())
    want, got = reference(PROMPT).logits, engine(PROMPT).logits
    cosine = torch.nn.functional.cosine_similarity(want.flatten(1), got.flatten(1)).min()
    assert cosine > 0.999 and not torch.equal(want, got)
    assert engine.generate(PROMPT, max_new_tokens=6, do_sample=False).shape == (2, 10)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_zero_section_streams_the_weights_and_generates_hf_tokens(device: str, tmp_path: Path) -> None:
    """``init_inference(model, zero={...})``: ZeRO-Inference (stage 3 + offload_param) through the engine gives
    Hugging Face's greedy tokens; the weights live in shards (nothing gathered after generate); destroy()
    removes the swap files."""
    reference = _model("llama").eval()
    offload: dict[str, Any] = {"device": device}
    if device == "nvme":
        offload |= {"nvme_path": str(tmp_path), "max_in_cpu": 0}  # else a model this small stays in memory
    engine = init_inference(_model("llama"), dtype=torch.float32,
                            zero={"stage": 3, "offload_param": offload, "stage3_param_persistence_threshold": 0})
    placed = engine._zero_inference()
    assert placed is not None and engine.module is placed.module
    want = reference.generate(PROMPT, max_new_tokens=8, do_sample=False)
    assert torch.equal(engine.generate(PROMPT, max_new_tokens=8, do_sample=False), want)
    assert all(p.numel() == 0 for p in engine.module.parameters())  # released: only the shards remain
    assert torch.equal(engine(want).logits, reference(want).logits)
    if device == "nvme":
        assert any(tmp_path.rglob("*")) and placed.io_stats()["bytes_read"] > 0
    engine.destroy()
    if device == "nvme":
        assert not [f for f in tmp_path.rglob("*") if f.is_file()]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_kernel_inject_generates_hf_tokens_and_composes_with_int8(kind: str) -> None:
    """``replace_with_kernel_inject=True``: the fused, KV-cached decoder gives HF's greedy tokens in fp32; with
    ``dtype=torch.int8`` as well, the fused qkv projection is quantized too and generation still runs."""
    from zerospeed.inference.fused import FusedKVCache
    from zerospeed.inference.quantize import Int8Linear

    reference = _model(kind).eval()
    engine = init_inference(_model(kind), dtype=torch.float32, replace_with_kernel_inject=True, max_out_tokens=32)
    want = reference.generate(PROMPT, max_new_tokens=16, do_sample=False)
    assert torch.equal(engine.generate(PROMPT, max_new_tokens=16, do_sample=False), want)
    out = engine(PROMPT, use_cache=True)
    assert isinstance(out.past_key_values, FusedKVCache)
    torch.testing.assert_close(out.logits, reference(PROMPT).logits, rtol=0, atol=1e-5)
    quantized = init_inference(_model(kind), dtype=torch.int8, replace_with_kernel_inject=True, max_out_tokens=32)
    names = {name for name, m in quantized.module.named_modules() if isinstance(m, Int8Linear)}
    assert any(name.endswith("qkv") for name in names), sorted(names)
    assert quantized.generate(PROMPT, max_new_tokens=16, do_sample=False).shape == want.shape


def test_kernel_inject_with_zero_inference_gives_hf_tokens() -> None:
    """The fused decoder's weights streamed by ZeRO-Inference (the injection runs first, then the placement)."""
    reference = _model("llama").eval()
    engine = init_inference(_model("llama"), dtype=torch.float32, replace_with_kernel_inject=True, max_out_tokens=32,
                            zero={"stage": 3, "offload_param": {"device": "cpu"},
                                  "stage3_param_persistence_threshold": 0})
    assert [t.name for t in engine.transforms][-2:] == ["kernel_inject", "zero_inference"]
    want = reference.generate(PROMPT, max_new_tokens=8, do_sample=False)
    assert torch.equal(engine.generate(PROMPT, max_new_tokens=8, do_sample=False), want)
    engine.destroy()


def test_max_out_tokens_and_refusals() -> None:
    engine = init_inference(_model(), dtype=torch.float32, max_tokens=3)
    with pytest.raises(RuntimeError) as info:
        engine.generate(PROMPT, max_new_tokens=2)
    assert str(info.value) == ("input of 4 tokens exceeds max_out_tokens=3; raise max_out_tokens (alias max_tokens) "
                               "in the inference config")
    with pytest.raises(NotImplementedError, match="InferenceEngine.compile: zerospeed compiles nothing at run time"):
        engine.compile()
    assert engine.is_compiled is False
    with pytest.raises(ValueError, match="dtype: conflicting values in config"):
        init_inference(_model(), {"dtype": "fp32"}, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="max_out_tokens=1024 exceeds the model's n_positions=32; use max_out_tokens"):
        init_inference(_model(), kernel_inject=True)  # DeepSpeed's default cache is longer than this tiny model
    with pytest.raises(ValueError, match="OPTForCausalLM"):
        from transformers import OPTConfig, OPTForCausalLM
        init_inference(OPTForCausalLM(OPTConfig(hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2,
                                                word_embed_proj_dim=16, vocab_size=50)), kernel_inject=True)
    plain = init_inference(torch.nn.Linear(2, 2), dtype=torch.float32)
    with pytest.raises(AttributeError, match="Linear has no generate"):
        plain.generate(torch.ones(1, 2))


def test_profile_model_time() -> None:
    engine = init_inference(_model(), dtype=torch.float32)
    with pytest.raises(RuntimeError, match="profiling is off; call engine.profile_model_time"):
        engine.model_times()
    engine.profile_model_time()
    engine(PROMPT)
    engine(PROMPT)
    times = engine.model_times()
    assert len(times) == 2 and all(t > 0 for t in times) and engine.model_times() == []


def test_deepspeed_paths_reach_the_engine() -> None:
    installed = is_installed()
    if not installed:
        install_as_deepspeed()
    try:
        deepspeed = importlib.import_module("deepspeed")
        assert deepspeed.init_inference is init_inference and deepspeed.InferenceEngine is InferenceEngine
        assert importlib.import_module("deepspeed.inference.engine").InferenceEngine is InferenceEngine
        config = importlib.import_module("deepspeed.inference.config").DeepSpeedInferenceConfig
        assert config is zerospeed.inference.config.DeepSpeedInferenceConfig
        with pytest.raises(NotImplementedError, match="build_hf_engine: FastGen"):
            importlib.import_module("deepspeed.inference").build_hf_engine
    finally:
        if not installed:
            uninstall_as_deepspeed()


# -- checkpoints -----------------------------------------------------------------------------------------------------
def _config() -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
            "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def _train_save_serve(root: str) -> dict[str, Any]:
    """2 ranks: train 3 steps at ZeRO stage 2, save; rank 0 writes the trained state dict; then a fresh model
    (other values) served at tp=2 from the checkpoint generates what the trained model generates."""
    import torch.distributed as dist

    model = _model(seed=0)
    engine, *_ = zerospeed.initialize(model=model, config=_config(), model_parameters=model.parameters())
    rows = token_rows(12, seed=dist.get_rank())
    for step in range(3):
        engine.backward(engine(**lm_batch(rows[2 * step: 2 * step + 2])).loss)
        engine.step()
    engine.save_checkpoint(f"{root}/ckpt")
    trained = copy.deepcopy(engine.module).eval()
    if dist.get_rank() == 0:
        torch.save(trained.state_dict(), f"{root}/trained.pt")
    want = trained.generate(PROMPT, max_new_tokens=16, do_sample=False)
    served = zerospeed.init_inference(_model(seed=1), checkpoint=f"{root}/ckpt", tensor_parallel={"tp_size": 2},
                                      dtype=torch.float32)
    got = served.generate(PROMPT, max_new_tokens=16, do_sample=False)
    diff = (served(want).logits - trained(want).logits).abs().max().item()
    return {"equal": torch.equal(got, want), "diff": diff, "tokens": got.tolist()}


@pytest.mark.spawns
def test_checkpoint_round_trip(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    ranks = run_distributed(_train_save_serve, 2, str(tmp_path), timeout=300)
    for rank in ranks:
        assert rank["equal"] and rank["diff"] <= 1e-5, rank
    trained = _model(seed=1)
    state = torch.load(tmp_path / "trained.pt", weights_only=True)
    trained.load_state_dict(state)
    want = trained.eval()(torch.tensor(ranks[0]["tokens"])).logits
    save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}, str(tmp_path / "w.safetensors"))
    torch.save({"module": state}, tmp_path / "wrapped.pt")
    for source in ("ckpt", "ckpt/global_step3", "trained.pt", "w.safetensors", "wrapped.pt"):
        engine = init_inference(_model(seed=2), checkpoint=str(tmp_path / source), dtype=torch.float32)
        assert torch.equal(engine(torch.tensor(ranks[0]["tokens"])).logits, want), source
    engine = init_inference(_model(seed=2), checkpoint="trained.pt", base_dir=str(tmp_path), dtype=torch.float32)
    assert torch.equal(engine(PROMPT).logits, trained(PROMPT).logits)
    llama_state = tmp_path / "llama.pt"
    torch.save(_model("llama").state_dict(), llama_state)
    mismatch = r"llama.pt does not match the model: missing \['transformer.wpe.weight'"
    with pytest.raises(CheckpointError, match=mismatch):
        init_inference(_model(), checkpoint=str(llama_state))
    with pytest.raises(CheckpointError, match="missing.pt does not exist; pass a zerospeed checkpoint directory"):
        init_inference(_model(), checkpoint=str(tmp_path / "missing.pt"))
