"""Where model state lives: the ``StateStore`` and its tiers, chosen once from the config.

A tier (:mod:`zerospeed.offload.tier`) is a value that knows one place for tensors (the compute
device, CPU memory, files on NVMe) and how to put a tensor there. The store says which tier holds what: the fp32 masters and
optimizer states (``offload_optimizer``), the stage-3 parameter shards between uses
(``offload_param``), and — with ``offload_optimizer.ratio < 1`` — which units keep their optimizer
work on the compute device. Code that allocates state asks the store instead of testing offload
flags, so turning offload on changes where tensors are made, not which code runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from zerospeed.accelerator import Accelerator
from zerospeed.config.policies import ZeroPolicy
from zerospeed.offload.tier import MemoryTier, StateTier, host_tier

if TYPE_CHECKING:
    from zerospeed.config.schema_zero import AioConfig

Tier = MemoryTier  # the memory tier, by the name it had before NVMe got a tier of its own


@dataclass(frozen=True)
class StateStore:
    """Which tier holds each kind of state (see the module docstring)."""

    compute: MemoryTier  # where the model computes: the default home of everything
    optimizer: StateTier  # fp32 masters and optimizer states of offloaded units
    params: StateTier  # stage-3 parameter shards between uses
    offload_ratio: float = 1.0  # fraction of the optimizer's elements in ``optimizer`` (the rest: ``compute``)
    nvme_lookahead: int = 1  # NVMe: units read ahead of the one being updated
    # offload_param nvme: shard elements kept in CPU memory anyway (``max_in_cpu``: the first units
    # that fit), and how many freed shard buffers are kept for reuse (``buffer_count``)
    params_in_memory: int = 0
    param_buffers: int = 5

    @classmethod
    def from_config(cls, zero_cfg: ZeroPolicy, compute_device: torch.device, accelerator: Accelerator,
                    aio: AioConfig | None = None) -> StateStore:
        """The tiers ``zero_optimization`` asks for; ``aio``: the config's ``aio`` section (NVMe)."""
        compute = MemoryTier("device", compute_device)
        opt_cfg, par_cfg = zero_cfg.offload_optimizer, zero_cfg.offload_param
        # host memory is pinned only when asked and a CUDA device copies from it
        pin = compute.device.type == "cuda" and accelerator.device_type == "cuda"
        optimizer = host_tier(opt_cfg, compute, pin=pin, aio=aio, key="zero_optimization.offload_optimizer")
        params = (host_tier(par_cfg, compute, pin=pin, aio=aio, key="zero_optimization.offload_param")
                  if zero_cfg.stage == 3 else compute)
        ratio = opt_cfg.ratio if optimizer != compute else 1.0
        # buffer_count slabs: one being updated, one being written back, the rest read ahead
        lookahead = max(opt_cfg.buffer_count - 2, 1) if opt_cfg.pipeline_read else 1
        return cls(compute=compute, optimizer=optimizer, params=params, offload_ratio=ratio,
                   nvme_lookahead=lookahead, params_in_memory=par_cfg.max_in_cpu,
                   param_buffers=par_cfg.buffer_count)

    @classmethod
    def on_device(cls, device: torch.device) -> StateStore:
        """Everything on the compute device (no offload)."""
        tier = MemoryTier("device", device)
        return cls(compute=tier, optimizer=tier, params=tier)

    @property
    def offloads_optimizer(self) -> bool:
        return self.optimizer != self.compute

    @property
    def offloads_params(self) -> bool:
        return self.params != self.compute

    @property
    def swaps(self) -> bool:
        """Some state lives in files between uses (the NVMe tier holds the optimizer's or the parameters')."""
        return self.optimizer.swaps or self.params.swaps

    def optimizer_tiers(self, sizes: Sequence[int]) -> list[StateTier]:
        """The tier of each unit's masters and states, given the units' shard sizes in step order.

        With ``ratio < 1`` the first units (about ``1 - ratio`` of the elements) stay on the compute
        device and the rest are offloaded, as DeepSpeed splits its sub-groups.
        """
        if not self.offloads_optimizer or self.offload_ratio >= 1.0:
            return [self.optimizer] * len(sizes)
        keep = (1.0 - self.offload_ratio) * sum(sizes)
        out: list[StateTier] = []
        seen = 0
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
        if self.params.swaps and self.params_in_memory > 0:
            params += (f", except the first that fit in {self.params_in_memory:,} elements, kept in CPU memory "
                       f"(offload_param.max_in_cpu; 0 puts every shard on NVMe)")
        parts.append(params)
        return "; ".join(parts)

