"""``CommStats.sent``: the bytes a rank puts on the wire per collective under the usual algorithms, and
per-step deltas with ``snapshot()`` / ``since()``."""

from __future__ import annotations

import pickle
from typing import Callable

import pytest
import torch

from zerospeed.distributed import Comm, CommCounts
from zerospeed.testing import run_distributed

F32 = 4


def _sent_per_op() -> dict:
    comm = Comm()
    rank, w = comm.rank, comm.world_size
    checked = []

    def expect(op: str, sent: int, nbytes: int, run: Callable[[], object]) -> None:
        before = comm.stats.snapshot()
        run()
        delta = comm.stats.since(before)
        assert delta.calls.get(op) == 1, (op, delta)
        assert delta.sent.get(op, 0) == sent, (op, dict(delta.sent), sent)
        assert delta.bytes.get(op, 0) == nbytes, (op, dict(delta.bytes), nbytes)
        checked.append(op)

    # all_reduce as a ring: 2(W-1)/W of the tensor, rounded down (7 fp32 = 28 bytes)
    expect("all_reduce", 2 * (w - 1) * 28 // w, 28, lambda: comm.all_reduce(torch.ones(7)))
    # reduce_scatter: the other ranks' parts of the input; even and uneven
    expect("reduce_scatter", (w - 1) * 5 * F32, w * 5 * F32,
           lambda: comm.reduce_scatter(torch.empty(5), torch.ones(w * 5)))
    sizes = [3, 1, 4][:w]
    expect("reduce_scatter", (sum(sizes) - sizes[rank]) * F32, sum(sizes) * F32,
           lambda: comm.reduce_scatter(torch.empty(sizes[rank]), [torch.ones(n) for n in sizes]))
    # all_gather: this rank's input to each other rank; even and uneven
    expect("all_gather", (w - 1) * 6 * F32, w * 6 * F32, lambda: comm.all_gather(torch.empty(w * 6), torch.ones(6)))
    expect("all_gather", (w - 1) * sizes[rank] * 8, sum(sizes) * 8,
           lambda: comm.all_gather([torch.empty(n, dtype=torch.float64) for n in sizes],
                                   torch.ones(sizes[rank], dtype=torch.float64)))
    # all_to_all: everything but this rank's own part (rank r sends r + p + 1 elements to p)
    counts = [rank + p + 1 for p in range(w)]
    expect("all_to_all", (sum(counts) - counts[rank]) * F32, sum(counts) * F32,
           lambda: comm.all_to_all([torch.empty(p + rank + 1) for p in range(w)], [torch.ones(n) for n in counts]))
    # all_to_all_single: even rows of 3 columns, then uneven row splits
    expect("all_to_all", (w - 1) * 2 * 3 * F32, w * 2 * 3 * F32,
           lambda: comm.all_to_all_single(torch.empty(w * 2, 3), torch.ones(w * 2, 3)))
    splits_in = [rank + p + 1 for p in range(w)]
    splits_out = [p + rank + 1 for p in range(w)]
    expect("all_to_all", (sum(splits_in) - splits_in[rank]) * 3 * F32, sum(splits_in) * 3 * F32,
           lambda: comm.all_to_all_single(torch.empty(sum(splits_out), 3), torch.ones(sum(splits_in), 3),
                                          splits_out, splits_in))
    # broadcast: the source sends the tensor (a flat tree), the others nothing
    expect("broadcast", 3 * 8 if rank == w - 1 else 0, 3 * 8,
           lambda: comm.broadcast(torch.zeros(3, dtype=torch.int64), src=w - 1))
    # send n, recv 0 (a ring: rank r sends 2 + r elements to r + 1)
    nxt, prv = (rank + 1) % w, (rank - 1) % w
    incoming = torch.empty(2 + prv)
    handle = comm.recv(incoming, src=prv, async_op=True)
    expect("send", (2 + rank) * F32, (2 + rank) * F32, lambda: comm.send(torch.ones(2 + rank), dst=nxt))
    assert handle is not None
    before = comm.stats.snapshot()
    handle.wait()
    assert comm.stats.since(before) == CommCounts()  # waiting counts nothing
    assert comm.stats.sent["recv"] == 0 and comm.stats.bytes["recv"] == (2 + prv) * F32
    expect("barrier", 0, 0, comm.barrier)
    # all_gather_object: its two all_gathers (the sizes, then the pickled payloads), by the same rule
    obj = {"rank": rank, "pad": "x" * rank}
    before = comm.stats.snapshot()
    assert comm.all_gather_object(obj)[w - 1]["rank"] == w - 1
    delta = comm.stats.since(before)
    assert dict(delta.calls) == {"all_gather": 2}
    assert delta.sent["all_gather"] == (w - 1) * (8 + len(pickle.dumps(obj)))
    # snapshots are frozen copies; totals add up; reset clears sent too
    snap = comm.stats.snapshot()
    comm.all_reduce(torch.ones(4))
    assert snap.total_calls == comm.stats.total_calls - 1
    assert snap.total_sent == comm.stats.total_sent - 2 * (w - 1) * 16 // w
    assert comm.stats.total_sent == sum(comm.stats.sent.values()) and snap.total_bytes <= comm.stats.total_bytes
    with pytest.raises(TypeError):
        snap.calls["all_reduce"] = 0  # type: ignore[index]
    comm.stats.reset()
    assert comm.stats.snapshot() == CommCounts()
    return {"rank": rank, "checked": checked}


@pytest.mark.parametrize("world_size", [2, 3])
def test_sent_bytes_follow_the_usual_algorithms(world_size: int) -> None:
    results = run_distributed(_sent_per_op, world_size)
    assert [r["rank"] for r in results] == list(range(world_size))
    assert results[0]["checked"].count("all_to_all") == 3 and "broadcast" in results[0]["checked"]


def test_counts_subtract_per_op() -> None:
    a = CommCounts({"all_reduce": 1}, {"all_reduce": 8}, {"all_reduce": 4})
    b = CommCounts({"all_reduce": 3, "barrier": 1}, {"all_reduce": 24, "barrier": 0}, {"all_reduce": 12, "barrier": 0})
    d = b - a
    assert dict(d.calls) == {"all_reduce": 2, "barrier": 1} and dict(d.bytes) == {"all_reduce": 16}
    assert dict(d.sent) == {"all_reduce": 8} and (d.total_calls, d.total_bytes, d.total_sent) == (3, 16, 8)
