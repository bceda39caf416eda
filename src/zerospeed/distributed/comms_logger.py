"""DeepSpeed's communication logger: per collective, its count, message size, latency and bandwidths.

A :class:`CommsLogger` is a collaborator a :class:`~zerospeed.distributed.comm.Comm` holds. When it is
disabled (the default) a collective pays one attribute read for it and nothing is recorded; when it is
enabled, each collective whose name passes the filter (``prof_all``, or its name in ``prof_ops``) is
timed and recorded under its name and message size, as DeepSpeed's ``comms_logger`` does.

Timing rule: a collective's latency runs from the moment it enters Comm (before it is issued) to the end
of the wait that completes it, post-processing included (unpadding copies, the division of an ``avg``).
A synchronous call is timed around the call. An ``async_op=True`` call is recorded when its handle's
``wait()`` returns (or ``is_completed()`` first sees it done), so its latency includes whatever the
caller overlapped with it: it is the time until the result was in hand, an upper bound of the time on
the wire. A handle never waited for is never recorded. On NCCL the device is synchronized before the
clock stops, as DeepSpeed does; on gloo the wait itself is the end.

Message size (DeepSpeed's convention, the size ``calc_bw_log`` expects): the tensor of the call for
all_reduce, broadcast, send and recv; this rank's input for all_to_all(_single); this rank's part for
all_gather and reduce_scatter (the widest part when parts are uneven: what each rank puts in the padded
collective), which the formula multiplies by the group size. DeepSpeed records the whole input of
``reduce_scatter_tensor`` and then multiplies it by the group size again, reporting bandwidths n times
too high; zerospeed records the part, so both directions agree with nccl-tests. The group size ``n`` is
the size of the Comm's group (DeepSpeed uses the world size even for a subgroup). Barrier has size 0.
Bandwidths are in Gbps (10^9 bits per second), latencies in milliseconds; averages are DeepSpeed's
trimmed means (10% cut at each end).

Formulas (``calc_bw_log``, ``S`` bytes, ``t`` ms): all_gather / reduce_scatter: ``S *= n``, then as
all_to_all; all_to_all(_single): algbw ``S/t``, busbw ``S/t * (n-1)/n``; all_reduce: algbw ``2S/t``,
busbw ``S/t * 2(n-1)/n``; broadcast, send, recv, barrier (reduce, gather, scatter): both ``S/t``.
Each then ``* 8 / 1e6`` (bytes per ms to Gbps). A zero latency gives zero bandwidths.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

log = logging.getLogger("zerospeed")

# Formula families of calc_bw_log, by operation kind. DeepSpeed's spellings are kept alongside Comm's.
_GATHER_LIKE = frozenset({"all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor"})
_ALL_TO_ALL = frozenset({"all_to_all", "all_to_all_single"})
_ALL_REDUCE = frozenset({"all_reduce", "all_reduce_coalesced", "inference_all_reduce"})
_POINT = frozenset({"send", "recv", "isend", "irecv", "broadcast", "reduce", "gather", "scatter", "barrier"})
KINDS = _GATHER_LIKE | _ALL_TO_ALL | _ALL_REDUCE | _POINT

# DeepSpeed's record names for Comm's ops, so ``prof_ops: ["all_gather_into_tensor"]`` selects Comm's all_gather.
_DEEPSPEED_NAMES = {
    "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter", "isend": "send",
    "irecv": "recv", "all_to_all_single": "all_to_all",
}
_TRIM = 0.1  # DeepSpeed's trimmed means cut 10% at each end
_SIZE_UNITS = ("B", "KB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB")
_COL = 20  # DeepSpeed's table column width


def calc_bw_log(kind: str, size: int, duration_ms: float, world_size: int) -> tuple[float, float]:
    """DeepSpeed's ``(algbw, busbw)`` in Gbps of a ``kind`` collective of ``size`` bytes taking ``duration_ms``."""
    n = world_size
    if duration_ms <= 0:
        return 0.0, 0.0
    if kind in _GATHER_LIKE:
        size *= n
        algbw, busbw = size / duration_ms, size / duration_ms * ((n - 1) / n)
    elif kind in _ALL_TO_ALL:
        algbw, busbw = size / duration_ms, size / duration_ms * ((n - 1) / n)
    elif kind in _ALL_REDUCE:
        algbw, busbw = size * 2 / duration_ms, size / duration_ms * (2 * (n - 1) / n)
    elif kind in _POINT:
        algbw = busbw = size / duration_ms
    else:
        raise ValueError(f"calc_bw_log: unknown collective kind {kind!r}; expected one of {', '.join(sorted(KINDS))}")
    return algbw * 8 / 1e6, busbw * 8 / 1e6


