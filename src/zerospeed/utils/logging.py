"""DeepSpeed's logging helpers (``deepspeed.utils.logging``) over zerospeed's logger."""

from __future__ import annotations

import logging

# zerospeed's one logger (DeepSpeed scripts reach it as ``deepspeed.utils.logger``).
logger = logging.getLogger("zerospeed")

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
           "critical": logging.CRITICAL}


def _rank() -> int | None:
    from zerospeed.distributed import groups

    return groups.group_rank() if groups.is_initialized() else None


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the listed ranks (``[-1]``: every rank), prefixed with the rank. As in
    DeepSpeed, before ``init_distributed`` every call logs, and after it ``ranks=None`` logs nothing."""
    rank = _rank()
    wanted = list(ranks or [])
    if rank is not None and not (wanted[:1] == [-1] or rank in wanted):
        return
    logger.log(level, "[Rank %s] %s", -1 if rank is None else rank, message)


def set_log_level_from_string(log_level_str: str, custom_logger: logging.Logger | None = None) -> None:
    """Set the logger's level from a name (``"info"``, ``"warning"``, ...)."""
    level = _LEVELS.get(log_level_str.lower())
    if level is None:
        raise ValueError(f"log level {log_level_str!r} is not one of {sorted(_LEVELS)}")
    (custom_logger or logger).setLevel(level)


__all__ = ["log_dist", "logger", "set_log_level_from_string"]
