"""A collective whose wait outlasts the patience must not keep its tensors alive afterwards.

``Comm.wait_work`` first waits a short patience (0.5 s) and, when that wait times out, announces
where this rank waits and waits again. On a busy machine many waits outlast the patience. The
timeout exception it caught used to be kept with its traceback, a reference cycle (exception ->
traceback -> ``wait_work``'s frame -> the exception) that held every calling frame, and so the
tensors in them, until Python's cyclic garbage collector next ran: under ``zero.Init`` each one a
whole parameter's broadcast buffer, which is how a 1B-parameter build's peak rose with load.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist

from zerospeed.distributed.comm import Comm
from zerospeed.testing.dist import one_process_group


class _LateWork:
    """A gloo work whose first timed wait times out, as one past the patience does on a busy machine."""

    def __init__(self, work: Any) -> None:
        self._work = work
        self._timed_out = False

    def wait(self, timeout: Any = None) -> bool:
        if not self._timed_out:
            self._timed_out = True
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                               "1000ms for recv operation to complete")
        return bool(self._work.wait() if timeout is None else self._work.wait(timeout=timeout))

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())


@pytest.mark.parametrize("op", ["broadcast", "all_reduce"])
def test_a_wait_past_the_patience_frees_the_tensor_without_the_garbage_collector(
        monkeypatch: pytest.MonkeyPatch, op: str) -> None:
    with one_process_group():
        comm = Comm(name=f"patience-{op}")
        real = getattr(dist, op)
        monkeypatch.setattr(dist, op, lambda *args, **kwargs: _LateWork(real(*args, **kwargs)))
        gc.collect()
        gc.disable()  # only reference counting may free it: a cycle would keep it until a gc pass
        try:
            tensor = torch.full((1024,), 3.0)
            alive = weakref.ref(tensor)
            if op == "broadcast":
                comm.broadcast(tensor, src=0)
            else:
                comm.all_reduce(tensor)
            assert torch.equal(tensor, torch.full((1024,), 3.0))  # the collective itself still completed
            del tensor
            held = alive() is not None
        finally:
            gc.enable()
        assert not held, f"{op}'s tensor is still alive after its wait outlasted the patience (a reference cycle)"
