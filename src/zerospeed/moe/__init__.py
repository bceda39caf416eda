"""Mixture of experts under DeepSpeed's module name (``deepspeed.moe``).

Only the parameter-group helpers exist so far (scripts import them even without MoE layers);
the expert-parallel ``MoE`` layer lands with expert parallelism.
"""

from zerospeed._lazy_submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)
