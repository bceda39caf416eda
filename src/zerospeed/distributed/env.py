"""Rank discovery and process-group start-up.

:func:`discover` is pure: it reads a mapping of environment variables set by torchrun (or our
launcher), SLURM, Open MPI or an MPICH/Intel-MPI style PMI, and returns who this process is.
:func:`init_distributed` turns that into a running process group.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import os
import re
from dataclasses import dataclass
from typing import Literal, Mapping

import torch
import torch.distributed as dist

from zerospeed.accelerator import get_accelerator
from zerospeed.distributed.defaults import DEFAULT_ADDR, DEFAULT_PORT

Source = Literal["torchrun", "slurm", "openmpi", "pmi", "single"]
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class DistEnv:
    """Who this process is in the job, and where rank 0 listens."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: Source


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    raw = env.get(key)
    if raw is None:
        if default is None:
            raise ValueError(f"environment variable {key} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {key}={raw!r} is not an integer") from None


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``node[03-05,9],gpu1`` -> ``node03``,
    ``rack[1-2]-n[01-04]`` -> ``rack1-n01``."""
    out, depth, group = [], 0, ""
    for ch in nodelist.strip():
        if ch == "," and depth == 0:
            break
        if ch == "[":
            depth, group = depth + 1, ""
        elif ch == "]":
            depth -= 1
            out.append(re.split(r"[-,]", group)[0])
        elif depth:
            group += ch
        else:
            out.append(ch)
    host = "".join(out)
    if not host or depth:
        raise ValueError(f"cannot read a host from SLURM node list {nodelist!r}")
    return host


def slurm_tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Tasks on node ``node_id`` from SLURM's compressed ``SLURM_TASKS_PER_NODE`` (``4(x2),2``)."""
    counts: list[int] = []
    for item in tasks_per_node.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not match:
            raise ValueError(f"SLURM_TASKS_PER_NODE={tasks_per_node!r} is not in SLURM's format (e.g. 4(x2),2)")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if not 0 <= node_id < len(counts):
        raise ValueError(f"SLURM_NODEID={node_id} is outside SLURM_TASKS_PER_NODE={tasks_per_node!r}")
    return counts[node_id]


def discover(env: Mapping[str, str], default_port: int = DEFAULT_PORT) -> DistEnv:
    """Read rank and world size from the first launcher whose variables are present.

    Order: torchrun-style (``RANK``/``WORLD_SIZE``; also what our launcher sets), Open MPI, PMI,
    then SLURM (an ``mpirun`` inside an ``sbatch`` job inherits the batch step's SLURM variables,
    so MPI's own must win); with none of them, a single-process world.
    """
    port = _int(env, "MASTER_PORT", default_port)
    if "RANK" in env or "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE")
        return _checked(
            DistEnv(
                rank=_int(env, "RANK"),
                world_size=world,
                local_rank=_int(env, "LOCAL_RANK", 0),
                local_world_size=_int(env, "LOCAL_WORLD_SIZE", world),
                master_addr=env.get("MASTER_ADDR", DEFAULT_ADDR),
                master_port=port,
                source="torchrun",
            )
        )
    if "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        return _checked(_from_mpi(env, port, "OMPI_COMM_WORLD_", "openmpi"))
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        return _checked(_from_mpi(env, port, "PMI_", "pmi"))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world = _int(env, "SLURM_NTASKS")
        addr = env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", DEFAULT_ADDR)))
        if "SLURM_TASKS_PER_NODE" in env:
            local_world = slurm_tasks_on_node(env["SLURM_TASKS_PER_NODE"], _int(env, "SLURM_NODEID", 0))
        else:
            local_world = _int(env, "SLURM_NTASKS_PER_NODE", world)
        return _checked(
            DistEnv(
                rank=_int(env, "SLURM_PROCID"),
                world_size=world,
                local_rank=_int(env, "SLURM_LOCALID", 0),
                local_world_size=local_world,
                master_addr=addr,
                master_port=port,
                source="slurm",
            )
        )
    return DistEnv(0, 1, 0, 1, env.get("MASTER_ADDR", DEFAULT_ADDR), port, "single")


