"""What a multi-node job is, as one value every host receives: the contract between the runner and
the per-node agent.

The runner on the launching machine resolves the user's request into a :class:`JobSpec` and passes it,
encoded as one URL-safe base64 argument (DeepSpeed passes its ``--world_info`` the same way), to the
node agent (:mod:`zerospeed.launcher.node`) that pdsh, ssh, ``mpirun``, ``srun`` or the user
(``--no_ssh``) starts once on every host. The agent learns which host it is from
:func:`node_rank_of` and starts that host's ranks under torch's elastic agent. Keeping the job one
immutable value means every host starts from the same facts, and the command each runner runs is a
pure function of it (unit-tested with exact command lines).

Importing this module does not import torch.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from types import MappingProxyType

from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.plan import Program

__all__ = ["DEFAULT_RDZV_CONFIGS", "ElasticSpec", "JobSpec", "RUNNER_NODE_RANK_VARIABLES", "node_rank_of"]

# Variables from which a node agent started once per host by an MPI or Slurm runner reads its node
# rank, in the order they are tried (an mpirun inside an sbatch job inherits the SLURM ones, so MPI's
# win). Open MPI, MPICH hydra (PMI), Slurm.
RUNNER_NODE_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_NODEID")


#: The c10d rendezvous settings of a launcher-driven elastic job (torch's keys and its string values, as
#: ``torchrun --rdzv-conf`` passes them; see ``torch.distributed.elastic.rendezvous.dynamic_rendezvous
#: .create_handler``). torch's defaults suit agents that a scheduler starts at unrelated times; ours start
#: together from one runner, and every second a survivor waits is downtime:
#:
#: - ``last_call_timeout=3`` (torch: 30): once ``min_nodes`` hosts joined a round, how long it stays
#:   open for more before the workers start. Every round with fewer than ``max_nodes`` hosts (each one
#:   after a loss) pays it in full. A waiting agent polls the rendezvous state once a second (torch's
#:   sync loop), so the survivors of a loss, all waiting for the round to open, join within ~1 s of
#:   each other; the other 2 s cover start-up skew between hosts launched together (ssh, torch import).
#:   A host later than that is not lost: it joins the wait list and torch's agents restart the workers
#:   with it at once (one extra restart, never a wrong world).
#: - ``keep_alive_interval=2``, ``keep_alive_max_attempt=3`` (torch: 5 and 3): a host whose agent sent no
#:   heartbeat for interval x attempts is dropped from the rendezvous. A lost host is still a participant
#:   of the finished round until then, and the survivors' next round cannot open before it is dropped:
#:   4-6 s after its last heartbeat instead of 10-15 s. Heartbeats come from the agent's own timer thread
#:   (not the busy workers), so 3 missed in a row means a dead host or link, not a slow one.
#: - ``join_timeout=600`` (torch's default, made explicit): how long an agent waits for ``min_nodes`` hosts;
#:   covers a slow first start. A job that falls below ``min_nodes`` is stopped by the runner earlier.
#:
#: So a survivor waits about 6 + 3 s in the rendezvous after a loss (torch's defaults: about 45 s). The node
#: agent's ``--rdzv_conf k=v,...`` overrides single keys.
DEFAULT_RDZV_CONFIGS: Mapping[str, str] = MappingProxyType({
    "join_timeout": "600",
    "last_call_timeout": "3",
    "keep_alive_interval": "2",
    "keep_alive_max_attempt": "3",
})
# torch's integer-valued rendezvous keys (seconds or a count): each must be a positive integer.
_POSITIVE_RDZV_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout",
                       "keep_alive_interval", "keep_alive_max_attempt", "read_timeout")


@dataclass(frozen=True)
class ElasticSpec:
    """``--elastic_training``: the job runs on any number of hosts in ``min_nodes..max_nodes`` and
    restarts its workers when a host is lost or comes back. ``max_restarts`` bounds the restarts after a
    failure (a lost host is one; torch does not count a host joining): 10 rides out hosts lost over a long
    job, while a script that fails the same way at every start (a config error) ends the job after ten
    quick tries instead of looping for an hour. ``rdzv_configs`` are the c10d rendezvous settings every agent uses (:data:`DEFAULT_RDZV_CONFIGS`
    says why they are shorter than torch's)."""

    min_nodes: int
    max_nodes: int
    max_restarts: int = 10
    # hash=False: the spec stays hashable (a dict is not), equality still compares it
    rdzv_configs: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_RDZV_CONFIGS), hash=False)

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise LauncherError(
                f"--min_elastic_nodes {self.min_nodes} and --max_elastic_nodes {self.max_nodes} must satisfy "
                "1 <= min <= max"
            )
        configs = {str(key): str(value) for key, value in self.rdzv_configs.items()}
        for key in _POSITIVE_RDZV_KEYS:
            if key in configs and not (configs[key].isdigit() and int(configs[key]) > 0):
                raise LauncherError(f"rendezvous setting {key}={configs[key]!r} must be a positive integer "
                                    f"(seconds, or a count); e.g. {key}={DEFAULT_RDZV_CONFIGS.get(key, '5')}")
        object.__setattr__(self, "rdzv_configs", configs)  # a plain dict: encode() writes it as JSON


