"""The one exception type the config package raises for bad user input."""

from __future__ import annotations

from collections.abc import Iterable


class ConfigError(ValueError):
    """A configuration problem, reported as one ``key.path: what is wrong`` line per problem.

    Subclasses ``ValueError`` so callers that already catch ``ValueError`` keep working;
    ``problems`` keeps the individual lines for programs that want them.
    """

    def __init__(self, problems: str | Iterable[str]) -> None:
        lines = (problems,) if isinstance(problems, str) else tuple(problems)
        self.problems: tuple[str, ...] = lines
        super().__init__("\n".join(lines))
