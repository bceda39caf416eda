"""DeepSpeed 0.19.8's config getters of ``DeepSpeedEngine`` (``engine.fp16_enabled()``,
``engine.zero_optimization_stage()``...), answered from the engine's resolved config.

Part of :class:`zerospeed.engine_api.DeepSpeedEngineAPI`; kept apart so each module stays
readable. Return values are DeepSpeed's (a bool where it returns a bool, the config section where
it returns the section); a getter says so where zerospeed's answer differs on purpose.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zerospeed.config.policies import resolved
from zerospeed.config.values import OffloadDevice

if TYPE_CHECKING:
    from zerospeed.config import Config
    from zerospeed.config.schema_features import TensorParallelConfig
    from zerospeed.config.schema_zero import OffloadOptimizerConfig, OffloadParamConfig, ZenFlowConfig
    from zerospeed.precision.policy import MixedPrecisionPolicy


class DeepSpeedConfigGetters:
    """The engine's config, through DeepSpeed's getter methods; holds no state of its own."""

    if TYPE_CHECKING:  # provided by Engine
        config: Config
        policy: MixedPrecisionPolicy
        optimizer: torch.optim.Optimizer | None

    # -- precision -------------------------------------------------------------------------------
    def fp16_enabled(self) -> bool:
        return bool(resolved(self.config.fp16.enabled, "fp16.enabled"))

    def bfloat16_enabled(self) -> bool:
        return bool(resolved(self.config.bf16.enabled, "bf16.enabled"))

    def fp16_auto_cast(self) -> bool:
        return self.config.fp16.auto_cast

    def fp16_master_weights_and_gradients(self) -> bool:
        return self.config.fp16.fp16_master_weights_and_grads

    def bf16_master_weights_and_gradients(self) -> bool:
        return self.config.bf16.bf16_master_weights_and_grads

    def bf16_optimizer_states(self) -> bool:
        return self.config.bf16.bf16_optimizer_states

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """``(model dtype, gradient accumulation dtype)`` as this engine uses them. The second is fp32
        unless ``data_types.grad_accum_dtype`` is set (DeepSpeed names the model dtype there)."""
        return self.policy.param_dtype, self.policy.grad_accum_dtype

    def loss_scale(self) -> float:
        """The config's ``fp16.loss_scale`` (0 means dynamic); the live scale is ``engine.cur_scale``."""
        return self.config.fp16.loss_scale

    def dynamic_loss_scale(self) -> bool:
        return self.config.fp16.loss_scale == 0

    def initial_dynamic_scale(self) -> float:
        return float(2 ** self.config.fp16.initial_scale_power)

    def dynamic_loss_scale_args(self) -> dict[str, Any]:
        """DeepSpeed's dynamic loss scaler arguments, under its key names."""
        fp16 = self.config.fp16
        return {"init_scale": 2 ** fp16.initial_scale_power, "scale_window": fp16.loss_scale_window,
                "delayed_shift": fp16.hysteresis, "consecutive_hysteresis": fp16.consecutive_hysteresis,
                "min_scale": fp16.min_loss_scale}

    def torch_autocast_enabled(self) -> bool:
        return self.config.torch_autocast.enabled

    def torch_autocast_dtype(self) -> torch.dtype | None:
        dtype = self.config.torch_autocast.dtype
        return None if dtype is None else dtype.torch_dtype

    def torch_autocast_lower_precision_safe_modules(self) -> list[str]:
        """The configured module class names, else DeepSpeed's default list (Linear and Conv layers)."""
        names = self.config.torch_autocast.lower_precision_safe_modules
        if names is not None:
            return list(names)
        return [f"{cls.__module__}.{cls.__name__}" for cls in (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)]

    def postscale_gradients(self) -> bool:
        return not self.config.prescale_gradients

    def gradient_predivide_factor(self) -> float:
        return self.config.gradient_predivide_factor

    # -- optimizer / scheduler --------------------------------------------------------------------
    def optimizer_name(self) -> str | None:
        """The optimizer passed to ``initialize`` (its class name), else the config's type, lowercased
        for DeepSpeed's own optimizers as DeepSpeed does."""
        section = self.config.optimizer
        if section is None:
            return type(self.optimizer).__name__ if self.optimizer is not None else None
        return section.type.lower() if section.is_deepspeed_type else section.type

    def optimizer_params(self) -> dict[str, Any] | None:
        section = self.config.optimizer
        return None if section is None else section.to_dict().get("params", {})

    def optimizer_legacy_fusion(self) -> bool:
        return self.config.optimizer.legacy_fusion if self.config.optimizer is not None else False

    def scheduler_name(self) -> str | None:
        return None if self.config.scheduler is None else self.config.scheduler.type

    def scheduler_params(self) -> dict[str, Any] | None:
        section = self.config.scheduler
        return None if section is None else section.to_dict().get("params", {})

    def get_type(self) -> list[Any]:
        """Each param group's ``type`` entry (0.0 where absent), as DeepSpeed reads it."""
        if self.optimizer is None:
            return []
        return [group.get("type", 0.0) for group in self.optimizer.param_groups]

    # -- ZeRO ------------------------------------------------------------------------------------
    def zero_optimization_stage(self) -> int:
        return int(resolved(self.config.zero_optimization.stage, "zero_optimization.stage"))

    def zero_optimization(self) -> bool:
        """Whether ZeRO is on (stage > 0)."""
        return self.zero_optimization_stage() > 0

    def zero_optimization_partition_gradients(self) -> bool:
        """True at ZeRO stages 2 and 3 (gradients are partitioned)."""
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        """True at ZeRO stage 3 (parameters are partitioned)."""
        return self.zero_optimization_stage() >= 3

    def is_first_weights_partition_group(self) -> bool:
        """True at ZeRO stage 3 (as DeepSpeed: the weights are partitioned)."""
        return self.zero_optimization_partition_weights()

    def zero_offload_optimizer(self) -> OffloadOptimizerConfig | None:
        """The ``offload_optimizer`` section when it offloads (``.device``, ``.nvme_path``...), else None."""
        section = self.config.zero_optimization.offload_optimizer
        return section if section.device != OffloadDevice.NONE else None

    def zero_offload_param(self) -> OffloadParamConfig | None:
        """The ``offload_param`` section when it offloads, else None."""
        section = self.config.zero_optimization.offload_param
        return section if section.device != OffloadDevice.NONE else None

    def zero_use_cpu_optimizer(self) -> bool:
        return self.config.zero_optimization.offload_optimizer.device in (OffloadDevice.CPU, OffloadDevice.NVME)

    def zero_cpu_offload(self) -> bool:
        return self.config.zero_optimization.offload_optimizer.device == OffloadDevice.CPU

    def zero_nvme_offload_optimizer(self) -> bool:
        """Whether optimizer states are swapped to NVMe (needs ZeRO: stage 0 has no shard to swap)."""
        return (self.zero_optimization()
                and self.config.zero_optimization.offload_optimizer.device == OffloadDevice.NVME)

    def zero_partial_offload(self) -> float:
        return self.config.zero_optimization.offload_optimizer.ratio

    def super_offload(self) -> bool:
        return self.config.zero_optimization.offload_optimizer.super_offload

    def cpuadam_cores_perc(self) -> float:
        return self.config.zero_optimization.offload_optimizer.cpuadam_cores_perc

    def zero_overlap_comm(self) -> bool:
        """The config's ``overlap_comm``; unset means stage 3 only, as DeepSpeed resolves it."""
        value = self.config.zero_optimization.overlap_comm
        return value if value is not None else self.zero_optimization_stage() == 3

    def zero_reduce_bucket_size(self) -> int:
        return int(resolved(self.config.zero_optimization.reduce_bucket_size, "zero_optimization.reduce_bucket_size"))

    def zero_prefetch_bucket_size(self) -> int:
        return int(resolved(self.config.zero_optimization.prefetch_bucket_size,
                            "zero_optimization.stage3_prefetch_bucket_size"))

    def zero_param_persistence_threshold(self) -> int:
        return int(resolved(self.config.zero_optimization.param_persistence_threshold,
                            "zero_optimization.stage3_param_persistence_threshold"))

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return bool(resolved(self.config.zero_optimization.gather_16bit_weights_on_model_save,
                             "zero_optimization.stage3_gather_16bit_weights_on_model_save"))

    # plain zero_optimization keys, under DeepSpeed's getter names
    def zero_allgather_bucket_size(self) -> int:
        return self.config.zero_optimization.allgather_bucket_size

    def zero_allgather_partitions(self) -> bool:
        return self.config.zero_optimization.allgather_partitions

    def zero_allgather_sequential(self) -> bool:
        return self.config.zero_optimization.allgather_sequential

    def zero_compute_grad_norm(self) -> bool:
        return self.config.zero_optimization.compute_grad_norm

    def zero_contiguous_gradients(self) -> bool:
        return self.config.zero_optimization.contiguous_gradients

    def zero_elastic_checkpoint(self) -> bool:
        return self.config.zero_optimization.elastic_checkpoint

    def zero_hpz_partition_size(self) -> int:
        return self.config.zero_optimization.zero_hpz_partition_size

    def zero_ignore_unused_parameters(self) -> bool:
        return self.config.zero_optimization.ignore_unused_parameters

    def zero_legacy_stage1(self) -> bool:
        return self.config.zero_optimization.legacy_stage1

    def zero_load_from_fp32_weights(self) -> bool:
        return self.config.zero_optimization.load_from_fp32_weights

    def zero_log_trace_cache_warnings(self) -> bool:
        return self.config.zero_optimization.log_trace_cache_warnings

    def zero_max_live_parameters(self) -> int:
        return self.config.zero_optimization.max_live_parameters

    def zero_max_reuse_distance(self) -> int:
        return self.config.zero_optimization.max_reuse_distance

    def zero_model_persistence_threshold(self) -> int:
        return self.config.zero_optimization.model_persistence_threshold

    def zero_module_granularity_threshold(self) -> int:
        return self.config.zero_optimization.module_granularity_threshold

    def zero_multi_rank_bucket_allreduce(self) -> bool:
        return self.config.zero_optimization.use_multi_rank_bucket_allreduce

    def zero_parameter_alignment(self) -> bool:
        return self.config.zero_optimization.parameter_alignment

    def zero_quantized_gradients(self) -> bool:
        return self.config.zero_optimization.zero_quantized_gradients

    def zero_quantized_nontrainable_weights(self) -> bool:
        return self.config.zero_optimization.zero_quantized_nontrainable_weights

    def zero_quantized_weights(self) -> bool:
        return self.config.zero_optimization.zero_quantized_weights

    def zero_reduce_scatter(self) -> bool:
        return self.config.zero_optimization.reduce_scatter

    def zero_round_robin_gradients(self) -> bool:
        return self.config.zero_optimization.round_robin_gradients

    def zero_save_muon_momentum_buffer_in_memory(self) -> bool:
        return self.config.zero_optimization.save_muon_momentum_buffer_in_memory

    def zero_sub_group_size(self) -> int:
        return self.config.zero_optimization.sub_group_size

    def zenflow_config(self) -> ZenFlowConfig | None:
        return self.config.zero_optimization.zenflow

    def is_sanity_checks_enabled(self) -> bool:
        return self.config.zero_optimization.enable_sanity_checks

    def zero_allow_untested_optimizer(self) -> bool:
        return self.config.zero_allow_untested_optimizer

    def zero_force_ds_cpu_optimizer(self) -> bool:
        return self.config.zero_force_ds_cpu_optimizer

    # -- other config sections --------------------------------------------------------------------
    def aio_config(self) -> dict[str, Any]:
        """The ``aio`` section as a dict under DeepSpeed's key names (what DeepSpeed returns)."""
        return self.config.aio.to_dict()

    def tensor_parallel_config(self) -> TensorParallelConfig:
        return self.config.tensor_parallel

    def autotp_size(self) -> int:
        return self.config.tensor_parallel.autotp_size

    def checkpoint_serialization_enabled(self) -> bool:
        return self.config.checkpoint.checkpoint_serialization

    def checkpoint_writer_enabled(self) -> bool:
        return self.config.checkpoint.writer is not None

    def checkpoint_tag_validation_enabled(self) -> bool:
        return self.config.checkpoint.tag_validation != "IGNORE"

    def checkpoint_tag_validation_fail(self) -> bool:
        return self.config.checkpoint.tag_validation == "FAIL"

    def load_universal_checkpoint(self) -> bool:
        """The config's ``checkpoint.load_universal`` (zerospeed loads any world size and stage anyway)."""
        return self.config.checkpoint.load_universal

    def use_node_local_storage(self) -> bool:
        return self.config.checkpoint.use_node_local_storage

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def dump_state(self) -> bool:
        return self.config.dump_state

    def log_level(self) -> str | None:
        return self.config.log_level

    def flops_profiler_enabled(self) -> bool:
        return self.config.flops_profiler.enabled or self.autotuning_enabled()

    def flops_profiler_recompute_fwd_factor(self) -> float:
        return self.config.flops_profiler.recompute_fwd_factor

    def flops_profiler_profile_step(self) -> int:
        return self.config.flops_profiler.profile_step

    def flops_profiler_module_depth(self) -> int:
        return self.config.flops_profiler.module_depth

    def flops_profiler_top_modules(self) -> int:
        return self.config.flops_profiler.top_modules

    def flops_profiler_detailed(self) -> bool:
        return self.config.flops_profiler.detailed

    def flops_profiler_output_file(self) -> str | None:
        return self.config.flops_profiler.output_file

    def autotuning_enabled(self) -> bool:
        return self.config.autotuning.enabled

    def is_deepcompile_enabled(self) -> bool:
        return self.config.compile.deepcompile

    def is_deepcompile_active(self) -> bool:
        """False: DeepCompile is not part of zerospeed."""
        return False

    def _compile_passes(self) -> list[str]:
        passes = self.config.compile.to_dict().get("passes") or []
        return [str(p) for p in passes]

    def compile_zero_optimization_stage(self) -> bool:
        """Whether ``compile.passes`` names DeepCompile's ``z1``/``z3`` passes."""
        return "z1" in self._compile_passes() or "z3" in self._compile_passes()

    def compile_autosp(self) -> bool:
        """False unless the config's ``compile.passes`` names ``autosp`` (DeepCompile is refused)."""
        return "autosp" in self._compile_passes()

    def compile_autotp(self) -> bool:
        """False unless the config's ``compile.passes`` names ``autotp`` (DeepCompile is refused)."""
        return "autotp" in self._compile_passes()

    def uses_parallelization_pass_only(self) -> bool:
        """``compile_autosp() or compile_autotp()``, as DeepSpeed."""
        return self.compile_autosp() or self.compile_autotp()

    def data_efficiency_enabled(self) -> bool:
        return self.config.data_efficiency.enabled

    def data_efficiency_config(self) -> dict[str, Any]:
        return self.config.data_efficiency.to_dict()

    def data_sampling_config(self) -> dict[str, Any]:
        """``data_efficiency.data_sampling`` as a dict ({} when absent)."""
        return dict(self.data_efficiency_config().get("data_sampling") or {})

    def data_sampling_enabled(self) -> bool:
        """``data_efficiency.data_sampling.enabled`` (False when absent)."""
        return bool(self.data_sampling_config().get("enabled", False))

    def curriculum_learning_config(self) -> dict[str, Any]:
        """``data_efficiency.data_sampling.curriculum_learning`` as a dict ({} when absent)."""
        return dict(self.data_sampling_config().get("curriculum_learning") or {})

    def curriculum_learning_enabled(self) -> bool:
        """``data_efficiency.data_sampling.curriculum_learning.enabled`` (False when absent)."""
        return bool(self.curriculum_learning_config().get("enabled", False))

    def random_ltd_config(self) -> dict[str, Any]:
        """``data_efficiency.data_routing.random_ltd`` as a dict ({} when absent)."""
        routing = self.data_efficiency_config().get("data_routing") or {}
        return dict(routing.get("random_ltd") or {})

    def random_ltd_enabled(self) -> bool:
        """``data_efficiency.data_routing.random_ltd.enabled`` (False when absent)."""
        return bool(self.random_ltd_config().get("enabled", False))

    # -- progressive layer drop (DeepSpeed 0.19.6's getters; 0.19.8 removed the feature) ----------------
    def pld_enabled(self) -> bool:
        return self.config.progressive_layer_drop.enabled

    def pld_params(self) -> dict[str, float] | bool:
        """``progressive_layer_drop`` without ``enabled`` (defaults filled in), or False when the config has
        no such section, as DeepSpeed 0.19.6."""
        if "progressive_layer_drop" not in self.config.model_fields_set:
            return False
        section = self.config.progressive_layer_drop
        return {"theta": section.theta, "gamma": section.gamma}

    def pld_theta(self) -> float:
        """The config's ``progressive_layer_drop.theta`` (theta(t)'s limit); the live value is ``get_pld_theta()``."""
        return self.config.progressive_layer_drop.theta

    def pld_gamma(self) -> float:
        return self.config.progressive_layer_drop.gamma


__all__ = ["DeepSpeedConfigGetters"]
