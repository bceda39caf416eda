"""The fields of the root config: every top-level key of a DeepSpeed 0.19 config, typed.

:class:`ConfigSections` holds the sections, their validation and DeepSpeed's cross-checks;
:class:`~zerospeed.config.schema.Config` adds the world size and the operations (``resolve_auto``,
``features_in_use``...). The split keeps the config package free of import cycles: the modules
that read a config (``features``) import this module, and ``schema`` imports them.
"""


from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field, model_validator

from .base import Section, aliased
from .schema_features import (
    ActivationCheckpointingConfig,
    AutotuningConfig,
    CheckpointConfig,
    CometConfig,
    CommsLoggerConfig,
    CompileConfig,
    CSVMonitorConfig,
    CurriculumLearningConfig,
    DataEfficiencyConfig,
    DataStatesConfig,
    EigenvalueConfig,
    ElasticityConfig,
    FlopsProfilerConfig,
    HybridEngineConfig,
    NebulaConfig,
    OpaqueSection,
    PipelineConfig,
    ProgressiveLayerDropConfig,
    QuantizeTrainingConfig,
    TensorBoardConfig,
    TensorParallelConfig,
    TimersConfig,
    TrackioConfig,
    WandbConfig,
)
from .schema_optim import OptimizerConfig, SchedulerConfig
from .schema_precision import (
    AmpConfig,
    BF16Config,
    DataTypesConfig,
    FP16Config,
    SkippedStepsConfig,
    TorchAutocastConfig,
)
from .schema_zero import AioConfig, ZeroConfig
from .values import (
    AUTO,
    Auto,
    DType,
    check_int,
    fail,
    fail_many,
    json_kind,
    show,
    validator,
    zbool,
    zchoice,
    zdtype,
    zfloat,
    zint,
    zstr,
)

_BATCH = Annotated[int | Auto | None, zint(ge=1, auto=True, nullable=True)]


def _steps_per_print(value: Any) -> int | None:
    """accelerate writes ``float("inf")`` to mean "never print", which is DeepSpeed's ``None``."""
    if isinstance(value, float) and value == float("inf"):
        return None
    return check_int(value, ge=1)


_ONEBIT = ("OneBitAdam", "ZeroOneAdam", "OneBitLamb")


