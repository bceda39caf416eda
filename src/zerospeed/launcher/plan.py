"""Turn what the user asked for into what to launch, without touching processes or the network.

``LaunchRequest`` is the parsed command line; :func:`resolve_plan` combines it with the facts of the
machine (hostfile contents, CUDA device count, inherited ``CUDA_VISIBLE_DEVICES``) into a
``LaunchPlan``. Keeping this pure lets every rule (DeepSpeed's precedence of hostfile, --include,
--num_nodes, --num_gpus) be unit-tested with exact values.

DeepSpeed's selection, as its runner applies it: the hosts in hostfile order; ``--include``/``--exclude``
(never together with ``--num_nodes``/``--num_gpus``); ``--num_nodes K`` keeps the first K hosts;
``--num_gpus N`` the first N slots of every host. A plan is multi-node when it keeps more than one host or
``--force_multi`` is given, and is then started by a runner on every host (unless ``--no_ssh``: the user
starts ``zerospeed --no_ssh --node_rank=k`` on each). Where DeepSpeed silently runs something else than
asked, we refuse, naming the flag: ``--num_nodes`` above the hostfile's host count (DeepSpeed takes all),
``--num_gpus`` above a host's slots (DeepSpeed starts ranks on devices the host does not have), slots or
hosts that ``--include`` names but the hostfile lacks (DeepSpeed accepts unknown slots), ``--node_rank``
without ``--no_ssh`` and ``--min/max_elastic_nodes`` without ``--elastic_training`` (DeepSpeed ignores
them).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import TYPE_CHECKING

from zerospeed.distributed.defaults import DEFAULT_ADDR, DEFAULT_PORT
from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.hostfile import local_resources, parse_inclusion_exclusion

if TYPE_CHECKING:
    from zerospeed.launcher.job import JobSpec


__all__ = ["DEFAULT_HOSTFILE", "DEFAULT_MASTER_ADDR", "DEFAULT_MASTER_PORT", "JobOptions", "LaunchMode",
           "LaunchPlan", "LaunchRequest", "Program", "check_request", "check_without_hostfile", "job_spec", "parse_core_list",
           "resolve_plan", "stable_job_id"]

DEFAULT_MASTER_ADDR = DEFAULT_ADDR
DEFAULT_MASTER_PORT = DEFAULT_PORT
#: DeepSpeed's default hostfile (``DLTS_HOSTFILE``); used when it exists and no ``--hostfile`` is given.
DEFAULT_HOSTFILE = "/job/hostfile"


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
class JobOptions:
    """What the node agent does besides starting the ranks (DeepSpeed's ``launch.py`` options):
    ``--bind_cores_to_rank`` (with ``--bind_core_list``, e.g. ``"0-3,8"``), ``--enable_each_rank_log DIR``
    and ``--save_pid``. Only the node agent applies them, so a single-node launch that asks for one runs
    through the agent too."""

    bind_cores_to_rank: bool = False
    bind_core_list: str | None = None
    each_rank_log_dir: str | None = None
    save_pid: bool = False


@dataclass(frozen=True)
class LaunchRequest:
    """The launcher options as given; ``None`` means "not given" so defaults are decided in one place."""

    program: Program
    num_procs: int | None = None
    num_nodes: int | None = None
    include: str | None = None
    exclude: str | None = None
    hostfile: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    force_multi: bool = False
    no_ssh: bool = False
    node_rank: int | None = None
    elastic_training: bool = False
    min_elastic_nodes: int | None = None
    max_elastic_nodes: int | None = None
    options: JobOptions = field(default_factory=JobOptions)


class LaunchMode(Enum):
    """How a plan starts: ``LOCAL``: this machine's ranks under torch's agent in this process (the
    single-node launcher); ``NODE``: this host's node agent in this process (``--no_ssh``, or one host with
    options only the agent applies); ``RUNNER``: a runner (pdsh, ssh, mpirun, srun) starts an agent on
    every host."""

    LOCAL = "local"
    NODE = "node"
    RUNNER = "runner"


@dataclass(frozen=True)
class LaunchPlan:
    """A fully resolved launch: which slots on which hosts, where rank 0 listens, what runs.

    ``resources`` lists the hosts in hostfile (= node rank) order. For a single-node plan ``master_port``
    stays ``None`` when the user did not choose one (the runner then tries the default and falls back to
    a free port) and ``0`` asks for a free port; a multi-node plan always has a port (default 29500: no
    local probe can tell whether a remote port is free). ``visible_devices`` is the value for
    ``CUDA_VISIBLE_DEVICES``, set only for a single-node plan when CUDA exists and --include/--exclude
    picked devices (on several hosts each agent maps its own slots). ``node_rank`` is set for
    ``--no_ssh``; ``elastic_nodes`` is ``(min, max)`` with ``--elastic_training``.
    """

    resources: Mapping[str, tuple[int, ...]]
    program: Program
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int | None = None
    visible_devices: tuple[str, ...] | None = None
    hosts_from: str = "this machine"
    multi_node: bool = False
    node_rank: int | None = None
    elastic_nodes: tuple[int, int] | None = None
    options: JobOptions = field(default_factory=JobOptions)

    @property
    def num_nodes(self) -> int:
        return len(self.resources)

    @property
    def nproc_per_node(self) -> int:
        """Ranks on the first host (all of them for a single-node plan; hosts may differ otherwise)."""
        return len(next(iter(self.resources.values())))

    @property
    def world_size(self) -> int:
        return sum(len(slots) for slots in self.resources.values())

    @property
    def mode(self) -> LaunchMode:
        if self.node_rank is not None:
            return LaunchMode.NODE
        if self.multi_node:
            return LaunchMode.RUNNER
        if self.elastic_nodes is not None or self.options != JobOptions():
            return LaunchMode.NODE
        return LaunchMode.LOCAL


def resolve_plan(
    request: LaunchRequest,
    *,
    hostfile_resources: Mapping[str, int] | None,
    default_local_slots: int,
    cuda_available: bool = False,
    inherited_visible_devices: str | None = None,
    checked: bool = False,
) -> LaunchPlan:
    """Apply DeepSpeed's resource rules to ``request``.

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
        check_without_hostfile(request)
        pool = local_resources(request.num_procs or default_local_slots)
        hosts_from = "this machine"
    else:
        pool = dict(hostfile_resources)
        hosts_from = f"hostfile {request.hostfile}" if request.hostfile else "the hostfile"
    active = parse_inclusion_exclusion(pool, request.include, request.exclude)
    if request.num_nodes is not None:
        if request.num_nodes > len(active):
            raise LauncherError(
                f"--num_nodes {request.num_nodes} exceeds the {len(active)} host(s) of {hosts_from} "
                f"({', '.join(active)}); lower --num_nodes or add hosts"
            )
        active = dict(list(active.items())[: request.num_nodes])
    if hostfile_resources is not None and request.num_procs is not None:
        active = {host: _first_slots(host, slots, request.num_procs) for host, slots in active.items()}
    multi_node = request.force_multi or len(active) > 1
    node_rank = _node_rank(request, list(active))
    spans_hosts = multi_node or node_rank is not None
    visible = None
    if cuda_available and filtering and not spans_hosts:
        visible = _visible_devices(next(iter(active.values())), inherited_visible_devices)
    return LaunchPlan(
        resources=MappingProxyType({host: tuple(slots) for host, slots in active.items()}),
        program=request.program,
        master_addr=_master_addr(request, list(active), spans_hosts and hostfile_resources is not None),
        master_port=_master_port(request, spans_hosts),
        visible_devices=visible,
        hosts_from=hosts_from,
        multi_node=multi_node,
        node_rank=node_rank,
        elastic_nodes=_elastic_nodes(request, len(active)),
        options=request.options,
    )


