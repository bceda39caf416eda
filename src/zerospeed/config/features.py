"""Which features a config asks for, so the engine can refuse what it does not implement.

The whole DeepSpeed schema is parsed now, but features land over time; a config that asks
for one not yet implemented must fail loudly, never be silently ignored. A feature is
named by its key path (``"pipeline"``, ``"fp16"``, ``"flops_profiler"``); settings with
several values carry the value (``"zero_optimization.stage=3"``,
``"zero_optimization.offload_optimizer.device=nvme"``, ``"optimizer.type=Lamb"``).
Only non-default requests are listed. An unresolved ``"auto"`` counts as a request (its
value shows as ``auto``), so call :meth:`Config.require_resolved` first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .schema_root import ConfigSections as Config
from .values import AUTO, Auto, OffloadDevice


def _on(flag: bool | Auto) -> bool:
    return flag is True or flag is AUTO


def _value(value: Any) -> str:
    return "auto" if value is AUTO else str(getattr(value, "value", value))


def _flags(prefix: str, section: Any, names: Iterable[str]) -> list[str]:
    """``prefix.name`` for each boolean ``name`` switched on (top level when no prefix)."""
    return [f"{prefix}.{n}" if prefix else n for n in names if getattr(section, n) is True]


def _zero_features(cfg: Config) -> list[str]:
    """ZeRO requests; knobs DeepSpeed only reads at some stages are listed only there."""
    zero = cfg.zero_optimization
    stage3 = zero.stage in (3, AUTO)
    stage12 = zero.stage in (1, 2, AUTO)
    out: list[str] = []
    if zero.stage != 0:
        out.append(f"zero_optimization.stage={_value(zero.stage)}")
    opt, par = zero.offload_optimizer, zero.offload_param
    if opt.device != OffloadDevice.NONE:
        out.append(f"zero_optimization.offload_optimizer.device={_value(opt.device)}")
        # the pipelining and fast-init knobs only concern NVMe (DeepSpeed ignores them for the CPU)
        nvme_only = ("pipeline_read", "pipeline_write", "fast_init") if opt.device == OffloadDevice.NVME else ()
        out += _flags("zero_optimization.offload_optimizer", opt, nvme_only + ("super_offload",))
        if opt.ratio < 1.0:
            out.append("zero_optimization.offload_optimizer.ratio")
    if par.device != OffloadDevice.NONE and stage3:
        out.append(f"zero_optimization.offload_param.device={_value(par.device)}")
    if stage12:
        out += _flags("zero_optimization", zero, ("round_robin_gradients",))
    if stage3:
        out += _flags("zero_optimization", zero, (
            "zero_quantized_weights", "zero_quantized_nontrainable_weights",
            "zero_quantized_gradients", "mics_hierarchical_params_gather",
            "use_all_reduce_for_fetch_params", "allgather_sequential",
            "pipeline_loading_checkpoint"))
        if zero.zero_hpz_partition_size > 1:
            out.append("zero_optimization.zero_hpz_partition_size")
        if zero.mics_shard_size > 0:
            out.append("zero_optimization.mics_shard_size")
        if zero.partition_stream_chunk_size > 0:
            out.append("zero_optimization.stage3_partition_stream_chunk_size")
        if zero.gather_16bit_weights_on_model_save is not False:
            out.append("zero_optimization.stage3_gather_16bit_weights_on_model_save")
    out += _flags("zero_optimization", zero, ("elastic_checkpoint", "legacy_stage1", "parameter_alignment"))
    if not zero.compute_grad_norm:
        out.append("zero_optimization.compute_grad_norm")
    for name in ("zenflow", "zeropp_loco_param", "leaf_module"):
        if getattr(zero, name) is not None:
            out.append(f"zero_optimization.{name}")
    return out


def _precision_features(cfg: Config) -> list[str]:
    out: list[str] = []
    if _on(cfg.fp16.enabled):
        out.append("fp16")
        out += _flags("fp16", cfg.fp16, ("auto_cast", "fp16_master_weights_and_grads"))
    if _on(cfg.bf16.enabled):
        out.append("bf16")
        out += _flags("bf16", cfg.bf16, ("immediate_grad_update", "check_grad_overflow",
                                         "bf16_master_weights_and_grads",
                                         "bf16_optimizer_states"))
    if _on(cfg.amp.enabled):
        out.append("amp")
    if cfg.torch_autocast.enabled:
        out.append("torch_autocast")
    for name in ("grad_accum_dtype", "param_dtype", "buffer_dtype"):
        if getattr(cfg.data_types, name) is not None:
            out.append(f"data_types.{name}")
    return out


def _training_features(cfg: Config) -> list[str]:
    out: list[str] = []
    if cfg.optimizer is not None:
        out.append(f"optimizer.type={cfg.optimizer.type}")
        if cfg.optimizer.legacy_fusion:
            out.append("optimizer.legacy_fusion")
    if cfg.scheduler is not None:
        out.append(f"scheduler.type={cfg.scheduler.type}")
    if cfg.gradient_clipping is AUTO or cfg.gradient_clipping > 0:
        out.append("gradient_clipping")
    if not cfg.managed_gradient_accumulation:
        out.append("managed_gradient_accumulation")
    if cfg.communication_data_type is not None:
        out.append(f"communication_data_type={_value(cfg.communication_data_type)}")
    if cfg.seq_parallel_communication_data_type != "fp32":
        out.append("seq_parallel_communication_data_type="
                   f"{_value(cfg.seq_parallel_communication_data_type)}")
    if cfg.gradient_predivide_factor != 1.0:
        out.append("gradient_predivide_factor")
    if cfg.gradient_allreduce_op != "mean":
        out.append(f"gradient_allreduce_op={cfg.gradient_allreduce_op}")
    out += _flags("", cfg, ("prescale_gradients", "disable_allgather", "sparse_gradients",
                            "graph_harvesting", "dataloader_drop_last",
                            "use_data_before_expert_parallelism", "disable_python_gc"))
    return out


def _parallel_features(cfg: Config) -> list[str]:
    out: list[str] = []
    if cfg.pipeline is not None:
        out.append("pipeline")
    out += _tensor_parallel_features(cfg)
    if cfg.expert_parallel is not None:
        out.append("expert_parallel")
    if cfg.sequence_parallel_size is not None and cfg.sequence_parallel_size > 1:
        out.append("sequence_parallel_size")
    out += _flags("activation_checkpointing", cfg.activation_checkpointing, (
        "partition_activations", "contiguous_memory_optimization", "cpu_checkpointing",
        "synchronize_checkpoint_boundary", "profile"))
    if cfg.aio.use_gds:
        out.append("aio.use_gds")
    return out


def _tensor_parallel_features(cfg: Config) -> list[str]:
    """AutoTP itself is ``tensor_parallel``; each option beyond plain splitting is named on its own."""
    tp = cfg.tensor_parallel
    out: list[str] = []
    if tp.autotp_size > 0:
        out.append("tensor_parallel")
    out += _flags("tensor_parallel", tp, ("tp_overlap_comm", "keep_module_on_host", "replace_with_kernel_inject"))
    if tp.vocab_parallel_lm_head is not None:
        out.append(f"tensor_parallel.vocab_parallel_lm_head={tp.vocab_parallel_lm_head}")
    if tp.vocab_parallel_ce_backend != "torch":
        out.append(f"tensor_parallel.vocab_parallel_ce_backend={tp.vocab_parallel_ce_backend}")
    if tp.injection_policy_tuple is not None:
        out.append("tensor_parallel.injection_policy_tuple")
    if tp.partition_config is not None:
        out.append("tensor_parallel.partition_config")
    if tp.preset_model is not None:
        out.append(f"tensor_parallel.preset_model={tp.preset_model}")
    group = tp.tensor_parallel
    if group.tp_grain_size > 1:
        out.append("tensor_parallel.tensor_parallel.tp_grain_size")
    for name in ("mpu", "tp_group"):
        if getattr(group, name) is not None:
            out.append(f"tensor_parallel.tensor_parallel.{name}")
    return out


def _monitoring_features(cfg: Config) -> list[str]:
    out = [name for name in ("flops_profiler", "tensorboard", "csv_monitor", "wandb", "comet",
                             "trackio", "comms_logger") if getattr(cfg, name).enabled]
    out += _flags("", cfg, ("wall_clock_breakdown", "memory_breakdown", "dump_state"))
    if not cfg.timers.throughput.enabled:
        out.append("timers.throughput")
    return out


def _checkpoint_features(cfg: Config) -> list[str]:
    ckpt = cfg.checkpoint
    out = _flags("checkpoint", ckpt, ("load_universal", "use_node_local_storage"))
    if ckpt.parallel_write.pipeline_stage:
        out.append("checkpoint.parallel_write.pipeline_stage")
    if ckpt.writer is not None:
        out.append("checkpoint.writer")
    if ckpt.tag_validation != "WARN":
        out.append(f"checkpoint.tag_validation={ckpt.tag_validation}")
    return out


def _other_features(cfg: Config) -> list[str]:
    out = [name for name in ("progressive_layer_drop", "eigenvalue", "elasticity", "autotuning",
                             "hybrid_engine", "nebula", "datastates", "data_efficiency")
           if getattr(cfg, name).enabled]
    for name in ("curriculum_learning", "quantize_training"):
        section = getattr(cfg, name)
        if section is not None and section.enabled:
            out.append(name)
    for name in ("compression_training", "weight_quantization", "sparse_attention"):
        if getattr(cfg, name) is not None:
            out.append(name)
    if cfg.compile.enabled or cfg.compile.deepcompile:
        out.append("compile")
    return out


_GROUPS: tuple[Callable[[Config], list[str]], ...] = (
    _precision_features, _zero_features, _training_features, _parallel_features,
    _monitoring_features, _checkpoint_features, _other_features,
)


def features_in_use(cfg: Config) -> tuple[str, ...]:
    """Every non-default feature ``cfg`` requests, as key paths (see module docstring)."""
    out: list[str] = []
    for group in _GROUPS:
        out += [f for f in group(cfg) if f not in out]
    return tuple(out)


def _implemented(feature: str, implemented: frozenset[str] | set[str]) -> bool:
    if feature in implemented:
        return True
    key, sep, _ = feature.partition("=")
    return bool(sep) and f"{key}=*" in implemented


def check_implemented(cfg: Config, implemented: frozenset[str] | set[str]) -> None:
    """Raise ``NotImplementedError`` naming every requested feature not in ``implemented``.

    ``implemented`` holds feature names as returned by :func:`features_in_use`; an entry
    ``"key=*"`` accepts every value of that key.
    """
    missing = [f for f in features_in_use(cfg) if not _implemented(f, implemented)]
    if missing:
        raise NotImplementedError("zerospeed does not implement these requested config "
                                  "features yet: " + ", ".join(missing))