def _max_grad_norm_as_clipping(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """``optimizer.params.max_grad_norm`` -> ``gradient_clipping``. DeepSpeed's configs of 2020 (its
    GPT-2 and BERT examples) clip there, as apex's fused optimizers did, by the global gradient norm;
    DeepSpeed 0.3 moved it to the top level and later releases refuse the old spelling."""
    optimizer = data.get("optimizer")
    if not isinstance(optimizer, Mapping):
        return data
    params = optimizer.get("params")
    if not isinstance(params, Mapping) or "max_grad_norm" not in params:
        return data
    value = params["max_grad_norm"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        fail(f"optimizer.params.max_grad_norm: {show(value)} is not a norm; expected a number >= 0 "
             f"(it is the old spelling of the top-level gradient_clipping)")
    if "gradient_clipping" in data and data["gradient_clipping"] != value:
        fail(f"optimizer.params.max_grad_norm ({show(value)}) and gradient_clipping "
             f"({show(data['gradient_clipping'])}) disagree; max_grad_norm is the old spelling of "
             f"gradient_clipping: remove it and keep the value you want in gradient_clipping")
    warnings.warn(f"optimizer.params.max_grad_norm is deprecated (DeepSpeed's 2020 spelling); read as "
                  f'"gradient_clipping": {show(value)}: move it to the top level', DeprecationWarning, stacklevel=5)
    rest = {key: v for key, v in params.items() if key != "max_grad_norm"}
    return {**data, "optimizer": {**optimizer, "params": rest}, "gradient_clipping": value}


class ConfigSections(Section):
    """Every top-level section and key, validated and cross-checked (see :class:`Config`)."""

    # -- batch ---------------------------------------------------------------------------
    train_batch_size: _BATCH = None
    train_micro_batch_size_per_gpu: _BATCH = None
    gradient_accumulation_steps: _BATCH = None
    managed_gradient_accumulation: Annotated[bool, zbool()] = True
    dataloader_drop_last: Annotated[bool, zbool()] = False
    sequence_parallel_size: Annotated[int | None, zint(ge=1, nullable=True)] = None

    # -- optimizer ------------------------------------------------------------------------
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    gradient_clipping: Annotated[float | Auto, zfloat(ge=0, auto=True)] = 1.0  # DeepSpeed 0.19.8
    zero_allow_untested_optimizer: Annotated[bool, zbool()] = False
    zero_force_ds_cpu_optimizer: Annotated[bool, zbool()] = True

    # -- precision ------------------------------------------------------------------------
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = aliased("bf16", "bfloat16", default_factory=BF16Config)
    amp: AmpConfig = Field(default_factory=AmpConfig)
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    #: zerospeed's own: non-finite gradient norms (fp32 skipping, raising after K in a row)
    skipped_steps: SkippedStepsConfig = Field(default_factory=SkippedStepsConfig)

    # -- communication --------------------------------------------------------------------
    communication_data_type: Annotated[DType | None, zdtype(nullable=True)] = None
    seq_parallel_communication_data_type: Annotated[DType, zdtype()] = DType.FP32
    prescale_gradients: Annotated[bool, zbool()] = False
    gradient_predivide_factor: Annotated[float, zfloat(gt=0)] = 1.0
    gradient_allreduce_op: Annotated[str, zchoice({"mean": "mean", "sum": "sum"},
                                                  case="lower")] = "mean"
    disable_allgather: Annotated[bool, zbool()] = False
    sparse_gradients: Annotated[bool, zbool()] = False
    graph_harvesting: Annotated[bool, zbool()] = False

    # -- ZeRO and offload -----------------------------------------------------------------
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    aio: AioConfig = Field(default_factory=AioConfig)

    # -- model parallelism and memory -----------------------------------------------------
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig)
    pipeline: PipelineConfig | None = None
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    expert_parallel: OpaqueSection | None = None
    use_data_before_expert_parallelism: Annotated[bool, zbool()] = False

    # -- logging, monitoring, profiling ---------------------------------------------------
    #: ``None`` = never print; accelerate's ``float("inf")`` is read the same way.
    steps_per_print: Annotated[int | None, validator(_steps_per_print, "an integer >= 1",
                                                      nullable=True)] = None
    wall_clock_breakdown: Annotated[bool, zbool()] = False
    memory_breakdown: Annotated[bool, zbool()] = False
    dump_state: Annotated[bool, zbool()] = False
    log_level: Annotated[str | None, zstr(nullable=True)] = None
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    comet: CometConfig = Field(default_factory=CometConfig)
    trackio: TrackioConfig = Field(default_factory=TrackioConfig)
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    timers: TimersConfig = Field(default_factory=TimersConfig)

    # -- checkpointing --------------------------------------------------------------------
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    nebula: NebulaConfig = Field(default_factory=NebulaConfig)
    datastates: DataStatesConfig = Field(default_factory=DataStatesConfig)

    # -- training techniques zerospeed may never implement ---------------------------------
    progressive_layer_drop: ProgressiveLayerDropConfig = Field(
        default_factory=ProgressiveLayerDropConfig)
    eigenvalue: EigenvalueConfig = Field(default_factory=EigenvalueConfig)
    elasticity: ElasticityConfig = Field(default_factory=ElasticityConfig)
    autotuning: AutotuningConfig = Field(default_factory=AutotuningConfig)
    hybrid_engine: HybridEngineConfig = Field(default_factory=HybridEngineConfig)
    compile: CompileConfig = Field(default_factory=CompileConfig)
    data_efficiency: DataEfficiencyConfig = Field(default_factory=DataEfficiencyConfig)
    curriculum_learning: CurriculumLearningConfig | None = None
    quantize_training: QuantizeTrainingConfig | None = None
    compression_training: OpaqueSection | None = None
    weight_quantization: OpaqueSection | None = None
    sparse_attention: OpaqueSection | None = None
    vocabulary_size: Annotated[int | None, zint(ge=1, nullable=True)] = None
    disable_python_gc: Annotated[bool, zbool()] = False

    # -- validation -----------------------------------------------------------------------

    @model_validator(mode="before")
    @classmethod
    def _legacy_forms(cls, data: Any) -> Any:
        """``"zero_optimization": true/false`` was DeepSpeed's first ZeRO switch (stage 1/0);
        ``"aio": null`` means the defaults, as in DeepSpeed."""
        if isinstance(data, Mapping) and "aio" in data and data["aio"] is None:
            data = {k: v for k, v in data.items() if k != "aio"}  # DeepSpeed reads null as {}
        if isinstance(data, Mapping) and isinstance(data.get("zero_optimization"), bool):
            flag = data["zero_optimization"]
            warnings.warn('"zero_optimization": true/false is deprecated; use '
                          '"zero_optimization": {"stage": N}', DeprecationWarning, stacklevel=4)
            data = {**data, "zero_optimization": {"stage": 1 if flag else 0}}
        if data is not None and not isinstance(data, Mapping):
            fail(f"{show(data)} is {json_kind(data)}; a config must be a JSON object")
        return _max_grad_norm_as_clipping(data) if data is not None else data

    @model_validator(mode="after")
    def _cross_checks(self) -> ConfigSections:
        problems = _cross_check_problems(self)
        if problems:
            fail_many(problems)
        return self


def _is_on(flag: bool | Auto) -> bool:
    return flag is True


def _cross_check_problems(cfg: ConfigSections) -> list[tuple[tuple[str | int, ...], str]]:
    """Combinations DeepSpeed rejects; each problem is ``(key_path, message)``."""
    problems: list[tuple[tuple[str | int, ...], str]] = []
    stage = cfg.zero_optimization.stage
    known_stage = not isinstance(stage, Auto)
    if _is_on(cfg.fp16.enabled) and _is_on(cfg.bf16.enabled):
        problems.append((("bf16", "enabled"), "true together with fp16.enabled = true; "
                                               "enable at most one of fp16 and bf16"))
    if _is_on(cfg.amp.enabled) and (_is_on(cfg.fp16.enabled) or _is_on(cfg.bf16.enabled)):
        problems.append((("amp", "enabled"), "true together with fp16/bf16; Apex AMP replaces "
                                              "DeepSpeed's fp16/bf16 modes, enable only one"))
    for section, key in (("fp16", "fp16_master_weights_and_grads"),
                         ("bf16", "bf16_master_weights_and_grads"),
                         ("bf16", "bf16_optimizer_states")):
        if getattr(getattr(cfg, section), key) and known_stage and stage == 0:
            problems.append(((section, key), "true needs ZeRO stage 1, 2 or 3; "
                                             "zero_optimization.stage is 0"))
    if cfg.bf16.bf16_optimizer_states and not cfg.bf16.bf16_master_weights_and_grads:
        problems.append((("bf16", "bf16_optimizer_states"),
                         "true needs bf16.bf16_master_weights_and_grads = true"))
    if cfg.gradient_allreduce_op == "sum" and known_stage and stage == 3:
        problems.append((("gradient_allreduce_op",), '"sum" is not supported with ZeRO stage 3'))
    if cfg.optimizer is not None and cfg.optimizer.type in _ONEBIT:
        problems += _onebit_problems(show(cfg.optimizer.type), cfg)
    return problems


def _onebit_problems(name: str, cfg: ConfigSections) -> list[tuple[tuple[str | int, ...], str]]:
    """1-bit optimizers run at ZeRO stages 0-2: once they compress, every rank needs the whole momentum
    and applies the averaged one to its whole parameters (see zerospeed.zero.handover)."""
    zero = cfg.zero_optimization
    if zero.stage == 3:
        return [(("optimizer", "type"), f"{name} cannot be combined with ZeRO stage 3: once it compresses, every "
                                        f"rank needs the whole momentum and updates its whole parameters, which "
                                        f"stage 3 never holds; use zero_optimization.stage 0, 1 or 2")]
    if zero.stage in (1, 2) and zero.offload_optimizer.enabled:  # (stage 0 refuses offload_optimizer anyway)
        return [(("zero_optimization", "offload_optimizer", "device"),
                 f"{show(zero.offload_optimizer.device)} cannot be combined with {name}: once it compresses, "
                 f"its state is whole on every rank and steps there; remove zero_optimization.offload_optimizer")]
    return []
