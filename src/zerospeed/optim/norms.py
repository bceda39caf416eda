"""Optimizers whose update reads whole-parameter norms (LAMB's trust ratio).

ZeRO hands an optimizer pieces of parameters; such an optimizer takes a reducer that turns its
pieces' squared norms into the whole parameters' (one small collective), so its update stays that
of the unsharded optimizer.
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

from torch import Tensor

__all__ = ["WholeTensorNorms"]


@runtime_checkable
class WholeTensorNorms(Protocol):
    """An optimizer that can be told how to sum its tensors' squared norms over ZeRO's ranks."""

    def reduce_norms_with(self, reducer: Callable[[list[Tensor], Tensor], Tensor]) -> None:
        """``reducer(pieces, squares)`` -> the whole parameters' squared norms (a collective: every rank
        calls it the same number of times, with or without pieces)."""
