"""Pipeline instructions: the vocabulary every schedule is written in.

A schedule is data (ARCHITECTURE.md, "schedules as data, many schedules, one runtime"): for each pipeline
stage an ordered tuple of the frozen values below, produced by ``schedules.py`` without processes and
executed by one small interpreter. Each value says *which* micro-batch and *which* chunk (the stage's
local model chunk; chunk ``c`` of stage ``s`` is virtual stage ``c * stages + s``) it concerns, so the
interpreter needs no schedule-specific logic and the simulator (``simulate.py``) can check every order.

Communication semantics (the contract the simulator checks and an interpreter must honour):
- ``Send*`` never blocks: it is posted asynchronously (``isend``) and its handle is waited before the
  batch-level instructions (``ReduceTiedGrads``) at the latest. ``Recv*`` blocks until its message is there.
- A send is placed right after the computation that produced its tensor, a receive right before the
  computation that consumes it. With non-blocking sends, deadlock freedom then reduces to each stage's
  compute order respecting the data dependencies, which ``simulate`` verifies for every schedule.
- Messages travel on channels ``(sender, receiver, kind)`` with ``kind`` activation or gradient; on each
  channel receives happen in the order of the sends, so untagged FIFO point-to-point (one tag per kind)
  is enough.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Union


@dataclass(frozen=True)
class _MicroOp:
    """An instruction about one micro-batch on one local chunk of this stage."""

    micro: int
    chunk: int = 0
    code: ClassVar[str] = "?"

    def __str__(self) -> str:
        return f"{type(self).__name__}(micro={self.micro}, chunk={self.chunk})"


@dataclass(frozen=True)
class _P2P(_MicroOp):
    """A point-to-point transfer of one micro-batch's tensor between this stage and ``peer``."""

    peer: int = 0

    def __str__(self) -> str:
        return f"{type(self).__name__}(micro={self.micro}, chunk={self.chunk}, peer={self.peer})"


@dataclass(frozen=True)
class _BatchOp:
    """An instruction about the whole batch (after every micro-batch's backward on this stage)."""

    code: ClassVar[str] = "?"

    @property
    def micro(self) -> None:
        return None

    @property
    def chunk(self) -> None:
        return None

    def __str__(self) -> str:
        return f"{type(self).__name__}()"


@dataclass(frozen=True)
class LoadMicroBatch(_MicroOp):
    """Take micro-batch ``micro`` from the data iterator: inputs on the first virtual stage, labels on the
    last (a single-stage pipeline takes both). Placed right before that chunk's ``Forward``."""

    code: ClassVar[str] = "L"


@dataclass(frozen=True)
class Forward(_MicroOp):
    """Run chunk ``chunk`` forward on micro-batch ``micro``; keep what its backward needs."""

    code: ClassVar[str] = "F"


@dataclass(frozen=True)
class Backward(_MicroOp):
    """Full backward (input and weight gradients together, ``B`` + ``W`` fused); frees the activations."""

    code: ClassVar[str] = "BW"


@dataclass(frozen=True)
class BackwardInput(_MicroOp):
    """Zero-bubble ``B``: the gradient of the chunk's input only (what the previous stage waits for)."""

    code: ClassVar[str] = "B"


@dataclass(frozen=True)
class BackwardWeight(_MicroOp):
    """Zero-bubble ``W``: the weight gradients of a micro-batch whose ``BackwardInput`` already ran; nothing
    waits for it, so a schedule may delay it into an idle slot."""

    code: ClassVar[str] = "W"


@dataclass(frozen=True)
class SendActivation(_P2P):
    """Post (non-blocking) this chunk's output for ``micro`` to ``peer`` (next virtual stage)."""

    code: ClassVar[str] = "SA"


@dataclass(frozen=True)
class RecvActivation(_P2P):
    """Block until ``peer`` (holding the previous virtual stage) has sent ``micro``'s input for ``chunk``."""

    code: ClassVar[str] = "RA"


@dataclass(frozen=True)
class SendGrad(_P2P):
    """Post (non-blocking) the gradient of ``chunk``'s input for ``micro`` to ``peer`` (previous one)."""

    code: ClassVar[str] = "SG"


@dataclass(frozen=True)
class RecvGrad(_P2P):
    """Block until ``peer`` (next virtual stage) has sent the gradient of ``chunk``'s output for ``micro``."""

    code: ClassVar[str] = "RG"


@dataclass(frozen=True)
class ReduceTiedGrads(_BatchOp):
    """All-reduce gradients of weights tied across stages (e.g. embeddings); every stage reaches it, so it
    is also where pending sends are waited."""

    code: ClassVar[str] = "RT"


@dataclass(frozen=True)
class ReduceGrads(_BatchOp):
    """Reduce gradients over this stage's data-parallel group."""

    code: ClassVar[str] = "RD"


@dataclass(frozen=True)
class OptimizerStep(_BatchOp):
    """Step the optimizer (and LR schedule) of this stage's parameters."""

    code: ClassVar[str] = "S"


MicroInstruction = Union[LoadMicroBatch, Forward, Backward, BackwardInput, BackwardWeight,
                         SendActivation, RecvActivation, SendGrad, RecvGrad]
Communication = Union[SendActivation, RecvActivation, SendGrad, RecvGrad]
Instruction = Union[MicroInstruction, ReduceTiedGrads, ReduceGrads, OptimizerStep]
COMPUTE = (Forward, Backward, BackwardInput, BackwardWeight)
BATCH_END: tuple[Instruction, ...] = (ReduceTiedGrads(), ReduceGrads(), OptimizerStep())
