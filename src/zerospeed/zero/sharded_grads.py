"""Gradient reduce-scatter for ZeRO stages 1-3: each rank ends with the averaged gradient of its shard.

The one gradient reducer (:mod:`zero.reducer`) with a reduce-scatter, one bucket per unit: hooks add
each gradient into its unit's flat accumulator (in the accumulation dtype) and free ``param.grad``;
once every trainable parameter of a unit has its gradient, the unit is reduce-scattered
asynchronously while backward goes on, strictly in one order, identical on every rank (first
reverse registration order, then, after the first reduction, the order units completed on rank 0).
This module decides where each rank's reduced shard is kept.

The two ways of doing it differ only in the :class:`GradSharding` value:

* stage 1 keeps a full accumulator per unit for the whole accumulation window and reduces once,
  at the window's last micro-batch; the shard is a view of the accumulator.
* stages 2-3 reduce every micro-batch, add the result into a shard-sized gradient that lives
  across the window, and free the full accumulator as soon as it has been reduced.

Under ``offload_optimizer.device: nvme`` the stage-2/3 gradient shard of an NVMe-tier unit is not
kept in memory at all: it is the gradient region of the unit's slab (:meth:`ShardedGrads.keep_in_slabs`),
written as each reduction completes, with its norm measured on the window's last micro-batch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from zerospeed.distributed.comm import Comm
from zerospeed.lifecycle import Transitions
from zerospeed.offload.tier import StateTier
from zerospeed.zero.flat_param import FlatParamUnit
from zerospeed.zero.reducer import (Bucket, BufferPool, GradReducer, GradSlot, ReduceScatter, ReducerStateError,
                                    ReductionPolicy, second_backward_error)
from zerospeed.zero.step_grads import Ranges, StepGrads, counted_norm

_BufferPool = BufferPool  # the name tests and older code import from here


@dataclass(frozen=True)
class GradSharding:
    """How gradients are kept between micro-batches (see the module docstring)."""

    keep_full: bool  # stage 1: full accumulators live across the window; reduce at its end only

    @classmethod
    def for_stage(cls, stage: int) -> "GradSharding":
        if stage not in (1, 2, 3):
            raise ValueError(f"gradient sharding is for ZeRO stages 1-3, got stage {stage}")
        return cls(keep_full=stage == 1)


class SlabGradStore(Protocol):
    """Where the stage-2/3 gradient shards of some units live outside memory (their NVMe slabs): the
    seam :meth:`ShardedGrads.keep_in_slabs` takes (:class:`zero.swapped.SwappedOptimizerState` today)."""

    grads: dict[int, torch.Tensor]  # unit index -> its gradient region (empty while swapped out)

    def holds_grad(self, unit_index: int) -> bool: ...

    def store_grad(self, unit_index: int, values: torch.Tensor, accumulate: bool,
                   accum_dtype: torch.dtype) -> torch.Tensor: ...

    def flush_grads(self) -> None: ...


class ShardWindow(enum.Enum):
    """What a unit's gradient shard holds within the accumulation window."""

    EMPTY = "empty"  # nothing of this window yet (stale values)
    SUMMED = "summed"  # the sum of this window's reduced micro-batches so far
    PREPARED = "prepared"  # NVMe: read in, with the step's recorded unscale/clip applied


_SHARD_TRANSITIONS: dict[ShardWindow, frozenset[ShardWindow]] = {
    ShardWindow.EMPTY: frozenset({ShardWindow.SUMMED}),
    ShardWindow.SUMMED: frozenset({ShardWindow.SUMMED, ShardWindow.PREPARED}),
    ShardWindow.PREPARED: frozenset(),
}
_SHARD = Transitions(_SHARD_TRANSITIONS, error=ReducerStateError, label=lambda state: state.value)


