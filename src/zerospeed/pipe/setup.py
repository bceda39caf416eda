"""What ``zerospeed.initialize`` does for a :class:`PipelineModule`, kept out of the entry and the engine.

The degrees: pipeline stages from the module, tensor parallelism from the usual sources (``mpu``, the
config, the model's layers), data parallelism from what is left; a module's own topology and an
``mpu``'s pipeline size must agree. Then the checks a pipeline adds (ZeRO 0-2, no offload yet, a
schedule that fits), the norm scope (tied weights counted on their lowest stage, sums over tensor and
pipeline ranks) and the collaborators of :class:`~zerospeed.pipe.engine.PipelineEngine`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from zerospeed.config import Config, ConfigError
from zerospeed.config.policies import ZeroPolicy
from zerospeed.distributed.comm import Comm
from zerospeed.distributed.mesh import Mesh, ParallelDims
from zerospeed.pipe.engine import PipeParts
from zerospeed.pipe.module import PipelineModule
from zerospeed.pipe.p2p import StageLink
from zerospeed.pipe.schedules import ScheduleError, schedule_for
from zerospeed.pipe.tied import TiedWeights, counted_elsewhere
from zerospeed.zero.step_grads import NormScope


def is_pipeline(model: nn.Module) -> bool:
    return isinstance(model, PipelineModule)


def check_dims(module: PipelineModule, dims: ParallelDims) -> None:
    """The mesh's degrees agree with what the module was built for (stages; its topology's data and
    model axes when it has them)."""
    if dims.pp != module.num_stages:
        raise ValueError(f"the PipelineModule has {module.num_stages} stages but the mesh (mpu) has pipeline size "
                         f"{dims.pp}; build both for the same number of stages")
    topo = module.topology()
    axes = topo.get_axis_names()
    if "model" in axes and topo.get_dim("model") != dims.tp:
        raise ValueError(f"the PipelineModule's topology has model (tensor) parallel size {topo.get_dim('model')} but "
                         f"the job's tensor-parallel size is {dims.tp}; make them agree")
    if "model" in axes and "data" in axes and topo.get_dim("data") != dims.dp:
        raise ValueError(f"the PipelineModule's topology has data-parallel size {topo.get_dim('data')} but the "
                         f"job's is {dims.dp}; make them agree")


def check_stage(module: PipelineModule, mesh: Mesh) -> None:
    if mesh.comm("pp").rank != module.stage_id:
        raise ValueError(f"this rank builds pipeline stage {module.stage_id} but sits at pipeline coordinate "
                         f"{mesh.comm('pp').rank} of the mesh; build the PipelineModule's topology with the "
                         f"axes pipe, data, model (PipeModelDataParallelTopology) as the mesh lays ranks out")


def check_config(cfg: Config, module: PipelineModule, zero: ZeroPolicy) -> None:
    """Refuse, by key, what the pipeline engine does not run yet, and apply the config to the module."""
    if zero.stage > 2:
        raise ConfigError(f"zero_optimization.stage={zero.stage}: pipeline parallelism runs with ZeRO stages 0, 1 "
                          "and 2 (stage 3 gathers parameters in every forward, which the stages' own layers make "
                          "unnecessary); set zero_optimization.stage to 1 or 2")
    if cfg.progressive_layer_drop.enabled:
        raise ConfigError("progressive_layer_drop.enabled=true: not supported with a PipelineModule (its forward "
                          "takes one input, so the pld_theta keyword has nowhere to go; DeepSpeed 0.19.6 fails there "
                          "too); set progressive_layer_drop.enabled to false or train without pipeline stages")
    for key, offloaded in (("offload_optimizer", zero.offloads_optimizer), ("offload_param", zero.offload_param.enabled)):
        if offloaded:
            raise ConfigError(f"zero_optimization.{key}: offloading is not supported with pipeline parallelism "
                              "yet; remove the section, or train without pipeline stages")
    section = cfg.pipeline
    if section is not None and section.activation_checkpoint_interval > 0:
        module.activation_checkpoint_interval = section.activation_checkpoint_interval  # as DeepSpeed


def schedule_settings(cfg: Config, module: PipelineModule, micro_batches: int) -> tuple[str, int]:
    """The schedule's name and the chunks per stage, checked against the module and the batch."""
    section = cfg.pipeline
    name = section.schedule if section is not None else "1f1b"
    chunks = module.chunks
    if section is not None and section.chunks is not None and section.chunks != chunks:
        raise ConfigError(f"pipeline.chunks={section.chunks} but the PipelineModule was built with chunks={chunks}; "
                          f"pass PipelineModule(..., chunks={section.chunks}) or drop pipeline.chunks")
    if name == "interleaved_1f1b" and chunks < 2:
        raise ConfigError("pipeline.schedule=\"interleaved_1f1b\" runs several model chunks per stage: build the "
                          "PipelineModule with chunks=2 (or more), or choose another schedule")
    if name != "interleaved_1f1b" and chunks > 1:
        raise ConfigError(f"the PipelineModule has chunks={chunks} (virtual stages), which only "
                          f"pipeline.schedule=\"interleaved_1f1b\" runs; set that schedule or build it with chunks=1")
    if name == "zb_h1" and module.activation_checkpoint_interval > 0:
        raise ConfigError("pipeline.schedule=\"zb_h1\" with activation checkpointing is not supported (its split "
                          "backward keeps each block's graph between the input and weight gradients); use "
                          "schedule \"1f1b\" or activation_checkpoint_interval=0")
    try:
        schedule_for(name, stages=module.num_stages, micro_batches=micro_batches, chunks=chunks)
    except ScheduleError as exc:
        raise ConfigError(f"pipeline.schedule={name!r} with gradient_accumulation_steps={micro_batches}: {exc}") \
            from exc
    return name, chunks


def norm_scope(module: PipelineModule, mesh: Mesh, tp_scope: NormScope) -> NormScope:
    """Tied tensors counted on their lowest stage only; the norm summed over tensor and pipeline ranks."""
    across: tuple[Comm, ...] = tp_scope.across + ((mesh.comm("pp"),) if mesh.dims.pp > 1 else ())
    return NormScope(counted_elsewhere=tp_scope.counted_elsewhere | counted_elsewhere(module), across=across)


def pipe_parts(module: PipelineModule, mesh: Mesh, schedule: str, chunks: int, device: Any) -> PipeParts:
    """The link to the neighbour stages and the tied weights (collective: every rank builds the same
    groups); the tied copies start equal here."""
    link = StageLink(mesh.comm("pp"), module.stage_id, device=device) if mesh.dims.pp > 1 else None
    tied = TiedWeights(module, mesh)
    tied.broadcast_weights()
    return PipeParts(link=link, tied=tied, schedule=schedule, chunks=chunks)


__all__ = ["is_pipeline", "check_dims", "check_stage", "check_config", "schedule_settings", "norm_scope",
           "pipe_parts"]
