"""Strictness: unknown keys (did-you-mean), wrong types, ranges, aliases; exact messages."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from zerospeed.config import AUTO, ConfigError, DType, load_config

BATCH = {"train_batch_size": 8}


def problems(extra: dict[str, Any], world_size: int = 1) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as err:
        load_config({**BATCH, **extra}, world_size=world_size)
    assert not isinstance(err.value, ValidationError)
    return err.value.problems


def test_unknown_key_with_suggestion_in_zero_section() -> None:
    assert problems({"zero_optimization": {"stage3_prefetch_bucket_sise": 5}}) == (
        "zero_optimization.stage3_prefetch_bucket_sise: unknown key; "
        "did you mean stage3_prefetch_bucket_size?",)


def test_unknown_top_level_key() -> None:
    assert problems({"train_micro_batch_size_per_gpus": 2}) == (
        "train_micro_batch_size_per_gpus: unknown key; "
        "did you mean train_micro_batch_size_per_gpu?",)


def test_unknown_key_three_levels_down() -> None:
    assert problems({"zero_optimization": {"offload_optimizer": {"device": "cpu",
                                                                 "pin_memroy": True}}}) == (
        "zero_optimization.offload_optimizer.pin_memroy: unknown key; did you mean pin_memory?",)


def test_unknown_key_suggests_alias_names() -> None:
    # Short names are accepted aliases, so they are candidates too.
    assert problems({"zero_optimization": {"max_live_parameter": 1}}) == (
        "zero_optimization.max_live_parameter: unknown key; did you mean max_live_parameters?",)
    assert problems({"bfloat17": {"enabled": True}}) == (
        "bfloat17: unknown key; did you mean bfloat16?",)


def test_unknown_key_suggests_deprecated_names() -> None:
    assert problems({"zero_optimization": {"cpu_ofload": True}}) == (
        "zero_optimization.cpu_ofload: unknown key; did you mean cpu_offload?",)


def test_unknown_key_without_close_match_lists_valid_keys() -> None:
    assert problems({"progressive_layer_drop": {"zzz": 1}}) == (
        "progressive_layer_drop.zzz: unknown key; valid keys are enabled, gamma, theta",)


def test_zero_stage_not_allowed() -> None:
    assert problems({"zero_optimization": {"stage": 4}}) == (
        "zero_optimization.stage: 4 is not allowed; expected one of 0, 1, 2, 3",)


def test_out_of_range() -> None:
    assert problems({"fp16": {"loss_scale_window": -1}}) == (
        "fp16.loss_scale_window: -1 is out of range; expected an integer >= 1",)
    assert problems({"fp16": {"loss_scale": -0.5}}) == (
        "fp16.loss_scale: -0.5 is out of range; expected a number >= 0",)
    assert problems({"zero_optimization": {"offload_optimizer": {"ratio": 1.5}}}) == (
        "zero_optimization.offload_optimizer.ratio: 1.5 is out of range; "
        "expected a number between 0 and 1",)


def test_string_for_bool_is_an_error() -> None:
    assert problems({"fp16": {"enabled": "true"}}) == (
        'fp16.enabled: "true" is a string; expected true or false',)


def test_number_for_bool_is_an_error() -> None:
    assert problems({"wall_clock_breakdown": 1}) == (
        "wall_clock_breakdown: 1 is a number; expected true or false",)


def test_bool_for_int_is_an_error() -> None:
    assert problems({"steps_per_print": True}) == (
        "steps_per_print: true is a boolean; expected an integer >= 1",)


def test_fraction_for_int_is_an_error() -> None:
    assert problems({"zero_optimization": {"allgather_bucket_size": 1.5}}) == (
        "zero_optimization.allgather_bucket_size: 1.5 is not a whole number; "
        "expected an integer >= 0",)


def test_whole_float_for_int_is_fine() -> None:
    cfg = load_config({**BATCH, "zero_optimization": {"reduce_bucket_size": 5e8,
                                                      "stage3_max_live_parameters": 1e9}})
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert isinstance(cfg.zero_optimization.reduce_bucket_size, int)
    assert cfg.zero_optimization.max_live_parameters == 1_000_000_000


def test_int_for_float_is_fine() -> None:
    cfg = load_config({**BATCH, "gradient_clipping": 1, "fp16": {"min_loss_scale": 1}})
    assert cfg.gradient_clipping == 1.0
    assert isinstance(cfg.gradient_clipping, float)
    assert cfg.fp16.min_loss_scale == 1.0


def test_string_for_int() -> None:
    assert problems({"fp16": {"hysteresis": "2"}}) == (
        'fp16.hysteresis: "2" is a string; expected an integer >= 1',)


def test_object_expected() -> None:
    assert problems({"fp16": True}) == ("fp16: true is a boolean; expected an object",)
    assert problems({"zero_optimization": {"offload_param": "cpu"}}) == (
        'zero_optimization.offload_param: "cpu" is a string; expected an object',)


def test_auto_rejected_where_not_allowed() -> None:
    assert problems({"steps_per_print": "auto"}) == (
        'steps_per_print: "auto" is not accepted for this key; expected an integer >= 1',)
    assert problems({"zero_optimization": {"allgather_bucket_size": "auto"}}) == (
        'zero_optimization.allgather_bucket_size: "auto" is not accepted for this key; '
        "expected an integer >= 0",)


def test_null_rejected_where_not_allowed() -> None:
    assert problems({"fp16": {"enabled": None}}) == (
        "fp16.enabled: null is not allowed; expected true or false",)


def test_choice_values() -> None:
    assert problems({"zero_optimization": {"offload_param": {"device": "gpu"}}}) == (
        'zero_optimization.offload_param.device: "gpu" is not allowed; '
        'expected one of "none", "cpu", "nvme"',)
    assert problems({"communication_data_type": "fp8"}) == (
        'communication_data_type: "fp8" is not allowed; expected one of "fp32", "fp16", "bf16"',)


def test_array_item_path() -> None:
    assert problems({"elasticity": {"micro_batch_sizes": [2, "x"]}}) == (
        'elasticity.micro_batch_sizes[1]: "x" is a string; expected an integer >= 1',)


def test_all_errors_reported_one_per_line() -> None:
    found = problems({"fp16": {"enabled": "true", "loss_scale_window": -1},
                      "zero_optimization": {"stage": 4, "stage3_prefetch_bucket_sise": 1},
                      "wall_clock_breakdwn": True})
    assert found == (
        'fp16.enabled: "true" is a string; expected true or false',
        "fp16.loss_scale_window: -1 is out of range; expected an integer >= 1",
        "zero_optimization.stage: 4 is not allowed; expected one of 0, 1, 2, 3",
        "zero_optimization.stage3_prefetch_bucket_sise: unknown key; "
        "did you mean stage3_prefetch_bucket_size?",
        "wall_clock_breakdwn: unknown key; did you mean wall_clock_breakdown?",
    )
    with pytest.raises(ConfigError) as err:
        load_config({**BATCH, "fp16": {"enabled": "true", "loss_scale_window": -1}})
    assert str(err.value).count("\n") == 1


def test_fp16_and_bf16_both_enabled() -> None:
    assert problems({"fp16": {"enabled": True}, "bf16": {"enabled": True}}) == (
        "bf16.enabled: true together with fp16.enabled = true; enable at most one of fp16 "
        "and bf16",)


def test_bfloat16_is_an_alias_of_bf16() -> None:
    cfg = load_config({**BATCH, "bfloat16": {"enabled": True}})
    assert cfg.bf16.enabled is True
    assert cfg.bfloat16 is cfg.bf16
    assert cfg.precision == DType.BF16 == "bf16"
    assert "bfloat16" not in cfg.to_dict() and cfg.to_dict()["bf16"]["enabled"] is True


def test_bf16_and_bfloat16_both_given() -> None:
    assert problems({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}) == (
        "bf16: also given as bfloat16; they are the same setting, give only one",)


def test_stage3_alias_and_short_name_both_given() -> None:
    assert problems({"zero_optimization": {"stage3_prefetch_bucket_size": 1,
                                           "prefetch_bucket_size": 2}}) == (
        "zero_optimization.stage3_prefetch_bucket_size: also given as prefetch_bucket_size; "
        "they are the same setting, give only one",)


def test_precision_property() -> None:
    assert load_config(BATCH).precision == DType.FP32
    assert load_config({**BATCH, "fp16": {"enabled": True}}).precision == "fp16"
    cfg = load_config({**BATCH, "fp16": {"enabled": "auto"}})
    assert cfg.fp16.enabled is AUTO
    with pytest.raises(ConfigError, match=r'^fp16.enabled: "auto" is not resolved yet'):
        _ = cfg.precision


def test_dtype_spellings_are_normalised() -> None:
    for spelling, expected in (("fp16", "fp16"), ("FP16", "fp16"), ("half", "fp16"),
                               ("torch.float16", "fp16"), ("float32", "fp32"), ("float", "fp32"),
                               ("bfloat16", "bf16"), ("torch.bfloat16", "bf16")):
        cfg = load_config({**BATCH, "communication_data_type": spelling})
        assert cfg.communication_data_type == expected
        assert isinstance(cfg.communication_data_type, DType)
    assert load_config(BATCH).communication_data_type is None
    assert load_config({**BATCH, "communication_data_type": "bf16"}).to_dict()[
        "communication_data_type"] == "bf16"


def test_cross_checks() -> None:
    assert problems({"fp16": {"fp16_master_weights_and_grads": True}}) == (
        "fp16.fp16_master_weights_and_grads: true needs ZeRO stage 1, 2 or 3; "
        "zero_optimization.stage is 0",)
    assert problems({"bf16": {"enabled": True, "bf16_optimizer_states": True},
                     "zero_optimization": {"stage": 2}}) == (
        "bf16.bf16_optimizer_states: true needs bf16.bf16_master_weights_and_grads = true",)
    assert problems({"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}}) == (
        'gradient_allreduce_op: "sum" is not supported with ZeRO stage 3',)
    assert problems({"amp": {"enabled": True, "opt_level": "O1"}, "fp16": {"enabled": True}}) == (
        "amp.enabled: true together with fp16/bf16; Apex AMP replaces DeepSpeed's fp16/bf16 "
        "modes, enable only one",)


def test_legacy_boolean_zero_optimization() -> None:
    with pytest.warns(DeprecationWarning, match="zero_optimization"):
        cfg = load_config({**BATCH, "zero_optimization": True})
    assert cfg.zero_optimization.stage == 1


def test_checkpoint_tag_validation_is_case_insensitive() -> None:
    assert load_config({**BATCH, "checkpoint": {"tag_validation": "fail"}}
                       ).checkpoint.tag_validation == "FAIL"
    assert problems({"checkpoint": {"tag_validation": "sometimes"}}) == (
        'checkpoint.tag_validation: "sometimes" is not allowed; expected one of "Warn", '
        '"Ignore", "Fail"',)


def test_loose_sections_accept_unknown_keys_but_type_known_ones() -> None:
    cfg = load_config({**BATCH, "compression_training": {"weight_quantization": {
        "shared_parameters": {"enabled": True}}}, "autotuning": {"enabled": False,
                                                                "fast": True}})
    assert cfg.compression_training is not None
    assert cfg.compression_training.passthrough["weight_quantization"]["shared_parameters"][
        "enabled"] is True
    assert cfg.autotuning.passthrough["fast"] is True
    assert cfg.to_dict()["autotuning"] == {"enabled": False, "fast": True}
    assert problems({"autotuning": {"enabled": "yes"}}) == (
        'autotuning.enabled: "yes" is a string; expected true or false',)


def test_steps_per_print_infinity_means_never() -> None:
    # accelerate writes float("inf") to silence DeepSpeed's periodic printing.
    cfg = load_config({**BATCH, "steps_per_print": float("inf")})
    assert cfg.steps_per_print is None
    assert "steps_per_print" not in cfg.to_dict()
    assert load_config({**BATCH, "steps_per_print": 100}).steps_per_print == 100


def test_null_batch_size_is_not_set() -> None:
    # accelerate writes "train_batch_size": null next to the micro batch.
    cfg = load_config({"train_batch_size": None, "train_micro_batch_size_per_gpu": 2,
                       "gradient_accumulation_steps": 3}, world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == (12, 2, 3)


def test_null_sections() -> None:
    assert problems({"fp16": None}) == ("fp16: null is not allowed; expected an object",)
    cfg = load_config({**BATCH, "aio": None, "optimizer": None, "pipeline": None})
    assert cfg.aio.block_size == 1_048_576
    assert cfg.optimizer is None and cfg.pipeline is None


def _leaf_paths(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _leaf_paths(v, path + (k,))] + [path]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in _leaf_paths(v, path + (i,))] + [path]
    return [path]


def test_no_raw_exception_escapes_for_odd_values() -> None:
    """Replace every key of a big config by odd values: only ConfigError may come out."""
    import copy
    import pathlib
    import warnings

    source = pathlib.Path(__file__).parent / "data" / "ds_zero3_nvme_offload.json"
    base = load_config(source, world_size=16).to_dict()
    tried = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for path in _leaf_paths(base):
            if not path:
                continue
            for odd in (None, "x", -1, 1.5, True, {}):
                data = copy.deepcopy(base)
                node = data
                for part in path[:-1]:
                    node = node[part]
                node[path[-1]] = odd
                tried += 1
                try:
                    load_config(data, world_size=16)
                except ConfigError as err:
                    assert all(": " in line for line in err.problems), err.problems
    assert tried > 500


@pytest.mark.parametrize("section, message", [
    ({"compile": {"enable": True}}, "compile.enable: unknown key; did you mean enabled?"),
    ({"tensor_parallel": {"autotp_sise": 2}}, "tensor_parallel.autotp_sise: unknown key; did you mean autotp_size?"),
    ({"amp": {"enabeld": True}}, "amp.enabeld: unknown key; did you mean enabled?"),
    ({"autotuning": {"enable": True}}, "autotuning.enable: unknown key; did you mean enabled?"),
    ({"data_efficiency": {"enable": True}}, "data_efficiency.enable: unknown key; did you mean enabled?"),
])
def test_typos_in_loosely_typed_sections_are_caught(section: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config({"train_batch_size": 8, **section})
    assert str(err.value) == message


def test_passthrough_keys_of_loose_sections_still_parse() -> None:
    cfg = load_config({"train_batch_size": 8, "gradient_clipping": 0, "amp": {"enabled": True, "opt_level": "O1"},
                       "compile": {"deepcompile": True, "offload_activation": True}})
    assert cfg.features_in_use() == ("amp", "compile")
    assert cfg.to_dict()["amp"] == {"enabled": True, "opt_level": "O1"}


def test_null_offload_sections_mean_no_offload() -> None:
    cfg = load_config({"train_batch_size": 8,
                       "zero_optimization": {"stage": 3, "offload_param": None, "offload_optimizer": None}})
    assert not cfg.zero_optimization.offload_param.enabled
    assert not cfg.zero_optimization.offload_optimizer.enabled


def test_auto_where_not_allowed_reads_well() -> None:
    with pytest.raises(ConfigError) as err:
        load_config({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"betas": [0.9, "auto"]}}})
    assert str(err.value).startswith('optimizer.params.betas: "auto" is not allowed here; expected ')