class _UnitGrads:
    """One unit's gradient shard on this rank: where it is kept, and what it holds in this window."""

    def __init__(self, index: int, unit: FlatParamUnit, dtype: torch.dtype, acc: torch.Tensor | None,
                 tier: StateTier | None, lazy: bool = False):
        """``lazy``: a stage-2/3 shard in memory is allocated by the first gradient that lands (or the
        first read of it), not now: an engine without an optimizer (inference) never holds one."""
        self.index = index
        self.unit = unit
        self.plan = unit.plan
        self.dtype = dtype
        lo, hi = self.plan.shard_range(unit.comm.rank)
        self.lo, self.hi = lo, hi
        self.device = unit.full.device
        self._deferred: tuple[torch.device, bool] | None = None  # (where, pinned) of a shard not yet allocated
        if acc is not None:  # stage 1: the shard is this rank's part of the kept accumulator
            self.shard = acc[lo:hi]
        elif tier is not None and tier.swaps:  # the slab's gradient region, set by keep_in_slabs
            self.shard = torch.empty(0, dtype=torch.float32)
        else:  # in the optimizer's tier: an offloaded optimizer gets its gradients where it runs
            where = tier.device if tier is not None else self.device
            pinned = tier is not None and tier.pinned
            self._deferred = (where, pinned) if lazy and hi > lo else None
            self.shard = torch.zeros(0 if self._deferred else hi - lo, dtype=dtype, device=where,
                                     pin_memory=pinned and not self._deferred)
        self.swapped: SlabGradStore | None = None  # the store keeping this shard in a slab, if any
        self.final_norm: torch.Tensor | None = None  # NVMe: the norm of this window's final value
        self.window = ShardWindow.EMPTY

    def ensure(self) -> torch.Tensor:
        """The shard, allocated (zeros) now if it was deferred (``lazy``)."""
        if self._deferred is not None:
            where, pinned = self._deferred
            self.shard = torch.zeros(self.hi - self.lo, dtype=self.dtype, device=where, pin_memory=pinned)
            self._deferred = None
        return self.shard

    def advance(self, new: ShardWindow) -> None:
        self.window = _SHARD.check(f"internal error: the gradient shard of unit {self.plan.name!r}", self.window, new)

    def new_window(self) -> None:
        self.window = ShardWindow.EMPTY
        self.final_norm = None


def _unit_bucket(index: int, unit: FlatParamUnit, first_param: int) -> tuple[Bucket, int]:
    """Unit ``index`` as a reducer bucket (frozen parameters' slots have no hook), and the index the
    next unit's first trainable parameter gets."""
    slots = []
    for s, trainable in zip(unit.plan.params, unit.trainable, strict=True):
        slots.append(GradSlot(s.offset, torch.Size(s.shape), first_param if trainable else None))
        first_param += int(trainable)
    return Bucket(index, slots, unit.plan.padded_numel, unit.full.device), first_param


