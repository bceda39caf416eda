"""``zero_optimization`` (with its offload sub-sections) and ``aio``.

Keys, aliases and defaults follow DeepSpeed 0.19's ``DeepSpeedZeroConfig``; the
``stage3_*`` spellings are the printed names (they are what configs in the wild use),
the short names are accepted too. The deprecated ``cpu_offload*`` booleans and
``stage3_gather_fp16_weights_on_model_save`` are rewritten into the current keys with a
``DeprecationWarning``; an old and a new form that disagree are an error.
"""

from __future__ import annotations

import pathlib
import sys
import warnings
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field, model_validator

from .base import LooseSection, Section, aliased
from .values import (
    Auto,
    FrozenDict,
    OffloadDevice,
    fail,
    fail_many,
    json_kind,
    show,
    zbool,
    zchoice,
    zenum,
    zfloat,
    zint,
    zobject,
    zpath,
)

_E9 = 1_000_000_000


class _OffloadSection(Section):
    """What both offload sections share: the device, its NVMe path, pinning and buffers."""

    device: Annotated[OffloadDevice | Auto, zenum(OffloadDevice, auto=True)] = OffloadDevice.NONE
    nvme_path: Annotated[pathlib.Path | None, zpath(nullable=True)] = None
    pin_memory: Annotated[bool, zbool()] = True  # DeepSpeed 0.19.8

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> _OffloadSection:
        if self.device == OffloadDevice.NVME and self.nvme_path is None:
            fail('required when device is "nvme"', ("nvme_path",))
        return self

    @property
    def enabled(self) -> bool:
        return self.device not in (OffloadDevice.NONE,)


class OffloadParamConfig(_OffloadSection):
    """``zero_optimization.offload_param``: where stage-3 parameters live between uses."""

    buffer_count: Annotated[int, zint(ge=0)] = 5
    buffer_size: Annotated[int, zint(ge=0)] = 100_000_000
    max_in_cpu: Annotated[int, zint(ge=0)] = _E9


class OffloadOptimizerConfig(_OffloadSection):
    """``zero_optimization.offload_optimizer``: where optimizer state lives and steps."""

    buffer_count: Annotated[int, zint(ge=0)] = 4
    pipeline_read: Annotated[bool, zbool()] = False
    pipeline_write: Annotated[bool, zbool()] = False
    fast_init: Annotated[bool, zbool()] = False
    ratio: Annotated[float, zfloat(ge=0, le=1)] = 1.0
    super_offload: Annotated[bool, zbool()] = False
    convert_grad_on_cpu: Annotated[bool, zbool()] = True
    cpuadam_cores_perc: Annotated[float, zfloat(ge=0, le=1)] = 0.8

    @property
    def pipeline(self) -> bool:
        """Overlap NVMe reads or writes with the optimizer step."""
        return self.pipeline_read or self.pipeline_write


class ZenFlowConfig(LooseSection):
    """``zero_optimization.zenflow``: accepted for compatibility, not implemented."""


class LeafModuleConfig(LooseSection):
    """``zero_optimization.leaf_module``: accepted for compatibility, not implemented."""


_DEPRECATED_OFFLOAD = ("cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory")
_DEPRECATED_GATHER = "stage3_gather_fp16_weights_on_model_save"


