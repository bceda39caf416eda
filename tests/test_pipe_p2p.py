"""Point-to-point transfers between pipeline stages: the header codec (pure) and real gloo round trips."""

from __future__ import annotations

import datetime
import time

import pytest
import torch

from zerospeed.distributed.comm import CollectiveTimeout, Comm
from zerospeed.pipe.p2p import HeaderMismatch, StageLink, decode_header, encode_header
from zerospeed.testing.dist import run_distributed


# -- the header (pure) -------------------------------------------------------------------------------
def test_header_round_trips_structure_dtypes_shapes_and_grad_flags() -> None:
    a = torch.zeros(2, 3, requires_grad=True)
    b = torch.zeros(4, dtype=torch.int64)
    c = torch.zeros((), dtype=torch.bfloat16)
    tokens, tensors = encode_header("gradient", 7, (a, None, [b, (c,)]))
    assert tensors == [a, b, c]
    kind, micro, skeleton, specs = decode_header(tokens)
    assert (kind, micro, skeleton) == ("gradient", 7, (0, None, [1, (2,)]))
    assert specs == [(torch.float32, (2, 3), True), (torch.int64, (4,), False), (torch.bfloat16, (), False)]


def test_header_refuses_what_it_cannot_carry() -> None:
    with pytest.raises(TypeError, match=r"the activation of micro-batch 2\[1\] is a int; .*wrap numbers"):
        encode_header("activation", 2, (torch.ones(1), 3))
    with pytest.raises(HeaderMismatch, match="not a pipeline header"):
        decode_header([1, 2, 3, 4])
    tokens, _ = encode_header("activation", 0, torch.ones(1))
    with pytest.raises(HeaderMismatch, match="tokens left over"):
        decode_header([*tokens, 2])


# -- real transfers ----------------------------------------------------------------------------------
def _payload(micro: int, kind: str) -> tuple:
    """A deterministic payload whose shapes change with the micro-batch."""
    g = torch.Generator().manual_seed(micro * 10 + (kind == "gradient"))
    rows = 2 + micro
    hidden = torch.randn(rows, 3, generator=g)
    if kind == "gradient":
        return (hidden,)
    mask = None if micro % 2 else torch.randint(0, 2, (rows,), generator=g).bool()
    return (hidden.requires_grad_(), torch.randn(rows, generator=g).to(torch.bfloat16),
            torch.arange(rows * micro, dtype=torch.int64).view(rows, micro), mask)


def _long_payload() -> tuple:
    """Eight tensors of mixed dtypes and odd sizes: a header longer than one frame, and a body whose
    tensors need aligned offsets."""
    g = torch.Generator().manual_seed(5)
    dtypes = (torch.float64, torch.int16, torch.bool, torch.bfloat16, torch.float32, torch.uint8, torch.complex64,
              torch.int32)
    return tuple((torch.randn(3, i + 1, generator=g) * 50).to(dtype) for i, dtype in enumerate(dtypes))


def _describe(payload: object) -> object:
    """Plain Python values (bit-exact: floats as their raw ints) for comparing across processes."""
    if payload is None:
        return None
    if isinstance(payload, torch.Tensor):
        raw = payload.detach().reshape(-1)
        bits = raw.view(torch.int16) if raw.element_size() == 2 and raw.is_floating_point() else \
            raw.view(torch.int32) if raw.dtype == torch.float32 else raw
        return (str(payload.dtype), tuple(payload.shape), payload.requires_grad, bits.tolist())
    assert isinstance(payload, (tuple, list))
    return (type(payload).__name__, [_describe(item) for item in payload])


def _two_stages() -> dict:
    comm = Comm(name="pipe")
    link = StageLink(comm, comm.rank)
    got: dict = {}
    if comm.rank == 0:
        # a lone tensor, then a nested list, on the activation channel
        link.send("activation", 100, torch.arange(6.0).view(2, 3), 1)
        link.send("activation", 101, [torch.ones(0, 4), (torch.full((2,), 7, dtype=torch.int32),)], 1)
        link.send("activation", 102, _long_payload(), 1)
        # 1F1B-like: warm up with two forwards, then one forward / one backward, then drain
        for micro in (0, 1):
            link.send("activation", micro, _payload(micro, "activation"), 1)
        for micro in (2, 3):
            got[f"grad{micro - 2}"] = _describe(link.recv("gradient", micro - 2, 1))
            link.send("activation", micro, _payload(micro, "activation"), 1)
        for micro in (2, 3):
            got[f"grad{micro}"] = _describe(link.recv("gradient", micro, 1))
        # the same layout three times (one message each after the first), then a new shape
        for micro, rows in ((20, 2), (21, 2), (22, 2), (23, 4)):
            link.send("activation", micro, torch.full((rows, 3), float(micro)), 1)
        link.wait_sends()
        got["pending"] = link.pending_sends
    else:
        got["lone"] = _describe(link.recv("activation", 100, 0))
        got["nested"] = _describe(link.recv("activation", 101, 0))
        got["long"] = _describe(link.recv("activation", 102, 0))
        for micro in range(4):
            received = link.recv("activation", micro, 0)
            got[f"act{micro}"] = _describe(received)
            # the received activation is a leaf this stage can backprop into
            assert isinstance(received, tuple) and isinstance(received[0], torch.Tensor)
            (received[0] * 2).sum().backward()
            got[f"leaf_grad{micro}"] = received[0].grad is not None and bool((received[0].grad == 2).all())
            link.send("gradient", micro, _payload(micro, "gradient"), 0)
        for micro in (20, 21, 22, 23):
            got[f"same{micro}"] = _describe(link.recv("activation", micro, 0))
        # out of order on purpose: the header names what actually arrived
        link.send("gradient", 9, torch.ones(1), 0)
        link.wait_sends()
    if comm.rank == 0:
        try:
            link.recv("gradient", 8, 1)
        except HeaderMismatch as exc:
            got["mismatch"] = str(exc)
    got["stats"] = dict(comm.stats.calls)
    return got


