"""The error-compensated 1-bit all-reduce of 1-bit Adam (Tang et al., 2021), with DeepSpeed's math.

Each call moves about 1/32 of what an fp32 all-reduce moves: every rank sends the signs of its
buffer (one bit per element) and one scale, in two phases, and keeps what the compression lost
in two error buffers so that it is added back next call (the "error feedback" that makes 1-bit
Adam converge like Adam):

- worker (every rank, whole buffer): ``x = buffer + worker_error``; ``scale = ||x||_2 / sqrt(n)``;
  ``sign(x)`` is +1 for ``x >= 0`` (zero and NaN map to +1) and -1 otherwise;
  ``worker_error = x - scale * sign(x)``. The buffer is split into ``world`` equal chunks and
  chunk j's packed signs go to rank j (all_to_all), this rank's scale to every rank.
- server (rank j, chunk j): ``y = sum_i sign_i * (scale_i * (1/world)) + server_error``, summed
  in rank order (DeepSpeed scales each term before summing); ``server_scale = ||y|| / sqrt(chunk)``;
  ``server_error = y - server_scale * sign(y)``; then every rank gathers every chunk's signs and
  scale (all_gather) and chunk j of the result is ``server_scale_j * sign(y_j)``.

The two phases are public apart (:func:`compress_to_servers`, :func:`gather_from_servers`) so a
sharded optimizer (ZeRO 1-2) can stop after phase 1, which leaves each rank its own chunk of the
result. Each phase is one collective: a chunk's scale travels as 4 bytes after its packed signs
(DeepSpeed sends the scales in a second collective; the bytes on the wire are the same, the
round trips half). Signs are packed 8 per byte, most significant bit first (as
``numpy.packbits``), bit 1 meaning +1.

Buffers are 1-D fp32 of ``padded_size(numel, world)`` elements (a multiple of ``world * 8``, so
every chunk packs into whole bytes); ``worker_error`` has the buffer's length, ``server_error``
one chunk's. Every rank must pass the same sizes (they cannot be checked without a collective).
All communication goes through :class:`~zerospeed.distributed.comm.Comm`, so the bytes show in
``comm.stats``. :func:`simulate_compressed_allreduce` computes the same results for all ranks in
one process, for tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from zerospeed.distributed.comm import Comm

BITS_PER_BYTE = 8
_SCALE_BYTES = 4  # one fp32 scale, sent as raw bytes after a chunk's packed signs


def padded_size(numel: int, world_size: int) -> int:
    """The smallest length >= ``numel`` that splits into ``world_size`` chunks of whole bytes of signs.

    That is the next multiple of ``world_size * 8``. (DeepSpeed's OnebitAdam pads to a multiple of
    ``world_size * lcm(world_size, 8)``, the same when ``world_size`` divides 8.)
    """
    if numel < 0:
        raise ValueError(f"numel={numel} must be >= 0")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    unit = world_size * BITS_PER_BYTE
    return -(-numel // unit) * unit


def _nonnegative(values: torch.Tensor) -> torch.Tensor:
    """The sign bits: True where the sign is +1 (``x >= 0``, and NaN, as DeepSpeed's sign does)."""
    return torch.logical_not(values < 0)


# Multiplying 8 bytes holding 0/1 (read as one little-endian int64) by this constant gathers them into
# the top byte, the first byte as the most significant bit: bit k of the product's top byte comes only
# from byte 7 - k (the other partial products land on distinct lower bits, so nothing carries in).
_GATHER_BITS = 0x8040201008040201 - (1 << 64)  # as a signed int64


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Bool bits -> uint8, 8 per byte, MSB first; the last byte is padded with 0 bits."""
    assert bits.dtype == torch.bool, bits.dtype
    flat = bits.reshape(-1)
    pad = -flat.numel() % BITS_PER_BYTE
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    words = flat.view(torch.uint8)  # a bool is one byte holding 0 or 1
    if words.storage_offset() % BITS_PER_BYTE == 0:  # 8 bytes at a time: one multiply per output byte
        gathered = words.view(torch.int64) * _GATHER_BITS
        return torch.bitwise_right_shift(gathered, 56).to(torch.uint8)  # the low byte of the shift
    columns = words.view(-1, BITS_PER_BYTE)
    packed = columns[:, 0] << (BITS_PER_BYTE - 1)
    for k in range(1, BITS_PER_BYTE):
        packed.bitwise_or_(columns[:, k] << (BITS_PER_BYTE - 1 - k))
    return packed


def _sign_table(device: torch.device) -> torch.Tensor:
    """Row b: the 8 signs (±1.0, MSB first) that packed byte b stands for."""
    codes = torch.arange(256, dtype=torch.int64, device=device)
    shifts = torch.arange(BITS_PER_BYTE - 1, -1, -1, dtype=torch.int64, device=device)
    return ((codes[:, None] >> shifts) & 1).to(torch.float32).mul_(2).sub_(1)


def _decompress(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[rows, bytes]`` packed signs and ``[rows, 1]`` magnitudes -> ``[rows, 8 * bytes]`` values
    ``±magnitude``, exactly (one table lookup per byte: a row of the sign table times its magnitude)."""
    rows = packed.shape[0]
    table = (_sign_table(packed.device)[None] * scales.reshape(rows, 1, 1)).reshape(rows * 256, BITS_PER_BYTE)
    index = packed.to(torch.int64)
    if rows > 1:
        index += torch.arange(0, rows * 256, 256, dtype=torch.int64, device=packed.device)[:, None]
    return torch.embedding(table, index).reshape(rows, -1)


def _unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """uint8 -> bool bits, MSB first: the last dim grows 8 times (a 0-d input gives 8 bits)."""
    flat = packed.reshape(-1)
    columns = torch.empty(flat.numel(), BITS_PER_BYTE, dtype=torch.uint8, device=packed.device)
    for k in range(BITS_PER_BYTE):
        torch.bitwise_and(flat >> (BITS_PER_BYTE - 1 - k), 1, out=columns[:, k])
    bits = columns.view(torch.bool)  # every byte is 0 or 1
    return bits.reshape(*packed.shape[:-1], -1) if packed.dim() else bits.reshape(-1)


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """The signs of ``values`` (flattened), 8 per uint8 byte, MSB first, bit 1 for +1 (``x >= 0``).

    A length that is not a multiple of 8 leaves the last byte's low bits 0 (as ``numpy.packbits``).
    """
    if values.is_complex():
        raise TypeError(f"pack_signs: values must be real, got {values.dtype}")
    return _pack_bits(_nonnegative(values))


def unpack_signs(packed: torch.Tensor, numel: int | None = None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """±1 values (in ``dtype``) from :func:`pack_signs` output; ``numel`` drops the padding bits.

    ``numel`` defaults to ``8 * packed.numel()``.
    """
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_signs: packed must be uint8 (pack_signs output), got {packed.dtype}")
    capacity = packed.numel() * BITS_PER_BYTE
    numel = capacity if numel is None else numel
    if not capacity - BITS_PER_BYTE < numel <= capacity:
        raise ValueError(f"unpack_signs: numel={numel} does not fit {packed.numel()} packed bytes "
                         f"(expected {max(capacity - BITS_PER_BYTE + 1, 0)}..{capacity})")
    bits = _unpack_bits(packed.reshape(-1))[:numel]
    return bits.view(torch.uint8).to(dtype).mul_(2).sub_(1)


@dataclass(frozen=True, eq=False)  # tensors: no elementwise ==
class ServerChunk:
    """This rank's chunk after phase 1: what every rank gets for chunk ``comm.rank`` in phase 2.

    ``signs`` are the chunk's packed sign bits (uint8, ``chunk / 8`` bytes), ``scale`` the server
    scale (0-d fp32) and ``values`` the decompressed chunk, ``scale * sign`` (fp32, ``chunk``
    elements), for a sharded caller that needs only its own part.
    """

    signs: torch.Tensor
    scale: torch.Tensor
    values: torch.Tensor

    @property
    def numel(self) -> int:
        return self.values.numel()


def _check_fp32_vector(name: str, tensor: torch.Tensor, numel: int, device: torch.device, why: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != torch.float32:
        raise TypeError(f"{name} is {tensor.dtype}; the 1-bit all-reduce works on float32 "
                        f"(pass {name}.float() and copy the result back)")
    if tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape {tuple(tensor.shape)}"
                         f"{'' if tensor.is_contiguous() else ' (not contiguous)'}; pass {name}.reshape(-1)")
    if tensor.numel() != numel:
        raise ValueError(f"{name} has {tensor.numel()} elements but {why} needs {numel}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but the buffer is on {device}")


def _check_buffers(world_size: int, buffer: torch.Tensor, worker_error: torch.Tensor,
                   server_error: torch.Tensor) -> int:
    """Validate the three buffers; return the chunk length (buffer length / world size)."""
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"buffer must be a torch.Tensor, got {type(buffer).__name__}")
    n = buffer.numel()
    _check_fp32_vector("buffer", buffer, n, buffer.device, "itself")
    unit = world_size * BITS_PER_BYTE
    if n % unit:
        raise ValueError(
            f"buffer has {n} elements, not a multiple of world_size * 8 = {unit}; pad it with zeros to "
            f"padded_size({n}, {world_size}) = {padded_size(n, world_size)} (worker_error the same, "
            f"server_error {padded_size(n, world_size) // world_size})")
    chunk = n // world_size
    _check_fp32_vector("worker_error", worker_error, n, buffer.device, "a buffer of that length")
    _check_fp32_vector("server_error", server_error, chunk, buffer.device,
                       f"one chunk (buffer {n} / world size {world_size})")
    return chunk


def _scale(values: torch.Tensor) -> torch.Tensor:
    """The scale that makes ``scale * sign`` keep ``values``' root mean square: ``||x|| / sqrt(n)``."""
    return torch.linalg.vector_norm(values) / math.sqrt(values.numel())


def _with_scale(signs: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One message: the packed signs, then the fp32 scale's 4 bytes."""
    raw = scale.detach().reshape(1).to(torch.float32).view(torch.uint8)
    return torch.cat([signs, raw])


def _split_scale(messages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of :func:`_with_scale` messages -> (packed signs ``[W, bytes]``, scales ``[W, 1]``)."""
    raw = torch.empty(messages.shape[0], _SCALE_BYTES, dtype=torch.uint8, device=messages.device)
    scales = raw.copy_(messages[:, -_SCALE_BYTES:]).view(torch.float32)  # a fresh buffer: aligned for fp32
    return messages[:, :-_SCALE_BYTES], scales


def compress_to_servers(comm: Comm, buffer: torch.Tensor, worker_error: torch.Tensor,
                        server_error: torch.Tensor) -> ServerChunk:
    """Phase 1: compress ``buffer`` with the worker error, send chunk j's signs to rank j, and
    reduce this rank's chunk with the server error.

    Updates ``worker_error`` and ``server_error`` in place and leaves ``buffer`` unchanged. One
    all_to_all of ``n / 8 + 4 * world`` bytes. Returns this rank's chunk of the result.
    """
    world = comm.world_size
    chunk = _check_buffers(world, buffer, worker_error, server_error)
    if chunk == 0:  # every rank has the same (empty) sizes: nothing to send
        empty = buffer.new_empty(0)
        return ServerChunk(empty.to(torch.uint8), buffer.new_zeros(()), empty)
    compensated = worker_error.add_(buffer)  # the error buffer is the workspace: no extra n floats
    scale = _scale(compensated)
    packed = _pack_bits(_nonnegative(compensated)).view(world, chunk // BITS_PER_BYTE)
    # scale * sign(x), read back from the packed signs (a table lookup per byte: several times faster
    # on CPU than copysign with a 0-d scale, and the same ±scale values)
    worker_error.sub_(_decompress(packed, scale.reshape(1, 1).expand(world, 1)).view(-1))
    raw_scale = scale.reshape(1).view(torch.uint8)
    send = torch.cat([packed, raw_scale.expand(world, _SCALE_BYTES)], dim=1)
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send)
    signs, scales = _split_scale(recv)
    shares = scales * (1.0 / world)  # DeepSpeed's order: each worker scale over world, then summed
    terms = _decompress(signs, shares)
    total = terms[0].clone()
    for i in range(1, world):
        total.add_(terms[i])
    compensated_server = server_error.add_(total)
    server_scale = _scale(compensated_server)
    server_signs = _pack_bits(_nonnegative(compensated_server))
    values = _decompress(server_signs[None], server_scale.reshape(1, 1))[0]
    server_error.sub_(values)
    return ServerChunk(signs=server_signs, scale=server_scale, values=values)


def gather_from_servers(comm: Comm, chunk: ServerChunk, out: torch.Tensor) -> torch.Tensor:
    """Phase 2: all-gather every rank's :class:`ServerChunk` (signs and scale) and write the
    decompressed result, chunk after chunk, into ``out`` (1-D fp32 of ``world * chunk.numel``).

    One all_gather of ``chunk / 8 + 4`` bytes per rank. Returns ``out``.
    """
    world = comm.world_size
    _check_fp32_vector("out", out, world * chunk.numel, chunk.values.device,
                       f"{world} chunks of {chunk.numel}")
    if chunk.numel % BITS_PER_BYTE or chunk.signs.numel() * BITS_PER_BYTE != chunk.numel:
        raise ValueError(f"chunk has {chunk.numel} values but {chunk.signs.numel()} packed sign bytes; "
                         f"pass the ServerChunk compress_to_servers returned")
    if chunk.numel == 0:
        return out
    send = _with_scale(chunk.signs, chunk.scale)
    recv = send.new_empty(world, send.numel())
    comm.all_gather(recv, send)
    signs, scales = _split_scale(recv)
    out.view(world, chunk.numel).copy_(_decompress(signs, scales))
    return out


def compressed_allreduce(comm: Comm, buffer: torch.Tensor, worker_error: torch.Tensor,
                         server_error: torch.Tensor) -> torch.Tensor:
    """The 1-bit all-reduce (mean over ranks, compressed) of ``buffer``, written into ``buffer``.

    Both phases, two collectives. ``worker_error`` (buffer's length) and ``server_error`` (one
    chunk: buffer length / world size) carry what compression lost to the next call; start them
    at zero. Returns ``buffer``. An empty buffer communicates nothing.
    """
    chunk = compress_to_servers(comm, buffer, worker_error, server_error)
    return gather_from_servers(comm, chunk, buffer)


class SimulatedAllReduce(NamedTuple):
    """Per rank: the result, the new worker error and the new server error."""

    results: list[torch.Tensor]
    worker_errors: list[torch.Tensor]
    server_errors: list[torch.Tensor]


def simulate_compressed_allreduce(buffers: Sequence[torch.Tensor], worker_errors: Sequence[torch.Tensor],
                                  server_errors: Sequence[torch.Tensor]) -> SimulatedAllReduce:
    """What :func:`compressed_allreduce` gives on ``len(buffers)`` ranks, in one process.

    Plain ±1 floats, no packing and no communication, so tests can check the real thing against
    it exactly (same torch norm, same summation order). Inputs are not modified.
    """
    world = len(buffers)
    if world == 0 or len(worker_errors) != world or len(server_errors) != world:
        raise ValueError(f"need one buffer, worker error and server error per rank; got {len(buffers)}, "
                         f"{len(worker_errors)} and {len(server_errors)}")
    chunk = _check_buffers(world, buffers[0], worker_errors[0], server_errors[0])
    for r in range(world):
        _check_buffers(world, buffers[r], worker_errors[r], server_errors[r])
        if buffers[r].numel() != buffers[0].numel():
            raise ValueError(f"rank {r}'s buffer has {buffers[r].numel()} elements, rank 0's {buffers[0].numel()}")
    if chunk == 0:
        return SimulatedAllReduce([b.clone() for b in buffers], [e.clone() for e in worker_errors],
                                  [e.clone() for e in server_errors])

    def sign(x: torch.Tensor) -> torch.Tensor:
        return torch.where(x < 0, -1.0, 1.0)

    worker_signs, worker_scales, new_worker_errors = [], [], []
    for buffer, error in zip(buffers, worker_errors):
        x = buffer + error
        scale = _scale(x)
        worker_signs.append(sign(x))
        worker_scales.append(scale)
        new_worker_errors.append(x - scale * sign(x))
    pieces, new_server_errors = [], []
    for j in range(world):
        part = slice(j * chunk, (j + 1) * chunk)
        total = worker_signs[0][part] * (worker_scales[0] * (1.0 / world))
        for i in range(1, world):
            total = total + worker_signs[i][part] * (worker_scales[i] * (1.0 / world))
        y = total + server_errors[j]
        server_scale = _scale(y)
        pieces.append(server_scale * sign(y))
        new_server_errors.append(y - server_scale * sign(y))
    result = torch.cat(pieces)
    return SimulatedAllReduce([result.clone() for _ in range(world)], new_worker_errors, new_server_errors)
