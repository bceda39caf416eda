"""Turn what the user asked for into what to launch, without touching processes or the network.

``LaunchRequest`` is the parsed command line; :func:`resolve_plan` combines it with the facts of the
machine (hostfile contents, CUDA device count, inherited ``CUDA_VISIBLE_DEVICES``) into a
``LaunchPlan``. Keeping this pure lets every rule (DeepSpeed's precedence of hostfile, --include,
--num_nodes, --num_gpus) be unit-tested with exact values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from zerospeed.distributed.defaults import DEFAULT_ADDR, DEFAULT_PORT
from zerospeed.launcher.errors import LauncherError, MultiNodeNotImplementedError
from zerospeed.launcher.hostfile import local_resources, parse_inclusion_exclusion


__all__ = ["DEFAULT_MASTER_ADDR", "DEFAULT_MASTER_PORT", "LaunchPlan", "LaunchRequest", "Program",
           "check_request", "resolve_plan"]

DEFAULT_MASTER_ADDR = DEFAULT_ADDR
DEFAULT_MASTER_PORT = DEFAULT_PORT


@dataclass(frozen=True)
class Program:
    """What every rank runs. ``args`` are the user's script arguments, passed on verbatim."""

    script: str
    args: tuple[str, ...] = ()
    module: bool = False
    no_python: bool = False
    append_local_rank: bool = False

    def __post_init__(self) -> None:
        if self.module and self.no_python:
            raise LauncherError("--module and --no_python cannot be used together")


@dataclass(frozen=True)
class LaunchRequest:
    """The launcher options as given; ``None`` means "not given" so defaults are decided in one place."""

    program: Program
    num_procs: int | None = None
    num_nodes: int | None = None
    include: str | None = None
    exclude: str | None = None
    hostfile: str | None = None
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int | None = None


@dataclass(frozen=True)
class LaunchPlan:
    """A fully resolved launch: which slots on which hosts, where rank 0 listens, what runs.

    ``master_port`` stays ``None`` when the user did not choose one (the runner then tries the default
    and falls back to a free port); ``0`` asks for a free port. ``visible_devices`` is the value for
    ``CUDA_VISIBLE_DEVICES``, set only when CUDA exists and --include/--exclude picked devices.
    """

    resources: Mapping[str, tuple[int, ...]]
    program: Program
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int | None = None
    visible_devices: tuple[str, ...] | None = None
    hosts_from: str = "this machine"

    @property
    def num_nodes(self) -> int:
        return len(self.resources)

    @property
    def nproc_per_node(self) -> int:
        """Ranks on the (single) node; multi-node plans are rejected before anyone asks."""
        return len(next(iter(self.resources.values())))


def resolve_plan(
    request: LaunchRequest,
    *,
    hostfile_resources: Mapping[str, int] | None,
    default_local_slots: int,
    cuda_available: bool = False,
    inherited_visible_devices: str | None = None,
    checked: bool = False,
) -> LaunchPlan:
    """Apply DeepSpeed's resource rules to ``request`` and reject what we cannot launch yet.

    Without a hostfile the pool is ``localhost`` with ``--num_procs`` slots (default
    ``default_local_slots``: the CUDA device count, or 1). With a hostfile, --include/--exclude
    select slots, --num_nodes keeps the first K hosts and --num_procs the first N slots per host.
    ``checked=True`` skips :func:`check_request`, for a caller that ran it already (the launcher does,
    once, before it may import torch).
    """
    if not checked:
        check_request(request)
    filtering = bool(request.include or request.exclude)
    if hostfile_resources is None:
        pool = local_resources(request.num_procs or default_local_slots)
        hosts_from = "this machine"
    else:
        pool = dict(hostfile_resources)
        hosts_from = f"hostfile {request.hostfile}" if request.hostfile else "the hostfile"
    active = parse_inclusion_exclusion(pool, request.include, request.exclude)
    if request.num_nodes is not None:
        active = dict(list(active.items())[: request.num_nodes])
    if hostfile_resources is not None and request.num_procs is not None:
        active = {host: _first_slots(host, slots, request.num_procs) for host, slots in active.items()}
    if len(active) > 1:
        raise MultiNodeNotImplementedError(
            f"multi-node launch is not implemented yet: {hosts_from} spans {len(active)} hosts "
            f"({', '.join(active)}); pick one with --num_nodes 1 or --include <host>"
        )
    visible = None
    if cuda_available and filtering:
        visible = _visible_devices(next(iter(active.values())), inherited_visible_devices)
    return LaunchPlan(
        resources=MappingProxyType({host: tuple(slots) for host, slots in active.items()}),
        program=request.program,
        master_addr=request.master_addr,
        master_port=request.master_port,
        visible_devices=visible,
        hosts_from=hosts_from,
    )


def check_request(request: LaunchRequest) -> None:
    """Reject what is wrong whatever the machine holds (counts, ports, conflicting flags, multi-node).

    Needs no hostfile and no device count, so the launcher calls it before importing torch to count
    CUDA devices: a usage error is reported at once. :func:`resolve_plan` calls it too (unless told
    ``checked=True``).
    """
    _check_counts(request)
    if (request.include or request.exclude) and (request.num_procs is not None or request.num_nodes is not None):
        raise LauncherError(
            "--num_procs/--num_gpus/--num_nodes cannot be combined with --include/--exclude; "
            "select slots with one or the other"
        )
    if request.num_nodes is not None and request.num_nodes > 1:
        raise MultiNodeNotImplementedError(
            f"multi-node launch is not implemented yet (--num_nodes {request.num_nodes}); "
            "run with --num_nodes 1 or start one launcher per node"
        )


def _check_counts(request: LaunchRequest) -> None:
    """Reject counts and ports that cannot mean anything, naming the flag."""
    if request.num_procs is not None and request.num_procs < 1:
        raise LauncherError(f"--num_procs/--num_gpus must be at least 1, got {request.num_procs}")
    if request.num_nodes is not None and request.num_nodes < 1:
        raise LauncherError(f"--num_nodes must be at least 1, got {request.num_nodes}")
    if request.master_port is not None and not 0 <= request.master_port <= 65535:
        raise LauncherError(
            f"--master_port must be in 0..65535 (0 = pick a free port), got {request.master_port}"
        )
    if not request.master_addr:
        raise LauncherError("--master_addr must not be empty")


def _first_slots(host: str, slots: list[int], count: int) -> list[int]:
    """The first ``count`` slots of a hostfile host, as DeepSpeed's --num_gpus does."""
    if count > len(slots):
        raise LauncherError(
            f"--num_procs/--num_gpus {count} exceeds the {len(slots)} slots of host {host!r} in the "
            "hostfile; lower it or raise that host's slots="
        )
    return slots[:count]


def _visible_devices(slots: list[int], inherited: str | None) -> tuple[str, ...]:
    """Map selected slot ids to device ids, through an inherited ``CUDA_VISIBLE_DEVICES`` if any."""
    if not inherited:
        return tuple(str(slot) for slot in slots)
    parent = [item.strip() for item in inherited.split(",") if item.strip()]
    missing = [slot for slot in slots if slot >= len(parent)]
    if missing:
        raise LauncherError(
            f"selected device slot(s) {missing} but CUDA_VISIBLE_DEVICES={inherited!r} exposes only "
            f"{len(parent)} device(s); adjust --include/--exclude or CUDA_VISIBLE_DEVICES"
        )
    return tuple(parent[slot] for slot in slots)
