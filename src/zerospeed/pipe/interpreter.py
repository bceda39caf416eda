"""The one interpreter of pipeline schedules: executes a stage's instruction list for one batch.

It knows no schedule: every instruction says what to do and to which micro-batch and model chunk
(``instructions.py``). What depends on the engine (the data, the loss and its scaling, what brackets a
backward that produces weight gradients, the batch-end work) comes in as a :class:`StageHooks` value, so
the interpreter is tested and reused without an engine.

Per (micro-batch, chunk) it keeps the chunk's input (a received activation, or the loaded inputs on the
first virtual stage), its output (the loss on the last virtual stage) and, once received, the gradient
of the output. A fused ``Backward`` runs autograd once; the zero-bubble split runs the chunk as blocks
(its activation-checkpointing blocks) with detached boundaries, so ``BackwardInput`` computes only the
gradients flowing to the chunk's input (block by block) and ``BackwardWeight`` later the weight
gradients of each block from what ``BackwardInput`` kept (``split_backward.py``: no part is computed
twice).
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from zerospeed.pipe.instructions import (Backward, BackwardInput, BackwardWeight, Forward, Instruction,
                                         LoadMicroBatch, OptimizerStep, RecvActivation, RecvGrad, ReduceGrads,
                                         ReduceTiedGrads, SendActivation, SendGrad)
from zerospeed.pipe.module import PipelineModule
from zerospeed.pipe.p2p import Kind, StageLink
from zerospeed.pipe.schedules import Schedule
from zerospeed.pipe.split_backward import DeferredWeights, backward_input, backward_weights_later

Key = tuple[int, int]  # (micro-batch, chunk)
_COMPUTE = (Forward, Backward, BackwardInput, BackwardWeight)


class StageFailed(RuntimeError):
    """An instruction of a pipeline stage raised; the message names the stage and the instruction."""


def tensors_of(payload: Any) -> list[torch.Tensor]:
    """The tensors of a payload (a tensor, or nested tuples / lists of them and None), in order."""
    if isinstance(payload, torch.Tensor):
        return [payload]
    if isinstance(payload, (tuple, list)):
        return [t for item in payload for t in tensors_of(item)]
    return []


def _map(payload: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(payload, torch.Tensor):
        return fn(payload)
    if isinstance(payload, (tuple, list)):
        items = [_map(item, fn) for item in payload]
        return tuple(items) if isinstance(payload, tuple) else items
    return payload


def detached(payload: Any) -> Any:
    """``payload`` cut from its graph: each floating tensor a fresh leaf that requires grad as it did."""
    return _map(payload, lambda t: t.detach().requires_grad_(t.requires_grad and t.is_floating_point()))


def _differentiable(outputs: Any, grads: Any) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Pairs of (output tensor, its gradient) that autograd can use: outputs with a graph."""
    outs, gs = [], []
    for out, grad in zip(tensors_of(outputs), _grads_list(outputs, grads), strict=True):
        if out.requires_grad:
            outs.append(out)
            gs.append(grad)
    return outs, gs


def _grads_list(outputs: Any, grads: Any) -> list[torch.Tensor | None]:
    """``grads`` (the structure ``outputs`` has, gradients or None) flattened like ``tensors_of(outputs)``."""
    if grads is None:
        return [None] * len(tensors_of(outputs))
    if isinstance(outputs, torch.Tensor):
        return [grads if isinstance(grads, torch.Tensor) else None]
    if isinstance(outputs, (tuple, list)):
        if not isinstance(grads, (tuple, list)) or len(grads) != len(outputs):
            raise RuntimeError("the gradient received for a stage's output does not match the output's structure")
        return [g for o, gr in zip(outputs, grads, strict=True) for g in _grads_list(o, gr)]
    return []


