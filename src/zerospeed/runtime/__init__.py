"""DeepSpeed's module paths (``deepspeed.runtime.*``), as thin re-exports of zerospeed's modules.

zerospeed is organized by responsibility (``zero/``, ``offload/``, ``checkpoint/``...); DeepSpeed
scripts and frameworks import from DeepSpeed's layout. Every DeepSpeed-only path lives under this
package (and ``zerospeed.moe``, ``zerospeed.utils``), so that ``deepspeed.X`` is simply
``zerospeed.X`` once :func:`zerospeed.install_as_deepspeed` runs. Nothing here implements anything:
each name is the same object as its zerospeed original.
"""

from zerospeed._lazy_submodules import submodule_getattr

# ``deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES`` after a bare ``import deepspeed`` (accelerate does this)
__getattr__ = submodule_getattr(__name__)
