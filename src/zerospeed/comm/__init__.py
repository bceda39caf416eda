"""``zerospeed.comm``: DeepSpeed's public communication module (``import zerospeed.comm as dist``).

The calls keep ``torch.distributed``'s meaning (``group=``, ``async_op=``, global ``src`` ranks)
and DeepSpeed's signatures; they run through :mod:`zerospeed.distributed` (see :mod:`.api`).
"""

from zerospeed.comm.api import *  # noqa: F401,F403
from zerospeed.comm.api import __all__  # noqa: F401
