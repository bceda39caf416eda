"""The one gradient reducer: ordered buckets of gradients, reduced by a collective during backward.

Both ZeRO stage 0 (all-reduce, :mod:`zero.grads`) and stages 1-3 (reduce-scatter,
:mod:`zero.sharded_grads`) run the same algorithm, kept here once:

* a post-accumulate-grad hook on every trainable parameter adds its gradient into a slot of its
  bucket's flat accumulator (the window's first gradient overwrites, so nothing is zeroed per step)
  and frees ``param.grad``;
* on a reducing backward, a bucket whose trainable slots have all arrived is launched, asynchronously,
  strictly in one order, so every rank issues the same collectives in the same sequence whatever
  its autograd scheduling;
* the first reducing pass records the order gradients really arrived; :meth:`GradReducer.agreed_arrivals`
  returns rank 0's (one ``all_gather_object``), from which the caller lays the buckets out again;
* a finished collective is averaged (:class:`ReductionPolicy`) and handed to the caller's ``land``
  callable: where the result is kept is the caller's business (the flat buffer, or a shard).

What differs between the stages is a :class:`Collective` value (how one bucket is reduced, and which
part of it this rank keeps) and a few construction arguments (accumulators kept or pooled, when
finished reductions are folded in).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Collection, Protocol, Sequence

import torch

from zerospeed.distributed.comm import Comm, Handle
from zerospeed.lifecycle import Transitions


def plan_buckets(numels: Sequence[int], bucket_elems: int, alone: Collection[int] = ()) -> list[list[int]]:
    """Group parameter indices, in the given order, into buckets of about ``bucket_elems`` elements.

    A bucket closes once it reaches ``bucket_elems``; a parameter larger than that gets a bucket
    of its own, and so does every index in ``alone`` (a parameter reduced by a collective of its
    own, in its place in the order). Pure, so the layout is tested without processes.
    """
    if bucket_elems < 1:
        raise ValueError(f"reduce_bucket_size={bucket_elems} must be >= 1 element")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index, numel in enumerate(numels):
        if index in alone:
            if current:
                buckets.append(current)
                current, filled = [], 0
            buckets.append([index])
            continue
        current.append(index)
        filled += numel
        if filled >= bucket_elems:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


@dataclass(frozen=True)
class ReductionPolicy:
    """How gradients are averaged: DeepSpeed's ``communication_data_type``, ``prescale_gradients``
    and ``gradient_predivide_factor``."""

    reduce_dtype: torch.dtype | None = None  # None: reduce in the accumulation dtype
    prescale: bool = False
    predivide_factor: float = 1.0
    # the sum over the reducing group is divided by this many ranks (None: the group's size). Expert
    # parameters are summed over their expert-data-parallel group but averaged over the whole
    # data-parallel size, as DeepSpeed does: their tokens came from every data-parallel rank.
    average_over: int | None = None

    def __post_init__(self) -> None:
        if self.predivide_factor <= 0:
            raise ValueError(f"gradient_predivide_factor={self.predivide_factor} must be > 0")

    def before(self, flat: torch.Tensor, world: int) -> None:
        world = self.average_over or world
        if self.prescale:
            flat.div_(world)
        elif self.predivide_factor != 1.0:
            flat.mul_(1.0 / self.predivide_factor)

    def after(self, flat: torch.Tensor, world: int) -> None:
        world = self.average_over or world
        if not self.prescale and self.predivide_factor != world:
            flat.mul_(self.predivide_factor / world)


# -- how a bucket is reduced -------------------------------------------------------------------
class Pending(Protocol):
    """A reduction in flight (a Comm :class:`Handle`, or several chained by a collective)."""

    def wait(self) -> None:
        ...

    def is_completed(self) -> bool:
        ...


class Collective(Protocol):
    """How one flat bucket is reduced across ranks, and which part of it this rank keeps."""

    def launch(self, wire: torch.Tensor) -> Pending:
        """Start reducing ``wire`` (in place) asynchronously."""
        ...

    def result(self, wire: torch.Tensor) -> torch.Tensor:
        """The part of ``wire`` holding this rank's reduced values once the launch has completed."""
        ...


@dataclass(frozen=True)
class AllReduce:
    """Stage 0: every rank keeps the whole reduced bucket."""

    comm: Comm

    def launch(self, wire: torch.Tensor) -> Handle:
        handle = self.comm.all_reduce(wire, async_op=True)
        assert handle is not None
        return handle

    def result(self, wire: torch.Tensor) -> torch.Tensor:
        return wire


