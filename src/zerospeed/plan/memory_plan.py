"""One rank's peak memory for a config, by kind, and the cheapest configs that fit a budget.

The model-state lines are :func:`zerospeed.plan.states.model_state_plan` (what
``engine.memory_breakdown()`` will report); activations come from the meta-device trace
(:mod:`zerospeed.plan.activations`); the workspace is the largest transient the step makes beside
them (autograd's gradient of the largest parameter before it lands in a bucket, stage 3's gathered
units, torch Adam's two temporaries of the largest tensor it updates); the baseline and the first
step's fixed cost are measured (:mod:`zerospeed.plan.baseline`). Pure once those are known.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zerospeed.plan.activations import ActivationTrace
from zerospeed.plan.baseline import Baseline
from zerospeed.plan.settings import RunSettings
from zerospeed.plan.states import StateBytes, model_state_plan, unit_layout

__all__ = ["MemoryPlan", "Candidate", "cheapest_fitting", "plan_memory"]

#: glibc's default (dynamic) mmap threshold: the share of a step's transients (activations, workspace)
#: the heap keeps on top of the live bytes once freed tensors stop going back to the system. Calibrated
#: on the 98M GPT at stages 0-3 (measured 0.3-0.9, run to run and over the first steps; docs/memory_plan.md); 0 when the
#: ranks pin the threshold (MALLOC_MMAP_THRESHOLD_).
HEAP_RETENTION = 0.5
MALLOC_MODES = ("default", "fixed")

_CPU_OPTIMIZERS = ("CPUAdam", "DeepSpeedCPUAdam", "CPUAdagrad", "CPULion", "Lamb")


@dataclass(frozen=True)
class MemoryPlan:
    """Per-rank peak bytes by kind for one set of run settings."""

    settings: RunSettings
    states: StateBytes
    activations: int
    workspace: int
    baseline: Baseline
    allocator: int = 0

    @property
    def peak(self) -> int:
        """The rank's peak resident memory on the CPU (everything but the NVMe tier)."""
        return (self.baseline.idle + self.baseline.runtime + self.states.total + self.states.buffers
                + self.activations + self.workspace + self.allocator)

    @property
    def device_peak(self) -> int:
        """What an accelerator would hold: the peak without the process baseline and the CPU tier."""
        return self.peak - self.baseline.idle - self.baseline.runtime - self.allocator - self.states.offloaded

    def lines(self) -> list[tuple[str, int]]:
        s = self.states
        return [("baseline (idle rank: python, torch, zerospeed, gloo)", self.baseline.idle),
                ("runtime (first training step's fixed cost)", self.baseline.runtime),
                ("parameters", s.params), ("gradients", s.grads), ("optimizer states", s.optimizer_states),
                ("buffers (pooled gradient accumulators)", s.buffers), ("workspace (step transients)", self.workspace),
                ("activations", self.activations),
                ("allocator (glibc heap keeping freed transients)", self.allocator), ("peak per rank", self.peak),
                ("  of which CPU tier (offloaded state)", s.offloaded), ("NVMe tier (files, not memory)", s.on_nvme)]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def workspace_bytes(model: nn.Module, settings: RunSettings) -> int:
    """The largest transient beside the states at the step's peak (see the module docstring)."""
    st = settings.states
    trainable = [p.numel() for p in model.parameters() if p.requires_grad]
    largest = max(trainable, default=0)
    backward = largest * _itemsize(st.param_dtype)  # param.grad before the hook copies it into its bucket
    if st.stage == 3:
        specs, plan = unit_layout(model, st)
        fulls = sorted((u.padded_numel for u, spec in zip(plan.units, specs) if not spec.persistent), reverse=True)
        # a unit is released after its module only when its next use is farther than max_reuse_distance
        # elements: with DeepSpeed's default (1e9) every unit stays gathered from forward through its
        # backward, up to max_live_parameters; otherwise the unit in use and the one prefetched
        if st.zero.max_reuse_distance >= sum(fulls):
            gathered = min(sum(fulls), st.zero.max_live_parameters + (fulls[0] if fulls else 0))
        else:
            gathered = sum(fulls[:2])
        backward += gathered * _itemsize(st.param_dtype)
    if st.optimizer in _CPU_OPTIMIZERS or st.optimizer == "none":
        return backward
    if st.stage == 0:
        biggest = largest
    else:
        specs, plan = unit_layout(model, st)
        biggest = max((piece.numel for u in plan.units for r in range(st.world_size) for piece in u.pieces(r)),
                      default=0)
    # torch's Adam/AdamW: sqrt(exp_avg_sq) and its quotient exist together for the largest tensor
    return max(backward, 2 * biggest * _itemsize(st.master_dtype))


