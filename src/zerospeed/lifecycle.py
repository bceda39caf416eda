"""Checked lifecycles: a small enum of states and the moves allowed between them.

Residency and ordering bugs (a buffer given back while a write still reads it, a slab read twice over
itself, a gradient bucket reduced twice) corrupt state silently; a table of allowed moves turns them
into an error at the wrong move. Every lifecycle in the package (slabs and leases in ``offload/``,
gradient buckets and shard windows, a unit's gather cycle in ``zero/``) is checked by one of these.
"""

from __future__ import annotations

import enum
from typing import Callable, Generic, Mapping, TypeVar

S = TypeVar("S", bound=enum.Enum)


class IllegalTransition(AssertionError):
    """An internal invariant broke: a lifecycle was asked for a move its table does not allow."""


def _by_name(state: enum.Enum) -> str:
    return state.name


class Transitions(Generic[S]):
    """The moves allowed between the states of one lifecycle (``allowed[a]``: where ``a`` may go).

    ``error``: the exception a forbidden move raises; ``label``: how a state is named in its message."""

    def __init__(self, allowed: Mapping[S, frozenset[S]], *, error: type[Exception] = IllegalTransition,
                 label: Callable[[S], str] = _by_name):
        self.allowed = dict(allowed)
        self.error = error
        self.label = label

    def check(self, who: str, old: S, new: S) -> S:
        """``new``, when ``old -> new`` is allowed; raises ``error`` ("``who`` cannot go from ...") otherwise."""
        if new not in self.allowed.get(old, frozenset()):
            raise self.error(f"{who} cannot go from {self.label(old)} to {self.label(new)}")
        return new
