"""DeepSpeed's ``deepspeed.profiling.flops_profiler``: count a model's FLOPs, MACs and parameters
(forward and, measured, backward) per module; see ``profiler.py`` and, for what each op costs, ``rules.py``."""

from zerospeed.profiling.flops_profiler.profiler import (FlopsProfiler, ModelTotals, get_model_profile)
from zerospeed.profiling.flops_profiler.units import (bytes_to_string, duration_to_string, flops_to_string,
                                                      macs_to_string, number_to_string, params_to_string)

__all__ = ["FlopsProfiler", "ModelTotals", "get_model_profile", "number_to_string", "macs_to_string",
           "flops_to_string", "params_to_string", "duration_to_string", "bytes_to_string"]
