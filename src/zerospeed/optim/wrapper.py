"""The optimizer object ``initialize`` hands back: the user's torch optimizer plus the loss scale.

DeepSpeed returns a wrapper whose ``cur_scale`` is the live loss scale; scripts read it. Stepping
must go through ``engine.step()`` (which reduces, unscales, checks overflow and clips first), so a
direct ``step()`` here is refused with the fix.
"""

from __future__ import annotations

from typing import Any

import torch


class EngineOptimizer:
    """A thin view of ``optimizer`` for user code; attributes not defined here pass through."""

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: Any):
        self.optimizer = optimizer
        self._scaler = scaler

    @property
    def cur_scale(self) -> float:
        return float(self._scaler.loss_scale)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def step(self, closure: Any = None) -> None:
        raise RuntimeError("call engine.step() instead of optimizer.step(): the engine averages, unscales, "
                           "checks for overflow and clips the gradients before the optimizer runs")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"EngineOptimizer({self.optimizer!r}, cur_scale={self.cur_scale:g})"
