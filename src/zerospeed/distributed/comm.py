"""The only module that calls ``torch.distributed`` collectives.

A :class:`Comm` is bound to one process group. Every call goes out asynchronously and is waited
for with this Comm's timeout, so a hang becomes a :class:`CollectiveTimeout` that names the
collective and the ranks that never reached it. Arrival tracking costs nothing on the fast path:
only a rank that has already waited a while for a collective writes "I am in call #n" to the
store, so when the timeout fires every rank still waiting has said where it is. Calls and bytes are counted per op for profiling
and tests. Uneven sizes (padding) and average reductions are handled here, once, for every
backend.

In place: ``reduce_scatter(inputs[r*w:(r+1)*w], inputs)`` and ``all_gather(outputs,
outputs[r*w:(r+1)*w])`` work, sync or async. Gloo and NCCL take such aliased buffers as they
are; on other backends Comm notices the overlap (same storage, overlapping bytes) and breaks it
with one scratch copy, and copies nothing when there is no overlap.

Reduce-scatter has two ways to run. Gloo's native one clones the whole input and all_reduces
the clone, so a caller that passes ``inputs_writable=True`` (anything in ``inputs`` outside
``output`` may be left clobbered: partial or full sums) lets Comm all_reduce the input in place
and keep its slice instead, which is measured faster on gloo from 256 Ki elements on. Which way
runs is a :class:`ReduceScatterPolicy`, picked per backend in the constructor (NCCL: always
native) and overridable there; ``benchmarks/bench_comm.py --reduce-scatter`` measures it.

Byte accounting: ``stats.bytes[op]`` adds the size of the *whole* logical tensor of each call:
the tensor for all_reduce / broadcast / send / recv, the full input (all ranks' parts) for
reduce_scatter, the full output for all_gather, and this rank's input for all_to_all and all_to_all_single. Padding
is not counted. A reduce_scatter that runs as an all_reduce is still counted as one
reduce_scatter call of its input's bytes, so counters describe what the caller asked for and do
not change with the policy. The ZeRO paper's volumes follow from these by the usual factors.

``stats.sent[op]`` applies those factors: the bytes this rank puts on the wire under the usual
algorithms (W = group size, n = the ``bytes`` figure of the call): all_reduce as a ring,
``2(W-1)/W * n`` (rounded down); reduce_scatter, the parts of the other ranks, ``(W-1)/W * n``
when even; all_gather, this rank's input once to each other rank, ``(W-1)/W * n`` when even;
all_to_all(_single), what goes to the other ranks (this rank's own chunk excluded, uneven
splits counted exactly); broadcast, ``n`` on ``src`` and 0 elsewhere (a flat tree: a
pipelined or tree broadcast makes other ranks forward parts too, so this is the root's share
only); send ``n``, recv 0, barrier 0; ``all_gather_object`` is its two all_gathers. Padding is
not counted here either, and a reduce_scatter the policy runs as an all_reduce is still counted
as a reduce_scatter (the algorithm asked for; gloo's own is an all_reduce of a clone anyway, so
on gloo the wire carries up to twice that). ``stats.snapshot()`` and ``stats.since(snapshot)``
give per-step deltas.

Timing is a policy the Comm holds: ``comms_logger`` (a
:class:`~zerospeed.distributed.comms_logger.CommsLogger`; by default the process's one, which a
``comms_logger`` config section or ``deepspeed.comm.configure`` enables, so every Comm is logged)
times each call from entry to the end of the wait that completes it (async handles: until
``wait()``), under the op's name and DeepSpeed's message size; see that module for the rule.
"""

from __future__ import annotations

import datetime
import pickle
import weakref
from collections import Counter
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Literal, Mapping, Sequence

import torch
import torch.distributed as dist

from zerospeed.distributed.comms_logger import CommsLogger, Probe, process_logger

ReduceOpName = Literal["sum", "avg", "max", "min", "product"]
DEFAULT_COMM_TIMEOUT = datetime.timedelta(minutes=10)
_PATIENCE = datetime.timedelta(seconds=0.5)  # how long a wait stays silent before announcing itself

_NATIVE_OPS = MappingProxyType({
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # divided afterwards: gloo has no AVG on older torch
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
})


# torch's reduction enum, as ``zerospeed.comm.ReduceOp`` (DeepSpeed users write ``dist.ReduceOp.SUM``).
ReduceOp = dist.ReduceOp
_OP_NAMES: Mapping["dist.ReduceOp.RedOpType", ReduceOpName] = MappingProxyType({
    dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MAX: "max",
    dist.ReduceOp.MIN: "min", dist.ReduceOp.PRODUCT: "product",
})