def convert_size(size_bytes: int) -> str:
    """``1536`` -> ``"1.5 KB"``: DeepSpeed's human-readable message size (powers of 1024, two decimals)."""
    if size_bytes == 0:
        return "0B"
    i = 0
    while i + 1 < len(_SIZE_UNITS) and size_bytes >= 1024 ** (i + 1):
        i += 1
    return f"{round(size_bytes / 1024 ** i, 2)} {_SIZE_UNITS[i]}"


def trim_mean(data: Iterable[float], trim: float = _TRIM) -> float:
    """The mean of ``data`` without its ``round(n * trim)`` smallest and largest values (0 when empty)."""
    values = sorted(data)
    n = len(values)
    if n == 0:
        return 0.0
    k = int(round(n * trim))
    kept = values[k: n - k]
    return sum(kept) / len(kept)


@dataclass
class OpRecord:
    """Every call of one op at one message size: latencies (ms) and bandwidths (Gbps), in call order."""

    latencies: list[float] = field(default_factory=list)
    algbw: list[float] = field(default_factory=list)
    busbw: list[float] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.latencies)


class Probe:
    """One collective being timed; :meth:`stop` records it (once)."""

    __slots__ = ("_logger", "kind", "name", "msg_size", "world_size", "_start", "_sync")

    def __init__(self, logger: "CommsLogger", kind: str, name: str, msg_size: int, world_size: int, sync: bool):
        self._logger, self.kind, self.name, self.msg_size, self.world_size = logger, kind, name, msg_size, world_size
        self._sync = sync
        self._start = logger.clock()

    def stop(self) -> None:
        if self._sync:
            torch.cuda.synchronize()
        latency_ms = (self._logger.clock() - self._start) * 1e3
        self._logger.append(self.kind, self.name, self.msg_size, latency_ms, self.world_size)


