"""Two network namespaces joined by a rate-limited veth pair, so a 2-rank benchmark on one machine sees a
real network bottleneck (bench_comm_compression.py).

Loopback between processes on one host moves gigabytes per second, which hides what gradient compression
is for. Here each rank runs in its own namespace (``ip netns exec``) and every byte between them crosses one
veth pair whose egress, on both ends, is shaped by a token bucket (``tc qdisc ... tbf``). Everything the
context manager creates carries this process's pid in its name (namespaces ``zsnb-<pid>-<hex>-<0|1>``,
links ``zsnb<pid><hex><a|b>``), so a run finds what a crashed run left behind (its pid no longer alive) and
removes it. Needs root (CAP_SYS_ADMIN + CAP_NET_ADMIN) and iproute2; otherwise ``NetnsUnavailable`` says why.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

PREFIX = "zsnb"
_NS_RE = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]+-[01]$")
_LINK_RE = re.compile(rf"^{PREFIX}(\d+)[0-9a-f]{{2}}[ab]$")
_DENIED = ("Operation not permitted", "Permission denied", "EPERM", "must be root")


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (no ``ip``/``tc``, not root, or the kernel/container refuses)."""


@dataclass(frozen=True)
class Endpoint:
    """One side of the link: the namespace a rank runs in, its veth name and IPv4 address."""

    netns: str
    ifname: str
    address: str

    def exec_prefix(self) -> list[str]:
        """The argv prefix running a command inside this namespace."""
        return ["ip", "netns", "exec", self.netns]


@dataclass(frozen=True)
class VethLink:
    """A veth pair between two namespaces (``ends[0]`` and ``ends[1]``), as created by :func:`veth_link`."""

    tag: str
    ends: tuple[Endpoint, Endpoint]