class ShardedGrads:
    """Gradient accumulation and reduce-scatter over the units of a ZeRO-1/2/3 model."""

    def __init__(self, units: Sequence[FlatParamUnit], comm: Comm, sharding: GradSharding, *,
                 accum_dtype: torch.dtype = torch.float32, policy: ReductionPolicy = ReductionPolicy(),
                 overlap: bool = True, max_in_flight_elems: int = 500_000_000,
                 shard_tiers: Sequence[StateTier] | None = None,
                 on_final_shard: Callable[[int], None] | None = None,
                 norm_skip: Sequence[Ranges] | None = None, lazy_shards: bool = False):
        """``overlap=False`` (``overlap_comm: false``) waits for each reduction as it is launched.
        ``shard_tiers``: per unit, where stages 2-3 keep the gradient shard (the optimizer's tier: CPU
        memory under ``offload_optimizer``, so each unit's reduced gradient moves there as it completes).
        ``on_final_shard(u)``: called when unit ``u``'s shard is final (the early optimizer step listens).
        ``norm_skip``: per unit, ranges of this rank's shard another rank counts in the global norm.
        ``lazy_shards``: allocate each stage-2/3 shard in memory only when a gradient first lands (no
        optimizer: an inference engine allocates no gradient memory unless backward is run)."""
        self.comm = comm
        self.norm_skip: list[Ranges] = list(norm_skip) if norm_skip is not None else [()] * len(units)
        self.sharding = sharding
        self.policy = policy
        self._on_final_shard = on_final_shard
        params = [p for unit in units for p, trainable in zip(unit.params, unit.trainable, strict=True) if trainable]
        buckets, first = [], 0
        for u, unit in enumerate(units):
            bucket, first = _unit_bucket(u, unit, first)
            buckets.append(bucket)
        # Units without trainable parameters never get a gradient and are never reduced. Until the
        # first backward shows the real order, units go out in reverse registration order, except that
        # stage 3's persistent unit (small parameters of every layer) comes last: its gradients are
        # complete only at the very end, and launching strictly in order would otherwise hold every
        # other unit's gradient back until then (the whole model's gradients in memory at once).
        backwards = [u for u in reversed(range(len(units))) if buckets[u].n_trainable]
        mixed = len({unit.persistent for unit in units}) > 1
        order = [u for u in backwards if not (mixed and units[u].persistent)] + \
                [u for u in backwards if mixed and units[u].persistent]
        # Stages 2-3: a reduction that has finished is folded into its shard (and its full
        # accumulator freed) at the next launch; more than ``reduce_bucket_size`` elements in flight
        # make the oldest be waited for, so the bucket size bounds gradient memory as in DeepSpeed.
        self.reducer = GradReducer(params, buckets, order, comm, collective=ReduceScatter(comm), policy=policy,
                                   accum_dtype=accum_dtype, land=self._land, late_gradient=self._late_gradient,
                                   on_reduced=self._reduced, keep_accumulators=sharding.keep_full,
                                   fold_early=not sharding.keep_full, overlap=overlap,
                                   max_in_flight_elems=max(int(max_in_flight_elems), 1))
        tiers = list(shard_tiers) if shard_tiers is not None else [None] * len(units)
        self.units = [_UnitGrads(i, u, accum_dtype, buckets[i].acc, None if sharding.keep_full else tiers[i],
                                 lazy=lazy_shards)
                      for i, u in enumerate(units)]
        self.final = False  # this backward is the window's last: a completed reduction is the final shard
        self._window_reduced = False  # stage 1: the window's accumulators have been reduced
        self._step_grads: StepGrads | None = None  # this window's, once the step has asked for them
        self._swapped: list[SlabGradStore] = []  # the swapped stores holding some units' shards

    @property
    def order(self) -> list[int]:
        """Unit indices in launch order."""
        return self.reducer.order

    def keep_in_slabs(self, swapped: SlabGradStore) -> None:
        """Keep the shards of the units ``swapped`` (a :class:`SwappedOptimizerState`) holds gradient
        regions for in those regions instead of memory (stages 2-3)."""
        if self.sharding.keep_full:
            return
        for g in self.units:
            if swapped.holds_grad(g.index):
                g.shard, g.swapped = swapped.grads[g.index], swapped
        self._swapped.append(swapped)

    # -- backward ---------------------------------------------------------------------------
    def begin_backward(self, reduce: bool) -> None:
        """Called before each backward; ``reduce`` says whether this micro-batch's gradients go out
        (stage 1: only at the window's end; stages 2-3: always)."""
        if self._window_reduced and self.sharding.keep_full:
            raise second_backward_error()
        self.final = reduce
        self.reducer.begin_pass(reduce or not self.sharding.keep_full)

    @property
    def reducing(self) -> bool:
        """This backward's gradients are reduced."""
        return self.reducer.reducing

    def _late_gradient(self, bucket: Bucket) -> Exception:
        return RuntimeError(f"a gradient for a parameter of unit {self.units[bucket.index].plan.name!r} arrived "
                            f"after the unit was reduced in this backward; a parameter used again after its "
                            f"unit's backward is not supported")

    def _land(self, bucket: Bucket, out: torch.Tensor) -> None:
        """Keep unit ``bucket.index``'s averaged shard ``out``: in the stage-1 accumulator, added into
        the window's shard (stages 2-3), or in the unit's slab file (NVMe), while backward goes on."""
        g = self.units[bucket.index]
        accumulate = g.window is ShardWindow.SUMMED
        if self.sharding.keep_full:
            if out.data_ptr() != g.shard.data_ptr():
                g.shard.copy_(out)
        elif g.swapped is not None:
            value = g.swapped.store_grad(g.index, out.to("cpu"), accumulate=accumulate, accum_dtype=g.dtype)
            if self.final:
                g.final_norm = counted_norm(value.reshape(-1), self.norm_skip[g.index])
        else:
            g.ensure()
            if out.device != g.shard.device:  # an offloaded gradient shard: this unit's part moves now
                out = out.to(g.shard.device)
            if accumulate:
                g.shard.add_(out)
            else:
                g.shard.copy_(out)
        g.advance(ShardWindow.SUMMED)

    def _reduced(self, index: int) -> None:
        if self.final and self._on_final_shard is not None:
            self._on_final_shard(index)

    def end_backward(self) -> None:
        """After backward: reduce what is left (in order) and wait, when this backward reduces."""
        if not self.reducer.reducing:
            return
        self.reducer.flush()
        for swapped in self._swapped:  # the gradient files are complete before anything reads them
            swapped.flush_grads()
        self.reducer.reducing = False
        self._window_reduced = True
        if not self.reducer.relaid:  # launch in the order units completed on rank 0
            self.reducer.set_order(self.reducer.completion_order(self.reducer.agreed_arrivals()))

    def finish(self) -> None:
        """At the step: reduce a stage-1 window whose last backward ran inside ``no_sync()``."""
        if self.sharding.keep_full and not self._window_reduced:
            self.final = True
            self.reducer.begin_pass(True)
            self.end_backward()

    # -- step -------------------------------------------------------------------------------
    def shards(self) -> list[torch.Tensor]:
        """This rank's averaged gradient shard of every unit (valid after the window's last backward;
        an NVMe-kept one only while its unit is resident, after :meth:`prepare`)."""
        return [g.ensure() for g in self.units]

    def shard_of(self, unit_index: int) -> torch.Tensor:
        """Unit ``unit_index``'s gradient shard (allocated now if it was deferred)."""
        return self.units[unit_index].ensure()

    def step_grads(self) -> StepGrads:
        """The window's shards for the engine's unscale / norm / clip (see :mod:`zero.step_grads`)."""
        entries = [(g.ensure(), (g.final_norm if g.final_norm is not None else torch.zeros(()))
                    if g.swapped is not None else None) for g in self.units]
        device = next((g.device for g in self.units), torch.device("cpu"))
        self._step_grads = StepGrads(entries, device, self.norm_skip)
        return self._step_grads

    def prepare(self, unit_index: int) -> None:
        """Unit ``unit_index``'s NVMe-kept shard was just read in: apply the step's unscale and clip
        (once per window; a no-op for shards in memory, already done in place, and for a unit that
        got no gradient in this window)."""
        g = self.units[unit_index]
        if g.swapped is not None and g.window is ShardWindow.SUMMED and self._step_grads is not None:
            self._step_grads.apply(g.shard)
            g.advance(ShardWindow.PREPARED)

    def zero(self) -> None:
        """Start a new accumulation window."""
        self.final = False
        self.reducer.new_window()  # (waits for anything still in flight: only after an error mid-backward)
        self._window_reduced = False
        self._step_grads = None
        for swapped in self._swapped:
            swapped.flush_grads()
        for g in self.units:
            g.new_window()

    def tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(gradient state, transient buffers) held right now, for memory accounting."""
        buckets = self.reducer.buckets
        state = [b.acc for b in buckets if b.acc is not None and self.sharding.keep_full]
        state += [g.shard for g in self.units if not self.sharding.keep_full]
        transient = [b.acc for b in buckets if b.acc is not None and not self.sharding.keep_full]
        transient += [b.wire for b in buckets if b.wire is not None and b.wire is not b.acc]
        transient += self.reducer.pool.free
        return state, transient

    def remove_hooks(self) -> None:
        self.reducer.remove_hooks()
