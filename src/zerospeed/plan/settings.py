"""A config, read the way ``zerospeed.initialize`` reads it, as the few values a memory plan needs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from zerospeed.config import Config, load_config
from zerospeed.config.policies import TrainingPolicy, ZeroPolicy
from zerospeed.config.values import OffloadDevice
from zerospeed.plan.states import StateSettings
from zerospeed.precision.policy import policy_from_config

__all__ = ["RunSettings", "model_layout_unplanned", "optimizer_class", "run_settings", "unplanned"]


@dataclass(frozen=True)
class RunSettings:
    """What the plan varies: the model-state settings, the micro-batch and activation checkpointing."""

    states: StateSettings
    micro_batch: int
    checkpoint_activations: bool = False

    @property
    def stage(self) -> int:
        return self.states.stage

    def with_changes(self, *, stage: int | None = None, offload_optimizer: str | None = None,
                     offload_param: str | None = None, micro_batch: int | None = None,
                     checkpoint_activations: bool | None = None) -> RunSettings:
        """These settings with some choices changed (the search over cheaper configs); the optimizer
        class follows the offload choice as the engine's factory decides it."""
        zero = self.states.zero
        if stage is not None:
            zero = dataclasses.replace(zero, stage=stage)
        if offload_optimizer is not None:
            zero = dataclasses.replace(zero, offload_optimizer=dataclasses.replace(
                zero.offload_optimizer, device=OffloadDevice(offload_optimizer)))
        if offload_param is not None:
            zero = dataclasses.replace(zero, offload_param=dataclasses.replace(
                zero.offload_param, device=OffloadDevice(offload_param)))
        optimizer = self.states.optimizer
        base = {"CPUAdam": "AdamW"}.get(optimizer, optimizer)
        optimizer = "CPUAdam" if zero.offloads_optimizer and base in ("Adam", "AdamW") else base
        states = dataclasses.replace(self.states, zero=zero, optimizer=optimizer)
        return RunSettings(states=states,
                           micro_batch=self.micro_batch if micro_batch is None else micro_batch,
                           checkpoint_activations=(self.checkpoint_activations if checkpoint_activations is None
                                                   else checkpoint_activations))


def unplanned(what: str) -> str:
    """Why a plan is refused for a layout it does not model (a wrong plan would be worse than none)."""
    return (f"{what} is not planned: zerospeed plan models data parallelism (ZeRO stages 0-3, CPU/NVMe offload, "
            f"activation checkpointing), not how other parallelisms split parameters and activations over ranks; "
            f"plan the model without it, or measure a short run's peak (engine.memory_breakdown(), peak RSS)")


def model_layout_unplanned(model: nn.Module) -> str | None:
    """The refusal for a model whose layout the plan does not model (pipeline stages, MoE experts), or None."""
    from zerospeed.moe.layer import MoE
    from zerospeed.pipe.module import PipelineModule

    if isinstance(model, PipelineModule):
        return unplanned("a PipelineModule (pipeline parallelism)")
    if any(isinstance(module, MoE) for module in model.modules()):
        return unplanned("a model with MoE layers (expert parallelism)")
    return None


def optimizer_class(cfg: Config, zero: ZeroPolicy) -> str:
    """The class name of the optimizer the engine builds for ``cfg`` (``optim.factory.build_optimizer``):
    Adam/AdamW become ``CPUAdam`` under ``offload_optimizer``; ``SGD`` with momentum keeps a buffer."""
    section = cfg.optimizer
    if section is None:
        return "none"
    name = section.type
    if name in ("Adam", "AdamW"):
        return "CPUAdam" if zero.offloads_optimizer and zero.stage > 0 else name
    if name == "SGD":
        return "SGDMomentum" if float(section.params.get("momentum", 0) or 0) else "SGD"
    return name


def run_settings(source: object, world_size: int, *, checkpoint_activations: bool = False) -> RunSettings:
    """``source`` (a config dict, path or :class:`Config`) at ``world_size`` data-parallel ranks."""
    cfg = load_config(source, world_size=world_size)  # type: ignore[arg-type]
    if cfg.tensor_parallel.autotp_size > 1:
        raise ValueError(unplanned(f"tensor_parallel.autotp_size={cfg.tensor_parallel.autotp_size} (tensor "
                                   f"parallelism)"))
    policy = policy_from_config(cfg)
    zero = ZeroPolicy.from_config(cfg.zero_optimization)
    training = TrainingPolicy.from_config(cfg)
    states = StateSettings(zero=zero, world_size=world_size, param_dtype=policy.param_dtype,
                           accum_dtype=policy.grad_accum_dtype, master_dtype=policy.master_dtype,
                           optimizer=optimizer_class(cfg, zero))
    return RunSettings(states=states, micro_batch=training.train_micro_batch_size_per_gpu,
                       checkpoint_activations=checkpoint_activations)
