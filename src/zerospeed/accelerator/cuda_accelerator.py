"""The CUDA accelerator: NCCL collectives, one device per local rank, asynchronous streams.

Follows DeepSpeed's ``CUDA_Accelerator``; constructing it touches no CUDA API, so it can be built
(and inspected) on a machine without a GPU. Differences: free memory comes from
``torch.cuda.mem_get_info`` (DeepSpeed: pynvml when installed), and NVTX ranges go through
``torch.cuda.nvtx`` only (``domain``/``category`` are accepted and ignored).
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, ContextManager

import torch

from zerospeed.accelerator.abstract_accelerator import TorchAcceleratorBase


def _on_cuda(dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    return functools.partial(torch.tensor, dtype=dtype, device="cuda")


class CUDA_Accelerator(TorchAcceleratorBase):  # noqa: N801 -- DeepSpeed's class name
    """Each local rank owns ``cuda:<local_rank>``; work is queued on streams."""

    def __init__(self) -> None:
        super().__init__("cuda", "gloo" if sys.platform == "win32" else "nccl")

    def is_synchronized_device(self) -> bool:
        return False

    # ---- devices ----------------------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("cuda") if device_index is None else torch.device("cuda", device_index)

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    # ---- random numbers ---------------------------------------------------------------------------
    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if device_index is None:
            torch.cuda.set_rng_state(new_state)
        else:
            torch.cuda.set_rng_state(new_state, device_index)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if device_index is None:
            return torch.cuda.get_rng_state()
        return torch.cuda.get_rng_state(device_index)

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index]

    # ---- streams and events -----------------------------------------------------------------------
    @property
    def Stream(self) -> type[torch.cuda.Stream]:
        return torch.cuda.Stream

    def stream(self, stream: Any) -> ContextManager[Any]:
        """Run a block on ``stream``; ``None`` keeps the current stream (torch's own rule)."""
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: int | None = None) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: int | None = None) -> torch.cuda.Stream:
        return torch.cuda.default_stream(device_index)

    @property
    def Event(self) -> type[torch.cuda.Event]:
        return torch.cuda.Event

    # ---- memory -----------------------------------------------------------------------------------
    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)  # torch's deprecated alias does just this

    def memory_cached(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index)  # "cached" is torch's old name for reserved

    def max_memory_cached(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        return dict(torch.cuda.memory_stats(device_index))

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        index = torch.cuda.current_device() if device_index is None else device_index
        return int(torch.cuda.get_device_properties(index).total_memory)

    def available_memory(self, device_index: int | None = None) -> int:
        """Free bytes on the device as the driver sees them (other processes' use included)."""
        index = torch.cuda.current_device() if device_index is None else device_index
        free, _total = torch.cuda.mem_get_info(index)
        return int(free)

    # ---- data types -------------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return True if not torch.cuda.is_available() else bool(torch.cuda.is_bf16_supported())

    def is_fp16_supported(self) -> bool:
        """Compute capability 7+ (6.x only with ``DS_ALLOW_DEPRECATED_FP16=1``), as DeepSpeed."""
        if not torch.cuda.is_available():
            return True
        major, _minor = torch.cuda.get_device_capability()
        return major >= 7 or (major == 6 and os.environ.get("DS_ALLOW_DEPRECATED_FP16", "0") == "1")

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32]
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    # ---- misc -------------------------------------------------------------------------------------
    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> Any:
        return torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain: Any = None) -> Any:
        return torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        return torch.cuda._lazy_call(callback)

    def is_triton_supported(self) -> bool:
        if not self.is_available():
            return False
        major, _minor = torch.cuda.get_device_capability()
        return major >= 8

    # ---- graphs -----------------------------------------------------------------------------------
    def is_current_stream_capturing(self) -> bool:
        return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())

    def create_graph(self) -> torch.cuda.CUDAGraph:
        return torch.cuda.CUDAGraph()

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> ContextManager[Any]:
        return torch.cuda.graph(graph, pool, stream)

    def replay_graph(self, graph: Any) -> None:
        graph.replay()

    # ---- tensor constructors: data on the current CUDA device -------------------------------------
    @property
    def BFloat16Tensor(self) -> Callable[..., torch.Tensor]:
        return _on_cuda(torch.bfloat16)

    @property
    def ByteTensor(self) -> Callable[..., torch.Tensor]:
        return _on_cuda(torch.uint8)

    @property
    def DoubleTensor(self) -> Callable[..., torch.Tensor]:
        return _on_cuda(torch.float64)

    @property
    def FloatTensor(self) -> Callable[..., torch.Tensor]:
        return _on_cuda(torch.float32)

    @property
    def HalfTensor(self) -> Callable[..., torch.Tensor]:
        return _on_cuda(torch.float16)

    @property
    def IntTensor(self) -> Callable[..., torch.Tensor]:
        return _on_cuda(torch.int32)

    @property
    def LongTensor(self) -> Callable[..., torch.Tensor]:
        return _on_cuda(torch.int64)

    # ---- pinning ----------------------------------------------------------------------------------
    def register_host_memory(self, address: int, num_bytes: int) -> bool:
        """Page-lock ``num_bytes`` at ``address`` with ``cudaHostRegister`` (raises on a CUDA error)."""
        result = int(torch.cuda.cudart().cudaHostRegister(address, num_bytes, 0))
        torch.cuda.check_error(result)
        return True

    def unregister_host_memory(self, address: int) -> None:
        result = int(torch.cuda.cudart().cudaHostUnregister(address))
        torch.cuda.check_error(result)

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"

    # ---- launcher environment ---------------------------------------------------------------------
    def export_envs(self) -> list[str]:
        """Prefixes of variables the launcher forwards to every node (NCCL_*)."""
        return ["NCCL"]
