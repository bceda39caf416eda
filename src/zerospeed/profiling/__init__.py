"""Memory planning (and, later, timers and FLOPs profiling)."""

from zerospeed.profiling.memory import MemoryPlan, model_state_bytes

__all__ = ["MemoryPlan", "model_state_bytes"]
