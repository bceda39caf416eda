"""The inference config (DeepSpeed 0.19.8's ``DeepSpeedInferenceConfig`` keys and aliases) and what the settings
make of it on this machine: conflicts, deprecated keys, did-you-mean, refusals with their exact messages."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from zerospeed.config import ConfigError
from zerospeed.inference.config import (DeepSpeedInferenceConfig, default_inference_config, merge_arguments,
                                        parse_inference_config)
from zerospeed.inference.settings import InferenceSettings, Int8Settings, resolve_settings
from zerospeed.inference.transforms import Int8Weights, KernelInjection, LoadCheckpoint, ModuleTo, build_transforms

CPU = {"device_type": "cpu", "supported_dtypes": (torch.float32, torch.bfloat16)}


def settings(**data: Any) -> InferenceSettings:
    return resolve_settings(parse_inference_config(data), **CPU)  # type: ignore[arg-type]


def error(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        parse_inference_config(data)
    return str(info.value)


class Block(nn.Module):
    pass


def test_keys_aliases_and_values() -> None:
    cfg = parse_inference_config({"kernel_inject": False, "tp": {"tp_size": 2}, "dtype": "bf16", "max_tokens": 64,
                                  "min_tokens": 2, "injection_dict": {Block: "attn.out"}, "ckpt_config": {},
                                  "tm": True, "args": {"a": 1}})
    assert (cfg.tensor_parallel.tp_size, cfg.tp_size, cfg.mp_size) == (2, 2, 2)
    assert cfg.dtype is torch.bfloat16 and cfg.max_out_tokens == 64 and cfg.min_out_tokens == 2
    assert cfg.injection_policy == ((Block, ("attn.out",)),)
    assert cfg.config == {"a": 1}
    # every DeepSpeed dtype spelling, and torch dtypes
    for name, dtype in (("half", torch.float16), ("torch.float16", torch.float16), ("float", torch.float32),
                        ("bfloat", torch.bfloat16), ("int8", torch.int8), ("torch.int8", torch.int8)):
        assert parse_inference_config({"dtype": name}).dtype is dtype
    assert parse_inference_config({"dtype": torch.half}).dtype is torch.float16
    assert parse_inference_config({"moe": False}).moe.enabled is False
    assert parse_inference_config({"quant": {"weight": {"group_size": 32}}}).quant.weight.group_size == 32


def test_default_config_round_trips() -> None:
    assert parse_inference_config(default_inference_config()) == DeepSpeedInferenceConfig()
    assert default_inference_config()["max_out_tokens"] == 1024


def test_unknown_keys_and_wrong_values_name_the_key() -> None:
    assert error({"dtyp": "fp16"}) == "dtyp: unknown key; did you mean dtype?"
    assert error({"tensor_parallel": {"tp_sise": 2}}) == "tensor_parallel.tp_sise: unknown key; did you mean tp_size?"
    assert error({"quant": {"weight": {"groupsize": 8}}}) == ("quant.weight.groupsize: unknown key; did you mean "
                                                             "group_size?")
    assert error({"max_tokens": 0}) == "max_tokens: 0 is out of range; expected an integer >= 1"
    assert error({"dtype": "fp8"}).startswith('dtype: "fp8" is not a dtype; expected one of bf16, bfloat, ')
    assert error({"dtype": torch.float64}) == ("dtype: torch.float64 is not supported; expected torch.float16, "
                                               "torch.bfloat16, torch.float32 or torch.int8")
    assert error({"tp": {}, "tensor_parallel": {}}) == ("tensor_parallel: also given as tp; they are the same "
                                                        "setting, give only one")
    assert error({"quant": {"weight": {"q_type": "sym"}}}) == ('quant.weight.q_type: "sym" is not allowed; expected '
                                                               'one of "symmetric", "asymmetric"')
    assert error({"injection_policy": {Block: 3}}) == (
        "injection_policy: Block: 3 is not a layer name or a tuple of them; give the names, relative to the block, "
        "of the linears whose outputs are summed over ranks (row-parallel), e.g. ('attn.out_proj', 'mlp.fc2'); "
        "DeepSpeed's kernel-injection policy classes are not accepted here")
    assert error({"injection_policy": {Block: "o"}, "replace_with_kernel_inject": True}) == (
        "injection_policy: cannot be combined with replace_with_kernel_inject (DeepSpeed's rule too): an injection "
        "policy describes a tensor-parallel split, kernel injection replaces whole layers; give one of them")
    assert error({"min_out_tokens": 9, "max_out_tokens": 8}) == ("min_out_tokens: 9 is more than max_out_tokens 8; "
                                                                 "raise max_out_tokens")
    assert error({"tp": {"enabled": False, "tp_size": 2}}) == ("tensor_parallel.tp_size: tp_size 2 with enabled "
                                                               "false; set enabled true or tp_size 1")


def test_deprecated_keys_move_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match="mp_size is deprecated; use tensor_parallel.tp_size instead"):
        assert parse_inference_config({"mp_size": 2}).tensor_parallel.tp_size == 2
    with pytest.warns(DeprecationWarning, match="moe_type is deprecated; use moe.type instead"):
        assert parse_inference_config({"moe_type": "residual", "moe": True}).moe.type == "residual"
    with pytest.warns(DeprecationWarning, match="ep_size is deprecated"):
        assert parse_inference_config({"ep_size": 2, "moe": {"ep_size": 2}}).moe.ep_size == 2  # same value: fine
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert error({"mp_size": 2, "tp": {"tp_size": 4}}) == (
            "mp_size: 2 conflicts with tp.tp_size = 4; mp_size is deprecated: remove it and keep tp.tp_size")
    with pytest.warns(DeprecationWarning, match="replace_method is deprecated"):
        parse_inference_config({"replace_method": "inject"})


def test_init_inference_merge_rule(tmp_path: Path) -> None:
    assert merge_arguments({"dtype": "fp32"}, {"max_tokens": 8}) == {"dtype": "fp32", "max_tokens": 8}
    assert merge_arguments({"dtype": "fp32"}, {"dtype": "fp32"}) == {"dtype": "fp32"}
    with pytest.raises(ConfigError) as info:
        merge_arguments({"dtype": "fp32"}, {"dtype": torch.bfloat16})
    assert str(info.value) == ('dtype: conflicting values in config ("fp32") and the keyword argument '
                               '(torch.bfloat16); give it once, or the same value in both')
    path = tmp_path / "inference.json"
    path.write_text(json.dumps({"tensor_parallel": {"tp_size": 1}}))
    assert merge_arguments(str(path), {}) == {"tensor_parallel": {"tp_size": 1}}
    with pytest.raises(ConfigError, match="config: int is not accepted; expected a dict or the path of a JSON"):
        merge_arguments(3, {})  # type: ignore[arg-type]


def test_dtype_default_follows_the_accelerator() -> None:
    assert settings().compute_dtype is None  # no fp16 here: the model keeps its dtype
    gpu = resolve_settings(DeepSpeedInferenceConfig(), device_type="cuda",
                           supported_dtypes=(torch.float32, torch.float16, torch.bfloat16))
    assert gpu.compute_dtype is torch.float16  # DeepSpeed's default where fp16 is supported
    assert settings(dtype="bf16").compute_dtype is torch.bfloat16
    with pytest.raises(ConfigError) as info:
        settings(dtype="fp16")
    assert str(info.value) == ("dtype: torch.float16 is not supported by the cpu accelerator here (it supports "
                               "torch.float32, torch.bfloat16); choose one of those")


def test_device_keys_are_refused_with_the_reason() -> None:
    with pytest.raises(ConfigError) as info:
        settings(enable_cuda_graph=True, use_triton=True)
    assert info.value.problems == ("enable_cuda_graph: CUDA graphs need a CUDA device, and this run is on cpu; "
                                   "remove it", "use_triton: triton kernels run on GPUs, and this run is on cpu; "
                                   "remove it")
    with pytest.raises(NotImplementedError, match="enable_cuda_graph: not built in zerospeed"):
        resolve_settings(parse_inference_config({"enable_cuda_graph": True}), device_type="cuda",
                         supported_dtypes=(torch.float32,))


@pytest.mark.parametrize("data, message", [
    ({"set_empty_params": True}, "set_empty_params: building the model with empty parameters"),
    ({"save_mp_checkpoint_path": "/x"}, "save_mp_checkpoint_path: saving a resharded copy is not built"),
    ({"ckpt_config": {"save_mp_checkpoint_path": "/x"}}, "save_mp_checkpoint_path: saving a resharded copy"),
    ({"training_mp_size": 2}, "training_mp_size: it describes DeepSpeed's Megatron checkpoint descriptors"),
    ({"transposed_mode": True}, "transposed_mode: the transposed weight layout"),
    ({"tm": False}, "triangular_masking: a setting of DeepSpeed's fused transformer kernels"),
    ({"return_tuple": False}, "return_tuple: a setting of DeepSpeed's fused transformer layers"),
    ({"injection_policy_tuple": ("a",)}, "injection_policy_tuple: DeepSpeed's internal field"),
    ({"tp": {"tp_grain_size": 32}}, "tensor_parallel.tp_grain_size: uneven splits in grains are not built"),
    ({"moe": {"ep_size": 2}}, "moe.ep_size: expert-parallel inference of DeepSpeed MoE layers is not built"),
    ({"moe": {"num_experts": [8]}}, "moe.moe_experts/type/ep_group/ep_mp_group: they describe a DeepSpeed MoE"),
    ({"dtype": "int8", "quant": {"weight": {"num_bits": 4}}}, "quant.weight.num_bits: 4-bit weights are not built"),
    ({"dtype": "int8", "quant": {"weight": {"q_type": "asymmetric"}}}, "quant.weight.q_type: asymmetric"),
    ({"dtype": "int8", "quant": {"weight": {"post_init_quant": {"fc": {}}}}}, "quant.weight.quantized_initial"),
    ({"dtype": "int8", "quant": {"qkv": {"enabled": False}}}, "quant.qkv.enabled false: keeping q/k/v"),
    ({"checkpoint": {"type": "Megatron", "checkpoints": []}}, "checkpoint: DeepSpeed's JSON checkpoint descriptor"),
    ({"checkpoint": "/models/ckpt.json"}, "checkpoint: DeepSpeed's JSON checkpoint descriptor"),
])
def test_unbuilt_capabilities_are_refused_by_name(data: dict[str, Any], message: str) -> None:
    with pytest.raises(NotImplementedError) as info:
        settings(**data)
    assert str(info.value).startswith(message), str(info.value)


def test_int8_settings() -> None:
    assert settings().int8 is None
    assert settings(quant={"weight": {"group_size": 32}}).int8 is None  # quant only works with dtype int8
    got = settings(dtype=torch.int8, quant={"weight": {"group_size": 32}})
    assert got.int8 == Int8Settings(bits=8, group_size=32) and got.compute_dtype is None
    assert settings(dtype="int8").int8 == Int8Settings(bits=8, group_size=128)
    with pytest.raises(ConfigError) as info:
        settings(dtype="int8", quant={"weight": {"q_groups": 8}})
    assert str(info.value) == ("quant.weight.q_groups: DeepSpeed counts 8 groups over a whole flattened weight, so "
                               "the group length differs per layer; zerospeed groups a fixed number of weights "
                               "along each row: give quant.weight.group_size (e.g. 128) instead")
    with pytest.raises(ConfigError, match="quant: dtype is torch.int8 .* but quant.enabled or quant.weight.enabled"):
        settings(dtype="int8", quant={"enabled": False})


def test_zero_and_checkpoint_settings() -> None:
    with pytest.raises(ConfigError, match="dtype: torch.int8 with zero.stage 3: int8 weights are buffers"):
        settings(dtype="int8", zero={"stage": 3})
    with pytest.raises(ConfigError, match="zero.stage 3 with tensor_parallel.tp_size 2: ZeRO-Inference shards"):
        settings(zero={"stage": 3}, tensor_parallel={"tp_size": 2})
    assert settings().zero is None and settings(zero={"stage": 0}).zero is None
    assert settings(zero={"stage": 3, "offload_param": {"device": "cpu"}}).zero.stage == 3  # type: ignore[union-attr]
    with pytest.raises(ConfigError) as info:
        settings(zero={"stage": 2})
    assert str(info.value) == ("zero.stage: 2 shards optimizer states and gradients, which inference has none of; "
                               "ZeRO-Inference is stage 3 (with offload_param), or leave zero out")
    assert settings(checkpoint="ckpt", base_dir="/models").checkpoint == "/models/ckpt"
    assert settings(ckpt_config={"checkpoint_dir": "/c"}).checkpoint == "/c"
    with pytest.raises(ConfigError, match="checkpoint: '/a' and checkpoint_config.checkpoint_dir '/b' disagree"):
        settings(checkpoint="/a", ckpt_config={"checkpoint_dir": "/b"})


class _Mpu:
    def get_model_parallel_world_size(self) -> int:
        return 2


def test_tensor_parallel_degree_sources() -> None:
    with pytest.warns(DeprecationWarning, match="mp_size is deprecated"):
        assert settings(mp_size=1).tp_size == 1
    assert settings(tensor_parallel={"tp_size": 2}).tp_size == 2
    assert settings(tensor_parallel={"mpu": _Mpu()}).tp_size == 2
    with pytest.raises(ConfigError) as info:
        settings(tensor_parallel={"mpu": _Mpu(), "tp_size": 4})
    assert str(info.value) == ("tensor_parallel.tp_size: 4 but the mpu's model-parallel size is 2; make them agree "
                               "or leave tp_size out")


def test_transform_factory_order() -> None:
    cpu = torch.device("cpu")
    steps = build_transforms(settings(dtype="bf16", checkpoint="/c.pt"), comm=None, device=cpu)
    assert [t.name for t in steps] == ["load_checkpoint", "cast_dtype", "to_device"]
    assert steps == (LoadCheckpoint("/c.pt"), ModuleTo(torch.bfloat16, "cast_dtype"), ModuleTo(cpu, "to_device"))
    assert [t.name for t in build_transforms(settings(keep_module_on_host=True), comm=None, device=cpu)] == []
    assert build_transforms(settings(dtype="int8", quant={"weight": {"group_size": 32}}), comm=None,
                            device=cpu) == (ModuleTo(cpu, "to_device"), Int8Weights(32))
    zero = {"stage": 3, "offload_param": {"device": "cpu"}}
    steps = build_transforms(settings(dtype="bf16", zero=zero), comm=None, device=cpu)
    assert [t.name for t in steps] == ["cast_dtype", "zero_inference"]  # ZeRO-Inference places the weights itself
    placed = steps[-1].zero  # type: ignore[attr-defined]
    assert placed["stage"] == 3 and placed["offload_param"]["device"] == "cpu"
    steps = build_transforms(settings(dtype="int8", replace_with_kernel_inject=True, max_tokens=64), comm=None,
                             device=cpu)
    assert steps == (ModuleTo(cpu, "to_device"), KernelInjection(64), Int8Weights(128))  # int8 finds the fused qkv
