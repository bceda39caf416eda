"""ZeRO stage 3: gather a unit's parameters just before its module runs, release them after.

Module hooks drive everything. Before a module's forward its units are all-gathered (waiting for a
prefetch if one is in flight) and its inputs are wrapped so that, in backward, a callback fires once
the gradients of those inputs exist, i.e. once the module's backward is over; after its forward the
units are released and a hook on the outputs' gradients gathers them again just before the module's
backward. The first forward records the order units are needed in; later steps follow that trace
(forward, then backward in reverse) to prefetch up to ``stage3_prefetch_bucket_size`` elements
ahead, never holding more than ``stage3_max_live_parameters`` gathered, and to keep a unit that is
needed again within ``stage3_max_reuse_distance`` elements instead of releasing and re-gathering it.
When a step departs from the trace, units are simply gathered on demand (and the trace is recorded
again), so a changed order costs speed, never correctness. Every rank runs the same module code, so
every rank issues the same gathers in the same order.

A forward that runs without grad (evaluation, generation: ZeRO-Inference) is followed by no backward
but, usually, by the same forward again (a decode step runs every unit once per token, in the same
order). There the trace is read as a cycle: the prefetch looks past the forward's end into the next
forward's first units (never into a backward that will not come), at least the next unit is always
prefetched, a unit counts as reused only within the same forward, and at the forward's end everything
is released except those first units already on their way for the next call. Each unit is read
once per forward, while the one before it computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from zerospeed.zero.flat_param import FlatParamUnit


@dataclass(frozen=True)
class PrefetchPolicy:
    """DeepSpeed's stage-3 knobs, in elements."""

    prefetch_elems: int = 50_000_000
    max_live_elems: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    overlap: bool = True  # False: never prefetch (``overlap_comm: false``)


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs whose backward runs once the module's own backward is done."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


@dataclass
class PrefetchStats:
    """What the coordinator did since it was made (for tests, benchmarks and progress reports)."""

    forwards: int = 0  # model forwards begun
    on_demand: int = 0  # units gathered when needed, nothing having fetched them ahead
    prefetched: int = 0  # gathers started ahead of need
    prefetch_used: int = 0  # ...of which the unit was used before being released
    prefetch_wasted: int = 0  # ...released without a use (a changed order, or an error)
    peak_live_elems: int = 0  # most non-persistent elements gathered (or in flight) at once
    # the latest forward's needs, in order: (unit index, whether it had been fetched ahead)
    last_forward: list[tuple[int, bool]] = field(default_factory=list)


class _Trace:
    """The unit order of one step (forward events, then the same in reverse for backward)."""

    def __init__(self, forward: list[int], numel: list[int]):
        self.forward_len = len(forward)
        self.seq = forward + forward[::-1]
        self.prefix = [0]
        for u in self.seq:
            self.prefix.append(self.prefix[-1] + numel[u])
        self.next_use: list[int | None] = [None] * len(self.seq)
        last: dict[int, int] = {}
        for i in range(len(self.seq) - 1, -1, -1):
            self.next_use[i] = last.get(self.seq[i])
            last[self.seq[i]] = i

    def find(self, unit: int, after: int) -> int | None:
        for i in range(after + 1, len(self.seq)):
            if self.seq[i] == unit:
                return i
        return None

    def reuse_distance(self, i: int, backward: bool = True) -> int | None:
        """Elements gathered between event ``i`` and the next use of its unit (None: no next use;
        ``backward=False``: no backward follows, so only a use later in the same forward counts)."""
        j = self.next_use[i]
        if j is None or (not backward and j >= self.forward_len):
            return None
        return self.prefix[j] - self.prefix[i + 1]

    def ahead(self, position: int, backward: bool) -> list[int]:
        """The units needed after event ``position``: the rest of the step, or (no backward) the
        rest of this forward followed by the next forward (the trace read as a cycle)."""
        if backward:
            return self.seq[position + 1:]
        forward = self.seq[: self.forward_len]
        return forward[position + 1:] + forward