def input_grads(inputs: Any) -> Any:
    """The gradient of each tensor of ``inputs`` (None where it has none), in ``inputs``' structure."""
    if isinstance(inputs, torch.Tensor):
        return inputs.grad if inputs.requires_grad else None
    if isinstance(inputs, (tuple, list)):
        items = [input_grads(item) for item in inputs]
        return tuple(items) if isinstance(inputs, tuple) else items
    return None


@dataclass
class StageHooks:
    """What the engine supplies to the interpreter.

    ``next_batch()``: the next micro-batch as ``(inputs, labels)``; ``prepare_inputs``: inputs as the
    first layer takes them (cast to the compute dtype); ``loss(outputs, labels)``: the last stage's loss
    (or its output when it computes none); ``scale(loss)``: the tensor backward starts from;
    ``weight_backward(final)``: a context around every backward that produces weight gradients (``final``:
    the stage's last one in the batch); ``tied``, ``reduce``, ``step``: the batch-end instructions."""

    next_batch: Callable[[], tuple[Any, Any]]
    loss: Callable[[Any, Any], Any]
    prepare_inputs: Callable[[Any], Any] = lambda x: x
    scale: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss
    weight_backward: Callable[[bool], ContextManager[None]] = lambda final: contextlib.nullcontext()
    tied: Callable[[], None] = lambda: None
    reduce: Callable[[], None] = lambda: None
    step: Callable[[], None] = lambda: None


@dataclass
class _Blocks:
    """A split forward's boundaries: per block, its (detached) input and its output."""

    inputs: list[Any] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    pending: list[DeferredWeights] = field(default_factory=list)  # kept by BackwardInput for BackwardWeight