@dataclass(frozen=True)
class ReduceScatter:
    """Stages 1-3: the bucket is ``world_size`` equal shards; this rank keeps its own, reduced in place."""

    comm: Comm

    def _shard(self, wire: torch.Tensor) -> torch.Tensor:
        size = wire.numel() // self.comm.world_size
        return wire[self.comm.rank * size: (self.comm.rank + 1) * size]

    def launch(self, wire: torch.Tensor) -> Handle:
        handle = self.comm.reduce_scatter(self._shard(wire), wire, async_op=True, inputs_writable=True)
        assert handle is not None
        return handle

    def result(self, wire: torch.Tensor) -> torch.Tensor:
        return self._shard(wire)


# -- one bucket ----------------------------------------------------------------------------------
class ReducerStateError(RuntimeError):
    """An internal error: a bucket was driven through its lifecycle out of order (a zerospeed bug)."""


class BucketState(enum.Enum):
    """Where a bucket is within one backward pass."""

    ACCUMULATING = "accumulating"  # gradients of this pass are being added in
    LAUNCHED = "launched"  # its collective is in flight; a further gradient would be lost
    REDUCED = "reduced"  # the averaged result has been handed to ``land``


_BUCKET = Transitions({
    BucketState.ACCUMULATING: frozenset({BucketState.LAUNCHED}),
    BucketState.LAUNCHED: frozenset({BucketState.REDUCED}),
    BucketState.REDUCED: frozenset({BucketState.ACCUMULATING}),
}, error=ReducerStateError, label=lambda state: state.value)


@dataclass(frozen=True)
class GradSlot:
    """One parameter's place in a bucket's flat accumulator; ``param`` is its index in the reducer's
    parameter list, or None for a frozen parameter (no hook; its slot is reduced as zeros)."""

    offset: int
    shape: torch.Size
    param: int | None

    @property
    def end(self) -> int:
        return self.offset + self.shape.numel()


class Bucket:
    """The gradients reduced by one collective: slots in one flat accumulator of ``numel`` elements."""

    def __init__(self, index: int, slots: Sequence[GradSlot], numel: int, device: torch.device, *,
                 collective: Collective | None = None):
        """``collective``: how this bucket is reduced when not the reducer's (a row exchange)."""
        self.index = index
        self.collective = collective
        self.slots = list(slots)
        self.numel = numel  # slots, then zero padding up to here
        self.used = max((s.end for s in self.slots), default=0)  # where the padding starts
        self.device = device
        self.n_trainable = sum(s.param is not None for s in self.slots)
        self.acc: torch.Tensor | None = None  # set by the reducer (kept, or taken from its pool)
        self.written = [False] * len(self.slots)  # slots holding this window's values (else stale)
        self.received: set[int] = set()  # slots whose gradient arrived in this reducing pass
        self.state = BucketState.ACCUMULATING
        self.handle: Pending | None = None
        self.wire: torch.Tensor | None = None  # the accumulator in the reduce dtype, while in flight

    def advance(self, new: BucketState) -> None:
        self.state = _BUCKET.check(f"internal error: gradient bucket {self.index}", self.state, new)

    def view(self, slot: int) -> torch.Tensor:
        assert self.acc is not None
        s = self.slots[slot]
        return self.acc[s.offset: s.end].view(s.shape)


class BufferPool:
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


Land = Callable[[Bucket, torch.Tensor], None]


def second_backward_error() -> RuntimeError:
    """A backward after the window's gradients went out for averaging (they would be lost)."""
    return RuntimeError("a second engine.backward() on the last micro-batch of an accumulation window: its "
                        "gradients were already sent for averaging; call backward once per micro-batch (add "
                        "the losses first)")


