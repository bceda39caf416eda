"""``zerospeed.initialize``: DeepSpeed's entry point, turning a model and a config into an Engine."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import logging
import os
from typing import Any, Callable, Iterable

import torch
from torch import nn

from zerospeed.accelerator import get_accelerator
from zerospeed.config import Config, ConfigError, load_config, resolve_batch
from zerospeed.config.load import read_source
from zerospeed.config.policies import TrainingPolicy, ZeroPolicy
from zerospeed.config.specs import OptimizerSpec, SchedulerSpec
from zerospeed.data.loader import DistributedLoader
from zerospeed.distributed.comm import Comm
from zerospeed.distributed.env import DEFAULT_TIMEOUT, init_distributed, process_group_timeout
from zerospeed.distributed.groups import group_rank, group_size
from zerospeed.distributed.mesh import Mesh
from zerospeed.engine import Engine
from zerospeed.layer_drop import LayerDropSchedule
from zerospeed.monitor.config import DeepSpeedMonitorConfig
from zerospeed.monitor.events import NoStepEvents, StepEvents, step_events
from zerospeed.monitor.monitor import MonitorMaster
from zerospeed.optim.exchange import ExchangingOptimizer
from zerospeed.precision.policy import MixedPrecisionPolicy
from zerospeed.profiling.flops_profiler.engine_profiler import EngineFlopsProfiler, ProfileSettings
from zerospeed.profiling.flops_profiler.report import RunFacts
from zerospeed.profiling.timers import NoTimers, PhaseTimers, WallClockTimers
from zerospeed.zero.contract import ModelState
from zerospeed.zero.external import external_parameters
from zerospeed.zero.grads import ReductionPolicy
from zerospeed.zero.optimizer import check_supported
from zerospeed.zero.owner import clear_owner, engine_owner, init_partition
from zerospeed.zero.replicated import ReplicatedState
from zerospeed.zero.sparse_rows import SparseRows
from zerospeed.zero.sparse_rows import refuse_unsupported as refuse_sparse
from zerospeed.zero.step_grads import NormScope

log = logging.getLogger("zerospeed")

# Config features this engine honours; anything else a config asks for is refused by name.
IMPLEMENTED = frozenset({
    "pipeline", "tensor_parallel", "tensor_parallel.partition_config", "tensor_parallel.preset_model=*",
    "fp16", "bf16", "gradient_clipping", "optimizer.type=*", "scheduler.type=*", "communication_data_type=*",
    "prescale_gradients", "gradient_predivide_factor", "dataloader_drop_last", "bf16.check_grad_overflow",
    "zero_optimization.stage=1", "zero_optimization.stage=2", "zero_optimization.stage=3",
    "data_types.grad_accum_dtype", "checkpoint.writer", "checkpoint.tag_validation=IGNORE",
    "checkpoint.tag_validation=FAIL", "zero_optimization.offload_optimizer.device=cpu",
    "zero_optimization.offload_optimizer.ratio", "zero_optimization.offload_param.device=cpu",
    "zero_optimization.offload_optimizer.device=nvme", "zero_optimization.offload_param.device=nvme", "zero_optimization.offload_optimizer.pipeline_read",
    "zero_optimization.offload_optimizer.pipeline_write", "zero_optimization.offload_optimizer.fast_init",
    "activation_checkpointing.cpu_checkpointing", "activation_checkpointing.contiguous_memory_optimization",
    "activation_checkpointing.synchronize_checkpoint_boundary", "activation_checkpointing.profile",
    "wall_clock_breakdown", "sparse_gradients", "progressive_layer_drop", "comms_logger", "flops_profiler",
    "elasticity",  # Config.build derives the batch sizes at the data-parallel size (zerospeed.elasticity)
    "tensorboard", "csv_monitor", "wandb", "comet",
    # save_16bit_model / _zero3_consolidated_16bit_state_dict always gather the stage-3 shards.
    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
})


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's ``--deepspeed`` / ``--deepspeed_config`` options to a user's parser."""
    group = parser.add_argument_group("zerospeed", "zerospeed configuration")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable zerospeed (accepted for DeepSpeed compatibility)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="zerospeed / DeepSpeed JSON config")
    group.add_argument("--deepscale", default=False, action="store_true", help="deprecated: use --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="deprecated: use --deepspeed_config")
    return parser


def initialize(args: Any = None, model: nn.Module | None = None,
               optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None = None,
               model_parameters: Iterable[Any] | None = None, training_data: Any = None,
               lr_scheduler: Any = None, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable[[list[Any]], Any] | None = None, config: Any = None,
               config_params: Any = None) -> tuple[Engine, Any, DistributedLoader | None, Any]:
    """Return ``(engine, optimizer, dataloader, lr_scheduler)`` exactly as ``deepspeed.initialize``."""
    # First: what initialize logs on the way (a warning about the data) gets the handler and level the
    # user chose, and a wrong ZEROSPEED_LOG_LEVEL fails before any work.
    _ensure_log_handler()
    if isinstance(args, nn.Module):
        raise TypeError("zerospeed.initialize got a model as its first argument (args); pass it as model=...")
    if model is None:
        raise ValueError("zerospeed.initialize needs model=... (an nn.Module)")
    from zerospeed.moe import setup as moe_setup
    from zerospeed.pipe import setup as pipe_setup
    from zerospeed.pipe.module import PipelineModule
    from zerospeed.tensor_parallel import setup as tp_setup

    pipeline = model if isinstance(model, PipelineModule) else None

    source = _config_source(args, config, config_params)
    if not isinstance(source, Config):  # read a file (or decode base64) once: the degrees and the config need it
        source = read_source(source)
    info = init_distributed(dist_init_required=dist_init_required)
    world = group_size()
    tp_settings = _tensor_parallel_settings(source)
    dims = tp_setup.declared_dims(world, model=model, mpu=mpu, autotp_size=int(tp_settings.get("autotp_size") or 0),
                                  pipeline_stages=pipeline.num_stages if pipeline is not None else 1)
    dims = moe_setup.with_experts(dims, model)
    if pipeline is not None:
        pipe_setup.check_dims(pipeline, dims)
    # batch arithmetic over the data-parallel ranks; pipeline.stages "auto" is the module's
    cfg = _resolved_config(source, dims.dp, {"pipeline.stages": dims.pp})
    if pipeline is not None and cfg.pipeline is not None and cfg.pipeline.stages != dims.pp:
        raise ConfigError(f"pipeline.stages={cfg.pipeline.stages} but the PipelineModule has {dims.pp} stages; "
                          f"set it to {dims.pp} or \"auto\"")
    cfg.check_implemented(IMPLEMENTED)  # refuses expert/sequence parallelism by name
    if pipeline is None and cfg.pipeline is not None:
        log.warning("the config has a \"pipeline\" section but the model is not a PipelineModule: it is ignored")
    # Collectives time out as the process group was asked to (init_distributed(timeout=...)).
    pg_timeout = process_group_timeout()
    mesh = tp_setup.build_mesh(dims, mpu, None if pg_timeout == DEFAULT_TIMEOUT else pg_timeout)
    _log_comms(cfg)
    comm = mesh.dp
    assert comm.world_size == cfg.world_size, "the batch arithmetic must use the data-parallel size"

    from zerospeed.precision.policy import policy_from_config

    _configure_activation_checkpointing(cfg)
    policy = policy_from_config(cfg)
    zero = ZeroPolicy.from_config(cfg.zero_optimization)
    training = TrainingPolicy.from_config(cfg)
    if cfg.sparse_gradients:
        refuse_sparse(stage=zero.stage, pipeline=pipeline is not None, tp=dims.tp)
    schedule: tuple[str, int] | None = None
    if pipeline is not None:
        pipe_setup.check_stage(pipeline, mesh)
        pipe_setup.check_config(cfg, pipeline, zero)
        schedule = pipe_setup.schedule_settings(cfg, pipeline, training.gradient_accumulation_steps)
    layer_drop = _layer_drop(cfg, model)
    model.to(get_accelerator().torch_device(info.local_rank))
    _detach_previous_engine(model)
    moe_setup.bind(model, mesh)
    tp_setup.apply_config_autotp(model, mesh, tp_settings)
    tp_setup.check_model_groups(model, mesh)
    layout = tp_setup.layout_of(model, mesh)
    policy.cast_module(model)
    _broadcast_from_rank0(model, comm, experts=mesh.comm("edp"))
    tp_setup.broadcast_replicated(model, mesh, layout)
    norm = tp_setup.norm_scope(model, mesh, layout)
    parts = None
    if pipeline is not None and schedule is not None:  # after the broadcasts: tied copies start from stage min's
        parts = pipe_setup.pipe_parts(pipeline, mesh, *schedule, device=next(model.parameters()).device)
        norm = pipe_setup.norm_scope(pipeline, mesh, norm)
    trainable = [p for p in model.parameters() if p.requires_grad]
    # The optimizer is made while the parameters are still whole (Adagrad makes its state at once).
    offload = _optimizer_offload(zero)
    if optimizer is None and cfg.optimizer is not None and moe_setup.has_experts(model):
        model_parameters = moe_setup.optimizer_groups(list(model_parameters or trainable))
    opt = _build_optimizer(optimizer, model_parameters, trainable, cfg, cpu_offload=offload)
    if offload:
        _warn_if_slow_on_cpu(opt)
    exchanging = _check_exchanging(opt, zero, pipeline=pipeline is not None, experts=moe_setup.has_experts(model))
    if moe_setup.has_experts(model):
        state: ModelState = _split_state(model, cfg, mesh, policy, zero=zero, training=training,
                                         has_optimizer=opt is not None, norm=norm, exchanging=exchanging)
    else:
        state = _model_state(model, cfg, comm, policy, zero=zero, training=training, has_optimizer=opt is not None,
                             norm=norm, exchanging=exchanging)
    if opt is not None:
        if state.stage > 0:
            check_supported(opt, cfg.zero_allow_untested_optimizer)
        state.adopt(opt)
    sched = _build_scheduler(lr_scheduler, opt, cfg)
    loader = None
    if training_data is not None:
        loader = DistributedLoader(training_data, micro_batch_size=training.train_micro_batch_size_per_gpu,
                                   rank=comm.rank, world_size=comm.world_size, collate_fn=collate_fn,
                                   drop_last=cfg.dataloader_drop_last,
                                   gradient_accumulation_steps=training.gradient_accumulation_steps,
                                   # once per job: every pipeline stage / tensor rank has a data-parallel rank 0
                                   warn=group_rank() == 0)
    if parts is not None:
        from zerospeed.pipe.engine import PipelineEngine

        engine: Engine = PipelineEngine(model, cfg, comm, policy, opt, sched, pipe=parts, state=state, mesh=mesh,
                                        timers=_timers(cfg), settings=training, training_dataloader=loader,
                                        flops_profiler=_flops_profiler(cfg, model, mesh, norm, training),
                                        step_events=_step_events(cfg, None))  # its batch loss is dp-averaged
    else:
        engine = Engine(model, cfg, comm, policy, opt, sched, state=state, mesh=mesh, timers=_timers(cfg),
                        settings=training, training_dataloader=loader, layer_drop=layer_drop,
                        flops_profiler=_flops_profiler(cfg, model, mesh, norm, training),
                        step_events=_step_events(cfg, comm))
    if group_rank() == 0:
        # One line at INFO; DeepSpeed's ~250-line dump of every default in force only at DEBUG.
        if log.isEnabledFor(logging.INFO):  # the line builds a config of defaults to compare with
            log.info("%s", config_line(cfg, training))
        if log.isEnabledFor(logging.DEBUG):  # the JSON of every key is built only to be shown
            log.debug("zerospeed config (resolved, every default in force):\n%s", cfg.to_json())
        if layer_drop is not None:
            log.info("progressive layer drop: theta(t) = (1 - %g) * exp(-%g * t) + %g, passed to the model's "
                     "training forwards as pld_theta", layer_drop.theta, layer_drop.gamma, layer_drop.theta)
        if offload or state.stage == 3 and zero.offload_param.enabled:
            log.info("offload: %s", state.describe_offload())
    return engine, opt, loader, sched


def _log_comms(cfg: Config) -> None:
    """A ``comms_logger`` section turns on the process's comms logger, which every Comm records into
    (``deepspeed.comm.log_summary`` prints it); left off, each call pays one attribute read."""
    from zerospeed.comm.summary import configure_from_config

    configure_from_config(cfg)


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    """The one config given: ``config=`` (or its old name ``config_params=``), or ``args.deepspeed_config``
    (or the deprecated ``--deepscale_config``). Two different ones are refused, as DeepSpeed does."""
    given = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None)
    deepscale = getattr(args, "deepscale_config", None)
    if deepscale is not None:
        if from_args is not None:
            raise ValueError("both --deepscale_config and --deepspeed_config were given; keep --deepspeed_config")
        log.warning("--deepscale_config is deprecated; use --deepspeed_config")
        from_args = deepscale
    if from_args is not None and given is not None:
        raise ValueError(f"two configs: config= was passed to initialize and args.deepspeed_config is {from_args!r}; "
                         f"drop one (DeepSpeed refuses this too)")
    source = given if given is not None else from_args
    if source is None:
        raise ValueError("no config: pass config= (a dict or a JSON path) or args with --deepspeed_config")
    return source


