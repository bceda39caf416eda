"""The one place that decides device, collective backend, pinned memory and streams.

Everything else asks an :class:`Accelerator` instead of testing ``torch.cuda.is_available()``
itself, so CPU (gloo) and CUDA (NCCL) runs share every other line of code.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator, Literal, Mapping

import torch

DeviceType = Literal["cpu", "cuda"]
_ENV_OVERRIDE = "ZEROSPEED_ACCELERATOR"


@dataclass(frozen=True)
class Accelerator:
    """Facts about the compute device kind used by this process."""

    device_type: DeviceType

    @property
    def backend(self) -> str:
        """The collective backend that fits this device: NCCL for CUDA, gloo for CPU."""
        return "nccl" if self.device_type == "cuda" else "gloo"

    @property
    def is_cpu(self) -> bool:
        return self.device_type == "cpu"

    def device(self, local_rank: int = 0) -> torch.device:
        """The device this local rank computes on (one CUDA device per rank; all CPU ranks share 'cpu')."""
        if self.device_type == "cuda":
            return torch.device("cuda", local_rank)
        return torch.device("cpu")

    def set_device(self, local_rank: int) -> None:
        if self.device_type == "cuda":
            torch.cuda.set_device(local_rank)

    def device_count(self) -> int:
        return torch.cuda.device_count() if self.device_type == "cuda" else 1

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """Page-lock a host tensor for fast async copies; pointless (and skipped) without CUDA."""
        if self.device_type == "cuda" and not tensor.is_pinned():
            return tensor.pin_memory()
        return tensor

    def synchronize(self) -> None:
        if self.device_type == "cuda":
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def stream(self, stream: "torch.cuda.Stream | None") -> Iterator[None]:
        """Run a block on a side stream; a no-op on CPU where work is synchronous anyway."""
        if self.device_type == "cuda" and stream is not None:
            with torch.cuda.stream(stream):
                yield
        else:
            yield

    def new_stream(self) -> "torch.cuda.Stream | None":
        return torch.cuda.Stream() if self.device_type == "cuda" else None


def get_accelerator(env: Mapping[str, str] | None = None) -> Accelerator:
    """Pick the accelerator: ``ZEROSPEED_ACCELERATOR=cpu|cuda`` overrides, else CUDA when present."""
    env = os.environ if env is None else env
    override = env.get(_ENV_OVERRIDE, "").strip().lower()
    if override:
        if override not in ("cpu", "cuda"):
            raise ValueError(
                f"{_ENV_OVERRIDE}={override!r} is not a known accelerator; use 'cpu' or 'cuda'"
            )
        if override == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(
                f"{_ENV_OVERRIDE}=cuda but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}); unset it to run on the CPU"
            )
        return Accelerator(override)  # type: ignore[arg-type]
    return Accelerator("cuda" if torch.cuda.is_available() else "cpu")
