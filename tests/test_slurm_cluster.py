"""Real Slurm (slurmctld, one slurmd per host, munge) on the namespace test cluster
(zerospeed.testing.slurm_cluster): srun places tasks on the cluster's hosts by node count, tasks per
node, --nodelist and --exclude; a lost host ends srun with a non-zero code within a bound and the
node comes back; stop() leaves no process or file behind."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from zerospeed.testing.cluster import ETC_NETNS, NETNS_DIR, Cluster
from zerospeed.testing.slurm_cluster import (
    SlurmCluster,
    SlurmConfig,
    cgroup_conf_text,
    slurm_conf_text,
    slurm_unavailable_reason,
)

# Needs the namespace test cluster (root, iproute2, sshd ...): the `make test-cluster` lane.
pytestmark = pytest.mark.cluster

# Printed by every task: where it ran and what Slurm told it.
_WHERE = ("import json, os, socket; print(json.dumps({'host': socket.gethostname(), "
          "'netns': os.stat('/proc/self/ns/net').st_ino, 'node': int(os.environ['SLURM_NODEID']), "
          "'rank': int(os.environ['SLURM_PROCID']), 'local': int(os.environ['SLURM_LOCALID'])}), flush=True)")


def _skip_unless_slurm() -> None:
    reason = slurm_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    _skip_unless_slurm()
    with Cluster(3) as cluster, SlurmCluster(cluster) as slurm:
        yield slurm


def _tasks(slurm: SlurmCluster, *srun_args: str) -> list[dict[str, int | str]]:
    out = slurm.run(["srun", *srun_args, "python3", "-c", _WHERE], timeout=60)
    return sorted((json.loads(line) for line in out.splitlines() if line.strip()), key=lambda t: t["rank"])


def test_slurm_conf_names_every_namespace_setting(tmp_path: Path) -> None:
    config = SlurmConfig(cluster_name="zsabc123", nodes=(("h0", "10.1.2.1"), ("h1", "10.1.2.2")), folder=tmp_path,
                         ctld_port=20010, slurmd_port=20011, munge_socket=tmp_path / "munge" / "munge.socket",
                         cpus_per_node=4)
    lines = slurm_conf_text(config).splitlines()
    for expected in ("SlurmctldHost=h0(10.1.2.1)", "SlurmctldPort=20010", "SlurmdPort=20011",
                     f"AuthInfo=socket={tmp_path}/munge/munge.socket", f"SlurmdSpoolDir={tmp_path}/spool/%n",
                     f"StateSaveLocation={tmp_path}/state", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
                     "JobAcctGatherType=jobacct_gather/none", "MpiDefault=none", "ReturnToService=2",
                     "SlurmdTimeout=5", "MessageTimeout=3", "KillWait=2", "SlurmdParameters=config_overrides",
                     "NodeName=h0 NodeAddr=10.1.2.1 CPUs=4 State=UNKNOWN",
                     "NodeName=h1 NodeAddr=10.1.2.2 CPUs=4 State=UNKNOWN",
                     "PartitionName=zs Nodes=ALL Default=YES MaxTime=INFINITE OverSubscribe=FORCE:4 State=UP"):
        assert expected in lines
    # Every path Slurm writes is inside the folder: nothing lands in /var or /run.
    paths = [line.split("=", 1)[1] for line in lines
             if line.split("=", 1)[0] in ("StateSaveLocation", "SlurmdSpoolDir", "SlurmctldPidFile", "SlurmdPidFile",
                                          "SlurmctldLogFile", "SlurmdLogFile")]
    assert len(paths) == 6 and all(p.startswith(f"{tmp_path}/") for p in paths)
    assert cgroup_conf_text(tmp_path) == f"CgroupPlugin=cgroup/v1\nCgroupMountpoint={tmp_path}/cgroup\n"
    with pytest.raises(ValueError, match="SlurmConfig.nodes is empty"):
        slurm_conf_text(SlurmConfig(cluster_name="x", nodes=(), folder=tmp_path, ctld_port=1, slurmd_port=2,
                                    munge_socket=tmp_path / "s"))


def test_srun_runs_one_task_on_each_host(slurm: SlurmCluster) -> None:
    cluster = slurm.cluster
    tasks = _tasks(slurm, "--nodes=3", "--ntasks-per-node=1")
    assert [(t["host"], t["node"], t["rank"], t["local"]) for t in tasks] == [
        ("h0", 0, 0, 0), ("h1", 1, 1, 0), ("h2", 2, 2, 0)]
    # Each task really ran inside its host's network namespace.
    assert [t["netns"] for t in tasks] == [cluster.netns_inode(i) for i in range(3)]
    assert len({t["netns"] for t in tasks}) == 3


def test_srun_two_tasks_per_node_get_local_ids(slurm: SlurmCluster) -> None:
    tasks = _tasks(slurm, "--nodes=2", "--ntasks-per-node=2")
    assert [(t["host"], t["node"], t["rank"], t["local"]) for t in tasks] == [
        ("h0", 0, 0, 0), ("h0", 0, 1, 1), ("h1", 1, 2, 0), ("h1", 1, 3, 1)]


def test_srun_nodelist_and_exclude_pick_the_named_hosts(slurm: SlurmCluster) -> None:
    assert [t["host"] for t in _tasks(slurm, "--nodelist=h0,h2", "--ntasks-per-node=1")] == ["h0", "h2"]
    assert [t["host"] for t in _tasks(slurm, "--nodes=2", "--exclude=h0")] == ["h1", "h2"]
    assert [t["host"] for t in _tasks(slurm, "--nodelist=h1", "--ntasks-per-node=2")] == ["h1", "h1"]


def _job_tasks_on(cluster: Cluster, host: int) -> list[int]:
    """PIDs of the test job's tasks (``sleep 120``) still alive on ``host``."""
    found = []
    for pid in cluster.pids_on(host):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", b"120"]:
                found.append(pid)
        except OSError:
            pass
    return found


