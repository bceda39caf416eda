"""Realistic DeepSpeed configs (tests/data/ds_*) parse to the expected values and round-trip."""

from __future__ import annotations

import json
import pathlib
import warnings

import pytest

from zerospeed.config import AUTO, Config, DType, OffloadDevice, load_config

DATA = pathlib.Path(__file__).parent / "data"

#: Each example with the data-parallel world size it is written for.
WORLD_SIZES = {
    "ds_2020_bing_bert_lamb.json": 2,  # DeepSpeed's own examples of 2020, verbatim (tests/test_seed_configs.py)
    "ds_2020_megatron_gpt2.json": 2,
    "ds_activation_checkpointing.json": 16,
    "ds_bert_lamb_fp16.json": 64,
    "ds_bf16_warmup_decay.json": 8,
    "ds_commented.hjson": 8,
    "ds_deprecated_cpu_offload.json": 8,
    "ds_deprecated_zero3.json": 4,
    "ds_flops_profiler.json": 4,
    "ds_gpt2_zero2.json": 8,
    "ds_hf_zero3_auto.json": 1,
    "ds_onebit_adam_comm.json": 16,
    "ds_onecycle.json": 8,
    "ds_pipeline_parallel.json": 2,
    "ds_progressive_layer_drop.json": 32,
    "ds_warmup_cosine_sparse.json": 4,
    "ds_zero1_monitors.json": 8,
    "ds_zero3_nvme_offload.json": 16,
}


def load(name: str) -> Config:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return load_config(DATA / name, world_size=WORLD_SIZES[name])


def batch(cfg: Config) -> tuple[object, object, object]:
    return (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps)


def test_every_example_is_listed() -> None:
    assert sorted(p.name for p in DATA.glob("ds_*")) == sorted(WORLD_SIZES)
    assert len(WORLD_SIZES) >= 10


@pytest.mark.parametrize("name", sorted(WORLD_SIZES))
def test_round_trip_through_to_json(name: str) -> None:
    cfg = load(name)
    text = cfg.to_json()
    again = load_config(json.loads(text), world_size=WORLD_SIZES[name])
    assert again == cfg
    assert again.to_json() == text
    assert cfg.to_dict() == json.loads(text)


def test_bert_lamb_fp16() -> None:
    cfg = load("ds_bert_lamb_fp16.json")
    assert batch(cfg) == (65536, 64, 16)
    assert cfg.optimizer is not None and cfg.optimizer.type == "Lamb"
    assert dict(cfg.optimizer.params) == {"lr": 0.011, "weight_decay": 0.01,
                                          "bias_correction": False, "max_coeff": 0.3,
                                          "min_coeff": 0.01}
    assert cfg.scheduler is not None and cfg.scheduler.type == "WarmupDecayLR"
    assert cfg.scheduler.params["warmup_type"] == "linear"
    assert cfg.scheduler.params["total_num_steps"] == 7038
    assert cfg.fp16.enabled is True and cfg.fp16.dynamic_loss_scale
    assert cfg.fp16.initial_dynamic_scale == 65536.0
    assert cfg.gradient_clipping == 1.0 and cfg.steps_per_print == 1000
    assert cfg.sparse_attention is not None
    assert cfg.sparse_attention.passthrough["mode"] == "fixed"
    assert cfg.precision == DType.FP16


def test_2020_megatron_gpt2() -> None:
    """DeepSpeedExamples' Megatron-LM/scripts/ds_config.json: ZeRO as a boolean, max_grad_norm in Adam."""
    with pytest.warns(DeprecationWarning) as seen:
        cfg = load_config(DATA / "ds_2020_megatron_gpt2.json", world_size=2)
    assert {str(w.message).split(" ")[0] for w in seen} >= {'"zero_optimization":', "optimizer.params.max_grad_norm"}
    assert batch(cfg) == (16, 8, 1) and cfg.zero_stage == 1
    assert cfg.gradient_clipping == 1.0
    assert cfg.optimizer is not None and dict(cfg.optimizer.params) == {"lr": 0.00015}
    assert (cfg.fp16.loss_scale_window, cfg.fp16.hysteresis, cfg.fp16.min_loss_scale) == (1000, 2, 1.0)


