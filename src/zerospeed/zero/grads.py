"""ZeRO stage 0's gradient buckets: the one gradient reducer (:mod:`zero.reducer`) with an all-reduce.

Parameters are grouped, in order, into flat buckets of about ``reduce_bucket_size`` elements in the
accumulation dtype (fp32 for bf16/fp16 training); ``param.grad`` is freed as soon as it has been
added in. Only the micro-step that ends an accumulation window reduces: a bucket whose parameters
have all received their gradient is all-reduced at once, asynchronously, while backward continues
with earlier layers. After the first window the buckets are laid out again in the order gradients
really arrived (rank 0's), so unused or late parameters no longer hold the first buckets back.
``finish()`` launches what is left, waits, and applies DeepSpeed's scaling (``prescale_gradients`` /
``gradient_predivide_factor``). With ``rows`` (the config's ``sparse_gradients``) each lookup
table's gradient has a bucket of its own, reduced by exchanging only the rows the window touched
(:mod:`zero.sparse_rows`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from zerospeed.distributed.comm import Comm
from zerospeed.zero.reducer import (AllReduce, Bucket, GradReducer, GradSlot, ReductionPolicy, plan_buckets,
                                    second_backward_error)
from zerospeed.zero.sparse_rows import SparseRows, TouchedRows

__all__ = ["GradBuckets", "ReductionPolicy", "plan_buckets"]


class GradBuckets:
    """Owns gradient accumulation and averaging for a list of parameters (ZeRO stage 0)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], comm: Comm, *, bucket_elems: int,
                 accum_dtype: torch.dtype = torch.float32, policy: ReductionPolicy = ReductionPolicy(),
                 rows: SparseRows | None = None):
        """``rows``: which parameters are lookup tables exchanged as touched rows (None: all dense)."""
        trainable = [p for p in params if p.requires_grad]
        self._trainable = trainable
        self._bucket_elems = bucket_elems
        self.comm = comm
        self.touched: TouchedRows | None = rows.track(trainable) if rows is not None else None
        # a first guess: backward meets the last layers first
        buckets = self._layout(list(reversed(range(len(trainable)))))
        self.reducer = GradReducer(trainable, buckets, range(len(buckets)), comm, collective=AllReduce(comm),
                                   policy=policy, accum_dtype=accum_dtype, land=_keep_whole,
                                   late_gradient=_late_gradient, keep_accumulators=True)
        self.policy = policy
        self._finished_once = False  # every rank sets it in finish(): the re-layout never depends on local data
        self._window_done = False

    def _layout(self, order: list[int]) -> list[Bucket]:
        """Buckets for the trainable parameters taken in ``order`` (indices into the trainable list)."""
        numels = [self._trainable[i].numel() for i in order]
        touched = self.touched
        alone = {k for k, i in enumerate(order) if touched is not None and touched.covers(self._trainable[i])}
        buckets = []
        for b, group in enumerate(plan_buckets(numels, self._bucket_elems, alone)):
            slots, offset = [], 0
            for k in group:
                p = self._trainable[order[k]]
                slots.append(GradSlot(offset, p.shape, order[k]))
                offset += p.numel()
            first = self._trainable[order[group[0]]]
            exchange = touched.exchange(self.comm, first) if touched is not None and group[0] in alone else None
            buckets.append(Bucket(b, slots, offset, first.device, collective=exchange))
        return buckets

    @property
    def buckets(self) -> list[Bucket]:
        """The buckets, in launch order."""
        return self.reducer.buckets

    @property
    def reduce_this_step(self) -> bool:
        """Whether this backward's gradients are averaged (the engine turns it off inside a window)."""
        return self.reducer.reducing

    @reduce_this_step.setter
    def reduce_this_step(self, value: bool) -> None:
        self.reducer.reducing = value

    # -- boundary --------------------------------------------------------------------------
    def finish(self) -> None:
        """Reduce every bucket not yet launched (unused parameters count as zero) and wait for all.

        Idempotent within a window (reading a gradient early, e.g. ``safe_get_full_grad``, finishes it)."""
        if self._window_done:
            return
        self.reducer.flush()
        self._finished_once = True
        self.reducer.restart_pass()  # a further reducing backward would launch again
        self._window_done = True

    def finish_locally(self) -> None:
        """End the window without averaging: each rank keeps its own accumulated gradients (the
        optimizer exchanges what it needs itself, e.g. 1-bit Adam's compressed momentum)."""
        if self._window_done:
            return
        self.reducer.settle_locally()
        self._window_done = True

    def _relay(self) -> None:
        """Lay the buckets out in the order gradients actually arrived (rank 0's, so every rank
        launches the same collectives in the same order); parameters that got no gradient go last.
        Like DDP's bucket rebuild: buckets fill, and go out, as early as backward allows."""
        seen = self.reducer.agreed_arrivals()
        arrived = set(seen)
        order = seen + [i for i in range(len(self._trainable)) if i not in arrived]
        buckets = self._layout(order)
        self.reducer.set_buckets(buckets, range(len(buckets)))

    def grad_of(self, param: torch.Tensor) -> torch.Tensor:
        """The accumulated (after ``finish``: averaged) gradient of ``param``, a view into its bucket
        (valid until the next ``zero()``, which may lay the buckets out again)."""
        b, slot = self.reducer.where(param)
        return self.reducer.buckets[b].view(slot)

    def flat_buffers(self) -> list[torch.Tensor]:
        """Every bucket's flat gradient buffer (for overflow checks and norms in one pass each)."""
        out = []
        for bucket in self.reducer.buckets:
            assert bucket.acc is not None
            out.append(bucket.acc)
        return out

    def zero(self) -> None:
        """Start a new accumulation window (after the first, with buckets in the observed order).

        Nothing is cleared in memory: each slot is overwritten by its first gradient of the window,
        or zeroed when its bucket is sent without one, so buffers are only meaningful after ``finish``.
        """
        self._window_done = False
        self.reducer.new_window()
        if not self.reducer.relaid and self._finished_once:
            self._relay()

    def remove_hooks(self) -> None:
        self.reducer.remove_hooks()
        if self.touched is not None:
            self.touched.remove_hooks()


def _keep_whole(bucket: Bucket, out: torch.Tensor) -> None:
    """The all-reduced bucket stays in its flat buffer (copied back when reduced in another dtype)."""
    if out is not bucket.acc:
        assert bucket.acc is not None
        bucket.acc.copy_(out)


def _late_gradient(bucket: Bucket) -> Exception:
    return second_backward_error()