def reduce_op_name(op: "dist.ReduceOp | dist.ReduceOp.RedOpType | ReduceOpName") -> ReduceOpName:
    """Comm's name for a torch ``ReduceOp`` (or a name, returned as it is once checked)."""
    if isinstance(op, str):
        if op not in _NATIVE_OPS:
            raise ValueError(f"op={op!r} is not a reduction; expected one of {', '.join(_NATIVE_OPS)}")
        return op
    # Only the enum members are keys: a ``ReduceOp`` instance is not one (it never matched the
    # dict lookup, since ``RedOpType.__eq__`` rejects it), so it is refused as before.
    if isinstance(op, dist.ReduceOp.RedOpType) and op in _OP_NAMES:
        return _OP_NAMES[op]
    raise ValueError(f"op={op!r} is not supported; use ReduceOp.SUM, AVG, MAX, MIN or PRODUCT")


# Backends whose all_gather / reduce_scatter are known to be right when this rank's part of the
# big buffer *is* the small one (NCCL documents in-place use; gloo's all_gather gathers into a
# scratch tensor and its reduce_scatter reduces a clone). Elsewhere Comm breaks the alias itself.
_ALIAS_SAFE_BACKENDS = frozenset({"gloo", "nccl"})


@dataclass(frozen=True)
class ReduceScatterPolicy:
    """When a reduce_scatter runs as an in-place all_reduce of its inputs plus taking this rank's slice.

    Gloo's own reduce_scatter clones the whole input and all_reduces the clone, so when the caller
    lets Comm clobber the inputs (``inputs_writable=True``) skipping that clone is faster from
    some size on; NCCL's native reduce_scatter moves 1/world of the data an all_reduce moves, so
    it always stays native. ``all_reduce_min_numel`` counts the elements of the whole input (all
    ranks' parts); None means never. Every rank must use the same policy: it decides which
    collective goes on the wire. (Gloo's native reduce_scatter Work, torch 2.13, also ignores the
    wait timeout and never reports ``is_completed()``; the all_reduce way has neither problem.)
    """

    all_reduce_min_numel: int | None = None

    def __post_init__(self) -> None:
        if self.all_reduce_min_numel is not None and self.all_reduce_min_numel < 0:
            raise ValueError(f"all_reduce_min_numel={self.all_reduce_min_numel} must be >= 0 or None")

    def use_all_reduce(self, numel: int) -> bool:
        return self.all_reduce_min_numel is not None and numel >= self.all_reduce_min_numel

    @classmethod
    def for_backend(cls, backend: str) -> "ReduceScatterPolicy":
        """The measured default for ``backend`` (see ``benchmarks/bench_comm.py --reduce-scatter``)."""
        return _REDUCE_SCATTER_DEFAULTS.get(backend, NATIVE_REDUCE_SCATTER)


NATIVE_REDUCE_SCATTER = ReduceScatterPolicy(None)
ALL_REDUCE_REDUCE_SCATTER = ReduceScatterPolicy(0)
_REDUCE_SCATTER_DEFAULTS = MappingProxyType({
    # Gloo: always, when allowed. Its native reduce_scatter is itself clone + all_reduce + copy, so
    # the all_reduce way does strictly less work (measured equal below 256 Ki elements, up to 2.5x
    # faster above), and it keeps Comm's timeout diagnostics, which gloo's native Work ignores.
    "gloo": ReduceScatterPolicy(0),
})


class CollectiveError(RuntimeError):
    """A collective failed (a peer died or the network broke); the message says where peers were."""


class CollectiveTimeout(CollectiveError):
    """A collective did not complete in time; the message names the ranks that never arrived.

    The group is not usable afterwards (gloo closes the connections of a timed-out operation):
    report, then tear the job down.
    """


class _Totals:
    """The totals over ops of per-op ``calls``, ``bytes`` and ``sent`` counters."""

    calls: Mapping[str, int]
    bytes: Mapping[str, int]
    sent: Mapping[str, int]

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def total_sent(self) -> int:
        return sum(self.sent.values())