def test_2020_bing_bert_lamb() -> None:
    """DeepSpeedExamples' bing_bert/deepspeed_bsz16K_lamb_config.json: max_grad_norm in Lamb's params."""
    with pytest.warns(DeprecationWarning, match="max_grad_norm"):
        cfg = load_config(DATA / "ds_2020_bing_bert_lamb.json", world_size=2)
    assert batch(cfg) == (16384, 16, 512)
    assert cfg.gradient_clipping == 1.0 and cfg.prescale_gradients and cfg.wall_clock_breakdown
    assert cfg.optimizer is not None and dict(cfg.optimizer.params) == {
        "lr": 4e-3, "weight_decay": 0.01, "bias_correction": False, "max_coeff": 0.5, "min_coeff": 0.08}
    assert cfg.fp16.enabled is True and cfg.fp16.dynamic_loss_scale


def test_gpt2_zero2() -> None:
    cfg = load("ds_gpt2_zero2.json")
    assert batch(cfg) == (256, 8, 4)
    z = cfg.zero_optimization
    assert z.stage == 2 and cfg.zero_enabled and cfg.zero_stage == 2
    assert (z.overlap_comm, z.contiguous_gradients, z.reduce_scatter) == (True, True, True)
    assert (z.allgather_bucket_size, z.reduce_bucket_size) == (500_000_000, 500_000_000)
    assert (cfg.fp16.initial_scale_power, cfg.fp16.loss_scale_window, cfg.fp16.hysteresis,
            cfg.fp16.min_loss_scale) == (12, 1000, 2, 1.0)
    assert cfg.optimizer is not None and cfg.optimizer.params["betas"] == (0.9, 0.95)
    assert cfg.scheduler is not None and dict(cfg.scheduler.params) == {
        "warmup_min_lr": 0.0, "warmup_max_lr": 1.5e-4, "warmup_num_steps": 3000,
        "warmup_type": "log", "last_batch_iteration": -1}
    assert cfg.zero_allow_untested_optimizer is True


def test_zero3_nvme_offload_with_aio() -> None:
    cfg = load("ds_zero3_nvme_offload.json")
    assert batch(cfg) == (64, 4, 1)
    z = cfg.zero_optimization
    assert z.stage == 3
    assert z.offload_param.device == OffloadDevice.NVME
    assert z.offload_param.nvme_path == pathlib.Path("/local_nvme")
    assert (z.offload_param.buffer_count, z.offload_param.buffer_size,
            z.offload_param.max_in_cpu, z.offload_param.pin_memory) == (
        6, 100_000_000, 1_000_000_000, True)
    assert z.offload_optimizer.device == "nvme"
    assert (z.offload_optimizer.pipeline_read, z.offload_optimizer.pipeline_write,
            z.offload_optimizer.buffer_count) == (True, True, 5)
    assert (z.prefetch_bucket_size, z.param_persistence_threshold, z.reduce_bucket_size) == (
        1_500_000, 100_000, 1_000_000)
    assert z.gather_16bit_weights_on_model_save is True
    assert (cfg.aio.block_size, cfg.aio.queue_depth, cfg.aio.intra_op_parallelism,
            cfg.aio.single_submit, cfg.aio.overlap_events) == (262144, 32, 1, False, True)
    assert cfg.precision == "bf16"


def test_hf_trainer_zero3_with_auto() -> None:
    cfg = load("ds_hf_zero3_auto.json")
    assert batch(cfg) == (AUTO, AUTO, AUTO)
    assert cfg.fp16.enabled is AUTO and cfg.bf16.enabled is AUTO
    assert cfg.fp16.loss_scale == 0.0 and cfg.fp16.min_loss_scale == 1.0
    z = cfg.zero_optimization
    assert (z.offload_optimizer.device, z.offload_param.device) == ("cpu", "cpu")
    assert z.offload_optimizer.pin_memory and z.offload_param.pin_memory
    assert (z.reduce_bucket_size, z.prefetch_bucket_size, z.param_persistence_threshold) == (
        AUTO, AUTO, AUTO)
    assert (z.max_live_parameters, z.max_reuse_distance) == (1_000_000_000, 1_000_000_000)
    assert cfg.gradient_clipping is AUTO and cfg.steps_per_print == 2000
    assert len(cfg.unresolved_auto()) == 17


