"""Distributed runtime: rank discovery, process groups, and the single door to collectives."""

from zerospeed.distributed.comm import CollectiveError, CollectiveTimeout, Comm, CommCounts, CommStats, Handle
from zerospeed.distributed.env import DistEnv, discover, init_distributed, shutdown_distributed
from zerospeed.distributed.mesh import Mesh, ParallelDims

__all__ = [
    "CollectiveError", "CollectiveTimeout", "Comm", "CommCounts", "CommStats", "Handle", "DistEnv", "discover",
    "init_distributed", "shutdown_distributed", "Mesh", "ParallelDims",
]
