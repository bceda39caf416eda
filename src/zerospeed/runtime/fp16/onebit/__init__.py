"""``deepspeed.runtime.fp16.onebit``: 1-bit Adam, 0/1 Adam and 1-bit LAMB (the same objects as
``zerospeed.optim.onebit``)."""

from zerospeed.optim.onebit import OnebitAdam, OnebitLamb, ZeroOneAdam

__all__ = ["OnebitAdam", "OnebitLamb", "ZeroOneAdam"]
