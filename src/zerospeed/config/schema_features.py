"""Feature sections besides precision, ZeRO and the optimizer.

Sections zerospeed implements or plans to (activation checkpointing, pipeline, monitors,
profilers, checkpointing...) are typed key by key with DeepSpeed 0.19's defaults.
Sections for features we may never implement (compression, data efficiency, autotuning...)
are :class:`LooseSection`: their ``enabled``-style keys are typed, the rest is kept verbatim.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from .base import LooseSection, Section
from .schema_tp import TensorParallelConfig  # its own module (partition_config is large); kept importable here
from .values import (
    Auto,
    zbool,
    zchoice,
    zfloat,
    zint,
    zintlist,
    zstr,
    zstrlist,
)


class ActivationCheckpointingConfig(Section):
    """``activation_checkpointing``: options of ``zerospeed.checkpointing``."""

    partition_activations: Annotated[bool, zbool()] = False
    contiguous_memory_optimization: Annotated[bool, zbool()] = False
    cpu_checkpointing: Annotated[bool, zbool()] = False
    number_checkpoints: Annotated[int | None, zint(ge=1, nullable=True)] = None
    synchronize_checkpoint_boundary: Annotated[bool, zbool()] = False
    profile: Annotated[bool, zbool()] = False


# The pipeline schedules ``pipeline.schedule`` names (``zerospeed.pipe.schedules.SCHEDULES``; a test keeps them equal).
PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "zb_h1")


class PipelineConfig(Section):
    """``pipeline``: pipeline-parallel engine options (``stages`` defaults to ``"auto"``,
    i.e. taken from the ``PipelineModule``). DeepSpeed's keys, plus zerospeed's ``schedule``
    (default DeepSpeed's 1F1B) and ``chunks`` (model chunks per stage for ``interleaved_1f1b``;
    it must match the ``PipelineModule``'s ``chunks``, which it defaults to)."""

    stages: Annotated[int | Auto, zint(ge=1, auto=True)] = Auto.AUTO
    partition: Annotated[str, zstr()] = "best"
    seed_layers: Annotated[bool, zbool()] = False
    activation_checkpoint_interval: Annotated[int, zint(ge=0)] = 0
    pipe_partitioned: Annotated[bool, zbool()] = True
    grad_partitioned: Annotated[bool, zbool()] = True
    use_reentrant: Annotated[bool | None, zbool(nullable=True)] = None
    schedule: Annotated[str, zchoice({name: name for name in PIPELINE_SCHEDULES})] = "1f1b"
    chunks: Annotated[int | None, zint(ge=1, nullable=True)] = None


class FlopsProfilerConfig(Section):
    """``flops_profiler``."""

    enabled: Annotated[bool, zbool()] = False
    recompute_fwd_factor: Annotated[float, zfloat(ge=0)] = 0.0
    profile_step: Annotated[int, zint(ge=1)] = 1
    module_depth: Annotated[int, zint(ge=-1)] = -1
    top_modules: Annotated[int, zint(ge=1)] = 1
    detailed: Annotated[bool, zbool()] = True
    output_file: Annotated[str | None, zstr(nullable=True)] = None


class TensorBoardConfig(Section):
    """``tensorboard`` monitor."""

    enabled: Annotated[bool, zbool()] = False
    output_path: Annotated[str, zstr()] = ""
    job_name: Annotated[str, zstr()] = "DeepSpeedJobName"


class CSVMonitorConfig(Section):
    """``csv_monitor``: metrics as local CSV files."""

    enabled: Annotated[bool, zbool()] = False
    output_path: Annotated[str, zstr()] = ""
    job_name: Annotated[str, zstr()] = "DeepSpeedJobName"


class WandbConfig(Section):
    """``wandb`` monitor."""

    enabled: Annotated[bool, zbool()] = False
    group: Annotated[str | None, zstr(nullable=True)] = None
    team: Annotated[str | None, zstr(nullable=True)] = None
    project: Annotated[str, zstr()] = "deepspeed"


class CometConfig(Section):
    """``comet`` monitor."""

    enabled: Annotated[bool, zbool()] = False
    samples_log_interval: Annotated[int, zint(ge=1)] = 100
    project: Annotated[str | None, zstr(nullable=True)] = None
    workspace: Annotated[str | None, zstr(nullable=True)] = None
    api_key: Annotated[str | None, zstr(nullable=True)] = None
    experiment_name: Annotated[str | None, zstr(nullable=True)] = None
    experiment_key: Annotated[str | None, zstr(nullable=True)] = None
    online: Annotated[bool | None, zbool(nullable=True)] = None
    mode: Annotated[str | None, zchoice(
        {"get": "get", "create": "create", "get_or_create": "get_or_create"}, nullable=True)] = None


class TrackioConfig(Section):
    """``trackio`` monitor."""

    enabled: Annotated[bool, zbool()] = False
    project: Annotated[str, zstr()] = "deepspeed"


class CommsLoggerConfig(Section):
    """``comms_logger``: per-collective logging."""

    enabled: Annotated[bool, zbool()] = False
    prof_all: Annotated[bool, zbool()] = True
    prof_ops: Annotated[tuple[str, ...], zstrlist()] = ()
    verbose: Annotated[bool, zbool()] = False
    debug: Annotated[bool, zbool()] = False


class ParallelWriteConfig(Section):
    """``checkpoint.parallel_write``."""

    pipeline_stage: Annotated[bool, zbool()] = False


class CheckpointWriterConfig(Section):
    """``checkpoint.writer``: DeepSpeed's fast checkpoint writer options."""

    type: Annotated[str, zchoice({"MOCK": "MOCK", "PYTHON": "PYTHON", "FAST": "FAST"},
                                 case="upper")] = "FAST"
    decoupled: Annotated[bool, zbool()] = False
    io_buffer_size: Annotated[int, zint(ge=1)] = 64 * 1024**2
    io_buffer_double: Annotated[bool, zbool()] = True
    show_statistics: Annotated[bool, zbool()] = False
    data_parallel: Annotated[str | None, zchoice(
        {"REPLICA": "REPLICA", "SOCKET": "SOCKET", "MACHINE": "MACHINE"},
        case="upper", nullable=True)] = None
    io_multiplier: Annotated[int, zint(ge=1)] = 1


class CheckpointConfig(Section):
    """``checkpoint``: tag validation, universal checkpoints, storage options. DeepSpeed's keys, plus
    zerospeed's ``load_must_exist``: a ``load_checkpoint`` that finds no checkpoint raises instead of
    returning ``(None, None)`` with a warning (default false, DeepSpeed's behaviour; the call's
    ``must_exist=`` overrides it), so a resume from a mistyped or empty folder cannot start over."""

    tag_validation: Annotated[str, zchoice({"WARN": "WARN", "IGNORE": "IGNORE", "FAIL": "FAIL"},
                                           ("Warn", "Ignore", "Fail"), case="upper")] = "WARN"
    load_universal: Annotated[bool, zbool()] = False
    use_node_local_storage: Annotated[bool, zbool()] = False
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
    checkpoint_serialization: Annotated[bool, zbool()] = True
    writer: CheckpointWriterConfig | None = None
    load_must_exist: Annotated[bool, zbool()] = False


class ProgressiveLayerDropConfig(Section):
    """``progressive_layer_drop`` (DeepSpeed 0.19.6; removed in 0.19.8): ``theta`` is the keep ratio theta(t)
    tends to (a probability, so at most 1; DeepSpeed does not check it), ``gamma`` its decay rate."""

    enabled: Annotated[bool, zbool()] = False
    theta: Annotated[float, zfloat(ge=0, le=1)] = 1.0
    gamma: Annotated[float, zfloat(ge=0)] = 0.001


class EigenvalueConfig(Section):
    """``eigenvalue``: Hessian eigenvalue estimation (used by MoQ)."""

    enabled: Annotated[bool, zbool()] = False
    verbose: Annotated[bool, zbool()] = False
    max_iter: Annotated[int, zint(ge=1)] = 100
    tol: Annotated[float, zfloat(ge=0)] = 0.01
    stability: Annotated[float, zfloat(ge=0)] = 1e-6
    gas_boundary_resolution: Annotated[int, zint(ge=1)] = 1
    layer_name: Annotated[str, zstr()] = "bert.encoder.layer"
    layer_num: Annotated[int, zint(ge=0)] = 0


class ElasticityConfig(Section):
    """``elasticity``: the batch sizes chosen from the data-parallel size, so an elastic job keeps its global
    batch at every world size it restarts at. When enabled, :meth:`Config.build` derives the three batch
    keys with :func:`zerospeed.elasticity.compute_elastic_config` (DeepSpeed's arithmetic) from the section
    as written; the typed fields here only check the values' types."""

    enabled: Annotated[bool, zbool()] = False
    max_train_batch_size: Annotated[int, zint(ge=1)] = 2000
    micro_batch_sizes: Annotated[tuple[int, ...], zintlist(ge=1)] = (2, 4, 6)
    min_gpus: Annotated[int, zint(ge=1)] = 1
    max_gpus: Annotated[int, zint(ge=1)] = 10000
    min_time: Annotated[int, zint(ge=0)] = 0
    version: Annotated[float, zfloat(ge=0)] = 0.2
    prefer_larger_batch: Annotated[bool, zbool()] = True
    ignore_non_elastic_batch_info: Annotated[bool, zbool()] = False
    model_parallel_size: Annotated[int, zint(ge=1)] = 1
    num_gpus_per_node: Annotated[int, zint(ge=1)] = 1


class HybridEngineConfig(Section):
    """``hybrid_engine``: DeepSpeed-Chat train/generate switching (not implemented)."""

    enabled: Annotated[bool, zbool()] = False
    max_out_tokens: Annotated[int, zint(ge=1)] = 512
    inference_tp_size: Annotated[int, zint(ge=1)] = 1
    release_inference_cache: Annotated[bool, zbool()] = False
    pin_parameters: Annotated[bool, zbool()] = True
    tp_gather_partition_size: Annotated[int, zint(ge=1)] = 8
    enable_cuda_graph: Annotated[bool, zbool()] = False


class ThroughputTimerConfig(Section):
    """``timers.throughput``."""

    enabled: Annotated[bool, zbool()] = True
    synchronized: Annotated[bool, zbool()] = True


class TimersConfig(Section):
    """``timers``."""

    throughput: ThroughputTimerConfig = Field(default_factory=ThroughputTimerConfig)


class NebulaConfig(LooseSection):
    """``nebula``: Azure Nebula checkpoint service (not implemented)."""

    enabled: Annotated[bool, zbool()] = False
    persistent_storage_path: Annotated[str | None, zstr(nullable=True)] = None
    persistent_time_interval: Annotated[int, zint(ge=1)] = 100
    num_of_version_in_retention: Annotated[int, zint(ge=1)] = 2
    enable_nebula_load: Annotated[bool, zbool()] = True


class AutotuningConfig(LooseSection):
    """``autotuning`` (not implemented; only ``enabled`` is typed)."""

    enabled: Annotated[bool, zbool()] = False


class CompileConfig(LooseSection):
    """``compile``: torch.compile / DeepCompile (not implemented; flags typed)."""

    enabled: Annotated[bool, zbool()] = False
    deepcompile: Annotated[bool, zbool()] = False


class DataStatesConfig(LooseSection):
    """``datastates`` asynchronous checkpointing (not implemented)."""

    enabled: Annotated[bool, zbool()] = False


class DataEfficiencyConfig(LooseSection):
    """``data_efficiency``: curriculum sampling / random-LTD (not implemented)."""

    enabled: Annotated[bool, zbool()] = False
    seed: Annotated[int, zint()] = 1234


class CurriculumLearningConfig(LooseSection):
    """Legacy ``curriculum_learning`` section (not implemented)."""

    enabled: Annotated[bool, zbool()] = False


class QuantizeTrainingConfig(LooseSection):
    """``quantize_training`` (MoQ; not implemented)."""

    enabled: Annotated[bool, zbool()] = False


class OpaqueSection(LooseSection):
    """A section kept verbatim: ``compression_training``, ``weight_quantization``,
    ``sparse_attention``, ``expert_parallel``... Present means requested."""


__all__ = [name for name in dir() if name.endswith("Config") or name == "OpaqueSection"]
