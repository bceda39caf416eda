"""The contracts the engine, the checkpoint code and user utilities hold the ZeRO states to.

:class:`ModelState` is what every way of keeping a model's training state implements: stage 0
(:class:`~zerospeed.zero.replicated.ReplicatedState`) and stages 1-3
(:class:`~zerospeed.zero.sharded.ShardedState`) today, pipeline stages later. The engine drives a
step through it without knowing which one it has, and ``checkpoint/`` reads and writes any of them
through the same slots, so a new parallelism plugs in by implementing this and nothing else.

:class:`ParamOwner` is the one back-reference a trained parameter carries (``param._zerospeed_owner``)
to the state that holds its masters, gradients and optimizer states, so the DeepSpeed-named
``safe_get_full_*`` utilities and ``GatheredParameters`` work at every stage. Parameters that
``zero.Init`` partitioned before any engine exists carry an ``InitPartition`` instead (see
:func:`zerospeed.zero.owner.owner_of`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ContextManager, Iterator, Protocol, Sequence

import torch

from zerospeed.sharding.slots import ParamInfo, Slot
from zerospeed.zero.step_grads import StepGrads

if TYPE_CHECKING:
    from zerospeed.zero.flat_param import FlatParamUnit


@dataclass(frozen=True)
class CheckpointGroups:
    """How a checkpoint visits a state: ``groups`` of units made resident one at a time (``None``: every
    unit at once), and whether all of it is ``in_memory`` (then a save may hold every group's views at
    once and an asynchronous save may copy them and write later; swapped state is written group by
    group from the training thread)."""

    groups: tuple[tuple[int, ...] | None, ...]
    in_memory: bool

    @classmethod
    def everything_in_memory(cls) -> CheckpointGroups:
        return cls((None,), True)


class ModelState(Protocol):
    """Parameters, gradients and optimizer states of one model on this rank, at some ZeRO stage."""

    @property
    def stage(self) -> int:
        """The ZeRO stage (0-3), as recorded in checkpoints."""
        ...

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The torch optimizer, once :meth:`adopt` re-pointed it at this state's masters or shards."""
        ...

    @property
    def unit_count(self) -> int:
        """How many units checkpoints and ``resident_state`` index (0: none, everything at once)."""
        ...

    def keeps(self, param: torch.Tensor) -> bool:
        """Whether ``param`` (a model parameter) is one this state trains or holds."""
        ...

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """Take over ``optimizer``: its groups now hold this state's fp32 masters (or this rank's pieces)."""

    # backward
    def begin_backward(self, reduce: bool) -> None:
        """A backward starts; ``reduce``: it is the last of its accumulation window (reduce gradients)."""

    def end_backward(self) -> None:
        """The backward ended (its reductions may still be in flight until :meth:`step_grads`)."""

    def allows_no_sync(self) -> bool:
        """Whether ``engine.no_sync()`` can skip a reduction at this stage."""
        ...

    # step
    def step_grads(self) -> StepGrads:
        """This window's reduced gradients (this rank's part), ready to unscale, measure and clip."""
        ...

    def sum_over_ranks(self, local: torch.Tensor) -> torch.Tensor:
        """The sum of a per-rank partial (a squared norm) over the ranks that share gradients."""
        ...

    def squared_norm(self, grads: StepGrads) -> torch.Tensor:
        """The global squared norm (float64) of ``grads`` (from :meth:`step_grads`), every parameter
        counted once over all ranks."""
        ...

    def apply(self) -> None:
        """Run the optimizer on this window's gradients and publish the new weights to the model."""

    def zero(self) -> None:
        """End the accumulation window: drop its gradients."""

    def settle(self) -> None:
        """Wait for background optimizer work before masters or states are read or written from outside."""

    # memory and offload
    def resident_state(self, units: Sequence[int] | None = None, write_back: bool = False) -> ContextManager[None]:
        """Masters and optimizer states of ``units`` (default: all) in memory inside the block."""
        ...

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held now: ``params``, ``grads``, ``optimizer_states``, ``total``, ``buffers``,
        ``offloaded``, ``on_nvme`` (see ``Engine.memory_breakdown``)."""
        ...

    def offload_io(self) -> dict[str, float]:
        """Offload traffic since start: ``bytes_read``, ``bytes_written``, ``read_wait_s``, ``write_wait_s``."""
        ...

    def describe_offload(self) -> str:
        """Where state lives and when the optimizer steps, in one line (logged at ``initialize``)."""
        ...

    def release_all(self) -> None:
        """Free every gathered parameter (``engine.empty_partition_cache``); nothing when none are."""

    # checkpoints
    def checkpoint_params(self) -> list[ParamInfo]:
        """Every parameter's name, full shape, dtype and trainability, in the module's order."""
        ...

    def checkpoint_groups(self) -> CheckpointGroups:
        """How a checkpoint visits this state (see :class:`CheckpointGroups`)."""
        ...

    def checkpoint_slots(self, for_save: bool, units: Sequence[int] | None = None) -> list[Slot]:
        """The element ranges this rank writes (``for_save``) or needs (loading), optionally of ``units``."""
        ...

    def after_checkpoint_load(self, units: Sequence[int] | None = None) -> None:
        """Masters (of ``units``, default all) were overwritten: bring the model's weights in line."""

    def full_param_values(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter's full value by name, in the compute dtype (collective at stage 3)."""
        ...

    # lifetime
    def remove_hooks(self) -> None:
        """Take this state's hooks off the model (``engine.destroy``)."""

    def detach_model(self) -> None:
        """Give the model back whole and unhooked (it is passed to ``initialize`` again; collective)."""


class ParamOwner(ABC):
    """What a trained parameter's back-reference answers, at any stage (collective at stages 1-3:
    every rank calls it for the same parameter)."""

    state: ModelState  # the state that trains the parameter

    @property
    def unit(self) -> FlatParamUnit | None:
        """The flat unit holding the parameter (stages 1-3), or None (stage 0)."""
        return None

    @abstractmethod
    def full_fp32(self) -> torch.Tensor:
        """A copy of the full fp32 master."""

    @abstractmethod
    def full_grad(self) -> torch.Tensor | None:
        """A copy of the full averaged fp32 gradient, or None when there is none."""

    @abstractmethod
    def full_optimizer_state(self, key: str) -> torch.Tensor | None:
        """A copy of the full optimizer state ``key`` (e.g. ``"exp_avg"``), or None."""

    @abstractmethod
    def set_full_fp32(self, value: torch.Tensor) -> None:
        """Overwrite the master and the model's copy with ``value`` (the same on every rank)."""


__all__ = ["CheckpointGroups", "ModelState", "ParamOwner"]
