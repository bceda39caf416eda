"""``deepspeed.runtime.fp16``: only the communication-compressed optimizers live here in zerospeed
(mixed precision itself is the engine's, see ``zerospeed.precision``)."""

from zerospeed._lazy_submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)
