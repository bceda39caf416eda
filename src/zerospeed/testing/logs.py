"""Collect what zerospeed logs inside a rank (pytest's ``caplog`` does not reach spawned processes)."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator


class _Collect(logging.Handler):
    def __init__(self, messages: list[str]) -> None:
        super().__init__()
        self.messages = messages

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def log_messages(level: int = logging.INFO, name: str = "zerospeed") -> Iterator[list[str]]:
    """The messages logger ``name`` emits at ``level`` or above while the block runs (the logger's
    level is lowered to ``level`` for the block and restored after it)."""
    logger = logging.getLogger(name)
    messages: list[str] = []
    handler = _Collect(messages)
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
