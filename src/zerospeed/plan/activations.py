"""Activation bytes of one training micro-step, traced on the meta device (no memory, no compute).

The model runs forward on meta tensors shaped like the real micro-batch inside
``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd keeps for backward passes the
pack hook, and the distinct storages among them (parameters left out: they are model state) are
what the forward holds at its end, the activation peak of a step. Per repeated block (a
transformer layer) the trace also records what the block kept and the size of its input, which
gives activation checkpointing's figure without a second trace: the blocks keep only their inputs,
and backward recomputes one block at a time.

The model factory gives the example batch (see ``docs/memory_plan.md``): a tensor, a tuple of
positional inputs, or a dict of keyword inputs, whose first dimension is the batch; the trace
resizes that dimension to the micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerospeed.sharding.units import repeated_block_classes

__all__ = ["ActivationTrace", "as_micro_batch", "trace_activations"]


@dataclass(frozen=True)
class ActivationTrace:
    """Bytes a micro-step's forward keeps for backward. ``saved``: all of it; ``in_blocks``: the part
    kept inside repeated blocks; ``block_inputs``: the blocks' inputs; ``largest_block``: the most
    one block keeps; ``largest_tensor``: the largest single kept tensor (a gradient of its size
    exists beside them in backward)."""

    saved: int
    in_blocks: int = 0
    block_inputs: int = 0
    largest_block: int = 0
    largest_tensor: int = 0

    def peak(self, checkpointing: bool) -> int:
        """Activation bytes at the step's peak: what the forward kept (with checkpointing: the blocks'
        inputs instead of their insides, plus one block recomputed) and one gradient in flight the
        size of the largest kept tensor."""
        kept = self.saved
        if checkpointing and self.in_blocks:
            kept = self.saved - self.in_blocks + self.block_inputs + self.largest_block
        return kept + self.largest_tensor

    def scaled(self, factor: float) -> ActivationTrace:
        """The trace of a micro-batch ``factor`` times as large (activations grow with the batch)."""
        return ActivationTrace(*(int(round(v * factor)) for v in (self.saved, self.in_blocks, self.block_inputs,
                                                                   self.largest_block, self.largest_tensor)))


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def as_micro_batch(example: Any, micro_batch: int) -> Any:
    """``example`` (tensor / tuple / list / dict of tensors, batch first) as meta tensors with
    ``micro_batch`` rows; other values pass through."""
    if isinstance(example, torch.Tensor):
        if example.dim() == 0:
            return torch.empty((), dtype=example.dtype, device="meta")
        return torch.empty((micro_batch, *example.shape[1:]), dtype=example.dtype, device="meta")
    if isinstance(example, dict):
        return {k: as_micro_batch(v, micro_batch) for k, v in example.items()}
    if isinstance(example, (tuple, list)):
        return type(example)(as_micro_batch(v, micro_batch) for v in example)
    return example


def _scalar_loss(out: Any) -> torch.Tensor:
    """The value backward starts from: the output itself when it is a scalar (a loss), else its sum."""
    if isinstance(out, dict):
        out = out.get("loss", next(iter(out.values())))
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"the model's forward returned {type(out).__name__}; the plan needs a tensor (a loss or "
                        f"logits), a tuple/list starting with one, or a dict with a 'loss' entry")
    return out if out.dim() == 0 else out.float().sum()


def trace_activations(model: nn.Module, example: Any, *, micro_batch: int,
                      compute_dtype: torch.dtype | None = None) -> ActivationTrace:
    """Trace one forward of ``model`` (on the meta device; cast to ``compute_dtype`` when given, as the
    engine casts it) on ``example`` resized to ``micro_batch`` rows."""
    if compute_dtype is not None:
        model = model.to(compute_dtype)
    batch = as_micro_batch(example, micro_batch)
    if compute_dtype is not None:  # the engine casts floating inputs to the compute dtype
        batch = _cast_floating(batch, compute_dtype)
    params = {_key(p) for p in model.parameters()}
    kept: dict[int, int] = {}
    blocks = repeated_block_classes(model)
    per_block: list[int] = []
    inputs: list[int] = []
    stack: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _key(t)
        if key not in params and key not in kept:
            kept[key] = _nbytes(t)
        return t

    def before(module: nn.Module, args: tuple[Any, ...]) -> None:
        stack.append(sum(kept.values()))
        inputs.append(sum(_nbytes(a) for a in args if isinstance(a, torch.Tensor)))

    def after(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        per_block.append(sum(kept.values()) - stack.pop())

    hooks = []
    for module in model.modules():
        if blocks and isinstance(module, blocks):
            hooks += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if isinstance(batch, dict):
                out = model(**batch)
            elif isinstance(batch, (tuple, list)):
                out = model(*batch)
            else:
                out = model(batch)
        _scalar_loss(out)
    finally:
        for hook in hooks:
            hook.remove()
    return ActivationTrace(saved=sum(kept.values()), in_blocks=sum(per_block), block_inputs=sum(inputs),
                           largest_block=max(per_block, default=0), largest_tensor=max(kept.values(), default=0))


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: _cast_floating(v, dtype) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floating(v, dtype) for v in value)
    return value
