"""Real Slurm on the namespace test cluster: slurmctld on host 0, one slurmd per host, munge.

Why: the ``--launcher slurm`` runner must be tested against Debian's real ``srun``/slurmctld/slurmd,
which place tasks by node name and address exactly as on a real cluster. :class:`SlurmCluster` turns
a started :class:`zerospeed.testing.cluster.Cluster` into a Slurm cluster whose node names are the
cluster's hostnames, so ``srun --nodes=3 ...`` run inside any host starts processes in the hosts'
network/UTS/mount namespaces (each task sees its host's hostname, IP and network namespace)::

    with Cluster(3) as cluster, SlurmCluster(cluster) as slurm:
        slurm.run(["srun", "--nodes=3", "hostname"])  # on host 0, with slurm_env()
        # a launcher under test:
        cluster.run_on(0, slurm.client_argv(["zerospeed", "--launcher", "slurm", ...]), env=slurm.slurm_env())

Shape (everything in ``<cluster folder>/slurm``, removed by ``stop()``):

- ``munge/``: a fresh random key (no ``mungekey`` needed: any >=32 random bytes, mode 0400) and ONE
  ``munged -F --force`` on host 0 with its own ``--socket/--pid-file/--log-file/--seed-file``. A
  path-named unix socket is reached from every network namespace, and the cluster folder is the same
  file system on every host, so all daemons and clients share it (``AuthInfo=socket=...``). It runs
  inside host 0 (not in the root namespace) so the cluster's own safety nets (teardown, the sweep of
  a dead owner's cluster) stop it with everything else.
- ``slurm.conf`` + ``cgroup.conf`` (read from the same folder); ``SLURM_CONF`` points at it for the
  daemons (also ``-f``) and for every client: :meth:`SlurmCluster.slurm_env`.
- ``slurmctld -D`` on host 0, ``slurmd -D -N <hostname>`` on every host, each the child of this
  process (``Cluster.run_on(track=True)``); stopped by PID (SIGTERM, SIGKILL after a grace).

Facts learned (Debian 12, Slurm 22.05.8, munge 0.5.15; what slurm.conf needs in namespaces):

- slurmd 22.05 ALWAYS initialises the cgroup plugin, whatever Proctrack/Task plugins are configured.
  Its autodetection statfs()es ``/sys/fs/cgroup``; ``ip netns exec`` (which makes the cluster's host
  holders) mounts a fresh sysfs, so inside a host that directory is empty and slurmd dies with "No
  filesystem mounted on /sys/fs/cgroup / Unable to initialize cgroup plugin". No mount is needed:
  ``cgroup.conf`` with ``CgroupPlugin=cgroup/v1`` (skips the autodetection) and ``CgroupMountpoint=``
  an empty folder of ours is enough, as long as nothing uses cgroups: ``ProctrackType=
  proctrack/linuxproc``, ``TaskPlugin=task/none``, ``JobAcctGatherType=jobacct_gather/none``.
- ``MpiDefault=none``: the pmix plugins are then never used (slurmctld/slurmd still log "can not load
  PMIx library" at start; harmless). /tmp stays shared between hosts (like a cluster's shared FS).
- munged refuses a socket whose every ancestor directory is not world-executable ("Socket is
  inaccessible: execute permissions for all required"); the cluster folder is a 0700 ``mkdtemp``, so
  munged runs with ``--force`` (it then only warns; all clients are root). Munge credentials carry
  the origin address 127.0.0.1 of munged's namespace; Slurm 22.05 does not check it.
- ``SlurmctldHost=<host0>(<ip>)`` and ``NodeName=<h> NodeAddr=<ip>``: daemons and clients never need
  name resolution of the controller; slurmd reaches srun back at the source address of srun's
  connection. Client commands must run INSIDE a host: from the root namespace the controller's
  address is not routed (the cluster has no route out, by design).
- CPU counts: a node registers with the machine's real core count; ``SlurmdParameters=
  config_overrides`` makes the configured ``CPUs=`` win, so nodes with more slots than cores are not
  drained ("Low CPUs"), and ``OverSubscribe=FORCE`` on the partition lets jobs share CPUs (tests run
  several small jobs at once).
- srun learns of a killed host in one of two ways (seen both, run to run): the kernel resets its I/O
  connection to that host's slurmstepd and srun aborts the step at once ("step_launch_notify_io_failure:
  aborting, io error with slurmstepd on node <node index>", exit 137, ~4 s); or the connection just
  closes and slurmctld's pings mark the node DOWN ("Node failure on <host>", exit 143 with
  ``--kill-on-bad-exit=1``; SlurmdTimeout=5 + MessageTimeout=3: ~11-13 s after the kill; with
  MessageTimeout=5 ~15 s). The other tasks get SIGTERM, SIGKILL ``KillWait=2`` s later.
  ``ReturnToService=2`` returns the node to "idle" within ~1 s of its slurmd starting again
  (:meth:`SlurmCluster.restart_node`).
- Back-to-back jobs on the same nodes: a node is not allocated while the previous job is still
  COMPLETING on it, so the next ``srun`` may print "job N queued and waiting for resources" for up to
  ~1 s; harmless (it is not a shortage of CPUs: ``OverSubscribe=FORCE``).
- Any Slurm client (``srun --version`` included) without ``SLURM_CONF`` and without
  /etc/slurm/slurm.conf falls back to "configless" mode and looks up a DNS SRV record, i.e. sends
  traffic off the machine: always give clients :meth:`SlurmCluster.slurm_env`; the version check here
  uses ``slurmd -V``, which reads no configuration.
- Each cluster's hosts are their own network namespaces, so ports never collide between clusters;
  they are still derived from the cluster token (``SlurmctldPort``/``SlurmdPort``) so logs of two
  clusters are told apart.
- slurmd forks ``slurmstepd`` detached (re-parented to init), so a step outlives a SIGTERMed slurmd:
  ``stop()`` first cancels every job (``scancel``), then stops the daemons, then SIGKILLs any
  ``slurmstepd`` still on a host and its descendants, by PID (found by the host's network namespace
  and ``/proc/<pid>/exe``, never by a name pattern).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from zerospeed.testing.cluster import Cluster, ClusterError, cluster_unavailable_reason

__all__ = ["SlurmCluster", "SlurmConfig", "SlurmError", "cgroup_conf_text", "slurm_conf_text",
           "slurm_unavailable_reason"]

SLURM_TOOLS: tuple[str, ...] = ("slurmctld", "slurmd", "slurmstepd", "srun", "sinfo", "squeue", "scancel", "munged")
_MIN_VERSION = (21, 8)  # CgroupPlugin= in cgroup.conf appeared in 21.08
_STOP_GRACE_S = 5.0


class SlurmError(RuntimeError):
    """A Slurm daemon did not start or stop; the message names the daemon, host and its log."""


def _which(tool: str) -> str | None:
    return shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/local/sbin:/usr/sbin:/sbin")


def _slurm_version() -> tuple[int, int] | None:
    # ``slurmd -V``, not ``srun --version``: a client without SLURM_CONF and /etc/slurm/slurm.conf
    # looks its controller up in DNS (configless mode), i.e. sends traffic out of the machine.
    slurmd = _which("slurmd")
    if slurmd is None:
        return None
    out = subprocess.run([slurmd, "-V"], capture_output=True, text=True).stdout
    match = re.search(r"(\d+)\.(\d+)", out)
    return (int(match.group(1)), int(match.group(2))) if match else None


def slurm_unavailable_reason() -> str | None:
    """Why a SlurmCluster cannot run here (for ``pytest.skip``), or None when it can: the cluster's
    own requirements, then Slurm's and munge's programs, then a Slurm version with ``CgroupPlugin``."""
    reason = cluster_unavailable_reason(("slurmd", "slurmctld", "srun", "munged"))
    if reason is not None:
        return reason
    for tool in SLURM_TOOLS:
        if _which(tool) is None:
            package = {"srun": "slurm-client", "sinfo": "slurm-client", "squeue": "slurm-client",
                       "scancel": "slurm-client", "munged": "munge", "slurmstepd": "slurmd"}.get(tool, tool)
            return f"the Slurm test cluster needs {tool!r} (Debian package {package}); `make cluster-deps` installs it"
    version = _slurm_version()
    if version is None or version < _MIN_VERSION:
        return (f"the Slurm test cluster needs Slurm >= {_MIN_VERSION[0]}.{_MIN_VERSION[1]:02d} "
                f"(slurmd -V says {version}); install Debian 12's slurm-client/slurmd/slurmctld")
    return None


@dataclass(frozen=True)
class SlurmConfig:
    """Everything slurm.conf depends on; a pure value so the text is unit-tested without daemons."""

    cluster_name: str
    nodes: tuple[tuple[str, str], ...]  # (node name == hostname, address); nodes[0] runs slurmctld
    folder: Path
    ctld_port: int
    slurmd_port: int
    munge_socket: Path
    cpus_per_node: int = 8
    slurmd_timeout_s: int = 5
    message_timeout_s: int = 3
    kill_wait_s: int = 2


def slurm_conf_text(config: SlurmConfig) -> str:
    """slurm.conf for a namespace cluster (see the module docstring for why each line is there)."""
    if not config.nodes:
        raise ValueError("SlurmConfig.nodes is empty: a Slurm cluster needs at least one node")
    folder = config.folder
    ctld_name, ctld_addr = config.nodes[0]
    lines = [
        f"ClusterName={config.cluster_name}",
        f"SlurmctldHost={ctld_name}({ctld_addr})",
        f"SlurmctldPort={config.ctld_port}",
        f"SlurmdPort={config.slurmd_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={config.munge_socket}",
        f"StateSaveLocation={folder / 'state'}",
        f"SlurmdSpoolDir={folder / 'spool' / '%n'}",
        f"SlurmctldPidFile={folder / 'run' / 'slurmctld.pid'}",
        f"SlurmdPidFile={folder / 'run' / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={folder / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={folder / 'log' / 'slurmd-%n.log'}",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "MailProg=/bin/true",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "PropagateResourceLimits=NONE",
        "SchedulerType=sched/builtin",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        f"SlurmdTimeout={config.slurmd_timeout_s}",
        f"MessageTimeout={config.message_timeout_s}",
        f"KillWait={config.kill_wait_s}",
        "InactiveLimit=0",
        "MinJobAge=5",
    ]
    for name, addr in config.nodes:
        lines.append(f"NodeName={name} NodeAddr={addr} CPUs={config.cpus_per_node} State=UNKNOWN")
    lines.append("PartitionName=zs Nodes=ALL Default=YES MaxTime=INFINITE OverSubscribe=FORCE:4 State=UP")
    return "\n".join(lines) + "\n"


def cgroup_conf_text(folder: Path) -> str:
    """cgroup.conf that lets slurmd start where /sys/fs/cgroup is empty (see the module docstring)."""
    return f"CgroupPlugin=cgroup/v1\nCgroupMountpoint={folder / 'cgroup'}\n"


def _exe(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def _in_some_netns(pid: int) -> bool:
    """Alive and not a zombie (a zombie's namespaces cannot be read any more)."""
    try:
        os.stat(f"/proc/{pid}/ns/net")
    except OSError:
        return False
    return True


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc/<pid>/task/*/children)."""
    kids: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                kids += [int(p) for p in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    return kids


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    todo = [pid]
    while todo:
        kids = _children(todo.pop())
        found += kids
        todo += kids
    return found


class SlurmCluster:
    """slurmctld + munged on host 0 and one slurmd per host of ``cluster``; see the module docstring.

    ``start()`` (or ``with``) returns once ``sinfo`` shows every node idle; ``stop()`` cancels jobs,
    stops every daemon by PID and removes ``<cluster folder>/slurm``. The cluster must be started
    and outlive this object (stop this first)."""

    def __init__(self, cluster: Cluster, *, cpus_per_node: int = 8, slurmd_timeout_s: int = 5,
                 start_timeout_s: float = 30.0) -> None:
        if cpus_per_node < 1:
            raise ValueError(f"cpus_per_node={cpus_per_node}: give at least 1 (the slots a node offers)")
        if slurmd_timeout_s < 2:
            raise ValueError(f"slurmd_timeout_s={slurmd_timeout_s}: Slurm needs at least 2 s "
                             "(a node is pinged every SlurmdTimeout/3 s)")
        if not cluster.token:
            raise ValueError("cluster: start the Cluster first (`with Cluster(3) as cluster, SlurmCluster(cluster)`)")
        self.cluster = cluster
        self.folder = cluster.folder / "slurm"
        port = 20000 + (int(cluster.token, 16) % 4000) * 2
        self.config = SlurmConfig(
            cluster_name=f"zs{cluster.token}",
            nodes=tuple((h, cluster.host_ip(i)) for i, h in enumerate(cluster.hostnames)),
            folder=self.folder, ctld_port=port, slurmd_port=port + 1,
            munge_socket=self.folder / "munge" / "munge.socket",
            cpus_per_node=cpus_per_node, slurmd_timeout_s=slurmd_timeout_s)
        self.conf_path = self.folder / "slurm.conf"
        self._start_timeout_s = start_timeout_s
        self._munged: subprocess.Popen[Any] | None = None
        self._ctld: subprocess.Popen[Any] | None = None
        self._slurmd: dict[int, subprocess.Popen[Any]] = {}
        self._started = False

    # ---------------------------------------------------------------- clients
    def slurm_env(self) -> dict[str, str]:
        """Variables every Slurm client (srun, sinfo, scancel) needs to reach this cluster."""
        return {"SLURM_CONF": str(self.conf_path)}

    def client_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` behind ``env -u`` for each SLURM_* variable of THIS process: when the tests run
        inside a real Slurm job, its SLURM_JOB_ID etc. would make srun use that job instead."""
        unset = [arg for key in sorted(os.environ) if key.startswith("SLURM_") for arg in ("-u", key)]
        return ["env", *unset, *argv] if unset else list(argv)

    def run(self, argv: Sequence[str], *, host: int | str = 0, timeout: float = 60.0) -> str:
        """Run a client command (sinfo, scontrol, srun ...) on ``host``; its stdout."""
        return self.cluster.check_output_on(host, self.client_argv(argv), env=self.slurm_env(), timeout=timeout)

    def node_states(self) -> dict[str, str]:
        """Node name -> Slurm state as sinfo prints it ("idle", "down*", "alloc" ...)."""
        out = self.run(["sinfo", "--noheader", "--Node", "--format=%N %T"], timeout=15)
        states: dict[str, str] = {}
        for line in out.splitlines():
            if line.strip():
                name, state = line.split()[:2]
                states[name] = state
        return states

    def wait_idle(self, hosts: Sequence[int | str] | None = None, timeout: float | None = None) -> None:
        """Until every (or each given) node is "idle"; raises SlurmError with the states and logs."""
        names = [self.cluster.hostnames[self.cluster.host_index(h)] for h in (hosts if hosts is not None
                                                                           else range(self.cluster.n_hosts))]
        deadline = time.monotonic() + (self._start_timeout_s if timeout is None else timeout)
        states: dict[str, str] = {}
        while True:
            self._check_alive()
            with contextlib.suppress(ClusterError):
                states = self.node_states()
                if all(states.get(n) == "idle" for n in names):
                    return
            if time.monotonic() > deadline:
                raise SlurmError(f"Slurm nodes {names} not idle after {timeout or self._start_timeout_s} s: "
                                 f"sinfo says {states}; {self._log_tails()}")
            time.sleep(0.2)

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> SlurmCluster:
        """Write key and configs, start munged, slurmctld and the slurmds, wait until all are idle.
        A failed start stops what it started and raises SlurmError naming the daemon and its log."""
        if self._started:
            raise SlurmError("this SlurmCluster was started already; make a new one")
        self._started = True
        try:
            self._write_files()
            self._start_munged()
            self._start_ctld()
            for i in range(self.cluster.n_hosts):
                self._start_slurmd(i)
            self.wait_idle()
        except BaseException:
            with contextlib.suppress(Exception):
                self.stop()
            raise
        return self

    def _write_files(self) -> None:
        folder = self.folder
        folder.mkdir(mode=0o755)
        for sub in ("state", "spool", "run", "log", "cgroup"):
            (folder / sub).mkdir()
        for name in self.cluster.hostnames:
            (folder / "spool" / name).mkdir()
        munge = folder / "munge"
        munge.mkdir(mode=0o755)  # munged: the socket's folder must be world-executable
        key = munge / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        self.conf_path.write_text(slurm_conf_text(self.config))
        (folder / "cgroup.conf").write_text(cgroup_conf_text(folder))

    def _daemon(self, host: int, argv: Sequence[str], log_name: str) -> subprocess.Popen[Any]:
        log = open(self.folder / "log" / log_name, "ab")  # stdout/stderr: what it says before its log file opens
        try:
            return self.cluster.run_on(host, self.client_argv(argv), env=self.slurm_env(), cwd=str(self.folder),
                                       stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True, track=True)
        finally:
            log.close()

    def _start_munged(self) -> None:
        munge = self.folder / "munge"
        self._munged = self._daemon(0, [
            "munged", "-F", "--force", f"--socket={self.config.munge_socket}", f"--key-file={munge / 'munge.key'}",
            f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
            f"--seed-file={munge / 'munged.seed'}"], "munged.out")
        deadline = time.monotonic() + 10
        while not self.config.munge_socket.exists():
            if self._munged.poll() is not None or time.monotonic() > deadline:
                raise SlurmError(f"munged on {self.cluster.hostnames[0]} did not create {self.config.munge_socket} "
                                 f"(exit code {self._munged.poll()}): {self._tail(munge / 'munged.log')}")
            time.sleep(0.02)

    def _start_ctld(self) -> None:
        self._ctld = self._daemon(0, ["slurmctld", "-D", "-f", str(self.conf_path)], "slurmctld.out")

    def _start_slurmd(self, i: int) -> None:
        name = self.cluster.hostnames[i]
        self._slurmd[i] = self._daemon(i, ["slurmd", "-D", "-N", name, "-f", str(self.conf_path)], f"slurmd-{name}.out")

    def restart_node(self, host: int | str, *, wait: bool = True) -> None:
        """Start again whatever of this cluster's daemons on ``host`` is not running (after
        ``Cluster.kill_host``): slurmd, and on host 0 munged and slurmctld. ``ReturnToService=2``
        brings a DOWN node back; with ``wait`` this returns once the node is idle."""
        i = self.cluster.host_index(host)
        if i == 0:
            if self._munged is None or self._munged.poll() is not None:
                self.config.munge_socket.unlink(missing_ok=True)
                self._start_munged()
            if self._ctld is None or self._ctld.poll() is not None:
                self._start_ctld()
        slurmd = self._slurmd.get(i)
        if slurmd is None or slurmd.poll() is not None:
            self._start_slurmd(i)
        if wait:
            self.wait_idle([i])

    def _check_alive(self) -> None:
        for what, proc in (("munged", self._munged), ("slurmctld", self._ctld)):
            if proc is not None and proc.poll() is not None:
                raise SlurmError(f"{what} on {self.cluster.hostnames[0]} exited with {proc.returncode}: "
                                 f"{self._log_tails()}")

    def _tail(self, path: Path, lines: int = 15) -> str:
        try:
            return f"{path.name}: " + " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return f"{path.name}: (no log)"

    def _log_tails(self) -> str:
        logs = sorted((self.folder / "log").glob("*")) if (self.folder / "log").is_dir() else []
        return "; ".join(self._tail(p, 6) for p in logs if p.stat().st_size)

    def stop(self) -> None:
        """Cancel every job, stop slurmd/slurmctld/munged by PID (SIGTERM, SIGKILL after a grace),
        SIGKILL steps that outlived their slurmd, remove ``<cluster folder>/slurm``. Safe twice."""
        if not self._started:
            return
        ctld_up = self._ctld is not None and self._ctld.poll() is None
        if ctld_up and self.folder.is_dir():
            with contextlib.suppress(ClusterError, subprocess.TimeoutExpired):
                self.run(["scancel", "--quiet", "--user=root"], timeout=10)
                deadline = time.monotonic() + 5  # a job on a dead node stays COMPLETING: do not wait long
                while (time.monotonic() < deadline
                       and self.run(["squeue", "--noheader", "--format=%i"], timeout=10).strip()):
                    time.sleep(0.2)
        daemons = [p for p in (*self._slurmd.values(), self._ctld, self._munged) if p is not None]
        for proc in daemons:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _STOP_GRACE_S
        for proc in daemons:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._kill_leftover_steps()
        self._slurmd.clear()
        self._ctld = self._munged = None
        shutil.rmtree(self.folder, ignore_errors=True)
        self._started = False

    def _kill_leftover_steps(self, timeout: float = 10.0) -> None:
        """SIGKILL slurmstepd processes (and their tasks) still on this cluster's hosts, by PID, until
        none is left (a SIGKILLed process lingers a moment on a loaded machine)."""
        stepd = _which("slurmstepd")
        if stepd is None:
            return
        stepd = os.path.realpath(stepd)
        deadline = time.monotonic() + timeout
        while True:
            targets: list[int] = []
            for i in range(self.cluster.n_hosts):
                with contextlib.suppress(Exception):
                    for pid in self.cluster.pids_on(i):
                        if _exe(pid) == stepd:
                            targets += [pid, *_descendants(pid)]
            targets = [pid for pid in targets if _in_some_netns(pid)]
            if not targets:
                return
            if time.monotonic() > deadline:
                raise SlurmError(f"Slurm steps {sorted(targets)} still running {timeout} s after SIGKILL")
            for pid in targets:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
