"""The bytes of model state one rank will hold, computed from shapes with the states' own layout code.

The figures are those ``engine.memory_breakdown()`` reports after a step (``params``, ``grads``,
``optimizer_states``, ``offloaded``, ``on_nvme``), because they come from the same decisions the
states make: :func:`zerospeed.zero.layout.build_units` (units, coalescing, stage-3 persistence),
:class:`zerospeed.sharding.plan.ShardPlan` (padding and each rank's pieces),
:func:`zerospeed.zero.reducer.plan_buckets` (stage 0's buckets) and
:class:`zerospeed.offload.store.StateStore` (which tier keeps each unit's optimizer state). The
model may live on the meta device: nothing here reads a value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from zerospeed.accelerator import get_accelerator
from zerospeed.config.policies import ZeroPolicy
from zerospeed.offload.store import StateStore
from zerospeed.sharding.plan import ShardPlan, UnitPlan
from zerospeed.zero.flat_param import shape_of
from zerospeed.zero.layout import MIN_UNIT_ELEMS, UnitSpec, build_units

POOL_KEEP = 3  # freed accumulators the reducer keeps for reuse (zero.reducer.GradReducer's BufferPool)

__all__ = ["OPTIMIZER_STATES", "OptimizerStates", "StateBytes", "StateSettings", "model_state_plan",
           "unit_layout"]


@dataclass(frozen=True)
class OptimizerStates:
    """What an optimizer keeps per parameter tensor: ``per_element`` master-dtype tensors the size of
    the parameter (Adam's two moments) and ``scalar_bytes`` in a tensor of its own (torch's ``step``)."""

    per_element: int
    scalar_bytes: int = 0


#: Per optimizer class (the one the engine builds, see ``optim.factory``): torch's Adam/AdamW/Adagrad
#: keep ``step`` as a 0-d fp32 tensor, zerospeed's CPU optimizers and Lamb as a Python int.
OPTIMIZER_STATES: dict[str, OptimizerStates] = {
    "AdamW": OptimizerStates(2, 4), "Adam": OptimizerStates(2, 4), "CPUAdam": OptimizerStates(2),
    "DeepSpeedCPUAdam": OptimizerStates(2), "Lamb": OptimizerStates(2), "Adagrad": OptimizerStates(1, 4),
    "CPUAdagrad": OptimizerStates(1), "SGD": OptimizerStates(0), "SGDMomentum": OptimizerStates(1),
    "CPULion": OptimizerStates(1), "none": OptimizerStates(0),
}


@dataclass(frozen=True)
class StateSettings:
    """The decisions of a run that set its model-state bytes (built from a config by ``plan.config``)."""

    zero: ZeroPolicy
    world_size: int
    param_dtype: torch.dtype = torch.float32
    accum_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32
    optimizer: str = "AdamW"

    def __post_init__(self) -> None:
        if self.zero.stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_optimization.stage={self.zero.stage} is not a ZeRO stage; use 0, 1, 2 or 3")
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size} must be >= 1")
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer={self.optimizer!r} has no known state layout; one of "
                             f"{', '.join(OPTIMIZER_STATES)}")

    @property
    def stage(self) -> int:
        return self.zero.stage

    @property
    def states(self) -> OptimizerStates:
        return OPTIMIZER_STATES[self.optimizer]


@dataclass(frozen=True)
class StateBytes:
    """One rank's model state, by kind (the keys of ``engine.memory_breakdown()``). ``offloaded`` and
    ``on_nvme`` say where part of the first three lives; ``buffers`` is what the state holds between
    steps beyond them (stage-3 gathered units, pooled gradient accumulators)."""

    params: int
    grads: int
    optimizer_states: int
    buffers: int = 0
    offloaded: int = 0
    on_nvme: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_states

    def as_breakdown(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer_states": self.optimizer_states,
                "total": self.total, "buffers": self.buffers, "offloaded": self.offloaded, "on_nvme": self.on_nvme}


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def unit_layout(model: nn.Module, settings: StateSettings) -> tuple[list[UnitSpec], ShardPlan]:
    """The units and shard plan :class:`~zerospeed.zero.sharded.ShardedState` builds for ``model``."""
    zero = settings.zero
    bucket = max(zero.reduce_bucket_size, 1)
    threshold = zero.param_persistence_threshold if zero.stage == 3 else 0
    min_unit = min(MIN_UNIT_ELEMS, bucket) if zero.stage < 3 else 0
    specs = build_units(model, bucket_elems=bucket, persistence_threshold=threshold, min_unit_elems=min_unit)
    plan = ShardPlan.build([(s.name, [(n, shape_of(p)) for n, p in zip(s.param_names, s.params)]) for s in specs],
                           settings.world_size)
    return specs, plan


def model_state_plan(model: nn.Module, settings: StateSettings, rank: int = 0) -> StateBytes:
    """Rank ``rank``'s model-state bytes after a training step, as ``memory_breakdown()`` reports them."""
    if not 0 <= rank < settings.world_size:
        raise ValueError(f"rank={rank} is outside world_size={settings.world_size}")
    if settings.stage == 0:
        return _replicated(model, settings)
    return _sharded(model, settings, rank)


