"""``deepspeed.runtime.zero.stage3``: DeepSpeed's ZeRO-3 memory estimators (``model_to_params`` here returns
the total and the largest layer's parameters, as DeepSpeed's stage-3 version does)."""

from zerospeed.plan.estimators import (estimate_zero3_model_states_mem_needs,
                                       estimate_zero3_model_states_mem_needs_all_cold,
                                       estimate_zero3_model_states_mem_needs_all_live)
from zerospeed.plan.estimators import model_to_params_and_largest_layer as model_to_params

__all__ = ["estimate_zero3_model_states_mem_needs", "estimate_zero3_model_states_mem_needs_all_cold",
           "estimate_zero3_model_states_mem_needs_all_live", "model_to_params"]