def _tensor_parallel_settings(source: Config | dict[str, Any]) -> dict[str, Any]:
    """The ``tensor_parallel`` section as written (its degree is needed before the batch arithmetic,
    which runs over the data-parallel ranks only; the section itself is validated with the config)."""
    if isinstance(source, Config):
        return source.tensor_parallel.model_dump()
    section = source.get("tensor_parallel") or {}
    if not isinstance(section, dict):
        return {}
    size = section.get("autotp_size", 0)
    return {**section, "autotp_size": size if isinstance(size, int) and not isinstance(size, bool) else 0}


def _layer_drop(cfg: Config, model: nn.Module) -> LayerDropSchedule | None:
    """``progressive_layer_drop``: theta(t)'s schedule, when the model's forward can take the keywords the
    engine will pass it in training (``progressive_layer_drop=True, pld_theta=theta``, as DeepSpeed)."""
    section = cfg.progressive_layer_drop
    if not section.enabled:
        return None
    schedule = LayerDropSchedule(theta=section.theta, gamma=section.gamma)
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read: let the first forward tell
        return schedule
    takes = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if not any(p.kind is p.VAR_KEYWORD for p in parameters) and not {"progressive_layer_drop", "pld_theta"} <= takes:
        raise ConfigError(f"progressive_layer_drop.enabled=true: the engine passes progressive_layer_drop=True and "
                          f"pld_theta=<theta(t)> to every training forward (as DeepSpeed), but "
                          f"{type(model).__name__}.forward does not accept them; add keyword parameters "
                          f"progressive_layer_drop: bool = False, pld_theta: float = 1.0 (and drop blocks with "
                          f"zerospeed.layer_drop.LayerDropPlan), or set progressive_layer_drop.enabled to false")
    return schedule


