"""``deepspeed.runtime.dataloader``: the data loaders under DeepSpeed's names."""

from zerospeed.data.loader import DistributedLoader as DeepSpeedDataLoader
from zerospeed.data.loader import RepeatingLoader

__all__ = ["DeepSpeedDataLoader", "RepeatingLoader"]
