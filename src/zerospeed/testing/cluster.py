"""A test cluster on one machine: N "hosts" made of Linux namespaces, reachable by real ssh.

Why: the multi-node launcher (pdsh, ssh, Open MPI, MPICH, Slurm) must be tested against the real
tools, which only ever see hostnames, IP addresses, sshd and hosts files. Namespaces give each "host"
exactly those, on one machine, without containers or images, and the whole cluster is created and
torn down by a test in about a second.

Shape (one cluster, token ``T`` = 6 random hex digits, unique per cluster so parallel runs never meet):

- a "switch" network namespace ``zsT-sw`` holding a bridge ``br0``; the root namespace gets no
  interface at all;
- per host ``i``: a network namespace ``zsT-h<i>`` with ``lo`` up and ``eth0`` (a veth whose peer
  ``p<i>`` sits on the bridge), address ``10.A.B.<i+1>/24`` in a private /24 derived from the token
  (one not overlapping any root-namespace address), no default route: traffic cannot leave the cluster;
- per host a long-lived *holder* process started as ``ip netns exec zsT-h<i> unshare --uts --mount
  --propagation private sh -c 'hostname <prefix>h<i>; exec sleep infinity'``; every process run on the
  host is ``nsenter -t <holder> -n -u -m`` (network, hostname, mounts). The holder is never killed
  before teardown, so the host's UTS and mount namespaces live as long as the cluster;
- ``ip netns exec`` bind-mounts ``/etc/netns/zsT-h<i>/<name>`` over ``/etc/<name>`` in the holder's
  mount namespace (inherited by everything entered through it): ``hosts`` (every cluster hostname ->
  its IP; a host's own name maps to its eth0 address as on real clusters, not 127.0.1.1),
  ``resolv.conf`` (no name server: an unknown name fails at once instead of leaving the cluster) and
  ``ssh/`` (``ssh_config``: the cluster's user key as ``IdentityFile``, a complete known_hosts with
  ``StrictHostKeyChecking yes``, ``BatchMode yes``, ``ConnectTimeout``). So ``ssh h1 hostname``,
  ``pdsh -R ssh -w h0,h1 hostname``, Open MPI's ``mpirun`` and MPICH's hydra work from inside any
  host exactly as on a real cluster. Files written into ``etc_dir(i)/<existing dir>/`` after start
  appear inside the host too (the bind mount shares the directory);
- a real ``/usr/sbin/sshd -D`` per host on ``<ip>:22`` (generated ed25519 host key per host, one user
  key for root, ``AuthorizedKeysFile`` in the cluster folder, ``PermitRootLogin prohibit-password``,
  ``UsePAM no``, ``StrictModes no`` because the folder lives under the world-writable /tmp);
- the mount namespaces are copies of the root one, so ``/tmp`` (and the cluster folder in it) is the
  SAME on every host, like a cluster's shared file system: scripts and checkpoints written there are
  seen by every host. ``/tmp`` is not made private here (Slurm's pmix wants a private /tmp per node:
  the Slurm helper does that for slurmd only).

Everything the cluster creates lives under one folder (``folder``) plus ``/etc/netns/zsT-*``, and is
removed by ``stop()``, which first SIGKILLs every process whose ``/proc/<pid>/ns/net`` is one of the
cluster's namespaces (by PID, never by a name pattern), then deletes the namespaces (their veths and
the bridge go with them). A failed start tears down what it made; a ``weakref.finalize`` runs the same
teardown at interpreter exit; and a cluster whose owner process died without tearing down (SIGKILL)
is removed by the next ``Cluster.start()`` (its owner PID and start time are recorded in
``/etc/netns/zsT-sw/owner``).

Facts learned while building it (Debian 12: Open MPI 4.1.4, MPICH 4.0.2 hydra, pdsh 2.34, OpenSSH 9.2):

- sshd refuses to start without its privilege-separation directory ``/run/sshd``; it is created once
  (empty, root 0755, what the openssh-server package itself creates at service start) and left.
- Open MPI as root refuses to start ("mpirun has detected an attempt to run as root") unless given
  ``--allow-run-as-root`` or both ``OMPI_ALLOW_RUN_AS_ROOT=1`` and ``OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``;
  nothing else is needed to launch across these hosts, because a host has only ``lo`` (which Open MPI
  skips by default) and ``eth0``. ``openmpi_args()``/``openmpi_env()`` still pin ``oob_tcp_if_include``
  and ``btl_tcp_if_include`` to eth0 and ``plm_rsh_agent`` to ssh, as a real multi-homed cluster needs.
  Its rsh launcher runs ``ssh <host> orted ...`` with the host's ``/etc/ssh/ssh_config``.
- MPICH's hydra launches its proxies with ``ssh`` by default and needs no extra settings once the
  hostnames resolve to the eth0 addresses (``mpich_env()`` pins ``HYDRA_LAUNCHER=ssh`` and
  ``HYDRA_IFACE=eth0`` anyway, so a stray interface never wins).
- pdsh's default rcmd module is ``rsh``: ``-R ssh`` or ``PDSH_RCMD_TYPE=ssh`` (``pdsh_env()``).
- Some kernels lack ``netem`` (this machine's: CONFIG_NET_SCH_NETEM unset; ``tbf`` and ``htb`` exist),
  so ``limit(rate=...)`` uses ``tbf`` and only a ``delay`` needs netem (its absence is named). Measured
  here with 100 MB over TCP: unlimited ~7 Gbit/s (CPU-bound), ``1gbit`` ~0.89 Gbit/s, ``10gbit`` ~5 Gbit/s.
- A process killed by ``kill_host`` is a zombie of whoever started it until reaped; a zombie has no
  namespaces any more (``/proc/<pid>/ns/net`` cannot be read), so it no longer counts as "on" the host.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

__all__ = ["Cluster", "ClusterError", "cluster_unavailable_reason", "cluster_or_skip", "remove_stale_clusters"]

NETNS_DIR = Path("/run/netns")
ETC_NETNS = Path("/etc/netns")
INTERFACE = "eth0"
SSH_PORT = 22
_NAME_RE = re.compile(r"^zs([0-9a-f]{6})-(sw|h\d+)$")
# Tools the cluster itself needs (Debian package in brackets in the skip reason).
_REQUIRED_TOOLS: tuple[tuple[str, str], ...] = (
    ("ip", "iproute2"), ("tc", "iproute2"), ("unshare", "util-linux"), ("nsenter", "util-linux"),
    ("/usr/sbin/sshd", "openssh-server"), ("ssh", "openssh-client"), ("ssh-keygen", "openssh-client"),
)
# Optional tools the tests of each runner need.
TOOL_PACKAGES: Mapping[str, str] = {
    "pdsh": "pdsh", "mpirun.openmpi": "openmpi-bin", "mpirun.mpich": "mpich",
    "slurmd": "slurmd", "slurmctld": "slurmctld", "srun": "slurm-client", "munged": "munge",
}


class ClusterError(RuntimeError):
    """A cluster operation failed; the message names the command, host and its output."""


def _which(tool: str) -> str | None:
    if os.path.isabs(tool):
        return tool if os.access(tool, os.X_OK) else None
    # sbin directories are searched too: a non-login root shell may not have them on PATH.
    path = os.environ.get("PATH", "") + ":/usr/local/sbin:/usr/sbin:/sbin"
    return shutil.which(tool, path=path)


def cluster_unavailable_reason(tools: Sequence[str] = ()) -> str | None:
    """Why a Cluster cannot be built here (for ``pytest.skip``), or None when it can.

    Checks root, the tools the cluster needs (plus ``tools``, e.g. ``("pdsh", "mpirun.mpich")``),
    and that this process may create namespaces at all (a container without CAP_SYS_ADMIN may not)."""
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        return "the test cluster needs Linux namespaces (/proc/self/ns/net is missing)"
    if os.geteuid() != 0:
        return "the test cluster needs root (network namespaces, sshd); run the tests as root to include it"
    for tool, package in (*_REQUIRED_TOOLS, *((t, TOOL_PACKAGES.get(t, t)) for t in tools)):
        if _which(tool) is None:
            return f"the test cluster needs {tool!r} (Debian package {package}); `make cluster-deps` installs it"
    probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"namespaces are not permitted here (unshare --net --uts --mount: {probe.stderr.strip()!r})"
    return None


def _run(argv: Sequence[str], *, check: bool = True, input: str | None = None, timeout: float = 30) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, input=input, timeout=timeout)
    if check and proc.returncode != 0:
        raise ClusterError(f"{' '.join(argv)!r} failed with exit code {proc.returncode}: "
                           f"{(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def _ns_id(path: str | Path) -> tuple[int, int] | None:
    """(device, inode) of a namespace file; None when it cannot be read (gone, zombie)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _pids_in_netns(ns: tuple[int, int]) -> set[int]:
    pids: set[int] = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _ns_id(f"/proc/{entry}/ns/net") == ns:
            pids.add(int(entry))
    return pids