def _timers(cfg: Config) -> PhaseTimers:
    """``wall_clock_breakdown``: timed phases (device-synchronized) or none."""
    if not cfg.wall_clock_breakdown:
        return NoTimers()
    return WallClockTimers(synchronize=get_accelerator().synchronize)


def _flops_profiler(cfg: Config, model: nn.Module, mesh: Mesh, norm: NormScope,
                    training: TrainingPolicy) -> EngineFlopsProfiler | None:
    """``flops_profiler``: every rank profiles ``profile_step``; the totals are summed over the Comms the
    gradient norm is (tensor and pipeline ranks), each parameter counted where the norm counts it."""
    section = cfg.flops_profiler
    if not section.enabled:
        return None
    settings = ProfileSettings(profile_step=section.profile_step, module_depth=section.module_depth,
                               top_modules=section.top_modules, detailed=section.detailed,
                               output_file=section.output_file)
    facts = RunFacts(world_size=group_size(), dp_size=mesh.dims.dp, mp_size=mesh.dims.tp,
                     micro_batch=training.train_micro_batch_size_per_gpu)
    return EngineFlopsProfiler(model, settings=settings, facts=facts, across=norm.across,
                               counted_elsewhere=norm.counted_elsewhere, prints=group_rank() == 0,
                               recompute_fwd_factor=section.recompute_fwd_factor)


