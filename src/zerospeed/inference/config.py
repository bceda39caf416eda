"""DeepSpeed 0.19.8's inference config (``DeepSpeedInferenceConfig``), as strict frozen sections.

Every key and alias DeepSpeed accepts parses here (``tp``/``tensor_parallel``, ``kernel_inject``,
``injection_dict``, ``max_tokens``, ``ckpt_config``...); an unknown key is an error with a
did-you-mean, two spellings of one key are an error, and DeepSpeed's deprecated top-level keys
(``mp_size``, ``mpu``, ``ep_size``, ``ep_group``, ``ep_mp_group``, ``moe_experts``, ``moe_type``) are
moved to their new place with a ``DeprecationWarning`` (an old and a new form that disagree are an
error). Python objects DeepSpeed accepts (a ``torch.dtype``, an ``mpu``, process groups, module
classes in ``injection_policy``) are accepted too, as scripts build the config in code.

What a key *means* on this machine, and whether zerospeed has built it, is decided once in
:mod:`zerospeed.inference.settings`; this module only checks shapes and values.

zerospeed adds one key, ``quant.weight.group_size``: the number of consecutive weights along a row
(the input dimension) sharing one int8 scale. DeepSpeed's ``q_groups`` counts groups over a whole
flattened matrix, so its group length differs from layer to layer; it is refused with this key as
the fix (see ``settings``).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field, PlainValidator, ValidationError, model_validator

from zerospeed.config.base import Section, aliased
from zerospeed.config.errors import ConfigError
from zerospeed.config.schema_zero import ZeroConfig
from zerospeed.config.translate import config_error
from zerospeed.config.values import (FrozenDict, check_int, fail, json_kind, show, validator, zbool, zchoice, zint,
                                     zobject, zstr)
from zerospeed.ops import int8

#: DeepSpeed's ``DtypeEnum`` spellings (matched exactly, as DeepSpeed does).
DTYPE_NAMES: Mapping[str, str] = {
    "torch.float16": "float16", "fp16": "float16", "float16": "float16", "half": "float16",
    "torch.float32": "float32", "fp32": "float32", "float32": "float32", "float": "float32",
    "torch.bfloat16": "bfloat16", "bf16": "bfloat16", "bfloat16": "bfloat16", "bfloat": "bfloat16",
    "torch.int8": "int8", "int8": "int8",
}
#: DeepSpeed's ``QuantTypeEnum`` values.
QUANT_TYPES = ("symmetric", "asymmetric")
#: DeepSpeed's ``MoETypeEnum`` values.
MOE_TYPES = ("standard", "residual")
#: zerospeed's default int8 group length (weights per scale along a row), the quantizer's own.
DEFAULT_GROUP_SIZE = int8.DEFAULT_GROUP_SIZE


def _check_dtype(value: Any) -> Any:
    """A ``torch.dtype`` among DeepSpeed's, or one of its string spellings -> ``torch.dtype``."""
    import torch

    allowed = {torch.float16, torch.float32, torch.bfloat16, torch.int8}
    if isinstance(value, torch.dtype):
        if value not in allowed:
            fail(f"{value} is not supported; expected torch.float16, torch.bfloat16, torch.float32 or torch.int8")
        return value
    if isinstance(value, str):
        if value not in DTYPE_NAMES:
            fail(f"{show(value)} is not a dtype; expected one of {', '.join(sorted(DTYPE_NAMES))} (or a torch.dtype)")
        return getattr(torch, DTYPE_NAMES[value])
    fail(f"{show(value)} is {json_kind(value)}; expected a torch.dtype or a dtype name such as \"fp16\"")


def _check_replace_method(value: Any) -> str:
    """Any string (DeepSpeed's default is ``"auto"``, which the generic string check keeps for "decide later")."""
    if not isinstance(value, str):
        fail(f"{show(value)} is {json_kind(value)}; expected a string")
    return value


def _any(value: Any) -> Any:
    return value


def _check_experts(value: Any) -> tuple[int, ...]:
    """``moe_experts``: a list of expert counts (DeepSpeed also takes a bare int in code)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (check_int(value, ge=1),)
    if not isinstance(value, (list, tuple)):
        fail(f"{show(value)} is {json_kind(value)}; expected an array of expert counts")
    return tuple(check_int(v, ge=1) for v in value)


def _check_checkpoint(value: Any) -> Any:
    """A path (string or ``os.PathLike``) or DeepSpeed's JSON checkpoint descriptor (a dict)."""
    import os

    if isinstance(value, Mapping):
        return FrozenDict(dict(value))
    if isinstance(value, (str, os.PathLike)):
        return os.fspath(value)
    fail(f"{show(value)} is {json_kind(value)}; expected a checkpoint path or DeepSpeed's checkpoint descriptor")