@dataclass(frozen=True)
class JobSpec:
    """One multi-node job. ``world`` lists the hosts in node-rank order, each with its slot ids
    (local ranks run on those slots); global ranks are numbered host by host in that order, as
    DeepSpeed numbers them. ``job_id`` names the job's files on every host (pid file, logs), so
    stopping a job touches only its own processes."""

    job_id: str
    world: tuple[tuple[str, tuple[int, ...]], ...]
    master_addr: str
    master_port: int
    program: Program
    elastic: ElasticSpec | None = None
    bind_cores_to_rank: bool = False
    bind_core_list: str | None = None
    each_rank_log_dir: str | None = None
    save_pid: bool = False
    # Variables the agent sets for its workers on top of what the runner's shell exported.
    worker_env: Mapping[str, str] = field(default_factory=dict)

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(host for host, _ in self.world)

    @property
    def world_size(self) -> int:
        return sum(len(slots) for _, slots in self.world)

    def slots_of(self, node_rank: int) -> tuple[int, ...]:
        return self.world[node_rank][1]

    def encode(self) -> str:
        """The job as one shell-safe token (URL-safe base64 of JSON: letters, digits, ``-_=``)."""
        raw = asdict(self)
        raw["worker_env"] = dict(self.worker_env)
        return base64.urlsafe_b64encode(json.dumps(raw, sort_keys=True).encode("utf-8")).decode("ascii")

    @classmethod
    def decode(cls, token: str) -> JobSpec:
        """Inverse of :meth:`encode`; a damaged token is a :class:`LauncherError`, not a traceback."""
        try:
            raw = json.loads(base64.urlsafe_b64decode(token.encode("ascii")).decode("utf-8"))
            program = _program(raw.pop("program"))
            elastic = raw.pop("elastic")
            world = tuple((str(host), tuple(int(s) for s in slots)) for host, slots in raw.pop("world"))
            return cls(
                program=program,
                elastic=_elastic(elastic) if elastic is not None else None,
                world=world,
                **raw,
            )
        except (ValueError, TypeError, KeyError, UnicodeError) as exc:
            raise LauncherError(f"cannot read the job description passed to this node ({exc}); the runner "
                                "and this host may run different zerospeed versions") from None


def _elastic(raw: dict[str, object]) -> ElasticSpec:
    """A token without ``rdzv_configs`` (written before they existed) gets the defaults."""
    configs = raw.pop("rdzv_configs", None)
    if configs is None:
        return ElasticSpec(**raw)  # type: ignore[arg-type]
    if not isinstance(configs, dict):
        raise TypeError(f"rdzv_configs must be an object, got {configs!r}")
    return ElasticSpec(rdzv_configs={str(k): str(v) for k, v in configs.items()}, **raw)  # type: ignore[arg-type]


def _program(raw: dict[str, object]) -> Program:
    args = raw.pop("args")
    assert isinstance(args, list)
    return Program(args=tuple(str(a) for a in args), **raw)  # type: ignore[arg-type]


def node_rank_of(spec: JobSpec, *, explicit: int | None = None, host: str | None = None,
                 environ: Mapping[str, str]) -> int:
    """This host's node rank: ``explicit`` (``--node_rank``, pdsh's ``%n``, ssh's per-host command),
    else ``host`` (pdsh's ``%h``: the hostfile name it reached) looked up in the world, else the
    runner's own variables (:data:`RUNNER_NODE_RANK_VARIABLES`; all runners here start one agent per
    host, so the runner's process rank is the node rank). Out-of-range answers are errors naming where
    they came from."""
    source: str
    if explicit is not None:
        rank, source = explicit, f"--node_rank {explicit}"
    elif host is not None:
        if host not in spec.hosts:
            slurm = " (this node's SLURMD_NODENAME)" if environ.get("SLURMD_NODENAME") == host else ""
            hint = ("; under --launcher slurm the hostfile must name each host exactly as Slurm does (the short "
                    "node names of 'sinfo -N -h -o %N'), not an FQDN or IP address") if slurm else ""
            raise LauncherError(f"host {host!r}{slurm} is not in this job's hosts ({', '.join(spec.hosts)}){hint}")
        return spec.hosts.index(host)
    else:
        for name in RUNNER_NODE_RANK_VARIABLES:
            if name == "SLURM_NODEID" and environ.get("SLURMD_NODENAME") in spec.hosts:
                # srun: the node's own name; its index in the allocation may follow another order
                return spec.hosts.index(environ["SLURMD_NODENAME"])
            if name in environ:
                try:
                    rank = int(environ[name])
                except ValueError:
                    raise LauncherError(f"{name}={environ[name]!r} is not an integer node rank") from None
                source = f"{name}={environ[name]}"
                break
        else:
            raise LauncherError(
                "cannot tell this host's node rank: pass --node_rank, or start the agent through pdsh, "
                f"ssh, mpirun or srun (none of {', '.join(RUNNER_NODE_RANK_VARIABLES)} is set)"
            )
    if not 0 <= rank < len(spec.world):
        raise LauncherError(f"{source} is outside this job's {len(spec.world)} host(s) "
                            f"({', '.join(spec.hosts)}); node ranks are 0..{len(spec.world) - 1}")
    return rank