# -- the reducer -----------------------------------------------------------------------------------
class GradReducer:
    """Accumulates the gradients of ``params`` into ordered buckets and reduces them with ``collective``.

    ``keep_accumulators``: each bucket's accumulator lives across windows (stage 0, stage 1); else it
    is taken from a pool when its first gradient arrives and given back once reduced (stages 2-3).
    ``fold_early``: a finished reduction is landed at the next launch rather than at :meth:`flush`,
    and more than ``max_in_flight_elems`` elements in flight make the oldest be waited for (stages
    2-3: the bucket size bounds gradient memory). ``overlap=False`` waits for each reduction as it is
    launched. ``late_gradient(bucket)`` is the error for a gradient arriving after its bucket went
    out in this pass; ``land(bucket, out)`` keeps the averaged result ``out``; ``on_reduced(index)``
    runs once bucket ``index`` has landed and released its buffers.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], buckets: Sequence[Bucket], order: Sequence[int],
                 comm: Comm, *, collective: Collective, policy: ReductionPolicy, accum_dtype: torch.dtype,
                 land: Land, late_gradient: Callable[[Bucket], Exception],
                 on_reduced: Callable[[int], None] | None = None, keep_accumulators: bool,
                 fold_early: bool = False, overlap: bool = True, max_in_flight_elems: int | None = None):
        if not params:
            raise ValueError("no trainable parameters: every parameter has requires_grad=False")
        self.comm = comm
        self.collective = collective
        self.policy = policy
        self.accum_dtype = accum_dtype
        self._land = land
        self._late_gradient = late_gradient
        self._on_reduced = on_reduced
        self.keep_accumulators = keep_accumulators
        self.fold_early = fold_early
        self.overlap = overlap
        self.max_in_flight_elems = max_in_flight_elems
        self.pool = BufferPool(keep=3)
        self._params = list(params)
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self.reducing = False  # this pass's gradients go out (set by begin_pass)
        self.relaid = False  # the order has been agreed from a real pass (see agreed_arrivals)
        self._arrivals: list[int] = []  # parameter indices in hook order, first reducing pass only
        self._next = 0  # position in ``order`` of the next bucket to launch
        self._in_flight: list[Bucket] = []
        self.set_buckets(buckets, order)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._params]

    def set_buckets(self, buckets: Sequence[Bucket], order: Sequence[int]) -> None:
        """(Re)lay the parameters out in ``buckets``, launched in ``order`` (bucket indices)."""
        assert not self._in_flight, "no reduction in flight while the buckets change"
        self.buckets = list(buckets)
        self.order = list(order)
        self._where: list[tuple[int, int]] = [(-1, -1)] * len(self._params)
        for b, bucket in enumerate(self.buckets):
            assert bucket.index == b
            for slot, s in enumerate(bucket.slots):
                if s.param is not None:
                    self._where[s.param] = (b, slot)
            if self.keep_accumulators:
                bucket.acc = torch.zeros(bucket.numel, dtype=self.accum_dtype, device=bucket.device)
        assert all(b >= 0 for b, _ in self._where), "every parameter has a slot"

    def set_order(self, order: Sequence[int]) -> None:
        """Launch the same buckets in ``order`` from the next pass on (every rank must pass the same)."""
        assert sorted(order) == sorted(self.order), "a new order of the same buckets"
        self.order = list(order)

    def where(self, param: torch.Tensor) -> tuple[int, int]:
        """``(bucket, slot)`` of a trainable parameter."""
        return self._where[self._index[id(param)]]

    # -- hooks -----------------------------------------------------------------------------
    def _on_grad(self, param: torch.Tensor) -> None:
        index = self._index[id(param)]
        b, slot = self._where[index]
        bucket = self.buckets[b]
        if bucket.state is not BucketState.ACCUMULATING:
            raise self._late_gradient(bucket)
        if param.grad is not None:
            self._ensure_acc(bucket)
            view = bucket.view(slot)
            if bucket.written[slot]:
                view.add_(param.grad)
            elif param.grad.is_sparse:  # a sparse=True embedding's COO gradient: duplicate rows are summed
                view.zero_()
                view.add_(param.grad)
                bucket.written[slot] = True
            else:  # the window's first gradient overwrites: no zeroing pass over the buckets per step
                view.copy_(param.grad)
                bucket.written[slot] = True
            param.grad = None  # the bucket holds it now; free the parameter-dtype copy
        if self.reducing:
            if not self.relaid:
                self._arrivals.append(index)
            bucket.received.add(slot)
            if len(bucket.received) == bucket.n_trainable:
                self._launch_ready()

    def _ensure_acc(self, bucket: Bucket) -> torch.Tensor:
        if bucket.acc is None:
            bucket.acc = self.pool.take(bucket.numel, self.accum_dtype, bucket.device)
            bucket.written = [False] * len(bucket.slots)
        return bucket.acc

    def _launch_ready(self) -> None:
        while self._next < len(self.order):
            bucket = self.buckets[self.order[self._next]]
            if len(bucket.received) < bucket.n_trainable:
                return
            self._launch(bucket)
            self._next += 1

    def _launch(self, bucket: Bucket) -> None:
        bucket.advance(BucketState.LAUNCHED)
        acc = self._ensure_acc(bucket)
        for slot, s in enumerate(bucket.slots):
            if not bucket.written[slot]:  # no gradient this window (unused or frozen parameter): zero
                acc[s.offset: s.end].zero_()
                bucket.written[slot] = True
        if bucket.used < bucket.numel:
            acc[bucket.used:].zero_()  # padding
        dtype = self.policy.reduce_dtype
        wire = acc if dtype is None or dtype == acc.dtype else acc.to(dtype)
        self.policy.before(wire, self.comm.world_size)
        bucket.wire = wire
        bucket.handle = (bucket.collective or self.collective).launch(wire)
        self._in_flight.append(bucket)
        if not self.overlap:
            self._complete(self._in_flight.pop(0))
        elif self.fold_early:
            while self._in_flight and self._in_flight[0].handle is not None and self._in_flight[0].handle.is_completed():
                self._complete(self._in_flight.pop(0))
            if self.max_in_flight_elems is not None:
                while sum(b.numel for b in self._in_flight) > self.max_in_flight_elems:
                    self._complete(self._in_flight.pop(0))

    def _complete(self, bucket: Bucket) -> None:
        """Wait for ``bucket``'s reduction, average it and hand it to ``land``."""
        assert bucket.handle is not None and bucket.wire is not None
        bucket.handle.wait()
        out = (bucket.collective or self.collective).result(bucket.wire)
        self.policy.after(out, self.comm.world_size)
        self._land(bucket, out)
        if not self.keep_accumulators:
            assert bucket.acc is not None
            self.pool.give(bucket.acc)
            bucket.acc = None  # the full gradient is freed as soon as it is reduced
        bucket.handle = bucket.wire = None
        bucket.advance(BucketState.REDUCED)
        if self._on_reduced is not None:
            self._on_reduced(bucket.index)

    # -- passes and windows -------------------------------------------------------------------
    def begin_pass(self, reducing: bool) -> None:
        """A new backward pass; ``reducing``: its gradients go out as their buckets fill."""
        self.reducing = reducing
        self.restart_pass()

    def restart_pass(self) -> None:
        """Buckets reduced in this pass take gradients again; launching starts from the first."""
        self._next = 0
        for bucket in self.buckets:
            bucket.received.clear()
            if bucket.state is BucketState.REDUCED:
                bucket.advance(BucketState.ACCUMULATING)

    def flush(self) -> None:
        """Launch, in order, every bucket not yet sent in this pass (missing gradients count as zero)
        and wait for all reductions."""
        while self._next < len(self.order):
            self._launch(self.buckets[self.order[self._next]])
            self._next += 1
        while self._in_flight:
            self._complete(self._in_flight.pop(0))

    def agreed_arrivals(self) -> list[int]:
        """Rank 0's order of first arrival of each parameter's gradient (indices into ``params``) in
        the first reducing pass, so every rank lays out the same order; observing stops here."""
        seen = list(dict.fromkeys(self.comm.all_gather_object(self._arrivals)[0]))
        self.relaid = True
        self._arrivals = []
        return seen

    def completion_order(self, arrivals: Sequence[int]) -> list[int]:
        """Buckets in the order ``arrivals`` complete them, then the others in the current order."""
        missing = {b: bucket.n_trainable for b, bucket in enumerate(self.buckets)}
        done: list[int] = []
        for index in arrivals:
            b, _ = self._where[index]
            missing[b] -= 1
            if missing[b] == 0:
                done.append(b)
        finished = set(done)
        return done + [b for b in self.order if b not in finished]

    def settle_locally(self) -> None:
        """End the pass with every bucket holding this rank's own accumulated gradients, unreduced
        (an optimizer exchanging by itself): unwritten slots and padding become zero, as a launch
        would make them, and nothing is sent."""
        assert not self._in_flight, "a local window launches nothing"
        for bucket in self.buckets:
            if bucket.state is not BucketState.ACCUMULATING:
                continue
            acc = self._ensure_acc(bucket)
            for slot, s in enumerate(bucket.slots):
                if not bucket.written[slot]:
                    acc[s.offset: s.end].zero_()
                    bucket.written[slot] = True
            if bucket.used < bucket.numel:
                acc[bucket.used:].zero_()
        self.restart_pass()

    def new_window(self) -> None:
        """Start an accumulation window: every slot is overwritten by its first gradient again."""
        while self._in_flight:  # only after an error mid-backward
            self._complete(self._in_flight.pop(0))
        self.restart_pass()
        for bucket in self.buckets:
            bucket.written = [False] * len(bucket.slots)

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
