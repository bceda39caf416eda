"""Bucketed gradient reduction for data parallelism, started from gradient hooks during backward.

Gradients are accumulated, micro-batch after micro-batch, into flat per-bucket buffers in the
accumulation dtype (fp32 for bf16/fp16 training), and ``param.grad`` is freed as soon as it has
been added in. On the micro-step that ends an accumulation window, a bucket whose parameters have
all received their gradient is all-reduced at once, asynchronously, while backward continues with
earlier layers; buckets are launched strictly in order so every rank issues the same collectives in
the same order whatever its autograd scheduling. After the first window the buckets are laid out
again in the order gradients really arrived (rank 0's), so unused or late parameters no longer hold
the first buckets back. ``finish()`` launches what is left, waits, and applies DeepSpeed's scaling
(``prescale_gradients`` / ``gradient_predivide_factor``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from zerospeed.distributed.comm import Comm, Handle


def plan_buckets(numels: Sequence[int], bucket_elems: int) -> list[list[int]]:
    """Group parameter indices, in the given order, into buckets of about ``bucket_elems`` elements.

    A bucket closes once it reaches ``bucket_elems``; a parameter larger than that gets a bucket
    of its own. Pure, so the layout is tested without processes.
    """
    if bucket_elems < 1:
        raise ValueError(f"reduce_bucket_size={bucket_elems} must be >= 1 element")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index, numel in enumerate(numels):
        current.append(index)
        filled += numel
        if filled >= bucket_elems:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


@dataclass(frozen=True)
class ReductionPolicy:
    """How gradients are averaged: DeepSpeed's ``communication_data_type``, ``prescale_gradients``
    and ``gradient_predivide_factor``."""

    reduce_dtype: torch.dtype | None = None  # None: reduce in the accumulation dtype
    prescale: bool = False
    predivide_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.predivide_factor <= 0:
            raise ValueError(f"gradient_predivide_factor={self.predivide_factor} must be > 0")

    def before(self, flat: torch.Tensor, world: int) -> None:
        if self.prescale:
            flat.div_(world)
        elif self.predivide_factor != 1.0:
            flat.mul_(1.0 / self.predivide_factor)

    def after(self, flat: torch.Tensor, world: int) -> None:
        if not self.prescale and self.predivide_factor != world:
            flat.mul_(self.predivide_factor / world)


class _Bucket:
    def __init__(self, params: list[torch.nn.Parameter], dtype: torch.dtype):
        device = params[0].device
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            self.views.append(self.buffer[offset: offset + p.numel()].view(p.shape))
            offset += p.numel()
        self.ready: set[int] = set()
        self.written = [False] * len(params)  # slots holding this window's gradient (else stale)
        self.handle: Handle | None = None
        self.wire: torch.Tensor | None = None  # the buffer in the reduce dtype, while in flight


class GradBuckets:
    """Owns gradient accumulation and averaging for a list of parameters (ZeRO stage 0)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], comm: Comm, *, bucket_elems: int,
                 accum_dtype: torch.dtype = torch.float32, policy: ReductionPolicy = ReductionPolicy()):
        trainable = [p for p in params if p.requires_grad]
        if not trainable:
            raise ValueError("no trainable parameters: every parameter has requires_grad=False")
        self.comm = comm
        self.policy = policy
        self._trainable = trainable
        self._bucket_elems = bucket_elems
        self._accum_dtype = accum_dtype
        self._layout(list(reversed(range(len(trainable)))))  # a first guess: backward meets the last layers first
        self._index = {id(p): i for i, p in enumerate(trainable)}
        self._observed: list[int] = []  # hook order of the first reducing step
        self._relaid = False
        self._finished_once = False  # every rank sets it in finish(): the re-layout never depends on local data
        self.reduce_this_step = True  # the engine turns this off inside an accumulation window
        self._next_launch = 0
        self._window_done = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in trainable]

    def _layout(self, order: list[int]) -> None:
        """(Re)build the buckets for parameters taken in ``order`` (indices into the trainable list)."""
        params = [self._trainable[i] for i in order]
        groups = plan_buckets([p.numel() for p in params], self._bucket_elems)
        self.buckets = [_Bucket([params[i] for i in group], self._accum_dtype) for group in groups]
        self._where: dict[int, tuple[int, int]] = {}
        for b, bucket in enumerate(self.buckets):
            for slot, p in enumerate(bucket.params):
                self._where[id(p)] = (b, slot)

    # -- hooks -----------------------------------------------------------------------------
    def _on_grad(self, param: torch.Tensor) -> None:
        b, slot = self._where[id(param)]
        bucket = self.buckets[b]
        if bucket.handle is not None:
            raise RuntimeError("a second engine.backward() on the last micro-batch of an accumulation window: "
                               "its gradients were already sent for averaging; call backward once per "
                               "micro-batch (add the losses first)")
        if param.grad is not None:
            if bucket.written[slot]:
                bucket.views[slot].add_(param.grad)
            else:  # the window's first gradient overwrites: no zeroing pass over the buckets per step
                bucket.views[slot].copy_(param.grad)
                bucket.written[slot] = True
            param.grad = None  # the bucket holds it now; free the parameter-dtype copy
        if self.reduce_this_step:
            if not self._relaid:
                self._observed.append(self._index[id(param)])
            bucket.ready.add(slot)
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)
            self._next_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        for slot, written in enumerate(bucket.written):
            if not written:  # no gradient this window (unused parameter): it counts as zero
                bucket.views[slot].zero_()
                bucket.written[slot] = True
        world = self.comm.world_size
        dtype = self.policy.reduce_dtype
        wire = bucket.buffer if dtype is None or dtype == bucket.buffer.dtype else bucket.buffer.to(dtype)
        self.policy.before(wire, world)
        bucket.wire = wire
        bucket.handle = self.comm.all_reduce(wire, async_op=True)

    # -- boundary --------------------------------------------------------------------------
    def finish(self) -> None:
        """Reduce every bucket not yet launched (unused parameters count as zero) and wait for all.

        Idempotent within a window (reading a gradient early, e.g. ``safe_get_full_grad``, finishes it)."""
        if self._window_done:
            return
        for bucket in self.buckets[self._next_launch:]:
            self._launch(bucket)
        self._next_launch = len(self.buckets)
        self._finished_once = True
        world = self.comm.world_size
        for bucket in self.buckets:
            assert bucket.handle is not None and bucket.wire is not None
            bucket.handle.wait()
            self.policy.after(bucket.wire, world)
            if bucket.wire is not bucket.buffer:
                bucket.buffer.copy_(bucket.wire)
            bucket.handle = bucket.wire = None
            bucket.ready.clear()
        self._next_launch = 0
        self._window_done = True

    def _relay(self) -> None:
        """Lay the buckets out in the order gradients actually arrived (rank 0's, so every rank
        launches the same collectives in the same order); parameters that got no gradient go last.
        Like DDP's bucket rebuild: buckets fill, and go out, as early as backward allows."""
        seen = list(dict.fromkeys(self.comm.all_gather_object(self._observed)[0]))
        order = seen + [i for i in range(len(self._trainable)) if i not in set(seen)]
        self._layout(order)
        self._relaid = True
        self._observed = []

    def grad_of(self, param: torch.Tensor) -> torch.Tensor:
        """The accumulated (after ``finish``: averaged) gradient of ``param``, a view into its bucket
        (valid until the next ``zero()``, which may lay the buckets out again)."""
        b, slot = self._where[id(param)]
        return self.buckets[b].views[slot]

    def flat_buffers(self) -> list[torch.Tensor]:
        """Every bucket's flat gradient buffer (for overflow checks and norms in one pass each)."""
        return [bucket.buffer for bucket in self.buckets]

    def zero(self) -> None:
        """Start a new accumulation window (after the first, with buckets in the observed order).

        Nothing is cleared in memory: each slot is overwritten by its first gradient of the window,
        or zeroed when its bucket is sent without one, so buffers are only meaningful after ``finish``.
        """
        self._window_done = False
        if not self._relaid and self._finished_once:
            self._relay()
        for bucket in self.buckets:
            bucket.written = [False] * len(bucket.params)
            bucket.ready.clear()
        self._next_launch = 0

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
