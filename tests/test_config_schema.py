"""Schema defaults (DeepSpeed 0.19), value types, equality/hashing and printing."""

from __future__ import annotations

import json

import pytest
import torch

from zerospeed.config import AUTO, DType, FrozenDict, OffloadDevice, load_config

BATCH = {"train_batch_size": 8}


def test_top_level_defaults_match_deepspeed() -> None:
    cfg = load_config(BATCH)
    assert cfg.gradient_clipping == 1.0  # GRADIENT_CLIPPING_DEFAULT in DeepSpeed 0.19.8
    assert cfg.steps_per_print is None
    assert (cfg.prescale_gradients, cfg.gradient_predivide_factor) == (False, 1.0)
    assert cfg.communication_data_type is None
    assert cfg.seq_parallel_communication_data_type == DType.FP32
    assert cfg.gradient_allreduce_op == "mean"
    assert (cfg.zero_allow_untested_optimizer, cfg.zero_force_ds_cpu_optimizer) == (False, True)
    assert (cfg.wall_clock_breakdown, cfg.memory_breakdown, cfg.dump_state) == (
        False, False, False)
    assert (cfg.sparse_gradients, cfg.dataloader_drop_last, cfg.graph_harvesting) == (
        False, False, False)
    assert cfg.managed_gradient_accumulation is True
    assert cfg.optimizer is None and cfg.scheduler is None and cfg.pipeline is None
    assert cfg.zero_enabled is False and cfg.zero_stage == 0


def test_section_defaults_match_deepspeed() -> None:
    cfg = load_config(BATCH)
    fp16 = cfg.fp16
    assert (fp16.enabled, fp16.auto_cast, fp16.loss_scale, fp16.initial_scale_power,
            fp16.loss_scale_window, fp16.hysteresis, fp16.consecutive_hysteresis,
            fp16.min_loss_scale, fp16.fp16_master_weights_and_grads) == (
        False, False, 0.0, 16, 1000, 2, False, 1.0, False)
    bf16 = cfg.bf16
    assert (bf16.enabled, bf16.immediate_grad_update, bf16.check_grad_overflow,
            bf16.bf16_master_weights_and_grads, bf16.bf16_optimizer_states) == (
        False, False, True, False, False)
    ac = cfg.activation_checkpointing
    assert (ac.partition_activations, ac.cpu_checkpointing, ac.contiguous_memory_optimization,
            ac.number_checkpoints, ac.synchronize_checkpoint_boundary, ac.profile) == (
        False, False, False, None, False, False)
    fp = cfg.flops_profiler
    assert (fp.enabled, fp.recompute_fwd_factor, fp.profile_step, fp.module_depth,
            fp.top_modules, fp.detailed, fp.output_file) == (False, 0.0, 1, -1, 1, True, None)
    assert (cfg.tensorboard.output_path, cfg.tensorboard.job_name) == ("", "DeepSpeedJobName")
    assert (cfg.wandb.project, cfg.wandb.team, cfg.wandb.group) == ("deepspeed", None, None)
    assert (cfg.comms_logger.prof_all, cfg.comms_logger.prof_ops) == (True, ())
    ck = cfg.checkpoint
    assert (ck.tag_validation, ck.load_universal, ck.use_node_local_storage,
            ck.parallel_write.pipeline_stage) == ("WARN", False, False, False)
    pld = cfg.progressive_layer_drop
    assert (pld.enabled, pld.theta, pld.gamma) == (False, 1.0, 0.001)
    ev = cfg.eigenvalue
    assert (ev.max_iter, ev.tol, ev.stability, ev.layer_name) == (
        100, 0.01, 1e-6, "bert.encoder.layer")
    assert (cfg.hybrid_engine.max_out_tokens, cfg.hybrid_engine.pin_parameters) == (512, True)
    assert (cfg.timers.throughput.enabled, cfg.timers.throughput.synchronized) == (True, True)
    assert cfg.elasticity.micro_batch_sizes == (2, 4, 6)
    assert cfg.data_types.grad_accum_dtype is None


def test_pipeline_defaults_when_present() -> None:
    pipe = load_config({**BATCH, "pipeline": {"stages": 2}}).pipeline
    assert pipe is not None
    assert (pipe.stages, pipe.partition, pipe.seed_layers, pipe.activation_checkpoint_interval,
            pipe.pipe_partitioned, pipe.grad_partitioned) == (2, "best", False, 0, True, True)


def test_enums_compare_as_strings_and_map_to_torch() -> None:
    assert OffloadDevice.CPU == "cpu" and str(OffloadDevice.NVME) == "nvme"
    assert DType.BF16 == "bf16" and str(DType.FP16) == "fp16"
    assert DType.BF16.torch_dtype is torch.bfloat16
    assert DType.FP16.torch_dtype is torch.float16
    assert DType.FP32.torch_dtype is torch.float32


def test_frozen_dict() -> None:
    fd = FrozenDict({"a": 1, "b": (1, 2)})
    assert fd == {"a": 1, "b": (1, 2)}
    assert hash(fd) == hash(FrozenDict({"b": (1, 2), "a": 1}))
    with pytest.raises(TypeError):
        fd["a"] = 2  # type: ignore[index]
    assert repr(fd) == "FrozenDict({'a': 1, 'b': (1, 2)})"


def test_equality_and_hash() -> None:
    a = load_config({**BATCH, "zero_optimization": {"stage": 2}, "fp16": {"enabled": True}})
    b = load_config({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
                     "fp16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    assert a == b and hash(a) == hash(b)
    assert a != load_config({**BATCH, "zero_optimization": {"stage": 1},
                             "fp16": {"enabled": True}})
    assert a != load_config({"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": True},
                             "zero_optimization": {"stage": 2}}, world_size=2)
    assert len({a, b}) == 1


def test_to_json_uses_deepspeed_names_and_fills_defaults() -> None:
    cfg = load_config({**BATCH, "bfloat16": {"enabled": True},
                       "zero_optimization": {"stage": 3, "prefetch_bucket_size": 10,
                                             "offload_param": {"device": "cpu"}},
                       "aio": {"thread_count": 2}})
    printed = json.loads(cfg.to_json())
    assert printed["bf16"] == {"enabled": True, "immediate_grad_update": False,
                               "check_grad_overflow": True,
                               "bf16_master_weights_and_grads": False,
                               "bf16_optimizer_states": False}
    zero = printed["zero_optimization"]
    assert zero["stage3_prefetch_bucket_size"] == 10
    assert zero["overlap_comm"] is True
    assert zero["offload_param"] == {"device": "cpu", "buffer_count": 5,
                                     "buffer_size": 100_000_000, "max_in_cpu": 1_000_000_000,
                                     "pin_memory": True}
    assert printed["aio"]["intra_op_parallelism"] == 2
    assert printed["train_micro_batch_size_per_gpu"] == 8
    assert "optimizer" not in printed and "pipeline" not in printed
    assert cfg.to_dict() == printed
    assert load_config(printed) == cfg
    assert cfg.to_json(indent=None).startswith('{"train_batch_size": 8, ')


def test_auto_values_print_as_auto() -> None:
    cfg = load_config({"train_batch_size": "auto", "fp16": {"enabled": "auto"}})
    assert cfg.fp16.enabled is AUTO
    assert cfg.to_dict()["fp16"]["enabled"] == "auto"
    assert cfg.to_dict()["train_batch_size"] == "auto"
