"""``deepspeed.runtime.fp16.onebit.zoadam``: :class:`zerospeed.optim.onebit.zoadam.ZeroOneAdam`."""

from zerospeed.optim.onebit.zoadam import ZeroOneAdam

__all__ = ["ZeroOneAdam"]