def _kill_in_netns(ns: tuple[int, int], *, keep: frozenset[int] = frozenset(), timeout: float = 10.0) -> None:
    """SIGKILL every process in the network namespace ``ns`` except the PIDs in ``keep``, until none
    is left (a process may fork while we look); by PID, never by name."""
    deadline = time.monotonic() + timeout
    while True:
        pids = _pids_in_netns(ns) - keep
        if not pids:
            return
        if time.monotonic() > deadline:
            raise ClusterError(f"processes {sorted(pids)} are still in the namespace after SIGKILL for {timeout} s")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


def _rate_bits(rate: str) -> int:
    """Bits per second of a tc rate ("8mbit", "1gbit", "10Gbit", "125mbps" = bytes, "1000" = bits)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)?", rate.strip().lower())
    if match is None:
        raise ValueError(f"rate={rate!r}: use tc's rate syntax, e.g. '1gbit', '10gbit', '8mbit'")
    value = float(match.group(1)) * 1000 ** " kmgt".index(match.group(2) or " ")
    return int(value * (8 if match.group(3) == "bps" else 1))


def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22: starttime in clock ticks since boot


@dataclass
class _State:
    """What teardown needs; owned by the finalizer (not the Cluster), so it can run at exit."""

    token: str
    namespaces: list[str] = field(default_factory=list)  # switch first, then hosts
    etc_dirs: list[Path] = field(default_factory=list)
    folder: Path | None = None
    children: list[subprocess.Popen[Any]] = field(default_factory=list)


def _teardown(state: _State) -> list[str]:
    """Kill, delete, remove; keeps going past errors and returns them (teardown must not stop halfway)."""
    errors: list[str] = []
    for name in reversed(state.namespaces):
        ns = _ns_id(NETNS_DIR / name)
        if ns is None:
            continue
        try:
            _kill_in_netns(ns)
        except ClusterError as error:
            errors.append(f"{name}: {error}")
    for child in state.children:
        with contextlib.suppress(Exception):
            child.kill()
        with contextlib.suppress(Exception):
            child.wait(timeout=5)
    state.children.clear()
    for name in reversed(state.namespaces):
        if (NETNS_DIR / name).exists():
            proc = subprocess.run(["ip", "netns", "delete", name], capture_output=True, text=True)
            if proc.returncode != 0:
                errors.append(f"ip netns delete {name}: {proc.stderr.strip()}")
    state.namespaces.clear()
    for etc in state.etc_dirs:
        shutil.rmtree(etc, ignore_errors=True)
    state.etc_dirs.clear()
    with contextlib.suppress(OSError):
        ETC_NETNS.rmdir()  # only when empty: another cluster's folders keep it
    if state.folder is not None:
        shutil.rmtree(state.folder, ignore_errors=True)
        state.folder = None
    return errors


def remove_stale_clusters() -> list[str]:
    """Tear down clusters whose owner process is gone (it was SIGKILLed before its teardown ran).

    Only clusters with an owner record are touched: a cluster being built right now by another
    process has written its record before creating anything, and its owner is alive."""
    removed: list[str] = []
    if not ETC_NETNS.is_dir():
        return removed
    for entry in sorted(ETC_NETNS.iterdir()):
        match = _NAME_RE.match(entry.name)
        if not match or match.group(2) != "sw":
            continue
        try:
            pid_s, start, folder = (entry / "owner").read_text().split("\n")[:3]
        except (OSError, ValueError):
            continue
        if _start_time(int(pid_s)) == start:
            continue  # the owner is alive
        token = match.group(1)
        names = [n.name for n in (*NETNS_DIR.glob(f"zs{token}-*"), *ETC_NETNS.glob(f"zs{token}-*"))]
        names = sorted(set(names), key=lambda n: (n != f"zs{token}-sw", n))
        _teardown(_State(token=token, namespaces=names, etc_dirs=[ETC_NETNS / n for n in names],
                         folder=Path(folder) if folder else None))
        removed.append(token)
    return removed


class Cluster:
    """N hosts (network + UTS + mount namespaces with a real sshd) on one bridge; see the module doc.

    ``with Cluster(3) as cluster: cluster.check_output_on(0, ["ssh", "h1", "hostname"])``.
    Hosts are named ``<prefix>h<i>``; a ``host`` argument is an index or a hostname.
    ``etc_files`` (path under /etc -> text) are written into every host's /etc before start; the
    directory or file must exist in the real /etc (``ip netns exec`` only bind-mounts over existing
    paths)."""

    def __init__(self, n_hosts: int = 3, *, prefix: str = "", parent: str | None = None,
                 start_sshd: bool = True, etc_files: Mapping[str, str] | None = None) -> None:
        if n_hosts < 1 or n_hosts > 250:
            raise ValueError(f"n_hosts={n_hosts}: a cluster has 1..250 hosts")
        if prefix and not re.fullmatch(r"[a-z][a-z0-9-]*", prefix):
            raise ValueError(f"prefix={prefix!r}: use lower-case letters, digits and '-', starting with a letter")
        self.n_hosts = n_hosts
        self.prefix = prefix
        self.hostnames: tuple[str, ...] = tuple(f"{prefix}h{i}" for i in range(n_hosts))
        self.interface = INTERFACE
        self._parent = parent
        self._start_sshd = start_sshd
        self._etc_files = dict(etc_files or {})
        self._holders: list[subprocess.Popen[bytes]] = []
        self._sshd: dict[int, subprocess.Popen[bytes]] = {}
        self._netns: list[tuple[int, int]] = []
        self._state: _State | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self.token = ""
        self.subnet: ipaddress.IPv4Network | None = None
        self.folder = Path()

    # ---------------------------------------------------------------- names and addresses
    @property
    def switch_namespace(self) -> str:
        return f"zs{self.token}-sw"

    @property
    def namespaces(self) -> tuple[str, ...]:
        """The hosts' network namespace names (``ip netns exec`` works with them too)."""
        return tuple(f"zs{self.token}-h{i}" for i in range(self.n_hosts))

    def host_index(self, host: int | str) -> int:
        if isinstance(host, int):
            if not 0 <= host < self.n_hosts:
                raise IndexError(f"host={host}: this cluster has hosts 0..{self.n_hosts - 1}")
            return host
        if host not in self.hostnames:
            raise KeyError(f"host={host!r}: this cluster's hosts are {', '.join(self.hostnames)}")
        return self.hostnames.index(host)

    def host_ip(self, host: int | str) -> str:
        assert self.subnet is not None, "the cluster is not started"
        return str(self.subnet.network_address + self.host_index(host) + 1)

    def holder_pid(self, host: int | str) -> int:
        """The PID whose namespaces ARE the host (nsenter -t <pid> -n -u -m enters it)."""
        return self._holders[self.host_index(host)].pid

    def netns_inode(self, host: int | str) -> int:
        """The inode of the host's network namespace, as ``/proc/<pid>/ns/net`` shows it."""
        return self._netns[self.host_index(host)][1]

    def etc_dir(self, host: int | str) -> Path:
        """``/etc/netns/<namespace>``: its entries are bind-mounted over ``/etc/<name>`` in the host."""
        return ETC_NETNS / self.namespaces[self.host_index(host)]

    def host_dir(self, host: int | str) -> Path:
        """The host's own files (sshd config, host key, pid file, log) inside the cluster folder."""
        return self.folder / "hosts" / self.hostnames[self.host_index(host)]

    @property
    def user_key(self) -> Path:
        """The private key every host's ssh uses (root's key, authorized on every sshd)."""
        return self.folder / "id_ed25519"

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Cluster:
        """Build the namespaces, bridge, addresses, holders and sshds; tear down and raise on failure."""
        if self._state is not None:
            raise ClusterError("this Cluster was started already; make a new one")
        reason = cluster_unavailable_reason()
        if reason is not None:
            raise ClusterError(reason)
        remove_stale_clusters()
        self.token = self._new_token()
        self._state = _State(token=self.token)
        self._finalizer = weakref.finalize(self, _teardown, self._state)
        try:
            self._build()
        except BaseException:
            with contextlib.suppress(ClusterError):  # the start's own error is the one to report
                self.stop()
            raise
        return self

    def stop(self) -> None:
        """Kill every process on every host (by PID), delete namespaces, veths, bridge, /etc/netns
        entries and the folder. Safe to call twice and after a failed start."""
        if self._finalizer is None:
            return
        state = self._state
        errors = _teardown(state) if state is not None and self._finalizer.detach() is not None else []
        self._finalizer = None
        self._holders.clear()
        self._sshd.clear()
        if errors:
            raise ClusterError("cluster teardown left things behind: " + "; ".join(errors))

    def _new_token(self) -> str:
        taken = {p.name for p in NETNS_DIR.glob("zs*")}
        if ETC_NETNS.is_dir():
            taken |= {p.name for p in ETC_NETNS.iterdir()}
        while True:
            token = secrets.token_hex(3)
            if not any(name.startswith(f"zs{token}-") for name in taken):
                return token

    def _pick_subnet(self) -> ipaddress.IPv4Network:
        used = [ipaddress.ip_interface(m).network for m in
                re.findall(r"\binet (\S+)", _run(["ip", "-o", "-4", "addr", "show"]))]
        seed = int(self.token, 16)
        for attempt in range(256):
            value = (seed + attempt * 7919) & 0xFFFF
            subnet = ipaddress.IPv4Network(f"10.{value >> 8}.{value & 0xFF}.0/24")
            if not any(subnet.overlaps(net) for net in used):
                return subnet
        raise ClusterError(f"no free 10.x.y.0/24 found beside the addresses in use: {used}")

    def _build(self) -> None:
        assert self._state is not None
        state = self._state
        self.subnet = self._pick_subnet()
        ETC_NETNS.mkdir(parents=True, exist_ok=True)
        sw = self.switch_namespace
        sw_etc = ETC_NETNS / sw
        state.etc_dirs.append(sw_etc)
        sw_etc.mkdir(parents=True, exist_ok=True)
        base = self._parent or tempfile.gettempdir()
        state.folder = Path(tempfile.mkdtemp(prefix=f"zs{self.token}-cluster-", dir=base))
        self.folder = state.folder
        # The owner record first: a stale-cluster sweep never removes a cluster being built.
        (sw_etc / "owner").write_text(f"{os.getpid()}\n{_start_time(os.getpid())}\n{self.folder}\n")
        self._write_keys_and_configs()

        state.namespaces.append(sw)
        _run(["ip", "netns", "add", sw])
        _run(["ip", "-n", sw, "link", "set", "lo", "up"])
        _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", "br0", "up"])
        for i, ns in enumerate(self.namespaces):
            state.etc_dirs.append(ETC_NETNS / ns)
            state.namespaces.append(ns)
            _run(["ip", "netns", "add", ns])
            self._netns.append(_ns_id(NETNS_DIR / ns) or (0, 0))
            _run(["ip", "-n", sw, "link", "add", f"p{i}", "type", "veth", "peer", "name", INTERFACE, "netns", ns])
            _run(["ip", "-n", sw, "link", "set", f"p{i}", "master", "br0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.host_ip(i)}/{self.subnet.prefixlen}", "dev", INTERFACE])
            _run(["ip", "-n", ns, "link", "set", INTERFACE, "up"])
        for i, ns in enumerate(self.namespaces):
            holder = subprocess.Popen(
                ["ip", "netns", "exec", ns, "unshare", "--uts", "--mount", "--propagation", "private", "--",
                 "/bin/sh", "-c", 'hostname "$1" && echo ready && exec sleep infinity', "sh", self.hostnames[i]],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
            state.children.append(holder)
            self._holders.append(holder)
        for i, holder in enumerate(self._holders):
            assert holder.stdout is not None and holder.stderr is not None
            line = holder.stdout.readline()
            if line != b"ready\n":
                raise ClusterError(f"host {self.hostnames[i]}: its namespace holder did not start: "
                                   f"{holder.stderr.read().decode(errors='replace').strip()}")
            holder.stdout.close()
            # ip netns exec warns on stderr about /etc/netns entries it could not bind; keep reading
            # nothing from it: close so a full pipe never blocks the holder.
            holder.stderr.close()
        if self._start_sshd:
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
            for i in range(self.n_hosts):
                self._launch_sshd(i)
            for i in range(self.n_hosts):
                self._wait_sshd(i)

    def _write_keys_and_configs(self) -> None:
        assert self.subnet is not None
        folder = self.folder
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"zerospeed-cluster-{self.token}",
              "-f", str(self.user_key)])
        (folder / "authorized_keys").write_text(Path(f"{self.user_key}.pub").read_text())
        known: list[str] = []
        for i, name in enumerate(self.hostnames):
            hdir = self.host_dir(i)
            hdir.mkdir(parents=True)
            key = hdir / "ssh_host_ed25519_key"
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(key)])
            public = " ".join(Path(f"{key}.pub").read_text().split()[:2])
            known.append(f"{name},{self.host_ip(i)} {public}\n")
            (hdir / "sshd_config").write_text(
                f"ListenAddress {self.host_ip(i)}:{SSH_PORT}\n"
                f"HostKey {key}\n"
                f"PidFile {hdir / 'sshd.pid'}\n"
                f"AuthorizedKeysFile {folder / 'authorized_keys'}\n"
                "PermitRootLogin prohibit-password\n"
                "PubkeyAuthentication yes\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                "UsePAM no\nStrictModes no\nUseDNS no\n"
                "AcceptEnv LANG LC_* ZEROSPEED_* OMPI_* PMIX_* HYDRA_* MPIR_*\n"
                "PermitUserEnvironment no\nX11Forwarding no\nPrintMotd no\nPrintLastLog no\n"
                "MaxStartups 200:30:400\nMaxSessions 200\nLogLevel ERROR\n"
                "Subsystem sftp internal-sftp\n")
        (folder / "known_hosts").write_text("".join(known))
        ssh_config = (
            "Host *\n"
            f"    IdentityFile {self.user_key}\n"
            "    IdentitiesOnly yes\n"
            f"    UserKnownHostsFile {folder / 'known_hosts'}\n"
            "    GlobalKnownHostsFile /dev/null\n"
            "    StrictHostKeyChecking yes\n"
            "    CheckHostIP no\n"
            "    BatchMode yes\n"
            "    ConnectTimeout 5\n"
            "    ServerAliveInterval 5\n"
            "    ServerAliveCountMax 3\n"
            "    LogLevel ERROR\n"
            "    User root\n")
        (folder / "ssh_config").write_text(ssh_config)
        hosts = ("127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n"
                 + "".join(f"{self.host_ip(i)} {name}\n" for i, name in enumerate(self.hostnames)))
        (folder / "etc_hosts").write_text(hosts)
        for ns in self.namespaces:
            etc = ETC_NETNS / ns
            (etc / "ssh").mkdir(parents=True)
            (etc / "ssh" / "ssh_config").write_text(ssh_config)
            (etc / "hosts").write_text(hosts)
            (etc / "hostname").write_text(f"{self.hostnames[self.namespaces.index(ns)]}\n")
            if Path("/etc/resolv.conf").exists():
                (etc / "resolv.conf").write_text("# zerospeed test cluster: no name server, hosts file only\n"
                                                 "options timeout:1 attempts:1\n")
            for rel, text in self._etc_files.items():
                target = etc / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text)

    def _launch_sshd(self, i: int) -> None:
        hdir = self.host_dir(i)
        sshd = self.run_on(i, ["/usr/sbin/sshd", "-D", "-f", str(hdir / "sshd_config"), "-E", str(hdir / "sshd.log")],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True, track=True)
        self._sshd[i] = sshd

    def _wait_sshd(self, i: int, timeout: float = 10.0) -> None:
        """Until the host's sshd accepts connections (probed from inside the host)."""
        deadline = time.monotonic() + timeout
        sshd = self._sshd[i]
        probe = f"import socket; socket.create_connection(('{self.host_ip(i)}', {SSH_PORT}), 1).close()"
        while True:
            if sshd.poll() is not None:
                log = (self.host_dir(i) / "sshd.log")
                raise ClusterError(f"host {self.hostnames[i]}: sshd exited with {sshd.returncode}: "
                                   f"{log.read_text().strip() if log.exists() else '(no log)'}")
            if self.run_on(i, ["python3", "-c", probe], stderr=subprocess.DEVNULL).wait() == 0:
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"host {self.hostnames[i]}: sshd not listening on {self.host_ip(i)}:{SSH_PORT} "
                                   f"after {timeout} s")
            time.sleep(0.05)

    # ---------------------------------------------------------------- running things on hosts
    def nsenter_argv(self, host: int | str, argv: Sequence[str], *, cwd: str | None = None) -> list[str]:
        """The command line that runs ``argv`` inside ``host`` (its network, hostname and mounts)."""
        return ["nsenter", "-t", str(self.holder_pid(host)), "-n", "-u", "-m",
                f"--wd={cwd or os.getcwd()}", "--", *argv]

    def run_on(self, host: int | str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
               cwd: str | None = None, track: bool = False, **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on ``host``; ``env`` adds variables over this process's environment.

        The process is this process's child (``nsenter`` execs ``argv`` in the same PID). ``track``
        makes teardown reap it (for daemons the caller does not wait for)."""
        if self._state is None or self._finalizer is None:
            raise ClusterError("the cluster is not started (use `with Cluster(...)` or .start())")
        full_env = dict(os.environ)
        full_env.update(env or {})
        proc: subprocess.Popen[Any] = subprocess.Popen(self.nsenter_argv(host, argv, cwd=cwd), env=full_env,
                                                       **popen_kwargs)
        if track:
            self._state.children[:] = [c for c in self._state.children if c.poll() is None]
            self._state.children.append(proc)
        return proc

    def check_output_on(self, host: int | str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                        cwd: str | None = None, timeout: float = 60.0, input: str | None = None) -> str:
        """Run ``argv`` on ``host`` and return its stdout; raises ClusterError naming the host, the
        command, the exit code and stderr when it fails or outlives ``timeout``."""
        stdin = subprocess.PIPE if input is not None else subprocess.DEVNULL
        proc = self.run_on(host, argv, env=env, cwd=cwd, stdin=stdin,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(input=input, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            try:  # a grandchild (ssh under mpirun) may hold the pipes open: do not wait for it
                out, err = proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                out, err = "", ""
            raise ClusterError(f"on {self.hostnames[self.host_index(host)]}: {' '.join(argv)!r} ran past {timeout} s; "
                               f"stdout {out[-2000:]!r} stderr {err[-2000:]!r}") from None
        if proc.returncode != 0:
            raise ClusterError(f"on {self.hostnames[self.host_index(host)]}: {' '.join(argv)!r} exited with "
                               f"{proc.returncode}: {err.strip()[-4000:]}")
        return out

    def hostfile(self, slots: int | Sequence[int] = 1, path: str | Path | None = None) -> str:
        """DeepSpeed hostfile text (``h0 slots=2`` lines); written to ``path`` too when given."""
        counts = [slots] * self.n_hosts if isinstance(slots, int) else list(slots)
        if len(counts) != self.n_hosts:
            raise ValueError(f"slots={slots!r}: give one count or {self.n_hosts} counts")
        text = "".join(f"{name} slots={n}\n" for name, n in zip(self.hostnames, counts, strict=True))
        if path is not None:
            Path(path).write_text(text)
        return text

    # ---------------------------------------------------------------- runner settings
    def openmpi_env(self) -> dict[str, str]:
        """Variables Open MPI's mpirun needs here: root allowed, ssh launcher, TCP on eth0 only."""
        return {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "OMPI_MCA_plm_rsh_agent": "ssh", "OMPI_MCA_btl_tcp_if_include": INTERFACE,
                "OMPI_MCA_oob_tcp_if_include": INTERFACE}

    def openmpi_args(self) -> list[str]:
        """The same as mpirun arguments (for a command line that must not depend on the environment)."""
        return ["--allow-run-as-root", "--mca", "plm_rsh_agent", "ssh",
                "--mca", "btl_tcp_if_include", INTERFACE, "--mca", "oob_tcp_if_include", INTERFACE]

    def mpich_env(self) -> dict[str, str]:
        """Variables MPICH's hydra uses here: ssh launcher, the eth0 interface."""
        return {"HYDRA_LAUNCHER": "ssh", "HYDRA_IFACE": INTERFACE}

    def mpich_args(self) -> list[str]:
        return ["-launcher", "ssh", "-iface", INTERFACE]

    def pdsh_env(self) -> dict[str, str]:
        return {"PDSH_RCMD_TYPE": "ssh"}

    # ---------------------------------------------------------------- failures and links
    def pids_on(self, host: int | str) -> set[int]:
        """Every live process on ``host`` (its holder and sshd included)."""
        return _pids_in_netns(self._netns[self.host_index(host)])

    def kill_host(self, host: int | str, *, keep_sshd: bool = False) -> None:
        """SIGKILL every process on ``host`` (found by network namespace, by PID) except the holder
        (and sshd when ``keep_sshd``): the host "dies" and, without sshd, is unreachable until
        ``revive_host``. Its TCP peers see resets (use ``set_link(host, up=False)`` first for a silent loss)."""
        i = self.host_index(host)
        keep = {self._holders[i].pid}
        sshd = self._sshd.get(i)
        if keep_sshd and sshd is not None and sshd.poll() is None:
            keep.add(sshd.pid)
        _kill_in_netns(self._netns[i], keep=frozenset(keep))
        if sshd is not None and sshd.pid not in keep:
            sshd.wait(timeout=5)
            del self._sshd[i]

    def revive_host(self, host: int | str) -> None:
        """Bring a killed host back: link up, sshd started again (if it is not running)."""
        i = self.host_index(host)
        self.set_link(i, up=True)
        sshd = self._sshd.get(i)
        if self._start_sshd and (sshd is None or sshd.poll() is not None):
            self._launch_sshd(i)
            self._wait_sshd(i)

    def set_link(self, host: int | str, *, up: bool) -> None:
        """Unplug (``up=False``) or plug back the host's cable: its bridge port goes down/up, so
        packets are silently lost as when a machine vanishes."""
        i = self.host_index(host)
        _run(["ip", "-n", self.switch_namespace, "link", "set", f"p{i}", "up" if up else "down"])

    def limit(self, rate: str | None = "1gbit", delay: str | None = None,
              hosts: Sequence[int | str] | None = None) -> None:
        """Limit every (or the given) host's link to ``rate`` (tc syntax: "1gbit", "8mbit") in both
        directions (a qdisc on eth0 inside the host and on its bridge port), with an optional one-way
        ``delay`` ("1ms"). ``rate=None, delay=None`` removes the limits.

        A rate alone uses ``tbf`` (burst: 1 ms of the rate, at least 128 KiB so GSO packets pass);
        a delay needs ``netem``, which some kernels lack (this one is checked, and named if missing)."""
        if rate is not None:
            bits = _rate_bits(rate)
            burst = max(bits // 8 // 1000, 128 * 1024)
        for host in (range(self.n_hosts) if hosts is None else hosts):
            i = self.host_index(host)
            for ns, dev in ((self.namespaces[i], INTERFACE), (self.switch_namespace, f"p{i}")):
                if rate is None and delay is None:
                    _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
                    continue
                if delay is None:
                    spec = ["tbf", "rate", rate or "", "burst", str(burst), "latency", "100ms"]
                else:
                    spec = ["netem", "limit", "100000", "delay", delay, *(["rate", rate] if rate is not None else [])]
                proc = subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *spec],
                                      capture_output=True, text=True)
                if proc.returncode != 0:
                    hint = (" (the kernel lacks the netem qdisc, CONFIG_NET_SCH_NETEM: limit the rate only)"
                            if spec[0] == "netem" and "unknown" in proc.stderr else "")
                    raise ClusterError(f"limit(rate={rate!r}, delay={delay!r}) on {self.hostnames[i]}: "
                                       f"tc {' '.join(spec)} failed: {proc.stderr.strip()}{hint}")

    def unlimit(self) -> None:
        self.limit(rate=None, delay=None)


def cluster_or_skip(n_hosts: int = 3, *, tools: Sequence[str] = (), **kwargs: Any) -> Iterator[Cluster]:
    """For a pytest fixture: ``yield from cluster_or_skip(3, tools=("pdsh",))`` skips with the reason
    when a cluster cannot be built here, else yields a started cluster and stops it afterwards."""
    import pytest

    reason = cluster_unavailable_reason(tools)
    if reason is not None:
        pytest.skip(reason)
    with Cluster(n_hosts, **kwargs) as cluster:
        yield cluster
