"""DeepSpeed 0.19.8's engine surface on zerospeed's Engine: every one of its 180 names is implemented
(and answers from the config that built the engine) or refused with a replacement; the docs table
lists exactly that split.

The name list is data (``tests/data/deepspeed_0_19_8_engine_api.json``, taken from DeepSpeed 0.19.8's
``DeepSpeedEngine``: public names not on ``nn.Module``, plus its overrides). Engines here are real,
on a one-process gloo group started in this process (no extra processes).

Regenerate the docs table after changing the API: ``PYTHONPATH=src python tests/test_engine_api.py --write``.
"""

from __future__ import annotations

import inspect
import json
import logging
import pathlib
import re
import sys
from typing import Any, Iterator

import pytest
import torch
from torch import nn

from zerospeed.engine_refusals import REFUSED
from zerospeed.testing import one_process_group

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "deepspeed_0_19_8_engine_api.json"
DOC = ROOT / "docs" / "deepspeed_engine_api.md"
API: dict[str, dict[str, str]] = json.loads(DATA.read_text(encoding="utf-8"))["names"]
OVERRIDES = ("compile", "eval", "forward", "train", "zero_grad")

# Instance attributes DeepSpeed scripts read (not methods): name -> what a 1-rank CPU engine holds.
ATTRIBUTES_1_RANK: dict[str, Any] = {
    "local_rank": 0, "global_rank": 0, "world_size": 1, "dp_world_size": 1, "mp_world_size": 1,
    "seq_dp_world_size": 1, "sequence_parallel_size": 1, "device": torch.device("cpu"), "mpu": None,
    "has_moe_layers": False, "pipeline_parallelism": False, "is_compiled": False,
}
# Methods with side effects the generic "every getter answers" sweep must not call.
_NOT_GETTERS = {"destroy", "step", "backward", "forward", "no_sync"}


# -- the docs table, generated from the code --------------------------------------------------------
def _engine_class() -> type:
    from zerospeed.engine import Engine

    return Engine


def status(name: str) -> tuple[str, str]:
    """``("implemented" | "refused", note)`` of a DeepSpeed name on zerospeed's Engine."""
    from zerospeed.engine_refusals import is_refused

    engine = _engine_class()
    attribute = inspect.getattr_static(engine, name)
    if isinstance(attribute, staticmethod):
        attribute = attribute.__func__
    if is_refused(attribute):
        return "refused", REFUSED[name]
    if isinstance(attribute, property) and attribute.fget is not None:
        attribute = attribute.fget
    doc = inspect.cleandoc(attribute.__doc__ or "")  # its own docstring, not one inherited
    owner = next(k for k in engine.__mro__ if name in vars(k))
    where = {"Module": "torch.nn.Module's.", "Engine": "The engine's own."}.get(owner.__name__, "")
    first = " ".join(doc.split("\n\n")[0].split())
    if not first and inspect.isfunction(attribute):  # a one-line getter: name the config key it reads
        keys = re.findall(r"self\.config\.(\w+(?:\.\w+)*)", inspect.getsource(attribute))
        first = "config " + ", ".join(f"`{key}`" for key in dict.fromkeys(keys)) if keys else ""
    return "implemented", " ".join(part for part in (where, first) if part)


