"""A unit's parameters as views into one flat, padded buffer, of which each rank owns a shard.

``full`` holds the whole unit in the compute dtype; every model parameter's ``.data`` is a view into
it, set once, so the module's own ``Parameter`` objects stay in place (optimizers, hooks and user
code keep working). A *persistent* unit (stages 1-2, and small parameters under stage 3) keeps
``full`` allocated and its ``shard`` is a view of it. Otherwise (stage 3) the shard is a separate
tensor and ``full``'s storage is freed between uses (``resize_(0)``, as FSDP does): views, including
the ones autograd saved for backward, keep pointing at the same storage, which :meth:`gather`
re-allocates and fills, so backward sees the right values again without any tensor being re-made.
"""

from __future__ import annotations

import torch
from torch import nn

from zerospeed.dist.comm import Comm, Handle
from zerospeed.sharding.plan import UnitPlan


class FlatParamUnit:
    """The parameters of one unit, flat; see the module docstring."""

    def __init__(self, plan: UnitPlan, params: list[nn.Parameter], comm: Comm, *, persistent: bool,
                 shards_given: bool = False):
        """``shards_given``: the params' ``.data`` already hold only this rank's pieces (zero.Init)."""
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
        lo, hi = plan.shard_range(comm.rank)
        self.full = torch.zeros(plan.padded_numel, dtype=self.dtype, device=device)
        if shards_given:
            raise NotImplementedError  # filled in by zero.Init (see init.py)
        with torch.no_grad():
            for slot, p in zip(plan.params, params):
                self.full[slot.offset: slot.end].copy_(p.detach().reshape(-1))
        self.shard = self.full[lo:hi] if persistent else self.full[lo:hi].clone()
        for slot, p in zip(plan.params, params):
            p.data = self.full[slot.offset: slot.end].view(slot.shape)
        self._pending: Handle | None = None
        self._gathered = True
        if not persistent:
            self.release()

    # -- state ------------------------------------------------------------------------------
    @property
    def gathered(self) -> bool:
        """True while ``full`` holds every rank's values (or a gather of them is in flight)."""
        return self._gathered

    @property
    def numel(self) -> int:
        return self.plan.padded_numel

    def release(self) -> None:
        """Free ``full``'s memory (non-persistent units only); the parameters keep their shapes."""
        if self.persistent or not self._gathered:
            return
        self.wait()
        self.full.untyped_storage().resize_(0)
        self._gathered = False

    def gather(self, async_op: bool = False) -> None:
        """All-gather every rank's shard into ``full``; ``wait()`` before reading when async."""
        if self._gathered:
            if not async_op:
                self.wait()
            return
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        self._gathered = True
        self._pending = self.comm.all_gather(self.full, self.shard, async_op=True)
        if not async_op:
            self.wait()

    def wait(self) -> None:
        if self._pending is not None:
            handle, self._pending = self._pending, None
            handle.wait()

    def publish_shard(self, async_op: bool = True) -> Handle | None:
        """After an update of ``shard``: all-gather it into ``full`` (persistent units; others are
        gathered on their next use)."""
        if not self.persistent:
            return None
        return self.comm.all_gather(self.full, self.shard, async_op=async_op)

    def full_param(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s full values (gathered if needed; a copy when the unit is released)."""
        slot = self.plan.params[index]
        if self._gathered:
            self.wait()
            return self.full[slot.offset: slot.end].view(slot.shape)
        self.gather()
        try:
            return self.full[slot.offset: slot.end].view(slot.shape).clone()
        finally:
            self.release()

    def tensors(self) -> list[torch.Tensor]:
        """The buffers this unit holds right now (for memory accounting)."""
        held = [self.shard] if not self.persistent else []
        if self._gathered:
            held.append(self.full)
        return held
