"""Cross-entropy over logits whose vocabulary is split across the tensor-parallel group.

Gathering ``[tokens, vocab]`` logits to every rank would cost the largest activation of a language
model; instead each rank keeps its vocabulary slice and the softmax is assembled from two
all-reduces of per-token numbers: the maximum logit (for stability), then the sum of exponentials
together with the target's logit (which only the rank holding that word has). The backward needs
no communication: ``softmax - onehot`` of this rank's slice.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from zerospeed.distributed.comm import Comm
from zerospeed.tensor_parallel.group import TPGroup, tp_comm


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, comm: Comm,
                ignore_index: int) -> torch.Tensor:
        logits = logits.float()
        vocab_local = logits.shape[-1]
        start = comm.rank * vocab_local
        peak = logits.max(dim=-1).values
        comm.all_reduce(peak, op="max")
        shifted = logits - peak.unsqueeze(-1)
        ignored = target == ignore_index
        outside = (target < start) | (target >= start + vocab_local) | ignored
        local_target = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp_()  # shifted is ours: reuse it for the softmax numerator
        both = torch.stack([exp.sum(dim=-1), picked])
        comm.all_reduce(both)
        total, target_logit = both[0], both[1]
        loss = (total.log() - target_logit).masked_fill(ignored, 0.0)
        exp.div_(total.unsqueeze(-1))  # the softmax of this rank's slice
        ctx.save_for_backward(exp, local_target, outside, ignored)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local_target, outside, ignored = ctx.saved_tensors
        out = softmax.clone()
        hit = (~outside).to(out.dtype)
        out.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        out.mul_((grad * (~ignored).to(grad.dtype)).unsqueeze(-1))
        return out, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group: TPGroup = None, *,
                                 ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy(full_logits.view(-1, V), target.view(-1))`` from this rank's vocabulary slice
    ``logits`` (``[..., V / tp]``, e.g. a :class:`ColumnParallelLinear` LM head without gather), in
    float32. ``reduction``: ``"mean"`` over tokens not equal to ``ignore_index`` (torch's rule),
    ``"sum"``, or ``"none"`` (per-token losses shaped like ``target``, 0 where ignored)."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}: expected 'mean', 'sum' or 'none'")
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree: logits must be "
                         f"target's shape plus one vocabulary dimension")
    comm = tp_comm(tp_group)
    if comm is None or comm.world_size == 1:
        flat = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1),
                               ignore_index=ignore_index, reduction=reduction)
        return flat.view(target.shape) if reduction == "none" else flat
    losses = _VocabParallelCrossEntropy.apply(logits, target, comm, ignore_index)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    counted = (target != ignore_index).sum()
    return losses.sum() / counted  # nan when every token is ignored, as torch gives


__all__ = ["vocab_parallel_cross_entropy"]
