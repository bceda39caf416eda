"""Point-to-point transfers between pipeline stages, through the comm door.

A :class:`StageLink` moves one micro-batch's activation (forward) or gradient (backward) between this
stage and another, with the semantics ``instructions.py`` promises: a send is posted and returns its
:class:`PendingSend` (waited later, at the latest by :meth:`StageLink.wait_sends`); a receive blocks.
Each kind travels on its own tag, so on every (sender, receiver, kind) channel messages arrive in the
order they were sent and activations never meet gradients.

A payload is a tensor, ``None``, or a tuple / list of payloads (nested). Every transfer carries a
header (the shape handshake): int64 tokens holding the kind, the micro-batch and the payload's
structure with each tensor's dtype, shape and ``requires_grad``. It is sent every time, so shapes may
change from one micro-batch to the next and a mismatch is caught, never guessed. Tensors travel as raw
bytes (bit-exact for every dtype, bf16 included), all of a transfer's in one body, each at an offset
aligned to ``_ALIGN``; received tensors are views of it, leaves with the sender's ``requires_grad``,
so the receiving stage can backprop into them.

Messages, not bytes, are what a transfer costs on gloo (a ping-pong of two messages takes three times
one), so a transfer whose layout equals the previous one on its channel is ONE message: the fixed-size
header frame followed by the body. Both ends remember each channel's last layout, so the receiver
knows that message's size. When the layout changes, the first message (still of the remembered size)
carries the new header in its frame and the sender's flag says the body follows separately: then a
spill message for a header longer than the frame, then the body. The header codec
(:func:`encode_header`, :func:`decode_header`) is pure.

A stage that knows its coming receives (:meth:`StageLink.expect`, the interpreter tells it from its
program) has the next transfer's first message posted as soon as the previous one is taken, so it
lands while the stage computes instead of after it asks (about 0.3 ms less per transfer on gloo).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

import torch

from zerospeed.distributed.comm import CollectiveError, CollectiveTimeout, Comm, Handle

Kind = Literal["activation", "gradient"]
Payload = Union[torch.Tensor, None, tuple["Payload", ...], list["Payload"]]
TensorSpec = tuple[torch.dtype, tuple[int, ...], bool]  # dtype, shape, requires_grad

KINDS: tuple[Kind, ...] = ("activation", "gradient")
TAGS = {"activation": 0x5A01, "gradient": 0x5A02}  # one channel per kind; never Comm's default tag 0
_MAGIC = 0x5A5031  # "ZP1": a header, version 1
_TENSOR, _NONE, _TUPLE, _LIST = 1, 2, 3, 4
_FRAME = 32  # int64 slots of the header frame: the body flag, the token count, then up to 30 tokens
_HEAD = _FRAME - 2  # header tokens the frame holds
_FRAME_BYTES = _FRAME * 8
_ALIGN = 16  # bytes: every tensor in the body starts at a multiple, so its typed view is legal
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)


class HeaderMismatch(RuntimeError):
    """A received message is not the one this stage's schedule expected (order or kind differs)."""


def encode_header(kind: Kind, micro: int, payload: Payload) -> tuple[list[int], list[torch.Tensor]]:
    """The header tokens for ``payload`` and its tensors in wire order (pure)."""
    tokens, tensors = [_MAGIC, KINDS.index(kind), micro], []

    def walk(item: Payload, where: str) -> None:
        if item is None:
            tokens.append(_NONE)
        elif isinstance(item, torch.Tensor):
            if item.dtype not in _DTYPES:
                raise TypeError(f"{where} has dtype {item.dtype}, which pipeline transfers do not carry; "
                                f"use one of {', '.join(str(d) for d in _DTYPES)}")
            tokens.extend([_TENSOR, _DTYPES.index(item.dtype), int(item.requires_grad), item.dim(), *item.shape])
            tensors.append(item)
        elif isinstance(item, (tuple, list)):
            tokens.extend([_TUPLE if isinstance(item, tuple) else _LIST, len(item)])
            for i, child in enumerate(item):
                walk(child, f"{where}[{i}]")
        else:
            raise TypeError(f"{where} is a {type(item).__name__}; a pipeline stage may only pass tensors, None "
                            f"and tuples/lists of them between stages (wrap numbers in a tensor)")

    walk(payload, f"the {kind} of micro-batch {micro}")
    return tokens, tensors


