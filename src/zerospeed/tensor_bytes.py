"""A CPU tensor's memory as a ``memoryview``, for file I/O without copies; byte counts as people read them.

Not through ``tensor.numpy()``: a numpy array over a storage makes that storage non-resizable, and
zerospeed releases storages it swaps or gathers (``untyped_storage().resize_(0)``). The view does
not keep the tensor alive: the caller must hold the tensor while the view is in use.
"""

from __future__ import annotations

import ctypes

import torch


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, as unsigned bytes (``format 'B'``)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"tensor_bytes needs a contiguous CPU tensor, got one on {tensor.device}"
                         f"{'' if tensor.is_contiguous() else ' (not contiguous)'}")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


_BINARY_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(nbytes: int) -> str:
    """``nbytes`` at the binary scale that shows it (``512 B``, ``4.00 KiB``, ``17.6 MiB``, ``1.25 GiB``),
    three significant digits from KiB on, so that small sizes in error messages (a full disk, a tiny
    run) do not print as ``0.00 GiB``."""
    if nbytes < 1024:
        return f"{nbytes} B"
    value, unit = float(nbytes), "B"
    for unit in _BINARY_UNITS:
        value /= 1024
        if value < 1024:
            break
    text = f"{value:.2f}"
    if float(text) >= 10:  # decided after rounding: 9.999 shows as 10.0, not 10.00
        text = f"{value:.1f}"
    if float(text) >= 100:
        text = f"{value:.0f}"
    return f"{text} {unit}"
