"""ZeRO stages 1-3 as one model-state strategy: units, gradient shards, optimizer shards, stage-3 hooks.

What differs between the stages is chosen here, once, as values: which units are persistent (all
of them for stages 1-2; under stage 3 only the small parameters), how gradients are kept
(:class:`GradSharding`), and whether a :class:`ParamCoordinator` gathers parameters around each
module (stage 3). The engine drives it exactly like :class:`ReplicatedState`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Callable, ContextManager, Iterator, Sequence

import torch
from torch import nn

from zerospeed.config.policies import ZeroPolicy
from zerospeed.distributed.comm import Comm
from zerospeed.offload import MemoryStorage, StateStore, SwappedSlabs, TierStorage, itemsize
from zerospeed.sharding.plan import Piece, ShardPlan
from zerospeed.sharding.slots import ParamInfo, Slot
from zerospeed.zero.contract import CheckpointGroups, ParamOwner
from zerospeed.zero.ds_param import Partitioned, ZeroParamStatus
from zerospeed.zero.flat_param import FlatParamUnit, UnitPhase, shape_of
from zerospeed.zero.owner import clear_owner, init_partition, set_owner
from zerospeed.zero.grads import ReductionPolicy
from zerospeed.zero.layout import MIN_UNIT_ELEMS, UnitSpec, build_units, module_users
from zerospeed.zero.memory import storage_bytes
from zerospeed.ops.cpu_optimizer import CPUOptimizer
from zerospeed.zero.eager import EagerSteps, StepOverlap
from zerospeed.zero.optimizer import ZeroOptimizer
from zerospeed.zero.params import ParamCoordinator, PrefetchPolicy
from zerospeed.zero.sharded_grads import GradSharding, ShardedGrads
from zerospeed.zero.step_grads import NormScope, StepGrads

log = logging.getLogger("zerospeed")

# Optimizers whose update of an element depends on that element only: safe to step sub-group by
# sub-group (Lamb, or anything unknown, may look at whole tensors or count steps per call).
ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = (CPUOptimizer, torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD,
                                            torch.optim.Adagrad)


class ShardedState:
    """This rank's shards of a model's parameters, gradients and optimizer states."""

    def __init__(self, model: nn.Module, comm: Comm, *, stage: int, master_dtype: torch.dtype,
                 accum_dtype: torch.dtype, reduction: ReductionPolicy, zero_cfg: ZeroPolicy,
                 external: dict[int, list[nn.Parameter]] | None = None, store: StateStore | None = None,
                 overlap_step: StepOverlap | None = None, norm: NormScope = NormScope(),
                 owns: Callable[[nn.Parameter], bool] | None = None, with_optimizer: bool = True):
        """``store``: where state lives (default: all on the parameters' device); ``overlap_step``:
        whether the (offloaded) optimizer step may overlap backward (default: no); ``norm``: how the
        global gradient norm counts parameters when the model is split beyond data parallelism.
        ``with_optimizer=False`` (no optimizer, e.g. ZeRO-Inference): no fp32 masters (each unit's
        master is its shard), gradient shards only if a backward ever lands one, and :meth:`adopt`
        refuses -- so a model streamed from NVMe costs its gathered units and nothing per parameter."""
        if stage not in (1, 2, 3):
            raise ValueError(f"ShardedState is for ZeRO stages 1-3, got {stage}")
        self.stage = stage
        self.module = model
        self.comm = comm
        self.norm = norm
        bucket = max(zero_cfg.reduce_bucket_size, 1)
        threshold = zero_cfg.param_persistence_threshold if stage == 3 else 0
        # stages 1-2: a unit is one reduce-scatter and one all-gather, so small ones are joined (stage
        # 3 gathers each unit around the module that owns it: the module tree's units stay)
        min_unit = min(MIN_UNIT_ELEMS, bucket) if stage < 3 else 0
        specs = build_units(model, bucket_elems=bucket, persistence_threshold=threshold, min_unit_elems=min_unit,
                            owns=owns)
        self.specs = specs
        self.plan = ShardPlan.build([(s.name, [(n, shape_of(p)) for n, p in zip(s.param_names, s.params)])
                                     for s in specs], comm.world_size)
        device = next(iter(p for spec in specs for p in spec.params)).device if specs else torch.device("cpu")
        self.store = store if store is not None else StateStore.on_device(device)
        self.param_storage: TierStorage = MemoryStorage()  # the parameter tier's NVMe run, if it swaps
        self.param_swap: SwappedSlabs | None = None  # the swapped parameter shards in it
        self.units = self._build_units(specs, stage)
        overlap = zero_cfg.overlap_comm
        sharding = GradSharding.for_stage(stage)
        self.zero_optimizer = ZeroOptimizer(self.units, comm, master_dtype=master_dtype,
                                            allgather_bucket_elems=zero_cfg.allgather_bucket_size,
                                            store=self.store, grads_in_slabs=not sharding.keep_full,
                                            keep_masters=with_optimizer)
        # enabled by adopt(), once the optimizer is known to be elementwise
        self._overlap_requested = overlap_step or StepOverlap(False, 1, "not requested")
        self.eager = EagerSteps(self.zero_optimizer, self._overlap_requested.without("no optimizer"),
                                grad_of=lambda u: self.grads.shard_of(u))
        self.grads = ShardedGrads(self.units, comm, sharding, accum_dtype=accum_dtype,
                                  policy=reduction, overlap=overlap,
                                  max_in_flight_elems=zero_cfg.reduce_bucket_size,
                                  shard_tiers=self.store.optimizer_tiers([p.shard_numel for p in self.plan.units]),
                                  on_final_shard=self.eager.ready,
                                  norm_skip=[[(piece.shard_offset, piece.shard_offset + piece.numel)
                                              for piece in plan.pieces(comm.rank)
                                              if piece.param in norm.counted_elsewhere]
                                             for plan in self.plan.units],
                                  lazy_shards=not with_optimizer)
        self._final_backward_end: float | None = None  # when this window's last backward ended
        # seconds of the last step (for benchmarks): the early updates (wall), how much of them ran
        # before backward ended, how long step() waited for them, the update at the step, and
        # casting/gathering the shards
        self.last_step_times: dict[str, float] = {}
        self.coordinator: ParamCoordinator | None = None
        if stage == 3:
            policy = PrefetchPolicy(prefetch_elems=zero_cfg.prefetch_bucket_size,
                                    max_live_elems=zero_cfg.max_live_parameters,
                                    max_reuse_distance=zero_cfg.max_reuse_distance,
                                    overlap=overlap)
            self.coordinator = ParamCoordinator(model, self.units, module_users(model, specs, external), policy)
        ds_id = 0
        for u, unit in enumerate(self.units):
            unit.bind_master(self.zero_optimizer.masters[u],
                             resident=functools.partial(self.resident_state, [u], write_back=True))
            for i, p in enumerate(unit.params):
                # stage 3 partitions: the parameter answers DeepSpeed's ds_* attributes (zero.ds_param)
                set_owner(p, Zero3ParamRef(self, u, i, ds_id) if stage == 3 else UnitParamRef(self, u, i))
                ds_id += 1

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.zero_optimizer.optimizer

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        self.zero_optimizer.adopt(optimizer)
        if self.zero_optimizer.swapped is not None:
            self.grads.keep_in_slabs(self.zero_optimizer.swapped)
        overlap = self._overlap_requested
        if overlap.enabled and not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
            overlap = overlap.without(f"{type(optimizer).__name__} is not known to be elementwise (Lamb's trust "
                                      f"ratio needs whole-parameter norms), so the step runs after backward")
        self.eager.overlap = overlap

    def _build_units(self, specs: list[UnitSpec], stage: int) -> list[FlatParamUnit]:
        """The units, in order. ``offload_param.device: nvme``: each non-persistent unit's shard goes
        to a file of its own as soon as the unit is made (so the shards are never all in memory), and
        is read in for its all-gather and for its update (see :class:`SlabLease`) — except the first
        units whose shards fit in ``max_in_cpu`` elements, which stay in CPU memory (as in DeepSpeed)."""
        units: list[FlatParamUnit] = []
        tier = self.store.params
        if not tier.swaps:
            for plan, spec in zip(self.plan.units, specs):
                units.append(FlatParamUnit(plan, list(spec.params), self.comm, persistent=stage < 3 or spec.persistent,
                                           shard_tier=tier))
            return units
        run = tier.open(self.comm, purpose="params", what="offload_param nvme")
        error: BaseException | None = None
        slabs: SwappedSlabs | None = None
        # ``max_in_cpu``: the first units whose shards fit stay in CPU memory (the same on every rank)
        in_memory, budget = set(), self.store.params_in_memory
        for plan, spec in zip(self.plan.units, specs):
            if not spec.persistent and plan.shard_numel <= budget:
                in_memory.add(id(plan))
                budget -= plan.shard_numel
        try:
            swapped = [(plan, spec) for plan, spec in zip(self.plan.units, specs)
                       if not spec.persistent and id(plan) not in in_memory]
            sizes = [plan.shard_numel * itemsize(spec.params[0].dtype) for plan, spec in swapped]
            # zero.Init partitions on the same disk are deleted as each parameter is taken, before its
            # unit is written: the room needed at the peak is what they do not give back, or one unit
            freed = sum(partition.file_bytes() for spec in specs for p in spec.params
                        if (partition := init_partition(p)) is not None)
            run.check_room(max(sum(sizes) - freed, max(sizes, default=0)),
                           f"the parameter shards of {len(swapped)} units")
            slabs = run.slabs("param", keep_buffers=self.store.param_buffers)
        except (OSError, ValueError, RuntimeError) as exc:
            error = exc
        for plan, spec in zip(self.plan.units, specs):
            # every rank makes every unit (zero.Init partitions are gathered collectively), even after
            # an error here, so that the ranks fail together below instead of waiting on each other
            unit = FlatParamUnit(plan, list(spec.params), self.comm, persistent=stage < 3 or spec.persistent,
                                 shard_tier=tier)
            units.append(unit)
            if error is not None and not unit.persistent:
                unit.shard = torch.empty(0, dtype=unit.dtype)  # failing anyway: hold no shard (all in memory)
            elif slabs is not None and not unit.persistent and id(plan) not in in_memory:
                try:
                    alias = unit.shard.view(-1)  # the same memory; ``unit.shard`` is re-pointed in and out
                    unit.keep_shard_in(slabs.lease(slabs.add(alias, [unit.shard], check_room=False)))
                except (OSError, ValueError, RuntimeError) as exc:
                    error = exc
        try:
            self.comm.fail_together(error, "offload_param nvme")
        except BaseException:
            run.close()
            raise
        assert slabs is not None
        self.param_swap, self.param_storage = slabs, run
        return units

    def describe_offload(self) -> str:
        """Where state lives and when the optimizer steps, in one line (logged at initialize)."""
        return f"{self.store.describe()}; optimizer step: {self.eager.overlap.reason}"

    # -- backward ---------------------------------------------------------------------------
    def begin_backward(self, reduce: bool) -> None:
        if self._final_backward_end is not None and self.eager.overlap.enabled and any(self.eager.eligible):
            raise RuntimeError("a second engine.backward() on the last micro-batch of an accumulation window: the "
                               "optimizer step overlaps backward (offload without clipping), so that window's "
                               "update has already begun; call backward once per micro-batch (add the losses "
                               "first) and engine.step() after it")
        self.grads.begin_backward(reduce)

    def end_backward(self) -> None:
        self.grads.end_backward()
        if self.grads.final:
            self._final_backward_end = time.perf_counter()
            # the last sub-group starts now, while the engine goes on into step()
            self.eager.flush(during_backward=False)
        if self.coordinator is not None:
            self.coordinator.end_backward()

    def allows_no_sync(self) -> bool:
        """Stage 1 reduces only at the window's end anyway; stages 2-3 reduce every micro-batch
        into shards, so there is nothing a skipped reduction could keep (as in DeepSpeed)."""
        return self.stage == 1

    # -- step -------------------------------------------------------------------------------
    def step_grads(self) -> StepGrads:
        self.grads.finish()
        return self.grads.step_grads()

    @property
    def unit_count(self) -> int:
        return len(self.units)

    def keeps(self, param: torch.Tensor) -> bool:
        return any(p is param for unit in self.units for p in unit.params)

    def squared_norm(self, grads: StepGrads) -> torch.Tensor:
        return self.sum_over_ranks(grads.local_norm().double().square())

    def sum_over_ranks(self, local: torch.Tensor) -> torch.Tensor:
        total = local.detach().to(device=self.store.compute.device, dtype=torch.float64).reshape(1).clone()
        self.comm.all_reduce(total)
        return self.norm.sum_across(total[0])

    def apply(self) -> None:
        start = time.perf_counter()
        done, copied = self.eager.drain()
        waited = time.perf_counter() - start
        self.zero_optimizer.step(self.grads.shards(), done=done, copied=copied, before_update=self.grads.prepare)
        spans, end = self.eager.spans, self._final_backward_end or start
        times = self.zero_optimizer.times
        self.last_step_times = {"early_update": sum(b - a for a, b in spans),
                                "early_under_backward": sum(max(min(b, end) - a, 0.0) for a, b in spans),
                                "early_wait": waited, "update": times["update"], "publish": times["publish"]}

    def zero(self) -> None:
        try:
            stepped, _ = self.eager.drain()
            if stepped:
                log.warning("an accumulation window ended without engine.step() after its last backward, whose "
                            "overlapped optimizer step had already updated %d of %d units; those updates are kept",
                            len(stepped), len(self.units))
        finally:
            self.eager.spans = []
            self._final_backward_end = None
            self.grads.zero()

    def settle(self) -> None:
        """Wait for early optimizer jobs before masters or states are read or written from outside."""
        self.eager.wait()

    def resident_state(self, units: Sequence[int] | None = None, write_back: bool = False) -> ContextManager[None]:
        """Masters and optimizer states of ``units`` (default: all) in memory inside the block (the
        NVMe tier reads them, and writes them back after when ``write_back``; others: nothing to do)."""
        swapped = self.zero_optimizer.swapped
        if swapped is not None:
            return swapped.resident(units, write_back=write_back)
        if self.zero_optimizer.keeps_masters or self.param_swap is None:
            return contextlib.nullcontext()
        # no optimizer: each unit's master is its shard, which the parameter tier may keep in a file
        return self._shards_resident(range(len(self.units)) if units is None else units, write_back)

    @contextlib.contextmanager
    def _shards_resident(self, units: Sequence[int], write_back: bool) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for u in units:
                stack.enter_context(self.units[u].shard_resident(write_back=write_back))
            yield

    # -- queries ----------------------------------------------------------------------------
    def unit_of(self, param: nn.Parameter) -> tuple[FlatParamUnit, int]:
        for unit in self.units:
            for i, p in enumerate(unit.params):
                if p is param:
                    return unit, i
        raise KeyError(f"a tensor of shape {tuple(param.shape)} is not a parameter of this model")

    def release_all(self) -> None:
        """Free every gathered stage-3 parameter (``engine.empty_partition_cache``), also those the
        coordinator fetched ahead for a next forward."""
        if self.coordinator is not None:
            self.coordinator.release_all()
        for unit in self.units:
            unit.release()

    # -- full views of one parameter (zerospeed.utils.safe_get_* ; collective) --------------
    def full_fp32(self, unit_index: int, index: int) -> torch.Tensor:
        self.settle()
        unit = self.units[unit_index]
        with self.resident_state([unit_index]):
            return unit.param_slice(unit.gather_shard_values(self.zero_optimizer.masters[unit_index]), index).float()

    def full_grad(self, unit_index: int, index: int) -> torch.Tensor | None:
        unit = self.units[unit_index]
        if not unit.trainable[index]:
            return None
        with self.resident_state([unit_index]):  # an NVMe-kept gradient shard comes in with its slab
            shard = self.grads.shard_of(unit_index)
            return unit.param_slice(unit.gather_shard_values(shard), index).float()

    def full_optimizer_state(self, unit_index: int, index: int, key: str) -> torch.Tensor | None:
        self.settle()
        unit = self.units[unit_index]
        shard = torch.zeros(unit.plan.shard_numel, dtype=torch.float32, device=unit.full.device)
        found = torch.zeros(1, device=unit.full.device)  # collectives run on the compute device
        optimizer = self.zero_optimizer.optimizer
        with self.resident_state([unit_index]):
            for piece, u, offset, numel in self.zero_optimizer.pieces():
                value = optimizer.state.get(piece, {}).get(key) if optimizer is not None else None
                if u == unit_index and isinstance(value, torch.Tensor) and value.numel() == numel:
                    shard[offset: offset + numel].copy_(value.reshape(-1))
                    found += 1
        self.comm.all_reduce(found)
        if not found.item() or not unit.trainable[index]:
            return None
        return unit.param_slice(unit.gather_shard_values(shard), index).clone()

    def set_full_fp32(self, unit_index: int, index: int, value: torch.Tensor) -> None:
        """Overwrite one parameter everywhere it lives on this rank (every rank passes the same value;
        no communication)."""
        self.settle()
        unit = self.units[unit_index]
        slot = unit.plan.params[index]
        if tuple(value.shape) != slot.shape:
            raise ValueError(f"{slot.name}: value has shape {tuple(value.shape)}, the parameter {slot.shape}")
        flat = value.detach().reshape(-1)
        with torch.no_grad(), self.resident_state([unit_index], write_back=True), \
                unit.shard_resident(write_back=True):
            for piece in unit.plan.pieces(self.comm.rank):
                if piece.param == slot.name:
                    part = flat[piece.start: piece.end]
                    self.zero_optimizer.masters[unit_index][piece.shard_offset: piece.shard_offset + piece.numel].copy_(part)
                    unit.shard[piece.shard_offset: piece.shard_offset + piece.numel].copy_(part)
            if unit.persistent or unit.gathered:
                unit.wait()
                unit.param_slice(unit.full, index).copy_(value)

    def memory_breakdown(self) -> dict[str, int]:
        self.settle()
        unit_tensors = [t for unit in self.units for t in unit.tensors()]
        resident = [u.full for u in self.units if u.persistent] + [u.shard for u in self.units if not u.persistent]
        params = storage_bytes(resident)
        gathered = storage_bytes(unit_tensors, exclude=resident)
        grad_state, grad_transient = self.grads.tensors()
        grads = storage_bytes(grad_state)
        states = storage_bytes(self.zero_optimizer.state_tensors(), exclude=resident)
        buffers = gathered + storage_bytes(grad_transient, exclude=grad_state)
        return {"params": params, "grads": grads, "optimizer_states": states,
                "total": params + grads + states, "buffers": buffers, "offloaded": self._offloaded_bytes(),
                "on_nvme": self._swapped_bytes()}

    def _offloaded_bytes(self) -> int:
        """Bytes of the above held in an offload tier (CPU memory) rather than with the computation."""
        zopt, compute = self.zero_optimizer, self.store.compute
        held = [m for m, unit, tier in zip(zopt.masters, self.units, zopt.tiers)
                if tier != compute and m is not unit.shard]
        if zopt.optimizer is not None:
            for piece, u, *_ in zopt.pieces():
                if zopt.tiers[u] != compute:
                    held += [v for v in zopt.optimizer.state.get(piece, {}).values()
                             if isinstance(v, torch.Tensor) and v.numel() > 1]
        if self.store.offloads_params:
            held += [unit.shard for unit in self.units if not unit.persistent]
        if not self.grads.sharding.keep_full:  # stages 2-3 keep gradient shards in the optimizer's tier
            held += [g.shard for g, tier in zip(self.grads.units, zopt.tiers) if tier != compute]
        return storage_bytes(held)

    def offload_io(self) -> dict[str, float]:
        """NVMe traffic of this rank since initialize (see :meth:`Engine.offload_io`)."""
        return (self.zero_optimizer.storage.io_stats() + self.param_storage.io_stats()).as_dict()

    def _swapped_bytes(self) -> int:
        """Bytes of state kept in swap files (optimizer state and parameter shards)."""
        return self.zero_optimizer.storage.bytes_held() + self.param_storage.bytes_held()

    # -- checkpoints -------------------------------------------------------------------------
    def checkpoint_params(self) -> list[ParamInfo]:
        return [ParamInfo(slot.name, slot.shape, unit.dtype, p.requires_grad)
                for unit in self.units for slot, p in zip(unit.plan.params, unit.params)]

    def checkpoint_groups(self) -> CheckpointGroups:
        """Swapped optimizer state: one unit per group, each made resident with :meth:`resident_state`
        while its slots are used, so a checkpoint never needs more than one unit's state in memory."""
        if self.zero_optimizer.swapped is None and (self.zero_optimizer.keeps_masters or self.param_swap is None):
            return CheckpointGroups.everything_in_memory()
        return CheckpointGroups(tuple((u,) for u in range(len(self.units))), in_memory=False)

    def checkpoint_slots(self, for_save: bool, units: Sequence[int] | None = None) -> list[Slot]:
        """The pieces of this rank's shards (the same for saving and loading), of ``units`` (default:
        all). Swapped units must be resident (:meth:`resident_state`) while the slots are used."""
        self.settle()
        out = []
        wanted = set(range(len(self.units)) if units is None else units)
        for u, unit in enumerate(self.units):
            if u not in wanted:
                continue
            master = self.zero_optimizer.masters[u]
            index = {slot.name: i for i, slot in enumerate(unit.plan.params)}
            for piece in unit.plan.pieces(self.comm.rank):
                param = unit.params[index[piece.param]]
                key = self.zero_optimizer.piece_of.get(id(param)) if param.requires_grad else None
                out.append(Slot(piece.param, piece.start, piece.end,
                                master[piece.shard_offset: piece.shard_offset + piece.numel], key, 0))
        return out

    def full_param_values(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter's whole compute-dtype value, by name (collective: stage-3 units are gathered
        one at a time and released again; each value is valid until the next one is asked for)."""
        for unit in self.units:
            was_gathered = unit.gathered
            unit.gather()
            for i, slot in enumerate(unit.plan.params):
                yield slot.name, unit.param_slice(unit.full, i)
            if not was_gathered:
                unit.release()

    def after_checkpoint_load(self, units: Sequence[int] | None = None) -> None:
        """The masters were overwritten: refresh the compute-dtype shards, re-gather the persistent
        units (collective), let stage-3 units gather afresh on next use, and drop stale gradients."""
        wanted = range(len(self.units)) if units is None else units
        for u in wanted:
            self.units[u].release()
        with torch.no_grad():
            for u in wanted:
                unit, master = self.units[u], self.zero_optimizer.masters[u]
                if master is not unit.shard:
                    with unit.shard_resident(write_back=True):
                        unit.shard.copy_(master)
                unit.publish_shard(async_op=False)
        self.grads.zero()

    def remove_hooks(self) -> None:
        self.grads.remove_hooks()
        self.eager.close()
        if self.zero_optimizer.swapped is not None:
            self.zero_optimizer.swapped.close()
        self.param_storage.close()
        if self.coordinator is not None:
            self.coordinator.remove_hooks()

    def detach_model(self) -> None:
        """Give the model back whole and unhooked (a second ``initialize`` on it; collective)."""
        self.remove_hooks()
        with torch.no_grad():
            for unit in self.units:
                unit.gather()
                for i, p in enumerate(unit.params):
                    p.data = unit.param_slice(unit.full, i).clone()
                    clear_owner(p)


class UnitParamRef(ParamOwner):
    """A parameter's back-reference to the ZeRO state that holds its shards."""

    def __init__(self, state: ShardedState, unit_index: int, index: int):
        self.state: ShardedState = state
        self.unit_index, self.index = unit_index, index

    @property
    def unit(self) -> FlatParamUnit:
        return self.state.units[self.unit_index]

    def full_fp32(self) -> torch.Tensor:
        return self.state.full_fp32(self.unit_index, self.index)

    def full_grad(self) -> torch.Tensor | None:
        return self.state.full_grad(self.unit_index, self.index)

    def full_optimizer_state(self, key: str) -> torch.Tensor | None:
        return self.state.full_optimizer_state(self.unit_index, self.index, key)

    def set_full_fp32(self, value: torch.Tensor) -> None:
        self.state.set_full_fp32(self.unit_index, self.index, value)


class Zero3ParamRef(UnitParamRef, Partitioned):
    """A stage-3 parameter's back-reference, which also answers DeepSpeed's ZeRO-3 attributes: the
    parameter's part of this rank's unit shard is its partition (units pack parameters, so no
    parameter has padding of its own: ``padding_size()`` is 0)."""

    def __init__(self, state: ShardedState, unit_index: int, index: int, ds_id: int):
        super().__init__(state, unit_index, index)
        self.ds_id = ds_id
        self.shape = self.unit.plan.params[index].shape

    @property
    def status(self) -> ZeroParamStatus:
        phase = self.unit.phase
        if phase is UnitPhase.GATHERED:
            return ZeroParamStatus.AVAILABLE
        return ZeroParamStatus.NOT_AVAILABLE if phase is UnitPhase.RELEASED else ZeroParamStatus.INFLIGHT

    @property
    def persistent(self) -> bool:
        return self.unit.persistent

    def _piece(self) -> Piece | None:
        unit = self.unit
        name = unit.plan.params[self.index].name
        return next((pc for pc in unit.plan.pieces(unit.comm.rank) if pc.param == name), None)

    def partition_numel(self) -> int:
        piece = self._piece()
        return piece.numel if piece is not None else 0

    def padding_size(self) -> int:
        return 0

    def partition_tensor(self) -> torch.Tensor:
        piece, shard = self._piece(), self.unit.shard
        return shard[piece.shard_offset: piece.shard_offset + piece.numel] if piece is not None else shard[:0]

    def make_available(self) -> None:
        self.unit.gather()

    def repartition(self) -> None:
        self.unit.release()


__all__ = ["ShardedState", "UnitParamRef", "UnitSpec", "Zero3ParamRef"]
