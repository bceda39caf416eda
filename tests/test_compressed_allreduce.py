"""The 1-bit compressed all-reduce (1-bit Adam): sign packing, exact agreement with the one-process
simulation on 1-4 gloo ranks over consecutive calls (the error buffers carry over), DeepSpeed's
``CompressedBackend`` conventions, and the bytes it saves on the wire."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from zerospeed.distributed import Comm, ParallelDims
from zerospeed.distributed.compressed import (
    compress_to_servers,
    compressed_allreduce,
    gather_from_servers,
    pack_signs,
    padded_size,
    simulate_compressed_allreduce,
    unpack_signs,
)
from zerospeed.testing import run_distributed

CALLS = 4  # consecutive calls per test: the worker and server errors of one feed the next


# -- packing and padding (one process) ----------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 1000])
def test_pack_unpack_round_trip_matches_numpy_packbits(n: int) -> None:
    values = torch.randn(n, generator=torch.Generator().manual_seed(n))
    values[::5] = 0.0  # zero maps to +1
    if n > 3:
        values[3] = -0.0  # so does negative zero (DeepSpeed: sign(-0.0) + 1 is truthy)
    packed = pack_signs(values)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n / 8)
    assert np.array_equal(packed.numpy(), np.packbits(values.numpy() >= 0))  # MSB first, 1 = +1
    signs = unpack_signs(packed, n)
    assert signs.dtype == torch.float32 and signs.shape == (n,)
    assert torch.equal(signs, torch.where(values < 0, -1.0, 1.0))
    assert unpack_signs(packed).numel() == 8 * packed.numel()  # padding bits included by default


def test_pack_nan_is_plus_one_and_bytes_are_msb_first() -> None:
    values = torch.tensor([float("nan"), -1.0, 2.0, -3.0, 0.0, -0.0, -5.0, 6.0, -7.0])
    packed = pack_signs(values)
    assert packed.tolist() == [0b10101101, 0b00000000]
    assert unpack_signs(packed, 9).tolist() == [1, -1, 1, -1, 1, 1, -1, 1, -1]
    assert unpack_signs(packed, 16, dtype=torch.float64).dtype == torch.float64


def test_unpack_refuses_a_length_that_does_not_fit() -> None:
    with pytest.raises(ValueError, match="numel=17 does not fit 2 packed bytes"):
        unpack_signs(torch.zeros(2, dtype=torch.uint8), 17)
    with pytest.raises(ValueError, match="numel=8 does not fit 2 packed bytes"):
        unpack_signs(torch.zeros(2, dtype=torch.uint8), 8)
    with pytest.raises(TypeError, match="must be uint8"):
        unpack_signs(torch.zeros(2), 8)


def test_padded_size() -> None:
    assert [padded_size(n, 2) for n in (0, 1, 16, 17, 33)] == [0, 16, 16, 32, 48]
    assert [padded_size(n, 3) for n in (1, 24, 25)] == [24, 24, 48]
    assert padded_size(1_000_000, 4) == 1_000_000 and padded_size(1_000_001, 4) == 1_000_032
    with pytest.raises(ValueError, match="world_size=0 must be >= 1"):
        padded_size(8, 0)
    with pytest.raises(ValueError, match="numel=-1 must be >= 0"):
        padded_size(-1, 2)


def test_simulation_keeps_its_inputs_and_the_errors_hold_what_compression_lost() -> None:
    g = torch.Generator().manual_seed(0)
    world, n = 2, 32
    buffers = [torch.randn(n, generator=g) for _ in range(world)]
    errors = [torch.zeros(n) for _ in range(world)]
    servers = [torch.zeros(n // world) for _ in range(world)]
    before = [b.clone() for b in buffers]
    out = simulate_compressed_allreduce(buffers, errors, servers)
    assert all(torch.equal(a, b) for a, b in zip(before, buffers)) and all(not e.any() for e in errors)
    # the result is one magnitude per chunk, and what the two levels lost is exactly in the errors
    for j in range(world):
        assert out.results[0][j * 16:(j + 1) * 16].abs().unique().numel() == 1
    for r in range(world):
        assert torch.equal(out.results[r], out.results[0])
        worker_scale = torch.linalg.vector_norm(buffers[r]) / math.sqrt(n)
        torch.testing.assert_close(buffers[r] - out.worker_errors[r],
                                   worker_scale * torch.where(buffers[r] < 0, -1.0, 1.0))
    with pytest.raises(ValueError, match="not a multiple of world_size \\* 8 = 16"):
        simulate_compressed_allreduce([torch.zeros(20)] * 2, [torch.zeros(20)] * 2, [torch.zeros(10)] * 2)


# -- on real ranks --------------------------------------------------------------------------------------
def _rank_data(call: int, rank: int, numel: int, padded: int) -> torch.Tensor:
    """What rank ``rank`` reduces in call ``call``: random, some exact zeros, zero padding at the end."""
    g = torch.Generator().manual_seed(1000 * call + rank)
    values = torch.randn(numel, generator=g) * (1.0 + call)
    values[rank::7] = 0.0
    return torch.cat([values, torch.zeros(padded - numel)])


def _against_simulation(numel: int) -> dict:
    comm = Comm()
    world, rank = comm.world_size, comm.rank
    padded = padded_size(numel, world)
    chunk = padded // world
    worker_error, server_error = torch.zeros(padded), torch.zeros(chunk)
    sim_workers = [torch.zeros(padded) for _ in range(world)]
    sim_servers = [torch.zeros(chunk) for _ in range(world)]
    checked = []
    for call in range(CALLS):
        buffers = [_rank_data(call, r, numel, padded) for r in range(world)]
        expected = simulate_compressed_allreduce(buffers, sim_workers, sim_servers)
        buffer = buffers[rank].clone()
        before = comm.stats.snapshot()
        if call % 2 == 0:
            assert compressed_allreduce(comm, buffer, worker_error, server_error) is buffer
        else:  # the two halves, as a sharded optimizer would call them
            mine = compress_to_servers(comm, buffer, worker_error, server_error)
            assert torch.equal(buffer, buffers[rank])  # phase 1 leaves the buffer alone
            assert torch.equal(mine.values, expected.results[rank][rank * chunk:(rank + 1) * chunk])
            assert mine.signs.numel() == chunk // 8 and mine.scale.shape == ()
            assert torch.equal(mine.values.abs(), mine.scale.expand(chunk))
            out = torch.full((padded,), float("nan"))
            assert gather_from_servers(comm, mine, out) is out
            buffer = out
        delta = comm.stats.since(before)
        assert torch.equal(buffer, expected.results[rank]), call
        assert torch.equal(worker_error, expected.worker_errors[rank]), call
        assert torch.equal(server_error, expected.server_errors[rank]), call
        # two collectives; each moves the packed signs plus one 4-byte scale per chunk message
        assert dict(delta.calls) == {"all_to_all": 1, "all_gather": 1}, delta
        assert dict(delta.bytes) == {"all_to_all": padded // 8 + 4 * world, "all_gather": padded // 8 + 4 * world}
        assert dict(delta.sent) == ({"all_to_all": (world - 1) * (chunk // 8 + 4),
                                     "all_gather": (world - 1) * (chunk // 8 + 4)} if world > 1 else {})
        sim_workers, sim_servers = expected.worker_errors, expected.server_errors
        checked.append(float(worker_error.abs().sum()))
    # the errors are not trivially zero: the comparison above checked real carried state
    assert all(c > 0 for c in checked)
    return {"result": buffer.tolist()[:4], "server_error": float(server_error.abs().sum())}


@pytest.mark.parametrize("world_size, numel", [(2, 1000), (3, 1001), (4, 4096)])
def test_equals_the_simulation_on_gloo_ranks(world_size: int, numel: int) -> None:
    results = run_distributed(_against_simulation, world_size, numel)
    assert all(r["result"] == results[0]["result"] for r in results)  # every rank holds the same result
    assert all(r["server_error"] > 0 for r in results)


def _one_rank() -> list[str]:
    comm = Comm()
    assert comm.world_size == 1
    padded = padded_size(50, 1)
    worker_error, server_error = torch.zeros(padded), torch.zeros(padded)
    worker_error[:8] = -0.0  # with a -0.0 buffer below, the compensated value is -0.0: its sign is +1
    sim_worker, sim_server = [worker_error.clone()], [torch.zeros(padded)]
    for call in range(CALLS):
        buffer = _rank_data(call, 0, 50, padded)
        if call == 0:
            buffer[:8] = -0.0
        buffer_in = buffer + sim_worker[0]
        expected = simulate_compressed_allreduce([buffer.clone()], sim_worker, sim_server)
        compressed_allreduce(comm, buffer, worker_error, server_error)
        assert torch.equal(buffer, expected.results[0])
        assert torch.equal(worker_error, expected.worker_errors[0])
        assert torch.equal(server_error, expected.server_errors[0])
        if call == 0:
            scale = torch.linalg.vector_norm(buffer_in) / math.sqrt(padded)
            assert torch.equal(worker_error[:8], -scale.expand(8))  # -0.0 - scale * (+1)
        sim_worker, sim_server = expected.worker_errors, expected.server_errors
    # one rank still compresses (the math of any world), and communicates nothing on the wire
    assert buffer.abs().unique().numel() == 1 and comm.stats.total_sent == 0
    # an empty buffer is a no-op without a collective
    calls = comm.stats.total_calls
    empty = torch.zeros(0)
    assert compressed_allreduce(comm, empty, torch.zeros(0), torch.zeros(0)) is empty
    assert comm.stats.total_calls == calls

    messages = []
    for call in (
        lambda: compressed_allreduce(comm, torch.zeros(12), torch.zeros(12), torch.zeros(12)),
        lambda: compressed_allreduce(comm, torch.zeros(16, dtype=torch.float64), torch.zeros(16), torch.zeros(16)),
        lambda: compressed_allreduce(comm, torch.zeros(16), torch.zeros(8), torch.zeros(16)),
        lambda: compressed_allreduce(comm, torch.zeros(16), torch.zeros(16), torch.zeros(8)),
        lambda: compressed_allreduce(comm, torch.zeros(2, 8), torch.zeros(16), torch.zeros(16)),
        lambda: compressed_allreduce(comm, torch.zeros(16), torch.zeros(16, dtype=torch.float16), torch.zeros(16)),
    ):
        try:
            call()
        except (TypeError, ValueError) as exc:
            messages.append(str(exc))
    assert comm.stats.total_calls == calls  # every misuse was refused before the network
    return messages


def test_one_rank_follows_the_math_and_bad_buffers_are_refused() -> None:
    messages = run_distributed(_one_rank, 1)[0]
    assert len(messages) == 6, messages
    assert "buffer has 12 elements, not a multiple of world_size * 8 = 8; pad it with zeros to " \
           "padded_size(12, 1) = 16" in messages[0]
    assert "buffer is torch.float64; the 1-bit all-reduce works on float32" in messages[1]
    assert "worker_error has 8 elements but a buffer of that length needs 16" in messages[2]
    assert "server_error has 8 elements but one chunk (buffer 16 / world size 1) needs 16" in messages[3]
    assert "buffer must be a contiguous 1-D tensor, got shape (2, 8); pass buffer.reshape(-1)" in messages[4]
    assert "worker_error is torch.float16" in messages[5]


# -- DeepSpeed's backend classes --------------------------------------------------------------------------
def _deepspeed_backend() -> dict:
    from zerospeed.runtime.comm.compressed import CompressedBackend
    from zerospeed.runtime.comm.mpi import MpiBackend
    from zerospeed.runtime.comm.nccl import NcclBackend

    mesh = ParallelDims(world_size=2).build()
    backend = NcclBackend(mesh)  # a Mesh lends its data-parallel Comm
    assert NcclBackend is CompressedBackend and backend.comm is mesh.dp
    assert (backend.size, backend.rank) == (2, mesh.dp.rank)
    rank = backend.rank
    shape, numel = (5, 7), 35
    padded = padded_size(numel, 2)
    worker_error, server_error = torch.zeros(padded), torch.zeros(padded // 2)
    sim_worker, sim_server = [torch.zeros(padded) for _ in range(2)], [torch.zeros(padded // 2) for _ in range(2)]
    for call in range(3):  # DeepSpeed's convention: any shape, shorter than the padded errors
        values = [_rank_data(call, r, numel, numel).view(shape) for r in range(2)]
        expected = simulate_compressed_allreduce([torch.cat([v.reshape(-1), torch.zeros(padded - numel)])
                                                  for v in values], sim_worker, sim_server)
        buffer = values[rank].clone()
        out = backend.compressed_allreduce(buffer, worker_error, server_error, local_rank=rank)
        assert out is buffer and out.shape == shape
        assert torch.equal(out.reshape(-1), expected.results[rank][:numel])
        assert torch.equal(worker_error, expected.worker_errors[rank])
        assert torch.equal(server_error, expected.server_errors[rank])
        sim_worker, sim_server = expected.worker_errors, expected.server_errors
    assert mesh.dp.stats.calls["all_to_all"] == 3  # counted on the mesh's data-parallel Comm
    # an empty buffer: the errors start over, nothing is sent (DeepSpeed's check_and_handle_empty_buffer)
    empty = torch.zeros(0, 3)
    assert backend.compressed_allreduce(empty, worker_error, server_error, rank) is empty
    assert not worker_error.any() and not server_error.any()
    world = MpiBackend(True)
    assert isinstance(world, CompressedBackend) and world.cuda_aware and world.size == 2
    messages = []
    for call in (lambda: world.compressed_allreduce(torch.zeros(40), torch.zeros(32), torch.zeros(16), 0),
                 lambda: world.compressed_allreduce(torch.zeros(4).half(), torch.zeros(16), torch.zeros(8), 0),
                 lambda: CompressedBackend(object())):
        try:
            call()
        except (TypeError, ValueError) as exc:
            messages.append(str(exc))
    return {"messages": messages}


def test_deepspeed_backend_classes_on_two_ranks() -> None:
    messages = run_distributed(_deepspeed_backend, 2)[0]["messages"]
    assert "worker_error has 32 elements, fewer than buffer_m's 40; size it padded_size(40, 2) = 48" in messages[0]
    assert "buffer_m is torch.float16" in messages[1]
    assert "has no get_data_parallel_group()" in messages[2]


# -- the saving -------------------------------------------------------------------------------------------
MOMENTUM = 1_000_000


def _sent_bytes() -> dict:
    comm = Comm()
    padded = padded_size(MOMENTUM, comm.world_size)
    momentum = torch.randn(padded, generator=torch.Generator().manual_seed(comm.rank))
    before = comm.stats.snapshot()
    comm.all_reduce(momentum.clone())
    full = comm.stats.since(before).total_sent
    before = comm.stats.snapshot()
    compressed_allreduce(comm, momentum, torch.zeros(padded), torch.zeros(padded // comm.world_size))
    return {"fp32": full, "compressed": comm.stats.since(before).total_sent}


@pytest.mark.parametrize("world_size", [2, 4])
def test_compressed_sends_under_a_twentieth_of_fp32(world_size: int) -> None:
    sent = run_distributed(_sent_bytes, world_size)
    for rank in sent:
        print(f"W={world_size}: 1M-element fp32 momentum, bytes sent per rank: all_reduce {rank['fp32']}, "
              f"compressed {rank['compressed']} ({rank['fp32'] / rank['compressed']:.1f}x less)")
        assert rank["fp32"] == 2 * (world_size - 1) * 4 * MOMENTUM // world_size
        assert rank["compressed"] * 20 <= rank["fp32"]