def test_lost_host_ends_srun_and_the_node_comes_back(slurm: SlurmCluster) -> None:
    cluster = slurm.cluster
    srun = cluster.run_on(0, slurm.client_argv(["srun", "--kill-on-bad-exit=1", "--nodes=3", "--ntasks-per-node=1",
                                                "sh", "-c", "echo started; exec sleep 120"]),
                          env=slurm.slurm_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert srun.stdout is not None
        assert [srun.stdout.readline() for _ in range(3)] == ["started\n"] * 3
        killed_at = time.monotonic()
        cluster.kill_host(2, keep_sshd=True)
        _, err = srun.communicate(timeout=60)
        elapsed = time.monotonic() - killed_at
    finally:
        if srun.poll() is None:
            srun.kill()
            srun.wait()
    bound = slurm.config.slurmd_timeout_s + slurm.config.message_timeout_s + 20
    assert srun.returncode != 0, err
    assert elapsed < bound, f"srun took {elapsed:.1f} s (bound {bound} s) to notice the lost host: {err}"
    # Two ways srun learns it (both name the lost host): the reset of its I/O connection to h2's
    # slurmstepd (at once), or slurmctld's pings marking h2 DOWN (after SlurmdTimeout).
    assert "Node failure on h2" in err or "io error with slurmstepd on node 2" in err, err
    # The job's tasks on the surviving hosts are gone too (srun waits for them up to KillWait).
    deadline = time.monotonic() + 10
    while (_job_tasks_on(cluster, 0) or _job_tasks_on(cluster, 1)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (_job_tasks_on(cluster, 0), _job_tasks_on(cluster, 1)) == ([], [])
    # ReturnToService=2: the host's slurmd started again brings the node back to idle, usable at once.
    slurm.restart_node(2)
    assert [t["host"] for t in _tasks(slurm, "--nodes=3")] == ["h0", "h1", "h2"]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "(gone)"


def test_stop_leaves_no_process_or_file() -> None:
    _skip_unless_slurm()
    with Cluster(2) as cluster:
        before = [cluster.pids_on(i) for i in range(2)]  # namespace holder and sshd
        slurm = SlurmCluster(cluster).start()
        folder = slurm.folder
        srun = cluster.run_on(0, slurm.client_argv(["srun", "--nodes=2", "sh", "-c", "echo started; exec sleep 120"]),
                              env=slurm.slurm_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert srun.stdout is not None
        assert [srun.stdout.readline() for _ in range(2)] == ["started\n"] * 2
        assert all(cluster.pids_on(i) - before[i] for i in range(2))  # slurmd, slurmstepd, sleep ...
        slurm.stop()
        assert srun.wait(timeout=10) != 0  # the running job was cancelled
        left = {pid: _cmdline(pid) for i in range(2) for pid in cluster.pids_on(i) - before[i]}
        assert left == {}
        assert not folder.exists()
        slurm.stop()  # twice is fine
        token, cluster_folder = cluster.token, cluster.folder
    assert not list(NETNS_DIR.glob(f"zs{token}-*")) and not list(ETC_NETNS.glob(f"zs{token}-*"))
    assert not cluster_folder.exists()


def test_slurm_cluster_needs_a_started_cluster() -> None:
    with pytest.raises(ValueError, match=r"cluster: start the Cluster first"):
        SlurmCluster(Cluster(1))
