"""DeepSpeed's accelerator interface (``DeepSpeedAccelerator``), written for zerospeed.

Scripts written for DeepSpeed call ``get_accelerator().device_name(i)``, ``.pin_memory(t)``,
``.Stream`` and so on; every name of DeepSpeed 0.19's abstract class exists here with its meaning.
The abstract methods are exactly DeepSpeed's abstract methods (never more), so a user accelerator
written against DeepSpeed's base class also subclasses this one.

On top of the interface sit the few zerospeed-internal views the rest of the library reads
(``device_type``, ``backend``, ``is_cpu``, ``torch_device``, ``new_stream``); they are derived from
the interface, so a user accelerator gets them for free.

zerospeed never JIT-compiles native ops: ``get_op_builder``/``create_op_builder`` answer ``None``
(DeepSpeed's "no such builder"), while ``op_builder_dir``/``build_extension`` raise
:class:`AcceleratorFeatureUnsupported` rather than hand back something that cannot work.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any, Callable, ContextManager, MutableMapping, Sequence

import torch


class AcceleratorFeatureUnsupported(NotImplementedError):
    """An accelerator method zerospeed deliberately does not provide (the message says what instead)."""


class DeepSpeedAccelerator(abc.ABC):
    """What a device kind can do, asked by name instead of testing ``torch.cuda`` everywhere."""

    supports_nvtx_domain = False
    # Whether torch's pinning really page-locks host memory for this device (not on a CPU-only run).
    _torch_pins_host_memory = True

    def __init__(self) -> None:
        self._name: str | None = None
        self._communication_backend_name: str | None = None
        self._compile_backend: str | None = None

    # ---- zerospeed's own views, derived from the interface --------------------------------------
    @property
    def device_type(self) -> str:
        """The torch device type this accelerator computes on ('cpu', 'cuda', ...)."""
        return self.device_name()

    @property
    def backend(self) -> str:
        """The collective backend that fits this device: NCCL for CUDA, gloo for CPU."""
        return str(self.communication_backend_name())

    @property
    def is_cpu(self) -> bool:
        return self.device_type == "cpu"

    def torch_device(self, local_rank: int = 0) -> torch.device:
        """The device a local rank computes on: its own device index, or the one shared 'cpu'."""
        if self.is_cpu:
            return torch.device("cpu")
        return torch.device(self.device_type, local_rank)

    def new_stream(self) -> Any:
        """A side stream for overlapping copies, or None where work is synchronous (nothing to overlap)."""
        return None if self.is_synchronized_device() else self.Stream()

    # ---- timing and ordering ----------------------------------------------------------------------
    @abc.abstractmethod
    def is_synchronized_device(self) -> bool:
        """True when work is finished as soon as it is issued (CPU), so no stream bookkeeping is needed."""

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    # ---- devices ----------------------------------------------------------------------------------
    @abc.abstractmethod
    def device_name(self, device_index: int | None = None) -> str: ...

    @abc.abstractmethod
    def device(self, device_index: int | None = None) -> Any: ...

    @abc.abstractmethod
    def set_device(self, device_index: int) -> None: ...

    @abc.abstractmethod
    def current_device(self) -> int: ...

    @abc.abstractmethod
    def current_device_name(self) -> str: ...

    @abc.abstractmethod
    def device_count(self) -> int: ...

    @abc.abstractmethod
    def synchronize(self, device_index: int | None = None) -> None: ...

    # ---- random numbers ---------------------------------------------------------------------------
    def random(self) -> Any:
        """The ``torch.random`` module (DeepSpeed's answer on every accelerator)."""
        return torch.random

    @abc.abstractmethod
    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None: ...

    @abc.abstractmethod
    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor: ...

    @abc.abstractmethod
    def manual_seed(self, seed: int) -> Any: ...

    @abc.abstractmethod
    def manual_seed_all(self, seed: int) -> Any: ...

    @abc.abstractmethod
    def initial_seed(self) -> int: ...

    @abc.abstractmethod
    def default_generator(self, device_index: int) -> torch.Generator: ...

    # ---- streams and events -----------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def Stream(self) -> Any: ...

    @abc.abstractmethod
    def stream(self, stream: Any) -> ContextManager[Any]: ...

    @abc.abstractmethod
    def current_stream(self, device_index: int | None = None) -> Any: ...

    @abc.abstractmethod
    def default_stream(self, device_index: int | None = None) -> Any: ...

    @property
    @abc.abstractmethod
    def Event(self) -> Any: ...

    # ---- memory -----------------------------------------------------------------------------------
    @abc.abstractmethod
    def empty_cache(self) -> None: ...

    @abc.abstractmethod
    def memory_allocated(self, device_index: int | None = None) -> int: ...

    @abc.abstractmethod
    def max_memory_allocated(self, device_index: int | None = None) -> int: ...

    @abc.abstractmethod
    def reset_max_memory_allocated(self, device_index: int | None = None) -> None: ...

    @abc.abstractmethod
    def memory_cached(self, device_index: int | None = None) -> int: ...

    @abc.abstractmethod
    def max_memory_cached(self, device_index: int | None = None) -> int: ...

    @abc.abstractmethod
    def reset_max_memory_cached(self, device_index: int | None = None) -> None: ...

    @abc.abstractmethod
    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]: ...

    @abc.abstractmethod
    def reset_peak_memory_stats(self, device_index: int | None = None) -> None: ...

    @abc.abstractmethod
    def memory_reserved(self, device_index: int | None = None) -> int: ...

    @abc.abstractmethod
    def max_memory_reserved(self, device_index: int | None = None) -> int: ...

    @abc.abstractmethod
    def total_memory(self, device_index: int | None = None) -> int: ...

    @abc.abstractmethod
    def available_memory(self, device_index: int | None = None) -> int: ...

    # ---- data types -------------------------------------------------------------------------------
    @abc.abstractmethod
    def is_bf16_supported(self) -> bool: ...

    @abc.abstractmethod
    def is_fp16_supported(self) -> bool: ...

    def is_fp64_supported(self) -> bool:
        return True

    @abc.abstractmethod
    def supported_dtypes(self) -> list[torch.dtype]: ...

    # ---- misc -------------------------------------------------------------------------------------
    @abc.abstractmethod
    def is_available(self) -> bool: ...

    @abc.abstractmethod
    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> Any: ...

    @abc.abstractmethod
    def range_pop(self, domain: Any = None) -> Any: ...

    @abc.abstractmethod
    def lazy_call(self, callback: Callable[[], Any]) -> Any: ...

    @abc.abstractmethod
    def communication_backend_name(self) -> str | None: ...

    @abc.abstractmethod
    def is_triton_supported(self) -> bool: ...

    def prefer_triton_grouped_mm(self) -> bool:
        return False

    # ---- graphs -----------------------------------------------------------------------------------
    def is_current_stream_capturing(self) -> bool:
        return False

    @abc.abstractmethod
    def create_graph(self) -> Any: ...

    @abc.abstractmethod
    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> ContextManager[Any]: ...

    @abc.abstractmethod
    def replay_graph(self, graph: Any) -> None: ...

    # ---- tensor constructors ----------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def BFloat16Tensor(self) -> Callable[..., torch.Tensor]: ...

    @property
    @abc.abstractmethod
    def ByteTensor(self) -> Callable[..., torch.Tensor]: ...

    @property
    @abc.abstractmethod
    def DoubleTensor(self) -> Callable[..., torch.Tensor]: ...

    @property
    @abc.abstractmethod
    def FloatTensor(self) -> Callable[..., torch.Tensor]: ...

    @property
    @abc.abstractmethod
    def HalfTensor(self) -> Callable[..., torch.Tensor]: ...

    @property
    @abc.abstractmethod
    def IntTensor(self) -> Callable[..., torch.Tensor]: ...

    @property
    @abc.abstractmethod
    def LongTensor(self) -> Callable[..., torch.Tensor]: ...

    # ---- pinned host memory -----------------------------------------------------------------------
    # The public methods go through the three ``_torch_*`` primitives, which a device overrides.
    def _torch_pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    def _torch_empty_pinned(self, tensor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        return tensor.new_empty(tuple(shape), pin_memory=True)

    def _torch_is_pinned(self, tensor: torch.Tensor) -> bool:
        return bool(tensor.is_pinned())

    @staticmethod
    def _shape_numel(shape: Sequence[int]) -> int:
        numel = 1
        for dim in shape:
            numel *= int(dim)
        return numel

    @staticmethod
    def _require_host_device(device: Any) -> None:
        try:
            kind = torch.device(device).type
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"pinned buffers live in host memory; pass device='cpu', not {device!r}") from err
        if kind != "cpu":
            raise ValueError(f"pinned buffers live in host memory; pass device='cpu', not {device!r}")

    def _pin_fresh(self, template: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        return self._torch_empty_pinned(template, shape)

    def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True) -> torch.Tensor:
        """Page-lock a host tensor for fast async copies (returned as is when already pinned).

        ``make_copy=False`` treats ``tensor`` as a shape/dtype template and returns a fresh, unfilled
        pinned buffer (flat when ``match_shape=False``), as DeepSpeed does.
        """
        if make_copy:
            return tensor if self._torch_is_pinned(tensor) else self._torch_pin_memory(tensor)
        shape = tuple(tensor.shape) if match_shape else (tensor.numel(),)
        return self._pin_fresh(tensor, shape)

    def pin_empty(self, *size: Any, dtype: torch.dtype, device: Any = "cpu") -> torch.Tensor:
        """An unfilled pinned host buffer of ``size`` (ints or one sequence)."""
        self._require_host_device(device)
        if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
            shape = tuple(int(d) for d in size[0])
        else:
            shape = tuple(int(d) for d in size)
        return self._pin_fresh(torch.empty(0, dtype=dtype, device="cpu"), shape)

    def pin_empty_like(self, tensor: torch.Tensor, device: Any = "cpu", dtype: torch.dtype | None = None) -> torch.Tensor:
        self._require_host_device(device)
        template = torch.empty(0, dtype=tensor.dtype if dtype is None else dtype, device="cpu")
        return self._pin_fresh(template, tuple(tensor.shape))

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return self._torch_is_pinned(tensor)

    def unpin_memory(self, tensor: torch.Tensor) -> None:
        """torch frees pinned storage with the tensor; there is no explicit unpin (DeepSpeed: None)."""
        return None

    def register_host_memory(self, address: int, num_bytes: int) -> bool:
        """Page-lock memory torch did not allocate; False where the device runtime cannot."""
        return False

    def unregister_host_memory(self, address: int) -> None:
        return None

    def pin_memory_alignment(self) -> int:
        """Byte alignment required for device-registered host memory; 1 means none."""
        return 1

    @abc.abstractmethod
    def on_accelerator(self, tensor: torch.Tensor) -> bool: ...

    # ---- native op builders: zerospeed ships its kernels prebuilt and never JIT-compiles ----------
    @abc.abstractmethod
    def op_builder_dir(self) -> str: ...

    @abc.abstractmethod
    def create_op_builder(self, class_name: str) -> Any: ...

    @abc.abstractmethod
    def get_op_builder(self, class_name: str) -> Any: ...

    @abc.abstractmethod
    def build_extension(self) -> Any: ...

    # ---- launcher environment ---------------------------------------------------------------------
    @abc.abstractmethod
    def export_envs(self) -> list[str]: ...

    @abc.abstractmethod
    def visible_devices_envs(self) -> list[str]: ...

    @abc.abstractmethod
    def set_visible_devices_envs(self, current_env: MutableMapping[str, str],
                                 local_accelerator_ids: Sequence[int]) -> None: ...

    # ---- torch.compile ----------------------------------------------------------------------------
    @abc.abstractmethod
    def get_compile_backend(self) -> str | None: ...

    @abc.abstractmethod
    def set_compile_backend(self, backend: str) -> None: ...


