"""One model's training state kept by several states, each over its own parameters and replica group.

Expert parameters (mixture of experts) are replicated over a smaller group than the rest of the
model: the ranks holding the same experts (expert-data-parallel), not the whole data-parallel group.
Rather than teach every stage about two groups, a :class:`SplitState` composes ordinary states: one
over the dense parameters and the data-parallel group, one over the expert parameters and their
group, and drives them as one :class:`~zerospeed.zero.contract.ModelState`. The parts share the one
optimizer (each adopts its own parameter groups; each steps only the pieces it gave gradients to),
and the gradient norm is the sum of each part's, each summed over the ranks its gradients differ on.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import ContextManager, Iterator, Mapping, Sequence

import torch

from zerospeed.sharding.slots import ParamInfo, Slot
from zerospeed.zero.contract import CheckpointGroups, ModelState
from zerospeed.zero.step_grads import StepGrads


class SplitStepGrads(StepGrads):
    """The parts' step gradients as one: scaling applies to every part; each part keeps its own."""

    def __init__(self, parts: Sequence[StepGrads]):
        entries = [entry for part in parts for entry in part.entries]
        skip = [ranges for part in parts for ranges in part.skip]
        device = parts[0].device if parts else torch.device("cpu")
        super().__init__(entries, device, skip)
        self.parts = list(parts)

    def _record(self, op: str, value: float) -> None:
        for part in self.parts:
            part._record(op, value)
        self.ops.append((op, value))


