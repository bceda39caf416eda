"""Group-wise symmetric int8 weights and the int8 x float matmul that reads them.

A weight ``W[N, K]`` (row n = output feature n) is cut, row by row, into groups of ``group_size``
consecutive input elements (the last group of a row is shorter when ``group_size`` does not divide
``K``; ``group_size >= K`` is one scale per row). Each group keeps ``scale = max|w| / 127`` (fp32) and
``q = round(w / scale)`` (round to nearest, ties to even; int8 in [-127, 127]; an all-zero group has
scale 0 and q 0). The dequantized weight is ``q * scale`` rounded once to fp32.

:func:`int8_linear` computes ``x W^T + b`` in fp32 with that dequantized weight and returns x's dtype.
Generation's decode step (a few rows of x) is bound by reading the weights, so the native kernel
(``_int8_gemm``, built at install time) reads the int8 bytes directly: a quarter of fp32's traffic.
Many rows (prefill) are bound by arithmetic instead: the weight is dequantized tile by tile into a
small fp32 buffer and each tile goes to torch's sgemm. Without the native kernels (or for tensors on
an accelerator) the same tiles are dequantized by PyTorch, so every path multiplies the same weights.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch.nn import functional as F

from zerospeed.ops.native import INT8_KERNELS, KernelChoice, choose

#: rows of x up to which the native kernel multiplies directly from int8 (decode); more go to sgemm
DIRECT_MAX_ROWS = 16
#: weights below which one thread does the work: one thread reads 2 MiB of int8 in ~0.2 ms, and on a
#: busy machine a fork/join can wait a whole scheduler slice (~10 ms) for a descheduled thread
PARALLEL_MIN_WEIGHTS = 1 << 21
#: fp32 elements of one dequantized weight tile on the sgemm path (bounds the temporary)
TILE_ELEMS = 1 << 22
QMAX = 127
#: elements per scale: 128 keeps the scales at 3% of the int8 bytes (0.258x fp32 in all); on small
#: GPT-2/Llama models the logits' cosine with fp32 moved only from 0.99977 (32) to 0.99967 (256) (the
#: acceptance in tests/test_inference_quantize.py), while larger groups read fewer scales
DEFAULT_GROUP_SIZE = 128


def kernels(implementation: str = "auto") -> KernelChoice:
    """The int8 kernels to run: ``auto`` (native when built), ``native`` (or an error saying why not),
    ``torch``; ``zerospeed report`` prints the ``auto`` choice."""
    return choose(implementation, INT8_KERNELS)


def num_groups(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size)


def check_group_size(group_size: object) -> int:
    """``group_size`` as a positive int, or a ValueError saying what to pass."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r}: pass a positive number of input elements per scale "
                         f"(e.g. 128; a multiple of 16 keeps the native kernel vectorised; >= in_features gives "
                         f"one scale per output row)")
    return group_size


