"""``deepspeed.runtime.zero.stage_1_and_2``: DeepSpeed's ZeRO-2 memory estimators (the optimizer itself is
``zerospeed.zero``)."""

from zerospeed.plan.estimators import (estimate_zero2_model_states_mem_needs,
                                       estimate_zero2_model_states_mem_needs_all_cold,
                                       estimate_zero2_model_states_mem_needs_all_live, model_to_params)

__all__ = ["estimate_zero2_model_states_mem_needs", "estimate_zero2_model_states_mem_needs_all_cold",
           "estimate_zero2_model_states_mem_needs_all_live", "model_to_params"]