def _step_events(cfg: Config, comm: Comm | None) -> StepEvents | NoStepEvents:
    """The monitor sections: DeepSpeed's ``MonitorMaster`` (rank 0 writes) and the events each optimizer
    step writes to it; nothing when no monitor is enabled. ``comm``: what the losses are averaged over
    (None: they already are)."""
    master = MonitorMaster(DeepSpeedMonitorConfig.from_config(cfg), rank=group_rank())
    return step_events(master, comm=comm, fp16=cfg.fp16.enabled is True)


def _configure_activation_checkpointing(cfg: Config) -> None:
    """An ``activation_checkpointing`` section configures ``zerospeed.checkpointing`` (as DeepSpeed's
    engine does); without one, a configuration the user made with ``configure`` is left alone."""
    from zerospeed.config.schema_features import ActivationCheckpointingConfig

    if cfg.activation_checkpointing != ActivationCheckpointingConfig():
        from zerospeed import checkpointing

        checkpointing.configure(None, deepspeed_config=cfg)


#: Environment variable naming the ``zerospeed`` logger's level (debug shows the whole resolved config).
LOG_LEVEL_ENV = "ZEROSPEED_LOG_LEVEL"
_LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
               "critical": logging.CRITICAL}


def _ensure_log_handler() -> None:
    """Show zerospeed's INFO lines (config, step reports) like DeepSpeed does, unless the user set up logging.

    ``ZEROSPEED_LOG_LEVEL`` (debug, info, warning, error, critical) sets the ``zerospeed`` logger's level;
    without it a level the user set on that logger is kept, and an unset one becomes INFO.
    """
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[zerospeed] %(message)s"))
        log.addHandler(handler)
        if log.level == logging.NOTSET:
            log.setLevel(logging.INFO)
    wanted = os.environ.get(LOG_LEVEL_ENV, "").strip()
    if wanted:
        level = _LOG_LEVELS.get(wanted.lower())
        if level is None:
            raise ValueError(f"{LOG_LEVEL_ENV}={wanted!r} is not a log level; use one of {', '.join(_LOG_LEVELS)} "
                             f"(debug also logs the whole resolved config) or unset it")
        log.setLevel(level)


