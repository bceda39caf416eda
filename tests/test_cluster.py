"""The one-machine test cluster (zerospeed.testing.cluster): namespaces that behave as separate hosts
reachable by real ssh, pdsh, Open MPI and MPICH; tc link limits; host loss and revival; a teardown that
leaves nothing behind, also after a failed start and after its owner was SIGKILLed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from zerospeed.testing.cluster import (
    ETC_NETNS,
    NETNS_DIR,
    Cluster,
    ClusterError,
    cluster_or_skip,
    cluster_unavailable_reason,
    remove_stale_clusters,
)
from zerospeed.testing.cluster import _rate_bits

# Needs the namespace test cluster (root, iproute2, sshd ...): the `make test-cluster` lane.
pytestmark = pytest.mark.cluster

# Printed by a host over ssh: where am I (hostname, the address my hostname resolves to, my network
# namespace) and can I see the shared folder.
_WHERE = ("import json, os, socket, sys; print(json.dumps({'hostname': socket.gethostname(), "
          "'ip': socket.gethostbyname(socket.gethostname()), 'netns': os.stat('/proc/self/ns/net').st_ino, "
          "'shared': os.path.exists(sys.argv[1])}))")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    yield from cluster_or_skip(3)


def _skip_without(*tools: str) -> None:
    reason = cluster_unavailable_reason(tools)
    if reason is not None:
        pytest.skip(reason)


def _leftovers(token: str, folder: Path) -> list[str]:
    """Everything a cluster with ``token`` could leave behind: namespaces, /etc/netns folders, its folder."""
    left = [str(p) for p in (*NETNS_DIR.glob(f"zs{token}-*"), *ETC_NETNS.glob(f"zs{token}-*"))]
    return left + ([str(folder)] if folder.exists() else [])


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip() for line in out.splitlines()}


def test_rates_read_as_tc_reads_them() -> None:
    assert [_rate_bits(r) for r in ("8mbit", "1gbit", "10Gbit", "125mbps", "1000", "1.5gbit")] == [
        8_000_000, 1_000_000_000, 10_000_000_000, 1_000_000_000, 1000, 1_500_000_000]
    with pytest.raises(ValueError, match=r"rate='fast': use tc's rate syntax, e.g. '1gbit'"):
        _rate_bits("fast")


def test_hosts_have_their_own_hostname_ip_and_network_namespace(cluster: Cluster) -> None:
    marker = cluster.folder / "shared-marker"
    marker.write_text("seen by every host\n")
    answers = [json.loads(cluster.check_output_on(0, ["ssh", name, f"python3 -c \"{_WHERE}\" {marker}"]))
               for name in cluster.hostnames]
    assert [a["hostname"] for a in answers] == ["h0", "h1", "h2"]
    assert [a["ip"] for a in answers] == [cluster.host_ip(i) for i in range(3)]
    assert [a["netns"] for a in answers] == [cluster.netns_inode(i) for i in range(3)]
    assert len({a["netns"] for a in answers} | {os.stat("/proc/self/ns/net").st_ino}) == 4
    assert all(a["shared"] for a in answers)  # /tmp is the cluster's shared file system
    assert cluster.hostfile(slots=[2, 1, 2]) == "h0 slots=2\nh1 slots=1\nh2 slots=2\n"
    # No interface of the cluster lives in the root namespace; each host has exactly lo and eth0.
    assert not any(link.startswith(("p0", "br0")) or link.startswith("zs") for link in _root_links())
    links = cluster.check_output_on(1, ["ip", "-o", "link", "show"])
    assert [line.split(":")[1].strip().split("@")[0] for line in links.splitlines()] == ["lo", "eth0"]


def test_pdsh_reaches_every_host(cluster: Cluster) -> None:
    _skip_without("pdsh")
    out = cluster.check_output_on(2, ["pdsh", "-R", "ssh", "-w", ",".join(cluster.hostnames), "hostname"])
    assert sorted(out.splitlines()) == ["h0: h0", "h1: h1", "h2: h2"]


def test_openmpi_mpirun_starts_one_process_per_host(cluster: Cluster) -> None:
    _skip_without("mpirun.openmpi")
    out = cluster.check_output_on(0, ["mpirun.openmpi", *cluster.openmpi_args(), "-n", "3", "--map-by", "ppr:1:node",
                                      "--host", "h0,h1,h2", "hostname"], timeout=60)
    assert sorted(out.split()) == ["h0", "h1", "h2"]
    # The same through the environment alone (what a runner that only exports variables relies on).
    out = cluster.check_output_on(1, ["mpirun.openmpi", "-n", "3", "--map-by", "ppr:1:node", "--host", "h0,h1,h2",
                                      "hostname"], env=cluster.openmpi_env(), timeout=60)
    assert sorted(out.split()) == ["h0", "h1", "h2"]


def test_mpich_hydra_starts_one_process_per_host(cluster: Cluster) -> None:
    _skip_without("mpirun.mpich")
    # `sh -c 'sleep; hostname'`, not `hostname`: hydra 4.0.2's mpiexec dies of SIGPIPE (exit -13) in about one
    # run in six when every process ends before it has finished setting up the others (measured here: 4 of 25
    # with `hostname`, 0 of 15 with a 0.5 s program). The node agents it starts run for seconds; pre-flight reads
    # the hosts' answers, not the exit code.
    out = cluster.check_output_on(0, ["mpirun.mpich", "-n", "3", "-ppn", "1", "-hosts", "h0,h1,h2",
                                      "sh", "-c", "sleep 0.5; hostname"], env=cluster.mpich_env(), timeout=60)
    assert sorted(out.split()) == ["h0", "h1", "h2"]


_SERVER = ("import socket, sys; s = socket.create_server((sys.argv[1], 0)); print(s.getsockname()[1], flush=True); "
           "c, _ = s.accept(); n = 0\nwhile (b := c.recv(1 << 16)): n += len(b)\nc.sendall(str(n).encode()); c.close()")
_CLIENT = ("import socket, sys, time; c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); "
           "t = time.monotonic(); "
           "c.sendall(b'x' * 1_000_000); c.shutdown(socket.SHUT_WR); n = c.recv(64); "
           "print(time.monotonic() - t, n.decode())")


def _send_one_megabyte(cluster: Cluster) -> float:
    """Seconds to send 1 MB from h0 to h1 over TCP (until h1 confirmed receiving all of it)."""
    server = cluster.run_on(1, [sys.executable, "-c", _SERVER, cluster.host_ip(1)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        seconds, received = cluster.check_output_on(0, [sys.executable, "-c", _CLIENT, cluster.host_ip(1), port],
                                                    timeout=30).split()
        assert received == "1000000"
        return float(seconds)
    finally:
        server.kill()
        server.wait()


def test_tc_limit_makes_the_link_measurably_slower(cluster: Cluster) -> None:
    unlimited = _send_one_megabyte(cluster)
    cluster.limit(rate="8mbit", hosts=[0])
    try:
        limited = _send_one_megabyte(cluster)
    finally:
        cluster.unlimit()
    # 1 MB at 8 Mbit/s is 1 s; an unlimited veth moves it in milliseconds.
    assert limited >= 0.5, (limited, unlimited)
    assert limited > 3 * unlimited, (limited, unlimited)
    assert _send_one_megabyte(cluster) < 0.5  # the limit is gone again


def test_kill_host_stops_everything_on_it_and_revive_brings_ssh_back(cluster: Cluster) -> None:
    # A long job on h2 started over ssh from h0, as a runner would.
    job = cluster.run_on(0, ["ssh", "h2", "sleep 300"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while len(cluster.pids_on(2)) < 4 and time.monotonic() < deadline:  # holder, sshd, session sshd, sleep
        time.sleep(0.05)
    assert len(cluster.pids_on(2)) >= 4
    cluster.kill_host(2, keep_sshd=True)
    assert job.wait(timeout=10) != 0  # the remote sleep died with its session
    assert cluster.check_output_on(0, ["ssh", "h2", "hostname"]).strip() == "h2"  # sshd was kept
    cluster.kill_host(2)
    assert cluster.pids_on(2) == {cluster.holder_pid(2)}  # nothing but the namespace holder
    with pytest.raises(ClusterError, match=r"on h0: 'ssh h2 hostname' exited with 255"):
        cluster.check_output_on(0, ["ssh", "h2", "hostname"], timeout=20)
    cluster.revive_host(2)
    assert cluster.check_output_on(0, ["ssh", "h2", "hostname"]).strip() == "h2"
    # An unplugged cable: the host keeps running but cannot be reached.
    cluster.set_link(1, up=False)
    try:
        with pytest.raises(ClusterError, match=r"on h0: 'ssh -o ConnectTimeout=1 h1 true' exited with 255"):
            cluster.check_output_on(0, ["ssh", "-o", "ConnectTimeout=1", "h1", "true"], timeout=20)
    finally:
        cluster.set_link(1, up=True)
    assert cluster.check_output_on(0, ["ssh", "h1", "hostname"]).strip() == "h1"


def test_teardown_leaves_no_namespace_interface_process_or_folder() -> None:
    _skip_without()
    links_before = _root_links()
    with Cluster(2, prefix="node") as cluster:
        token, folder = cluster.token, cluster.folder
        assert cluster.check_output_on(1, ["ssh", "nodeh0", "hostname"]).strip() == "nodeh0"
        # A daemon on a host that is nobody's child here (it outlives its ssh session).
        cluster.check_output_on(0, ["ssh", "nodeh1", "setsid sleep 300 </dev/null >/dev/null 2>&1 &"])
        pids = cluster.pids_on(0) | cluster.pids_on(1)
        assert len(pids) >= 5  # 2 holders, 2 sshds, the daemon
        assert _root_links() == links_before
        assert len(_leftovers(token, folder)) == 7  # sw + 2 hosts, each in /run/netns and /etc/netns; folder
    assert _leftovers(token, folder) == []
    assert [pid for pid in pids if _alive(pid)] == []
    assert _root_links() == links_before
    cluster.stop()  # a second stop is harmless


def test_a_failed_start_tears_down_what_it_made(monkeypatch: pytest.MonkeyPatch) -> None:
    _skip_without()

    def sshd_never_answers(self: Cluster, i: int, timeout: float = 10.0) -> None:
        raise ClusterError(f"host {self.hostnames[i]}: sshd not listening (simulated)")

    monkeypatch.setattr(Cluster, "_wait_sshd", sshd_never_answers)
    cluster = Cluster(2)
    with pytest.raises(ClusterError, match=r"host h0: sshd not listening \(simulated\)"):
        cluster.start()
    assert cluster.token and _leftovers(cluster.token, cluster.folder) == []


def test_a_cluster_whose_owner_was_killed_is_removed_by_the_next_start() -> None:
    _skip_without()
    owner = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from zerospeed.testing.cluster import Cluster; "
         "c = Cluster(1, start_sshd=False).start(); print(c.token, c.folder, flush=True); time.sleep(300)"],
        stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    token, folder = owner.stdout.readline().split()
    owner.kill()
    owner.wait()
    assert len(_leftovers(token, Path(folder))) == 5
    assert token in remove_stale_clusters()
    assert _leftovers(token, Path(folder)) == []
