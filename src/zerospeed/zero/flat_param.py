"""A unit's parameters as views into one flat, padded buffer, of which each rank owns a shard.

``full`` holds the whole unit in the compute dtype; every model parameter's ``.data`` is a view into
it, so the module's own ``Parameter`` objects stay in place (optimizers, hooks and user code keep
working). A *persistent* unit (stages 1-2, and small parameters under stage 3) keeps ``full``
allocated and its ``shard`` is a view of it. Otherwise (stage 3) the shard is a separate tensor and
``full``'s storage is freed between uses (``resize_(0)``, as FSDP does): views, including the ones
autograd saved for backward, keep pointing at the same storage, which :meth:`gather` re-allocates
and fills, so backward sees the right values again without any tensor being re-made. While released,
each parameter's ``.data`` is an empty tensor (as in DeepSpeed), so touching a released parameter
is a shape error rather than a read of freed memory.

Each parameter carries one back-reference, ``param._zerospeed_owner``, to the object that holds its
state (here a :class:`UnitParamRef`); everything else lives in the owner, never on the parameter.
"""

from __future__ import annotations

import contextlib
import enum
from typing import Callable, ContextManager

import torch
from torch import nn

from zerospeed.distributed.comm import Comm, Handle
from zerospeed.lifecycle import Transitions
from zerospeed.offload import SlabLease, StateTier
from zerospeed.offload.nvme import IOWait
from zerospeed.sharding.flat import FlatUnit
from zerospeed.sharding.plan import UnitPlan
from zerospeed.zero.owner import init_partition

def full_values(param: torch.Tensor) -> torch.Tensor:
    """``param``'s full values: itself, or gathered from its ``zero.Init`` partition (collective)."""
    partition = init_partition(param)
    return partition.take_full() if partition is not None else param.detach()


def shape_of(param: torch.Tensor) -> tuple[int, ...]:
    """The full shape, also for a parameter partitioned by ``zero.Init`` (whose data is empty)."""
    partition = init_partition(param)
    return partition.shape if partition is not None else tuple(param.shape)


class UnitPhase(enum.Enum):
    """Where a unit's ``full`` buffer is in its gather/release cycle."""

    RELEASED = "released"  # ``full`` has no memory; parameters are empty
    READING = "reading"  # the shard's NVMe read is in flight; the all-gather follows in ``wait()``
    GATHERING = "gathering"  # the all-gather is in flight
    GATHERED = "gathered"  # ``full`` holds every rank's values


_PHASES = Transitions({
    UnitPhase.RELEASED: frozenset({UnitPhase.READING, UnitPhase.GATHERING}),
    UnitPhase.READING: frozenset({UnitPhase.GATHERING, UnitPhase.RELEASED}),  # RELEASED: the read failed
    UnitPhase.GATHERING: frozenset({UnitPhase.GATHERED}),
    UnitPhase.GATHERED: frozenset({UnitPhase.RELEASED}),
}, label=lambda phase: phase.value)  # IllegalTransition: an AssertionError


