"""The tiers state can live in: the compute device, CPU memory, files on NVMe.

A tier is a value chosen once from the config. Code that holds state asks its tier what to do rather
than testing which tier it is: :attr:`StateTier.swaps` says whether tensors there live in files
between uses, and :meth:`StateTier.open` gives the tier's storage for this run — nothing to open for
memory tiers (a :class:`~zerospeed.offload.run.MemoryStorage` whose calls do nothing), a run
directory, an async I/O handle and the slabs in it for NVMe (:class:`~zerospeed.offload.run.NvmeRun`).
"""

from __future__ import annotations

import abc
import pathlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal

import torch

from zerospeed.config.values import OffloadDevice
from zerospeed.distributed.comm import Comm

if TYPE_CHECKING:
    from zerospeed.config.schema import Config
    from zerospeed.config.policies import OptimizerOffload, ParamOffload
    from zerospeed.config.schema_zero import AioConfig, OffloadOptimizerConfig, OffloadParamConfig

    OffloadSection = OffloadOptimizerConfig | OffloadParamConfig | OptimizerOffload | ParamOffload
    from zerospeed.offload.run import MemoryStorage, NvmeRun

CPU = torch.device("cpu")


class StateTier(abc.ABC):
    """One place for state: where it is while in use (``device``), whether host memory there is
    page-locked (``pinned``), and whether it lives in files between uses (``swaps``)."""

    name: str
    device: torch.device
    pinned: bool
    swaps: ClassVar[bool]

    def place(self, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A copy of ``tensor`` (cast to ``dtype``) in this tier's memory; the same tensor when it
        already is (a swapping tier's memory is where its slabs are read to: the CPU)."""
        dtype = dtype or tensor.dtype
        if tensor.device == self.device and tensor.dtype == dtype and (not self.pinned or tensor.is_pinned()):
            return tensor
        out = torch.empty(tensor.shape, dtype=dtype, device=self.device, pin_memory=self.pinned)
        with torch.no_grad():
            out.copy_(tensor)
        return out

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.device

    @abc.abstractmethod
    def describe(self) -> str:
        """``name (where[, pinned])``, for the line logged at initialize."""

    @abc.abstractmethod
    def open(self, comm: Comm, *, purpose: str, what: str) -> MemoryStorage | NvmeRun:
        """This rank's storage in the tier for one owner (collective for tiers that swap: every rank
        calls it). ``purpose`` tells the owners of one run apart (e.g. ``"params"``); ``what`` names
        the config section in errors."""


@dataclass(frozen=True)
class MemoryTier(StateTier):
    """Memory of a device: the compute device itself, or CPU memory under ``offload_*.device: cpu``."""

    name: Literal["device", "cpu"]
    device: torch.device
    pinned: bool = False  # page-locked host memory (only ever true when a CUDA device copies from it)
    swaps: ClassVar[bool] = False

    def describe(self) -> str:
        return f"{self.name} ({self.device}{', pinned' if self.pinned else ''})"

    def open(self, comm: Comm, *, purpose: str, what: str) -> MemoryStorage:
        from zerospeed.offload.run import MemoryStorage

        return MemoryStorage()


@dataclass(frozen=True)
class NvmeTier(StateTier):
    """Files under ``path`` (ZeRO-Infinity), read into CPU memory while in use."""

    path: pathlib.Path  # the directory under which this run's swap files go
    pinned: bool = False
    aio: AioConfig | None = field(default=None, compare=False)  # block size, queue depth... (None: defaults)
    # the config key that chose ``path``, named by every error about it (a read-only or full disk)
    key: str = field(default="nvme_path", compare=False)
    name: str = field(default="nvme", init=False)
    device: torch.device = field(default=CPU, init=False)  # slabs are read into CPU memory
    swaps: ClassVar[bool] = True

    def describe(self) -> str:
        return f"{self.name} ({self.path}{', pinned' if self.pinned else ''})"

    def open(self, comm: Comm, *, purpose: str, what: str) -> NvmeRun:
        from zerospeed.offload.run import NvmeRun

        return NvmeRun.open(self, comm, purpose=purpose, what=what)


def host_tier(section: OffloadSection, compute: MemoryTier, *, pin: bool,
              aio: AioConfig | None, key: str) -> StateTier:
    """The tier an ``offload_optimizer`` / ``offload_param`` section asks for: CPU memory for
    ``device: cpu`` (pinned when ``pin`` and the section asks), files under ``nvme_path`` for
    ``device: nvme``; else the compute tier. ``key``: the section's config path (e.g.
    ``zero_optimization.offload_param``), for errors about its ``nvme_path``."""
    pinned = bool(section.pin_memory) and pin
    if section.device == OffloadDevice.NVME:
        assert section.nvme_path is not None  # the config requires it with device nvme
        return NvmeTier(pathlib.Path(section.nvme_path), pinned=pinned, aio=aio, key=f"{key}.nvme_path")
    if section.device == OffloadDevice.CPU:
        return MemoryTier("cpu", CPU, pinned=pinned)
    return compute


def remote_device_tier(cfg: Config | None, remote_device: str | None) -> NvmeTier | None:
    """Where ``zero.Init(remote_device=...)`` keeps partitions: the config's ``offload_param`` NVMe
    tier for ``"nvme"`` (the default when the config puts ``offload_param`` there), None for memory
    (``"cpu"``)."""
    section = cfg.zero_optimization.offload_param if cfg is not None else None
    tier = host_tier(section, MemoryTier("cpu", CPU), pin=False, aio=cfg.aio,
                     key="zero_optimization.offload_param") \
        if cfg is not None and section is not None else None
    nvme = tier if isinstance(tier, NvmeTier) else None
    if remote_device is None:
        return nvme
    if remote_device not in ("cpu", "nvme"):
        raise ValueError(f"zero.Init(remote_device={remote_device!r}): expected 'cpu' or 'nvme' (None: from the "
                         f"config's offload_param.device)")
    if remote_device == "cpu":
        return None
    if nvme is None:
        raise ValueError("zero.Init(remote_device='nvme') needs the config's zero_optimization.offload_param with "
                         "device 'nvme' and an nvme_path; pass config=... with that section")
    return nvme
