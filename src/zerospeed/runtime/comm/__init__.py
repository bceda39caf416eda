"""``deepspeed.runtime.comm``: the 1-bit optimizers' compressed all-reduce backends, at DeepSpeed's paths.

``compressed.CompressedBackend`` is the one implementation (:mod:`zerospeed.distributed.compressed`
through the comm door); ``nccl.NcclBackend`` and ``mpi.MpiBackend`` name it for scripts written
against those backends, whatever process-group backend actually runs.
"""

from zerospeed._lazy_submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)