def test_bf16_warmup_decay() -> None:
    cfg = load("ds_bf16_warmup_decay.json")
    assert batch(cfg) == (512, 8, 8)
    assert cfg.bf16.enabled is True and cfg.fp16.enabled is False
    assert cfg.data_types.grad_accum_dtype == DType.FP32
    assert cfg.optimizer is not None and cfg.optimizer.type == "AdamW"  # written "adamw"
    assert cfg.scheduler is not None and dict(cfg.scheduler.params) == {
        "total_num_steps": 100000, "warmup_min_lr": 0.0, "warmup_max_lr": 3e-4,
        "warmup_num_steps": 2000, "warmup_type": "log", "last_batch_iteration": -1}
    assert cfg.zero_optimization.stage == 1


def test_pipeline_parallel() -> None:
    cfg = load("ds_pipeline_parallel.json")
    assert batch(cfg) == (256, 8, 16)
    assert cfg.pipeline is not None
    assert (cfg.pipeline.stages, cfg.pipeline.partition, cfg.pipeline.seed_layers,
            cfg.pipeline.activation_checkpoint_interval, cfg.pipeline.pipe_partitioned,
            cfg.pipeline.grad_partitioned) == (4, "parameters", True, 1, True, True)
    assert cfg.fp16.initial_scale_power == 15


def test_zero1_with_monitors() -> None:
    cfg = load("ds_zero1_monitors.json")
    assert batch(cfg) == (256, 16, 2)
    assert cfg.zero_optimization.stage == 1
    assert (cfg.tensorboard.enabled, cfg.tensorboard.output_path, cfg.tensorboard.job_name) == (
        True, "logs/tensorboard/", "gpt_zero1")
    assert (cfg.wandb.enabled, cfg.wandb.team, cfg.wandb.group, cfg.wandb.project) == (
        True, "my-team", "zero1-runs", "gpt-pretraining")
    assert cfg.csv_monitor.enabled and cfg.csv_monitor.output_path == "logs/csv/"
    assert cfg.comms_logger.prof_ops == ("all_reduce", "all_gather")
    assert cfg.comms_logger.prof_all is False
    assert cfg.comet.enabled is False


def test_flops_profiler_and_wall_clock() -> None:
    cfg = load("ds_flops_profiler.json")
    assert batch(cfg) == (32, 8, 1)
    fp = cfg.flops_profiler
    assert (fp.enabled, fp.profile_step, fp.module_depth, fp.top_modules, fp.detailed,
            fp.output_file) == (True, 5, -1, 3, True, None)
    assert cfg.wall_clock_breakdown is True and cfg.memory_breakdown is False
    assert (cfg.timers.throughput.enabled, cfg.timers.throughput.synchronized) == (True, False)
    assert cfg.optimizer is not None and cfg.optimizer.type == "SGD"
    assert dict(cfg.optimizer.params) == {"lr": 0.05, "momentum": 0.9, "nesterov": True}


def test_activation_checkpointing() -> None:
    cfg = load("ds_activation_checkpointing.json")
    assert batch(cfg) == (1024, 4, 16)
    ac = cfg.activation_checkpointing
    assert (ac.partition_activations, ac.cpu_checkpointing, ac.contiguous_memory_optimization,
            ac.number_checkpoints, ac.synchronize_checkpoint_boundary, ac.profile) == (
        True, True, True, 24, False, False)
    assert cfg.fp16.loss_scale_window == 500


