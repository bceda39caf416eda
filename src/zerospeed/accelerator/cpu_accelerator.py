"""The CPU accelerator: gloo collectives, synchronous work, host memory as device memory.

Follows DeepSpeed's ``CPU_Accelerator`` except where its answer would stop a CUDA-written script:

* ``Stream``/``Event``/``current_stream``/``default_stream`` give :mod:`host_sync` objects (DeepSpeed:
  None), so ``s = acc.Stream(); with acc.stream(s): ...; s.synchronize()`` runs unchanged;
  ``new_stream()``, zerospeed's internal ask, still answers None (nothing to overlap on a CPU).
* ``device(i)`` is ``torch.device('cpu')`` (DeepSpeed: None), usable in ``.to(...)``.
* ``current_device()`` is ``LOCAL_RANK`` as an int (DeepSpeed: the raw string when set).
* memory figures come from ``/proc`` (DeepSpeed: psutil, which zerospeed does not depend on).
"""

from __future__ import annotations

import os
from typing import Any, Callable, ContextManager, Sequence

import torch

from zerospeed.accelerator import host_memory
from zerospeed.accelerator.abstract_accelerator import TorchAcceleratorBase, no_op_context
from zerospeed.accelerator.host_sync import DEFAULT_HOST_STREAM, HostEvent, HostStream


class CPU_Accelerator(TorchAcceleratorBase):  # noqa: N801 -- DeepSpeed's class name
    """Every rank computes on the host; pinning is a no-op because nothing needs page-locked memory."""

    _torch_pins_host_memory = False

    def __init__(self) -> None:
        super().__init__("cpu", "gloo")
        self._peak_rss = host_memory.rss_bytes()  # DeepSpeed's "max allocated" on a CPU: peak RSS seen

    def is_synchronized_device(self) -> bool:
        return True

    # ---- devices ----------------------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        return "cpu"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def set_device(self, device_index: int) -> None:
        return None

    def current_device(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        """``LOCAL_SIZE`` when a launcher set it, else one per NUMA node with cores (as DeepSpeed)."""
        local_size = int(os.environ.get("LOCAL_SIZE", "0") or 0)
        return local_size if local_size > 0 else host_memory.numa_node_count()

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    # ---- random numbers ---------------------------------------------------------------------------
    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.set_rng_state(new_state)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def manual_seed(self, seed: int) -> torch.Generator:
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> torch.Generator:
        return torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def default_generator(self, device_index: int | None = None) -> torch.Generator:
        return torch.default_generator

    # ---- streams and events -----------------------------------------------------------------------
    @property
    def Stream(self) -> type[HostStream]:
        return HostStream

    def stream(self, stream: Any) -> ContextManager[None]:
        return no_op_context()

    def current_stream(self, device_index: int | None = None) -> HostStream:
        return DEFAULT_HOST_STREAM

    def default_stream(self, device_index: int | None = None) -> HostStream:
        return DEFAULT_HOST_STREAM

    @property
    def Event(self) -> type[HostEvent]:
        return HostEvent

    # ---- memory: the process's resident set stands in for "allocated" ----------------------------
    def _rss(self) -> int:
        now = host_memory.rss_bytes()
        self._peak_rss = max(self._peak_rss, now)
        return now

    def _reset_peak(self) -> None:
        self._peak_rss = host_memory.rss_bytes()

    def empty_cache(self) -> None:
        return None

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self._rss()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        self._rss()
        return self._peak_rss

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self._reset_peak()

    def memory_cached(self, device_index: int | None = None) -> int:
        return self._rss()

    def max_memory_cached(self, device_index: int | None = None) -> int:
        return self.max_memory_allocated()

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        self._reset_peak()

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        current = self._rss()
        return {"allocated_bytes.all.current": current, "allocated_bytes.all.peak": self._peak_rss}

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self._reset_peak()

    def memory_reserved(self, device_index: int | None = None) -> int:
        return self._rss()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return self.max_memory_allocated()

    def total_memory(self, device_index: int | None = None) -> int:
        return host_memory.total_bytes()

    def available_memory(self, device_index: int | None = None) -> int:
        return host_memory.available_bytes()

    # ---- data types -------------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        """Whether oneDNN has fast fp16 kernels here (DeepSpeed's test); fp16 math still works without."""
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except Exception:  # an older torch without the probe
            return False

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32, torch.bfloat16]
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        return dtypes

    # ---- misc -------------------------------------------------------------------------------------
    def is_available(self) -> bool:
        return True

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        return None

    def range_pop(self, domain: Any = None) -> None:
        return None

    def is_triton_supported(self) -> bool:
        return False

    # ---- graphs: nothing to capture on a synchronous device ---------------------------------------
    def create_graph(self) -> None:
        return None

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> ContextManager[None]:
        return no_op_context()

    def replay_graph(self, graph: Any) -> None:
        return None

    # ---- tensor constructors: torch's legacy CPU types, as DeepSpeed (sizes or data both work) ----
    @property
    def BFloat16Tensor(self) -> Callable[..., torch.Tensor]:
        return torch.BFloat16Tensor

    @property
    def ByteTensor(self) -> Callable[..., torch.Tensor]:
        return torch.ByteTensor

    @property
    def DoubleTensor(self) -> Callable[..., torch.Tensor]:
        return torch.DoubleTensor

    @property
    def FloatTensor(self) -> Callable[..., torch.Tensor]:
        return torch.FloatTensor

    @property
    def HalfTensor(self) -> Callable[..., torch.Tensor]:
        return torch.HalfTensor

    @property
    def IntTensor(self) -> Callable[..., torch.Tensor]:
        return torch.IntTensor

    @property
    def LongTensor(self) -> Callable[..., torch.Tensor]:
        return torch.LongTensor

    # ---- pinning: torch cannot page-lock for a CPU-only run, so these allocate plain host memory --
    def _torch_pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def _torch_empty_pinned(self, tensor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        return tensor.new_empty(tuple(shape))

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    # ---- launcher environment ---------------------------------------------------------------------
    def export_envs(self) -> list[str]:
        return []