def _check_injection_policy(value: Any) -> tuple[tuple[type, tuple[str, ...]], ...]:
    """``{BlockClass: ("attn.out_proj", "mlp.fc2")}`` -> ``((BlockClass, names), ...)``."""
    from torch import nn

    if not isinstance(value, Mapping):
        fail(f"{show(value)} is {json_kind(value)}; expected a dict mapping a module class to the names of its "
             f"row-parallel linears, e.g. {{MyBlock: ('attn.out_proj', 'mlp.fc2')}}")
    out: list[tuple[type, tuple[str, ...]]] = []
    for block, names in value.items():
        if not (isinstance(block, type) and issubclass(block, nn.Module)):
            fail(f"key {block!r} is not an nn.Module subclass; the keys are the model's block classes "
                 f"(e.g. transformers' GPT2Block)")
        if isinstance(names, str):
            names = (names,)
        if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) and n for n in names):
            fail(f"{block.__name__}: {names!r} is not a layer name or a tuple of them; give the names, relative to "
                 f"the block, of the linears whose outputs are summed over ranks (row-parallel), e.g. "
                 f"('attn.out_proj', 'mlp.fc2'); DeepSpeed's kernel-injection policy classes are not accepted here")
        out.append((block, tuple(names)))
    return tuple(out)


_OBJECT = Annotated[Any, PlainValidator(_any)]


class InferenceTPConfig(Section):
    """``tensor_parallel`` (alias ``tp``): DeepSpeed's ``DeepSpeedTPConfig``."""

    enabled: Annotated[bool, zbool()] = True
    tp_size: Annotated[int, zint(ge=1)] = 1
    tp_grain_size: Annotated[int, zint(ge=1)] = 64
    mpu: _OBJECT = None
    tp_group: _OBJECT = None


class MoEInferenceConfig(Section):
    """``moe``: DeepSpeed's ``DeepSpeedMoEConfig`` (``true``/``false`` stand for ``{"enabled": ...}``)."""

    enabled: Annotated[bool, zbool()] = True
    ep_size: Annotated[int, zint(ge=1)] = 1
    moe_experts: Annotated[tuple[int, ...], validator(_check_experts, "an array of expert counts")] = aliased(
        "moe_experts", "num_experts", default=(1,))
    type: Annotated[str, zchoice({t: t for t in MOE_TYPES})] = "standard"
    ep_mp_group: _OBJECT = None
    ep_group: _OBJECT = aliased("ep_group", "expert_group", default=None)


class _BaseQuantConfig(Section):
    enabled: Annotated[bool, zbool()] = True
    num_bits: Annotated[int, zint(ge=1)] = 8
    q_type: Annotated[str, zchoice({t: t for t in QUANT_TYPES})] = "symmetric"
    q_groups: Annotated[int, zint(ge=1)] = 1


class WeightQuantConfig(_BaseQuantConfig):
    """``quant.weight``: DeepSpeed's keys plus zerospeed's ``group_size`` (weights per scale along a row)."""

    quantized_initialization: Annotated[FrozenDict, zobject()] = FrozenDict()
    post_init_quant: Annotated[FrozenDict, zobject()] = FrozenDict()
    group_size: Annotated[int, zint(ge=1)] = DEFAULT_GROUP_SIZE


class ActivationQuantConfig(_BaseQuantConfig):
    """``quant.activation``."""


class QKVQuantConfig(Section):
    """``quant.qkv``."""

    enabled: Annotated[bool, zbool()] = True


class QuantizationConfig(Section):
    """``quant``: DeepSpeed's ``QuantizationConfig``."""

    enabled: Annotated[bool, zbool()] = True
    activation: ActivationQuantConfig = Field(default_factory=ActivationQuantConfig)
    weight: WeightQuantConfig = Field(default_factory=WeightQuantConfig)
    qkv: QKVQuantConfig = Field(default_factory=QKVQuantConfig)