def config_line(cfg: Config, training: TrainingPolicy) -> str:
    """The config as one INFO line: the batch arithmetic, precision, ZeRO stage and the features asked for,
    and how to see all of it (DeepSpeed prints every key at start-up; here that dump is at DEBUG)."""
    batch, micro = training.train_batch_size, training.train_micro_batch_size_per_gpu
    accum = training.gradient_accumulation_steps
    features = ", ".join(features_beyond_defaults(cfg)) or "none"
    return (f"zerospeed config (resolved): batch {batch} = micro {micro} x accumulation {accum} x "
            f"{batch // (micro * accum)} data-parallel rank(s), {cfg.precision.value}, ZeRO stage "
            f"{cfg.zero_optimization.stage}; features beyond the defaults: {features} (the full config is "
            f"logged at DEBUG: {LOG_LEVEL_ENV}=debug, or logging.getLogger('zerospeed').setLevel(logging.DEBUG))")


def features_beyond_defaults(cfg: Config) -> tuple[str, ...]:
    """``cfg.features_in_use()`` less what a config of defaults uses with the same value.

    ``features_in_use`` names what is switched on, and one default is on: gradient_clipping 1.0 (DeepSpeed
    0.19.8's default), so every config "used" clipping whether it mentioned it or not. A feature that a
    config of defaults also uses is kept only where its value differs from the default (clipping at 0.5);
    a config that restates a default is taken as not asking.
    """
    defaults = load_config({"train_micro_batch_size_per_gpu": 1}, world_size=1)
    on_by_default = set(defaults.features_in_use())
    if not on_by_default:
        return cfg.features_in_use()
    mine, default = cfg.to_dict(), defaults.to_dict()
    return tuple(feature for feature in cfg.features_in_use()
                 if feature not in on_by_default
                 or _at_key(mine, feature.partition("=")[0]) != _at_key(default, feature.partition("=")[0]))


