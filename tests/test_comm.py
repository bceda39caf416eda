"""Every Comm collective on real gloo ranks: results for even and uneven sizes, counters, timeouts."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from zerospeed.distributed import CollectiveTimeout, Comm
from zerospeed.testing import run_distributed

UNEVEN = [3, 1, 4, 1, 5]  # part sizes per rank: not equal, not multiples of the world size


def _fill(rank: int, part: int, n: int) -> torch.Tensor:
    """What rank ``rank`` contributes for part ``part`` (distinct per rank and part)."""
    return torch.arange(n, dtype=torch.float32) + 100.0 * rank + 10.0 * part


def _collectives() -> dict:
    comm = Comm()
    rank, ws = comm.rank, comm.world_size
    expected_bytes: dict[str, int] = {}

    def add(op: str, nbytes: int) -> None:
        expected_bytes[op] = expected_bytes.get(op, 0) + nbytes

    # all_reduce: sum, avg, max (7 elements: not a multiple of the world size)
    t = _fill(rank, 0, 7)
    comm.all_reduce(t)
    torch.testing.assert_close(t, sum(_fill(r, 0, 7) for r in range(ws)), rtol=0, atol=0)
    add("all_reduce", 7 * 4)
    t = _fill(rank, 0, 7)
    comm.all_reduce(t, op="avg")
    torch.testing.assert_close(t, sum(_fill(r, 0, 7) for r in range(ws)) / ws)
    add("all_reduce", 7 * 4)
    t = torch.tensor([float(rank), -float(rank)])
    comm.all_reduce(t, op="max")
    assert t.tolist() == [ws - 1.0, 0.0]
    add("all_reduce", 8)

    # reduce_scatter, even: one flat input of ws * 5 elements
    flat = torch.cat([_fill(rank, p, 5) for p in range(ws)])
    out = torch.empty(5)
    comm.reduce_scatter(out, flat)
    torch.testing.assert_close(out, sum(_fill(r, rank, 5) for r in range(ws)), rtol=0, atol=0)
    add("reduce_scatter", ws * 5 * 4)

    # reduce_scatter, uneven parts, averaged
    sizes = UNEVEN[:ws]
    parts = [_fill(rank, p, sizes[p]) for p in range(ws)]
    out = torch.empty(sizes[rank])
    comm.reduce_scatter(out, parts, op="avg")
    torch.testing.assert_close(out, sum(_fill(r, rank, sizes[rank]) for r in range(ws)) / ws)
    add("reduce_scatter", sum(sizes) * 4)

    # all_gather, even (2-D input, flat output) and uneven (list of differently sized outputs)
    mine = _fill(rank, 0, 6).view(2, 3)
    gathered = torch.empty(ws * 6)
    comm.all_gather(gathered, mine)
    torch.testing.assert_close(gathered, torch.cat([_fill(r, 0, 6) for r in range(ws)]), rtol=0, atol=0)
    add("all_gather", ws * 6 * 4)
    outs = [torch.empty(sizes[r], dtype=torch.float64) for r in range(ws)]
    comm.all_gather(outs, _fill(rank, 1, sizes[rank]).double())
    for r in range(ws):
        torch.testing.assert_close(outs[r], _fill(r, 1, sizes[r]).double(), rtol=0, atol=0)
    add("all_gather", sum(sizes) * 8)

    # broadcast from the last rank, int64
    t = torch.full((3,), rank, dtype=torch.int64)
    comm.broadcast(t, src=ws - 1)
    assert t.tolist() == [ws - 1] * 3
    add("broadcast", 3 * 8)

    # send / recv around a ring, uneven sizes (rank r sends UNEVEN[r] elements to r+1)
    if ws > 1:
        nxt, prv = (rank + 1) % ws, (rank - 1) % ws
        incoming = torch.empty(UNEVEN[prv])
        h = comm.recv(incoming, src=prv, async_op=True)
        comm.send(_fill(rank, 9, UNEVEN[rank]), dst=nxt)
        h.wait()
        torch.testing.assert_close(incoming, _fill(prv, 9, UNEVEN[prv]), rtol=0, atol=0)
        add("send", UNEVEN[rank] * 4)
        add("recv", UNEVEN[prv] * 4)

    # all_to_all: rank r sends (r + p + 1) elements to rank p
    inputs = [_fill(rank, p, rank + p + 1) for p in range(ws)]
    outputs = [torch.empty(p + rank + 1) for p in range(ws)]
    comm.all_to_all(outputs, inputs)
    for p in range(ws):
        torch.testing.assert_close(outputs[p], _fill(p, rank, p + rank + 1), rtol=0, atol=0)
    add("all_to_all", sum(rank + p + 1 for p in range(ws)) * 4)

    # async handles: is_completed() only says True once post-processing (averaging, unpadding) is done
    t = torch.ones(4)
    h = comm.all_reduce(t, op="avg", async_op=True)
    while not h.is_completed():
        time.sleep(0.001)
    assert t.tolist() == [1.0] * 4
    h.wait()  # idempotent
    assert t.tolist() == [1.0] * 4
    add("all_reduce", 16)
    outs = [torch.zeros(sizes[r]) for r in range(ws)]
    h = comm.all_gather(outs, _fill(rank, 2, sizes[rank]), async_op=True)
    while not h.is_completed():
        time.sleep(0.001)
    for r in range(ws):
        torch.testing.assert_close(outs[r], _fill(r, 2, sizes[r]), rtol=0, atol=0)
    add("all_gather", sum(sizes) * 4)

    # a zero-size part is fine
    zero_sizes = [0] + [2] * (ws - 1)
    outs = [torch.empty(n) for n in zero_sizes]
    comm.all_gather(outs, torch.full((zero_sizes[rank],), float(rank)))
    assert [o.tolist() for o in outs] == [[float(r)] * n for r, n in enumerate(zero_sizes)]
    add("all_gather", sum(zero_sizes) * 4)

    # small python objects, over the same all_gather
    assert comm.all_gather_object({"rank": rank, "tag": "x" * rank}) == [{"rank": r, "tag": "x" * r} for r in range(ws)]
    comm.stats.bytes["all_gather"] -= 8 * ws + sum(len(__import__("pickle").dumps({"rank": r, "tag": "x" * r})) for r in range(ws))
    comm.stats.calls["all_gather"] -= 2

    comm.barrier()
    add("barrier", 0)
    assert dict(comm.stats.bytes) == expected_bytes, (dict(comm.stats.bytes), expected_bytes)
    assert comm.stats.total_bytes == sum(expected_bytes.values())
    assert comm.stats.calls["all_reduce"] == 4 and comm.stats.calls["reduce_scatter"] == 2
    assert comm.stats.calls["all_gather"] == 4 and comm.stats.calls["barrier"] == 1
    return {"rank": rank, "bytes": dict(comm.stats.bytes), "calls": comm.stats.total_calls}


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_collective_uneven_sizes_and_counters(world_size: int) -> None:
    results = run_distributed(_collectives, world_size)
    assert [r["rank"] for r in results] == list(range(world_size))
    # every rank contributed the same logical volume for the symmetric collectives
    assert len({r["bytes"]["all_reduce"] for r in results}) == 1
    assert results[0]["bytes"]["reduce_scatter"] == (world_size * 5 + sum(UNEVEN[:world_size])) * 4


def _misuse() -> str:
    comm = Comm()
    messages = []
    for call in (
        lambda: comm.reduce_scatter(torch.empty(3), torch.empty(7)),
        lambda: comm.all_gather([torch.empty(1)], torch.empty(1)),
        lambda: comm.broadcast(torch.empty(1), src=5),
        lambda: comm.all_reduce(torch.ones(2, dtype=torch.int64), op="avg"),
        lambda: comm.reduce_scatter(torch.empty(1, dtype=torch.int32), torch.ones(2, dtype=torch.int32), op="avg"),
        lambda: comm.reduce_scatter(torch.empty(2), [torch.empty(1), torch.empty(3)]),
        lambda: comm.all_reduce(torch.ones(2), op="mean"),  # type: ignore[arg-type]
    ):
        try:
            call()
        except (ValueError, TypeError) as exc:
            messages.append(str(exc))
    assert comm.stats.total_calls == 0  # every misuse was caught before the network
    comm.barrier()
    return "\n".join(messages)


def test_misuse_is_caught_before_the_network() -> None:
    text = run_distributed(_misuse, 2)[0]
    assert "expected 2 x 3 = 6 elements, got 7" in text
    assert "all_gather: got 1 tensors for a group of 2 ranks" in text
    assert "rank 5 is outside group 'world' of size 2" in text
    assert "op='avg' needs a floating-point tensor, got torch.int64" in text
    assert "op='avg' needs a floating-point tensor, got torch.int32" in text
    assert "op='mean' is not a reduction; expected one of sum, avg, max, min, product" in text
    assert ("reduce_scatter: output has 2 elements but part 0 has 1" in text
            or "reduce_scatter: output has 2 elements but part 1 has 3" in text)


def _timeout_message(call) -> str:
    """The CollectiveTimeout text ``call`` raises (or a marker the assertions will reject)."""
    try:
        call()
    except CollectiveTimeout as exc:
        return str(exc)
    return "no timeout"


def _one_rank_absent() -> str:
    import datetime

    comm = Comm(timeout=datetime.timedelta(seconds=2))
    comm.broadcast(torch.zeros(1), src=0)  # both ranks in step so far
    if comm.rank == 1:
        time.sleep(4)  # never calls the all_reduce below
        return ""
    return _timeout_message(lambda: comm.all_reduce(torch.ones(1)))


def test_timeout_names_the_collective_and_the_missing_rank() -> None:
    start = time.monotonic()
    message = run_distributed(_one_rank_absent, 2, timeout=60)[0]
    assert time.monotonic() - start < 30
    assert message.startswith("all_reduce (call #2 on group 'world', ranks [0, 1]) did not complete within 2s")
    assert "ranks that did not arrive: [1] (rank 1 not waiting in any collective: busy or dead)" in message


def test_comm_requires_a_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is up in the test process")
    with pytest.raises(RuntimeError, match="call zerospeed.init_distributed"):
        Comm()


def _rank_stuck_in_an_earlier_collective() -> str:
    import datetime

    comm = Comm(timeout=datetime.timedelta(seconds=3))
    if comm.rank == 2:  # waits in a broadcast nobody else joins, long enough to announce itself
        try:
            comm.broadcast(torch.zeros(1), src=2)
        except CollectiveTimeout:
            pass
        return ""
    return _timeout_message(lambda: comm.all_reduce(torch.ones(1)))


def test_timeout_tells_where_a_stuck_rank_waits() -> None:
    messages = run_distributed(_rank_stuck_in_an_earlier_collective, 3, timeout=60)
    for message in messages[:2]:
        assert "all_reduce (call #1 on group 'world', ranks [0, 1, 2]) did not complete within 3s" in message
        assert "ranks that did not arrive: [2] (rank 2 last seen waiting in #1 broadcast)" in message


def _short_timeout(which: str) -> str:
    """One timed-out call per run: after a timeout gloo closes the pair, so the group is spent."""
    import datetime

    comm = Comm(timeout=datetime.timedelta(seconds=0.3 if which == "all_reduce" else 1))
    if comm.rank == 1:
        time.sleep(3)
        return ""
    start = time.monotonic()
    try:
        if which == "all_reduce":
            comm.all_reduce(torch.ones(1))
        else:
            comm.recv(torch.empty(1), src=1)
    except CollectiveTimeout as exc:
        return f"{time.monotonic() - start:.1f}|{exc}"
    return "0|no timeout"


def test_a_timeout_shorter_than_the_patience_still_fires() -> None:
    elapsed, message = run_distributed(_short_timeout, 2, "all_reduce", timeout=60)[0].split("|", 1)
    assert float(elapsed) < 2.0
    assert message.startswith("all_reduce (call #1 on group 'world', ranks [0, 1]) did not complete within 0.3s")


def test_point_to_point_timeout_names_the_peer() -> None:
    elapsed, message = run_distributed(_short_timeout, 2, "recv", timeout=60)[0].split("|", 1)
    assert float(elapsed) < 4.0
    assert message.startswith("recv from rank 1 (point-to-point on group 'world', ranks [0, 1]) "
                              "did not complete within 1s")


def _comm_outlives_its_group() -> str:
    from zerospeed.distributed import shutdown_distributed

    comm = Comm()
    shutdown_distributed()
    try:
        comm.barrier()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_comm_does_not_keep_a_destroyed_group_alive() -> None:
    assert run_distributed(_comm_outlives_its_group, 2)[0] == (
        "the process group of Comm 'world' was destroyed; build a new Comm after init_distributed()")


def _slow_sender() -> list[float]:
    comm = Comm()
    box = torch.zeros(3)
    if comm.rank == 0:
        time.sleep(1.5)  # longer than the 0.5 s patience of collectives
        comm.send(torch.tensor([1.0, 2.0, 3.0]), dst=1)
    else:
        comm.recv(box, src=0)
    all_ = torch.full((1,), float(comm.rank))
    if comm.rank == 0:
        time.sleep(1.5)
    comm.all_reduce(all_)  # rank 1 waits past the patience, announces itself, then completes normally
    return box.tolist() + all_.tolist()


def test_slow_peers_are_not_mistaken_for_timeouts() -> None:
    assert run_distributed(_slow_sender, 2)[1] == [1.0, 2.0, 3.0, 1.0]
