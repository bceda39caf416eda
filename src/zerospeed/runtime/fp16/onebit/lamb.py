"""``deepspeed.runtime.fp16.onebit.lamb``: :class:`zerospeed.optim.onebit.lamb.OnebitLamb`."""

from zerospeed.optim.onebit.lamb import OnebitLamb

__all__ = ["OnebitLamb"]
