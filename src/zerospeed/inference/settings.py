"""What an inference config asks for on this machine, decided once: :class:`InferenceSettings`.

The config (:mod:`zerospeed.inference.config`) only checks shapes and values. Here each key meets
the device and what zerospeed has built: a key that means nothing on this device (CUDA graphs or
triton on a CPU, fp16 where the accelerator has no fp16 kernels) is a :class:`ConfigError` giving
the reason; a key whose capability is not built raises ``NotImplementedError`` naming it. Nothing
is silently ignored. Components below receive the frozen settings, never the config.

Decisions (documented in ``docs/inference.md``):

- ``dtype`` not given: DeepSpeed's default (fp16) where the accelerator supports fp16, otherwise the
  model keeps its dtype (DeepSpeed refuses its own default on such a CPU).
- int8 weights: ``dtype=torch.int8`` (DeepSpeed's rule: ``quant`` only works with it); activations stay
  in the model's dtype (cast the model first for bf16 activations). The group length is
  ``quant.weight.group_size`` (zerospeed's key, default 128 weights per scale along a row); DeepSpeed's
  ``q_groups`` other than its default 1 is refused. ``quant.activation`` and ``quant.qkv.enabled: true``
  are DeepSpeed's defaults and do nothing in its v1 engine either.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from zerospeed.config.errors import ConfigError
from zerospeed.config.schema_zero import ZeroConfig
from zerospeed.config.values import Auto
from zerospeed.inference.config import DEFAULT_GROUP_SIZE, DeepSpeedInferenceConfig


@dataclass(frozen=True)
class Int8Settings:
    """Weight-only quantization: bits per weight and weights per scale along a row."""

    bits: int = 8
    group_size: int = DEFAULT_GROUP_SIZE


@dataclass(frozen=True)
class InferenceSettings:
    """The resolved inference request (plain values; the process-group objects are passed through)."""

    compute_dtype: torch.dtype | None  # cast the model to this; None keeps the model's dtype
    tp_size: int
    tp_group: Any = None  # a torch ProcessGroup, zerospeed Comm or Mesh given by the user
    mpu: Any = None
    injection_policy: tuple[tuple[type, tuple[str, ...]], ...] | None = None
    kernel_inject: bool = False
    int8: Int8Settings | None = None
    zero: ZeroConfig | None = None  # ZeRO-Inference (stage 3) section, None when off
    checkpoint: str | None = None
    keep_module_on_host: bool = False
    max_out_tokens: int = 1024
    min_out_tokens: int = 1


def resolve_settings(config: DeepSpeedInferenceConfig, *, device_type: str,
                     supported_dtypes: tuple[torch.dtype, ...]) -> InferenceSettings:
    """Check ``config`` against the device (``device_type``: "cpu", "cuda"...) and what is built."""
    _refuse_device_keys(config, device_type)
    _refuse_unbuilt(config)
    int8 = _int8(config)
    dtype = config.dtype
    if dtype is None:
        compute = torch.float16 if torch.float16 in supported_dtypes else None
    elif dtype == torch.int8:
        compute = None
    else:
        compute = dtype
    if compute is not None and compute not in supported_dtypes:
        names = ", ".join(str(d) for d in supported_dtypes)
        raise ConfigError(f"dtype: {compute} is not supported by the {device_type} accelerator here (it supports "
                          f"{names}); choose one of those")
    tp_size, tp_group, mpu = _tp(config)
    zero = _zero(config.zero)
    if int8 is not None and zero is not None:
        raise ConfigError("dtype: torch.int8 with zero.stage 3: int8 weights are buffers that ZeRO-Inference does not "
                          "stream, so they would all stay in memory; use int8 (a quarter of the fp32 bytes) or "
                          "ZeRO-Inference (weights in CPU memory or on NVMe), not both")
    if zero is not None and tp_size > 1:
        raise ConfigError(f"zero.stage 3 with tensor_parallel.tp_size {tp_size}: ZeRO-Inference shards the weights "
                          f"over every rank itself; leave tp_size at 1 (or leave zero out for tensor-parallel serving)")
    return InferenceSettings(
        compute_dtype=compute, tp_size=tp_size, tp_group=tp_group, mpu=mpu,
        injection_policy=config.injection_policy, kernel_inject=config.replace_with_kernel_inject, int8=int8,
        zero=zero, checkpoint=_checkpoint(config), keep_module_on_host=config.keep_module_on_host,
        max_out_tokens=config.max_out_tokens, min_out_tokens=config.min_out_tokens)


def _refuse_device_keys(config: DeepSpeedInferenceConfig, device_type: str) -> None:
    problems = []
    on_gpu = device_type == "cuda"
    for key, what in (("enable_cuda_graph", "CUDA graphs need a CUDA device"),
                      ("use_triton", "triton kernels run on GPUs"),
                      ("triton_autotune", "triton kernels run on GPUs")):
        if getattr(config, key) and not on_gpu:
            problems.append(f"{key}: {what}, and this run is on {device_type}; remove it")
    if problems:
        raise ConfigError(problems)
    for key in ("enable_cuda_graph", "use_triton", "triton_autotune"):
        if getattr(config, key):
            raise NotImplementedError(f"{key}: not built in zerospeed (no run-time compiled kernels); remove it")


def _refuse_unbuilt(config: DeepSpeedInferenceConfig) -> None:
    """Keys DeepSpeed reads for capabilities zerospeed does not have: refused by name with the way on."""
    refusals = [
        (config.set_empty_params, "set_empty_params: building the model with empty parameters and filling them "
                                  "from a checkpoint is not built; build the model on the host and pass "
                                  "checkpoint="),
        (config.save_mp_checkpoint_path is not None or config.checkpoint_config.save_mp_checkpoint_path is not None,
         "save_mp_checkpoint_path: saving a resharded copy is not built (and not needed: a zerospeed checkpoint "
         "loads at any tensor-parallel size); remove it"),
        (config.training_mp_size != 1, "training_mp_size: it describes DeepSpeed's Megatron checkpoint descriptors, "
                                       "which are not read; a zerospeed checkpoint records its own degree: remove it"),
        (config.transposed_mode, "transposed_mode: the transposed weight layout of DeepSpeed's kernels is not "
                                 "built; remove it"),
        (not config.triangular_masking, "triangular_masking: a setting of DeepSpeed's fused transformer kernels; "
                                        "zerospeed keeps the model's own attention masks: remove it"),
        (not config.return_tuple, "return_tuple: a setting of DeepSpeed's fused transformer layers; zerospeed's "
                                  "layers return what the model's layers return: remove it"),
        (config.injection_policy_tuple is not None, "injection_policy_tuple: DeepSpeed's internal field; give "
                                                    "injection_policy={BlockClass: (row-parallel names...)}"),
        (config.tensor_parallel.tp_grain_size != 64, "tensor_parallel.tp_grain_size: uneven splits in grains are "
                                                     "not built; zerospeed splits layers evenly (the vocabulary is "
                                                     "padded): remove it"),
        (config.moe.enabled and config.moe.ep_size > 1, "moe.ep_size: expert-parallel inference of DeepSpeed MoE "
                                                        "layers is not built; Hugging Face Mixtral-style experts are "
                                                        "split over tensor_parallel ranks instead"),
        (config.moe.moe_experts != (1,) or config.moe.type != "standard" or config.moe.ep_group is not None
         or config.moe.ep_mp_group is not None,
         "moe.moe_experts/type/ep_group/ep_mp_group: they describe a DeepSpeed MoE model to DeepSpeed's MoE kernel "
         "injection, which is not built; zerospeed reads the experts from the model: remove them"),
    ]
    for refused, message in refusals:
        if refused:
            raise NotImplementedError(message)


def _int8(config: DeepSpeedInferenceConfig) -> Int8Settings | None:
    """int8 weights when ``dtype`` is ``torch.int8`` (DeepSpeed's rule: ``quant`` only works with it), with
    ``quant.weight``'s settings; what is not built is refused."""
    if config.dtype != torch.int8:
        return None
    quant, weight = config.quant, config.quant.weight
    if not (quant.enabled and weight.enabled):
        raise ConfigError("quant: dtype is torch.int8 (int8 weights) but quant.enabled or quant.weight.enabled is "
                          "false; enable them or choose a floating dtype")
    if weight.num_bits != 8:
        raise NotImplementedError(f"quant.weight.num_bits: {weight.num_bits}-bit weights are not built; use 8")
    if weight.q_type != "symmetric":
        raise NotImplementedError(f"quant.weight.q_type: {weight.q_type} quantization is not built; use symmetric")
    if weight.q_groups != 1:
        raise ConfigError(f"quant.weight.q_groups: DeepSpeed counts {weight.q_groups} groups over a whole flattened "
                          f"weight, so the group length differs per layer; zerospeed groups a fixed number of "
                          f"weights along each row: give quant.weight.group_size (e.g. {DEFAULT_GROUP_SIZE}) instead")
    if weight.quantized_initialization or weight.post_init_quant:
        raise NotImplementedError("quant.weight.quantized_initialization/post_init_quant: per-layer quantization "
                                  "tables are not built; give quant.weight.group_size for every linear layer")
    if not quant.qkv.enabled:
        raise NotImplementedError("quant.qkv.enabled false: keeping q/k/v projections in float is not built; "
                                  "remove it")
    return Int8Settings(bits=8, group_size=weight.group_size)


def _tp(config: DeepSpeedInferenceConfig) -> tuple[int, Any, Any]:
    """The tensor-parallel degree and the group or ``mpu`` it comes from (all must agree)."""
    tp = config.tensor_parallel
    size, group, mpu = config.tp_size, tp.tp_group, tp.mpu
    explicit = "tp_size" in tp.model_fields_set
    if mpu is not None:
        getter = getattr(mpu, "get_model_parallel_world_size", None) or getattr(
            mpu, "get_tensor_model_parallel_world_size", None)
        if getter is None:
            raise ConfigError("tensor_parallel.mpu: it must answer get_model_parallel_world_size() and "
                              "get_model_parallel_group() (Megatron's mpu)")
        mpu_size = int(getter())
        if explicit and size != mpu_size:
            raise ConfigError(f"tensor_parallel.tp_size: {size} but the mpu's model-parallel size is {mpu_size}; "
                              f"make them agree or leave tp_size out")
        size = mpu_size
    if group is not None:
        from zerospeed.tensor_parallel.group import degree, tp_comm

        group_size = degree(tp_comm(group))
        if explicit and size != group_size:
            raise ConfigError(f"tensor_parallel.tp_size: {size} but tensor_parallel.tp_group has {group_size} ranks; "
                              f"make them agree or leave tp_size out")
        size = group_size
    return size, group, mpu


def _zero(zero: ZeroConfig) -> ZeroConfig | None:
    if isinstance(zero.stage, Auto):
        raise ConfigError('zero.stage: "auto" is not resolved for inference; give 3 (ZeRO-Inference) or 0')
    if zero.stage in (1, 2):
        raise ConfigError(f"zero.stage: {zero.stage} shards optimizer states and gradients, which inference has "
                          f"none of; ZeRO-Inference is stage 3 (with offload_param), or leave zero out")
    return zero if zero.stage == 3 else None


def _checkpoint(config: DeepSpeedInferenceConfig) -> str | None:
    """The checkpoint path (``checkpoint`` or ``checkpoint_config.checkpoint_dir``, under ``base_dir``)."""
    direct, nested = config.checkpoint, config.checkpoint_config.checkpoint_dir
    if direct is not None and nested is not None and direct != nested:
        raise ConfigError(f"checkpoint: {direct!r} and checkpoint_config.checkpoint_dir {nested!r} disagree; give one")
    path = direct if direct is not None else nested
    if path is None:
        return None
    if not isinstance(path, str) or path.endswith(".json"):
        raise NotImplementedError("checkpoint: DeepSpeed's JSON checkpoint descriptor (type/checkpoints/version) is "
                                  "not read; pass a zerospeed checkpoint directory (from save_checkpoint) or a "
                                  "state-dict file (.pt, .bin or .safetensors)")
    base = config.base_dir or config.checkpoint_config.base_dir or ""
    return os.path.join(base, path) if base else path


__all__ = ["InferenceSettings", "Int8Settings", "resolve_settings"]