def decode_header(tokens: list[int]) -> tuple[Kind, int, Payload, list[TensorSpec]]:
    """Inverse of :func:`encode_header`: kind, micro-batch, a payload skeleton (tensors as indices into
    the returned specs, as ``int``) and each tensor's spec, in wire order (pure)."""
    if len(tokens) < 4 or tokens[0] != _MAGIC or not 0 <= tokens[1] < len(KINDS):
        raise HeaderMismatch(f"not a pipeline header: {tokens[:4]}; a non-pipeline message used the "
                             f"pipeline's tags {sorted(TAGS.values())}")
    specs: list[TensorSpec] = []
    pos = 3

    def take() -> int:
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def walk() -> object:
        code = take()
        if code == _NONE:
            return None
        if code == _TENSOR:
            dtype, grad, ndim = _DTYPES[take()], bool(take()), take()
            specs.append((dtype, tuple(take() for _ in range(ndim)), grad))
            return len(specs) - 1
        if code in (_TUPLE, _LIST):
            items = [walk() for _ in range(take())]
            return tuple(items) if code == _TUPLE else items
        raise HeaderMismatch(f"corrupt pipeline header: unknown code {code} at token {pos - 1}")

    skeleton = walk()
    if pos != len(tokens):
        raise HeaderMismatch(f"corrupt pipeline header: {len(tokens) - pos} tokens left over")
    return KINDS[tokens[1]], tokens[2], skeleton, specs  # type: ignore[return-value]


