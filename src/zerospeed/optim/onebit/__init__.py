"""Communication-compressed optimizers: 1-bit Adam, 0/1 Adam and 1-bit LAMB (DeepSpeed's algorithms,
made to run on any backend of the comm door and resumable at any world size)."""

from .adam import OnebitAdam
from .base import COMM_BACKENDS, CompressedMomentum, OneBitOptimizer, padded_length
from .lamb import OnebitLamb
from .zoadam import ZeroOneAdam

__all__ = ["COMM_BACKENDS", "CompressedMomentum", "OneBitOptimizer", "OnebitAdam", "OnebitLamb", "ZeroOneAdam",
           "padded_length"]
