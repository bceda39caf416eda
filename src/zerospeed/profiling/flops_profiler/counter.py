"""Counting while a model runs: every dispatched aten op is costed (``rules.py``) and charged to the
innermost profiled module running it (forward) or to the backward total (any op autograd's engine runs,
recomputed forwards of activation checkpointing included).

Work autograd does to store a leaf's gradient (adding into ``.grad``, gradient hooks, the engine's
reduction in post-accumulate hooks) is not counted: the same forward and backward give the same numbers
whatever the ZeRO stage or accumulation state.

One :class:`OpTally` per profile holds everything (no module attributes, no module-global lists, no
patched ``torch.nn.functional``): counts are keyed by module identity, so two profilers never share
numbers and a profile started again starts from zero.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.hooks import RemovableHandle

from zerospeed.profiling.flops_profiler.rules import OpCost, op_cost


_ACCUMULATE_GRAD: type = getattr(torch._C._functions, "AccumulateGrad")  # the node that stores a leaf's gradient


def storing_gradients() -> bool:
    """True while autograd hands a leaf its gradient: adding into ``.grad``, the leaf's gradient hooks and
    post-accumulate hooks (the engine's gradient reduction). That work is bookkeeping, not the backward's
    gradient computation, and is not counted."""
    return isinstance(torch._C._current_autograd_node(), _ACCUMULATE_GRAD)


def in_backward() -> bool:
    """True while autograd's engine runs a backward on this thread (a gradient kernel, a tensor hook,
    or a forward recomputed by activation checkpointing)."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class ModuleCount:
    """What one module did itself during a profile (its children's work is theirs)."""

    flops: int = 0
    macs: int = 0
    duration: float = 0.0  # seconds inside the module's forward, children included
    calls: int = 0


@dataclass
class OpTally:
    """The numbers of one profile: per module (forward) and the backward's totals."""

    modules: dict[int, ModuleCount] = field(default_factory=dict)
    backward_flops: int = 0
    backward_macs: int = 0
    stack: list[tuple[int, float]] = field(default_factory=list)  # (module id, start time) of running forwards
    # where forward ops outside every profiled module go (None: nowhere); the engine points it at the model
    # inside its forward bracket, so a pipeline's tied-head ``forward_fn`` and ``loss_fn`` count
    outside: int | None = None

    def charge(self, cost: OpCost) -> None:
        if in_backward():
            if storing_gradients():
                return
            self.backward_flops += cost.flops
            self.backward_macs += cost.macs
            return
        owner = self.stack[-1][0] if self.stack else self.outside
        if owner is not None:  # else: the caller's own work (e.g. its loss), not the model's
            count = self.modules[owner]
            count.flops += cost.flops
            count.macs += cost.macs

    def reset(self) -> None:
        """Zero every count (modules keep their entries; forwards running now stay on the stack)."""
        for key in self.modules:
            self.modules[key] = ModuleCount()
        self.backward_flops = self.backward_macs = 0

    def of(self, module: nn.Module) -> ModuleCount:
        return self.modules.get(id(module), ModuleCount())


class CountingMode(TorchDispatchMode):
    """Runs each op, then hands its cost to ``charge`` (ops without a rule cost nothing)."""

    def __init__(self, charge: Callable[[OpCost], None]):
        super().__init__()
        self._charge = charge

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        cost = op_cost(func, args, kwargs, out)
        if cost.flops or cost.macs:
            self._charge(cost)
        return out


class ModuleHooks:
    """Forward pre/post hooks on every module of ``model`` (but those of an ignored type, whose work
    goes to their parent), keeping ``tally.stack`` and the modules' forward durations."""

    def __init__(self, model: nn.Module, tally: OpTally, *, ignore: Iterable[type] = (),
                 synchronize: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.perf_counter):
        self._tally = tally
        self._synchronize = synchronize
        self._clock = clock
        ignored = tuple(ignore)
        self._handles: list[RemovableHandle] = []
        seen: set[int] = set()
        for module in model.modules():
            if type(module) in ignored and module is not model or id(module) in seen:  # DeepSpeed: exact type
                continue
            seen.add(id(module))
            tally.modules.setdefault(id(module), ModuleCount())
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))

    def _enter(self, module: nn.Module, args: Any) -> None:
        if in_backward():  # a recompute: its ops are the backward's, its time is not the forward's
            return
        self._synchronize()
        self._tally.stack.append((id(module), self._clock()))

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if in_backward() or not self._tally.stack or self._tally.stack[-1][0] != id(module):
            return
        self._synchronize()
        _, start = self._tally.stack.pop()
        count = self._tally.modules[id(module)]
        count.duration += self._clock() - start
        count.calls += 1

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


__all__ = ["in_backward", "storing_gradients", "ModuleCount", "OpTally", "CountingMode", "ModuleHooks"]
