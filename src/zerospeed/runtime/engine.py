"""``deepspeed.runtime.engine``: the engine class under DeepSpeed's name."""

from zerospeed.engine import Engine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