class TorchAcceleratorBase(DeepSpeedAccelerator):
    """What zerospeed's CPU and CUDA accelerators answer alike."""

    def __init__(self, name: str, communication_backend: str) -> None:
        super().__init__()
        self._name = name
        self._communication_backend_name = communication_backend
        self._compile_backend = "inductor"

    def communication_backend_name(self) -> str | None:
        return self._communication_backend_name

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        return callback()

    def op_builder_dir(self) -> str:
        raise AcceleratorFeatureUnsupported(
            "zerospeed builds no DeepSpeed op builders: its native kernels ship prebuilt in "
            "zerospeed.ops; use the optimizers (e.g. deepspeed.ops.adam.DeepSpeedCPUAdam) directly")

    def create_op_builder(self, class_name: str) -> None:
        """None: zerospeed has no op builders (DeepSpeed's answer for an unknown builder)."""
        return None

    def get_op_builder(self, class_name: str) -> None:
        """None: zerospeed has no op builders (DeepSpeed's answer for an unknown builder)."""
        return None

    def build_extension(self) -> Any:
        raise AcceleratorFeatureUnsupported(
            "zerospeed does not compile DeepSpeed C++/CUDA extensions; build your own with "
            "torch.utils.cpp_extension.BuildExtension directly")

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env: MutableMapping[str, str],
                                 local_accelerator_ids: Sequence[int]) -> None:
        for name in self.visible_devices_envs():
            current_env[name] = ",".join(str(i) for i in local_accelerator_ids)

    def get_compile_backend(self) -> str | None:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        import torch._dynamo  # heavy; only when asked

        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            raise ValueError(f"torch.compile backend {backend!r} is not available on {self.device_name()}; "
                             f"choose one of {sorted(known)}")
        self._compile_backend = backend

    def __repr__(self) -> str:
        return f"<zerospeed {type(self).__name__} {self._name} backend={self._communication_backend_name}>"


def no_op_context() -> ContextManager[None]:
    """The context DeepSpeed's CPU accelerator returns where a device would switch state."""
    return contextlib.nullcontext()