@dataclass(frozen=True)
class CommCounts(_Totals):
    """A frozen copy of a :class:`CommStats` (``snapshot()``), or the difference of two (``b - a``).

    Per op: ``calls``, ``bytes`` (the logical tensor sizes) and ``sent`` (bytes this rank put on
    the wire, see the module docstring). Taking one costs a copy of three small dicts, so a step
    loop can take one per step.
    """

    calls: Mapping[str, int] = field(default_factory=dict)
    bytes: Mapping[str, int] = field(default_factory=dict)
    sent: Mapping[str, int] = field(default_factory=dict)

    def __sub__(self, earlier: "CommCounts") -> "CommCounts":
        """What was counted after ``earlier``; ops that did not run in between are left out."""
        if not isinstance(earlier, CommCounts):
            return NotImplemented

        def minus(now: Mapping[str, int], then: Mapping[str, int]) -> Mapping[str, int]:
            return MappingProxyType({op: n - then.get(op, 0) for op, n in now.items() if n != then.get(op, 0)})

        return CommCounts(minus(self.calls, earlier.calls), minus(self.bytes, earlier.bytes),
                          minus(self.sent, earlier.sent))


@dataclass
class CommStats(_Totals):
    """Calls, logical bytes and bytes sent on the wire per collective name, for profiling and tests."""

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    sent: Counter = field(default_factory=Counter)

    def record(self, op: str, nbytes: int, sent: int = 0) -> None:
        self.calls[op] += 1
        self.bytes[op] += nbytes
        self.sent[op] += sent

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self.sent.clear()

    def snapshot(self) -> CommCounts:
        """The counters now, frozen: subtract two to get what one step communicated."""
        return CommCounts(MappingProxyType(dict(self.calls)), MappingProxyType(dict(self.bytes)),
                          MappingProxyType(dict(self.sent)))

    def since(self, earlier: CommCounts) -> CommCounts:
        """What was counted after ``earlier`` (a :meth:`snapshot`)."""
        return self.snapshot() - earlier


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Handle:
    """An in-flight collective. ``wait()`` applies the timeout, then finishes any post-processing."""

    def __init__(self, comm: "Comm", op: str, seq: int | None, work: Any, finish: Callable[[], None] | None,
                 probe: Probe | None = None):
        self._comm, self._op, self._seq, self._work, self._finish = comm, op, seq, work, finish
        self._probe = probe  # the comms logger's timer of this call, stopped when the wait completes
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        self._comm.wait_work(self._work, self._op, self._seq)
        if self._finish is not None:
            self._finish()
        self._done = True
        if self._probe is not None:
            self._probe.stop()

    def is_completed(self) -> bool:
        """True once the result is in place (post-processing included), without blocking."""
        if not self._done and self._work.is_completed():
            self.wait()
        return self._done


