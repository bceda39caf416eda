"""Gradient reduce-scatter for ZeRO stages 1-3: each rank ends with the averaged gradient of its shard.

Per-parameter hooks add each gradient into its unit's flat accumulator (in the accumulation
dtype) and free ``param.grad``. Once every trainable parameter of a unit has its gradient, the
unit is reduce-scattered asynchronously while backward goes on. Units are launched strictly in one
order, identical on every rank whatever autograd's scheduling (first reverse registration order,
then, after the first reduction, the order gradients really completed on rank 0).

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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from zerospeed.distributed.comm import Comm, Handle
from zerospeed.offload.tier import StateTier
from zerospeed.zero.flat_param import FlatParamUnit
from zerospeed.zero.grads import ReductionPolicy
from zerospeed.zero.step_grads import StepGrads

if TYPE_CHECKING:
    from zerospeed.zero.swapped import SwappedOptimizerState


@dataclass(frozen=True)
class GradSharding:
    """How gradients are kept between micro-batches (see the module docstring)."""

    keep_full: bool  # stage 1: full accumulators live across the window; reduce at its end only

    @classmethod
    def for_stage(cls, stage: int) -> "GradSharding":
        if stage not in (1, 2, 3):
            raise ValueError(f"gradient sharding is for ZeRO stages 1-3, got stage {stage}")
        return cls(keep_full=stage == 1)


class _UnitGrads:
    def __init__(self, index: int, unit: FlatParamUnit, dtype: torch.dtype, keep_full: bool, tier: StateTier | None):
        self.index = index
        self.unit = unit
        self.plan = unit.plan
        self.dtype = dtype
        lo, hi = self.plan.shard_range(unit.comm.rank)
        self.lo, self.hi = lo, hi
        self.device = unit.full.device
        self.acc: torch.Tensor | None = None
        if keep_full:
            self.acc = torch.zeros(self.plan.padded_numel, dtype=dtype, device=self.device)
            self.shard = self.acc[lo:hi]
        elif tier is not None and tier.swaps:  # the slab's gradient region, set by keep_in_slabs
            self.shard = torch.empty(0, dtype=torch.float32)
        else:  # in the optimizer's tier: an offloaded optimizer gets its gradients where it runs
            where = tier.device if tier is not None else self.device
            self.shard = torch.zeros(hi - lo, dtype=dtype, device=where,
                                     pin_memory=tier is not None and tier.pinned)
        self.swapped: SwappedOptimizerState | None = None  # the state keeping this shard on NVMe, if any
        self.final_norm: torch.Tensor | None = None  # NVMe: the norm of this window's final value
        self.prepared = False  # NVMe: the step's recorded unscale/clip applied since it was read in
        self.written = [False] * len(self.plan.params)  # slots of ``acc`` holding this window's values
        self.n_trainable = sum(unit.trainable)
        self.received: set[int] = set()
        self.shard_written = False  # ``shard`` holds this window's sum so far (stages 2-3)
        self.handle: Handle | None = None
        self.wire: torch.Tensor | None = None
        self.launched = False  # sent in the current backward

    def ensure_acc(self, pool: "_BufferPool") -> torch.Tensor:
        if self.acc is None:
            self.acc = pool.take(self.plan.padded_numel, self.dtype, self.device)
            self.written = [False] * len(self.plan.params)
        return self.acc

    def view(self, slot: int, pool: "_BufferPool") -> torch.Tensor:
        s = self.plan.params[slot]
        return self.ensure_acc(pool)[s.offset: s.end].view(s.shape)


class _BufferPool:
    """A few freed accumulators kept for reuse: transformer blocks are all the same size, and a fresh
    large allocation each micro-batch costs page faults on every step."""

    def __init__(self, keep: int):
        self.keep = keep
        self.free: list[torch.Tensor] = []

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        for i, t in enumerate(self.free):
            if t.numel() == numel and t.dtype == dtype and t.device == device:
                return self.free.pop(i)
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, tensor: torch.Tensor) -> None:
        self.free.append(tensor)
        del self.free[: max(len(self.free) - self.keep, 0)]


class ShardedGrads:
    """Gradient accumulation and reduce-scatter over the units of a ZeRO-1/2/3 model."""

    def __init__(self, units: Sequence[FlatParamUnit], comm: Comm, sharding: GradSharding, *,
                 accum_dtype: torch.dtype = torch.float32, policy: ReductionPolicy = ReductionPolicy(),
                 overlap: bool = True, max_in_flight_elems: int = 500_000_000,
                 shard_tiers: Sequence[StateTier] | None = None):
        """``overlap=False`` (``overlap_comm: false``) waits for each reduction as it is launched.
        ``shard_tiers``: per unit, where stages 2-3 keep the gradient shard (the optimizer's tier: CPU
        memory under ``offload_optimizer``, so each unit's reduced gradient moves there as it completes)."""
        self.comm = comm
        self.overlap = overlap
        # Stages 2-3: a reduction that has finished is folded into its shard (and its full
        # accumulator freed) at the next launch; more than ``reduce_bucket_size`` elements in flight
        # make the oldest be waited for, so the bucket size bounds gradient memory as in DeepSpeed.
        self.max_in_flight_elems = max(int(max_in_flight_elems), 1)
        self._in_flight: list[_UnitGrads] = []
        self._pool = _BufferPool(keep=3)
        self.sharding = sharding
        self.policy = policy
        tiers = list(shard_tiers) if shard_tiers is not None else [None] * len(units)
        self.units = [_UnitGrads(i, u, accum_dtype, sharding.keep_full, None if sharding.keep_full else tiers[i])
                      for i, u in enumerate(units)]
        self._where: dict[int, tuple[int, int]] = {}
        self._hooks = []
        for u, unit in enumerate(units):
            for slot, p in enumerate(unit.params):
                if p.requires_grad:
                    self._where[id(p)] = (u, slot)
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        if not self._where:
            raise ValueError("no trainable parameters: every parameter has requires_grad=False")
        # Units without trainable parameters never get a gradient and are never reduced. Until the
        # first backward shows the real order, units go out in reverse registration order, except that
        # stage 3's persistent unit (small parameters of every layer) comes last: its gradients are
        # complete only at the very end, and launching strictly in order would otherwise hold every
        # other unit's gradient back until then (the whole model's gradients in memory at once).
        backwards = [u for u in reversed(range(len(self.units))) if self.units[u].n_trainable]
        mixed = len({unit.persistent for unit in units}) > 1
        self.order = [u for u in backwards if not (mixed and units[u].persistent)] + \
                     [u for u in backwards if mixed and units[u].persistent]
        self._observed: list[int] = []
        self._relaid = False
        self._next = 0
        self.reducing = False  # set by begin_backward: this backward's gradients are reduced
        self.final = False  # this backward is the window's last: a completed reduction is the final shard
        # called with a unit's index when its shard is final (the early optimizer step listens)
        self.on_final_shard: Callable[[int], None] | None = None
        self._window_reduced = False  # stage 1: the window's accumulators have been reduced
        self._step_grads: StepGrads | None = None  # this window's, once the step has asked for them
        self._swapped: list[SwappedOptimizerState] = []  # the NVMe stores holding some units' shards

    def keep_in_slabs(self, swapped: SwappedOptimizerState) -> None:
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
            raise RuntimeError("a second engine.backward() on the last micro-batch of an accumulation window: "
                               "its gradients were already sent for averaging; call backward once per "
                               "micro-batch (add the losses first)")
        self.reducing = reduce or not self.sharding.keep_full
        self.final = reduce
        self._next = 0
        for g in self.units:
            g.received.clear()
            g.launched = False

    def _on_grad(self, param: torch.Tensor) -> None:
        u, slot = self._where[id(param)]
        g = self.units[u]
        if g.launched:
            raise RuntimeError(f"a gradient for a parameter of unit {g.plan.name!r} arrived after the unit "
                               f"was reduced in this backward; a parameter used again after its unit's "
                               f"backward is not supported")
        if param.grad is not None:
            view = g.view(slot, self._pool)
            if g.written[slot]:
                view.add_(param.grad)
            else:
                view.copy_(param.grad)
                g.written[slot] = True
            param.grad = None
        if self.reducing:
            g.received.add(slot)
            if len(g.received) == g.n_trainable:
                if not self._relaid:
                    self._observed.append(u)
                self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.order):
            g = self.units[self.order[self._next]]
            if len(g.received) < g.n_trainable:
                return
            self._launch(g)
            self._next += 1

    def _launch(self, g: _UnitGrads) -> None:
        g.launched = True
        acc = g.ensure_acc(self._pool)
        for slot, written in enumerate(g.written):
            if not written:  # no gradient this window (unused or frozen parameter): zero
                s = g.plan.params[slot]
                acc[s.offset: s.end].zero_()
                g.written[slot] = True
        acc[g.plan.numel:].zero_()  # padding
        dtype = self.policy.reduce_dtype
        wire = acc if dtype is None or dtype == acc.dtype else acc.to(dtype)
        self.policy.before(wire, self.comm.world_size)
        g.wire = wire
        g.handle = self.comm.reduce_scatter(wire[g.lo:g.hi], wire, async_op=True, inputs_writable=True)
        self._in_flight.append(g)
        if not self.overlap:
            self._complete(self._in_flight.pop(0))
        elif not self.sharding.keep_full:
            while self._in_flight and self._in_flight[0].handle.is_completed():
                self._complete(self._in_flight.pop(0))
            while sum(g.plan.padded_numel for g in self._in_flight) > self.max_in_flight_elems:
                self._complete(self._in_flight.pop(0))

    def _complete(self, g: _UnitGrads) -> None:
        """Wait for ``g``'s reduction, average it into the shard, free the full accumulator (stages 2-3)."""
        assert g.handle is not None and g.wire is not None
        g.handle.wait()
        out = g.wire[g.lo:g.hi]
        self.policy.after(out, self.comm.world_size)
        if self.sharding.keep_full:
            if out.data_ptr() != g.shard.data_ptr():
                g.shard.copy_(out)
        elif g.swapped is not None:  # into the unit's slab file, while backward goes on
            value = g.swapped.store_grad(g.index, out.to("cpu"), accumulate=g.shard_written, accum_dtype=g.dtype)
            g.shard_written = True
            if self.final:
                g.final_norm = torch.linalg.vector_norm(value, dtype=torch.float32)
            assert g.acc is not None
            self._pool.give(g.acc)
            g.acc = None
        else:
            if out.device != g.shard.device:  # an offloaded gradient shard: this unit's part moves now
                out = out.to(g.shard.device)
            if g.shard_written:
                g.shard.add_(out)
            else:
                g.shard.copy_(out)
                g.shard_written = True
            assert g.acc is not None
            self._pool.give(g.acc)
            g.acc = None  # the full gradient is freed as soon as it is reduced
        g.handle = g.wire = None
        if self.final and self.on_final_shard is not None:
            self.on_final_shard(g.index)

    def end_backward(self) -> None:
        """After backward: reduce what is left (in order) and wait, when this backward reduces."""
        if not self.reducing:
            return
        while self._next < len(self.order):
            self._launch(self.units[self.order[self._next]])
            self._next += 1
        while self._in_flight:
            self._complete(self._in_flight.pop(0))
        for swapped in self._swapped:  # the gradient files are complete before anything reads them
            swapped.flush_grads()
        for u in self.order:
            self.units[u].received.clear()
        self.reducing = False
        self._window_reduced = True
        if not self._relaid:
            self._relay()

    def finish(self) -> None:
        """At the step: reduce a stage-1 window whose last backward ran inside ``no_sync()``."""
        if self.sharding.keep_full and not self._window_reduced:
            self.reducing = self.final = True
            self._next = 0
            self.end_backward()

    def _relay(self) -> None:
        """Launch in the order units completed on rank 0 (every rank then issues the same sequence)."""
        seen = list(dict.fromkeys(self.comm.all_gather_object(self._observed)[0]))
        self.order = seen + [u for u in self.order if u not in set(seen)]
        self._relaid = True
        self._observed = []

    # -- step -------------------------------------------------------------------------------
    def shards(self) -> list[torch.Tensor]:
        """This rank's averaged gradient shard of every unit (valid after the window's last backward;
        an NVMe-kept one only while its unit is resident, after :meth:`prepare`)."""
        return [g.shard for g in self.units]

    def step_grads(self) -> StepGrads:
        """The window's shards for the engine's unscale / norm / clip (see :mod:`zero.step_grads`)."""
        entries = [(g.shard, (g.final_norm if g.final_norm is not None else torch.zeros(()))
                    if g.swapped is not None else None) for g in self.units]
        device = next((g.device for g in self.units), torch.device("cpu"))
        self._step_grads = StepGrads(entries, device)
        return self._step_grads

    def prepare(self, unit_index: int) -> None:
        """Unit ``unit_index``'s NVMe-kept shard was just read in: apply the step's unscale and clip
        (once per window; a no-op for shards in memory, already done in place)."""
        g = self.units[unit_index]
        if g.swapped is not None and not g.prepared and self._step_grads is not None:
            self._step_grads.apply(g.shard)
            g.prepared = True

    def zero(self) -> None:
        """Start a new accumulation window."""
        self.final = False
        while self._in_flight:  # only after an error mid-backward
            self._complete(self._in_flight.pop(0))
        self._window_reduced = False
        self._step_grads = None
        for swapped in self._swapped:
            swapped.flush_grads()
        for g in self.units:
            g.written = [False] * len(g.plan.params)
            g.shard_written = False
            g.final_norm, g.prepared = None, False
            g.received.clear()
            g.launched = False
        self._next = 0

    def tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(gradient state, transient buffers) held right now, for memory accounting."""
        state = [g.acc for g in self.units if g.acc is not None and self.sharding.keep_full]
        state += [g.shard for g in self.units if not self.sharding.keep_full]
        transient = [g.acc for g in self.units if g.acc is not None and not self.sharding.keep_full]
        transient += [g.wire for g in self.units if g.wire is not None and g.wire is not g.acc]
        transient += self._pool.free
        return state, transient

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