def test_deprecated_cpu_offload_file() -> None:
    with pytest.warns(DeprecationWarning, match="cpu_offload"):
        cfg = load_config(DATA / "ds_deprecated_cpu_offload.json", world_size=8)
    assert batch(cfg) == (24, 3, 1)
    assert cfg.zero_optimization.offload_optimizer.device == OffloadDevice.CPU
    assert cfg.zero_optimization.offload_param.device == OffloadDevice.NONE
    assert cfg.optimizer is not None and dict(cfg.optimizer.params) == {
        "lr": 0.00015, "torch_adam": False, "adam_w_mode": True}


def test_deprecated_zero3_file() -> None:
    cfg = load("ds_deprecated_zero3.json")
    assert batch(cfg) == (4, 1, 1)
    z = cfg.zero_optimization
    assert (z.offload_optimizer.device, z.offload_optimizer.pin_memory) == ("cpu", True)
    assert (z.offload_param.device, z.offload_param.pin_memory) == ("cpu", True)
    assert z.gather_16bit_weights_on_model_save is True
    assert z.max_live_parameters == 300_000_000


def test_commented_hjson() -> None:
    cfg = load("ds_commented.hjson")
    assert batch(cfg) == (16, 2, 1)
    assert cfg.bf16.enabled is True  # written as the older "bfloat16" key
    z = cfg.zero_optimization
    assert (z.stage, z.offload_optimizer.device, z.offload_optimizer.pin_memory,
            z.reduce_bucket_size) == (2, "cpu", True, 200_000_000)
    assert cfg.optimizer is not None and cfg.optimizer.type == "AdamW"
    assert dict(cfg.optimizer.params) == {"lr": 1e-4, "weight_decay": 0.05}
    assert cfg.communication_data_type == DType.BF16


def test_onecycle() -> None:
    cfg = load("ds_onecycle.json")
    assert batch(cfg) == (128, 16, 1)
    assert cfg.scheduler is not None and cfg.scheduler.type == "OneCycle"
    assert dict(cfg.scheduler.params) == {
        "cycle_first_step_size": 1000, "cycle_first_stair_count": 500,
        "cycle_second_step_size": 1000, "cycle_second_stair_count": 500,
        "decay_step_size": 1000, "cycle_min_lr": 0.0001, "cycle_max_lr": 0.001,
        "decay_lr_rate": 0.001, "cycle_min_mom": 0.85, "cycle_max_mom": 0.99,
        "decay_mom_rate": 0.0, "cycle_momentum": True, "last_batch_iteration": -1}


def test_progressive_layer_drop() -> None:
    cfg = load("ds_progressive_layer_drop.json")
    assert batch(cfg) == (4096, 16, 8)
    pld = cfg.progressive_layer_drop
    assert (pld.enabled, pld.theta, pld.gamma) == (True, 0.5, 0.001)
    assert cfg.prescale_gradients is True and cfg.gradient_predivide_factor == 8.0


def test_onebit_adam_with_communication_settings() -> None:
    cfg = load("ds_onebit_adam_comm.json")
    assert batch(cfg) == (4096, 16, 16)
    assert cfg.optimizer is not None and cfg.optimizer.type == "OneBitAdam"
    assert cfg.optimizer.params["freeze_step"] == 23000
    assert cfg.optimizer.params["comm_backend_name"] == "nccl"
    assert cfg.communication_data_type == DType.FP16 and cfg.prescale_gradients is False
    ck = cfg.checkpoint
    assert (ck.tag_validation, ck.load_universal, ck.use_node_local_storage) == (
        "FAIL", False, True)
    assert cfg.dataloader_drop_last is True


def test_warmup_cosine_sparse_gradients() -> None:
    cfg = load("ds_warmup_cosine_sparse.json")
    assert batch(cfg) == (64, 8, 2)
    assert cfg.scheduler is not None and dict(cfg.scheduler.params) == {
        "total_num_steps": 50000, "warmup_num_steps": 500, "cos_min_ratio": 0.1,
        "warmup_min_ratio": 0.0, "warmup_type": "log", "last_batch_iteration": -1}
    assert cfg.optimizer is not None and cfg.optimizer.type == "Adagrad"
    assert cfg.sparse_gradients is True
    assert cfg.seq_parallel_communication_data_type == DType.BF16
    assert not cfg.zero_enabled