def plan_memory(model: nn.Module, trace: ActivationTrace, settings: RunSettings, baseline: Baseline, *,
                traced_batch: int, malloc: str = "default") -> MemoryPlan:
    """The plan for ``settings``; ``trace`` was taken at ``traced_batch`` rows (scaled to the micro-batch).
    ``malloc``: ``"default"`` (glibc's dynamic mmap threshold: add :data:`HEAP_RETENTION` of the
    transients) or ``"fixed"`` (the ranks pin it: freed tensors go back to the system)."""
    if malloc not in MALLOC_MODES:
        raise ValueError(f"malloc={malloc!r}: expected one of {', '.join(MALLOC_MODES)}")
    states = max((model_state_plan(model, settings.states, rank) for rank in range(settings.states.world_size)),
                 key=lambda s: s.total + s.buffers)
    activations = trace.scaled(settings.micro_batch / traced_batch).peak(settings.checkpoint_activations)
    workspace = workspace_bytes(model, settings)
    allocator = int(HEAP_RETENTION * (activations + workspace)) if malloc == "default" else 0
    return MemoryPlan(settings=settings, states=states, activations=activations, workspace=workspace,
                      baseline=baseline, allocator=allocator)


@dataclass(frozen=True)
class Candidate:
    """A config the search tried and its plan."""

    plan: MemoryPlan

    @property
    def label(self) -> str:
        st = self.plan.settings.states
        parts = [f"stage {st.stage}", f"offload_optimizer={st.zero.offload_optimizer.device.value}"]
        if st.stage == 3:
            parts.append(f"offload_param={st.zero.offload_param.device.value}")
        parts += [f"activation_checkpointing={'on' if self.plan.settings.checkpoint_activations else 'off'}",
                  f"micro_batch={self.plan.settings.micro_batch}"]
        return ", ".join(parts)

    def cost(self) -> tuple[int, int, int, int]:
        """Cheaper first: no offload, no recomputation, the largest micro-batch, the lowest stage."""
        st = self.plan.settings.states
        offloads = int(st.zero.offloads_optimizer) + int(st.stage == 3 and st.zero.offload_param.enabled)
        return (offloads, int(self.plan.settings.checkpoint_activations), -self.plan.settings.micro_batch, st.stage)


def cheapest_fitting(model: nn.Module, trace: ActivationTrace, base: RunSettings, baseline: Baseline, *,
                     traced_batch: int, budget: int, on_device: bool, limit: int = 5,
                     malloc: str = "default") -> list[Candidate]:
    """The ``limit`` cheapest configs (stage, offload, activation checkpointing, micro-batch halved down
    to 1) whose peak (``device_peak`` when ``on_device``, else the CPU peak) fits in ``budget`` bytes."""
    batches = []
    mb = base.micro_batch
    while mb >= 1:
        batches.append(mb)
        mb //= 2
    found = []
    for stage in (0, 1, 2, 3):
        for opt in ("none", "cpu") if stage else ("none",):
            for par in ("none", "cpu") if stage == 3 else ("none",):
                for ckpt in (False, True):
                    for mb in batches:
                        settings = base.with_changes(stage=stage, offload_optimizer=opt, offload_param=par,
                                                     micro_batch=mb, checkpoint_activations=ckpt)
                        plan = plan_memory(model, trace, settings, baseline, traced_batch=traced_batch,
                                           malloc=malloc)
                        if (plan.device_peak if on_device else plan.peak) <= budget:
                            found.append(Candidate(plan))
                            break  # the largest micro-batch that fits, for this choice
    return sorted(found, key=Candidate.cost)[:limit]