@torch.no_grad()
def quantize_groupwise(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` (any float dtype) -> ``(q int8 [N, K], scales fp32 [N, ceil(K / group_size)])``."""
    check_group_size(group_size)
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_groupwise takes a 2-d floating weight [out, in]; got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    n, k = weight.shape
    groups = num_groups(k, group_size)
    w = weight.detach().float()
    pad = groups * group_size - k
    padded = F.pad(w, (0, pad)) if pad else w  # zeros never raise a group's max
    blocks = padded.reshape(n, groups, group_size)
    scales = blocks.abs().amax(dim=2) / QMAX
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe.unsqueeze(2)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.reshape(n, groups * group_size)[:, :k].contiguous(), scales.contiguous()


def dequantize_groupwise(q: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """``q * scale`` per group, as fp32 ``[N, K]`` (the weights every matmul path multiplies)."""
    k = q.shape[1]
    return q.float() * scales.repeat_interleave(group_size, dim=1)[:, :k]


def _check(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group_size: int,
           bias: torch.Tensor | None) -> None:
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"int8_linear: the weight must be int8 [out, in]; got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    if scales.dtype != torch.float32 or tuple(scales.shape) != (n, num_groups(k, group_size)):
        raise ValueError(f"int8_linear: scales must be fp32 [{n}, {num_groups(k, group_size)}] for weight "
                         f"{tuple(q.shape)} and group_size={group_size}; got {scales.dtype} {tuple(scales.shape)}")
    if not x.is_floating_point() or x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"int8_linear: the input must be floating with last dimension in_features={k}; got "
                         f"{x.dtype} {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"int8_linear: bias must have shape ({n},); got {tuple(bias.shape)}")
    if not (q.is_contiguous() and scales.is_contiguous()):
        raise ValueError("int8_linear: the int8 weight and its scales must be contiguous")


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group_size: int,
                bias: torch.Tensor | None = None, *, kernels: KernelChoice | None = None) -> torch.Tensor:
    """``x W^T + bias`` for the group-quantized ``W = (q, scales)``, computed in fp32, returned in x's dtype.

    ``x`` may have any leading dimensions. ``kernels`` defaults to the ``auto`` choice."""
    _check(x, q, scales, group_size, bias)
    return matmul(x, q, scales, group_size, bias, kernels if kernels is not None else auto_kernels())


def matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group_size: int, bias: torch.Tensor | None,
           choice: KernelChoice) -> torch.Tensor:
    """:func:`int8_linear` without the argument checks, for layers that checked their tensors once when
    they were built (a decode step calls this once per layer: its Python cost is part of the step)."""
    n, k = q.shape
    xf = x.reshape(-1, k)
    if xf.dtype != torch.float32:
        xf = xf.float()
    if not xf.is_contiguous():
        xf = xf.contiguous()
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    native = choice.module if xf.device.type == "cpu" else None
    rows = xf.shape[0]
    if native is not None and 0 < rows <= DIRECT_MAX_ROWS:
        y = torch.empty(rows, n, dtype=torch.float32)
        native.int8_linear(xf.data_ptr(), rows, k, q.data_ptr(), scales.data_ptr(), scales.shape[1], group_size,
                           bias.data_ptr() if bias is not None else 0, y.data_ptr(), n, _threads(n * k))
    else:
        y = _tiled(xf, q, scales, group_size, _native_dequantize(native) if native is not None else None)
        if bias is not None:
            y.add_(bias)
    if x.dtype != torch.float32:
        y = y.to(x.dtype)
    return y.view(*x.shape[:-1], n)


@functools.lru_cache(maxsize=1)
def auto_kernels() -> KernelChoice:
    """The ``auto`` choice, made once per process."""
    return kernels("auto")


def _threads(weights: int) -> int:
    return 1 if weights < PARALLEL_MIN_WEIGHTS else torch.get_num_threads()


Dequantize = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], None]


def _native_dequantize(module: object) -> Dequantize:
    def run(q: torch.Tensor, scales: torch.Tensor, group_size: int, out: torch.Tensor) -> None:
        rows, k = q.shape
        module.dequantize(q.data_ptr(), scales.data_ptr(), rows, k, scales.shape[1],  # type: ignore[attr-defined]
                          group_size, out.data_ptr(), _threads(rows * k))
    return run


def _torch_dequantize(q: torch.Tensor, scales: torch.Tensor, group_size: int, out: torch.Tensor) -> None:
    out.copy_(dequantize_groupwise(q, scales, group_size))


def _tiled(xf: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group_size: int,
           dequantize: Dequantize | None) -> torch.Tensor:
    """``xf W^T`` with W dequantized a tile of rows at a time into one fp32 buffer, each tile an sgemm
    into the rows of ``y^T`` it owns (contiguous), transposed once at the end."""
    run = dequantize or _torch_dequantize
    n, k = q.shape
    tile_rows = max(1, min(n, TILE_ELEMS // max(k, 1)))
    buffer = torch.empty(tile_rows, k, dtype=torch.float32, device=xf.device)
    if tile_rows == n:
        run(q, scales, group_size, buffer)
        return torch.mm(xf, buffer.t())
    y_t = torch.empty(n, xf.shape[0], dtype=torch.float32, device=xf.device)
    for start in range(0, n, tile_rows):
        end = min(start + tile_rows, n)
        tile = buffer[: end - start]
        run(q[start:end], scales[start:end], group_size, tile)
        torch.mm(tile, xf.t(), out=y_t[start:end])
    return y_t.t().contiguous()


__all__ = ["DIRECT_MAX_ROWS", "auto_kernels", "check_group_size", "dequantize_groupwise", "int8_linear", "kernels",
           "matmul", "num_groups", "quantize_groupwise"]