def _at_key(config: dict[str, Any], dotted: str) -> Any:
    """The value at a dotted key path of a config dict (``None`` where it is absent)."""
    value: Any = config
    for name in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(name)
    return value


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _resolved_config(source: Any, world: int, known: dict[str, Any] | None = None) -> Config:
    """Load the config and fill the ``"auto"`` values the engine can know (``known``, by key path);
    refuse the rest by name.

    Batch sizes set to ``"auto"`` are derived from the ones that are given and the world size
    (a lone micro batch means one accumulation step), as if they had been left out.
    """
    cfg = load_config(source, world_size=world)
    pending = set(cfg.unresolved_auto())
    fill = {key: value for key, value in (known or {}).items() if key in pending}
    if fill:
        cfg = cfg.resolve_auto(fill)
        pending = set(cfg.unresolved_auto())
    batch_auto = [key for key in _BATCH_KEYS if key in pending]
    if batch_auto and len(batch_auto) < len(_BATCH_KEYS):
        given = {key: (None if key in batch_auto else getattr(cfg, key)) for key in _BATCH_KEYS}
        sizes = resolve_batch(given["train_batch_size"], given["train_micro_batch_size_per_gpu"],
                              given["gradient_accumulation_steps"], world)
        cfg = cfg.resolve_auto({key: getattr(sizes, key) for key in batch_auto})
        pending = set(cfg.unresolved_auto())
    if pending:
        raise ConfigError("\n".join(f'{key}: "auto" has no value zerospeed can derive here; set it in the config'
                                    for key in sorted(pending)))
    return cfg


def _detach_previous_engine(model: nn.Module) -> None:
    """A model given to ``initialize`` again leaves its previous engine (whose hooks would otherwise
    take every gradient first): parameters are made whole and unhooked, the old engine is dead."""
    states: list[ModelState] = []
    for p in model.parameters():
        owner = engine_owner(p)
        if owner is not None and all(owner.state is not known for known in states):
            states.append(owner.state)
    for state in states:
        log.warning("zerospeed.initialize: this model belongs to an earlier engine; that engine stops working")
        state.detach_model()


def _broadcast_from_rank0(model: nn.Module, comm: Comm, *, experts: Comm) -> None:
    """Start every rank from rank 0's weights and buffers, as DDP and DeepSpeed do (parameters
    partitioned by zero.Init were broadcast when they were made); expert parameters from the first
    rank of their expert-data-parallel group (the ranks holding the same experts)."""
    from zerospeed.moe.utils import is_moe_param

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if init_partition(tensor) is None:
                (experts if is_moe_param(tensor) else comm).broadcast(tensor.data, src=0)


