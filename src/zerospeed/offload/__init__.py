"""Where model state lives (device, CPU memory; NVMe with ZeRO-Infinity) and how it moves."""

from zerospeed.offload.store import StateStore, Tier

__all__ = ["StateStore", "Tier"]