class ParamCoordinator:
    """Installs the stage-3 hooks on ``model`` and decides when units are gathered and released."""

    def __init__(self, model: nn.Module, units: list[FlatParamUnit], users: dict[str, list[int]],
                 policy: PrefetchPolicy):
        self.units = units
        self.policy = policy
        self._numel = [u.numel for u in units]
        self._recording: list[int] | None = []
        self._trace: _Trace | None = None
        self._cursor = -1
        self._active = [0] * len(units)  # modules currently inside their forward, per unit
        self._last_event = [-1] * len(units)  # trace position of each unit's latest use
        self._in_forward = False  # inside the model's own forward (the trace records only there)
        self._backward = True  # the current forward runs with grad: a backward may follow
        self._ahead: set[int] = set()  # units gathered ahead of their use and not used yet
        self._carried: set[int] = set()  # of those, fetched for the next forward (no-grad cycle)
        self.stats = PrefetchStats()
        self._handles = []
        modules = dict(model.named_modules())
        for path, unit_ids in users.items():
            module = modules[path]
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(unit_ids), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_hook(unit_ids)))
        self._handles.append(model.register_forward_pre_hook(self._begin_forward, prepend=True))
        self._handles.append(model.register_forward_hook(self._end_forward))

    # -- accounting -------------------------------------------------------------------------
    def live_elems(self) -> int:
        return sum(u.numel for u in self.units if u.gathered and not u.persistent)

    def release_all(self, keep: set[int] | frozenset[int] = frozenset()) -> None:
        """Release every gathered unit (except ``keep``)."""
        for u, unit in enumerate(self.units):
            if u not in keep:
                self._release(u)

    def _release(self, unit_id: int) -> None:
        if unit_id in self._ahead:  # fetched ahead but never used: the trace was wrong this time
            self._ahead.discard(unit_id)
            self._carried.discard(unit_id)
            self.stats.prefetch_wasted += 1
        self.units[unit_id].release()

    # -- events -----------------------------------------------------------------------------
    def _event(self, unit_id: int) -> None:
        """Unit ``unit_id`` is needed now: gather it and prefetch what the trace says comes next."""
        if self._recording is not None and self._in_forward:
            self._recording.append(unit_id)
        position = self._trace.find(unit_id, self._cursor) if self._trace is not None else None
        if position is None:
            if self._trace is not None:  # the order changed: gather on demand and record it again
                self._trace, self._recording = None, []
        else:
            self._cursor = position
        self._last_event[unit_id] = -1 if position is None else position
        unit = self.units[unit_id]
        ahead = unit_id in self._ahead
        if ahead:
            self._ahead.discard(unit_id)
            self._carried.discard(unit_id)
            self.stats.prefetch_used += 1
        elif not unit.gathered and not unit.persistent:
            self.stats.on_demand += 1
        if self._in_forward:
            self.stats.last_forward.append((unit_id, ahead))
        # start this unit's gather (if no prefetch did), then queue the next ones behind it, and only
        # then wait: the storage always has the next read queued while this unit is copied and computed
        unit.gather(async_op=True)
        if position is not None and self.policy.overlap:
            self._prefetch(position)
        unit.wait()
        self._note_live()

    def _note_live(self) -> None:
        self.stats.peak_live_elems = max(self.stats.peak_live_elems, self.live_elems())

    def _prefetch(self, position: int) -> None:
        assert self._trace is not None
        budget = self.policy.prefetch_elems
        live = self.live_elems()
        # with no backward to come, the budget is a window ahead of the current unit (units on their
        # way count), and the next unit is always fetched, even when larger than the budget (the
        # storage then always has the next read queued; DeepSpeed's prefetcher also overshoots)
        first = not self._backward
        cycle_start = self._trace.forward_len - position - 1  # index in ``ahead`` where the next forward starts
        for k, u in enumerate(self._trace.ahead(position, self._backward)):
            unit = self.units[u]
            if unit.gathered:
                if not self._backward and u in self._ahead:  # on its way: part of the look-ahead window
                    budget -= unit.numel
                    first = False
                continue
            if (unit.numel > budget and not first) or live + unit.numel > self.policy.max_live_elems:
                return
            first = False
            unit.gather(async_op=True)
            self.stats.prefetched += 1
            self._ahead.add(u)
            if not self._backward and k >= cycle_start:
                self._carried.add(u)
            budget -= unit.numel
            live += unit.numel

    def _maybe_release(self, unit_id: int) -> None:
        if self._active[unit_id] > 0:
            return
        if self._trace is not None and self._last_event[unit_id] >= 0:
            distance = self._trace.reuse_distance(self._last_event[unit_id], backward=self._backward)
            if distance is not None and distance <= self.policy.max_reuse_distance \
                    and self.live_elems() <= self.policy.max_live_elems:
                return
        self._release(unit_id)

    # -- hooks ------------------------------------------------------------------------------
    def _begin_forward(self, module: nn.Module, args: Any) -> None:
        # a forward without backward may have left units gathered (or a module whose forward raised
        # inside it): released, except the first units the previous no-grad forward fetched for this one
        self.release_all(keep=self._carried)
        self._carried = set()
        self._active = [0] * len(self.units)
        self._cursor = -1
        self._last_event = [-1] * len(self.units)
        self._in_forward = True
        self._backward = torch.is_grad_enabled()
        self.stats.forwards += 1
        self.stats.last_forward = []
        if self._recording is not None:
            self._recording = []

    def _end_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._in_forward = False
        if self._recording is not None and self._trace is None:
            self._trace = _Trace(self._recording, self._numel)
            self._recording = None
        if not torch.is_grad_enabled() or not module.training:  # no backward expected: free it all now
            # ...but the next forward's first units, on their way (a decode step follows a decode step)
            self.release_all(keep=self._carried if not self._backward else frozenset())

    def _pre_hook(self, unit_ids: list[int]) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
            if _in_backward():
                # activation checkpointing recomputes this forward inside backward, and may stop it
                # early (its post-hook then never runs): the units stay gathered for the module's
                # backward and are released after it (``_after_backward``: through the original
                # forward's wrapped inputs, or — reentrant checkpointing, whose first forward ran
                # without grad — through the recompute's, wrapped here), not by the recompute
                for u in unit_ids:
                    self._event(u)
                if not torch.is_grad_enabled():
                    return args, kwargs
                return _wrap_inputs(args, kwargs, lambda: self._after_backward(unit_ids))
            for u in unit_ids:
                self._active[u] += 1
                self._event(u)
            if not torch.is_grad_enabled():
                return args, kwargs
            return _wrap_inputs(args, kwargs, lambda: self._after_backward(unit_ids))

        return hook

    def _post_hook(self, unit_ids: list[int]) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if _in_backward():  # a recompute (see the pre-hook): released after the module's backward
                return
            for u in unit_ids:
                self._active[u] -= 1
            for u in unit_ids:
                self._maybe_release(u)
            outputs = [t for t in _tensors(output) if t.requires_grad]
            if outputs and torch.is_grad_enabled():
                torch.autograd.graph.register_multi_grad_hook(
                    outputs, lambda _grad: self._before_backward(unit_ids), mode="any")

        return hook

    def _before_backward(self, unit_ids: list[int]) -> None:
        for u in reversed(unit_ids):
            self._event(u)

    def _after_backward(self, unit_ids: list[int]) -> None:
        for u in unit_ids:
            self._maybe_release(u)

    def end_backward(self) -> None:
        """After a whole backward: nothing stays gathered, whatever the graph looked like."""
        self._carried = set()
        self.release_all()
        self._cursor = -1

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _in_backward() -> bool:
    """Whether autograd is running a backward on this thread (a checkpointed forward being recomputed)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _wrap_inputs(args: tuple[Any, ...], kwargs: dict[str, Any],
                 callback: Callable[[], None]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Route the grad-requiring tensors among a module's direct arguments through ``_PostBackward``."""
    arg_slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    kwarg_slots = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    if not arg_slots and not kwarg_slots:
        return args, kwargs
    inputs = [args[i] for i in arg_slots] + [kwargs[k] for k in kwarg_slots]
    # one output per input, in order: the positional ones first, then the keyword ones
    wrapped = iter(_PostBackward.apply(callback, *inputs))
    new_args, new_kwargs = list(args), dict(kwargs)
    for i, tensor in zip(arg_slots, wrapped):  # zip stops at arg_slots' end without taking more
        new_args[i] = tensor
    for k, tensor in zip(kwarg_slots, wrapped):
        new_kwargs[k] = tensor
    return tuple(new_args), new_kwargs
