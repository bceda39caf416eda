"""Issue 33's acceptance: the example GPT across 3 namespace hosts x 2 ranks through every runner.

Every runner (pdsh, ssh, Open MPI, MPICH, Slurm, ``--no_ssh``) launches ``multinode_gpt.py`` at ZeRO-2
and then ZeRO-3 (one launch, 20 steps each) from inside host 0, as a user on a login node would; its
losses must equal the same job's 6 ranks on one host, every rank proves where it ran (hostname, IP,
network namespace) and a variable from ``.deepspeed_env`` reaches every rank. Then the failure and
elastic semantics on the same cluster. One cluster (and one single-host reference) serves the module:
starting processes is what costs here, not the steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from zerospeed.testing.cluster import Cluster, cluster_or_skip

# Needs the namespace test cluster (root, iproute2, sshd ...): the `make test-cluster` lane.
pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "launcher_scripts" / "multinode_gpt.py"
ZEROSPEED = str(Path(sys.executable).with_name("zerospeed"))
HOSTS, SLOTS, STEPS = 3, 2, 20
LAUNCH_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    yield from cluster_or_skip(HOSTS, tools=("pdsh", "mpirun.openmpi", "mpirun.mpich"))


def _read_losses(out: Path) -> dict[tuple[int, int], tuple[int, float]]:
    """(stage, step) -> (world, loss); a step written twice (redone after a restart) keeps its last value."""
    losses: dict[tuple[int, int], tuple[int, float]] = {}
    for line in (out / "losses.jsonl").read_text().splitlines():
        record = json.loads(line)
        losses[(record["stage"], record["step"])] = (record["world"], record["loss"])
    return losses


def _where(out: Path) -> list[dict[str, object]]:
    return [json.loads(p.read_text()) | {"file": p.name} for p in sorted(out.glob("where-rank*.json"))]


def _job_dir(cluster: Cluster, name: str) -> Path:
    """A folder on the cluster's shared file system holding the job's hostfile, .deepspeed_env and output."""
    work = cluster.folder / "jobs" / name
    work.mkdir(parents=True)
    cluster.hostfile(SLOTS, path=work / "hostfile")
    (work / ".deepspeed_env").write_text(f"ZS_MARKER=carried-{name}\n")
    return work


def _launch(cluster: Cluster, host: int, argv: list[str], *, work: Path, env: dict[str, str] | None = None,
            timeout: float = LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    proc = cluster.run_on(host, argv, cwd=str(work), env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(argv)} ran past {timeout} s:\n{out[-6000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, "")


@pytest.fixture(scope="module")
def reference(cluster: Cluster) -> dict[tuple[int, int], tuple[int, float]]:
    """The same job as 6 ranks on one host (host 0)."""
    work = _job_dir(cluster, "reference")
    done = _launch(cluster, 0, [ZEROSPEED, "--num_procs", str(HOSTS * SLOTS), str(SCRIPT), "--out",
                                str(work / "out"), "--steps", str(STEPS)], work=work)
    assert done.returncode == 0, done.stdout[-6000:]
    losses = _read_losses(work / "out")
    assert sorted(losses) == [(stage, step) for stage in (2, 3) for step in range(1, STEPS + 1)]
    return losses


def _runner_env(cluster: Cluster, runner: str) -> dict[str, str]:
    if runner == "openmpi":
        return cluster.openmpi_env()
    if runner == "mpich":
        return cluster.mpich_env()
    return {}


def _assert_spans_hosts(cluster: Cluster, out: Path, name: str) -> None:
    where = _where(out)
    assert len(where) == HOSTS * SLOTS, where
    by_host: dict[object, list[dict[str, object]]] = {}
    for record in where:
        by_host.setdefault(record["hostname"], []).append(record)
    assert sorted(by_host) == sorted(cluster.hostnames), where
    for i, hostname in enumerate(cluster.hostnames):
        records = by_host[hostname]
        assert len(records) == SLOTS
        assert {r["ip"] for r in records} == {cluster.host_ip(i)}
        assert {r["netns"] for r in records} == {cluster.netns_inode(i)}
    assert {r["marker"] for r in where} == {f"carried-{name}"}


@pytest.mark.parametrize("runner", ["pdsh", "ssh", "openmpi", "mpich"])
def test_three_hosts_train_as_six_ranks_on_one(cluster: Cluster, reference: dict[tuple[int, int], tuple[int, float]],
                                               runner: str) -> None:
    work = _job_dir(cluster, runner)
    done = _launch(cluster, 0, [ZEROSPEED, "--hostfile", str(work / "hostfile"), "--launcher", runner,
                                str(SCRIPT), "--out", str(work / "out"), "--steps", str(STEPS)],
                   work=work, env=_runner_env(cluster, runner))
    assert done.returncode == 0, done.stdout[-6000:]
    assert _read_losses(work / "out") == reference
    _assert_spans_hosts(cluster, work / "out", runner)
    for i, hostname in enumerate(cluster.hostnames):  # each rank's output line names its host and rank
        assert f"[{hostname} rank {i * SLOTS}]" in done.stdout, done.stdout[-3000:]


def test_slurm_srun_starts_one_agent_per_host(cluster: Cluster,
                                              reference: dict[tuple[int, int], tuple[int, float]]) -> None:
    from zerospeed.testing.slurm_cluster import SlurmCluster, slurm_unavailable_reason

    reason = slurm_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    work = _job_dir(cluster, "slurm")
    with SlurmCluster(cluster) as slurm:
        done = _launch(cluster, 0, slurm.client_argv([
            ZEROSPEED, "--hostfile", str(work / "hostfile"), "--launcher", "slurm", str(SCRIPT),
            "--out", str(work / "out"), "--steps", str(STEPS)]), work=work, env=slurm.slurm_env())
    assert done.returncode == 0, done.stdout[-6000:]
    assert _read_losses(work / "out") == reference
    _assert_spans_hosts(cluster, work / "out", "slurm")


def test_no_ssh_one_launcher_per_host(cluster: Cluster, reference: dict[tuple[int, int], tuple[int, float]]) -> None:
    work = _job_dir(cluster, "no_ssh")
    procs = [cluster.run_on(i, [ZEROSPEED, "--hostfile", str(work / "hostfile"), "--no_ssh", "--node_rank", str(i),
                                "--master_addr", cluster.hostnames[0], str(SCRIPT), "--out", str(work / "out"),
                                "--steps", str(STEPS)], cwd=str(work), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(HOSTS)]
    outputs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
        outputs.append(out)
    assert [p.returncode for p in procs] == [0] * HOSTS, "\n".join(o[-3000:] for o in outputs)
    assert _read_losses(work / "out") == reference
    _assert_spans_hosts(cluster, work / "out", "no_ssh")


def _wait_for_step(out: Path, step: int, proc: subprocess.Popen[str], timeout: float) -> None:
    """Until rank 0 has written ``step`` (any stage), or fail with the job's output."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = out / "losses.jsonl"
        if path.exists() and any(json.loads(line)["step"] >= step for line in path.read_text().splitlines()):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    output, _ = proc.communicate()
    pytest.fail(f"step {step} not reached (exit {proc.returncode}):\n{output[-6000:]}")