def _replicated(model: nn.Module, s: StateSettings) -> StateBytes:
    """Stage 0 (``ReplicatedState``): every parameter, one gradient bucket element each, fp32 masters
    when the model is 16-bit, the optimizer's states per master."""
    params = list(model.parameters())  # tied parameters once, as named_parameters()
    trainable = [p for p in params if p.requires_grad]
    n_train = sum(p.numel() for p in trainable)
    param_bytes = sum(p.numel() for p in params) * _itemsize(s.param_dtype)
    masters = n_train * _itemsize(s.master_dtype) if trainable and s.param_dtype != s.master_dtype else 0
    states = s.states.per_element * n_train * _itemsize(s.master_dtype) + s.states.scalar_bytes * len(trainable)
    return StateBytes(params=param_bytes, grads=n_train * _itemsize(s.accum_dtype), optimizer_states=masters + states)


def _sharded(model: nn.Module, s: StateSettings, rank: int) -> StateBytes:
    """Stages 1-3 (``ShardedState``): per unit its full buffer (persistent) or shard, its gradient
    (stage 1: the whole padded accumulator; 2-3: the shard), its fp32 master and optimizer states."""
    specs, plan = unit_layout(model, s)
    store = StateStore.from_config(s.zero, torch.device("cpu"), get_accelerator())
    tiers = store.optimizer_tiers([u.shard_numel for u in plan.units])
    p_size, a_size, m_size = _itemsize(s.param_dtype), _itemsize(s.accum_dtype), _itemsize(s.master_dtype)
    params = grads = states = offloaded = on_nvme = 0
    param_swaps = store.params.swaps
    in_cpu = store.params_in_memory  # offload_param.max_in_cpu: the first shards that fit stay in memory
    for spec, unit, tier in zip(specs, plan.units, tiers, strict=True):
        persistent = s.stage < 3 or spec.persistent
        shard_bytes = unit.shard_numel * p_size
        swapped = param_swaps and not persistent and unit.shard_numel > in_cpu
        if param_swaps and not persistent and not swapped:
            in_cpu -= unit.shard_numel
        if persistent:
            params += unit.padded_numel * p_size
        elif swapped:
            on_nvme += shard_bytes  # the shard lives in its file
        else:
            params += shard_bytes
            offloaded += shard_bytes if store.offloads_params else 0
        if not any(p.requires_grad for p in spec.params):
            pass  # (frozen units never get a gradient accumulator)
        elif s.stage == 1:
            grads += unit.padded_numel * a_size
        elif not tier.swaps:
            grads += unit.shard_numel * a_size
            offloaded += unit.shard_numel * a_size if tier != store.compute else 0
        unit_states = _unit_optimizer_bytes(unit, spec, s, rank)
        # ``StateTier.place`` keeps the shard itself as the master when it already has the master's
        # dtype and device (a swapped stage-3 shard gets a copy: the shard goes to its file)
        separate_master = s.param_dtype != s.master_dtype or swapped
        master = unit.shard_numel * m_size if separate_master else 0
        if tier.swaps:  # one slab per unit: [master | states | gradient], all fp32
            on_nvme += unit.shard_numel * 4 * (2 + s.states.per_element)
            continue
        states += master + unit_states
        if tier != store.compute:
            offloaded += master + unit_states
    buffers = 0 if s.stage == 1 else _pooled_accumulators(specs, plan, s.stage) * a_size
    return StateBytes(params=params, grads=grads, optimizer_states=states, buffers=buffers, offloaded=offloaded,
                      on_nvme=on_nvme)


def _pooled_accumulators(specs: list[UnitSpec], plan: ShardPlan, stage: int) -> int:
    """Elements of the freed gradient accumulators the reducer's pool keeps after a backward (stages
    2-3: ``BufferPool(keep=3)``; units reduced in reverse registration order, stage 3's persistent unit
    last, each taking a pooled buffer of its size when there is one and giving it back once reduced)."""
    trainable = [u for u, spec in enumerate(specs) if any(p.requires_grad for p in spec.params)]
    backwards = list(reversed(trainable))
    mixed = stage == 3 and len({specs[u].persistent for u in trainable}) > 1
    order = [u for u in backwards if not (mixed and specs[u].persistent)] + \
            [u for u in backwards if mixed and specs[u].persistent]
    pool: list[int] = []
    for u in order:
        size = plan.units[u].padded_numel
        if size in pool:
            pool.remove(size)
        pool.append(size)
        del pool[: max(len(pool) - POOL_KEEP, 0)]
    return sum(pool)


def _unit_optimizer_bytes(unit: UnitPlan, spec: UnitSpec, s: StateSettings, rank: int) -> int:
    """The optimizer's per-element states of this rank's pieces of ``unit`` (one tensor per piece of a
    trainable parameter; one-element pieces hold none: their only state is the step counter)."""
    if not s.states.per_element:
        return 0
    trainable = {name for name, p in zip(spec.param_names, spec.params) if p.requires_grad}
    numel = sum(piece.numel for piece in unit.pieces(rank) if piece.param in trainable and piece.numel > 1)
    return s.states.per_element * numel * _itemsize(s.master_dtype)


def param_count(model: nn.Module) -> int:
    """Distinct parameter elements (tied weights once)."""
    return sum(math.prod(shape_of(p)) for p in model.parameters())