class FlatParamUnit:
    """The parameters of one unit, flat; see the module docstring."""

    def __init__(self, plan: UnitPlan, params: list[nn.Parameter], comm: Comm, *, persistent: bool,
                 shard_tier: StateTier | None = None):
        """Parameters partitioned by ``zero.Init`` are gathered one at a time to fill the unit.
        ``shard_tier``: where a non-persistent unit keeps its shard between uses (``offload_param``;
        default: the parameters' device). A persistent unit's shard is always a view of ``full``."""
        if len(params) != len(plan.params):
            raise ValueError(f"unit {plan.name!r}: {len(params)} parameters for a plan of {len(plan.params)}")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise TypeError(f"unit {plan.name!r}: ZeRO needs the parameters of a unit to share one floating "
                            f"dtype, got {sorted(str(d) for d in dtypes)}; cast the model first")
        self.plan = plan
        self.params = params
        self.comm = comm
        self.persistent = persistent
        self.trainable = [p.requires_grad for p in params]
        self.dtype = params[0].dtype
        device = params[0].device
        flat = FlatUnit(plan, dtype=self.dtype, device=device)
        self.full = flat.buffer
        self._views = [flat.views[slot.name] for slot in plan.params]
        with torch.no_grad():
            for view, p in zip(self._views, params):
                view.copy_(full_values(p).reshape(view.shape))
        own = flat.shard(comm.rank)
        if persistent:
            self.shard = own
        else:
            placed = shard_tier.place(own) if shard_tier is not None else own
            self.shard = placed.clone() if placed is own else placed
        self._staged: torch.Tensor | None = None  # the shard's copy on the compute device, while gathering
        self.shard_lease: SlabLease | None = None  # a swapped shard's file residency (keep_shard_in)
        self._gather_holds_shard = False  # the lease was acquired for the gather in flight
        self._direct: IOWait | None = None  # one rank: the shard's file read straight into ``full``
        self._empty = torch.empty(0, dtype=self.dtype, device=device)
        for p, view in zip(params, self._views):
            p.data = view
        self.master: torch.Tensor | None = None  # this shard's fp32 master, when the optimizer keeps one
        # a context in which ``master`` is in memory and changes to it are kept (see bind_master)
        self.master_resident: Callable[[], ContextManager[None]] = contextlib.nullcontext
        self._pending: Handle | None = None
        self.phase = UnitPhase.GATHERED
        if not persistent:
            self.release()

    # -- wiring (the owning state, once the optimizer's masters and the shard's slab exist) --------
    def bind_master(self, master: torch.Tensor,
                    resident: Callable[[], ContextManager[None]] | None = None) -> None:
        """This shard's fp32 master, and (optionally) the context that keeps it in memory and its
        changes (an NVMe-tier master is read in and written back around it)."""
        self.master = master
        if resident is not None:
            self.master_resident = resident

    def keep_shard_in(self, lease: SlabLease) -> None:
        """A non-persistent unit's shard lives in a slab between uses; gathers read it in first."""
        if self.persistent or self.phase is not UnitPhase.RELEASED:
            raise AssertionError(f"internal error: unit {self.plan.name!r} can only swap its shard while released "
                                 f"and not persistent (phase {self.phase.value})")
        self.shard_lease = lease

    # -- state ------------------------------------------------------------------------------
    def _move(self, to: UnitPhase) -> None:
        self.phase = _PHASES.check(f"internal error: unit {self.plan.name!r}", self.phase, to)

    @property
    def gathered(self) -> bool:
        """True while ``full`` holds every rank's values (or a gather of them is in flight)."""
        return self.phase is not UnitPhase.RELEASED

    @property
    def numel(self) -> int:
        return self.plan.padded_numel

    def release(self) -> None:
        """Free ``full``'s memory (non-persistent units only); the parameters keep their shapes."""
        if self.persistent or self.phase is UnitPhase.RELEASED:
            return
        self.wait()
        self._free_full()

    def _free_full(self) -> None:
        for p in self.params:
            p.data = self._empty
        self.full.untyped_storage().resize_(0)
        self._move(UnitPhase.RELEASED)

    def gather(self, async_op: bool = False) -> None:
        """All-gather every rank's shard into ``full``; ``wait()`` before reading when async."""
        if self.phase is not UnitPhase.RELEASED:
            if not async_op:
                self.wait()
            return
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        for p, view in zip(self.params, self._views):
            p.data = view
        if self.shard_lease is not None:
            # a swapped shard is read in for the all-gather: a prefetch (async_op) only starts the
            # read, and the all-gather follows in wait() (every rank waits for its units in the same
            # order, so the collectives still line up). On one rank the shard *is* the full buffer:
            # its file is read straight into ``full`` (no slab buffer, no copy on this thread)
            direct = self.shard_lease.copy_into(self.full) if self.comm.world_size == 1 else None
            if direct is not None:
                self._direct = direct
            else:
                self.shard_lease.acquire(wait=False)
                self._gather_holds_shard = True
            self._move(UnitPhase.READING)
        else:
            self._launch_gather()
        if not async_op:
            self.wait()

    def _launch_gather(self) -> None:
        source = self.shard
        if source.device != self.full.device:  # offloaded shard: to the device first (async from pinned)
            source = self._staged = source.to(self.full.device, non_blocking=True)
        self._pending = self.comm.all_gather(self.full, source, async_op=True)
        self._move(UnitPhase.GATHERING)

    def wait(self) -> None:
        """Finish a gather in flight (a no-op when none is)."""
        if self.phase is UnitPhase.READING and self._direct is not None:
            lease, request, self._direct = self.shard_lease, self._direct, None
            assert lease is not None, "a unit reading its shard has a lease"
            try:
                lease.finish_copy(request)
            except BaseException:
                self._free_full()
                raise
            self._move(UnitPhase.GATHERING)
        if self.phase is UnitPhase.READING:
            lease = self.shard_lease
            assert lease is not None, "a unit reading its shard has a lease"
            try:
                lease.ready()
            except BaseException:  # the shard could not be read: nothing was gathered, let go of it all
                self._gather_holds_shard = False
                lease.release()
                self._free_full()
                raise
            self._launch_gather()
        if self._pending is not None:
            handle, self._pending = self._pending, None
            handle.wait()
            self._staged = None
        if self.phase is UnitPhase.GATHERING:
            self._move(UnitPhase.GATHERED)
        if self._gather_holds_shard:
            self._gather_holds_shard = False
            assert self.shard_lease is not None, "a unit holding its shard for a gather has a lease"
            self.shard_lease.release()

    def shard_resident(self, write_back: bool = False) -> ContextManager[None]:
        """``shard`` in memory inside the block (NVMe tier; ``write_back`` when the block changes it)."""
        return self.shard_lease.held(write_back) if self.shard_lease is not None else contextlib.nullcontext()

    def publish_shard(self, async_op: bool = True) -> Handle | None:
        """After an update of ``shard``: all-gather it into ``full`` (persistent units; others are
        gathered on their next use)."""
        if not self.persistent:
            return None
        return self.comm.all_gather(self.full, self.shard, async_op=async_op)

    def gather_shard_values(self, shard_values: torch.Tensor) -> torch.Tensor:
        """All-gather a shard-sized tensor laid out like this unit (grads, masters, optimizer states)
        into a full padded one (collective)."""
        device = self.full.device  # collectives run on the compute device, wherever the values live
        out = torch.empty(self.plan.padded_numel, dtype=shard_values.dtype, device=device)
        self.comm.all_gather(out, shard_values.to(device).contiguous())
        return out

    def param_slice(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s part of a full padded tensor laid out like this unit, in its shape."""
        slot = self.plan.params[index]
        return flat[slot.offset: slot.end].view(slot.shape)

    def tensors(self) -> list[torch.Tensor]:
        """The buffers this unit holds right now (for memory accounting)."""
        held = [self.shard] if not self.persistent else []
        if self.phase is not UnitPhase.RELEASED:
            held.append(self.full)
        return held
