"""Hugging Face causal LMs train unmodified through ``zerospeed.initialize`` (issue 16, part 1).

A tiny GPT-2 (tied input/output embeddings) and a tiny Llama, built from configs (nothing is
downloaded), train on 2 gloo ranks with keyword-argument forwards (``engine(input_ids=...,
attention_mask=..., labels=...)``) whose output object carries ``.loss``: at ZeRO stages 0-3 with
and without CPU offload in fp32 (losses and final weights against a single-process PyTorch reference on the
same global batches, then ``generate`` on the engine's module gives the reference's tokens), and in
bf16/fp16 (finite, falling losses). The last case of each model is the Hugging Face way of building a
ZeRO-3 model: ``HfDeepSpeedConfig`` kept alive, ``import deepspeed`` answered by zerospeed, then
``AutoModelForCausalLM.from_config`` (transformers enters ``deepspeed.zero.Init`` itself and reads
DeepSpeed's ``ds_*`` parameter attributes), training, ``generate`` with transformers' synced ranks,
and ``from_pretrained`` of a saved model loading its exact weights.

One ``run_distributed`` spawn per model runs every case in sequence (a fresh model and engine each)
and hands back plain lists; the tests compare them with the reference.
"""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from zerospeed.testing import run_distributed  # noqa: E402
from zerospeed.testing.configs import QUIET_STEPS_PER_PRINT  # noqa: E402
from zerospeed.testing.data import micro_batch_rows  # noqa: E402
from zerospeed.testing.hf_models import (VOCAB, LossOf, lm_batch, tiny_causal_lm, tiny_gpt2_config,  # noqa: E402
                                         tiny_llama_config, token_rows)
from zerospeed.testing.reference import train_reference  # noqa: E402

WORLD, MICRO, STEPS, LR, CLIP = 2, 2, 4, 0.01, 1.0
MIXED_STEPS = 8  # bf16/fp16 runs: enough steps for the loss to fall clearly
ATOL = 2e-5  # fp32 losses and weights: rounding of a sum over 2 ranks vs one process
# Adam's eps well above the gradient noise: GPT-2's key bias has a zero gradient in exact arithmetic
# (softmax ignores a shift shared by a row), and Adam would blow its rounding noise up to lr-sized steps
EPS = 1e-6
SEED = 0
PROMPT_LEN, NEW_TOKENS = 4, 6
KINDS = ("gpt2", "llama")

# name -> (stage, precision, offload): offload puts the optimizer on the CPU (stages 1-3) and, at
# stage 3, the parameters too
CASES: dict[str, tuple[int, str, bool]] = {
    **{f"fp32 s{s}": (s, "fp32", False) for s in (0, 1, 2, 3)},
    **{f"fp32 s{s} offload": (s, "fp32", True) for s in (1, 2, 3)},
    "bf16 s2 offload": (2, "bf16", True),
    "bf16 s3": (3, "bf16", False),
    "fp16 s1": (1, "fp16", False),
    "fp16 s3 offload": (3, "fp16", True),
}
HF_WAY = "hf from_config s3"  # the HfDeepSpeedConfig + from_config + from_pretrained case


def _config(stage: int, precision: str = "fp32", offload: bool = False) -> dict[str, Any]:
    # persistence 0: ZeRO-3 partitions every parameter of these tiny models (the default keeps all whole)
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 4096, "stage3_param_persistence_threshold": 0}
    if offload and stage > 0:
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload and stage == 3:
        zero["offload_param"] = {"device": "cpu"}
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
                              "gradient_clipping": CLIP, "steps_per_print": QUIET_STEPS_PER_PRINT,
                              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "eps": EPS}},
                              "zero_optimization": zero}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8}
    return config


def _rows(steps: int) -> torch.Tensor:
    return token_rows(steps * WORLD * MICRO, seed=1)


def _prompt() -> torch.Tensor:
    return token_rows(2, seed=9)[:, :PROMPT_LEN]


# ---------------------------------------------------------------------------------------------------
# Inside the ranks