class StageRun:
    """Executes stage ``link.stage``'s instructions of ``schedule`` over ``module`` (one batch)."""

    def __init__(self, schedule: Schedule, *, module: PipelineModule, link: StageLink | None, hooks: StageHooks,
                 stage: int):
        self.schedule, self.module, self.link, self.hooks, self.stage = schedule, module, link, hooks, stage
        self.program = schedule.programs[stage]
        self.last_virtual = schedule.virtual_stages - 1
        self.split = any(isinstance(op, (BackwardInput, BackwardWeight)) for op in self.program)
        # the last instruction producing weight gradients ends the window (its backward reduces)
        weight_ops = [i for i, op in enumerate(self.program) if isinstance(op, (Backward, BackwardWeight))]
        self._final = weight_ops[-1] if weight_ops else -1
        self.inputs: dict[Key, Any] = {}
        self.outputs: dict[Key, Any] = {}
        self.grads: dict[Key, Any] = {}
        self.labels: dict[int, Any] = {}
        self.blocks: dict[Key, _Blocks] = {}
        self.losses: list[Any] = []  # the last virtual stage's per-micro-batch losses (or outputs), detached
        self.in_flight = 0
        self.peak_in_flight = 0
        # (instruction code, micro-batch, chunk, start, end) of every computation, perf_counter seconds
        self.trace: list[tuple[str, int, int, float, float]] = []

    def _virtual(self, chunk: int) -> int:
        return chunk * self.schedule.stages + self.stage

    def run(self) -> None:
        """Execute the program; an error is re-raised naming this stage and the instruction it stopped at
        (its neighbours then time out waiting for it, naming it too)."""
        self._announce_receives()
        for position, op in enumerate(self.program):
            try:
                if isinstance(op, _COMPUTE):
                    start = time.perf_counter()
                    self._execute(op, position)
                    self.trace.append((op.code, op.micro, op.chunk, start, time.perf_counter()))
                else:
                    self._execute(op, position)
            except StageFailed:
                self._forget_receives()
                raise
            except Exception as exc:
                self._forget_receives()
                raise StageFailed(f"pipeline stage {self.stage} failed at {op} (instruction {position + 1} of "
                                  f"{len(self.program)} of the {self.schedule.name} schedule): "
                                  f"{type(exc).__name__}: {exc}") from exc
        if self.link is not None:
            self.link.wait_sends()

    def _execute(self, op: Instruction, position: int) -> None:
        if isinstance(op, LoadMicroBatch):
            inputs, labels = self.hooks.next_batch()
            if self._virtual(op.chunk) == 0:
                self.inputs[(op.micro, op.chunk)] = self.hooks.prepare_inputs(inputs)
            if self._virtual(op.chunk) == self.last_virtual:
                self.labels[op.micro] = labels
        elif isinstance(op, Forward):
            self._forward(op.micro, op.chunk)
        elif isinstance(op, Backward):
            with self.hooks.weight_backward(position == self._final):
                self._backward(op.micro, op.chunk)
        elif isinstance(op, BackwardInput):
            self._backward_input(op.micro, op.chunk)
        elif isinstance(op, BackwardWeight):
            with self.hooks.weight_backward(position == self._final):
                self._backward_weight(op.micro, op.chunk)
        elif isinstance(op, SendActivation):
            self._link().send("activation", op.micro, self.outputs[(op.micro, op.chunk)], op.peer)
            if not self.schedule.training:
                del self.outputs[(op.micro, op.chunk)]
        elif isinstance(op, RecvActivation):
            self.inputs[(op.micro, op.chunk)] = self._link().recv("activation", op.micro, op.peer)
        elif isinstance(op, SendGrad):
            payload = self.inputs.pop((op.micro, op.chunk))
            self._link().send("gradient", op.micro, input_grads(payload), op.peer)
        elif isinstance(op, RecvGrad):
            self.grads[(op.micro, op.chunk)] = self._link().recv("gradient", op.micro, op.peer)
        elif isinstance(op, ReduceTiedGrads):
            self._link_wait()
            self.hooks.tied()
        elif isinstance(op, ReduceGrads):
            self.hooks.reduce()
        elif isinstance(op, OptimizerStep):
            self.hooks.step()
        else:  # pragma: no cover - every instruction type is handled above
            raise AssertionError(f"unknown instruction {op}")

    def _announce_receives(self) -> None:
        """Tell the link every receive this program will make, so it posts each one ahead."""
        if self.link is None:
            return
        counts: dict[tuple[Kind, int], int] = {}
        for op in self.program:
            if isinstance(op, (RecvActivation, RecvGrad)):
                kind: Kind = "activation" if isinstance(op, RecvActivation) else "gradient"
                counts[(kind, op.peer)] = counts.get((kind, op.peer), 0) + 1
        for (kind, peer), count in counts.items():
            self.link.expect(kind, peer, count)

    def _forget_receives(self) -> None:
        if self.link is not None:
            self.link.forget_expected()

    def _link(self) -> StageLink:
        assert self.link is not None, "a one-stage schedule has no transfers"
        return self.link

    def _link_wait(self) -> None:
        if self.link is not None:
            self.link.wait_sends()

    # -- compute --------------------------------------------------------------------------------
    def _forward(self, micro: int, chunk: int) -> None:
        key = (micro, chunk)
        x = self.inputs[key]
        if not self.schedule.training:
            self.inputs.pop(key)
        if self.split:
            out = self._forward_blocks(key, x)
        else:
            out = self.module.forward(x, chunk)
        if self._virtual(chunk) == self.last_virtual:
            out = self.hooks.loss(out, self.labels.pop(micro))
            self.losses.append(_map(out, lambda t: t.detach()))
            if not self.schedule.training:
                return
        self.outputs[key] = out
        if self.schedule.training:
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def _forward_blocks(self, key: Key, x: Any) -> Any:
        """The chunk's forward with each block's input cut from the previous block's graph."""
        self.module.micro_offset += 1
        record = _Blocks()
        for index, block in enumerate(self.module.chunk_blocks(key[1])):
            if index > 0:
                x = detached(x)
            record.inputs.append(x)
            x = self.module.run_block(block, x)
            record.outputs.append(x)
        self.blocks[key] = record
        return x

    def _top(self, key: Key) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """The chunk's output tensors and the gradients backward starts from (the scaled loss on the
        last virtual stage)."""
        out = self.outputs.pop(key)
        if self._virtual(key[1]) == 0:  # the loaded inputs: no previous stage takes their gradient
            self.inputs.pop(key, None)
        if self._virtual(key[1]) == self.last_virtual:
            if not isinstance(out, torch.Tensor) or out.dim() != 0:
                raise ValueError(f"the pipeline's last stage produced {type(out).__name__}"
                                 f"{'' if not isinstance(out, torch.Tensor) else ' of shape ' + str(tuple(out.shape))}"
                                 " where a scalar loss tensor is needed to train; give PipelineModule a loss_fn, or "
                                 "make the last layer return the loss")
            return [self.hooks.scale(out)], [None]
        return _differentiable(out, self.grads.pop(key))

    def _backward(self, micro: int, chunk: int) -> None:
        outs, grads = self._top((micro, chunk))
        if outs:
            torch.autograd.backward(outs, grads)
        self.in_flight -= 1

    def _backward_input(self, micro: int, chunk: int) -> None:
        key = (micro, chunk)
        outs, grads = self._top(key)
        record = self.blocks[key]
        # the block outputs' tensors are replaced by the loss (last stage) or the received gradient pairs
        for index in range(len(record.outputs) - 1, -1, -1):
            block_inputs = [t for t in tensors_of(record.inputs[index]) if t.requires_grad]
            params = _block_params(self.module, self.module.chunk_blocks(chunk)[index])
            if not block_inputs or not outs:  # (token ids on the first stage need no gradient)
                if outs:
                    record.pending.append(backward_weights_later(outs, grads, params))
                next_outs, next_grads = [], []
            else:
                found, deferred = backward_input(outs, grads, block_inputs, params)
                record.pending.append(deferred)
                next_outs = [t for t, g in zip(block_inputs, found, strict=True) if g is not None]
                next_grads = [g for g in found if g is not None]
                if index == 0:  # the chunk's input: its gradient goes to the previous stage
                    for t, g in zip(block_inputs, found, strict=True):
                        t.grad = g
            if index > 0:
                outs, grads = _differentiable_of(record.outputs[index - 1], record.inputs[index], next_outs,
                                                 next_grads)
        self.in_flight -= 1

    def _backward_weight(self, micro: int, chunk: int) -> None:
        for deferred in self.blocks.pop((micro, chunk)).pending:
            deferred.run()


