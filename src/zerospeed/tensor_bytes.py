"""A CPU tensor's memory as a ``memoryview``, for file I/O without copies.

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