class ZeroConfig(Section):
    """``zero_optimization``: ZeRO stage and its buckets, prefetching and offload."""

    extra_keys = (*_DEPRECATED_OFFLOAD, _DEPRECATED_GATHER)

    stage: Annotated[int | Auto, zint(choices=(0, 1, 2, 3), auto=True)] = 0
    contiguous_gradients: Annotated[bool, zbool()] = True
    reduce_scatter: Annotated[bool, zbool()] = True
    reduce_bucket_size: Annotated[int | Auto, zint(ge=0, auto=True)] = 500_000_000
    use_multi_rank_bucket_allreduce: Annotated[bool, zbool()] = True
    allgather_partitions: Annotated[bool, zbool()] = True
    allgather_bucket_size: Annotated[int, zint(ge=0)] = 500_000_000
    #: DeepSpeed's default depends on the stage (on for stage 3); it is filled in after parsing.
    overlap_comm: Annotated[bool | None, zbool(nullable=True)] = None
    load_from_fp32_weights: Annotated[bool, zbool()] = True
    elastic_checkpoint: Annotated[bool, zbool()] = False
    offload_param: OffloadParamConfig = Field(default_factory=OffloadParamConfig)
    offload_optimizer: OffloadOptimizerConfig = Field(default_factory=OffloadOptimizerConfig)
    zenflow: ZenFlowConfig | None = None
    sub_group_size: Annotated[int, zint(ge=0)] = _E9
    prefetch_bucket_size: Annotated[int | Auto, zint(ge=0, auto=True)] = aliased(
        "stage3_prefetch_bucket_size", "prefetch_bucket_size", default=50_000_000)
    param_persistence_threshold: Annotated[int | Auto, zint(ge=0, auto=True)] = aliased(
        "stage3_param_persistence_threshold", "param_persistence_threshold", default=100_000)
    model_persistence_threshold: Annotated[int, zint(ge=0)] = aliased(
        "stage3_model_persistence_threshold", "model_persistence_threshold", default=sys.maxsize)
    max_live_parameters: Annotated[int, zint(ge=0)] = aliased(
        "stage3_max_live_parameters", "max_live_parameters", default=_E9)
    max_reuse_distance: Annotated[int, zint(ge=0)] = aliased(
        "stage3_max_reuse_distance", "max_reuse_distance", default=_E9)
    gather_16bit_weights_on_model_save: Annotated[bool | Auto, zbool(auto=True)] = aliased(
        "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
        default=False)
    module_granularity_threshold: Annotated[int, zint()] = aliased(
        "stage3_module_granularity_threshold", "module_granularity_threshold", default=0)
    use_all_reduce_for_fetch_params: Annotated[bool, zbool()] = aliased(
        "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params", default=False)
    allgather_sequential: Annotated[bool, zbool()] = aliased(
        "stage3_allgather_sequential", "allgather_sequential", default=False)
    partition_stream_chunk_size: Annotated[int, zint(ge=0)] = aliased(
        "stage3_partition_stream_chunk_size", "partition_stream_chunk_size", default=0)
    ignore_unused_parameters: Annotated[bool, zbool()] = True
    legacy_stage1: Annotated[bool, zbool()] = False
    round_robin_gradients: Annotated[bool, zbool()] = False
    zero_hpz_partition_size: Annotated[int, zint(ge=0)] = 1
    zero_quantized_weights: Annotated[bool, zbool()] = False
    zero_quantized_nontrainable_weights: Annotated[bool, zbool()] = False
    zero_quantized_gradients: Annotated[bool, zbool()] = False
    zeropp_loco_param: Annotated[FrozenDict | None, zobject(nullable=True)] = None
    mics_shard_size: Annotated[int, zint()] = -1
    mics_hierarchical_params_gather: Annotated[bool, zbool()] = False
    memory_efficient_linear: Annotated[bool, zbool()] = True
    compute_grad_norm: Annotated[bool, zbool()] = True
    parameter_alignment: Annotated[bool, zbool()] = False
    pipeline_loading_checkpoint: Annotated[bool, zbool()] = False
    override_module_apply: Annotated[bool, zbool()] = True
    log_trace_cache_warnings: Annotated[bool, zbool()] = False
    enable_sanity_checks: Annotated[bool, zbool()] = False
    save_muon_momentum_buffer_in_memory: Annotated[bool, zbool()] = False
    leaf_module: LeafModuleConfig | None = None

    # DeepSpeed's JSON names for the stage3_* fields, readable as attributes too.
    @property
    def stage3_prefetch_bucket_size(self) -> int | Auto:
        return self.prefetch_bucket_size

    @property
    def stage3_param_persistence_threshold(self) -> int | Auto:
        return self.param_persistence_threshold

    @property
    def stage3_model_persistence_threshold(self) -> int:
        return self.model_persistence_threshold

    @property
    def stage3_max_live_parameters(self) -> int:
        return self.max_live_parameters

    @property
    def stage3_max_reuse_distance(self) -> int:
        return self.max_reuse_distance

    @property
    def stage3_gather_16bit_weights_on_model_save(self) -> bool | Auto:
        return self.gather_16bit_weights_on_model_save

    @property
    def enabled(self) -> bool:
        """ZeRO is on (stage >= 1); an unresolved ``"auto"`` stage counts as on."""
        return self.stage != 0

    @model_validator(mode="before")
    @classmethod
    def _rewrite_deprecated(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        # DeepSpeed declares both offload sections Optional: null means "no offload", the defaults.
        data = {k: v for k, v in data.items()
                if not (k in ("offload_param", "offload_optimizer") and v is None)}
        _rewrite_gather(data)
        _rewrite_cpu_offload(data)
        return data

    @model_validator(mode="after")
    def _dependent_defaults_and_checks(self) -> ZeroConfig:
        if self.overlap_comm is None and not isinstance(self.stage, Auto):
            object.__setattr__(self, "overlap_comm", self.stage == 3)
        if not self.compute_grad_norm and self.stage not in (1, 2, Auto.AUTO):
            fail(f"false needs stage 1 or 2 (stage is {self.stage}); the global norm is needed "
                 f"elsewhere", ("compute_grad_norm",))
        if self.offload_optimizer.ratio < 1.0 and self.stage not in (3, Auto.AUTO):
            fail(f"{self.offload_optimizer.ratio} needs stage 3 (partial offload); "
                 f"stage is {self.stage}", ("offload_optimizer", "ratio"))
        if self.offload_param.enabled and self.stage in (0, 1, 2):
            warnings.warn(f"zero_optimization.offload_param has no effect at stage {self.stage}; "
                          "parameters are only offloaded by stage 3", UserWarning, stacklevel=2)
        return self


def _rewrite_gather(data: dict[str, Any]) -> None:
    if _DEPRECATED_GATHER not in data:
        return
    old = data.pop(_DEPRECATED_GATHER)
    if not isinstance(old, bool) and old != "auto":
        fail(f"{show(old)} is {json_kind(old)}; expected true or false", (_DEPRECATED_GATHER,))
    new_keys = [k for k in ("stage3_gather_16bit_weights_on_model_save",
                            "gather_16bit_weights_on_model_save") if k in data]
    if new_keys and data[new_keys[0]] != old:
        fail(f"{show(old)} conflicts with {new_keys[0]} = {show(data[new_keys[0]])}; "
             f"remove the deprecated {_DEPRECATED_GATHER}", (_DEPRECATED_GATHER,))
    warnings.warn(f"zero_optimization.{_DEPRECATED_GATHER} is deprecated; use "
                  "stage3_gather_16bit_weights_on_model_save", DeprecationWarning, stacklevel=4)
    if not new_keys:
        data["stage3_gather_16bit_weights_on_model_save"] = old


def _rewrite_cpu_offload(data: dict[str, Any]) -> None:
    """Map ``cpu_offload`` / ``cpu_offload_param`` / ``cpu_offload_use_pin_memory``."""
    old = {k: data.pop(k) for k in _DEPRECATED_OFFLOAD if k in data}
    if not old:
        return
    problems: list[tuple[tuple[str | int, ...], str]] = []
    for key, value in old.items():
        if not isinstance(value, bool):
            problems.append(((key,), f"{show(value)} is {json_kind(value)}; "
                                     "expected true or false"))
    if problems:
        fail_many(problems)
    replacement = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
    warnings.warn("zero_optimization." + ", zero_optimization.".join(sorted(old))
                  + (" is" if len(old) == 1 else " are") + " deprecated; use offload_optimizer / "
                  "offload_param with device and pin_memory",
                  DeprecationWarning, stacklevel=4)
    pin = old.get("cpu_offload_use_pin_memory")
    touched: list[str] = []
    for old_key, new_key in replacement.items():
        if old_key not in old:
            continue
        section = data.get(new_key)
        if section is None:
            if old[old_key]:
                data[new_key] = {"device": "cpu"}
                touched.append(new_key)
            continue
        if not isinstance(section, Mapping):
            continue  # pydantic reports the wrong type of the new form
        device = section.get("device", "none")
        if old[old_key] != (device in ("cpu", "nvme")) or (old[old_key] and device != "cpu"):
            problems.append(((old_key,), f"{show(old[old_key])} conflicts with zero_optimization."
                             f"{new_key}.device = {show(device)}; remove the deprecated {old_key}"))
        elif old[old_key]:
            touched.append(new_key)
    if pin is not None:
        for new_key in ("offload_optimizer", "offload_param"):
            section = data.get(new_key)
            if not isinstance(section, Mapping) or section.get("device", "none") == "none":
                continue
            if "pin_memory" in section and section["pin_memory"] != pin:
                problems.append((("cpu_offload_use_pin_memory",), f"{show(pin)} conflicts with "
                                 f"zero_optimization.{new_key}.pin_memory = "
                                 f"{show(section['pin_memory'])}; "
                                 "remove the deprecated cpu_offload_use_pin_memory"))
            else:
                data[new_key] = {**section, "pin_memory": pin}
    if problems:
        fail_many(problems)


class AioConfig(Section):
    """``aio``: asynchronous file I/O used by NVMe offload."""

    block_size: Annotated[int, zint(ge=1)] = 1_048_576
    queue_depth: Annotated[int, zint(ge=1)] = 8
    intra_op_parallelism: Annotated[int, zint(ge=1)] = aliased(
        "intra_op_parallelism", "thread_count", default=1)
    single_submit: Annotated[bool, zbool()] = False
    overlap_events: Annotated[bool, zbool()] = True
    use_gds: Annotated[bool, zbool()] = False
    io_backend: Annotated[str | None, zchoice(
        {"async_io": "async_io", "aio": "async_io", "async": "async_io", "deepnvme": "async_io",
         "posix": "posix", "sync": "posix", "simple": "posix"}, ("async_io", "posix"),
        case="lower", nullable=True)] = None

    @property
    def thread_count(self) -> int:
        """Older name of :attr:`intra_op_parallelism`."""
        return self.intra_op_parallelism
