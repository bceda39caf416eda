"""The flops profiler (issue 22): forward and measured backward FLOPs/MACs against hand counts written as
formulas (MLP, conv net, the example GPT with tied embeddings, an attention block), torch's
``FlopCounterMode`` on linear and conv layers, repeated profiles, tied weights, the DeepSpeed names, and the
``flops_profiler`` config section in 2-rank training runs (data parallel, and tensor parallel at tp=2,
whose summary sums the model-parallel ranks).

Conventions (``zerospeed/profiling/flops_profiler/rules.py``): a multiply-accumulate is 2 FLOPs; a bias,
an activation, a residual add, a pooled input element: 1 FLOP per element; layer norm 5 per element.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from zerospeed.profiling.flops_profiler import FlopsProfiler, get_model_profile
from zerospeed.profiling.flops_profiler.units import macs_to_string, number_to_string, params_to_string
from zerospeed.testing import run_distributed

pytestmark = pytest.mark.spawns

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

from gpt import GPT, GPTConfig  # noqa: E402


def _profile(model: nn.Module, *inputs: torch.Tensor) -> dict[str, int]:
    """Forward and backward of ``model(*inputs).sum()`` under one profile."""
    prof = FlopsProfiler(model)
    prof.start_profile()
    out = model(*inputs)
    out.sum().backward()
    prof.stop_profile()
    t = prof.totals()
    prof.end_profile()
    return {"fwd_flops": t.fwd_flops, "fwd_macs": t.fwd_macs, "bwd_flops": t.bwd_flops, "bwd_macs": t.bwd_macs,
            "params": t.params}


def _torch_counts(model: nn.Module, *inputs: torch.Tensor) -> tuple[int, int]:
    """torch's FlopCounterMode over the forward, then over the backward."""
    with FlopCounterMode(display=False) as fwd:
        out = model(*inputs)
    with FlopCounterMode(display=False) as bwd:
        out.sum().backward()
    return fwd.get_total_flops(), bwd.get_total_flops()


def _within(value: int, expected: int, rel: float = 0.01) -> bool:
    return abs(value - expected) <= rel * expected


# -- MLP ----------------------------------------------------------------------------------------------
B, D0, D1, D2, D3 = 8, 256, 512, 256, 16


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D0, D1), nn.ReLU(), nn.Linear(D1, D2), nn.ReLU(), nn.Linear(D2, D3))


def test_mlp_forward_and_backward_match_the_hand_count() -> None:
    counts = _profile(_mlp(), torch.randn(B, D0))
    fwd_macs = B * (D0 * D1 + D1 * D2 + D2 * D3)
    # the input needs no gradient, so backward skips the first layer's input gradient: not 2x forward
    bwd_macs = fwd_macs + B * (D1 * D2 + D2 * D3)  # every weight gradient + the input gradients of layers 2, 3
    assert counts["fwd_macs"] == fwd_macs
    assert counts["bwd_macs"] == bwd_macs
    # biases (1 per output element) and ReLUs (1 per element) on top of 2 FLOPs per MAC
    assert counts["fwd_flops"] == 2 * fwd_macs + B * (D1 + D2 + D3) + B * (D1 + D2)
    # bias gradients (a sum over the batch) and ReLU gradients
    assert counts["bwd_flops"] == 2 * bwd_macs + B * (D1 + D2 + D3) + B * (D1 + D2)
    assert _within(counts["fwd_flops"], 2 * fwd_macs) and _within(counts["bwd_flops"], 2 * bwd_macs)
    assert counts["params"] == D0 * D1 + D1 + D1 * D2 + D2 + D2 * D3 + D3


def test_mlp_agrees_with_torch_flop_counter() -> None:
    counts = _profile(_mlp(), torch.randn(B, D0))
    fwd, bwd = _torch_counts(_mlp(), torch.randn(B, D0))
    assert _within(counts["fwd_flops"], fwd) and _within(counts["bwd_flops"], bwd)


