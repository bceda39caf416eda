"""``zero_optimization``, offload sections, ``aio``: keys, aliases, defaults, deprecated forms."""

from __future__ import annotations

import pathlib
import sys
import warnings
from typing import Any

import pytest

from zerospeed.config import ConfigError, OffloadDevice, load_config

BATCH = {"train_batch_size": 8}


def zero(section: dict[str, Any]):
    return load_config({**BATCH, "zero_optimization": section}).zero_optimization


def problems(section: dict[str, Any]) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as err:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_config({**BATCH, "zero_optimization": section})
    return err.value.problems


def test_defaults_match_deepspeed() -> None:
    z = zero({})
    assert z.stage == 0 and not z.enabled
    assert (z.contiguous_gradients, z.reduce_scatter, z.allgather_partitions) == (True, True, True)
    assert (z.reduce_bucket_size, z.allgather_bucket_size) == (500_000_000, 500_000_000)
    assert z.overlap_comm is False  # stage-dependent default, off below stage 3
    assert z.sub_group_size == 1_000_000_000
    assert z.prefetch_bucket_size == 50_000_000
    assert z.param_persistence_threshold == 100_000
    assert z.model_persistence_threshold == sys.maxsize
    assert (z.max_live_parameters, z.max_reuse_distance) == (1_000_000_000, 1_000_000_000)
    assert z.gather_16bit_weights_on_model_save is False
    assert (z.ignore_unused_parameters, z.round_robin_gradients) == (True, False)
    assert (z.zero_hpz_partition_size, z.mics_shard_size) == (1, -1)
    assert z.offload_param.device == OffloadDevice.NONE == "none"
    assert (z.offload_param.buffer_count, z.offload_param.buffer_size,
            z.offload_param.max_in_cpu) == (5, 100_000_000, 1_000_000_000)
    assert z.offload_optimizer.device == "none" and not z.offload_optimizer.enabled
    assert (z.offload_optimizer.buffer_count, z.offload_optimizer.ratio) == (4, 1.0)


def test_overlap_comm_defaults_on_for_stage_3() -> None:
    assert zero({"stage": 3}).overlap_comm is True
    assert zero({"stage": 3, "overlap_comm": False}).overlap_comm is False
    assert zero({"stage": 2, "overlap_comm": True}).overlap_comm is True


def test_stage3_names_and_short_names() -> None:
    long = zero({"stage": 3, "stage3_prefetch_bucket_size": 1e6,
                 "stage3_param_persistence_threshold": 1e4, "stage3_max_live_parameters": 3e8,
                 "stage3_max_reuse_distance": 2e8, "stage3_model_persistence_threshold": 5,
                 "stage3_gather_16bit_weights_on_model_save": True,
                 "stage3_module_granularity_threshold": 7,
                 "stage3_use_all_reduce_for_fetch_params": True,
                 "stage3_allgather_sequential": True})
    short = zero({"stage": 3, "prefetch_bucket_size": 1e6, "param_persistence_threshold": 1e4,
                  "max_live_parameters": 3e8, "max_reuse_distance": 2e8,
                  "model_persistence_threshold": 5, "gather_16bit_weights_on_model_save": True,
                  "module_granularity_threshold": 7, "use_all_reduce_for_fetch_params": True,
                  "allgather_sequential": True})
    assert long == short
    assert (long.prefetch_bucket_size, long.stage3_prefetch_bucket_size) == (1_000_000, 1_000_000)
    assert long.stage3_param_persistence_threshold == 10_000
    assert long.stage3_max_live_parameters == 300_000_000
    assert long.stage3_max_reuse_distance == 200_000_000
    assert long.stage3_model_persistence_threshold == 5
    assert long.stage3_gather_16bit_weights_on_model_save is True
    printed = long.to_dict()
    assert printed["stage3_prefetch_bucket_size"] == 1_000_000
    assert "prefetch_bucket_size" not in printed


def test_offload_sections() -> None:
    z = zero({"stage": 3,
              "offload_param": {"device": "nvme", "nvme_path": "/nvme", "pin_memory": True,
                                "buffer_count": 6, "buffer_size": 1e8, "max_in_cpu": 1e9},
              "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 0.3,
                                    "pipeline_read": True, "fast_init": True}})
    assert z.offload_param.device == OffloadDevice.NVME
    assert z.offload_param.nvme_path == pathlib.Path("/nvme")
    assert z.offload_param.enabled and z.offload_param.pin_memory
    assert (z.offload_param.buffer_count, z.offload_param.buffer_size) == (6, 100_000_000)
    assert z.offload_optimizer.device == "cpu"
    assert z.offload_optimizer.ratio == 0.3
    assert z.offload_optimizer.pipeline and z.offload_optimizer.fast_init
    assert z.to_dict()["offload_param"]["nvme_path"] == "/nvme"


def test_nvme_needs_a_path() -> None:
    assert problems({"stage": 3, "offload_optimizer": {"device": "nvme"}}) == (
        'zero_optimization.offload_optimizer.nvme_path: required when device is "nvme"',)


def test_partial_offload_needs_stage_3() -> None:
    assert problems({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}) == (
        "zero_optimization.offload_optimizer.ratio: 0.5 needs stage 3 (partial offload); "
        "stage is 2",)


def test_param_offload_below_stage_3_warns() -> None:
    with pytest.warns(UserWarning, match="offload_param has no effect at stage 2"):
        z = zero({"stage": 2, "offload_param": {"device": "cpu"}})
    assert z.offload_param.device == "cpu"