def _fill(skeleton: object, tensors: list[torch.Tensor]) -> Payload:
    if isinstance(skeleton, int):
        return tensors[skeleton]
    if isinstance(skeleton, (tuple, list)):
        items = [_fill(child, tensors) for child in skeleton]
        return tuple(items) if isinstance(skeleton, tuple) else items
    return None


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view (a copy only when it is not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _layout(specs: list[TensorSpec]) -> tuple[list[int], int]:
    """Each tensor's byte offset in the body, and the body's size."""
    offsets, size = [], 0
    for dtype, shape, _ in specs:
        offsets.append(size)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        size += -(-nbytes // _ALIGN) * _ALIGN
    return offsets, size


def _pack(buffer: torch.Tensor, tensors: list[torch.Tensor], offsets: list[int]) -> None:
    for tensor, offset in zip(tensors, offsets):
        if tensor.numel() > 0:
            wire = _wire(tensor)
            buffer[offset:offset + wire.numel()].copy_(wire)


def _unpack(buffer: torch.Tensor, specs: list[TensorSpec], offsets: list[int]) -> list[torch.Tensor]:
    return [buffer[offset:offset + torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)
            .requires_grad_(grad) for (dtype, shape, grad), offset in zip(specs, offsets)]


@dataclass
class _Channel:
    """What both ends remember of one (peer, kind) channel: the last layout (header tokens past the
    micro-batch) and its body size, which sizes the next transfer's first message."""

    layout: tuple[int, ...] = ()
    body: int = 0
    expected: int = 0  # receives announced and not yet taken (receiving end)
    posted: tuple[torch.Tensor, Handle] | None = None  # the next transfer's first message, posted ahead


def _wrap(exc: CollectiveError, what: str, peer: int) -> CollectiveError:
    """Comm's point-to-point error, restated in pipeline terms (stage, peer, kind, micro-batch)."""
    if isinstance(exc, CollectiveTimeout):
        return CollectiveTimeout(
            f"{what}; stage {peer} did not post the matching transfer in time: it is slower than the "
            f"timeout (raise the comm timeout), stuck elsewhere, dead, or running a schedule that "
            f"orders this channel differently. Cause: {exc}")
    return CollectiveError(f"{what} failed; stage {peer} may have died. Cause: {exc}")


@dataclass
class PendingSend:
    """The posted messages of one send; keeps their buffers alive until :meth:`wait`."""

    link: "StageLink"
    kind: Kind
    micro: int
    dst: int
    handles: list[Handle] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)

    def wait(self) -> None:
        try:
            for handle in self.handles:
                handle.wait()
        except CollectiveError as exc:
            raise _wrap(exc, f"pipeline stage {self.link.stage}'s send of the {self.kind} of "
                                        f"micro-batch {self.micro} to stage {self.dst}", self.dst) from exc
        self.buffers.clear()


class StageLink:
    """This pipeline stage's point-to-point transfers over ``comm``, the pipeline group (group rank i is
    stage i). ``device`` is where received tensors are placed (CPU for gloo)."""

    def __init__(self, comm: Comm, stage: int, *, device: torch.device | str = "cpu"):
        if stage != comm.rank:
            raise ValueError(f"stage={stage} but this process is rank {comm.rank} of group '{comm.name}'; build "
                             f"the pipeline group with its ranks in stage order (group rank i = stage i)")
        self.comm, self.stage, self.stages = comm, stage, comm.world_size
        self.device = torch.device(device)
        self._pending: list[PendingSend] = []
        # each direction its own state: at pp=2 (interleaved) this stage sends to and receives from the
        # same peer on the same kind
        self._outgoing: dict[tuple[int, Kind], _Channel] = {}
        self._incoming: dict[tuple[int, Kind], _Channel] = {}

    def send(self, kind: Kind, micro: int, payload: Payload, dst_stage: int) -> PendingSend:
        """Post ``payload`` (the ``kind`` of ``micro``) to ``dst_stage``; returns at once."""
        self._check(kind, dst_stage, "dst_stage")
        tokens, tensors = encode_header(kind, micro, payload)
        offsets, body_size = _layout([(t.dtype, tuple(t.shape), False) for t in tensors])
        channel = self._outgoing.setdefault((dst_stage, kind), _Channel())
        layout = tuple(tokens[3:])
        same = layout == channel.layout
        first = torch.empty(_FRAME_BYTES + channel.body, dtype=torch.uint8, device=self.device)
        head = [int(same), len(tokens), *tokens[:_HEAD]]
        frame = torch.tensor(head + [0] * (_FRAME - len(head)), dtype=torch.int64)
        first[:_FRAME_BYTES].view(torch.int64).copy_(frame)
        buffers = [first]
        if same:
            _pack(first[_FRAME_BYTES:], tensors, offsets)
        else:
            if len(tokens) > _HEAD:
                buffers.append(torch.tensor(tokens[_HEAD:], dtype=torch.int64, device=self.device))
            if body_size:
                body = torch.empty(body_size, dtype=torch.uint8, device=self.device)
                _pack(body, tensors, offsets)
                buffers.append(body)
            channel.layout, channel.body = layout, body_size
        pending = PendingSend(self, kind, micro, dst_stage)
        for buffer in buffers:
            handle = self.comm.send(buffer, dst_stage, async_op=True, tag=TAGS[kind])
            assert handle is not None  # async_op=True always returns one
            pending.handles.append(handle)
        pending.buffers = buffers
        self._pending.append(pending)
        return pending

    def expect(self, kind: Kind, src_stage: int, count: int) -> None:
        """``count`` more transfers of ``kind`` will be received from ``src_stage``: keep the next one's
        first message posted ahead."""
        self._check(kind, src_stage, "src_stage")
        channel = self._incoming.setdefault((src_stage, kind), _Channel())
        channel.expected += count
        self._post_ahead(src_stage, kind, channel)

    def forget_expected(self) -> None:
        """Post nothing more ahead (a failed batch; a receive already posted stays posted)."""
        for channel in self._incoming.values():
            channel.expected = 0

    def _post_ahead(self, src: int, kind: Kind, channel: _Channel) -> None:
        if channel.expected > 0 and channel.posted is None:
            first = torch.empty(_FRAME_BYTES + channel.body, dtype=torch.uint8, device=self.device)
            handle = self.comm.recv(first, src, async_op=True, tag=TAGS[kind])
            assert handle is not None  # async_op=True always returns one
            channel.posted = (first, handle)

    def recv(self, kind: Kind, micro: int, src_stage: int) -> Payload:
        """Block until ``src_stage``'s ``kind`` of ``micro`` is here; return it (structure as sent)."""
        self._check(kind, src_stage, "src_stage")
        channel = self._incoming.setdefault((src_stage, kind), _Channel())
        if channel.posted is not None:
            (first, handle), channel.posted = channel.posted, None
            self._wait(handle, kind, micro, src_stage)
            channel.expected -= 1
        else:
            first = torch.empty(_FRAME_BYTES + channel.body, dtype=torch.uint8, device=self.device)
            self._recv(first, kind, micro, src_stage)
        frame = first[:_FRAME_BYTES].view(torch.int64).tolist()
        same, count = bool(frame[0]), frame[1]
        tokens = frame[2:2 + min(count, _HEAD)]
        if count > _HEAD:  # taken before any check: the channel stays in step
            rest = torch.empty(count - _HEAD, dtype=torch.int64, device=self.device)
            self._recv(rest, kind, micro, src_stage)
            tokens += rest.tolist()
        got_kind, got_micro, skeleton, specs = decode_header(tokens)
        offsets, body_size = _layout(specs)
        if same:
            body = first[_FRAME_BYTES:]
        else:
            body = torch.empty(body_size, dtype=torch.uint8, device=self.device)
            if body_size:
                self._recv(body, kind, micro, src_stage)
            channel.layout, channel.body = tuple(tokens[3:]), body_size
        tensors = _unpack(body, specs, offsets)
        if (got_kind, got_micro) == (kind, micro):
            self._post_ahead(src_stage, kind, channel)
        else:
            raise HeaderMismatch(
                f"pipeline stage {self.stage} expected the {kind} of micro-batch {micro} from stage {src_stage} "
                f"but received the {got_kind} of micro-batch {got_micro}; the two stages' schedules post "
                f"their sends and receives on this channel in different orders")
        return _fill(skeleton, tensors)

    def wait_sends(self) -> None:
        """Wait for every send posted so far, oldest first."""
        while self._pending:
            self._pending[0].wait()
            self._pending.pop(0)

    @property
    def pending_sends(self) -> int:
        return len(self._pending)

    def _recv(self, buffer: torch.Tensor, kind: Kind, micro: int, src: int) -> None:
        handle = self.comm.recv(buffer, src, async_op=True, tag=TAGS[kind])
        assert handle is not None  # async_op=True always returns one
        self._wait(handle, kind, micro, src)

    def _wait(self, handle: Handle, kind: Kind, micro: int, src: int) -> None:
        try:
            handle.wait()
        except CollectiveError as exc:
            what = f"pipeline stage {self.stage} waited {self.comm.timeout.total_seconds():g} s for the {kind} " \
                   f"of micro-batch {micro} from stage {src}" if isinstance(exc, CollectiveTimeout) else \
                   f"pipeline stage {self.stage}'s receive of the {kind} of micro-batch {micro} from stage {src}"
            raise _wrap(exc, what, src) from exc

    def _check(self, kind: str, peer: int, name: str) -> None:
        if kind not in TAGS:
            raise ValueError(f"kind={kind!r}; expected 'activation' or 'gradient'")
        if not 0 <= peer < self.stages or peer == self.stage:
            raise ValueError(f"{name}={peer} is not another stage of this {self.stages}-stage pipeline "
                             f"(this is stage {self.stage})")