class SplitState:
    """A :class:`ModelState` made of ``parts``, states over disjoint parameter sets of one model."""

    def __init__(self, parts: Sequence[ModelState], *, names: Sequence[Mapping[str, str]] = ()):
        """``names``: per part, the name a checkpoint stores a parameter under when it is not the
        module's (an expert by its global index, so a checkpoint reloads at any expert-parallel degree)."""
        if len(parts) < 2:
            raise ValueError(f"a SplitState needs at least two parts, got {len(parts)}")
        stages = {part.stage for part in parts}
        if len(stages) != 1:
            raise ValueError(f"the parts of a SplitState must be at one ZeRO stage, got {sorted(stages)}")
        self.parts = list(parts)
        self.names = [dict(m) for m in names] + [{} for _ in range(len(parts) - len(names))]
        self.stage = parts[0].stage
        self._unit_counts: list[int] | None = None

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.parts[0].optimizer

    @property
    def unit_count(self) -> int:
        return sum(self._counts())

    def keeps(self, param: torch.Tensor) -> bool:
        return any(part.keeps(param) for part in self.parts)

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """Each part adopts the optimizer groups holding its parameters (every group must belong to one part:
        see :func:`group_owner`)."""
        groups = list(optimizer.param_groups)
        mine = [[] for _ in self.parts]  # type: list[list[dict]]
        for g, group in enumerate(groups):
            mine[self._part_of_group(g, group)].append(group)
        try:
            for part, own in zip(self.parts, mine, strict=True):
                optimizer.param_groups = own
                part.adopt(optimizer)
        finally:
            optimizer.param_groups = groups  # the same dicts, now holding each part's masters or pieces

    def _part_of_group(self, index: int, group: dict) -> int:
        owners = {self._part_of(p) for p in group["params"]}
        if len(owners) > 1:
            raise ValueError(f"optimizer param group {index} mixes parameters kept by different replica groups "
                             f"(expert and non-expert parameters); build the groups with "
                             f"zerospeed.moe.utils.split_params_into_different_moe_groups_for_optimizer")
        return owners.pop() if owners else 0

    def _part_of(self, param: torch.Tensor) -> int:
        for i, part in enumerate(self.parts):
            if part.keeps(param):
                return i
        raise ValueError(f"a tensor of shape {tuple(param.shape)} in the optimizer is not a parameter of the model")

    # -- backward -------------------------------------------------------------------------------
    def begin_backward(self, reduce: bool) -> None:
        for part in self.parts:
            part.begin_backward(reduce)

    def end_backward(self) -> None:
        for part in self.parts:
            part.end_backward()

    def allows_no_sync(self) -> bool:
        return all(part.allows_no_sync() for part in self.parts)

    # -- step -----------------------------------------------------------------------------------
    def step_grads(self) -> StepGrads:
        return SplitStepGrads([part.step_grads() for part in self.parts])

    def squared_norm(self, grads: StepGrads) -> torch.Tensor:
        """The global squared gradient norm: each part's local squared norm summed over its own ranks."""
        assert isinstance(grads, SplitStepGrads)
        total = torch.zeros((), dtype=torch.float64)
        for part, part_grads in zip(self.parts, grads.parts, strict=True):
            total = total + part.squared_norm(part_grads).to(torch.float64).cpu()
        return total

    def sum_over_ranks(self, local: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("a SplitState's parts are summed over different ranks: use squared_norm(grads)")

    def apply(self) -> None:
        for part in self.parts:
            part.apply()

    def zero(self) -> None:
        for part in self.parts:
            part.zero()

    def settle(self) -> None:
        for part in self.parts:
            part.settle()

    # -- memory and offload ---------------------------------------------------------------------
    def _counts(self) -> list[int]:
        if self._unit_counts is None:
            self._unit_counts = [part.unit_count for part in self.parts]
        return self._unit_counts

    def _route(self, units: Sequence[int] | None) -> list[Sequence[int] | None]:
        """Global unit indices -> each part's own (None: every unit of every part)."""
        if units is None:
            return [None] * len(self.parts)
        out: list[list[int]] = [[] for _ in self.parts]
        start = 0
        bounds = []
        for count in self._counts():
            bounds.append((start, start + count))
            start += count
        for u in units:
            for i, (lo, hi) in enumerate(bounds):
                if lo <= u < hi:
                    out[i].append(u - lo)
                    break
            else:
                raise ValueError(f"unit {u} is not a unit of this state ({start} units)")
        return list(out)

    def resident_state(self, units: Sequence[int] | None = None, write_back: bool = False) -> ContextManager[None]:
        return self._resident(self._route(units), write_back)

    @contextlib.contextmanager
    def _resident(self, routed: list[Sequence[int] | None], write_back: bool) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for part, own in zip(self.parts, routed, strict=True):
                if own is None or own:
                    stack.enter_context(part.resident_state(own, write_back))
            yield

    def memory_breakdown(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for part in self.parts:
            for key, value in part.memory_breakdown().items():
                total[key] = total.get(key, 0) + value
        return total

    def offload_io(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for part in self.parts:
            for key, value in part.offload_io().items():
                total[key] = total.get(key, 0.0) + value
        return total

    def describe_offload(self) -> str:
        return "; ".join(part.describe_offload() for part in self.parts)

    def release_all(self) -> None:
        for part in self.parts:
            part.release_all()

    # -- checkpoints ----------------------------------------------------------------------------
    def checkpoint_params(self) -> list[ParamInfo]:
        return [dataclasses.replace(info, name=names.get(info.name, info.name))
                for part, names in zip(self.parts, self.names, strict=True) for info in part.checkpoint_params()]

    def checkpoint_groups(self) -> CheckpointGroups:
        groups: list[tuple[int, ...] | None] = []
        offset = 0
        for part, count in zip(self.parts, self._counts(), strict=True):
            own = part.checkpoint_groups()
            for group in own.groups:
                groups.append(tuple(offset + u for u in (group if group is not None else range(count))))
            offset += count
        in_memory = all(part.checkpoint_groups().in_memory for part in self.parts)
        if all(group == () for group in groups):  # no part has units (stage 0): one visit of everything
            return CheckpointGroups((None,), in_memory)
        return CheckpointGroups(tuple(groups), in_memory)

    def checkpoint_slots(self, for_save: bool, units: Sequence[int] | None = None) -> list[Slot]:
        out: list[Slot] = []
        for part, own, names in zip(self.parts, self._route(units), self.names, strict=True):
            if own is None or own:
                out += [dataclasses.replace(slot, param=names[slot.param]) if slot.param in names else slot
                        for slot in part.checkpoint_slots(for_save, own)]
        return out

    def after_checkpoint_load(self, units: Sequence[int] | None = None) -> None:
        for part, own in zip(self.parts, self._route(units), strict=True):
            if own is None or own:
                part.after_checkpoint_load(own)

    def full_param_values(self) -> Iterator[tuple[str, torch.Tensor]]:
        for part, names in zip(self.parts, self.names, strict=True):
            for name, value in part.full_param_values():
                yield names.get(name, name), value

    # -- lifetime -------------------------------------------------------------------------------
    def remove_hooks(self) -> None:
        for part in self.parts:
            part.remove_hooks()

    def detach_model(self) -> None:
        for part in self.parts:
            part.detach_model()


__all__ = ["SplitState", "SplitStepGrads"]
