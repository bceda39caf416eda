"""DeepSpeed's ``deepspeed.comm`` calls, with ``torch.distributed``'s meaning, through zerospeed's door.

Every collective here runs on a :class:`~zerospeed.distributed.comm.Comm` bound to the group the
caller names (``group=None``: every rank), so it has Comm's timeout diagnostics; ``async_op=True``
returns a handle with ``wait()`` and ``is_completed()`` as torch's ``Work`` has. Ranks (``src``) are
global ranks, as in torch. A rank outside ``group`` does nothing and gets None, as in torch.
The Comm is made per call and kept by nobody; it costs a few attribute reads. It records into the
process's comms logger (:mod:`.summary`, the one piece of module state, for DeepSpeed's
``configure`` / ``log_summary``).
"""

from __future__ import annotations

import datetime
import os
from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from zerospeed.distributed import groups
from zerospeed.distributed.comm import Comm, Handle, ReduceOp, reduce_op_name
from zerospeed.distributed.defaults import DEFAULT_PORT
from zerospeed.distributed.env import DEFAULT_TIMEOUT, DistEnv, discover, process_group_timeout, shutdown_distributed
from zerospeed.distributed.env import init_distributed as _start
from zerospeed.distributed.groups import ProcessGroup
from zerospeed.comm.summary import configure_from_config

if TYPE_CHECKING:
    from zerospeed.config import Config

# DeepSpeed's name for the process-group timeout default (zerospeed's: 30 minutes).
default_pg_timeout = DEFAULT_TIMEOUT

__all__ = [
    "ReduceOp", "ProcessGroup", "default_pg_timeout", "init_distributed", "is_available", "is_initialized",
    "get_rank", "get_world_size", "get_local_rank", "barrier", "all_reduce", "all_gather_into_tensor",
    "reduce_scatter_tensor", "broadcast", "new_group", "destroy_process_group",
]


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = DEFAULT_PORT, verbose: bool = True,
                     timeout: datetime.timedelta = default_pg_timeout, init_method: str | None = None,
                     dist_init_required: bool | None = None,
                     config: "Config | Mapping[str, object] | str | None" = None,
                     rank: int = -1, world_size: int = -1) -> DistEnv:
    """Start the default process group unless one is up (the backend defaults to the accelerator's:
    gloo on a CPU-only machine). ``config`` (a Config, a config dict or a JSON path) configures the comms logger
    from its ``comms_logger`` section, as DeepSpeed does. Returns who this process is."""
    if dist_init_required is False and not groups.is_initialized():
        raise RuntimeError("init_distributed(dist_init_required=False) but no process group is running; "
                           "start one first or pass dist_init_required=None")
    if config is not None:
        configure_from_config(config)
    return _start(dist_backend=dist_backend, auto_mpi_discovery=auto_mpi_discovery,
                  distributed_port=distributed_port, verbose=verbose, timeout=timeout,
                  init_method=init_method, rank=rank, world_size=world_size)


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return groups.is_initialized()


def get_rank(group: ProcessGroup | None = None) -> int:
    return groups.group_rank(group)


def get_world_size(group: ProcessGroup | None = None) -> int:
    return groups.group_size(group)


def get_local_rank() -> int:
    """This process's index on its node, from the launcher's variables (0 when run alone)."""
    return discover(dict(os.environ)).local_rank


def new_group(ranks: Sequence[int] | None = None) -> ProcessGroup:
    """A group of ``ranks`` (global ranks); every rank must call it, in the same order."""
    return groups.new_group(ranks)


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Destroy ``group``, or with None every group and the default one."""
    if group is None:
        shutdown_distributed()
    else:
        groups.destroy_group(group)


def barrier(group: ProcessGroup | None = None, async_op: bool = False,
            device_ids: list[int] | None = None) -> Handle | None:
    """Wait for every rank of ``group``. ``device_ids`` is accepted for torch's signature."""
    comm = _comm(group)
    return None if comm is None else comm.barrier(async_op=async_op)


def all_reduce(tensor: torch.Tensor, op: "ReduceOp.RedOpType | ReduceOp" = ReduceOp.SUM, group: ProcessGroup | None = None,
               async_op: bool = False) -> Handle | None:
    comm = _comm(group)
    return None if comm is None else comm.all_reduce(tensor, reduce_op_name(op), async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None,
              async_op: bool = False) -> Handle | None:
    """Copy global rank ``src``'s ``tensor`` to every rank of ``group``."""
    comm = _comm(group)
    if comm is None:
        return None
    if src not in comm.global_ranks:
        raise ValueError(f"broadcast(src={src}): global rank {src} is not in the group (ranks {list(comm.global_ranks)})")
    return comm.broadcast(tensor, src=comm.global_ranks.index(src), async_op=async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group: ProcessGroup | None = None,
                           async_op: bool = False) -> Handle | None:
    """Concatenate every rank's ``tensor`` into ``output_tensor`` (world size times as large)."""
    comm = _comm(group)
    return None if comm is None else comm.all_gather(output_tensor, tensor, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op: "ReduceOp.RedOpType | ReduceOp" = ReduceOp.SUM,
                          group: ProcessGroup | None = None, async_op: bool = False) -> Handle | None:
    """Reduce ``tensor`` (world size times ``output_tensor``) across ranks; keep this rank's part."""
    comm = _comm(group)
    return None if comm is None else comm.reduce_scatter(output_tensor, tensor, reduce_op_name(op),
                                                         async_op=async_op)


def _comm(group: ProcessGroup | None) -> Comm | None:
    """A Comm over ``group`` (None: every rank), or None when this rank is not in it."""
    target = group if group is not None else groups.world_group()
    if groups.group_rank(target) < 0:
        return None
    return Comm(target, name="zerospeed.comm", timeout=process_group_timeout(), track_arrivals=False)