# -- conv net -----------------------------------------------------------------------------------------
N, C0, HW, C1, C2, CLASSES = 4, 16, 16, 32, 32, 10


def _convnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(C0, C1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(C1, C2, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(C2, CLASSES))


def test_conv_net_forward_and_backward_match_the_hand_count() -> None:
    counts = _profile(_convnet(), torch.randn(N, C0, HW, HW))
    out1 = N * C1 * HW * HW                 # conv 1's output elements (padding 1 keeps 16x16)
    out2 = N * C2 * (HW // 2) ** 2          # conv 2's, after the 2x2 max pool
    conv1 = out1 * C0 * 3 * 3               # MACs: each output element sums C_in * k * k products
    conv2 = out2 * C1 * 3 * 3
    fc = N * C2 * CLASSES
    assert counts["fwd_macs"] == conv1 + conv2 + fc
    # conv 1's input needs no gradient: only its weight gradient; conv 2 and the head: both gradients
    assert counts["bwd_macs"] == conv1 + 2 * conv2 + 2 * fc
    extra_fwd = (out1 + out1 + out1        # conv 1 bias, ReLU, max pool (per input element)
                 + out2 + out2 + out2      # conv 2 bias, ReLU, average pool (per input element)
                 + N * CLASSES)            # head bias
    assert counts["fwd_flops"] == 2 * (conv1 + conv2 + fc) + extra_fwd
    extra_bwd = (out1 + out1 + out1        # conv 1 bias gradient, ReLU and max-pool gradients
                 + out2 + out2 + out2      # the same for conv 2 and the average pool
                 + N * CLASSES)            # head bias gradient
    assert counts["bwd_flops"] == 2 * (conv1 + 2 * conv2 + 2 * fc) + extra_bwd
    assert _within(counts["fwd_flops"], 2 * counts["fwd_macs"])
    assert _within(counts["bwd_flops"], 2 * counts["bwd_macs"])
    fwd, bwd = _torch_counts(_convnet(), torch.randn(N, C0, HW, HW))
    assert fwd == 2 * counts["fwd_macs"] and bwd == 2 * counts["bwd_macs"]


# -- GPT with tied embeddings -------------------------------------------------------------------------
GB, GT, GC, GL, GH, GV = 2, 16, 128, 2, 4, 512


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=GV, seq_len=GT, d_model=GC, n_layers=GL, n_heads=GH))


def _gpt_counts() -> dict[str, int]:
    model = _gpt()
    idx = torch.randint(0, GV, (GB, GT), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, GV, (GB, GT), generator=torch.Generator().manual_seed(2))
    return _profile(model, idx, targets)


def test_gpt_with_tied_embeddings_matches_the_hand_count() -> None:
    counts = _gpt_counts()
    bt = GB * GT
    per_block = (bt * GC * 3 * GC          # qkv projection
                 + 2 * GB * GT * GT * GC   # attention: Q K^T and A V over all heads, every query/key pair
                 + bt * GC * GC            # output projection
                 + 2 * bt * GC * 4 * GC)   # MLP
    fwd_macs = GL * per_block + bt * GC * GV  # + the (tied) LM head
    assert counts["fwd_macs"] == fwd_macs
    assert counts["bwd_macs"] == 2 * fwd_macs  # every input needs a gradient here: exactly twice
    # elementwise work: embeddings' sum, per block 2 layer norms (5/elem), biases 3C+C+4C+C, GELU 4C, 2
    # residuals; final layer norm; log-softmax of the loss over the vocabulary
    extra = bt * GC * (1 + GL * (10 + 9 + 4 + 2) + 5) + bt * GV
    assert counts["fwd_flops"] == 2 * fwd_macs + extra
    assert _within(counts["fwd_flops"], 2 * fwd_macs)
    assert _within(counts["bwd_flops"], 2 * counts["bwd_macs"])
    # the head's weight is the embedding's: counted once
    params = GV * GC + GT * GC + GL * (12 * GC * GC + 13 * GC) + 2 * GC
    assert counts["params"] == params == _gpt().num_params()