def render_doc() -> str:
    lines = [
        "# DeepSpeed engine API in zerospeed",
        "",
        "DeepSpeed 0.19.8's `DeepSpeedEngine` has 180 public names beyond `torch.nn.Module`'s (175 of its own",
        "and its overrides of `compile`, `eval`, `forward`, `train`, `zero_grad`). zerospeed's `Engine` answers",
        "every one: **implemented** (config getters answer from the resolved config the engine was built",
        "with), or **refused**: calling it raises `NotImplementedError` naming `engine.<name>` and what to use",
        "instead. The split lives in `zerospeed/engine_api.py`, `zerospeed/engine_config_api.py` and the",
        "refusal table `zerospeed/engine_refusals.py`; `tests/test_engine_api.py` checks this page against",
        "them (regenerate with `PYTHONPATH=src python tests/test_engine_api.py --write`).",
        "",
        "Instance attributes DeepSpeed sets in its constructor are read-only properties here, computed from",
        "the engine's process groups: `local_rank` (env `LOCAL_RANK`, 0 when unset), `global_rank`,",
        "`world_size`, `dp_world_size`, `mp_world_size` (tensor parallel), `sequence_parallel_size`,",
        "`seq_dp_world_size`, `device` (where the model's tensors live), `mpu` (the mesh when there is model",
        "parallelism, else None), `has_moe_layers` and `pipeline_parallelism` (False). `training_dataloader`,",
        "`optimizer`, `lr_scheduler`, `module`, `global_steps`, `global_samples`, `micro_steps` and",
        "`skipped_steps` are plain attributes, as in DeepSpeed.",
        "",
        "Deliberate differences: `memory_breakdown()` returns this rank's measured bytes (a dict: params,",
        "grads, optimizer_states, total, buffers, offloaded, on_nvme) instead of DeepSpeed's config flag",
        "(read `engine.config.memory_breakdown` for that); `get_data_types()` and `communication_data_type`",
        "report the dtypes zerospeed really uses (gradients accumulate and reduce in fp32 unless",
        "`data_types.grad_accum_dtype` / `communication_data_type` say otherwise); `get_batch_info()` returns",
        "the three numbers (DeepSpeed 0.19.8 returns the bound methods); `zero_offload_optimizer()` /",
        "`zero_offload_param()` return the section only when it offloads, else None.",
        "",
        "| name | kind | status | notes / use instead |",
        "|---|---|---|---|",
    ]
    for name in sorted(API):
        state, note = status(name)
        lines.append(f"| `{name}` | {API[name]['kind']} | {state} | {note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def _doc_rows(text: str) -> dict[str, tuple[str, str]]:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = (cells[2], cells[3])
    return rows


# -- a one-process engine ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    """A one-process gloo group for this module (torn down after it, so later tests see none)."""
    with one_process_group():
        yield


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _config(stage: int, *, precision: str = "fp32", micro: int = 2, accum: int = 2, **top: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
                           "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                           "zero_optimization": {"stage": stage}, **top}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 50, "hysteresis": 3,
                       "min_loss_scale": 0.5}
    elif precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _engine(cfg: dict[str, Any]) -> Any:
    import zerospeed

    engine, *_ = zerospeed.initialize(model=_model(), config=cfg)
    return engine


# Non-default zero_optimization values each stage's engine accepts, with the getter that reads each.
ZERO_KEYS: dict[str, tuple[str, Any]] = {
    "zero_reduce_bucket_size": ("reduce_bucket_size", 999),
    "zero_allgather_bucket_size": ("allgather_bucket_size", 12345),
    "zero_contiguous_gradients": ("contiguous_gradients", False),
    "zero_reduce_scatter": ("reduce_scatter", False),
    "zero_multi_rank_bucket_allreduce": ("use_multi_rank_bucket_allreduce", False),
    "zero_allgather_partitions": ("allgather_partitions", False),
    "zero_overlap_comm": ("overlap_comm", False),
    "zero_load_from_fp32_weights": ("load_from_fp32_weights", False),
    "zero_sub_group_size": ("sub_group_size", 23456),
    "zero_prefetch_bucket_size": ("stage3_prefetch_bucket_size", 3456),
    "zero_param_persistence_threshold": ("stage3_param_persistence_threshold", 4567),
    "zero_model_persistence_threshold": ("stage3_model_persistence_threshold", 5678),
    "zero_max_live_parameters": ("stage3_max_live_parameters", 6789),
    "zero_max_reuse_distance": ("stage3_max_reuse_distance", 7890),
    "zero_module_granularity_threshold": ("stage3_module_granularity_threshold", 11),
    "zero_ignore_unused_parameters": ("ignore_unused_parameters", False),
    "zero_hpz_partition_size": ("zero_hpz_partition_size", 1),
    "zero_log_trace_cache_warnings": ("log_trace_cache_warnings", True),
    "is_sanity_checks_enabled": ("enable_sanity_checks", True),
    "zero_save_muon_momentum_buffer_in_memory": ("save_muon_momentum_buffer_in_memory", True),
}
# Keys an engine refuses as features (or at some stage): their getters are checked on the config alone.
ZERO_KEYS_CONFIG_ONLY: dict[str, tuple[str, Any]] = {
    "zero_elastic_checkpoint": ("elastic_checkpoint", True),
    "zero_gather_16bit_weights_on_model_save": ("stage3_gather_16bit_weights_on_model_save", True),
    "zero_allgather_sequential": ("stage3_allgather_sequential", True),
    "zero_legacy_stage1": ("legacy_stage1", True),
    "zero_round_robin_gradients": ("round_robin_gradients", True),
    "zero_quantized_weights": ("zero_quantized_weights", True),
    "zero_quantized_nontrainable_weights": ("zero_quantized_nontrainable_weights", True),
    "zero_quantized_gradients": ("zero_quantized_gradients", True),
    "zero_compute_grad_norm": ("compute_grad_norm", False),
    "zero_parameter_alignment": ("parameter_alignment", True),
}

CASES = {  # id -> (stage, precision, extra top-level config)
    "stage0-fp32": (0, "fp32", {"gradient_clipping": 0.5, "dataloader_drop_last": True}),
    "stage1-fp16": (1, "fp16", {"prescale_gradients": True, "gradient_predivide_factor": 2.0}),
    "stage2-bf16-offload": (2, "bf16", {"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "cpu", "ratio": 1.0}}, "communication_data_type": "bf16", "checkpoint": {"tag_validation": "FAIL"}}),
    "stage3-bf16-offload": (3, "bf16", {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                                              "offload_optimizer": {"device": "cpu"}},
                                        "data_types": {"grad_accum_dtype": "bf16"}}),
}


@pytest.fixture(scope="module", params=list(CASES))
def built(request: pytest.FixtureRequest, one_rank: None) -> Iterator[tuple[Any, dict[str, Any]]]:
    stage, precision, extra = CASES[request.param]
    cfg = _config(stage, precision=precision, **extra)
    engine = _engine(cfg)
    yield engine, cfg
    engine.destroy()


# -- the name list ------------------------------------------------------------------------------------
def test_the_name_list_is_deepspeeds_180() -> None:
    assert len(API) == 180
    assert set(OVERRIDES) <= set(API)
    assert {n for n, v in API.items() if v["kind"] == "staticmethod"} == {
        "is_iterable_style_dataset", "is_map_style_dataset", "load_moe_state_dict"}
    assert {n for n, v in API.items() if v["kind"] == "property"} == {"communication_data_type", "is_compiled"}


@pytest.mark.parametrize("name", sorted(API))
def test_every_name_exists_with_deepspeeds_kind(name: str) -> None:
    engine = _engine_class()
    assert hasattr(engine, name), f"Engine.{name} is missing"
    attribute = inspect.getattr_static(engine, name)
    kind = API[name]["kind"]
    if kind == "property":
        assert isinstance(attribute, property)
    elif kind == "staticmethod":
        assert isinstance(attribute, staticmethod)
    else:
        assert inspect.isfunction(attribute), f"Engine.{name} should be a method, is {type(attribute).__name__}"


def test_refusals_are_deepspeed_names_and_none_shadows_an_implementation() -> None:
    assert set(REFUSED) <= set(API), f"refused names DeepSpeed does not have: {set(REFUSED) - set(API)}"
    refused = {name for name in API if status(name)[0] == "refused"}
    assert refused == set(REFUSED)


@pytest.fixture(scope="module")
def plain_engine(one_rank: None) -> Iterator[Any]:
    engine = _engine(_config(0))
    yield engine
    engine.destroy()


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_name_raises_naming_itself_and_a_replacement(name: str, plain_engine: Any) -> None:
    target = getattr(type(plain_engine) if API[name]["kind"] == "staticmethod" else plain_engine, name)
    with pytest.raises(NotImplementedError) as err:
        target("x", y=1)
    message = str(err.value)
    assert f"engine.{name} " in message
    assert REFUSED[name] in message
    assert any(hint in REFUSED[name] for hint in ("use ", "lands with")), REFUSED[name]


def test_the_docs_table_matches_the_code() -> None:
    text = DOC.read_text(encoding="utf-8")
    rows = _doc_rows(text)
    assert set(rows) == set(API), f"docs rows differ: {set(rows) ^ set(API)}"
    for name in API:
        assert rows[name] == status(name), f"docs row of {name} is stale"
    assert text == render_doc(), "docs/deepspeed_engine_api.md is stale: PYTHONPATH=src python tests/test_engine_api.py --write"


# -- implemented names, on real engines ----------------------------------------------------------------
def test_every_implemented_getter_answers(built: tuple[Any, dict]) -> None:
    engine, _ = built
    for name in sorted(API):
        if status(name)[0] != "implemented" or name in _NOT_GETTERS:
            continue
        attribute = inspect.getattr_static(type(engine), name)
        if isinstance(attribute, property):
            getattr(engine, name)
            continue
        method = getattr(engine, name)
        required = [p for p in inspect.signature(method).parameters.values()
                    if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not required:
            method()
    engine.train()
    assert engine.training and engine.module.training


def test_instance_attributes(built: tuple[Any, dict], monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _ = built
    for name, value in ATTRIBUTES_1_RANK.items():
        assert getattr(engine, name) == value, name
    assert engine.device == next(engine.module.parameters()).device
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert engine.local_rank == 3
    for name in ("training_dataloader", "optimizer", "lr_scheduler", "module", "global_steps", "global_samples",
                 "micro_steps", "skipped_steps"):
        assert hasattr(engine, name), name
    assert engine.get_data_parallel_rank() == engine.get_model_parallel_rank() == engine.get_tensor_parallel_rank() == 0


def test_config_getters_equal_the_config(built: tuple[Any, dict]) -> None:
    engine, cfg = built
    stage = cfg["zero_optimization"]["stage"]
    fp16, bf16 = cfg.get("fp16", {}).get("enabled", False), cfg.get("bf16", {}).get("enabled", False)
    assert engine.zero_optimization_stage() == stage
    assert engine.zero_optimization() is (stage > 0)
    assert engine.zero_optimization_partition_gradients() is (stage >= 2)
    assert engine.zero_optimization_partition_weights() is engine.is_first_weights_partition_group() is (stage == 3)
    assert engine.fp16_enabled() is fp16 and engine.bfloat16_enabled() is bf16
    assert engine.gradient_clipping() == cfg.get("gradient_clipping", 1.0)
    assert engine.dataloader_drop_last() is cfg.get("dataloader_drop_last", False)
    assert engine.postscale_gradients() is not cfg.get("prescale_gradients", False)
    assert engine.gradient_predivide_factor() == cfg.get("gradient_predivide_factor", 1.0)
    assert engine.checkpoint_tag_validation_fail() is (cfg.get("checkpoint", {}).get("tag_validation") == "FAIL")
    assert engine.checkpoint_tag_validation_enabled() is True
    assert engine.steps_per_print() == 10**9
    assert engine.optimizer_name() == "adamw" and engine.optimizer_params() == {"lr": 1e-3}
    assert engine.scheduler_name() is None and engine.scheduler_params() is None
    assert engine.get_lr() == [1e-3] and engine.get_type() == [0.0]
    offload = cfg["zero_optimization"].get("offload_optimizer")
    if offload is None:
        assert engine.zero_offload_optimizer() is None and not engine.zero_use_cpu_optimizer()
    else:
        assert engine.zero_offload_optimizer().device == offload["device"] == "cpu"
        assert engine.zero_use_cpu_optimizer() and engine.zero_cpu_offload()
        assert engine.zero_partial_offload() == offload.get("ratio", 1.0)
    assert engine.zero_nvme_offload_optimizer() is False
    param = cfg["zero_optimization"].get("offload_param")
    assert (engine.zero_offload_param() is None) is (param is None)


def test_data_types_and_communication_dtype(built: tuple[Any, dict]) -> None:
    engine, cfg = built
    names = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    model = torch.float16 if "fp16" in cfg else torch.bfloat16 if "bf16" in cfg else torch.float32
    accum = names[cfg.get("data_types", {}).get("grad_accum_dtype", "fp32")]
    assert engine.get_data_types() == (model, accum)
    assert next(engine.module.parameters()).dtype == model
    assert engine.communication_data_type == names.get(cfg.get("communication_data_type", ""), accum)
    with pytest.raises(NotImplementedError, match="communication_data_type.*set .communication_data_type. in the config"):
        engine.communication_data_type = torch.float16


def test_loss_scale_getters_follow_the_fp16_section(one_rank: None) -> None:
    dynamic = _engine(_config(0, precision="fp16"))
    assert dynamic.dynamic_loss_scale() is True and dynamic.loss_scale() == 0
    assert dynamic.initial_dynamic_scale() == 2 ** 8 == dynamic.cur_scale
    assert dynamic.dynamic_loss_scale_args() == {"init_scale": 256, "scale_window": 50, "delayed_shift": 3,
                                                 "consecutive_hysteresis": False, "min_scale": 0.5}
    dynamic.destroy()
    static = _engine({**_config(0), "fp16": {"enabled": True, "loss_scale": 128}})
    assert static.dynamic_loss_scale() is False and static.loss_scale() == 128 == static.cur_scale
    static.destroy()


@pytest.mark.parametrize("stage", [0, 3])
def test_zero_getters_equal_the_config_values(stage: int, one_rank: None) -> None:
    section = {"stage": stage, **{key: value for key, value in ZERO_KEYS.values()}}
    engine = _engine({**_config(stage), "zero_optimization": section})
    for getter, (_, value) in ZERO_KEYS.items():
        assert getattr(engine, getter)() == value, getter
    engine.destroy()


def test_zero_getters_of_keys_engines_refuse_read_the_config() -> None:
    from zerospeed.config import load_config
    from zerospeed.engine_config_api import DeepSpeedConfigGetters

    class ConfigOnly(DeepSpeedConfigGetters):
        def __init__(self, section: dict[str, Any]) -> None:
            self.config = load_config({"train_batch_size": 2, "zero_optimization": section})

    holder = ConfigOnly({"stage": 2, **{key: value for key, value in ZERO_KEYS_CONFIG_ONLY.values()}})
    for getter, (_, value) in ZERO_KEYS_CONFIG_ONLY.items():
        assert getattr(holder, getter)() == value, getter
    assert ConfigOnly({"stage": 3}).zero_overlap_comm() is True  # unset: stage 3 only, as DeepSpeed
    assert ConfigOnly({"stage": 2}).zero_overlap_comm() is False
    nvme = ConfigOnly({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "ratio": 0.5}})
    assert nvme.zero_nvme_offload_optimizer() and nvme.zero_use_cpu_optimizer() and not nvme.zero_cpu_offload()
    assert nvme.zero_partial_offload() == 0.5


def test_set_train_batch_size_round_trip_and_refusal(one_rank: None) -> None:
    engine = _engine(_config(2, micro=2, accum=2))
    assert engine.get_batch_info() == (4, 2, 2)
    engine.set_train_batch_size(6)
    assert engine.get_batch_info() == (6, 2, 3) == (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                                                     engine.gradient_accumulation_steps())
    assert engine.config.gradient_accumulation_steps == 3 and engine.config.train_batch_size == 6
    x = torch.randn(2, 4)
    boundaries = []
    for _ in range(3):  # one window is now three micro-batches
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(x).square().mean())
        engine.step()
    assert boundaries == [False, False, True] and engine.global_steps == 1 and engine.global_samples == 6
    engine.backward(engine(x).square().mean())
    engine.step()
    with pytest.raises(RuntimeError, match=r"set_train_batch_size\(\) in the middle of an accumulation window \(1 of 3"):
        engine.set_train_batch_size(4)
    for _ in range(2):
        engine.backward(engine(x).square().mean())
        engine.step()
    with pytest.raises(ValueError, match=r"set_train_batch_size\(5\).*multiple of .* = 2"):
        engine.set_train_batch_size(5)
    assert engine.get_batch_info() == (6, 2, 3)
    engine.set_train_batch_size(4)
    assert engine.get_batch_info() == (4, 2, 2)
    engine.set_train_micro_batch_size(3)
    assert engine.get_batch_info() == (6, 3, 2)
    with pytest.raises(ValueError, match="set_train_micro_batch_size"):
        engine.set_train_micro_batch_size(0)
    engine.destroy()


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_module_state_dict_round_trip(stage: int, one_rank: None, tmp_path: pathlib.Path) -> None:
    engine = _engine(_config(stage, precision="bf16"))
    reference = {k: v.to(torch.bfloat16) for k, v in _model().state_dict().items()}
    state = engine.module_state_dict()
    assert list(state) == list(reference)
    for key in reference:
        assert torch.equal(state[key], reference[key]), key
    assert "0.weight" not in engine.module_state_dict(prefix="m.") and "m.0.weight" in engine.module_state_dict(prefix="m.")
    ones = {k: torch.full_like(v, 0.5) for k, v in state.items()}
    engine.load_module_state_dict({"module": ones})
    from zerospeed.utils import safe_get_full_fp32_param

    for p in engine.module.parameters():  # the fp32 masters (what the optimizer updates) follow
        assert torch.equal(safe_get_full_fp32_param(p), torch.full(p.shape, 0.5))
    assert all(torch.equal(v, ones[k]) for k, v in engine.module_state_dict().items())
    with pytest.raises(RuntimeError, match=r"missing=\['2.bias'\]"):
        engine.load_module_state_dict({"module": {k: v for k, v in ones.items() if k != "2.bias"}})
    engine.load_module_state_dict({"module": {"2.bias": torch.zeros(2)}}, strict=False)
    assert torch.equal(engine.module_state_dict()["2.bias"], torch.zeros(2, dtype=torch.bfloat16))
    engine.save_fp16_model(str(tmp_path), "m.bin")
    saved = torch.load(tmp_path / "m.bin", weights_only=True)
    assert all(torch.equal(saved[k], v) for k, v in engine.module_state_dict().items())
    engine.destroy()


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self) -> Iterator[int]:
        return iter(range(3))


@pytest.mark.parametrize("stage", [0, 3])
def test_module_state_dict_leaves_frozen_parameters_out_on_request(stage: int, one_rank: None) -> None:
    import zerospeed

    model = _model()
    model[0].weight.requires_grad_(False)
    engine, *_ = zerospeed.initialize(model=model, config=_config(stage))
    assert "0.weight" in engine.module_state_dict()
    assert list(engine.module_state_dict(exclude_frozen_parameters=True)) == ["0.bias", "2.weight", "2.bias"]
    kept = engine.module_state_dict(keep_vars=True)["2.weight"]
    assert isinstance(kept, nn.Parameter) is (stage == 0)  # live tensors where parameters are whole
    engine.destroy()


def test_deepspeed_io_builds_the_rank_loader(one_rank: None) -> None:
    from torch.utils.data import TensorDataset

    from zerospeed.data.loader import DistributedLoader

    engine = _engine(_config(0, micro=3))
    data = TensorDataset(torch.arange(10.0).unsqueeze(1))
    loader = engine.deepspeed_io(data, route="eval")
    assert isinstance(loader, DistributedLoader)
    batches = [b[0].flatten().tolist() for b in loader]
    assert batches[0] == [0.0, 1.0, 2.0] and sum(len(b) for b in batches) == 10  # in order, nothing dropped
    assert [len(b[0]) for b in engine.deepspeed_io(data, batch_size=5)] == [5, 5]
    with pytest.raises(ValueError, match="map-style"):
        engine.deepspeed_io(_Stream())
    with pytest.raises(NotImplementedError, match="data_sampler=None"):
        engine.deepspeed_io(data, data_sampler=object())
    # 4 samples fill a micro-batch of 3 but not the global batch of 3 x accumulation 2: warned once, on rank 0
    from zerospeed.testing.logs import log_messages

    with log_messages(logging.WARNING) as messages:
        engine.deepspeed_io(TensorDataset(torch.arange(4.0).unsqueeze(1)))
    assert len(messages) == 1 and "fewer than one global batch of 6 " in messages[0], messages
    with pytest.raises(ValueError, match="route='bad'"):
        engine.deepspeed_io(data, route="bad")
    assert engine.is_map_style_dataset(data) and not engine.is_iterable_style_dataset(data)
    engine.destroy()


def test_memory_breakdown_measures_bytes(one_rank: None) -> None:
    engine = _engine(_config(0))
    breakdown = engine.memory_breakdown()
    params = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    assert breakdown["params"] == params and breakdown["total"] >= params
    engine.destroy()


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: PYTHONPATH=src python tests/test_engine_api.py --write")
    DOC.write_text(render_doc(), encoding="utf-8")
    print(f"wrote {DOC}")
