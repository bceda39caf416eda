"""Distributed data loading."""

from zerospeed.data.loader import DistributedLoader, RepeatingLoader, ResumableSampler

__all__ = ["DistributedLoader", "RepeatingLoader", "ResumableSampler"]
