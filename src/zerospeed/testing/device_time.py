"""Simulated device time for pipeline tests and benchmarks: autograd functions that sleep.

A stage busy on an accelerator leaves its host CPU free. Sleeping reproduces that on a CPU-only
machine, so four pipeline stages on two cores behave as four devices and a schedule's bubble costs
wall time, as it does on accelerators. Torch only (``benchmarks/_pipe_bench.py`` loads this file by
path in DeepSpeed's interpreter, which has no zerospeed).
"""

from __future__ import annotations

import time
from typing import Any

import torch


class DeviceTime(torch.autograd.Function):
    """Identity on activations costing ``forward_s`` in forward and ``input_s`` in the input gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, input_s: float) -> torch.Tensor:
        time.sleep(forward_s)
        ctx.input_s = input_s
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        time.sleep(ctx.input_s)
        return grad, None, None


class DeviceWeightTime(torch.autograd.Function):
    """A zero (``weight * 0``) whose gradient costs ``weight_s``: the weight-gradient part of backward,
    which a zero-bubble schedule defers and the others run at once. Give it a weight of its own: one
    the block also uses on its input path is a shared weight, whose backward cannot be split."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, weight_s: float) -> torch.Tensor:
        ctx.weight_s = weight_s
        return weight * 0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        time.sleep(ctx.weight_s)
        return grad * 0, None


__all__ = ["DeviceTime", "DeviceWeightTime"]
