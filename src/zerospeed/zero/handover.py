"""1-bit optimizers at ZeRO stages 1-2: sharded while they warm up, replicated once they compress.

1-bit Adam, 0/1 Adam and 1-bit LAMB warm up as their uncompressed algorithm on averaged gradients:
elementwise updates (LAMB's norms summed over ranks), which ZeRO runs exactly on this rank's pieces
with its usual memory. Once the optimizer exchanges by itself, the algorithm needs, on every rank,
this rank's own whole gradient and the whole momentum (each rank compresses its whole momentum
with one scale), and every rank ends the exchange with the same averaged momentum. Sharding the
update would then cost an all-gather of the parameters every step, more bytes than the compression
saves; so at that point the state is handed over, once, to a replicated (stage-0) state: masters
and per-element optimizer states are all-gathered whole, the parameters leave their flat units,
and every rank applies the averaged momentum to its whole parameters, sending 1/32 of the bytes of
an fp32 all-reduce. Memory from then on is that of stage 0 (whole masters and states on every
rank): the price of the bandwidth, logged at the hand-over.

The hand-over happens at the end of the optimizer step that decides the next window's gradients
stay local (``zero()``), or at the end of a checkpoint load that restores such a phase
(``after_checkpoint_load``), never inside a window. It is one way: a replicated state keeps any
later window exact (stage 0 runs every phase), also after loading a warm-up checkpoint.
"""

from __future__ import annotations

import enum
import logging
from typing import Any, Callable, ContextManager, Iterator, Sequence

import torch
from torch import nn

from zerospeed.optim.exchange import ExchangingOptimizer
from zerospeed.sharding.slots import ParamInfo, Slot
from zerospeed.zero.contract import CheckpointGroups, ModelState
from zerospeed.zero.replicated import ReplicatedState
from zerospeed.zero.sharded import ShardedState
from zerospeed.zero.step_grads import StepGrads

log = logging.getLogger("zerospeed")

__all__ = ["HandoverPhase", "HandoverState"]


class HandoverPhase(enum.Enum):
    """Where the training state lives: ZeRO shards (warm-up), then whole on every rank."""

    SHARDED = "sharded"
    REPLICATED = "replicated"