class CommsLogger:
    """Records collectives per name and message size when enabled; the settings are DeepSpeed's.

    ``enabled``: record at all. ``prof_all``: every op; otherwise only names in ``prof_ops`` (Comm's names,
    or DeepSpeed's: ``all_gather_into_tensor``, ``reduce_scatter_tensor``...). ``verbose``: log each call
    on global rank 0. ``debug``: record under ``"name | [Caller Func: f]"``, ``f`` the function that
    called into the communication layer. ``clock`` returns seconds (a test may pass a fake one).
    """

    def __init__(self, *, enabled: bool = False, prof_all: bool = True, prof_ops: Iterable[str] = (),
                 verbose: bool = False, debug: bool = False, clock: Callable[[], float] = time.perf_counter):
        self.enabled = enabled
        self.prof_all = prof_all
        self.prof_ops: tuple[str, ...] = tuple(prof_ops)
        self.verbose = verbose
        self.debug = debug
        self.clock = clock
        self.records: dict[str, dict[int, OpRecord]] = {}

    # -- settings --------------------------------------------------------------------------------
    def configure(self, *, enabled: bool | None = None, prof_all: bool | None = None,
                  prof_ops: Iterable[str] | None = None, verbose: bool | None = None,
                  debug: bool | None = None) -> None:
        """Change the settings given (None keeps one), as ``deepspeed.comm.configure`` does."""
        if prof_ops is not None:
            if isinstance(prof_ops, str):
                raise TypeError(f"prof_ops={prof_ops!r} must be a list of op names, e.g. [{prof_ops!r}]")
            self.prof_ops = tuple(prof_ops)
        for name, value in (("enabled", enabled), ("prof_all", prof_all), ("verbose", verbose), ("debug", debug)):
            if value is not None:
                if not isinstance(value, bool):
                    raise TypeError(f"{name}={value!r} must be True or False")
                setattr(self, name, value)

    def configure_from(self, section: Any) -> None:
        """Take every setting of a parsed ``comms_logger`` section (``CommsLoggerConfig``)."""
        self.configure(enabled=section.enabled, prof_all=section.prof_all, prof_ops=section.prof_ops,
                       verbose=section.verbose, debug=section.debug)

    def start_profiling_comms(self) -> None:
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        self.prof_all = False

    def start_profiling_op(self, op_names: Iterable[str]) -> None:
        self.prof_ops = tuple(dict.fromkeys([*self.prof_ops, *op_names]))

    def stop_profiling_op(self, op_names: Iterable[str]) -> None:
        drop = set(op_names)
        self.prof_ops = tuple(op for op in self.prof_ops if op not in drop)

    # -- recording -------------------------------------------------------------------------------
    def profiles(self, name: str) -> bool:
        """Whether a call named ``name`` is recorded now."""
        return self.enabled and (self.prof_all or any(_DEEPSPEED_NAMES.get(op, op) == name for op in self.prof_ops))

    def begin(self, kind: str, name: str, msg_size: int, world_size: int, *, sync: bool = False) -> Probe | None:
        """Start timing one call (None when it is not profiled). ``kind`` picks the bandwidth formula."""
        if not self.profiles(name):
            return None
        if self.debug:
            name = f"{name} | [Caller Func: {_caller()}]"
        return Probe(self, kind, name, msg_size, world_size, sync)

    def append(self, kind: str, name: str, msg_size: int, latency_ms: float, world_size: int) -> None:
        """Add one call's record (DeepSpeed's ``CommsLogger.append``)."""
        algbw, busbw = calc_bw_log(kind, msg_size, latency_ms, world_size)
        record = self.records.setdefault(name, {}).setdefault(msg_size, OpRecord())
        record.latencies.append(latency_ms)
        record.algbw.append(algbw)
        record.busbw.append(busbw)
        if self.verbose and _global_rank() == 0:
            log.info("comm op: %s | time (ms): %.2f | msg size: %s | algbw (Gbps): %.2f | busbw (Gbps): %.2f",
                     name, latency_ms, convert_size(msg_size), algbw, busbw)

    # -- reading ---------------------------------------------------------------------------------
    def reset_data(self) -> None:
        self.records.clear()

    def has_data(self) -> bool:
        return bool(self.records)

    def get_operation_names(self) -> list[str]:
        return list(self.records)

    def get_total_operations(self) -> int:
        return sum(r.count for sizes in self.records.values() for r in sizes.values())

    def get_raw_data(self) -> dict[str, dict[int, list[Any]]]:
        """DeepSpeed's raw layout: ``{name: {msg_size: [count, latencies, algbws, busbws]}}`` (copies)."""
        return {name: {size: [r.count, list(r.latencies), list(r.algbw), list(r.busbw)] for size, r in sizes.items()}
                for name, sizes in self.records.items()}

    def summary(self) -> dict[str, dict[int, dict[str, Any]]]:
        """Per name and message size (sizes ascending): DeepSpeed's ``summary`` entries."""
        return {name: {size: _summary_entry(r) | {"msg_size_bytes": size, "msg_size_str": convert_size(size)}
                       for size, r in sorted(sizes.items())}
                for name, sizes in self.records.items()}

    def get_operation_summary(self, name: str) -> dict[int, dict[str, Any]] | None:
        return self.summary().get(name)


