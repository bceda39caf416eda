"""``tensor_parallel``: AutoTP training, with DeepSpeed 0.19.8's keys (``TPTrainingConfig``).

``partition_config`` is typed key by key (DeepSpeed keeps it a free dict and reads it later with
``AutoTPConfig.from_dict``, so a typo'd key is silently ignored there): a misspelled key inside a
layer spec, an unknown ``partition_type`` or a pattern that is not a regular expression is reported
when the config is loaded, not when the model is split. Python objects DeepSpeed accepts here
(``mpu``, ``tp_group``, a ``torch.dtype``) are accepted too, as a script builds the dict in code.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import Field, PlainValidator, model_validator

from .base import Section, aliased
from .values import DType, DTYPE_SPELLINGS, check_int, check_str_list, fail, json_kind, show, validator, zbool, \
    zchoice, zint, zstr, zstrlist

#: DeepSpeed's ``PartitionType`` values.
PARTITION_TYPES = ("column", "row", "skip")
#: DeepSpeed's ``AutoTPPresets.get_preset`` names.
PRESET_MODELS = ("llama", "bloom", "chatglm", "mixtral", "deepseek_v2", "qwen2", "phi3")


def _check_patterns(value: Any) -> tuple[str, ...]:
    """Strings that compile as regular expressions (DeepSpeed matches them with ``re.match``)."""
    patterns = check_str_list(value)
    for i, pattern in enumerate(patterns):
        try:
            re.compile(pattern)
        except re.error as exc:
            fail(f"{show(pattern)} is not a regular expression ({exc})", (i,))
    return patterns


def _check_shape(value: Any) -> tuple[int | tuple[int, ...], ...]:
    """DeepSpeed's ``TPLayerSpec.shape``: ints (positive, or -1 to infer) with at most one nested
    list of positive sub-parameter sizes."""
    if not isinstance(value, (list, tuple)) or not value:
        fail(f"{show(value)} is {json_kind(value)}; expected a non-empty array such as [3, -1]")
    out: list[int | tuple[int, ...]] = []
    nested = 0
    for i, dim in enumerate(value):
        if isinstance(dim, (list, tuple)):
            nested += 1
            if nested > 1 or not dim:
                fail("only one non-empty nested array (the unequal sub-parameter sizes) is allowed", (i,))
            out.append(tuple(check_int(v, ge=1) for v in dim))
        else:
            size = check_int(dim, ge=-1)
            if size == 0:
                fail("0 is not a size; use a positive integer or -1 (inferred)", (i,))
            out.append(size)
    return tuple(out)


def _check_tp_dtype(value: Any) -> DType:
    """A DeepSpeed dtype spelling, or a ``torch.dtype`` (``str(torch.float16)`` is a known spelling)."""
    key = (value if isinstance(value, str) else str(value)).lower()
    if key not in DTYPE_SPELLINGS:
        fail(f"{show(value)} is not a dtype; expected one of fp32, fp16, bf16 (or a torch.dtype)")
    return DTYPE_SPELLINGS[key]


def _any(value: Any) -> Any:
    return value


class TPLayerSpecConfig(Section):
    """One ``partition_config.layer_specs`` entry (DeepSpeed's ``TPLayerSpec``)."""

    patterns: Annotated[tuple[str, ...], validator(_check_patterns, "an array of regular expressions")] = ()
    partition_type: Annotated[str, zchoice({t: t for t in PARTITION_TYPES}, case="lower")] = "column"
    shape: Annotated[tuple[int | tuple[int, ...], ...] | None,
                     validator(_check_shape, "an array of sizes", nullable=True)] = None
    partition_dim: Annotated[int | None, zint(ge=0, nullable=True)] = None
    model_types: Annotated[tuple[str, ...] | None, zstrlist(nullable=True)] = None
    gather_output: Annotated[bool, zbool()] = False
    grad_allreduce: Annotated[bool, zbool()] = False

    @model_validator(mode="after")
    def _check_partition_dim(self) -> "TPLayerSpecConfig":
        if not self.patterns:
            fail("a layer spec needs at least one pattern (a regular expression on parameter names)", ("patterns",))
        if self.shape is not None:
            dim = self.effective_partition_dim
            if dim >= len(self.shape):
                fail(f"{dim} is outside shape {list(self.shape)}", ("partition_dim",))
            nested = [i for i, d in enumerate(self.shape) if isinstance(d, tuple)]
            if nested and nested != [dim]:
                fail(f"a nested size list is only allowed at partition_dim {dim}", ("shape",))
        return self

    @property
    def effective_partition_dim(self) -> int:
        """DeepSpeed's default: 0 for column (weight rows), 1 for row (weight columns)."""
        if self.partition_dim is not None:
            return self.partition_dim
        return 0 if self.partition_type == "column" else 1


class AutoTPPartitionConfig(Section):
    """``partition_config`` (DeepSpeed's ``AutoTPConfig.from_dict`` keys)."""

    use_default_specs: Annotated[bool, zbool()] = True
    layer_specs: tuple[TPLayerSpecConfig, ...] = ()
    strict_mode: Annotated[bool, zbool()] = False
    lm_head_patterns: Annotated[tuple[str, ...], zstrlist()] = ("lm_head", "embed_out")
    embedding_partition_dim: Annotated[int, zint(ge=0)] = 1
    tp_size: Annotated[int, zint(ge=1)] = 1


class TPGroupConfig(Section):
    """``tensor_parallel.tensor_parallel`` (alias ``tp``): DeepSpeed's ``TPConfig``."""

    tp_size: Annotated[int, zint(ge=1)] = 1
    tp_grain_size: Annotated[int, zint(ge=1)] = 1
    mpu: Annotated[Any, PlainValidator(_any)] = None
    tp_group: Annotated[Any, PlainValidator(_any)] = None


class TensorParallelConfig(Section):
    """``tensor_parallel``: AutoTP training (``autotp_size`` 0 = off)."""

    dtype: Annotated[DType, validator(_check_tp_dtype, "fp32, fp16 or bf16")] = DType.FP16
    autotp_size: Annotated[int, zint(ge=0)] = 0
    tp_overlap_comm: Annotated[bool, zbool()] = False
    vocab_parallel_lm_head: Annotated[bool | None, zbool(nullable=True)] = None
    vocab_parallel_ce_backend: Annotated[str, zchoice({"torch": "torch", "liger": "liger"}, case="lower")] = "torch"
    tensor_parallel: TPGroupConfig = aliased("tensor_parallel", "tp", default_factory=TPGroupConfig)
    injection_policy_tuple: Annotated[Any, PlainValidator(_any)] = None
    partition_config: AutoTPPartitionConfig | None = None
    preset_model: Annotated[str | None, zchoice({p: p for p in PRESET_MODELS}, case="lower", nullable=True)] = None
    keep_module_on_host: Annotated[bool, zbool()] = False
    replace_with_kernel_inject: Annotated[bool, zbool()] = aliased("replace_with_kernel_inject", "kernel_inject",
                                                                   default=False)

    @model_validator(mode="after")
    def _check_sizes(self) -> "TensorParallelConfig":
        group_size = self.tensor_parallel.tp_size
        if self.autotp_size > 0 and group_size not in (1, self.autotp_size):
            fail(f"{group_size} does not match autotp_size {self.autotp_size}; give the same size or leave "
                 f"tensor_parallel.tp_size out", ("tensor_parallel", "tp_size"))
        return self


__all__ = ["AutoTPPartitionConfig", "PARTITION_TYPES", "PRESET_MODELS", "TPGroupConfig", "TPLayerSpecConfig",
           "TensorParallelConfig"]