def _model_state(model: nn.Module, cfg: Config, comm: Comm, policy: MixedPrecisionPolicy, *, zero: ZeroPolicy,
                 training: TrainingPolicy, has_optimizer: bool = True, norm: NormScope = NormScope(),
                 owns: Callable[[nn.Parameter], bool] | None = None,
                 reduction: ReductionPolicy | None = None, exchanging: bool = False) -> ModelState:
    """Stage 0 keeps everything on every rank; stages 1-3 shard (see zerospeed.zero). ``owns``: only
    these parameters, over ``comm``; ``reduction``: how their gradients are averaged (default: the config's);
    ``exchanging``: the optimizer exchanges by itself once warm (1-bit), so stages 1-2 hand over to a
    replicated state then (:mod:`zerospeed.zero.handover`)."""
    reduction = reduction or reduction_policy(cfg, policy)
    stage = zero.stage
    if stage == 0:
        for p in model.parameters():  # built under zero.Init but trained unsharded: make them whole
            partition = init_partition(p)
            if partition is not None:
                p.data = partition.take_full().to(p.dtype)
                clear_owner(p)
        return _replicated_state(model, cfg, comm, policy, zero=zero, reduction=reduction, norm=norm, owns=owns)
    from zerospeed.offload.store import StateStore
    from zerospeed.zero.eager import StepOverlap
    from zerospeed.zero.sharded import ShardedState

    device = next(model.parameters()).device
    store = StateStore.from_config(zero, device, get_accelerator(), aio=cfg.aio)
    if not has_optimizer and store.optimizer.swaps:
        # no optimizer (inference, evaluation): there are no states to swap, so nothing goes to NVMe
        log.info("zero_optimization.offload_optimizer.device is nvme but there is no optimizer: nothing to offload")
        store = dataclasses.replace(store, optimizer=store.compute, offload_ratio=1.0)
    overlap = StepOverlap.decide(offloaded=store.offloads_optimizer, swapped=store.swaps,
                                 clipping=training.gradient_clipping,
                                 loss_scaled=policy.loss_scaling is not None, overflow_checked=policy.check_overflow,
                                 sub_group_size=zero.sub_group_size)
    sharded = ShardedState(model, comm, stage=stage, master_dtype=policy.master_dtype,
                           accum_dtype=policy.grad_accum_dtype, reduction=reduction,
                           zero_cfg=zero, external=external_parameters(model), store=store, overlap_step=overlap,
                           norm=norm, owns=owns, with_optimizer=has_optimizer)
    if not exchanging:
        return sharded
    from zerospeed.zero.handover import HandoverState

    return HandoverState(sharded, replicated=functools.partial(_replicated_state, model, cfg, comm, policy, zero=zero,
                                                               reduction=reduction, norm=norm, owns=owns))


def _replicated_state(model: nn.Module, cfg: Config, comm: Comm, policy: MixedPrecisionPolicy, *, zero: ZeroPolicy,
                      reduction: ReductionPolicy, norm: NormScope,
                      owns: Callable[[nn.Parameter], bool] | None) -> ReplicatedState:
    """Stage 0's state (also what a 1-bit optimizer at stage 1-2 is handed over to once it compresses)."""
    return ReplicatedState(model, comm, master_dtype=policy.master_dtype, accum_dtype=policy.grad_accum_dtype,
                           bucket_elems=zero.reduce_bucket_size, reduction=reduction, norm=norm, owns=owns,
                           rows=SparseRows.of_model(model) if cfg.sparse_gradients else None)


def _check_exchanging(opt: torch.optim.Optimizer | None, zero: ZeroPolicy, *, pipeline: bool, experts: bool) -> bool:
    """Whether ``opt`` exchanges by itself (1-bit); refuses what such an optimizer cannot run with (a client
    optimizer object escapes the config's checks)."""
    if not isinstance(opt, ExchangingOptimizer):
        return False
    name = type(opt).__name__
    if experts:
        raise ConfigError(f"optimizer: {name} cannot train a model with expert (MoE) layers: their parameters are "
                          f"a second model state over their own replica group, which would step the optimizer "
                          f"twice per window and shift its warm-up and freeze; use Adam or AdamW")
    if zero.stage == 3:
        raise ConfigError(f"zero_optimization.stage: 3 cannot be combined with {name}: once it compresses, every "
                          f"rank needs the whole momentum and updates its whole parameters, which stage 3 never "
                          f"holds; use stage 0, 1 or 2")
    if zero.offloads_optimizer:
        raise ConfigError(f"zero_optimization.offload_optimizer cannot be combined with {name}: once it compresses, "
                          f"its state is whole on every rank and steps there; remove offload_optimizer")
    if pipeline and zero.stage > 0:
        raise ConfigError(f"zero_optimization.stage: {zero.stage} with pipeline parallelism cannot be combined "
                          f"with {name}; use stage 0")
    return zero.stage > 0


