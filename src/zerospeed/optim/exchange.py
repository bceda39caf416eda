"""Optimizers that average across data-parallel ranks themselves.

1-bit Adam, 0/1 Adam and 1-bit LAMB replace the gradient all-reduce by their own compressed
exchange of the momentum once their warm-up ends (and 0/1 Adam skips communication on some steps
altogether). The model state asks such an optimizer, window by window, whether it should still
average the gradients, and hands it the replica group it exchanges over; nothing else in the
engine knows about compression.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

from zerospeed.distributed.comm import Comm

__all__ = ["ExchangingOptimizer", "HoldsSideTensors", "RankLocalState"]


@runtime_checkable
class ExchangingOptimizer(Protocol):
    """An optimizer that owns (part of) the data-parallel exchange."""

    def bind_exchange(self, comm: Comm, *, pieces: bool = False) -> None:
        """The replica group the optimizer's collectives run over (given by the model state on adopt);
        ``pieces``: its tensors are ZeRO shard pieces until :meth:`params_replaced` hands it whole ones."""

    def reduces_gradients(self) -> bool:
        """Whether the coming window's gradients must be averaged by the model state (False: the
        optimizer receives this rank's own gradients and exchanges what it needs itself)."""

    def params_replaced(self) -> None:
        """The model state gave the optimizer other tensors for the same parameters (ZeRO's shard
        pieces replaced by whole tensors, their state re-keyed and gathered): derive again whatever
        the optimizer derived from its tensors or their state (phase, cached denominators)."""


@runtime_checkable
class RankLocalState(Protocol):
    """Optimizer state that differs from rank to rank (compression error buffers) and so is saved
    per rank rather than as element ranges of the parameters."""

    def rank_state(self) -> dict[str, Any]:
        """This rank's state: tensors and plain values, saved in its ``rank<N>.state.pt``."""

    def load_rank_states(self, read: Callable[[int], dict[str, Any]], saved_world: int, rank: int,
                         world_size: int) -> None:
        """Restore ``rank`` of ``world_size`` from a save of ``saved_world`` ranks, ``read(r)`` giving saved
        rank ``r``'s :meth:`rank_state`: the same world size restores this rank's own exactly (reading only
        it), another one reshapes every saved rank's."""


@runtime_checkable
class HoldsSideTensors(Protocol):
    """An optimizer keeping tensors outside ``optimizer.state`` (compression buffers), so a model
    state's memory accounting can count them."""

    def side_tensors(self) -> list:
        """Those tensors (``list[torch.Tensor]``)."""