def _from_mpi(env: Mapping[str, str], port: int, prefix: str, source: Source) -> DistEnv:
    world = _int(env, prefix + "SIZE")
    local_key = "OMPI_COMM_WORLD_LOCAL_SIZE" if source == "openmpi" else "MPI_LOCALNRANKS"
    local_size = _int(env, local_key, world)
    addr = env.get("MASTER_ADDR")
    if addr is None:
        if local_size != world:
            raise ValueError(
                f"{source} launch across several nodes needs MASTER_ADDR set to rank 0's host "
                f"(world size {world}, {local_size} ranks on this node)"
            )
        addr = DEFAULT_ADDR
    return DistEnv(
        rank=_int(env, prefix + "RANK"),
        world_size=world,
        local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK" if source == "openmpi" else "MPI_LOCALRANKID", 0),
        local_world_size=local_size,
        master_addr=addr,
        master_port=port,
        source=source,
    )


def _checked(info: DistEnv) -> DistEnv:
    if info.world_size < 1:
        raise ValueError(f"world size {info.world_size} from {info.source} variables must be >= 1")
    if not 0 <= info.rank < info.world_size:
        raise ValueError(
            f"rank {info.rank} from {info.source} variables is outside world size {info.world_size}"
        )
    return info


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = DEFAULT_PORT,
    verbose: bool = False,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    rank: int = -1,
    world_size: int = -1,
    store: dist.Store | None = None,
) -> DistEnv:
    """Start the default process group (DeepSpeed's signature) unless one is already running.

    The backend defaults to the accelerator's (gloo on CPU, NCCL on CUDA). A process group shut
    down cleanly at exit avoids gloo's "terminate called without an active exception" abort.
    """
    env = dict(os.environ)
    if not auto_mpi_discovery:
        env = {k: v for k, v in env.items() if not k.startswith(("OMPI_", "PMI_"))}
    info = discover(env, default_port=distributed_port)
    if rank >= 0 or world_size >= 0:
        if rank < 0 or world_size < 1:
            raise ValueError(f"give both rank and world_size (got rank={rank}, world_size={world_size})")
        info = _checked(DistEnv(rank, world_size, info.local_rank, info.local_world_size,
                                info.master_addr, info.master_port, info.source))
    if dist.is_initialized():
        # A group someone else started (Lightning, Accelerate, a user) is the truth for rank and size,
        # whatever the environment variables say. zerospeed's collectives run on it, so it is shut down
        # cleanly at exit too (a gloo group alive at interpreter teardown aborts the process).
        atexit.unregister(shutdown_distributed)
        atexit.register(shutdown_distributed)
        return dataclasses.replace(info, rank=dist.get_rank(), world_size=dist.get_world_size())
    if dist_init_required is False:
        return info
    accel = get_accelerator()
    backend = dist_backend or accel.backend
    if backend == "nccl":  # gloo ranks (e.g. CPU tests on a GPU box) need not own a device
        accel.set_device(info.local_rank)
    kwargs: dict = dict(backend=backend, timeout=timeout)
    if store is not None:
        kwargs.update(store=store, rank=info.rank, world_size=info.world_size)
    elif init_method is not None:
        kwargs.update(init_method=init_method, rank=info.rank, world_size=info.world_size)
    elif info.world_size == 1 and info.source == "single":
        # A lone process listens on a free port so two single-process jobs never collide.
        kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
    else:
        kwargs.update(
            store=dist.TCPStore(info.master_addr, info.master_port, info.world_size,
                                is_master=info.rank == 0 and not _agent_hosts_store(env), timeout=timeout),
            rank=info.rank, world_size=info.world_size,
        )
    dist.init_process_group(**kwargs)
    atexit.unregister(shutdown_distributed)
    atexit.register(shutdown_distributed)
    if verbose and info.rank == 0:
        print(f"zerospeed: {backend} process group of {info.world_size} ranks ({info.source})", flush=True)
    return info


def process_group_timeout(default: datetime.timedelta = DEFAULT_TIMEOUT) -> datetime.timedelta:
    """The timeout the default process group was started with (``init_distributed(timeout=...)``),
    so zerospeed's own collectives time out when the user asked them to."""
    world = dist.group.WORLD
    if world is None:  # no default group: nothing to read the timeout from
        return default
    try:
        backend = world._get_backend(torch.device(get_accelerator().device_type))
        return backend.options._timeout
    except Exception:  # older torch, or a backend without options: keep the default
        return default


def _agent_hosts_store(env: Mapping[str, str]) -> bool:
    """torch's elastic agent (our launcher, torchrun) already serves the store on MASTER_PORT."""
    return env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() in ("1", "true")


def shutdown_distributed() -> None:
    """Destroy the default process group if it is still up (safe to call twice)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