def _gathered(model: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
    from zerospeed.zero import GatheredParameters

    return GatheredParameters(list(model.parameters()))


def _weights(model: torch.nn.Module) -> dict[str, list]:
    """Every full parameter as nested float lists (tensors would cross the result pipe through shared
    memory, which does not outlive the rank)."""
    with _gathered(model):
        return {name: p.detach().float().tolist() for name, p in model.named_parameters()}


def _train(engine: Any, steps: int) -> list[float]:
    rank, rows = torch.distributed.get_rank(), _rows(steps)
    losses = []
    for step in range(steps):
        ids = rows[micro_batch_rows(step, rank, 0, world=WORLD, accum=1, micro=MICRO)]
        out = engine(**lm_batch(ids))  # keyword arguments in, a ModelOutput with .loss out
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
    return losses


def _tied(model: torch.nn.Module) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def _run_case(kind: str, stage: int, precision: str, offload: bool) -> dict[str, Any]:
    import zerospeed

    torch.manual_seed(100 + torch.distributed.get_rank())  # initialize must start every rank from rank 0's weights
    model = tiny_causal_lm(kind, seed=SEED) if torch.distributed.get_rank() == 0 else tiny_causal_lm(kind, seed=7)
    engine, *_ = zerospeed.initialize(model=model, config=_config(stage, precision, offload),
                                      model_parameters=model.parameters())
    steps = STEPS if precision == "fp32" else MIXED_STEPS
    losses = _train(engine, steps)
    out: dict[str, Any] = {"losses": losses, "tied": _tied(engine.module)}
    if precision == "fp32":
        out["weights"] = _weights(engine.module)
        out["tokens"] = engine.module.generate(_prompt(), max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
    return out


def _hf_way(kind: str, saved: str) -> dict[str, Any]:
    """from_config under HfDeepSpeedConfig (transformers runs zero.Init), train, generate, from_pretrained."""
    import deepspeed
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    config = _config(3)
    hf_config = HfDeepSpeedConfig(config)  # must stay alive: transformers holds it by weak reference
    assert is_deepspeed_zero3_enabled()
    deepspeed.comm.init_distributed()  # already up here: a no-op, as in a launched script
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(tiny_gpt2_config() if kind == "gpt2" else tiny_llama_config())
    params = dict(model.named_parameters())
    built = {"numel": sum(p.numel() for p in params.values()),
             "ds_numel": sum(p.ds_numel for p in params.values()),
             "partition_numel": sum(p.partition_numel() for p in params.values()),
             "held_bytes": sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in params.values()),
             "status": sorted({p.ds_status.name for p in params.values()}),
             "shapes_match": all(tuple(p.ds_shape) == tuple(p.ds_shape) and p.ds_numel == math.prod(p.ds_shape)
                                 for p in params.values()),
             "ids": sorted(p.ds_id for p in params.values())}
    with deepspeed.zero.GatheredParameters(list(params.values())):
        built["status_gathered"] = sorted({p.ds_status.name for p in params.values()})
    initial = _weights(model)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    after = dict(engine.module.named_parameters())
    built["engine_ds_numel"] = sum(p.ds_numel for p in after.values())
    built["engine_partition_numel"] = sum(p.partition_numel() for p in after.values())
    losses = _train(engine, STEPS)
    tokens = engine.module.generate(_prompt(), max_new_tokens=NEW_TOKENS, do_sample=False).tolist()  # synced_gpus
    weights = _weights(engine.module)
    tied = _tied(engine.module)
    loaded = AutoModelForCausalLM.from_pretrained(saved)  # zero.Init again; rank 0 loads, GatheredParameters scatters
    expected = load_file(str(Path(saved) / "model.safetensors"))
    with deepspeed.zero.GatheredParameters(list(loaded.parameters())):
        state = loaded.state_dict()
        mismatched = [k for k, v in expected.items() if not torch.equal(state[k], v)]
    loaded_partitioned = all(p.numel() == 0 for p in loaded.parameters())
    # adding tokens: transformers v5 builds the new embedding whole (not under zero.Init: its shape is read
    # elsewhere) and copies the old rows in while they are gathered; initialize partitions it later
    resized = loaded.resize_token_embeddings(VOCAB + 3)
    with deepspeed.zero.GatheredParameters(list(loaded.parameters())):
        rows_kept = torch.equal(resized.weight[:VOCAB], expected[next(k for k in expected if "embed" in k or "wte" in k)])
        resized_shape = tuple(resized.weight.shape)
        resized_finite = bool(torch.isfinite(resized.weight).all())
    resize = {"shape": resized_shape, "kept": rows_kept, "finite": resized_finite, "partitioned": hasattr(resized.weight, "ds_numel"),
              "tied": _tied(loaded)}
    del hf_config
    # bf16 configured: zero.Init makes the parameters bf16, buffers (RoPE's inv_freq) keep their dtype
    hf_config = HfDeepSpeedConfig(_config(3, "bf16"))
    half = AutoModelForCausalLM.from_config(tiny_gpt2_config() if kind == "gpt2" else tiny_llama_config())
    bf16 = {"params": sorted({str(p.ds_tensor.dtype) for p in half.parameters()}),
            "buffers": sorted({str(b.dtype) for b in half.buffers() if b.is_floating_point()})}
    del hf_config
    return {"built": built, "initial": initial, "losses": losses, "tokens": tokens, "weights": weights, "tied": tied,
            "loaded_keys": len(expected), "mismatched": mismatched, "loaded_partitioned": loaded_partitioned,
            "resize": resize, "bf16": bf16}


def _run_all(kind: str, saved: str) -> dict[str, Any]:
    import zerospeed

    # before transformers is imported: it decides at import whether DeepSpeed is there (a launched script
    # gets the same from ZEROSPEED_AS_DEEPSPEED=1, read at interpreter start)
    zerospeed.install_as_deepspeed()
    logging.getLogger("zerospeed").setLevel(logging.WARNING)  # keep the config dump out of the output
    logging.getLogger("transformers").setLevel(logging.ERROR)
    results: dict[str, Any] = {}
    for name, (stage, precision, offload) in CASES.items():
        try:
            results[name] = _run_case(kind, stage, precision, offload)
        except Exception as exc:
            raise AssertionError(f"{kind} case {name!r} failed on rank {torch.distributed.get_rank()}") from exc
    results[HF_WAY] = _hf_way(kind, saved)
    if kind == KINDS[0]:
        results["leaf moe"] = _train_leaf_moe()
    return results


# ---------------------------------------------------------------------------------------------------
# In the test process


_SPAWNS: dict[str, Any] = {}


def _results(kind: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every case's result on each rank, from one spawn per model (cached, failures too)."""
    if kind not in _SPAWNS:
        saved = tmp_path_factory.mktemp(f"saved-{kind}")
        tiny_causal_lm(kind, seed=3).save_pretrained(saved)  # what from_pretrained must load exactly
        try:
            _SPAWNS[kind] = run_distributed(_run_all, WORLD, kind, str(saved), timeout=240)
        except Exception as exc:  # noqa: BLE001 - re-raised by every test that needs this spawn
            _SPAWNS[kind] = exc
    if isinstance(_SPAWNS[kind], Exception):
        raise _SPAWNS[kind]
    return _SPAWNS[kind]


def _reference(kind: str, initial: dict[str, list] | None = None) -> dict[str, Any]:
    """Plain single-process PyTorch: the same model, global batches, AdamW and clipping."""
    model = tiny_causal_lm(kind, seed=SEED)
    if initial is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(torch.tensor(initial[name]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, eps=EPS)
    rows = _rows(STEPS)
    run = train_reference(LossOf(model), optimizer, steps=STEPS, world=WORLD, clip=CLIP,
                          batch=lambda step, rank, m: (rows[micro_batch_rows(step, rank, m, world=WORLD, accum=1,
                                                                             micro=MICRO)], rows),
                          loss_fn=lambda loss, _: loss)
    tokens = model.generate(_prompt(), max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
    return {"losses": run.losses, "tokens": tokens,
            "weights": {n: p.detach().tolist() for n, p in model.named_parameters()}}


_REFERENCES: dict[str, Any] = {}


def _cached_reference(kind: str) -> dict[str, Any]:
    if kind not in _REFERENCES:
        _REFERENCES[kind] = _reference(kind)
    return _REFERENCES[kind]


def _assert_matches(ranks: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    from zerospeed.testing import assert_close_tree

    for rank, result in enumerate(ranks):
        assert_close_tree(result["losses"], ref["losses"][rank], atol=ATOL, path=f"rank {rank} losses")
        assert result["tokens"] == ref["tokens"], f"rank {rank}: generate() differs from the reference"
    assert_close_tree(ranks[0]["weights"], ref["weights"], atol=ATOL, path="weights")


FP32 = [name for name, (_, precision, _) in CASES.items() if precision == "fp32"]
MIXED = [name for name, (_, precision, _) in CASES.items() if precision != "fp32"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", FP32)
def test_fp32_matches_reference(kind: str, case: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    ranks = [r[case] for r in _results(kind, tmp_path_factory)]
    _assert_matches(ranks, _cached_reference(kind))
    assert all(r["tied"] == (kind == "gpt2") for r in ranks)  # GPT-2's head is its embedding, at every stage


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", MIXED)
def test_mixed_precision_trains(kind: str, case: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    for rank, result in enumerate(_results(kind, tmp_path_factory)):
        losses = result[case]["losses"]
        assert all(math.isfinite(x) for x in losses), f"rank {rank}: {losses}"
        first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2  # each step trains on other rows: smooth a bit
        assert last < first - 0.2, f"rank {rank}: the loss did not fall: {losses}"


@pytest.mark.parametrize("kind", KINDS)
def test_from_config_under_hf_deepspeed_config(kind: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    ranks = [r[HF_WAY] for r in _results(kind, tmp_path_factory)]
    full = tiny_causal_lm(kind, seed=SEED)
    total = sum(p.numel() for p in full.parameters())
    for rank, result in enumerate(ranks):
        built = result["built"]
        assert built["numel"] == 0, f"rank {rank}: parameters are not partitioned after from_config"
        assert built["ds_numel"] == total == built["engine_ds_numel"]
        # each rank holds its half (up to one padding element per parameter)
        assert total / WORLD <= built["partition_numel"] <= total / WORLD + len(built["ids"])
        assert built["held_bytes"] == built["partition_numel"] * 4
        assert total / WORLD - 8 * len(built["ids"]) <= built["engine_partition_numel"] <= total / WORLD + 8
        assert built["status"] == ["NOT_AVAILABLE"] and built["status_gathered"] == ["AVAILABLE"]
        assert built["shapes_match"] and built["ids"] == list(range(len(built["ids"])))
        assert result["tied"] == (kind == "gpt2")
    assert ranks[0]["initial"] == ranks[1]["initial"]
    _assert_matches(ranks, _reference(kind, ranks[0]["initial"]))


@pytest.mark.parametrize("kind", KINDS)
def test_from_pretrained_under_stage3_loads_exact_weights(kind: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    for rank, result in enumerate(_results(kind, tmp_path_factory)):
        result = result[HF_WAY]
        assert result["loaded_partitioned"], f"rank {rank}: from_pretrained did not partition under ZeRO-3"
        assert result["loaded_keys"] > 0 and result["mismatched"] == [], f"rank {rank}: {result['mismatched']}"


@pytest.mark.parametrize("kind", KINDS)
def test_from_config_with_bf16_keeps_float_buffers(kind: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    for result in _results(kind, tmp_path_factory):
        bf16 = result[HF_WAY]["bf16"]
        assert bf16["params"] == ["torch.bfloat16"]
        assert bf16["buffers"] == ([] if kind == "gpt2" else ["torch.float32"])  # RoPE frequencies stay fp32


@pytest.mark.parametrize("kind", KINDS)
def test_resize_token_embeddings_under_stage3(kind: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    for rank, result in enumerate(_results(kind, tmp_path_factory)):
        resize = result[HF_WAY]["resize"]
        assert resize["shape"] == (VOCAB + 3, 32) and not resize["partitioned"], (rank, resize)
        assert resize["kept"] and resize["finite"] and resize["tied"] == (kind == "gpt2"), (rank, resize)


# ---------------------------------------------------------------------------------------------------
# The DeepSpeed names transformers and accelerate reach for (no ranks needed)


class _Experts(torch.nn.Module):
    """A mixture of experts whose experts run in a data-dependent order (what leaf modules are for)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = torch.randperm(3)[:2]  # two experts, a different pair on each rank
        return self.experts[int(chosen[0])](x) + self.experts[int(chosen[1])](x)


class _MoeModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 4)
        self.moe = _Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(torch.relu(self.inp(x))).sum(-1)


def _train_leaf_moe() -> dict[str, Any]:
    """Stage 3 with the experts' block marked a leaf: ranks use different experts, and without the mark
    their gathers would not line up (a hang, in DeepSpeed too)."""
    import zerospeed
    from zerospeed.utils import set_z3_leaf_modules

    torch.manual_seed(0)
    model = _MoeModel()
    set_z3_leaf_modules(model, [_Experts])
    engine, *_ = zerospeed.initialize(model=model, config=_config(3))
    torch.manual_seed(1 + torch.distributed.get_rank())
    losses = []
    for _ in range(3):
        x = torch.randn(MICRO, 4)
        loss = torch.nn.functional.mse_loss(engine(x), x.sum(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    hooked = sorted(name for name, m in engine.module.named_modules() if m._forward_pre_hooks)
    return {"losses": losses, "hooked": hooked}


def test_z3_leaf_modules_gather_their_subtree_on_entry() -> None:
    from zerospeed.utils import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module
    from zerospeed.zero.layout import build_units, module_users

    model = _MoeModel()
    units = build_units(model, bucket_elems=10**6, unit_classes=())
    before = module_users(model, units)
    assert "moe" not in before and {"moe.experts.0", "moe.experts.1", "moe.experts.2"} <= set(before)
    assert set_z3_leaf_modules(model, ["_Experts"]) == [model.moe] and z3_leaf_module(model.moe)
    after = module_users(model, units)
    assert not any(path.startswith("moe.") for path in after)  # no hooks inside the leaf
    assert sorted(after["moe"]) == sorted({i for path, ids in before.items() if path.startswith("moe.") for i in ids})
    assert get_z3_leaf_modules(model) == [model.moe]
    unset_z3_leaf_modules(model, [_Experts])
    assert get_z3_leaf_modules(model) == [] and module_users(model, units) == before
    with pytest.raises(ValueError, match="no module of these classes"):
        set_z3_leaf_modules(model, ["NoSuchBlock"])


def test_leaf_module_with_rank_dependent_experts_trains_at_stage3(tmp_path_factory: pytest.TempPathFactory) -> None:
    for rank, result in enumerate(_results(KINDS[0], tmp_path_factory)):
        leaf = result["leaf moe"]
        assert all(math.isfinite(x) for x in leaf["losses"]), (rank, leaf)
        assert leaf["hooked"] == ["", "inp", "moe"], (rank, leaf)  # nothing inside the leaf is hooked


def test_partition_parameters_names_transformers_uses() -> None:
    from zerospeed.runtime.zero import partition_parameters as pp

    assert pp._orig_torch_arange is torch.arange
    wrapped = pp.zero_wrapper_for_fp_tensor_constructor(torch.zeros, torch.bfloat16, torch.device("cpu"))
    assert wrapped(3).dtype == torch.bfloat16 and wrapped(3, dtype=torch.long).dtype == torch.long
    assert pp.ZeroParamStatus.NOT_AVAILABLE.value == 2


def test_zero_parameter_attributes_follow_the_owner() -> None:
    import copy

    from zerospeed.zero.ds_param import Partitioned, ZeroParameter, ZeroParamStatus
    from zerospeed.zero.owner import clear_owner, set_owner

    class Half(Partitioned):  # a stand-in owner: rank 0 of 2 holds the first half of a 3x5 parameter
        ds_id, shape, whole = 7, (3, 5), False

        @property
        def status(self) -> ZeroParamStatus:
            return ZeroParamStatus.AVAILABLE if self.whole else ZeroParamStatus.NOT_AVAILABLE

        @property
        def persistent(self) -> bool:
            return False

        def partition_numel(self) -> int:
            return 8

        def padding_size(self) -> int:
            return 1

        def partition_tensor(self) -> torch.Tensor:
            return torch.zeros(8)

        def make_available(self) -> None:
            self.whole = True

        def repartition(self) -> None:
            self.whole = False

    layer = torch.nn.Linear(5, 3)
    param = layer.weight
    set_owner(param, Half())
    assert type(param) is ZeroParameter and isinstance(param, torch.nn.Parameter)
    assert (param.ds_numel, tuple(param.ds_shape), param.ds_id, param.partition_numel()) == (15, (3, 5), 7, 8)
    assert (param.padding_size(), param.aligned_size(), param.ds_tensor.ds_numel) == (1, 16, 8)
    assert param.ds_status is ZeroParamStatus.NOT_AVAILABLE
    param.all_gather()
    assert param.ds_status is ZeroParamStatus.AVAILABLE
    param.partition()
    assert param.ds_summary()["status"] == "NOT_AVAILABLE"
    assert not hasattr(copy.deepcopy(layer).weight, "ds_numel")  # a copy holds no ZeRO state
    clear_owner(param)
    assert type(param) is torch.nn.Parameter and not hasattr(param, "ds_numel")
