"""``deepspeed.runtime.zero``: the ZeRO names DeepSpeed exports here (the same objects as ``zerospeed.zero``)."""

from zerospeed.zero import GatheredParameters, Init, TiledLinear, register_external_parameter, unregister_external_parameter

__all__ = ["GatheredParameters", "Init", "TiledLinear", "register_external_parameter", "unregister_external_parameter"]

from zerospeed._lazy_submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)