def check_request(request: LaunchRequest) -> None:
    """Reject what is wrong whatever the machine holds (counts, ports, conflicting flags).

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
    if request.node_rank is not None and not request.no_ssh:
        raise LauncherError(
            f"--node_rank {request.node_rank} is only used with --no_ssh (each host started by hand); add "
            "--no_ssh, or drop --node_rank and let the runner start every host"
        )
    if request.no_ssh and request.node_rank is None:
        raise LauncherError(
            "--no_ssh needs --node_rank: this host's position (0-based) among the selected hosts of the "
            "hostfile; run the same command on every host with its own --node_rank"
        )
    if not request.elastic_training:
        for flag, value in (("--min_elastic_nodes", request.min_elastic_nodes),
                            ("--max_elastic_nodes", request.max_elastic_nodes)):
            if value is not None:
                raise LauncherError(f"{flag} {value} only applies with --elastic_training; add it or drop {flag}")
    elif request.master_addr is None:
        raise LauncherError(
            "--elastic_training needs --master_addr: the address of the host that keeps the rendezvous "
            "(it must stay up for the whole job), as in DeepSpeed"
        )
    options = request.options
    if options.bind_core_list is not None:
        if not options.bind_cores_to_rank:
            raise LauncherError(
                f"--bind_core_list {options.bind_core_list!r} only applies with --bind_cores_to_rank; add it"
            )
        parse_core_list(options.bind_core_list)
    if options.each_rank_log_dir is not None and not options.each_rank_log_dir.strip():
        raise LauncherError("--enable_each_rank_log needs a folder name, got an empty string")


def check_without_hostfile(request: LaunchRequest) -> None:
    """What a request without a hostfile cannot ask (DeepSpeed: "Num nodes is >1 but no extra nodes
    available via hostfile"); the launcher calls it before it counts CUDA devices."""
    if request.num_nodes is not None and request.num_nodes > 1:
        raise LauncherError(
            f"--num_nodes {request.num_nodes} needs a hostfile listing the hosts (-H/--hostfile; "
            f"{DEFAULT_HOSTFILE} when it exists); without one zerospeed runs on this machine only"
        )


def parse_core_list(text: str) -> tuple[int, ...]:
    """DeepSpeed's ``--bind_core_list`` syntax: comma-separated core ids and ``a-b`` ranges (``1,3-5,7`` ->
    1, 3, 4, 5, 7), in the given order, each core once."""
    cores: list[int] = []
    for item in text.split(","):
        part = item.strip()
        low, dash, high = part.partition("-")
        numbers = (low, high) if dash else (low,)
        if not all(n.strip().isascii() and n.strip().isdigit() for n in numbers):
            raise LauncherError(
                f"--bind_core_list {text!r}: {part!r} is not a core id or an 'a-b' range; write e.g. '0-3,8'"
            )
        first = int(low)
        last = int(high) if dash else first
        if last < first:
            raise LauncherError(f"--bind_core_list {text!r}: range {part!r} runs backwards; write it low-high")
        for core in range(first, last + 1):
            if core in cores:
                raise LauncherError(f"--bind_core_list {text!r}: core {core} is listed twice")
            cores.append(core)
    return tuple(cores)


def job_spec(plan: LaunchPlan, *, job_id: str, master_port: int | None = None) -> JobSpec:
    """The :class:`~zerospeed.launcher.job.JobSpec` every host of ``plan`` receives: the hosts in node-rank
    order with their slots, the rendezvous, the program, elastic limits and the agent's options.
    ``master_port`` resolves a single-node plan's unset port (the launcher chooses a free one locally)."""
    from zerospeed.launcher.job import ElasticSpec, JobSpec  # job.py imports Program from this module

    port = plan.master_port if master_port is None else master_port
    if port is None:
        raise LauncherError("the job needs a master port; pass --master_port")
    elastic = None
    if plan.elastic_nodes is not None:
        elastic = ElasticSpec(min_nodes=plan.elastic_nodes[0], max_nodes=plan.elastic_nodes[1])
    options = plan.options
    return JobSpec(
        job_id=job_id,
        world=tuple((host, tuple(slots)) for host, slots in plan.resources.items()),
        master_addr=plan.master_addr,
        master_port=port,
        program=plan.program,
        elastic=elastic,
        bind_cores_to_rank=options.bind_cores_to_rank,
        bind_core_list=options.bind_core_list,
        each_rank_log_dir=options.each_rank_log_dir,
        save_pid=options.save_pid,
    )


def stable_job_id(plan: LaunchPlan) -> str:
    """A job id every host of a ``--no_ssh`` job computes alike (each runs its own ``zerospeed``, so no
    random id can be shared; it is also torch's rendezvous run id, so hosts with different ids never
    meet): 12 hex digits of a hash of only what every host must agree on anyway, the world (hosts and
    slots), the rendezvous address and port, and the elastic node range. The program, its arguments and
    the agent options are left out: hosts may run ``./train.py`` or ``train.py``, or pass per-host
    arguments (``--output_dir``), and must still meet. Two such jobs differ in at least their rendezvous
    while both run."""
    facts = {
        "world": [[host, list(slots)] for host, slots in plan.resources.items()],
        "master": [plan.master_addr, plan.master_port],
        "elastic": plan.elastic_nodes,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode("utf-8")).hexdigest()[:12]


def _node_rank(request: LaunchRequest, hosts: list[str]) -> int | None:
    """``--no_ssh``'s ``--node_rank``, checked against the selected hosts (as DeepSpeed asserts)."""
    if not request.no_ssh:
        return None
    if request.node_rank is None:
        raise LauncherError("--no_ssh needs --node_rank")  # check_request says it first, with the fix
    if not 0 <= request.node_rank < len(hosts):
        raise LauncherError(
            f"--node_rank {request.node_rank} is outside the {len(hosts)} selected host(s) "
            f"({', '.join(hosts)}); node ranks are 0..{len(hosts) - 1}, in hostfile order"
        )
    return request.node_rank


def _master_addr(request: LaunchRequest, hosts: list[str], from_hostfile: bool) -> str:
    """Given, else the first selected host for a job across hostfile hosts (DeepSpeed asks that host's
    ``hostname -I`` over ssh; its name reaches the same machine from every host without that round
    trip), else 127.0.0.1 (this machine only)."""
    if request.master_addr is not None:
        return request.master_addr
    return hosts[0] if from_hostfile else DEFAULT_MASTER_ADDR


def _master_port(request: LaunchRequest, spans_hosts: bool) -> int | None:
    if not spans_hosts:
        return request.master_port
    if request.master_port == 0:
        raise LauncherError(
            "--master_port 0 (any free port) only works on one machine: the other hosts cannot learn the "
            f"port; pass a fixed --master_port (default {DEFAULT_MASTER_PORT})"
        )
    return DEFAULT_MASTER_PORT if request.master_port is None else request.master_port


def _elastic_nodes(request: LaunchRequest, hosts: int) -> tuple[int, int] | None:
    """DeepSpeed's defaults: min 1, max the number of hosts. The job starts an agent on every selected
    host, so min above that count would wait forever and max below it would leave hosts idle."""
    if not request.elastic_training:
        return None
    low = 1 if request.min_elastic_nodes is None else request.min_elastic_nodes
    high = hosts if request.max_elastic_nodes is None else request.max_elastic_nodes
    if not 1 <= low <= high:
        raise LauncherError(
            f"--min_elastic_nodes {low} and --max_elastic_nodes {high} must satisfy 1 <= min <= max"
        )
    if low > hosts:
        raise LauncherError(
            f"--min_elastic_nodes {low} exceeds the {hosts} selected host(s); the job could never start; "
            "lower it or select more hosts"
        )
    if high < hosts:
        raise LauncherError(
            f"--max_elastic_nodes {high} is below the {hosts} selected host(s), which would leave "
            f"{hosts - high} of them idle; raise it or select fewer hosts (--num_nodes {high})"
        )
    return low, high


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
    if request.master_addr is not None and not request.master_addr:
        raise LauncherError("--master_addr must not be empty")
    for flag, value in (("--min_elastic_nodes", request.min_elastic_nodes),
                        ("--max_elastic_nodes", request.max_elastic_nodes)):
        if value is not None and value < 1:
            raise LauncherError(f"{flag} must be at least 1, got {value}")


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
