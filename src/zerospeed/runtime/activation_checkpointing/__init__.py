"""``deepspeed.runtime.activation_checkpointing``."""

from zerospeed._lazy_submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)