def _split_state(model: nn.Module, cfg: Config, mesh: Mesh, policy: MixedPrecisionPolicy, *, zero: ZeroPolicy,
                 training: TrainingPolicy, has_optimizer: bool, norm: NormScope,
                 exchanging: bool = False) -> ModelState:
    """A model with experts: dense parameters over the data-parallel group, experts over their
    expert-data-parallel group (averaged over the whole data-parallel size), at the configured stage."""
    from zerospeed.moe import setup as moe_setup
    from zerospeed.moe.utils import is_moe_param
    from zerospeed.zero.split_state import SplitState

    dense = _model_state(model, cfg, mesh.dp, policy, zero=zero, training=training, has_optimizer=has_optimizer,
                         norm=norm, owns=lambda p: not is_moe_param(p), exchanging=exchanging)
    experts = _model_state(model, cfg, mesh.comm("edp"), policy, zero=zero, training=training,
                           has_optimizer=has_optimizer, norm=moe_setup.expert_norm(norm, mesh), owns=is_moe_param,
                           exchanging=exchanging,
                           reduction=moe_setup.expert_reduction(reduction_policy(cfg, policy), mesh))
    return SplitState([dense, experts], names=[{}, moe_setup.global_expert_names(model)])


def _optimizer_offload(zero: ZeroPolicy) -> bool:
    """Whether the optimizer is offloaded to the CPU (refused at stage 0, which has no shard to offload)."""
    if not zero.offloads_optimizer:
        return False
    if zero.stage == 0:
        raise ConfigError("zero_optimization.offload_optimizer: offloading the optimizer needs ZeRO stage 1, 2 "
                          "or 3 (it offloads this rank's shard); set zero_optimization.stage")
    return True


def _warn_if_slow_on_cpu(optimizer: torch.optim.Optimizer | None) -> None:
    from zerospeed.ops.cpu_optimizer import CPUOptimizer

    if optimizer is not None and not isinstance(optimizer, CPUOptimizer):
        log.warning("zero_optimization.offload_optimizer: %s steps on the CPU as a plain torch optimizer, in "
                    "several passes; zerospeed.ops.adam.CPUAdam (chosen automatically for a configured "
                    "Adam/AdamW) does it in one", type(optimizer).__name__)


def reduction_policy(cfg: Config, policy: MixedPrecisionPolicy) -> ReductionPolicy:
    """DeepSpeed's gradient averaging settings, as one value."""
    return ReductionPolicy(reduce_dtype=policy.reduce_dtype, prescale=cfg.prescale_gradients,
                           predivide_factor=cfg.gradient_predivide_factor)


def _build_optimizer(optimizer: Any, model_parameters: Any, trainable: list[nn.Parameter],
                     cfg: Config, cpu_offload: bool = False) -> torch.optim.Optimizer | None:
    if optimizer is not None and cfg.optimizer is not None:
        raise ValueError("an optimizer was passed to initialize and the config has an \"optimizer\" section; "
                         "keep one of them")
    params = list(model_parameters) if model_parameters is not None else list(trainable)
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(params)
    if optimizer is None and cfg.optimizer is not None:
        from zerospeed.optim.factory import build_optimizer

        optimizer = build_optimizer(OptimizerSpec.from_config(cfg.optimizer), params, cpu_offload=cpu_offload)
    return optimizer


def _build_scheduler(lr_scheduler: Any, optimizer: torch.optim.Optimizer | None, cfg: Config) -> Any:
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        return lr_scheduler(optimizer)
    if lr_scheduler is not None:
        return lr_scheduler
    if cfg.scheduler is None:
        return None
    if optimizer is None:
        raise ValueError("the config has a \"scheduler\" but there is no optimizer to schedule")
    from zerospeed.optim.schedules import build_scheduler

    return build_scheduler(SchedulerSpec.from_config(cfg.scheduler), optimizer)
