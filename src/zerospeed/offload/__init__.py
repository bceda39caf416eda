"""Where model state lives (device, CPU memory; NVMe with ZeRO-Infinity) and how it moves."""

from zerospeed.offload.nvme import IOWait, RunDirectory, SlabLease, SwappedSlabs, itemsize
from zerospeed.offload.run import IoStats, MemoryStorage, NvmeRun, TierStorage
from zerospeed.offload.store import StateStore, Tier
from zerospeed.offload.tier import MemoryTier, NvmeTier, StateTier, remote_device_tier

__all__ = ["IOWait", "IoStats", "MemoryStorage", "MemoryTier", "NvmeRun", "NvmeTier", "RunDirectory", "SlabLease", "StateStore", "StateTier",
           "SwappedSlabs", "Tier", "TierStorage", "itemsize", "remote_device_tier"]
