"""The autograd regions of Megatron-style tensor parallelism, each a pair of collectives.

A tensor-parallel layer is correct only if its forward collective has the right backward twin:
a replicated input entering column-parallel weights is copied (forward: nothing; backward: the
partial input gradients of the ranks are summed), row-parallel partial outputs are summed
(forward: all-reduce; backward: nothing) and so on. With Megatron's sequence parallelism the
activations between blocks are split along the sequence, and the all-reduce pairs become an
all-gather / reduce-scatter pair carrying the same bytes.

Every collective goes through the tensor-parallel :class:`~zerospeed.distributed.comm.Comm`
(the comm door: counted, timed); on a group of one rank every region is the identity.
Gradients handed to a backward are cloned before an in-place collective (autograd may hold them),
and so are forward inputs, unless the caller says the tensor is its own: the layers pass
``inplace=True`` for the partial output of their own matmul (reduced in place, marked dirty for
autograd) and ``grad_inplace=True`` where the only consumer is their own ``F.linear``, whose
backward hands over a fresh input gradient (all-reduced in place). Same sums, one copy fewer each.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from zerospeed.distributed.comm import Comm


# -- collectives along a tensor dimension ---------------------------------------------------------
def all_gather_along(x: torch.Tensor, dim: int, comm: Comm) -> torch.Tensor:
    """The group's tensors concatenated along ``dim`` (rank order)."""
    dim = dim % x.dim()
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((comm.world_size * front.shape[0], *front.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(out, front)
    return out.movedim(0, dim)


def reduce_scatter_along(x: torch.Tensor, dim: int, comm: Comm) -> torch.Tensor:
    """The sum over the group, keeping this rank's chunk of ``dim`` (which the group size divides)."""
    dim = dim % x.dim()
    size = x.shape[dim]
    if size % comm.world_size:
        raise ValueError(f"dimension {dim} of size {size} cannot be split evenly over {comm.world_size} "
                         f"tensor-parallel ranks; make it a multiple of {comm.world_size}")
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((size // comm.world_size, *front.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, front, inputs_writable=True)
    return out.movedim(0, dim)


def split_along(x: torch.Tensor, dim: int, comm: Comm) -> torch.Tensor:
    """This rank's chunk of ``dim`` (contiguous), without communication."""
    size = x.shape[dim]
    if size % comm.world_size:
        raise ValueError(f"dimension {dim % x.dim()} of size {size} cannot be split evenly over "
                         f"{comm.world_size} tensor-parallel ranks; make it a multiple of {comm.world_size}")
    return x.chunk(comm.world_size, dim=dim)[comm.rank].contiguous()


def _summed(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out)
    return out


# -- the regions ------------------------------------------------------------------------------
class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, grad_inplace: bool) -> torch.Tensor:
        ctx.comm, ctx.grad_inplace = comm, grad_inplace
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.grad_inplace and grad.is_contiguous():
            ctx.comm.all_reduce(grad)  # the caller's F.linear made this gradient; nothing else holds it
            return grad, None, None
        return _summed(grad, ctx.comm), None, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, inplace: bool) -> torch.Tensor:
        if inplace and x.is_contiguous():
            comm.all_reduce(x)
            ctx.mark_dirty(x)
            return x
        return _summed(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


AlongDim = Callable[[torch.Tensor, int, Comm], torch.Tensor]


class _Pair(torch.autograd.Function):
    """A collective along a dimension in forward and its twin in backward (each ``f(tensor, dim, comm)``):
    split / all-gather, all-gather / split, and for sequence parallelism all-gather / reduce-scatter
    (the consumer is tensor-parallel, so the input gradients are partial sums) and reduce-scatter /
    all-gather."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, dim: int, forward: AlongDim, backward: AlongDim
                ) -> torch.Tensor:
        ctx.comm, ctx.dim, ctx.twin = comm, dim, backward
        return forward(x, dim, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        return ctx.twin(grad, ctx.dim, ctx.comm), None, None, None, None


class _SumGradsOverGroup(torch.autograd.Function):
    """Identity on parameters whose gradient each rank only sees part of (sequence-parallel norms and
    row-parallel biases see their sequence shard): backward sums the gradients in one all-reduce."""

    @staticmethod
    def forward(ctx: Any, comm: Comm, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.comm = comm
        ctx.like = [(p.shape, p.dtype, p.device) for p in params]
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        # every rank sends every parameter's slot (zeros where its part was unused), so sizes agree
        dense = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                 for g, (shape, dtype, device) in zip(grads, ctx.like, strict=True)]
        flat = torch.cat([g.reshape(-1) for g in dense])
        ctx.comm.all_reduce(flat)
        out, offset = [], 0
        for g in dense:
            out.append(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()
        return (None, *out)


def copy_to_tensor_parallel_region(x: torch.Tensor, comm: Comm, *, grad_inplace: bool = False) -> torch.Tensor:
    """Forward: identity; backward: all-reduce (a replicated input entering column-parallel weights).

    ``grad_inplace=True``: the result's only consumer is an op whose backward gives it a gradient
    nothing else holds (``F.linear``'s input gradient), so backward all-reduces that tensor in place
    instead of a copy."""
    return x if comm.world_size == 1 else _CopyToRegion.apply(x, comm, grad_inplace)


def reduce_from_tensor_parallel_region(x: torch.Tensor, comm: Comm, *, inplace: bool = False) -> torch.Tensor:
    """Forward: all-reduce; backward: identity (partial outputs of row-parallel weights).

    ``inplace=True``: ``x`` is the caller's own fresh tensor (a matmul output that no autograd node
    saved and nothing else reads), all-reduced in place and returned instead of a summed copy."""
    return x if comm.world_size == 1 else _ReduceFromRegion.apply(x, comm, inplace)


def scatter_to_tensor_parallel_region(x: torch.Tensor, comm: Comm, dim: int = -1) -> torch.Tensor:
    """Forward: keep this rank's chunk of ``dim``; backward: all-gather along it."""
    return x if comm.world_size == 1 else _Pair.apply(x, comm, dim, split_along, all_gather_along)


def gather_from_tensor_parallel_region(x: torch.Tensor, comm: Comm, dim: int = -1) -> torch.Tensor:
    """Forward: all-gather along ``dim``; backward: keep this rank's chunk."""
    return x if comm.world_size == 1 else _Pair.apply(x, comm, dim, all_gather_along, split_along)


def scatter_to_sequence_parallel_region(x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    """Forward: keep this rank's sequence chunk; backward: all-gather along the sequence."""
    return x if comm.world_size == 1 else _Pair.apply(x, comm, dim, split_along, all_gather_along)


def gather_from_sequence_parallel_region(x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    """Forward: all-gather the sequence; backward: reduce-scatter (the consumer is tensor-parallel)."""
    return x if comm.world_size == 1 else _Pair.apply(x, comm, dim, all_gather_along, reduce_scatter_along)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    """Forward: reduce-scatter along the sequence; backward: all-gather."""
    return x if comm.world_size == 1 else _Pair.apply(x, comm, dim, reduce_scatter_along, all_gather_along)


def gather_sequence(x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    """The whole sequence from shards whose consumer is replicated (a loss on every rank):
    backward keeps this rank's chunk, like :func:`gather_from_tensor_parallel_region`."""
    return gather_from_tensor_parallel_region(x, comm, dim)


def sum_grads_over_group(comm: Comm, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``params`` as they are, with their gradients summed over the group in one all-reduce."""
    if comm.world_size == 1 or not any(p.requires_grad for p in params):
        return params
    return _SumGradsOverGroup.apply(comm, *params)


__all__ = [
    "all_gather_along", "reduce_scatter_along", "split_along",
    "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "gather_sequence", "sum_grads_over_group",
]