def _differentiable_of(outputs: Any, inputs: Any, seen: list[torch.Tensor], grads: list[torch.Tensor]
                       ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Block ``i - 1``'s output tensors paired with the gradients found for block ``i``'s detached
    inputs (the same tensors, cut): the next step of the split backward."""
    found = {id(t): g for t, g in zip(seen, grads, strict=True)}
    outs: list[torch.Tensor] = []
    gs: list[torch.Tensor | None] = []
    for out, cut in zip(tensors_of(outputs), tensors_of(inputs), strict=True):
        if out.requires_grad and id(cut) in found:
            outs.append(out)
            gs.append(found[id(cut)])
    return outs, gs


def _block_params(module: PipelineModule, block: Any) -> list[nn.Parameter]:
    """The trainable parameters of the layers of ``block`` (a tied module's once)."""
    out: dict[int, nn.Parameter] = {}
    for func in module.block_funcs(block):
        if isinstance(func, nn.Module):
            owners = [func]
        elif isinstance(func, functools.partial):  # a TiedLayerSpec's forward_fn bound to its module
            owners = [a for a in func.args if isinstance(a, nn.Module)]
        else:
            owners = []
        for owner in owners:
            for p in owner.parameters():
                if p.requires_grad:
                    out.setdefault(id(p), p)
    return list(out.values())


__all__ = ["StageFailed", "StageHooks", "StageRun", "tensors_of", "detached", "input_grads"]
