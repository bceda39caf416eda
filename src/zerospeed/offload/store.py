"""Where model state lives: the ``StateStore`` and its tiers, chosen once from the config.

A tier is a value that knows one place for tensors (the compute device, CPU memory, later NVMe)
and how to put a tensor there. The store says which tier holds what: the fp32 masters and
optimizer states (``offload_optimizer``), the stage-3 parameter shards between uses
(``offload_param``), and — with ``offload_optimizer.ratio < 1`` — which units keep their optimizer
work on the compute device. Code that allocates state asks the store instead of testing offload
flags, so turning offload on changes where tensors are made, not which code runs.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from zerospeed.accelerator import Accelerator
from zerospeed.config.policies import OptimizerOffload, ParamOffload, ZeroPolicy
from zerospeed.config.values import OffloadDevice


@dataclass(frozen=True)
class Tier:
    """One place for state: a device, and whether host memory there is page-locked."""

    name: str  # "device", "cpu" or "nvme"
    device: torch.device  # where the state is while in use (the CPU for "nvme": it is read into memory)
    pinned: bool = False  # page-locked host memory (only ever true when a CUDA device copies from it)
    path: pathlib.Path | None = None  # "nvme": the directory under which this run's swap files go

    def place(self, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A copy of ``tensor`` (cast to ``dtype``) in this tier; the same tensor when it already is."""
        dtype = dtype or tensor.dtype
        if tensor.device == self.device and tensor.dtype == dtype and (not self.pinned or tensor.is_pinned()):
            return tensor
        out = torch.empty(tensor.shape, dtype=dtype, device=self.device, pin_memory=self.pinned)
        with torch.no_grad():
            out.copy_(tensor)
        return out

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.device

    def describe(self) -> str:
        where = str(self.path) if self.path is not None else str(self.device)
        return f"{self.name} ({where}{', pinned' if self.pinned else ''})"


@dataclass(frozen=True)
class StateStore:
    """Which tier holds each kind of state (see the module docstring)."""

    compute: Tier  # where the model computes: the default home of everything
    optimizer: Tier  # fp32 masters and optimizer states of offloaded units
    params: Tier  # stage-3 parameter shards between uses
    offload_ratio: float = 1.0  # fraction of the optimizer's elements in ``optimizer`` (the rest: ``compute``)
    aio: Any = None  # the ``aio`` config section (block size, queue depth...) for NVMe tiers
    nvme_lookahead: int = 1  # NVMe: units read ahead of the one being updated
    # offload_param nvme: shard elements kept in CPU memory anyway (``max_in_cpu``: the first units
    # that fit), and how many freed shard buffers are kept for reuse (``buffer_count``)
    params_in_memory: int = 0
    param_buffers: int = 5

    @classmethod
    def from_config(cls, zero_cfg: ZeroPolicy, compute_device: torch.device, accelerator: Accelerator,
                    aio: Any = None) -> "StateStore":
        """The tiers ``zero_optimization`` asks for; ``aio``: the config's ``aio`` section (NVMe)."""
        compute = Tier("device", compute_device)
        opt_cfg, par_cfg = zero_cfg.offload_optimizer, zero_cfg.offload_param
        optimizer = _host_tier(opt_cfg, compute, accelerator)
        params = _host_tier(par_cfg, compute, accelerator) if zero_cfg.stage == 3 else compute
        ratio = opt_cfg.ratio if optimizer != compute else 1.0
        # buffer_count slabs: one being updated, one being written back, the rest read ahead
        lookahead = max(opt_cfg.buffer_count - 2, 1) if opt_cfg.pipeline_read else 1
        return cls(compute=compute, optimizer=optimizer, params=params, offload_ratio=ratio, aio=aio,
                   nvme_lookahead=lookahead, params_in_memory=par_cfg.max_in_cpu,
                   param_buffers=par_cfg.buffer_count)

    @classmethod
    def on_device(cls, device: torch.device) -> "StateStore":
        """Everything on the compute device (no offload)."""
        tier = Tier("device", device)
        return cls(compute=tier, optimizer=tier, params=tier)

    @property
    def offloads_optimizer(self) -> bool:
        return self.optimizer != self.compute

    @property
    def offloads_params(self) -> bool:
        return self.params != self.compute

    def optimizer_tiers(self, sizes: Sequence[int]) -> list[Tier]:
        """The tier of each unit's masters and states, given the units' shard sizes in step order.

        With ``ratio < 1`` the first units (about ``1 - ratio`` of the elements) stay on the compute
        device and the rest are offloaded, as DeepSpeed splits its sub-groups.
        """
        if not self.offloads_optimizer or self.offload_ratio >= 1.0:
            return [self.optimizer] * len(sizes)
        keep = (1.0 - self.offload_ratio) * sum(sizes)
        out, seen = [], 0
        for size in sizes:
            # a unit stays on the device when its middle falls within the kept share
            out.append(self.compute if seen + size / 2 < keep else self.optimizer)
            seen += size
        return out

    def describe(self) -> str:
        parts = [f"optimizer state: {self.optimizer.describe()}"]
        if self.offloads_optimizer and self.offload_ratio < 1.0:
            parts[0] += f" for {self.offload_ratio:.0%} of the elements, the rest on {self.compute.describe()}"
        params = f"parameter shards: {self.params.describe()}"
        if self.params.name == "nvme" and self.params_in_memory > 0:
            params += (f", except the first that fit in {self.params_in_memory:,} elements, kept in CPU memory "
                       f"(offload_param.max_in_cpu; 0 puts every shard on NVMe)")
        parts.append(params)
        return "; ".join(parts)


def _host_tier(section: OptimizerOffload | ParamOffload, compute: Tier, accelerator: Accelerator) -> Tier:
    """CPU memory for ``device: cpu`` (pinned when asked and a CUDA device copies from it), files under
    ``nvme_path`` for ``device: nvme``; else the compute tier."""
    if section.device not in (OffloadDevice.CPU, OffloadDevice.NVME):
        return compute
    pinned = section.pin_memory and compute.device.type == "cuda" and accelerator.device_type == "cuda"
    if section.device == OffloadDevice.NVME:
        return Tier("nvme", torch.device("cpu"), pinned=pinned, path=section.nvme_path)
    return Tier("cpu", torch.device("cpu"), pinned=pinned)