def _summary_entry(record: OpRecord) -> dict[str, Any]:
    return {"count": record.count, "total_latency_ms": sum(record.latencies),
            "avg_latency_ms": trim_mean(record.latencies), "tput_avg_gbps": trim_mean(record.algbw),
            "busbw_avg_gbps": trim_mean(record.busbw)}


def straggler_entry(latencies: list[float], min_latencies: list[float], msg_size: int) -> dict[str, Any]:
    """DeepSpeed's straggler entry from this rank's latencies and their minimum over ranks (call by call).

    The minimum is the collective's own time (the last rank to arrive waits least); what this rank spent
    above it is time it waited for others.
    """
    waits = [mine - least for mine, least in zip(latencies, min_latencies, strict=True)]
    return {"count": len(latencies), "total_comm_lat_ms": sum(min_latencies), "total_straggler_ms": sum(waits),
            "avg_comm_lat_ms": trim_mean(min_latencies), "avg_straggler_ms": trim_mean(waits),
            "msg_size_bytes": msg_size, "msg_size_str": convert_size(msg_size)}


def format_table(summary: dict[str, dict[int, dict[str, Any]]],
                 straggler: dict[str, dict[int, dict[str, Any]]] | None) -> str:
    """DeepSpeed's printed table: a header, then each op's name and one row per message size."""
    def row(*cells: Any) -> str:
        return "".join(f"{c:<{_COL}.2f}" if isinstance(c, float) else f"{c!s:<{_COL}}" for c in cells).rstrip()

    lines = [row("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)", "tput_avg (Gbps)",
                 "busbw_avg (Gbps)")]
    for name, sizes in summary.items():
        lines.append(name)
        lines += [row("", e["msg_size_str"], e["count"], float(e["total_latency_ms"]), float(e["avg_latency_ms"]),
                      float(e["tput_avg_gbps"]), float(e["busbw_avg_gbps"])) for e in sizes.values()]
    if straggler is not None:
        lines += ["_______________________________", "Breakdown with straggler effect", "-------------------------------",
                  row("Comm. Op", "Message Size", "Count", "Total comm lat(ms)", "Total straggler(ms)",
                      "Avg comm lat(ms)", "Avg straggler(ms)")]
        for name, sizes in straggler.items():
            lines.append(name)
            lines += [row("", e["msg_size_str"], e["count"], float(e["total_comm_lat_ms"]),
                          float(e["total_straggler_ms"]), float(e["avg_comm_lat_ms"]), float(e["avg_straggler_ms"]))
                      for e in sizes.values()]
    return "\n".join(lines)


# Frames of these files are the communication layer itself; debug names the first caller outside them.
_LAYER_FILES = ("zerospeed/distributed/comm.py", "zerospeed/distributed/comms_logger.py", "zerospeed/comm/")


def _caller() -> str:
    frame = sys._getframe(1)
    while frame is not None and any(part in frame.f_code.co_filename.replace("\\", "/") for part in _LAYER_FILES):
        frame = frame.f_back  # type: ignore[assignment]
    return frame.f_code.co_name if frame is not None else "<unknown>"


def _global_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


class _ProcessLogger:
    """Holder of the process's one logger (the documented piece of module state: DeepSpeed keeps one
    communication logger per process, and ``deepspeed.comm.log_summary`` prints it)."""

    def __init__(self) -> None:
        self.logger = CommsLogger()


_PROCESS = _ProcessLogger()


def process_logger() -> CommsLogger:
    """The logger every :class:`~zerospeed.distributed.comm.Comm` records into unless given its own
    (disabled until a ``comms_logger`` section or ``deepspeed.comm.configure`` turns it on)."""
    return _PROCESS.logger