class Comm:
    """Collectives over one process group, with counters, a timeout and uneven-size support.

    ``src``/``dst`` arguments are ranks *within this group*. ``reduce_scatter_policy`` defaults to
    the measured one for the group's backend (:meth:`ReduceScatterPolicy.for_backend`).
    ``comms_logger`` times calls when enabled (default: the process's logger, disabled until configured,
    as DeepSpeed logs every collective into one per process); it is a plain attribute.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        name: str = "world",
        timeout: datetime.timedelta = DEFAULT_COMM_TIMEOUT,
        track_arrivals: bool = True,
        store: dist.Store | None = None,
        reduce_scatter_policy: ReduceScatterPolicy | None = None,
        comms_logger: CommsLogger | None = None,
    ):
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized; call zerospeed.init_distributed() first"
            )
        group = group if group is not None else dist.group.WORLD
        # Held weakly: a Comm kept alive until interpreter teardown (a module-level engine, say)
        # must not keep a destroyed gloo group alive, or its threads abort the process at exit.
        self._group_ref = weakref.ref(group)
        self.name = name
        self.timeout = timeout
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.global_ranks = tuple(dist.get_process_group_ranks(group))
        self._backend = dist.get_backend(group)
        self.reduce_scatter_policy = reduce_scatter_policy or ReduceScatterPolicy.for_backend(self._backend)
        self._alias_safe = self._backend in _ALIAS_SAFE_BACKENDS
        self.stats = CommStats()
        self.comms_logger = comms_logger if comms_logger is not None else process_logger()
        self._probe: Probe | None = None  # set by _enter, taken by the _run that follows it
        self._seq = 0
        self._store = (store or _default_store()) if track_arrivals else None
        # Which Comm over these ranks under this name this is: every rank builds its Comms in the same
        # order, so counting them in the store (per rank) gives each instance its own arrival keys and
        # an entry written by another engine's Comm (or an earlier attempt of an elastic job) never reads
        # as this one's.
        self._instance = self._count_instance()
        self._reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    @property
    def group(self) -> dist.ProcessGroup:
        group = self._group_ref()
        if group is None:
            raise RuntimeError(f"the process group of Comm '{self.name}' was destroyed; "
                               f"build a new Comm after init_distributed()")
        return group

    @property
    def store(self) -> dist.Store | None:
        """The key-value store this group's ranks share (None when arrivals are not tracked)."""
        return self._store

    @property
    def calls(self) -> int:
        """Collectives this rank has entered on this Comm so far (the sequence number of the last)."""
        return self._seq

    def ranks_waiting_beyond(self, seq: int) -> dict[int, str]:
        """Group ranks that announced waiting in a collective numbered above ``seq``, with its name.

        Such a rank is blocked in a call this rank has not made, so it will not do what this rank is
        waiting for (a checkpoint handshake uses this to fail fast instead of hanging).
        """
        out = {}
        for group_rank, entry in self._read_arrivals().items():
            if group_rank == self.rank:
                continue
            their_seq, their_op = entry.split(" ", 1)
            if int(their_seq) > seq:
                out[group_rank] = f"#{their_seq} {their_op}"
        return out

    def _read_arrivals(self) -> dict[int, str]:
        if self._store is None:
            return {}
        out = {}
        try:
            for group_rank, global_rank in enumerate(self.global_ranks):
                key = self._key(global_rank)
                if self._store.check([key]):
                    out[group_rank] = self._store.get(key).decode()
        except Exception:  # a store that cannot answer tells nothing; callers fall back to timeouts
            return {}
        return out

    def _scratch(self, *shape: int) -> torch.Tensor:
        """A tiny tensor on the device this group's backend talks from (CPU for gloo)."""
        device = torch.device("cuda", torch.cuda.current_device()) if self._backend == "nccl" else torch.device("cpu")
        return torch.zeros(*shape, device=device)

    # -- bookkeeping ---------------------------------------------------------------------------
    def _key(self, global_rank: int) -> str:
        return f"zerospeed/comm/{self.name}/{','.join(map(str, self.global_ranks))}/{self._instance}/{global_rank}"

    def _count_instance(self) -> int:
        if self._store is None:
            return 0
        ranks = ",".join(map(str, self.global_ranks))
        try:
            return int(self._store.add(f"zerospeed/comm/{self.name}/{ranks}/instances/{self.global_ranks[self.rank]}", 1))
        except Exception:  # a store that cannot count: arrivals are still tracked, under a shared key
            return 0

    def _enter(self, op: str, nbytes: int, sent: int, msg_size: int | None = None, kind: str | None = None) -> int:
        """Count a call about to be issued; start its timer when logging (``msg_size``: DeepSpeed's, default ``nbytes``)."""
        self._seq += 1
        self.stats.record(op, nbytes, sent)
        # Two attribute reads when logging is off. Every collective method calls _enter (or _begin) and then
        # _run with nothing in between that issues another call, so the pending probe is always its own.
        if self.comms_logger.enabled:
            self._begin(op, nbytes if msg_size is None else msg_size, kind)
        else:
            self._probe = None
        return self._seq

    def _begin(self, op: str, msg_size: int, kind: str | None = None) -> None:
        logger = self.comms_logger
        self._probe = (logger.begin(kind or op, op, msg_size, self.world_size, sync=self._backend == "nccl")
                       if logger.enabled else None)

    def wait_work(self, work: Any, op: str, seq: int | None) -> None:
        """Wait for ``work``; after a short patience announce where this rank is, then wait out the timeout."""
        if self._backend == "nccl":  # NCCL's own watchdog owns timeouts; a timed-out wait would abort it
            work.wait()
            return
        if seq is None:  # point-to-point: gloo closes the pair when a timed wait expires, so wait once
            try:
                work.wait(timeout=self.timeout)
            except Exception as exc:
                raise self.timeout_error(op, seq, exc) from exc
            return
        patience = min(self.timeout, _PATIENCE)
        try:
            work.wait(timeout=patience)
            return
        except Exception as exc:  # still running, or failed (then the second wait re-raises at once)
            # kept without its traceback: that holds this frame, whose locals hold the exception again, a
            # cycle that kept every caller's frame and tensors (zero.Init: a whole parameter per wait) alive
            # until the next gc pass -- so on a busy machine, where many waits outlast the patience, the
            # memory peak rose with the load
            first_error = exc.with_traceback(None)
        if self._store is not None and seq is not None:
            self._store.set(self._key(self.global_ranks[self.rank]), f"{seq} {op}")
        remaining = self.timeout - patience
        if remaining <= datetime.timedelta(0):  # c10d reads a zero timeout as "wait forever"
            raise self.timeout_error(op, seq, first_error) from first_error
        try:
            work.wait(timeout=remaining)
        except Exception as exc:
            raise self.timeout_error(op, seq, exc) from exc

    def _run(self, op: str, seq: int | None, work: Any, async_op: bool,
             finish: Callable[[], None] | None = None) -> Handle | None:
        handle = Handle(self, op, seq, work, finish, self._probe)
        self._probe = None
        if async_op:
            return handle
        handle.wait()
        return None

    def timeout_error(self, op: str, seq: int | None, cause: BaseException) -> CollectiveError:
        """Build the error for a failed wait, asking the store where every other rank was waiting.

        ``seq`` is None for point-to-point calls, whose peers are not all ranks of the group.
        """
        timed_out = any(word in str(cause).lower() for word in ("timed out", "timeout"))
        kind = CollectiveTimeout if timed_out else CollectiveError
        what = f"did not complete within {self.timeout.total_seconds():g}s" if timed_out else "failed"
        call = f"call #{seq} on" if seq is not None else "point-to-point on"
        head = f"{op} ({call} group '{self.name}', ranks {list(self.global_ranks)}) {what}"
        if self._store is None or seq is None:
            return kind(f"{head}: {cause}")
        me = self.global_ranks[self.rank]
        missing, notes = [], []
        try:
            for global_rank in self.global_ranks:
                key = self._key(global_rank)
                if global_rank == me:
                    continue
                entry = self._store.get(key).decode() if self._store.check([key]) else "0 -"
                their_seq, their_op = entry.split(" ", 1)
                if int(their_seq) < seq or (int(their_seq) == seq and their_op != op):  # behind, or elsewhere
                    missing.append(global_rank)
                    notes.append(f"rank {global_rank} last seen waiting in #{their_seq} {their_op}"
                                 if int(their_seq) else f"rank {global_rank} not waiting in any collective: busy or dead")
        except Exception as store_error:  # the store's host may be the rank that died
            first_line = str(store_error).splitlines()[0] if str(store_error) else type(store_error).__name__
            return kind(f"{head}; where the other ranks are is unknown (store unreachable: {first_line}). "
                        f"Cause: {cause}")
        return kind(
            f"{head}; ranks that did not arrive: {missing} ({'; '.join(notes) or 'all arrived'}). "
            f"Every rank must call the same collectives in the same order. Cause: {cause}"
        )

    def _global(self, group_rank: int) -> int:
        if not 0 <= group_rank < self.world_size:
            raise ValueError(f"rank {group_rank} is outside group '{self.name}' of size {self.world_size}")
        return self.global_ranks[group_rank]

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOpName = "sum",
                   async_op: bool = False) -> Handle | None:
        """Reduce ``tensor`` in place across the group."""
        finish = self._averager(tensor, op)  # validates op and dtype before any rank enters
        nbytes = _nbytes([tensor])
        seq = self._enter("all_reduce", nbytes, 2 * (self.world_size - 1) * nbytes // self.world_size)
        work = dist.all_reduce(tensor, op=_NATIVE_OPS[op], group=self.group, async_op=True)
        return self._run("all_reduce", seq, work, async_op, finish)

    def reduce_scatter(self, output: torch.Tensor, inputs: torch.Tensor | Sequence[torch.Tensor],
                       op: ReduceOpName = "sum", async_op: bool = False, *,
                       inputs_writable: bool = False) -> Handle | None:
        """Reduce across ranks and keep part ``rank`` in ``output``.

        ``inputs`` is either one tensor of ``world_size * output.numel()`` elements, or a list with
        one tensor per rank whose sizes may differ (every rank passes the same sizes). ``output``
        may be this rank's part of ``inputs`` (in place, as NCCL allows).

        ``inputs_writable=True`` lets Comm leave anything in ``inputs`` outside ``output``
        (garbage, partial sums), so the policy may run an in-place all_reduce instead of the
        native collective. It must be the same on every rank. Counted as a reduce_scatter either way.
        """
        parts, width, even = self._rank_parts("reduce_scatter", inputs, output, "output")
        self._averager(output, op)  # validates op and dtype before any rank enters the collective
        numel = sum(p.numel() for p in parts)
        # Uneven parts are packed into a scratch buffer anyway, which is ours to clobber. Only
        # facts every rank shares (sizes, policy, the flag) may pick the collective.
        via_all_reduce = (inputs_writable or not even) and self.reduce_scatter_policy.use_all_reduce(numel)
        seq = self._enter("reduce_scatter", _nbytes(parts), _nbytes(parts) - _nbytes([parts[self.rank]]),
                          width * output.element_size())
        # the caller's one contiguous tensor, or None when inputs is a list or not contiguous
        flat = inputs if isinstance(inputs, torch.Tensor) and inputs.is_contiguous() else None
        if via_all_reduce:
            # reshape(-1) of a contiguous tensor is a view: the caller's buffer is reduced in place
            buffer = flat.reshape(-1) if flat is not None else torch.cat([p.reshape(-1) for p in parts])
            start = sum(p.numel() for p in parts[: self.rank])
            recv = buffer[start: start + output.numel()]
            work = dist.all_reduce(buffer, op=_NATIVE_OPS[op], group=self.group, async_op=True)
        else:
            if even and flat is not None and output.is_contiguous():
                send, recv = flat.reshape(-1), output.reshape(-1)
                if not self._alias_safe and _overlaps(send, recv):
                    recv = torch.empty_like(recv)
            else:
                send = torch.zeros(self.world_size * width, dtype=output.dtype, device=output.device)
                for i, part in enumerate(parts):
                    send[i * width: i * width + part.numel()].copy_(part.reshape(-1))
                recv = torch.empty(width, dtype=output.dtype, device=output.device)
            work = self._reduce_scatter(recv, send, op=_NATIVE_OPS[op], group=self.group, async_op=True)

        def finish() -> None:
            if not _same_view(recv, output):
                mine = recv[: output.numel()].view(output.shape)
                output.copy_(mine.clone() if _overlaps(mine, output) else mine)
            if op == "avg":
                output.div_(self.world_size)

        return self._run("reduce_scatter", seq, work, async_op, finish)

    def all_gather(self, outputs: torch.Tensor | Sequence[torch.Tensor], input: torch.Tensor,
                   async_op: bool = False) -> Handle | None:
        """Gather every rank's ``input`` into ``outputs``.

        ``outputs`` is one tensor of ``world_size * input.numel()`` elements, or a list with one
        tensor per rank whose sizes may differ (every rank passes the same sizes). ``input`` may
        be this rank's part of ``outputs`` (in place); on backends not known to allow that, the
        input is copied aside first, and only then.
        """
        parts, width, even = self._rank_parts("all_gather", outputs, input, "input")
        seq = self._enter("all_gather", _nbytes(parts), (self.world_size - 1) * _nbytes([parts[self.rank]]),
                          width * input.element_size())
        if even and isinstance(outputs, torch.Tensor) and outputs.is_contiguous():
            send, recv = input.contiguous().reshape(-1), outputs.reshape(-1)
            if not self._alias_safe and _overlaps(send, recv):
                send = send.clone()
        else:
            send = torch.zeros(width, dtype=input.dtype, device=input.device)
            send[: input.numel()].copy_(input.reshape(-1))
            recv = torch.empty(self.world_size * width, dtype=input.dtype, device=input.device)
        work = self._all_gather(recv, send, group=self.group, async_op=True)

        def finish() -> None:
            if isinstance(outputs, torch.Tensor) and recv.data_ptr() == outputs.data_ptr():
                return
            for i, part in enumerate(parts):
                part.copy_(recv[i * width: i * width + part.numel()].view(part.shape))

        return self._run("all_gather", seq, work, async_op, finish)

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> Handle | None:
        """Copy group rank ``src``'s ``tensor`` to every rank, in place."""
        root = self._global(src)
        nbytes = _nbytes([tensor])
        seq = self._enter("broadcast", nbytes, nbytes if src == self.rank else 0)
        work = dist.broadcast(tensor, src=root, group=self.group, async_op=True)
        return self._run("broadcast", seq, work, async_op)

    def send(self, tensor: torch.Tensor, dst: int, async_op: bool = False, tag: int = 0) -> Handle | None:
        """Point-to-point send to group rank ``dst`` (not tracked as an arrival: peers differ).

        Messages with the same (sender, receiver, ``tag``) arrive in the order they were sent; a
        different tag is a separate channel (pipeline activations and gradients use one each).
        """
        self.stats.record("send", _nbytes([tensor]), _nbytes([tensor]))
        self._begin("send", _nbytes([tensor]))
        work = dist.isend(tensor.contiguous(), dst=self._global(dst), group=self.group, tag=tag)
        return self._run(f"send to rank {dst}{_tag_note(tag)}", None, work, async_op)

    def recv(self, tensor: torch.Tensor, src: int, async_op: bool = False, tag: int = 0) -> Handle | None:
        """Point-to-point receive from group rank ``src`` into ``tensor`` (on channel ``tag``, see send)."""
        self.stats.record("recv", _nbytes([tensor]), 0)
        self._begin("recv", _nbytes([tensor]))
        work = dist.irecv(tensor, src=self._global(src), group=self.group, tag=tag)
        return self._run(f"recv from rank {src}{_tag_note(tag)}", None, work, async_op)

    def all_to_all(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                   async_op: bool = False) -> Handle | None:
        """Send ``inputs[i]`` to rank i and receive rank i's part into ``outputs[i]`` (sizes may differ)."""
        self._check_parts("all_to_all inputs", list(inputs))
        self._check_parts("all_to_all outputs", list(outputs))
        dtype, device = inputs[0].dtype, inputs[0].device
        seq = self._enter("all_to_all", _nbytes(inputs), _nbytes(inputs) - _nbytes([inputs[self.rank]]))
        send = torch.cat([t.reshape(-1) for t in inputs]) if inputs else torch.empty(0, dtype=dtype)
        recv = torch.empty(sum(t.numel() for t in outputs), dtype=dtype, device=device)
        work = dist.all_to_all_single(
            recv, send,
            output_split_sizes=[t.numel() for t in outputs],
            input_split_sizes=[t.numel() for t in inputs],
            group=self.group, async_op=True,
        )

        def finish() -> None:
            offset = 0
            for out in outputs:
                out.copy_(recv[offset: offset + out.numel()].view(out.shape))
                offset += out.numel()

        return self._run("all_to_all", seq, work, async_op, finish)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: Sequence[int] | None = None,
                          input_split_sizes: Sequence[int] | None = None,
                          async_op: bool = False, *, op: str = "all_to_all") -> Handle | None:
        """Split ``input`` along dim 0, send part i to rank i, receive rank i's part into ``output``.

        Split sizes count rows (dim 0) as in ``torch.distributed``; None splits evenly. ``op`` is
        the name the bytes are counted under (this rank's input, as for :meth:`all_to_all`), so a
        caller can keep a small metadata exchange apart from its payload.
        """
        for name, tensor, splits in (("input", input, input_split_sizes), ("output", output, output_split_sizes)):
            if not tensor.is_contiguous():
                raise ValueError(f"all_to_all_single: {name} must be contiguous")
            rows = tensor.shape[0] if tensor.dim() else 1
            if splits is None:
                if rows % self.world_size:
                    raise ValueError(f"all_to_all_single: {name} has {rows} rows, not divisible by the group size "
                                     f"{self.world_size}; pass {name}_split_sizes")
            else:
                if len(splits) != self.world_size:
                    raise ValueError(f"all_to_all_single: {name}_split_sizes has {len(splits)} entries for a group "
                                     f"of {self.world_size} ranks")
                if sum(splits) != rows:
                    raise ValueError(f"all_to_all_single: {name}_split_sizes={list(splits)} sum to {sum(splits)} "
                                     f"but {name} has {rows} rows")
        if input.dtype != output.dtype:
            raise TypeError(f"all_to_all_single: input is {input.dtype} but output is {output.dtype}")
        seq = self._enter(op, _nbytes([input]), _split_sent_bytes(input, input_split_sizes, self.rank, self.world_size),
                          kind="all_to_all_single")
        work = dist.all_to_all_single(
            output, input,
            output_split_sizes=None if output_split_sizes is None else list(output_split_sizes),
            input_split_sizes=None if input_split_sizes is None else list(input_split_sizes),
            group=self.group, async_op=True,
        )
        return self._run(op, seq, work, async_op)

    def barrier(self, async_op: bool = False) -> Handle | None:
        """Wait until every rank of the group gets here (an all_reduce of one element, so it times out)."""
        seq = self._enter("barrier", 0, 0)
        work = dist.all_reduce(self._scratch(1), group=self.group, async_op=True)
        return self._run("barrier", seq, work, async_op)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Gather a small picklable object from every rank (for checks, not for tensors).

        Built on this Comm's own all_gather, so it honours the timeout and its diagnostics.
        """
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = self._scratch(self.world_size).long()
        self.all_gather(sizes, self._scratch(1).long().fill_(payload.numel()))
        buffers = [torch.empty(int(n), dtype=torch.uint8, device=sizes.device) for n in sizes.tolist()]
        self.all_gather(buffers, payload.to(sizes.device))
        return [pickle.loads(b.cpu().numpy().tobytes()) for b in buffers]

    def fail_together(self, error: BaseException | None, what: str,
                      error_type: type[Exception] = RuntimeError) -> None:
        """Raise on every rank when ``what`` failed on any (collective): a failure on one rank alone
        (a path missing on one node) must not leave the others waiting in the next collective. This
        rank's own error is raised as it is; the others' as ``error_type``, naming each rank."""
        outcomes = self.all_gather_object(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        failed = [f"rank {r}: {outcome}" for r, outcome in enumerate(outcomes) if outcome]
        if failed:
            raise error_type(f"{what} failed on other ranks: {'; '.join(failed)}")

    # -- helpers -------------------------------------------------------------------------------
    def _averager(self, tensor: torch.Tensor, op: ReduceOpName) -> Callable[[], None] | None:
        if op not in _NATIVE_OPS:
            raise ValueError(f"op={op!r} is not a reduction; expected one of {', '.join(_NATIVE_OPS)}")
        if op != "avg":
            return None
        if not tensor.is_floating_point():
            raise TypeError(f"op='avg' needs a floating-point tensor, got {tensor.dtype}")

        def average() -> None:
            tensor.div_(self.world_size)

        return average

    def _rank_parts(self, what: str, full: torch.Tensor | Sequence[torch.Tensor], local: torch.Tensor,
                    local_name: str) -> tuple[list[torch.Tensor], int, bool]:
        """Per-rank views of ``full`` (one flat tensor or a list), checked against this rank's ``local``.

        Returns the parts, the widest part's size and whether all parts are that size.
        """
        parts = self._split_even(full, local.numel()) if isinstance(full, torch.Tensor) else list(full)
        self._check_parts(what, parts)
        if parts[self.rank].numel() != local.numel():
            raise ValueError(f"{what}: {local_name} has {local.numel()} elements but part {self.rank} has "
                             f"{parts[self.rank].numel()}")
        width = max(p.numel() for p in parts)
        return parts, width, all(p.numel() == width for p in parts)

    def _split_even(self, flat: torch.Tensor, width: int) -> list[torch.Tensor]:
        if flat.numel() != width * self.world_size:
            raise ValueError(
                f"expected {self.world_size} x {width} = {width * self.world_size} elements, got {flat.numel()}; "
                f"pass a list of per-rank tensors for uneven sizes"
            )
        return list(flat.reshape(-1).split(width))

    def _check_parts(self, what: str, parts: list[torch.Tensor]) -> None:
        if len(parts) != self.world_size:
            raise ValueError(f"{what}: got {len(parts)} tensors for a group of {self.world_size} ranks")


def _split_sent_bytes(input: torch.Tensor, splits: Sequence[int] | None, rank: int, world_size: int) -> int:
    """Bytes of ``input`` that all_to_all_single sends to other ranks (its rows minus this rank's split)."""
    total = _nbytes([input])
    rows = input.shape[0] if input.dim() else 1
    if rows == 0:
        return 0
    own_rows = rows // world_size if splits is None else splits[rank]
    return total - own_rows * (total // rows)


def _tag_note(tag: int) -> str:
    return f" (tag {tag})" if tag else ""


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share any bytes of one storage (by extent: enough for flat views)."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a_lo, b_lo = a.data_ptr(), b.data_ptr()
    return a_lo < b_lo + b.numel() * b.element_size() and b_lo < a_lo + a.numel() * a.element_size()


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements of the same storage (then no copy is needed)."""
    return (a.data_ptr() == b.data_ptr() and a.numel() == b.numel() and a.dtype == b.dtype
            and (a.numel() <= 1 or (a.is_contiguous() and b.is_contiguous())))


def _default_store() -> dist.Store | None:
    """The default group's store, used to tell which ranks reached a collective (None if hidden)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None
