"""Distributed runtime: rank discovery, process groups, and the single door to collectives.

The names below are imported on first use (PEP 562), so importing a torch-free submodule such as
``zerospeed.distributed.defaults`` (the launcher does, to check its arguments) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zerospeed._lazy_submodules import lazy_attributes as _lazy_attributes

if TYPE_CHECKING:
    from zerospeed.distributed.comm import CollectiveError, CollectiveTimeout, Comm, CommCounts, CommStats, Handle
    from zerospeed.distributed.env import DistEnv, discover, init_distributed, shutdown_distributed
    from zerospeed.distributed.mesh import Mesh, ParallelDims

_LAZY = {
    **dict.fromkeys(("CollectiveError", "CollectiveTimeout", "Comm", "CommCounts", "CommStats", "Handle"),
                    "zerospeed.distributed.comm"),
    **dict.fromkeys(("DistEnv", "discover", "init_distributed", "shutdown_distributed"), "zerospeed.distributed.env"),
    **dict.fromkeys(("Mesh", "ParallelDims"), "zerospeed.distributed.mesh"),
}

__all__ = [
    "CollectiveError", "CollectiveTimeout", "Comm", "CommCounts", "CommStats", "Handle", "DistEnv", "discover",
    "init_distributed", "shutdown_distributed", "Mesh", "ParallelDims",
]

__getattr__, __dir__ = _lazy_attributes(__name__, _LAZY, public=__all__)
