"""ZeRO data parallelism: stage 0 (replicated, bucketed all-reduce) and stages 1-3 (sharded).

User-facing names follow ``deepspeed.zero``: :class:`Init`, :func:`GatheredParameters`,
:func:`register_external_parameter`, :class:`TiledLinear`.
"""

from zerospeed.zero.external import register_external_parameter, unregister_external_parameter
from zerospeed.zero.init import GatheredParameters, Init
from zerospeed.zero.tiling import TiledLinear

__all__ = ["GatheredParameters", "Init", "TiledLinear", "register_external_parameter",
           "unregister_external_parameter"]