def _run(argv: Sequence[str], timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run a command, raising with its stderr on failure (``NetnsUnavailable`` when refused by permissions)."""
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        err = (out.stderr or out.stdout).strip()
        if any(d in err for d in _DENIED):
            raise NetnsUnavailable(f"`{' '.join(argv)}` refused: {err}")
        raise RuntimeError(f"`{' '.join(argv)}` failed ({out.returncode}): {err}")
    return out


def check_available() -> None:
    """Raise ``NetnsUnavailable`` unless ``ip`` and ``tc`` exist and we run as root. (A container without
    CAP_NET_ADMIN is only found out when creating: :func:`veth_link` raises the same error then.)"""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetnsUnavailable(f"{' and '.join(missing)} not found on PATH (iproute2 is needed)")
    if os.geteuid() != 0:
        raise NetnsUnavailable(f"network namespaces need root (running as uid {os.geteuid()})")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces() -> list[str]:
    """Names from ``ip netns list`` (first word of each line)."""
    out = _run(["ip", "netns", "list"])
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def list_root_links() -> list[str]:
    """Link names in this (the root) namespace, without the ``@peer`` suffix."""
    out = _run(["ip", "-o", "link", "show"])
    return [line.split(":")[1].strip().split("@")[0] for line in out.stdout.splitlines() if ":" in line]


def ours(names: Sequence[str]) -> list[str]:
    """The namespaces and links among ``names`` that this module makes (any run's)."""
    return [n for n in names if _NS_RE.match(n) or _LINK_RE.match(n)]


def remove_leftovers() -> list[str]:
    """Delete namespaces/links named by a run whose process is gone (a crash, a SIGKILL); returns their names.
    Processes still inside such a namespace are not killed (not ours to end) but named in the message."""
    removed = []
    for ns in list_namespaces():
        m = _NS_RE.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            if pids:
                print(f"_netns: leftover namespace {ns} still holds processes {' '.join(pids)}; "
                      f"removing its name only", file=sys.stderr)
            _run(["ip", "netns", "delete", ns])
            removed.append(ns)
    for link in list_root_links():
        m = _LINK_RE.match(link)
        if m and not _pid_alive(int(m.group(1))):
            _run(["ip", "link", "delete", link])
            removed.append(link)
    return removed


def set_rate(link: VethLink, mbit: float | None) -> None:
    """Shape both ends' egress to ``mbit`` Mbit/s with a token bucket (``None``: remove the shaping).

    tbf rather than netem's ``rate``: tbf splits GSO super-packets to its burst size and holds the
    measured rate at 100 Mbit/s and 1 Gbit/s alike. The bucket holds 4 ms of traffic (at least 32 KiB),
    the queue 50 ms."""
    for end in link.ends:
        if mbit is None:
            subprocess.run(end.exec_prefix() + ["tc", "qdisc", "del", "dev", end.ifname, "root"],
                           capture_output=True)
            continue
        burst = max(32 * 1024, int(mbit * 1e6 / 8 * 0.004))
        _run(end.exec_prefix() + ["tc", "qdisc", "replace", "dev", end.ifname, "root", "tbf",
                                  "rate", f"{mbit:g}mbit", "burst", str(burst), "latency", "50ms"])


_SINK = """
import socket, sys, time
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], int(sys.argv[2]))); srv.listen(1)
print("ready", flush=True)
conn, _ = srv.accept(); total = 0; first = None
while True:
    chunk = conn.recv(1 << 20)
    if not chunk:
        break
    if first is None:
        first = time.perf_counter()
    total += len(chunk)
print(total, time.perf_counter() - (first or time.perf_counter()), flush=True)
"""

_SOURCE = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
block = b"\\0" * (1 << 20); left = int(sys.argv[3])
while left > 0:
    n = min(left, len(block)); s.sendall(block[:n]); left -= n
s.close()
"""


def measure_throughput(link: VethLink, nbytes: int, port: int = 5201, timeout: float = 60.0) -> float:
    """Send ``nbytes`` over TCP from ``ends[0]`` to ``ends[1]``; returns the receiver's rate in bit/s
    (first byte to end of stream, so connection setup is not counted)."""
    sink = subprocess.Popen(link.ends[1].exec_prefix() + [sys.executable, "-c", _SINK, link.ends[1].address,
                                                          str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert sink.stdout is not None
        if sink.stdout.readline().strip() != "ready":
            raise RuntimeError(f"throughput sink did not start: {sink.stderr.read() if sink.stderr else ''}")
        _run(link.ends[0].exec_prefix() + [sys.executable, "-c", _SOURCE, link.ends[1].address, str(port),
                                            str(nbytes)], timeout=timeout)
        out, err = sink.communicate(timeout=timeout)
        total, seconds = out.split()
        if int(total) != nbytes:
            raise RuntimeError(f"throughput sink got {total} of {nbytes} bytes: {err}")
        return int(total) * 8 / max(float(seconds), 1e-9)
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait()


@contextlib.contextmanager
def veth_link(rate_mbit: float | None = None, subnet: str = "10.213.7") -> Iterator[VethLink]:
    """Create two namespaces joined by a veth pair (``<subnet>.1`` and ``<subnet>.2``/24, loopback up in
    both), optionally rate-limited; delete both on exit, whatever happens inside (deleting a namespace
    destroys the veth end in it, and with it the pair). Leftovers of dead runs are removed first."""
    check_available()
    leftovers = remove_leftovers()
    if leftovers:
        print(f"_netns: removed leftovers of a crashed run: {', '.join(leftovers)}", file=sys.stderr)
    tag = f"{os.getpid()}{secrets.token_hex(1)}"
    ns = (f"{PREFIX}-{os.getpid()}-{tag[-2:]}-0", f"{PREFIX}-{os.getpid()}-{tag[-2:]}-1")
    link = VethLink(tag, (Endpoint(ns[0], f"{PREFIX}{tag}a", f"{subnet}.1"),
                          Endpoint(ns[1], f"{PREFIX}{tag}b", f"{subnet}.2")))
    created: list[str] = []
    try:
        for name in ns:
            _run(["ip", "netns", "add", name])
            created.append(name)
        a, b = link.ends
        _run(["ip", "link", "add", a.ifname, "netns", a.netns, "type", "veth", "peer", "name", b.ifname,
              "netns", b.netns])
        for end in link.ends:
            _run(["ip", "-n", end.netns, "addr", "add", f"{end.address}/24", "dev", end.ifname])
            _run(["ip", "-n", end.netns, "link", "set", end.ifname, "up"])
            _run(["ip", "-n", end.netns, "link", "set", "lo", "up"])
        if rate_mbit is not None:
            set_rate(link, rate_mbit)
        yield link
    finally:
        for name in reversed(created):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
        # a half-made pair whose `netns` move failed would stay in the root namespace
        for end in link.ends:
            if end.ifname in list_root_links():
                subprocess.run(["ip", "link", "delete", end.ifname], capture_output=True)


class Interrupted(BaseException):
    """SIGTERM/SIGHUP turned into an exception, so ``finally`` blocks (namespace removal) run."""


@contextlib.contextmanager
def signals_as_exceptions(signals: Sequence[int] = (signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """Inside the block, ``signals`` raise ``Interrupted`` (SIGINT already raises KeyboardInterrupt);
    the previous handlers come back on exit."""
    def handler(signum: int, frame: object) -> None:
        raise Interrupted(f"signal {signal.Signals(signum).name}")

    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def die_with_parent() -> None:
    """``preexec_fn`` for children: SIGKILL them when this process dies (even by SIGKILL), so no rank
    outlives the run and keeps a deleted namespace alive. Linux prctl(PR_SET_PDEATHSIG); survives exec."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG = 1
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def wait_all(procs: Sequence[subprocess.Popen], timeout: float, poll: float = 0.2) -> list[int]:
    """Wait for every process; as soon as one fails, kill the others (a rank whose peer died would hang in a
    collective until its timeout). Raises ``TimeoutError`` after ``timeout`` seconds. Returns exit codes."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes) or all(c is not None for c in codes):
            break
        if time.monotonic() > deadline:
            kill_all(procs)
            raise TimeoutError(f"processes still running after {timeout:.0f} s; killed")
        time.sleep(poll)
    kill_all(procs)
    return [p.wait() for p in procs]


def kill_all(procs: Sequence[subprocess.Popen]) -> None:
    """SIGKILL each still-running process we started (by its own pid) and reap it."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        with contextlib.suppress(Exception):
            p.wait(timeout=10)