class HandoverState:
    """A :class:`ShardedState` (stage 1 or 2) until the adopted 1-bit optimizer stops asking for averaged
    gradients, then a :class:`ReplicatedState` built by ``replicated`` over the same model and ranks."""

    def __init__(self, sharded: ShardedState, *, replicated: Callable[[], ReplicatedState]):
        if sharded.stage not in (1, 2):
            raise ValueError(f"HandoverState is for ZeRO stages 1-2, got {sharded.stage}")
        self.stage = sharded.stage
        self.module = sharded.module
        self.comm = sharded.comm
        self.phase = HandoverPhase.SHARDED
        self._sharded: ShardedState | None = sharded
        self._current: ModelState = sharded
        self._make_replicated = replicated
        self._exchange: ExchangingOptimizer | None = None
        self._groups: list[list[nn.Parameter]] = []  # the optimizer's groups of model parameters, as given

    # -- the hand-over ------------------------------------------------------------------------
    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """Remember the optimizer's groups (ZeRO keeps only this rank's pieces in them) and let the
        sharded state adopt it; every rank must hold a piece, so that every rank counts the same steps."""
        if not isinstance(optimizer, ExchangingOptimizer):
            raise TypeError(f"HandoverState is for optimizers that exchange by themselves (1-bit Adam, 0/1 Adam, "
                            f"1-bit LAMB); got {type(optimizer).__name__}")
        assert self._sharded is not None, "adopt() comes before any hand-over"
        self._groups = [list(group["params"]) for group in optimizer.param_groups]
        optimizer.bind_exchange(self.comm, pieces=True)
        self._sharded.adopt(optimizer)
        self._exchange = optimizer
        error = None
        if not self._sharded.zero_optimizer.pieces():
            error = ValueError(f"{type(optimizer).__name__} at ZeRO stage {self.stage}: rank {self.comm.rank} holds no "
                               f"element of any trainable parameter (the model is too small for "
                               f"{self.comm.world_size} ranks), so it would not count the optimizer's steps; "
                               f"use zero_optimization.stage 0")
        self.comm.fail_together(error, "1-bit optimizer at ZeRO stage 1-2", error_type=ValueError)

    def _hand_over_if_due(self) -> None:
        """Hand over when the optimizer wants the coming window's gradients left on their ranks (every
        rank's optimizer holds the same step counts, so every rank decides the same)."""
        if self.phase is HandoverPhase.SHARDED and self._exchange is not None \
                and not self._exchange.reduces_gradients():
            self._hand_over()

    def _hand_over(self) -> None:
        """Gather masters and per-element optimizer states whole, give the model its parameters back,
        and re-seat the optimizer on a replicated state (collective)."""
        sharded, optimizer = self._sharded, self.optimizer
        assert sharded is not None and optimizer is not None and self.phase is HandoverPhase.SHARDED
        sharded.settle()
        masters, states = _gather_whole(sharded, optimizer)
        sharded.detach_model()
        self._sharded = None
        replicated = self._make_replicated()
        optimizer.state.clear()
        for group, params in zip(optimizer.param_groups, self._groups):
            group["params"] = list(params)
        for p in (p for params in self._groups for p in params):
            if id(p) in states:
                optimizer.state[p] = states[id(p)]
        replicated.adopt(optimizer)  # the state moves to the masters with the groups
        with torch.no_grad():
            for model_param, master in zip(replicated.model_params, replicated.master_params, strict=True):
                master.copy_(masters[id(model_param)])
        assert self._exchange is not None
        self._exchange.params_replaced()
        replicated.after_checkpoint_load()  # the masters (and any restored rank-local values) into the model
        self._current, self.phase = replicated, HandoverPhase.REPLICATED
        if self.comm.rank == 0:
            held = replicated.memory_breakdown()
            log.info("ZeRO stage %d: %s now exchanges the momentum itself; masters and optimizer states are whole "
                     "on every rank from here on (%.1f MB of parameters, gradients and states per rank, as at "
                     "stage 0), and parameters are no longer all-gathered", self.stage,
                     type(optimizer).__name__, held["total"] / 2**20)

    # -- the model-state calls: the current state answers --------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._current.optimizer

    @property
    def unit_count(self) -> int:
        return self._current.unit_count

    def keeps(self, param: torch.Tensor) -> bool:
        return self._current.keeps(param)

    def begin_backward(self, reduce: bool) -> None:
        self._hand_over_if_due()  # normally done at the last zero(): a window never starts sharded and local
        self._current.begin_backward(reduce)

    def end_backward(self) -> None:
        self._current.end_backward()

    def allows_no_sync(self) -> bool:
        return self._current.allows_no_sync()

    def step_grads(self) -> StepGrads:
        return self._current.step_grads()

    def sum_over_ranks(self, local: torch.Tensor) -> torch.Tensor:
        return self._current.sum_over_ranks(local)

    def squared_norm(self, grads: StepGrads) -> torch.Tensor:
        return self._current.squared_norm(grads)

    def apply(self) -> None:
        self._current.apply()

    def zero(self) -> None:
        self._current.zero()
        self._hand_over_if_due()

    def settle(self) -> None:
        self._current.settle()

    def resident_state(self, units: Sequence[int] | None = None, write_back: bool = False) -> ContextManager[None]:
        return self._current.resident_state(units, write_back)

    def memory_breakdown(self) -> dict[str, int]:
        return self._current.memory_breakdown()

    def offload_io(self) -> dict[str, float]:
        return self._current.offload_io()

    def describe_offload(self) -> str:
        where = self._current.describe_offload()
        return f"{where} (1-bit optimizer at ZeRO stage {self.stage}: {self.phase.value})"

    def release_all(self) -> None:
        self._current.release_all()

    def checkpoint_params(self) -> list[ParamInfo]:
        return self._current.checkpoint_params()

    def checkpoint_groups(self) -> CheckpointGroups:
        return self._current.checkpoint_groups()

    def checkpoint_slots(self, for_save: bool, units: Sequence[int] | None = None) -> list[Slot]:
        return self._current.checkpoint_slots(for_save, units)

    def after_checkpoint_load(self, units: Sequence[int] | None = None) -> None:
        """Refresh the current state; a load that restored the compressing phase hands over here (the
        phase is known once the optimizer's rank-local state is restored, the load's last refresh)."""
        self._current.after_checkpoint_load(units)
        self._hand_over_if_due()

    def full_param_values(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._current.full_param_values()

    def remove_hooks(self) -> None:
        self._current.remove_hooks()

    def detach_model(self) -> None:
        self._current.detach_model()


def _gather_whole(state: ShardedState, optimizer: torch.optim.Optimizer
                  ) -> tuple[dict[int, torch.Tensor], dict[int, dict[str, Any]]]:
    """Every trainable parameter's whole fp32 master and optimizer state, by ``id`` of the model
    parameter (collective: one all-gather per unit and per-element key, one object all-gather)."""
    zopt, comm = state.zero_optimizer, state.comm
    per_element: set[str] = set()
    scalars: dict[int, dict[str, Any]] = {}  # index of the model parameter -> its non-tensor state
    index = 0
    for unit in state.units:
        for p in unit.params:
            piece = zopt.piece_of.get(id(p))
            for key, value in (optimizer.state.get(piece, {}) if piece is not None else {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    per_element.add(key)
                else:
                    scalars.setdefault(index, {})[key] = value.item() if isinstance(value, torch.Tensor) else value
            index += 1
    seen = comm.all_gather_object((sorted(per_element), scalars))
    keys = sorted({key for found, _ in seen for key in found})
    merged: dict[int, dict[str, Any]] = {}
    for _, found in seen:
        for i, values in found.items():
            merged.setdefault(i, dict(values))
    masters: dict[int, torch.Tensor] = {}
    states: dict[int, dict[str, Any]] = {}
    index = 0
    pieces_of: dict[int, list[tuple[nn.Parameter, int, int]]] = {}  # unit -> its pieces here, with their places
    for part, u, offset, numel in zopt.pieces():
        pieces_of.setdefault(u, []).append((part, offset, numel))
    for u, unit in enumerate(state.units):
        whole_master = unit.gather_shard_values(zopt.masters[u].float())
        whole = {}
        for key in keys:
            shard = torch.zeros(unit.plan.shard_numel, dtype=torch.float32, device=zopt.masters[u].device)
            for part, offset, numel in pieces_of.get(u, []):
                value = optimizer.state.get(part, {}).get(key)
                if isinstance(value, torch.Tensor):
                    shard[offset: offset + numel].copy_(value.reshape(-1))
            whole[key] = unit.gather_shard_values(shard)
        for i, p in enumerate(unit.params):
            masters[id(p)] = unit.param_slice(whole_master, i).clone()
            if unit.trainable[i] and index in merged:
                states[id(p)] = {**merged[index], **{key: unit.param_slice(whole[key], i).clone() for key in keys}}
            index += 1
    return masters, states