def _job_pids(cluster: Cluster, host: int, baseline: set[int]) -> set[int]:
    """Processes on ``host`` that were not there before the job (the job's, or leftovers of it)."""
    return cluster.pids_on(host) - baseline


def test_a_host_lost_mid_run_ends_the_job_everywhere_naming_it(cluster: Cluster) -> None:
    work = _job_dir(cluster, "lost_host")
    baseline = {i: cluster.pids_on(i) for i in range(HOSTS)}
    proc = cluster.run_on(0, [ZEROSPEED, "--hostfile", str(work / "hostfile"), "--launcher", "pdsh", str(SCRIPT),
                              "--out", str(work / "out"), "--steps", "200", "--stages", "2", "--step_delay", "0.2"],
                          cwd=str(work), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_step(work / "out", 10, proc, LAUNCH_TIMEOUT_S)
        cluster.kill_host(2)  # every process of host 2, its sshd too: the machine is gone
        killed_at = time.monotonic()
        output, _ = proc.communicate(timeout=90)
        ended_after = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        cluster.revive_host(2)
    assert proc.returncode != 0, output[-4000:]
    assert ended_after < 60, (ended_after, output[-4000:])
    summary = [line for line in output.splitlines() if line.startswith("zerospeed: host ")]
    assert summary and summary[0].startswith(f"zerospeed: host {cluster.hostnames[2]}"), output[-4000:]
    time.sleep(1.0)  # the stopped agents' last exits are reaped by their sshd sessions
    for i in range(HOSTS - 1):
        assert _job_pids(cluster, i, baseline[i]) == set(), (i, output[-3000:])


def _phases(losses: dict[tuple[int, int], tuple[int, float]], stage: int) -> list[tuple[int, int, int]]:
    """``(world, first step, last step)`` runs of the final per-step world sizes."""
    phases: list[tuple[int, int, int]] = []
    for step in sorted(s for st, s in losses if st == stage):
        world = losses[(stage, step)][0]
        if phases and phases[-1][0] == world and phases[-1][2] == step - 1:
            phases[-1] = (world, phases[-1][1], step)
        else:
            phases.append((world, step, step))
    return phases


def test_elastic_job_shrinks_to_the_survivors_and_grows_back(cluster: Cluster) -> None:
    """3 hosts, checkpoints every 4 steps, host 2 killed at step 10: the job goes on from step 8 on 4 ranks with
    the same global batch; host 2 revived: back to 6 ranks from the then newest checkpoint. The losses equal a
    reference that replays the same phases (6 ranks, then 4, then 6) from the same checkpoints."""
    work = _job_dir(cluster, "elastic")
    # 32 steps: after the loss at step 10 the survivors must still be training when host 2 is back and its
    # agent re-joined (probe interval, start-up, a restart): some 10-15 s of steps.
    stage, save_every, steps = 3, 4, 32
    common = [str(SCRIPT), "--stages", str(stage), "--steps", str(steps), "--elastic", "--save_every", str(save_every)]
    proc = cluster.run_on(0, [ZEROSPEED, "--hostfile", str(work / "hostfile"), "--launcher", "ssh",
                              "--elastic_training", "--min_elastic_nodes", "2", "--max_elastic_nodes", "3",
                              "--master_addr", cluster.hostnames[0], *common, "--out", str(work / "out"),
                              "--ckpt", str(work / "ckpt"), "--step_delay", "0.5"],
                          cwd=str(work), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_step(work / "out", 10, proc, LAUNCH_TIMEOUT_S)
        cluster.kill_host(2)
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:  # a few steps on the survivors, then revive
            losses = _read_losses(work / "out")
            if any(world == 4 and step >= 10 for (_, step), (world, _) in losses.items()):
                break
            time.sleep(0.1)
        cluster.revive_host(2)
        output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, output[-6000:]
    losses = _read_losses(work / "out")
    phases = _phases(losses, stage)
    worlds = [world for world, _, _ in phases]
    assert worlds[:3] == [6, 4, 6] and phases[1][1] == 9, (phases, output[-4000:])
    assert f"host {cluster.hostnames[2]} lost" in output and "downtime" in output, output[-4000:]
    # the reference: each phase from the previous phase's last checkpoint, at that phase's world size
    ref = _job_dir(cluster, "elastic_reference")
    for world, _, last in phases:
        done = _launch(cluster, 0, [ZEROSPEED, "--num_procs", str(world), str(SCRIPT), "--stages", str(stage),
                                    "--steps", str(last), "--elastic", "--save_every", str(save_every),
                                    "--out", str(ref / "out"), "--ckpt", str(ref / "ckpt")], work=ref)
        assert done.returncode == 0, done.stdout[-4000:]
    expected = _read_losses(ref / "out")
    assert sorted(expected) == sorted(losses)
    for key in sorted(losses):
        assert losses[key][0] == expected[key][0], key
        assert abs(losses[key][1] - expected[key][1]) <= 1e-6, (key, losses[key], expected[key])


def test_preflight_refuses_before_any_rank_starts_naming_the_host(cluster: Cluster) -> None:
    """An unreachable host, a host with another zerospeed version, a script missing on one host and a bad
    hostfile line: each refused with exit code 2 before any rank starts, naming the host (or line) and the fix."""
    work = _job_dir(cluster, "preflight")
    script = work / "train.py"
    script.write_text((REPO / "tests" / "launcher_scripts" / "multinode_gpt.py").read_text())
    (work / "gpt_path").mkdir()

    def launch(hostfile: str = "hostfile") -> subprocess.CompletedProcess[str]:
        return _launch(cluster, 0, [ZEROSPEED, "--hostfile", str(work / hostfile), "--launcher", "ssh", str(script),
                                    "--out", str(work / "out")], work=work, timeout=120)

    def refused(done: subprocess.CompletedProcess[str], *needles: str) -> None:
        assert done.returncode == 2, done.stdout[-3000:]
        assert "zerospeed: error:" in done.stdout, done.stdout[-3000:]
        for needle in needles:
            assert needle in done.stdout, (needle, done.stdout[-3000:])
        assert not (work / "out").exists()  # no rank ever ran

    h1, h2 = cluster.hostnames[1], cluster.hostnames[2]
    # another zerospeed on h1: its mount namespace sees a different zerospeed/__init__.py
    init = Path(sys.modules["zerospeed"].__file__ or "")
    fake = work / "other_version_init.py"
    fake.write_text(init.read_text().replace('__version__ = "', '__version__ = "9.9.9+other-', 1))
    mount = ["mount", "--bind", str(fake), str(init)]
    subprocess.run(cluster.nsenter_argv(1, mount), check=True)
    try:
        refused(launch(), f"host {h1}", "9.9.9+other-")
    finally:
        subprocess.run(cluster.nsenter_argv(1, ["umount", str(init)]), check=True)
    # the script is missing on h2 (an empty folder over the job folder there)
    subprocess.run(cluster.nsenter_argv(2, ["mount", "-t", "tmpfs", "none", str(work)]), check=True)
    try:
        refused(launch(), f"host {h2}", "train.py")
    finally:
        subprocess.run(cluster.nsenter_argv(2, ["umount", str(work)]), check=True)
    # h2 unreachable: its cable unplugged, so ssh hears nothing (a time-out, not a refusal)
    cluster.set_link(2, up=False)
    try:
        refused(launch(), f"host {h2}", "did not answer")
    finally:
        cluster.set_link(2, up=True)
    # a hostfile line that does not parse: named by file and line before anything is started
    (work / "bad_hostfile").write_text(f"{cluster.hostnames[0]} slots=2\n{h1} slots=two\n")
    refused(launch("bad_hostfile"), "bad_hostfile:2")
