"""``deepspeed.runtime.zero.partition_parameters``: ZeRO-3 construction and gathering."""

from zerospeed.zero import GatheredParameters, Init, register_external_parameter, unregister_external_parameter

__all__ = ["GatheredParameters", "Init", "register_external_parameter", "unregister_external_parameter"]
