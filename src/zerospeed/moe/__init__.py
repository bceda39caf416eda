"""Mixture of experts under DeepSpeed's module name (``deepspeed.moe``).

``layer.MoE`` is DeepSpeed's layer (same constructor, attribute and state-dict names, outputs);
``sharded_moe.MOELayer`` does the dispatch (DeepSpeed's capacity path, or the dropless grouped
path) and the expert-parallel token exchange through the comm door (``alltoall``);
``gate.TopKGate`` holds the router weight and ``gating`` the pure top-1/top-2/top-k functions
that produce a ``DispatchPlan``; ``experts.Experts`` holds this rank's expert copies; ``utils``
has the parameter-group helpers (``is_moe_param``,
``split_params_into_different_moe_groups_for_optimizer``).
"""

from zerospeed._lazy_submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)