# -- attention block ----------------------------------------------------------------------------------
AB, TQ, TK, AC, AH = 2, 12, 20, 64, 4


class CrossAttention(nn.Module):
    """Queries from ``x``, keys and values from ``memory``, through fused SDPA."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(AC, AC, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(t.shape[0], t.shape[1], AH, AC // AH).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(memory)), heads(self.v(memory)))
        return self.out(y.transpose(1, 2).reshape(x.shape))


def test_attention_block_counts_sdpa_by_its_shapes() -> None:
    torch.manual_seed(0)
    x = torch.randn(AB, TQ, AC, requires_grad=True)
    memory = torch.randn(AB, TK, AC, requires_grad=True)
    counts = _profile(CrossAttention(), x, memory)
    d = AC // AH
    sdpa = AB * AH * TQ * TK * d + AB * AH * TQ * TK * d  # Q K^T and A V
    linears = AB * TQ * AC * AC * 2 + AB * TK * AC * AC * 2  # q and out over the queries, k and v over memory
    assert counts["fwd_macs"] == sdpa + linears
    assert counts["fwd_flops"] == 2 * (sdpa + linears)
    assert counts["bwd_macs"] == 2 * (sdpa + linears)  # SDPA's backward: four products of the forward's size
    assert counts["bwd_flops"] == 2 * counts["bwd_macs"] + AB * TK * AC  # + memory's two gradients added
    # torch's counter agrees on the linear layers (its own count of SDPA, where it has one, aside)
    with FlopCounterMode(display=False) as torch_fwd:
        CrossAttention()(x, memory)
    sdpa_seen = sum(n for op, n in torch_fwd.get_flop_counts()["Global"].items() if "attention" in str(op))
    assert torch_fwd.get_total_flops() - sdpa_seen == 2 * linears


# -- repeated profiles, names, printing ---------------------------------------------------------------
def test_repeated_profiles_give_the_same_numbers() -> None:
    model = _mlp()
    first = get_model_profile(model, input_shape=(B, D0), print_profile=False, as_string=False)
    second = get_model_profile(model, input_shape=(B, D0), print_profile=False, as_string=False)
    assert first == second == (2 * B * (D0 * D1 + D1 * D2 + D2 * D3) + B * (2 * D1 + 2 * D2 + D3),
                               B * (D0 * D1 + D1 * D2 + D2 * D3), sum(p.numel() for p in model.parameters()))
    assert get_model_profile(model, input_shape=(B, D0), print_profile=False) == (
        number_to_string(first[0]), macs_to_string(first[1]), params_to_string(first[2]))
    prof = FlopsProfiler(model)
    totals = []
    for _ in range(2):  # start_profile starts from zero; the model's forward hooks are removed at stop
        # the second backward adds into .grad: storing gradients is not counted
        prof.start_profile()
        model(torch.randn(B, D0)).sum().backward()
        prof.stop_profile()
        totals.append(prof.totals())
    assert totals[0] == totals[1]
    prof.reset_profile()
    assert prof.get_total_flops() == 0 and prof.get_backward_flops() == 0
    prof.end_profile()
    assert not model._forward_hooks and not model[0]._forward_pre_hooks
    with pytest.raises(RuntimeError, match="start_profile"):
        prof.get_total_flops()


def test_ignored_modules_and_operations_outside_the_model() -> None:
    model = _mlp()
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=[nn.ReLU])
    out = model(torch.randn(B, D0))
    (out * 2).sum()  # the caller's arithmetic is not the model's forward
    prof.stop_profile()
    assert prof.get_total_macs() == B * (D0 * D1 + D1 * D2 + D2 * D3)
    assert prof.module_flops(model[1]) == 0  # an ignored module's work goes to its parent
    assert prof.get_total_flops() == 2 * prof.get_total_macs() + B * (2 * D1 + 2 * D2 + D3)
    prof.end_profile()


def test_printed_profile_layout(tmp_path: Path) -> None:
    model = _gpt()
    idx = torch.randint(0, GV, (GB, GT))
    path = tmp_path / "sub" / "profile.txt"
    flops, macs, params = get_model_profile(model, args=[idx], print_profile=True, detailed=True,
                                            module_depth=2, top_modules=2, output_file=str(path), as_string=False)
    text = path.read_text()
    assert "Profile Summary at step 1:" in text
    assert f"fwd flops per GPU: {' ' * 10}".rstrip() in text
    assert number_to_string(flops) in text and macs_to_string(macs) in text and params_to_string(params) in text
    assert "depth 0:" in text and "depth 1:" in text and "depth 2:" not in text
    assert "(blocks): ModuleList(" in text and "(qkv): Linear(" in text and "in_features=128" in text
    assert model.extra_repr() == "" and "Params" not in repr(model)  # the model's repr is untouched


def test_deepspeed_module_paths() -> None:
    import importlib

    import zerospeed

    profiler = importlib.import_module("zerospeed.profiling.flops_profiler.profiler")
    assert profiler.FlopsProfiler is FlopsProfiler and profiler.get_model_profile is get_model_profile
    assert zerospeed.profiling.flops_profiler.FlopsProfiler is FlopsProfiler


def test_bad_arguments_are_named() -> None:
    with pytest.raises(TypeError, match="torch.nn.Module"):
        FlopsProfiler("model")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="input_shape"):
        get_model_profile(_mlp(), input_shape=[B, D0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode"):
        get_model_profile(_mlp(), input_shape=(B, D0), mode="backward")
    with pytest.raises(ValueError, match="input_shape=, or args="):
        get_model_profile(_mlp())


# -- the config section in training -------------------------------------------------------------------
def _train_with_profiler(out_dir: str) -> dict[str, Any]:
    import torch.distributed as dist

    import zerospeed
    from zerospeed.testing.configs import adamw, train_config, zero_section

    rank = dist.get_rank()
    results: dict[str, Any] = {}
    # ZeRO stage 1 printing to a file, stage 3 (parameters partitioned: counted at full size) to stdout
    for case, stage, output_file in (("file", 1, os.path.join(out_dir, "profile.txt")), ("stdout", 3, None)):
        model = _mlp()
        profiler = {"enabled": True, "profile_step": 2, "module_depth": -1, "top_modules": 1, "detailed": True,
                    "output_file": output_file}
        config = train_config(micro=B, accum=2, optimizer=adamw(1e-3),
                              zero=zero_section(stage, reduce_bucket_size=100_000, persistence_threshold=0),
                              flops_profiler=profiler, wall_clock_breakdown=False)
        engine, *_ = zerospeed.initialize(model=model, config=config)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            for step in range(3):
                for micro in range(2):
                    x = torch.randn(B, D0, generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank))
                    engine.backward(engine(x).sum())
                    engine.step()
        last = engine.flops_profiler.last_profile
        results[case] = {"stdout": printed.getvalue(), "last": None if last is None else list(last.__dict__.values()),
                         "model": list(engine.flops_profiler.model_profile.__dict__.values()),
                         "phase": engine.flops_profiler.phase.name}
        if output_file is not None and rank == 0:
            results[case]["file"] = Path(output_file).read_text()
        engine.destroy()
    return results


def _two_rank_cases(out_dir: str) -> dict[str, Any]:
    """Every 2-rank case in one spawn: data parallel (ZeRO 1 and 3), tensor parallel, pipeline."""
    return {"dp": _train_with_profiler(out_dir), "tp": _tensor_parallel_profile(), "pp": _pipeline_profile()}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as out_dir:
        return run_distributed(_two_rank_cases, 2, out_dir)


def test_config_section_profiles_profile_step_on_two_ranks(two_ranks: list[dict[str, Any]]) -> None:
    results = [result["dp"] for result in two_ranks]
    fwd_macs = B * (D0 * D1 + D1 * D2 + D2 * D3)
    fwd_flops = 2 * fwd_macs + B * (2 * D1 + 2 * D2 + D3)
    bwd_macs = fwd_macs + B * (D1 * D2 + D2 * D3)
    # + 1: the backward of the engine's loss / gradient_accumulation_steps (one element)
    bwd_flops = 2 * bwd_macs + B * (2 * D1 + 2 * D2 + D3) + 1
    params = D0 * D1 + D1 + D1 * D2 + D2 + D2 * D3 + D3
    for rank, result in enumerate(results):
        for case in ("file", "stdout"):
            got = result[case]
            assert got["last"] == [fwd_flops, fwd_macs, bwd_flops, bwd_macs, params]
            assert got["model"] == got["last"]  # data parallelism: nothing to sum
            assert got["phase"] == "DONE"
        text = result["file"]["file"] if rank == 0 else result["stdout"]["stdout"]
        if rank != 0:
            assert text == "" and "file" not in result["file"]  # one rank prints
            continue
        printed = result["stdout"]["stdout"]
        assert result["file"]["stdout"] == ""  # output_file: nothing on stdout
        for body in (text, printed):
            assert body.count("Profile Summary at step 2:") == 1  # the first micro-batch of step 2 only
            assert "world size: " in body and "data parallel size: " in body
            assert f"{number_to_string(fwd_flops)}" in body.split("fwd flops per GPU:")[1].split("\n")[0]
            assert f"{number_to_string(bwd_flops)}" in body.split("bwd flops per GPU:")[1].split("\n")[0]
            assert macs_to_string(fwd_macs) in body and params_to_string(params) in body
            assert "bwd latency: " in body and "step latency: " in body and "samples/second: " in body


def _tensor_parallel_profile() -> dict[str, Any]:
    import torch.distributed as dist

    import zerospeed
    from zerospeed.distributed.mesh import ParallelDims
    from zerospeed.testing.configs import adamw, train_config, zero_section
    from zerospeed.testing.tp_models import GPTConfig as TPConfig
    from zerospeed.testing.tp_models import TinyGPT, token_batch

    cfg = TPConfig(vocab=128, seq=16, hidden=64, heads=4, layers=2, ffn=256)
    mesh = ParallelDims(world_size=dist.get_world_size(), tp=2).build()
    torch.manual_seed(0)
    model = TinyGPT(cfg, tp_group=mesh)
    config = train_config(micro=2, optimizer=adamw(1e-3), zero=zero_section(0, reduce_bucket_size=100_000, persistence_threshold=0),
                          flops_profiler={"enabled": True, "profile_step": 1, "detailed": False})
    engine, *_ = zerospeed.initialize(model=model, config=config, mpu=mesh)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for step in range(2):
            ids, targets = token_batch(step, 2, cfg)
            engine.backward(engine(ids, targets))
            engine.step()
    torch.manual_seed(0)
    plain = TinyGPT(cfg)  # the unsharded model, profiled in this process
    ids, targets = token_batch(0, 2, cfg)
    out = {"mine": list(engine.flops_profiler.last_profile.__dict__.values()),
           "model": list(engine.flops_profiler.model_profile.__dict__.values()),
           "plain": list(_profile(plain, ids, targets).values()), "stdout": printed.getvalue()}
    engine.destroy()
    return out


def test_tensor_parallel_summary_sums_the_model_parallel_ranks(two_ranks: list[dict[str, Any]]) -> None:
    results = [result["tp"] for result in two_ranks]
    fwd_flops, fwd_macs, bwd_flops, bwd_macs, params = range(5)
    plain = results[0]["plain"]
    for result in results:
        model = result["model"]
        assert model == results[0]["model"]
        # the slices' products add up to the unsharded model's exactly; each parameter counted once
        assert model[fwd_macs] == plain[fwd_macs] and model[bwd_macs] == plain[bwd_macs]
        assert model[params] == plain[params]
        assert result["mine"][fwd_macs] < plain[fwd_macs]  # each rank did part of the work
    assert results[0]["mine"][fwd_macs] + results[1]["mine"][fwd_macs] == plain[fwd_macs]
    text = results[0]["stdout"]
    assert "model parallel size: " in text and text.split("model parallel size:")[1].split("\n")[0].strip() == "2"
    assert params_to_string(plain[params]) in text.split("params of model")[1].split("\n")[0]
    assert number_to_string(results[0]["model"][fwd_flops]) in text.split("fwd flops of model")[1].split("\n")[0]
    assert results[1]["stdout"] == ""


def _pipeline_profile() -> dict[str, Any]:
    import zerospeed
    from zerospeed.testing.pipe_models import PlainGPT, gpt_pipeline, rank_iterator, token_batches

    module = gpt_pipeline(2, blocks=2)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "pipeline": {"schedule": "1f1b"},
              "flops_profiler": {"enabled": True, "profile_step": 1, "detailed": True}}
    engine, *_ = zerospeed.initialize(model=module, config=config)
    batches = token_batches(2, 2, 2)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        it = rank_iterator(batches, 0)
        for _ in range(2):
            engine.train_batch(it)
    plain = PlainGPT(blocks=2)  # one process, one micro-batch
    return {"model": list(engine.flops_profiler.model_profile.__dict__.values()),
            "plain": list(_profile(plain, batches[0][0][0][0]).values()), "stdout": printed.getvalue()}


def test_pipeline_summary_sums_the_stages_and_counts_the_tied_embedding_once(two_ranks: list[dict[str, Any]]
                                                                             ) -> None:
    results = [result["pp"] for result in two_ranks]
    fwd_flops, fwd_macs, bwd_flops, bwd_macs, params = range(5)
    plain = results[0]["plain"]
    for result in results:
        model = result["model"]
        # the batch's two micro-batches over both stages: twice one micro-batch of the whole model
        assert model[fwd_macs] == 2 * plain[fwd_macs]
        assert model[bwd_macs] == 2 * plain[bwd_macs]
        assert model[params] == plain[params]  # the tied embedding lives on both stages, counted once
    assert "Profile Summary at step 1:" in results[0]["stdout"] and results[1]["stdout"] == ""


def test_deepspeed_alias_paths() -> None:
    from zerospeed.deepspeed_alias import install_as_deepspeed, is_installed, uninstall_as_deepspeed

    installed = is_installed()
    if not installed:
        install_as_deepspeed()
    try:
        import deepspeed
        from deepspeed.profiling.flops_profiler import FlopsProfiler as Aliased
        from deepspeed.profiling.flops_profiler.profiler import get_model_profile as aliased_profile

        assert Aliased is FlopsProfiler and aliased_profile is get_model_profile
        assert deepspeed.profiling.flops_profiler.get_model_profile is get_model_profile
    finally:
        if not installed:
            uninstall_as_deepspeed()


def test_a_bare_import_reaches_the_profiler() -> None:
    """After ``import zerospeed as deepspeed``, ``deepspeed.profiling.flops_profiler.X`` (DeepSpeed imports
    eagerly): the package imports the submodule when the attribute is first asked for."""
    import zerospeed
    import zerospeed.profiling as profiling

    assert zerospeed.profiling is profiling
    assert profiling.__getattr__("flops_profiler") is sys.modules["zerospeed.profiling.flops_profiler"]
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        profiling.__getattr__("nothing")


def test_recomputed_forward_is_measured_as_backward_work() -> None:
    """Activation checkpointing runs the forward again inside backward: measured, no recompute factor."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = _mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.inner, x, use_reentrant=False)

    x = torch.randn(B, D0)
    plain, again = _profile(_mlp(), x), _profile(Checkpointed(), x)
    assert again["fwd_flops"] == plain["fwd_flops"] and again["fwd_macs"] == plain["fwd_macs"]
    # torch stops the recompute once the saved tensors backward needs are back: the last layer (whose
    # output nothing saved) is not run again
    last = B * D2 * D3
    assert again["bwd_macs"] == plain["bwd_macs"] + plain["fwd_macs"] - last
    assert again["bwd_flops"] == plain["bwd_flops"] + plain["fwd_flops"] - (2 * last + B * D3)
