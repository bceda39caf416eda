"""``deepspeed.runtime.progressive_layer_drop``: DeepSpeed 0.19.6's ``ProgressiveLayerDrop`` (removed in 0.19.8).

A stateful view of :class:`zerospeed.layer_drop.LayerDropSchedule` for scripts that drive it themselves. The
engine does not use it: it keeps the schedule and reads theta from ``global_steps`` (``engine.get_pld_theta()``).
"""

from __future__ import annotations

from typing import Any

from zerospeed.layer_drop import LayerDropSchedule
from zerospeed.utils.logging import log_dist


class ProgressiveLayerDrop:
    """theta starts at 1.0; ``update_state(global_step)`` sets theta(global_step) (DeepSpeed calls it at each
    accumulation boundary before counting the step); ``get_state()`` is the forward's keywords."""

    def __init__(self, theta: float = 0.5, gamma: float = 0.001) -> None:
        self.schedule = LayerDropSchedule(theta=theta, gamma=gamma)
        self.theta = theta
        self.gamma = gamma
        self.current_theta = 1.0
        log_dist(f"Enabled progressive layer dropping (theta = {self.theta})", ranks=[0])

    def get_state(self) -> dict[str, Any]:
        return {"progressive_layer_drop": True, "pld_theta": self.get_theta()}

    def get_theta(self) -> float:
        return self.current_theta

    def update_state(self, global_step: int) -> None:
        self.current_theta = self.schedule.theta_at(global_step)


__all__ = ["ProgressiveLayerDrop"]
