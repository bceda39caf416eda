"""Differentiable all-to-all over an expert-parallel :class:`~zerospeed.distributed.comm.Comm`.

The token exchange of expert parallelism must carry gradients back: the backward of an
all-to-all is the all-to-all with send and receive splits swapped. Every call goes through the
comm door, so bytes are counted there (under ``op``) and hangs become timeouts naming the ranks.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from zerospeed.distributed.comm import Comm

TOKENS_OP = "all_to_all"  # the name token exchanges are counted under in ``comm.stats``
COUNTS_OP = "all_to_all_counts"  # the small per-expert row-count exchange of the dropless path


def _exchange(comm: Comm, rows: Tensor, send_splits: list[int] | None, recv_splits: list[int] | None) -> Tensor:
    rows = rows.contiguous()
    if recv_splits is None:
        out = torch.empty_like(rows)
    else:
        out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
    comm.all_to_all_single(out, rows, output_split_sizes=recv_splits, input_split_sizes=send_splits, op=TOKENS_OP)
    return out


class _AllToAll(torch.autograd.Function):
    """Forward: rows split ``send_splits`` go out, ``recv_splits`` come in. Backward: the reverse."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, comm: Comm, send_splits: list[int] | None,
                recv_splits: list[int] | None) -> Tensor:
        ctx.comm, ctx.send_splits, ctx.recv_splits = comm, send_splits, recv_splits
        return _exchange(comm, rows, send_splits, recv_splits)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _exchange(ctx.comm, grad, ctx.recv_splits, ctx.send_splits), None, None, None


def all_to_all(rows: Tensor, comm: Comm, send_splits: Sequence[int] | None = None,
               recv_splits: Sequence[int] | None = None) -> Tensor:
    """Exchange the rows of ``rows`` (dim 0) across ``comm``'s ranks, differentiably.

    Without splits the rows are split evenly (DeepSpeed's capacity dispatch); with them, rank i
    gets ``send_splits[i]`` rows and this rank receives ``recv_splits[i]`` from rank i.
    """
    send = None if send_splits is None else [int(n) for n in send_splits]
    recv = None if recv_splits is None else [int(n) for n in recv_splits]
    out = _AllToAll.apply(rows, comm, send, recv)
    assert isinstance(out, Tensor)
    return out


def exchange_counts(comm: Comm, counts: Tensor) -> Tensor:
    """Rank i receives ``counts[i]`` (a ``[world, n]`` int64 block); returns what every rank sent here.

    Every rank calls it, also when it routes no token at all, so the exchange that follows never
    waits for a rank that had nothing to send.
    """
    counts = counts.to(torch.int64).contiguous()
    out = torch.empty_like(counts)
    comm.all_to_all_single(out, counts, op=COUNTS_OP)
    return out


__all__ = ["COUNTS_OP", "TOKENS_OP", "all_to_all", "exchange_counts"]