class InferenceCheckpointConfig(Section):
    """``checkpoint_config`` (alias ``ckpt_config``)."""

    checkpoint_dir: Annotated[str | None, zstr(nullable=True)] = None
    save_mp_checkpoint_path: Annotated[str | None, zstr(nullable=True)] = None
    base_dir: Annotated[str | None, zstr(nullable=True)] = None


#: Deprecated top-level keys -> (section, key) they moved to (DeepSpeed's ``new_param``).
DEPRECATED: Mapping[str, tuple[str, str]] = {
    "mp_size": ("tensor_parallel", "tp_size"), "mpu": ("tensor_parallel", "mpu"),
    "ep_size": ("moe", "ep_size"), "ep_group": ("moe", "ep_group"), "expert_group": ("moe", "ep_group"),
    "ep_mp_group": ("moe", "ep_mp_group"), "expert_mp_group": ("moe", "ep_mp_group"),
    "moe_experts": ("moe", "moe_experts"), "moe_type": ("moe", "type"),
}
_SECTION_ALIASES = {"tensor_parallel": ("tensor_parallel", "tp"), "moe": ("moe",)}


class DeepSpeedInferenceConfig(Section):
    """The inference config, under DeepSpeed's class name (``deepspeed.inference.config``).

    ``dtype`` is ``None`` when not given: DeepSpeed's default (fp16) is applied by the engine where
    the device supports fp16, and the model's own dtype is kept elsewhere (see ``settings``).
    """

    extra_keys = tuple(DEPRECATED)

    replace_with_kernel_inject: Annotated[bool, zbool()] = aliased("replace_with_kernel_inject", "kernel_inject",
                                                                   default=False)
    dtype: Annotated[Any, validator(_check_dtype, "a torch.dtype or dtype name", nullable=True)] = None
    tensor_parallel: InferenceTPConfig = aliased("tensor_parallel", "tp", default_factory=InferenceTPConfig)
    enable_cuda_graph: Annotated[bool, zbool()] = False
    use_triton: Annotated[bool, zbool()] = False
    triton_autotune: Annotated[bool, zbool()] = False
    zero: ZeroConfig = Field(default_factory=ZeroConfig)
    triangular_masking: Annotated[bool, zbool()] = aliased("triangular_masking", "tm", default=True)
    moe: MoEInferenceConfig = Field(default_factory=MoEInferenceConfig)
    keep_module_on_host: Annotated[bool, zbool()] = False
    quant: QuantizationConfig = Field(default_factory=QuantizationConfig)
    checkpoint: Annotated[Any, validator(_check_checkpoint, "a checkpoint path", nullable=True)] = None
    base_dir: Annotated[str, zstr()] = ""
    set_empty_params: Annotated[bool, zbool()] = False
    save_mp_checkpoint_path: Annotated[str | None, zstr(nullable=True)] = None
    checkpoint_config: InferenceCheckpointConfig = aliased("checkpoint_config", "ckpt_config",
                                                           default_factory=InferenceCheckpointConfig)
    return_tuple: Annotated[bool, zbool()] = True
    training_mp_size: Annotated[int, zint(ge=1)] = 1
    replace_method: Annotated[str, PlainValidator(_check_replace_method)] = "auto"
    injection_policy: Annotated[tuple[tuple[type, tuple[str, ...]], ...] | None,
                                validator(_check_injection_policy, "a dict of block class -> layer names",
                                          nullable=True)] = aliased("injection_policy", "injection_dict",
                                                                    default=None)
    injection_policy_tuple: _OBJECT = None
    config: _OBJECT = aliased("config", "args", default=None)
    max_out_tokens: Annotated[int, zint(ge=1)] = aliased("max_out_tokens", "max_tokens", default=1024)
    min_out_tokens: Annotated[int, zint(ge=1)] = aliased("min_out_tokens", "min_tokens", default=1)
    transposed_mode: Annotated[bool, zbool()] = False

    @model_validator(mode="before")
    @classmethod
    def _rewrite(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        if isinstance(data.get("moe"), bool):  # DeepSpeed's backward-compatible ``moe: true``
            data["moe"] = {"enabled": data["moe"]}
        if data.get("replace_method", "auto") != "auto":
            warnings.warn("replace_method is deprecated in DeepSpeed and has no effect; remove it from the "
                          "init_inference call", DeprecationWarning, stacklevel=4)
        _move_deprecated(data)
        return data

    @model_validator(mode="after")
    def _cross_checks(self) -> DeepSpeedInferenceConfig:
        if self.injection_policy is not None and self.replace_with_kernel_inject:
            fail("cannot be combined with replace_with_kernel_inject (DeepSpeed's rule too): an injection policy "
                 "describes a tensor-parallel split, kernel injection replaces whole layers; give one of them",
                 ("injection_policy",))
        if self.min_out_tokens > self.max_out_tokens:
            fail(f"{self.min_out_tokens} is more than max_out_tokens {self.max_out_tokens}; raise max_out_tokens",
                 ("min_out_tokens",))
        if not self.tensor_parallel.enabled and self.tensor_parallel.tp_size > 1:
            fail(f"tp_size {self.tensor_parallel.tp_size} with enabled false; set enabled true or tp_size 1",
                 ("tensor_parallel", "tp_size"))
        return self

    @property
    def tp_size(self) -> int:
        """The tensor-parallel degree asked for (1 when ``tensor_parallel.enabled`` is false)."""
        return self.tensor_parallel.tp_size if self.tensor_parallel.enabled else 1

    @property
    def mp_size(self) -> int:
        """DeepSpeed's deprecated name of ``tensor_parallel.tp_size``."""
        return self.tp_size


def _move_deprecated(data: dict[str, Any]) -> None:
    """``mp_size`` -> ``tensor_parallel.tp_size`` and the like, with a warning; a disagreeing new form is
    an error (DeepSpeed refuses the two together)."""
    for old, (section, key) in DEPRECATED.items():
        if old not in data:
            continue
        value = data.pop(old)
        spelled = [s for s in _SECTION_ALIASES[section] if s in data]
        target = data[spelled[0]] if spelled else {}
        name = spelled[0] if spelled else section
        if not isinstance(target, Mapping):
            continue  # the section's own validation reports the wrong type
        target = dict(target)
        keys = [k for k in target if k == key or (key == "moe_experts" and k == "num_experts")
                or (key == "ep_group" and k == "expert_group")]
        if keys and target[keys[0]] != value:
            fail(f"{show(value)} conflicts with {name}.{keys[0]} = {show(target[keys[0]])}; {old} is deprecated: "
                 f"remove it and keep {name}.{keys[0]}", (old,))
        warnings.warn(f"{old} is deprecated; use {section}.{key} instead", DeprecationWarning, stacklevel=5)
        if not keys:
            target[key] = value
        data[name] = target


def parse_inference_config(data: Mapping[str, Any]) -> DeepSpeedInferenceConfig:
    """Validate ``data`` into a :class:`DeepSpeedInferenceConfig`; every problem is a ``ConfigError``
    line naming the key."""
    try:
        return DeepSpeedInferenceConfig.model_validate(dict(data))
    except ValidationError as err:
        raise config_error(err, DeepSpeedInferenceConfig) from None


def merge_arguments(config: Mapping[str, Any] | str | None, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``init_inference``'s rule: the config (a dict, or a JSON/hjson file path) updated by the keyword
    arguments; a key in both with different values is an error naming it (DeepSpeed's rule)."""
    from zerospeed.config.load import read_source

    if config is None:
        data: dict[str, Any] = {}
    elif isinstance(config, (Mapping, str)):
        data = read_source(config)
    else:
        raise ConfigError(f"config: {type(config).__name__} is not accepted; expected a dict or the path of a "
                          f"JSON file (DeepSpeed's rule)")
    for key in sorted(set(data) & set(kwargs)):
        if not _same(data[key], kwargs[key]):
            raise ConfigError(f"{key}: conflicting values in config ({show(data[key])}) and the keyword argument "
                              f"({show(kwargs[key])}); give it once, or the same value in both")
    return {**data, **kwargs}


def default_inference_config() -> dict[str, Any]:
    """DeepSpeed's ``default_inference_config()``: every key at its default, under DeepSpeed's names."""
    return DeepSpeedInferenceConfig().to_dict()


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # tensors and other objects without a plain truth value
        return a is b


__all__ = ["ActivationQuantConfig", "DEFAULT_GROUP_SIZE", "DEPRECATED", "DeepSpeedInferenceConfig",
           "InferenceCheckpointConfig", "InferenceTPConfig", "MoEInferenceConfig", "QKVQuantConfig",
           "QuantizationConfig", "WeightQuantConfig", "default_inference_config", "merge_arguments",
           "parse_inference_config"]
