"""``deepspeed.runtime.fp16.onebit.adam``: :class:`zerospeed.optim.onebit.adam.OnebitAdam`."""

from zerospeed.optim.onebit.adam import OnebitAdam

__all__ = ["OnebitAdam"]
