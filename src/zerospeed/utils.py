"""User-facing utilities, named as in ``deepspeed.utils``."""

from zerospeed.data.loader import RepeatingLoader

__all__ = ["RepeatingLoader"]