@pytest.mark.spawns
def test_transfers_between_two_stages_are_bit_exact_and_fifo_per_channel() -> None:
    first, second = run_distributed(_two_stages, 2, timeout=60)
    assert second["lone"] == _describe(torch.arange(6.0).view(2, 3))
    assert second["nested"] == _describe([torch.ones(0, 4), (torch.full((2,), 7, dtype=torch.int32),)])
    assert second["long"] == _describe(_long_payload())
    for micro in range(4):
        assert second[f"act{micro}"] == _describe(_payload(micro, "activation"))
        assert second[f"leaf_grad{micro}"] is True
        assert first[f"grad{micro}"] == _describe(_payload(micro, "gradient"))
    assert first["pending"] == 0
    assert first["mismatch"] == ("pipeline stage 0 expected the gradient of micro-batch 8 from stage 1 but received "
                                 "the gradient of micro-batch 9; the two stages' schedules post their sends and "
                                 "receives on this channel in different orders")
    for micro, rows in ((20, 2), (21, 2), (22, 2), (23, 4)):
        assert second[f"same{micro}"] == _describe(torch.full((rows, 3), float(micro)))
    # a transfer in a new layout is its header frame and one body of all its non-empty tensors (the long
    # header spills into a second message); one in its channel's previous layout is a single message.
    # Sent: lone, nested, long, four activations of changing shapes, then the same layout thrice and a new one
    assert first["stats"]["send"] == 2 + 2 + 3 + 4 * 2 + (2 + 1 + 1) + 2
    assert second["stats"]["send"] == 4 * 2 + 2
    assert second["stats"]["recv"] == first["stats"]["send"]


def _both_directions() -> list:
    """Each stage sends the other activations in its own layout (interleaved at pp=2 does): the two
    directions of one (peer, kind) keep separate layouts, whether receives are announced or not."""
    comm = Comm(name="pipe")
    link = StageLink(comm, comm.rank)
    peer = 1 - comm.rank
    link.expect("activation", peer, 3)
    got = []
    for micro in range(4):
        rows = 2 + comm.rank * 5
        link.send("activation", micro, torch.full((rows, 3 + micro // 2), float(10 * comm.rank + micro)), peer)
        got.append(_describe(link.recv("activation", micro, peer)))
    link.wait_sends()
    return got


@pytest.mark.spawns
def test_both_directions_of_a_channel_keep_their_own_layout() -> None:
    first, second = run_distributed(_both_directions, 2, timeout=60)
    assert first == [_describe(torch.full((7, 3 + m // 2), float(10 + m))) for m in range(4)]
    assert second == [_describe(torch.full((2, 3 + m // 2), float(m))) for m in range(4)]


def _never_sent() -> str:
    comm = Comm(name="pipe", timeout=datetime.timedelta(seconds=1))
    link = StageLink(comm, comm.rank)
    if comm.rank == 0:
        link.send("activation", 2, torch.ones(2), 1)
        time.sleep(2.5)  # never sends micro-batch 3; outlives stage 1's timeout, then leaves
        return ""
    link.recv("activation", 2, 0)
    start = time.monotonic()
    try:
        link.recv("activation", 3, 0)
    except CollectiveTimeout as exc:
        return f"{time.monotonic() - start:.1f}|{exc}"
    return "0|no timeout"


@pytest.mark.spawns
def test_a_receive_that_times_out_names_stage_peer_kind_and_micro_batch() -> None:
    elapsed, message = run_distributed(_never_sent, 2, timeout=60)[1].split("|", 1)
    assert float(elapsed) < 2.5
    assert message.startswith("pipeline stage 1 waited 1 s for the activation of micro-batch 3 from stage 0; "
                              "stage 0 did not post the matching transfer in time")
    assert "Cause: recv from rank 0 (tag 23041) (point-to-point on group 'pipe'" in message


def test_a_link_checks_its_stage_kind_and_peers() -> None:
    class _FakeComm:
        rank, world_size, name = 1, 3, "pipe"

    with pytest.raises(ValueError, match=r"stage=0 but this process is rank 1 of group 'pipe'"):
        StageLink(_FakeComm(), 0)  # type: ignore[arg-type]
    link = StageLink(_FakeComm(), 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dst_stage=1 is not another stage of this 3-stage pipeline"):
        link.send("activation", 0, torch.ones(1), 1)
    with pytest.raises(ValueError, match="kind='grad'"):
        link.recv("grad", 0, 0)  # type: ignore[arg-type]
