"""Checked lifecycles: a small enum of states and the moves allowed between them.

Residency bugs (a buffer given back while a write still reads it, a slab read twice over itself)
corrupt state silently; a table of allowed moves turns them into an error at the wrong move.
"""

from __future__ import annotations

import enum
from typing import Generic, Mapping, TypeVar

S = TypeVar("S", bound=enum.Enum)


class IllegalTransition(AssertionError):
    """An internal invariant broke: a lifecycle was asked for a move its table does not allow."""


class Transitions(Generic[S]):
    """The moves allowed between the states of one lifecycle (``allowed[a]``: where ``a`` may go)."""

    def __init__(self, what: str, allowed: Mapping[S, frozenset[S]]):
        self.what = what
        self.allowed = dict(allowed)

    def check(self, who: str, old: S, new: S) -> S:
        """``new``, when ``old -> new`` is allowed; raises :class:`IllegalTransition` otherwise."""
        if new not in self.allowed.get(old, frozenset()):
            raise IllegalTransition(f"{who}: {self.what} cannot go from {old.name} to {new.name}")
        return new
