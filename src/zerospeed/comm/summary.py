"""``deepspeed.comm.configure`` / ``log_summary`` and friends, over one process-wide :class:`CommsLogger`.

DeepSpeed keeps one communication logger per process: ``deepspeed.comm.configure(...)`` (or an
engine whose config has a ``comms_logger`` section) turns it on, every collective of
``deepspeed.comm`` and of the engine's Comms records into it, and ``log_summary()`` prints it. So
every :class:`~zerospeed.distributed.comm.Comm` records into that one logger unless it is given one of
its own (:func:`process_logger`, held in :mod:`zerospeed.distributed.comms_logger`: the mesh's Comms and
the ones outside it, such as pipeline tied groups, ``zero.Init``, checkpoints and the compressed backend).

``log_summary`` runs no collective unless ``show_straggler=True`` (DeepSpeed brackets it with two
barriers; the table is printed by global rank 0 only either way). The straggler view gathers which
(op, size) records each rank has, then all-reduces their latencies with MIN over the world, call by
call, on a Comm that does not record: those collectives never show in the table. Records that are
not on every rank with the same count (pipeline stages' send/recv, a subgroup's ops) are left out of
the straggler view, since there is no call-by-call partner to compare with.
"""

from __future__ import annotations

import os
from datetime import datetime
from typing import Any, Iterable, Mapping

import torch

from zerospeed.distributed import groups
from zerospeed.distributed.comm import Comm
from zerospeed.distributed.comms_logger import CommsLogger, format_table, process_logger, straggler_entry
from zerospeed.distributed.env import process_group_timeout

__all__ = ["configure", "log_summary", "reset_log", "has_comm_data", "get_comm_operation_count",
           "get_logged_comm_ops", "process_logger", "configure_from_config"]


def configure_from_config(config: Any) -> bool:
    """Configure the process logger from a config's ``comms_logger`` section when it is enabled.

    ``config``: a zerospeed ``Config`` (or anything with a parsed ``comms_logger`` attribute), a raw
    DeepSpeed config mapping, or a JSON file path. Returns whether it was enabled. (DeepSpeed turns the logger on whenever the
    section is present, even with ``"enabled": false``; zerospeed follows the ``enabled`` key.)
    """
    from zerospeed.config import CommsLoggerConfig
    from zerospeed.config.load import read_source

    if isinstance(config, (str, os.PathLike)):
        config = read_source(config)
    if isinstance(config, Mapping):
        raw = config.get("comms_logger")
        section = CommsLoggerConfig.model_validate(raw) if raw is not None else CommsLoggerConfig()
    elif isinstance(getattr(config, "comms_logger", None), CommsLoggerConfig):
        section = config.comms_logger
    else:
        raise TypeError(f"deepspeed_config={type(config).__name__}: expected a zerospeed Config (an engine's "
                        f"engine.config), a DeepSpeed config dict or a JSON config path")
    if section.enabled:
        process_logger().configure_from(section)
    return bool(section.enabled)


def configure(deepspeed_config: Any = None, enabled: bool | None = None, prof_all: bool | None = None,
              prof_ops: Iterable[str] | None = None, verbose: bool | None = None, debug: bool | None = None) -> None:
    """DeepSpeed's ``deepspeed.comm.configure``: settings from a config's ``comms_logger`` section, then
    the keyword arguments given (None leaves a setting as it is)."""
    if deepspeed_config is not None:
        configure_from_config(deepspeed_config)
    process_logger().configure(enabled=enabled, prof_all=prof_all, prof_ops=prof_ops, verbose=verbose, debug=debug)


def reset_log() -> None:
    """Forget every record (e.g. at the start of an epoch)."""
    process_logger().reset_data()


def has_comm_data() -> bool:
    return process_logger().has_data()


def get_comm_operation_count() -> int:
    """Calls recorded, over every op and size."""
    return process_logger().get_total_operations()


def get_logged_comm_ops() -> list[str]:
    return process_logger().get_operation_names()


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> dict[str, Any] | None:
    """Print (global rank 0) the table of recorded collectives; with ``return_dict`` return it on every rank.

    ``show_straggler`` is collective (every rank must call it): per op and size, the minimum over ranks
    of each call's latency (the collective's own time) and this rank's excess over it (its wait for
    others). The dict has DeepSpeed's layout: ``summary``, ``straggler_analysis`` (None without
    ``show_straggler``) and ``metadata``.
    """
    logger = process_logger()
    summary = logger.summary()
    straggler = _straggler(logger) if show_straggler else None
    rank = groups.group_rank() if groups.is_initialized() else 0
    if rank == 0:
        print(format_table(summary, straggler), flush=True)
    if not return_dict:
        return None
    world = groups.group_size() if groups.is_initialized() else 1
    return {"summary": summary, "straggler_analysis": straggler,
            "metadata": {"world_size": world, "rank": rank, "timestamp": datetime.now().isoformat()}}


def _straggler(logger: CommsLogger) -> dict[str, dict[int, dict[str, Any]]]:
    records = {(name, size): r for name, sizes in logger.records.items() for size, r in sorted(sizes.items())}
    if not groups.is_initialized():
        return {name: {size: straggler_entry(r.latencies, r.latencies, size)} for (name, size), r in records.items()}
    comm = Comm(groups.world_group(), name="comms_logger", timeout=process_group_timeout(), track_arrivals=False,
                comms_logger=CommsLogger())  # a disabled logger of its own: these calls never show in the table
    mine = {key: r.count for key, r in records.items()}
    everyone = comm.all_gather_object(sorted(mine.items()))
    shared = [key for key, count in sorted(mine.items()) if all(dict(theirs).get(key) == count for theirs in everyone)]
    if not shared:
        return {}
    # the device the world's backend talks from (NCCL: this rank's GPU)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.distributed.get_backend() == "nccl" else torch.device("cpu")
    least = torch.tensor([lat for key in shared for lat in records[key].latencies], dtype=torch.float64, device=device)
    comm.all_reduce(least, "min")
    least = least.cpu()
    out: dict[str, dict[int, dict[str, Any]]] = {}
    offset = 0
    for name, size in shared:
        count = records[(name, size)].count
        out.setdefault(name, {})[size] = straggler_entry(records[(name, size)].latencies,
                                                         least[offset: offset + count].tolist(), size)
        offset += count
    return out