def test_deprecated_cpu_offload() -> None:
    with pytest.warns(DeprecationWarning, match=r"zero_optimization.cpu_offload is deprecated"):
        z = zero({"stage": 2, "cpu_offload": True})
    assert z.offload_optimizer.device == OffloadDevice.CPU
    assert z.offload_optimizer.pin_memory is True  # DeepSpeed 0.19.8's default
    assert z.offload_param.device == "none"
    assert "cpu_offload" not in z.to_dict()


def test_deprecated_cpu_offload_param_and_pin_memory() -> None:
    with pytest.warns(DeprecationWarning, match=r"cpu_offload_param.* are deprecated"):
        z = zero({"stage": 3, "cpu_offload": True, "cpu_offload_param": True,
                  "cpu_offload_use_pin_memory": True})
    assert (z.offload_optimizer.device, z.offload_optimizer.pin_memory) == ("cpu", True)
    assert (z.offload_param.device, z.offload_param.pin_memory) == ("cpu", True)


def test_deprecated_false_means_no_offload() -> None:
    with pytest.warns(DeprecationWarning):
        z = zero({"stage": 2, "cpu_offload": False})
    assert z.offload_optimizer.device == "none"


def test_deprecated_and_new_form_agreeing_is_fine() -> None:
    with pytest.warns(DeprecationWarning):
        z = zero({"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}})
    assert z.offload_optimizer.device == "cpu"


def test_deprecated_and_new_form_conflicting() -> None:
    assert problems({"stage": 3, "cpu_offload": True,
                     "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}) == (
        'zero_optimization.cpu_offload: true conflicts with '
        'zero_optimization.offload_optimizer.device = "nvme"; remove the deprecated cpu_offload',)
    assert problems({"stage": 3, "cpu_offload_param": False,
                     "offload_param": {"device": "cpu"}}) == (
        'zero_optimization.cpu_offload_param: false conflicts with '
        'zero_optimization.offload_param.device = "cpu"; remove the deprecated '
        "cpu_offload_param",)
    assert problems({"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": True,
                     "offload_optimizer": {"device": "cpu", "pin_memory": False}}) == (
        "zero_optimization.cpu_offload_use_pin_memory: true conflicts with "
        "zero_optimization.offload_optimizer.pin_memory = false; remove the deprecated "
        "cpu_offload_use_pin_memory",)


def test_deprecated_flag_wrong_type() -> None:
    assert problems({"cpu_offload": "yes", "cpu_offload_param": 1}) == (
        'zero_optimization.cpu_offload: "yes" is a string; expected true or false',
        "zero_optimization.cpu_offload_param: 1 is a number; expected true or false",
    )


def test_deprecated_fp16_gather_name() -> None:
    with pytest.warns(DeprecationWarning, match="stage3_gather_fp16_weights_on_model_save"):
        z = zero({"stage": 3, "stage3_gather_fp16_weights_on_model_save": True})
    assert z.gather_16bit_weights_on_model_save is True
    assert problems({"stage": 3, "stage3_gather_fp16_weights_on_model_save": True,
                     "stage3_gather_16bit_weights_on_model_save": False}) == (
        "zero_optimization.stage3_gather_fp16_weights_on_model_save: true conflicts with "
        "stage3_gather_16bit_weights_on_model_save = false; remove the deprecated "
        "stage3_gather_fp16_weights_on_model_save",)


def test_aio_section_and_thread_count_alias() -> None:
    cfg = load_config({**BATCH, "aio": {"block_size": 262144, "queue_depth": 32,
                                        "thread_count": 4, "single_submit": True}})
    assert cfg.aio.intra_op_parallelism == 4 == cfg.aio.thread_count
    assert (cfg.aio.block_size, cfg.aio.queue_depth, cfg.aio.single_submit) == (262144, 32, True)
    assert (cfg.aio.overlap_events, cfg.aio.use_gds) == (True, False)
    assert cfg.to_dict()["aio"]["intra_op_parallelism"] == 4
    defaults = load_config(BATCH).aio
    assert (defaults.block_size, defaults.queue_depth, defaults.intra_op_parallelism) == (
        1_048_576, 8, 1)
    with pytest.raises(ConfigError) as err:
        load_config({**BATCH, "aio": {"thread_count": 1, "intra_op_parallelism": 2}})
    assert str(err.value) == ("aio.intra_op_parallelism: also given as thread_count; they are "
                              "the same setting, give only one")


def test_loose_zero_subsections() -> None:
    z = zero({"stage": 2, "zenflow": {"topk_ratio": 0.05, "update_interval": 4},
              "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}})
    assert z.zenflow is not None and z.zenflow.passthrough["topk_ratio"] == 0.05
    assert z.zeropp_loco_param == {"err_beta": 0.8, "reset_T": 1024}
    assert z.to_dict()["zenflow"] == {"topk_ratio": 0.05, "update_interval": 4}


def test_compute_grad_norm_off_only_at_stages_1_and_2() -> None:
    assert zero({"stage": 2, "compute_grad_norm": False}).compute_grad_norm is False
    with pytest.raises(ConfigError) as err:
        zero({"stage": 3, "compute_grad_norm": False})
    assert str(err.value).startswith("zero_optimization.compute_grad_norm: false needs stage 1 or 2 (stage is 3)")
