"""``zerospeed.comm``: DeepSpeed's public communication module (``import zerospeed.comm as dist``).

The calls keep ``torch.distributed``'s meaning (``group=``, ``async_op=``, global ``src`` ranks)
and DeepSpeed's signatures; they run through :mod:`zerospeed.distributed` (see :mod:`.api`).
``configure`` and ``log_summary`` drive DeepSpeed's communication logger (see :mod:`.summary`).
"""

from zerospeed.comm.api import *  # noqa: F401,F403
from zerospeed.comm.api import __all__ as _api_names
from zerospeed.comm.summary import (  # noqa: F401
    configure,
    get_comm_operation_count,
    get_logged_comm_ops,
    has_comm_data,
    log_summary,
    reset_log,
)

__all__ = [*_api_names, "configure", "log_summary", "reset_log", "has_comm_data", "get_comm_operation_count",
           "get_logged_comm_ops"]
