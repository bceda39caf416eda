"""Memory planning, ``wall_clock_breakdown`` timers and the flops profiler (``flops_profiler/``, imported
when first reached: ``zerospeed.profiling.flops_profiler.FlopsProfiler`` after a bare ``import zerospeed``)."""

from zerospeed._lazy_submodules import submodule_getattr
from zerospeed.profiling.memory import MemoryPlan, model_state_bytes

__getattr__ = submodule_getattr(__name__)

__all__ = ["MemoryPlan", "model_state_bytes"]
