"""Multi-node launching on the namespace test cluster: start-up of every runner against DeepSpeed's,
step time over limited links, elastic downtime.

Three hosts (``zerospeed.testing.cluster.Cluster``: network + UTS + mount namespaces on one bridge, a
real sshd each, the same file system) x 2 ranks, gloo, one torch thread per rank, every launch run from
inside host 0 as a user would run it there. All times are unix times on the one machine clock the
namespaces share: the benchmark's own clock before it starts the runner, the ranks' ``time.time()``
in the files the job writes (``_multinode_bench.py``).

1. **Start-up** (``--parts startup``): runner start -> first optimizer step (the first line of rank 0's
   ``losses.jsonl``) for each zerospeed runner (pdsh, ssh, openmpi, mpich, slurm, no-ssh) and for
   DeepSpeed 0.19.8's own runner (``/tmp/dsvenv/bin/deepspeed``, pdsh; and its ``--no_ssh``) on the
   same hosts, in the same run, the sides interleaved round by round. The job is the acceptance GPT
   (``tests/launcher_scripts/multinode_gpt.py``'s model and batch, ZeRO-2, 2 steps) in each framework's
   flavour (``_multinode_bench.py`` / ``_ds_multinode_job.py``). Also split: "ranks running" (the last
   rank's script began: the runner's own part), "imported" (torch + the framework imported), "engine
   ready" (process group + engine built), and the runner's exit.
2. **Links** (``--parts links``): step time of the 6-rank GPT at a size where the gradients matter
   (d_model 256, 4 layers, vocab 1024, seq 64: 3.4M parameters, ZeRO-2) on 3 hosts x 2 ranks (zerospeed
   pdsh) with unlimited, 10 Gbit/s and 1 Gbit/s links (``Cluster.limit``: tc tbf on each host's link, both
   directions; each limit checked by a 64 MB TCP transfer) against the same job as 6 ranks on host 0.
   Step time: the differences of consecutive ``losses.jsonl`` times after ``--warmup-steps``.
3. **Elastic** (``--parts elastic``): ``--elastic_training --min_elastic_nodes 2`` on 3 hosts, the
   acceptance job with checkpoints every 4 steps; host 2 killed (every process, sshd included) after step
   10. Downtime = kill -> the first step on the survivors (world 4) in ``losses.jsonl``; the engine's
   own "elastic restart ... downtime" line is reported beside it.

    .venv/bin/python benchmarks/bench_multinode.py                 # everything, 3 rounds
    .venv/bin/python benchmarks/bench_multinode.py --quick         # make bench: < 2 min
    .venv/bin/python benchmarks/bench_multinode.py --parts startup --sides pdsh,ds-pdsh --rounds 5

Needs root, namespaces and the Debian packages of ``make cluster-deps`` (a side whose tool is missing
is skipped with the reason); DeepSpeed's side needs ``--deepspeed-python`` (default /tmp/dsvenv/bin/python).
Results: a table on stdout and ``benchmarks/results/multinode.json`` (``--json``; --quick writes none
unless given).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "benchmarks" / "_multinode_bench.py"
DS_JOB = ROOT / "benchmarks" / "_ds_multinode_job.py"
ELASTIC_JOB = ROOT / "tests" / "launcher_scripts" / "multinode_gpt.py"
RESULTS = ROOT / "benchmarks" / "results" / "multinode.json"

ZS_RUNNERS = ("pdsh", "ssh", "openmpi", "mpich", "slurm", "no_ssh")
DS_SIDES = ("ds-pdsh", "ds-no_ssh")
# Tools each side needs on the hosts (cluster_unavailable_reason names the Debian package).
SIDE_TOOLS = {"pdsh": ("pdsh",), "openmpi": ("mpirun.openmpi",), "mpich": ("mpirun.mpich",),
              "slurm": ("srun", "slurmd", "slurmctld", "munged"), "ds-pdsh": ("pdsh",)}
LINK_RATES = ("unlimited", "10gbit", "1gbit")
HOSTS, SLOTS = 3, 2
# The links benchmark's model (multinode_gpt.py's own is 30k parameters: its step is all overhead).
LINK_MODEL = ("--vocab", "1024", "--seq", "64", "--d_model", "256", "--heads", "4", "--layers", "4")
# Runner output lines worth a timestamp (first time seen, seconds after the runner started).
MARKERS = {
    "preflight_passed": re.compile(r"pre-flight passed"),
    "ds_cmd": re.compile(r"\bcmd = "),
    "elastic_restart": re.compile(r"elastic restart(?: \d+)?: (\d+) ranks, downtime ([0-9.]+) s"),
}


def side_label(side: str) -> str:
    return f"DeepSpeed {side[3:]}" if side.startswith("ds-") else f"zerospeed {side}"


# --------------------------------------------------------------------------------------------- launching
@dataclass
class Launch:
    """One job launch: the processes to start (host index, argv), with extra environment, in a fresh folder."""

    name: str
    procs: list[tuple[int, list[str]]]
    env: dict[str, str]
    folder: Path

    @property
    def out(self) -> Path:
        return self.folder / "out"


@dataclass
class RunRecord:
    """What one launch gave: its start, exit, exit codes, marker times, the job's files."""

    name: str
    t_start: float
    t_end: float = 0.0
    codes: list[int | None] = field(default_factory=list)
    markers: dict[str, Any] = field(default_factory=dict)
    log: str = ""
    error: str | None = None
    starts: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    left_over: int = 0

    def summary(self) -> dict[str, Any]:
        """Seconds after the runner started: ranks running, imported, engine ready, first step, exit."""
        out: dict[str, Any] = {"name": self.name, "codes": self.codes, "error": self.error,
                               "left_over_processes": self.left_over, "markers": self.markers}
        if self.starts:
            out["ranks"] = len(self.starts)
            out["hosts"] = len({s["netns"] for s in self.starts})
            for key, name in (("t0", "ranks_running"), ("t_imported", "imported"), ("t_init", "engine_ready")):
                out[name] = max(s[key] for s in self.starts) - self.t_start
        if self.steps:
            out["first_step"] = self.steps[0]["time"] - self.t_start
            out["step_times"] = [b["time"] - a["time"] for a, b in zip(self.steps, self.steps[1:])]
            out["losses"] = [s["loss"] for s in self.steps]
            out["worlds"] = [s["world"] for s in self.steps]
        out["exited"] = self.t_end - self.t_start if self.t_end else None
        return out


def _pump(stream: Any, lines: list[tuple[float, str]], lock: threading.Lock) -> None:
    for raw in iter(stream.readline, ""):
        with lock:
            lines.append((time.time(), raw.rstrip("\n")))
    stream.close()


def _stop(procs: Sequence[subprocess.Popen[str]], grace: float = 10.0) -> None:
    """SIGTERM (the runner stops its job on every host), then SIGKILL: only the processes we started."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class Bench:
    """The cluster (and Slurm, when asked) and the bookkeeping around each launch."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.zerospeed = str(Path(sys.executable).with_name("zerospeed"))
        self.deepspeed = str(Path(args.deepspeed_python).with_name("deepspeed"))
        self.cluster: Any = None
        self.slurm: Any = None
        self.hostfile = Path()
        self.count = 0
        self.baseline: dict[int, set[int]] = {}

    def start(self, with_slurm: bool) -> None:
        from zerospeed.testing.cluster import Cluster

        self.cluster = Cluster(HOSTS).start()
        self.hostfile = self.cluster.folder / "hostfile"
        self.cluster.hostfile(SLOTS, self.hostfile)
        if with_slurm:
            from zerospeed.testing.slurm_cluster import SlurmCluster

            self.slurm = SlurmCluster(self.cluster).start()
        self.take_baseline()

    def stop(self) -> None:
        if self.slurm is not None:
            self.slurm.stop()
        if self.cluster is not None:
            self.cluster.stop()

    def take_baseline(self) -> None:
        """The processes that belong on the hosts (namespace holders, sshd, Slurm's daemons)."""
        self.baseline = {i: self.cluster.pids_on(i) for i in range(HOSTS)}

    def reap_left_over(self, wait: float = 5.0) -> int:
        """Processes a finished launch left on the hosts (beyond the baseline; an sshd session may
        take a moment to close, so wait up to ``wait`` s); SIGKILLed by PID so the next launch starts
        clean. The count is recorded: a runner that leaves processes behind is a finding."""
        deadline = time.monotonic() + wait
        extra: set[int] = set()
        while True:
            extra = set()
            for i in range(HOSTS):
                extra |= self.cluster.pids_on(i) - self.baseline[i]
            if not extra or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        for pid in extra:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(extra)

    def folder(self, name: str) -> Path:
        """A fresh job folder on the shared file system, with the ``.deepspeed_env`` both runners read."""
        self.count += 1
        folder = self.cluster.folder / "runs" / f"{self.count:03d}-{name}"
        folder.mkdir(parents=True)
        # DS_ACCELERATOR: DeepSpeed's CPU accelerator (no CUDA here); OMP_NUM_THREADS=1 on both sides:
        # 6 ranks share 2 cores. zerospeed forwards the file as DeepSpeed does.
        (folder / ".deepspeed_env").write_text("DS_ACCELERATOR=cpu\nOMP_NUM_THREADS=1\n")
        return folder

    def env(self, side: str) -> dict[str, str]:
        env = {**self.cluster.pdsh_env(), **self.cluster.openmpi_env(), **self.cluster.mpich_env(),
               "PYTHONUNBUFFERED": "1"}
        if side == "slurm" and self.slurm is not None:
            env.update(self.slurm.slurm_env())
        return env

    # -- the launches
    def job_launch(self, side: str, job_args: Sequence[str], *, name: str | None = None,
                   extra: Sequence[str] = (), script: Path | None = None) -> Launch:
        """``side`` (a zerospeed runner, ``ds-pdsh``/``ds-no_ssh``, or ``one-host``) running the job."""
        folder = self.folder(name or side)
        args = ["--out", str(folder / "out"), *job_args]
        hf = str(self.hostfile)
        if side.startswith("ds-"):
            ds, job = self.deepspeed, str(script or DS_JOB)
            if side == "ds-pdsh":
                procs = [(0, [ds, "--hostfile", hf, "--launcher", "pdsh", *extra, job, *args])]
            else:
                procs = [(k, [ds, "--hostfile", hf, "--no_ssh", f"--node_rank={k}", "--master_addr",
                              self.cluster.hostnames[0], *extra, job, *args]) for k in range(HOSTS)]
        else:
            zs, job = self.zerospeed, str(script or JOB)
            if side == "one-host":
                procs = [(0, [zs, "--num_procs", str(HOSTS * SLOTS), *extra, job, *args])]
            elif side == "no_ssh":
                procs = [(k, [zs, "--hostfile", hf, "--no_ssh", f"--node_rank={k}", "--master_addr",
                              self.cluster.hostnames[0], *extra, job, *args]) for k in range(HOSTS)]
            else:
                procs = [(0, [zs, "--hostfile", hf, "--launcher", side, *extra, job, *args])]
        return Launch(name=side, procs=procs, env=self.env(side), folder=folder)

    def run(self, launch: Launch, *, timeout: float | None = None,
            during: Any = None) -> RunRecord:
        """Start every process of ``launch`` (t_start: just before the first), wait (``during(record,
        launch)`` is polled meanwhile: the elastic benchmark kills a host from it), read the job's files."""
        timeout = timeout or self.args.timeout
        lines: list[tuple[float, str]] = []
        lock = threading.Lock()
        procs: list[subprocess.Popen[str]] = []
        pumps: list[threading.Thread] = []
        record = RunRecord(name=launch.name, t_start=time.time())
        for host, argv in launch.procs:
            proc = self.cluster.run_on(host, argv, env=launch.env, cwd=str(launch.folder), stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       errors="replace")
            procs.append(proc)
            pump = threading.Thread(target=_pump, args=(proc.stdout, lines, lock), daemon=True)
            pump.start()
            pumps.append(pump)
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                record.error = f"ran past {timeout:.0f} s; stopped"
                _stop(procs)
                break
            if during is not None:
                during(record, launch)
            time.sleep(0.05)
        record.t_end = time.time()
        for pump in pumps:
            pump.join(timeout=5)
        record.codes = [p.returncode for p in procs]
        with lock:
            record.log = "\n".join(f"{t - record.t_start:8.3f} {line}" for t, line in lines)
            for key, pattern in MARKERS.items():
                for t, line in lines:
                    match = pattern.search(line)
                    if match:
                        record.markers[key] = {"t": t - record.t_start, "groups": list(match.groups())}
                        break
        (launch.folder / "runner.log").write_text(record.log + "\n")
        if self.args.keep_logs:  # the cluster folder goes with the cluster: keep a copy where asked
            keep = Path(self.args.keep_logs)
            keep.mkdir(parents=True, exist_ok=True)
            (keep / f"{launch.folder.name}.log").write_text(record.log + "\n")
        if record.error is None and any(code != 0 for code in record.codes):
            record.error = f"exit codes {record.codes}"
        out = launch.out
        if out.is_dir():
            record.starts = [json.loads(p.read_text()) for p in sorted(out.glob("start-rank*.json"))]
            losses = out / "losses.jsonl"
            if losses.exists():
                record.steps = [json.loads(line) for line in losses.read_text().splitlines() if line.strip()]
        if record.error is not None:
            record.error += "; last lines:\n" + "\n".join(record.log.splitlines()[-12:])
        record.left_over = self.reap_left_over()
        return record

    # -- link check
    def link_rate(self, megabytes: int = 64) -> float:
        """Gbit/s of one TCP stream h1 -> h0 (what the limit really gives on this CPU)."""
        port = 29999
        server = ("import socket,time,sys\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
                  f"s.bind(('0.0.0.0',{port}));s.listen(1);print('ready',flush=True);c,_=s.accept();n=0;t=None\n"
                  "while True:\n b=c.recv(1<<20)\n if t is None: t=time.time()\n if not b: break\n n+=len(b)\n"
                  "print(n*8/(time.time()-t)/1e9)\n")
        client = (f"import socket\nc=socket.create_connection(('{self.cluster.hostnames[0]}',{port}))\n"
                  f"b=bytes(1<<20)\nfor _ in range({megabytes}): c.sendall(b)\nc.close()\n")
        srv = self.cluster.run_on(0, [sys.executable, "-c", server], stdout=subprocess.PIPE, text=True)
        assert srv.stdout is not None
        srv.stdout.readline()
        self.cluster.check_output_on(1, [sys.executable, "-c", client], timeout=120)
        rate = float(srv.stdout.readline())
        srv.wait(timeout=10)
        return rate


# --------------------------------------------------------------------------------------------- statistics
def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def fmt(stat: dict[str, float] | None, scale: float = 1.0, digits: int = 2) -> str:
    if not stat:
        return "-"
    return (f"{stat['median'] * scale:.{digits}f} ({stat['min'] * scale:.{digits}f}-"
            f"{stat['max'] * scale:.{digits}f})")


def rotated(items: Sequence[str], k: int) -> list[str]:
    """Round ``k``'s order: each side takes each position in turn (no side always runs first, warm)."""
    k %= max(1, len(items))
    return list(items[k:]) + list(items[:k])


# --------------------------------------------------------------------------------------------- parts
def bench_startup(bench: Bench, sides: Sequence[str], args: argparse.Namespace) -> dict[str, Any]:
    job_args = ["--steps", str(args.startup_steps), "--stage", "2"]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    if args.warmup_runs:  # pyc files, page cache, DeepSpeed's cached shm op: untimed, once per framework
        firsts = [next((s for s in sides if s.startswith("ds-") == ds), None) for ds in (False, True)]
        for side in (s for s in firsts if s is not None):
            rec = bench.run(bench.job_launch(side, job_args, name=f"warmup-{side}"))
            print(f"  warm-up {side_label(side)}: {'ok' if rec.error is None else rec.error.splitlines()[0]}",
                  flush=True)
    for r in range(args.rounds):
        for side in rotated(sides, r):
            rec = bench.run(bench.job_launch(side, job_args))
            summ = rec.summary()
            summ["round"] = r
            runs[side].append(summ)
            status = (f"first step {summ['first_step']:.2f} s" if "first_step" in summ and rec.error is None
                      else f"FAILED: {rec.error}")
            print(f"  round {r + 1} {side_label(side)}: {status}", flush=True)
    table: dict[str, Any] = {}
    for side in sides:
        good = [s for s in runs[side] if s["error"] is None and "first_step" in s]
        table[side] = {key: spread([s[key] for s in good]) if good and all(key in s for s in good) else None
                       for key in ("ranks_running", "imported", "engine_ready", "first_step", "exited")}
        table[side]["ok_runs"] = len(good)
        table[side]["hosts"] = sorted({int(s.get("hosts", 0)) for s in good})
        pre = [s["markers"]["preflight_passed"]["t"] for s in good if "preflight_passed" in s["markers"]]
        table[side]["preflight_passed"] = spread(pre) if pre else None
        table[side]["left_over_processes"] = sum(s["left_over_processes"] for s in runs[side])
    ratios: dict[str, Any] = {}
    peer = "ds-pdsh" if "ds-pdsh" in sides else None
    if peer is not None:
        peer_by_round = {s["round"]: s for s in runs[peer] if s["error"] is None and "first_step" in s}
        for side in sides:
            if side.startswith("ds-"):
                continue
            per_round = [s["first_step"] / peer_by_round[s["round"]]["first_step"] for s in runs[side]
                         if s["error"] is None and "first_step" in s and s["round"] in peer_by_round]
            if per_round:
                ratios[side] = spread(per_round)
    return {"job_args": job_args, "runs": runs, "table": table, "ratio_first_step_vs_ds_pdsh": ratios}


def print_startup(result: dict[str, Any]) -> None:
    print("\nStart-up, seconds after the runner started (median (min-max) over the rounds):")
    head = (f"{'side':<20}{'ok':>4}{'pre-flight ok':>20}{'ranks running':>20}{'imported':>20}"
            f"{'engine ready':>20}{'FIRST STEP':>20}{'runner exit':>20}{'vs DS pdsh':>20}  hosts  left")
    print(head)
    for side, row in result["table"].items():
        ratio = result["ratio_first_step_vs_ds_pdsh"].get(side)
        print(f"{side_label(side):<20}{row['ok_runs']:>4}{fmt(row['preflight_passed']):>20}"
              f"{fmt(row['ranks_running']):>20}{fmt(row['imported']):>20}{fmt(row['engine_ready']):>20}"
              f"{fmt(row['first_step']):>20}{fmt(row['exited']):>20}{fmt(ratio, digits=3):>20}"
              f"  {','.join(map(str, row['hosts'])):>5}  {row['left_over_processes']}")


def bench_links(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    job_args = ["--steps", str(args.link_steps), "--stage", "2", *LINK_MODEL]
    # setting -> (side, rate): zerospeed on one host and on 3 hosts per rate; DeepSpeed's pdsh beside
    # it with --link-deepspeed (the same model in DeepSpeed's engine: the links' cost in the peer).
    plan: dict[str, tuple[str, str | None]] = {"one-host": ("one-host", None)}
    plan.update({f"3x2 {rate}": (args.link_runner, rate) for rate in args.rates})
    if args.link_deepspeed:
        plan.update({f"ds 3x2 {rate}": ("ds-pdsh", rate) for rate in args.rates})
    settings = list(plan)
    measured: dict[str, float] = {}
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in settings}
    for r in range(args.rounds):
        for setting in rotated(settings, r):
            side, rate = plan[setting]
            if rate in (None, "unlimited"):
                bench.cluster.unlimit()
            else:
                bench.cluster.limit(rate=rate)
            if rate is not None and rate not in measured:  # one host: loopback, no link
                measured[rate] = bench.link_rate()
            rec = bench.run(bench.job_launch(side, job_args, name=setting.replace(" ", "-")))
            summ = rec.summary()
            summ["round"] = r
            summ["setting"] = setting
            runs[setting].append(summ)
            steps = summ.get("step_times", [])[args.warmup_steps:]
            status = (f"step {statistics.median(steps) * 1e3:.0f} ms (median of {len(steps)})"
                      if steps and rec.error is None else f"FAILED: {rec.error}")
            print(f"  round {r + 1} {setting}: {status}", flush=True)
    bench.cluster.unlimit()
    table: dict[str, Any] = {}
    for setting in settings:
        good = [s for s in runs[setting] if s["error"] is None and len(s.get("step_times", [])) > args.warmup_steps]
        pooled = [t for s in good for t in s["step_times"][args.warmup_steps:]]
        per_round = {s["round"]: statistics.median(s["step_times"][args.warmup_steps:]) for s in good}
        table[setting] = {"step": spread(pooled) if pooled else None, "round_medians": per_round,
                          "link_gbit_s": measured.get(plan[setting][1] or ""), "ok_runs": len(good),
                          "final_loss": good[0]["losses"][-1] if good else None}
    base = table["one-host"]["round_medians"]
    for setting in settings:
        rounds = table[setting]["round_medians"]
        per = [rounds[r] / base[r] for r in rounds if r in base]
        table[setting]["vs_one_host"] = spread(per) if per else None
    return {"job_args": job_args, "runner": args.link_runner, "runs": runs, "table": table,
            "link_gbit_s": measured}


def print_links(result: dict[str, Any]) -> None:
    print(f"\nStep time of the 6-rank GPT ({' '.join(result['job_args'][4:])}, ZeRO-2), 3 hosts x 2 ranks "
          f"through {side_label(result['runner'])} ('ds' rows: DeepSpeed's pdsh runner and engine) vs 6 ranks "
          "on one host (zerospeed); ms (median (min-max) over all steps):")
    print(f"{'setting':<18}{'ok':>4}{'TCP Gbit/s':>12}{'step ms':>26}{'round medians ms':>24}{'vs one host':>22}"
          f"{'final loss':>12}")
    for setting, row in result["table"].items():
        rounds = list(row["round_medians"].values())
        rm = f"{min(rounds) * 1e3:.0f}-{max(rounds) * 1e3:.0f}" if rounds else "-"
        gbit = f"{row['link_gbit_s']:.2f}" if row["link_gbit_s"] is not None else "-"
        loss = f"{row['final_loss']:.4f}" if row["final_loss"] is not None else "-"
        print(f"{setting:<18}{row['ok_runs']:>4}{gbit:>12}{fmt(row['step'], 1e3, 0):>26}{rm:>24}"
              f"{fmt(row['vs_one_host'], digits=3):>22}{loss:>12}")


def bench_elastic(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    for r in range(args.elastic_rounds):
        killed: dict[str, float] = {}

        def kill_at_step(record: RunRecord, launch: Launch) -> None:
            if killed:
                return
            losses = launch.out / "losses.jsonl"
            if losses.exists() and sum(1 for _ in losses.open()) >= args.kill_step:
                killed["t"] = time.time()
                bench.cluster.kill_host(HOSTS - 1)
                killed["done"] = time.time()

        launch = bench.job_launch(args.link_runner, [], name="elastic", script=ELASTIC_JOB,
                                  extra=["--master_addr", bench.cluster.hostnames[0],
                                         "--elastic_training", "--min_elastic_nodes", "2",
                                         "--max_elastic_nodes", str(HOSTS)])
        ckpt = launch.folder / "ckpt"
        # multinode_gpt.py's own arguments (after --out): ZeRO-2 only, checkpoints every 4 steps, a
        # short pause per step so "after step 10" is a moment the benchmark can catch.
        launch.procs = [(h, [*argv, "--stages", "2", "--steps", "20", "--elastic", "--ckpt", str(ckpt),
                             "--save_every", "4", "--step_delay", str(args.step_delay)])
                        for h, argv in launch.procs]
        rec = bench.run(launch, during=kill_at_step)
        bench.cluster.revive_host(HOSTS - 1)
        bench.take_baseline()
        summ = rec.summary()
        summ["round"] = r
        if killed:
            summ["killed_at"] = killed["t"] - rec.t_start
            after = [s for s in rec.steps if s["time"] > killed["t"] and s["world"] < HOSTS * SLOTS]
            if after:
                summ["downtime"] = after[0]["time"] - killed["t"]
                summ["resumed_at_step"] = after[0]["step"]
                summ["world_after"] = after[0]["world"]
        marker = summ["markers"].get("elastic_restart")
        if marker:
            summ["engine_downtime"] = float(marker["groups"][1])
        runs.append(summ)
        status = (f"downtime {summ['downtime']:.2f} s (resumed at step {summ['resumed_at_step']} on "
                  f"{summ['world_after']} ranks; engine says {summ.get('engine_downtime')} s)"
                  if "downtime" in summ else f"FAILED: {rec.error or 'no step on the survivors'}")
        print(f"  round {r + 1} elastic: {status}", flush=True)
    good = [s for s in runs if "downtime" in s]
    table = {"downtime": spread([s["downtime"] for s in good]) if good else None,
             "engine_downtime": spread([s["engine_downtime"] for s in good if "engine_downtime" in s])
             if any("engine_downtime" in s for s in good) else None,
             "ok_runs": len(good)}
    return {"runner": args.link_runner, "kill_after_step": args.kill_step, "runs": runs, "table": table}


def print_elastic(result: dict[str, Any]) -> None:
    t = result["table"]
    print(f"\nElastic ({side_label(result['runner'])}, 3 hosts -> host 2 killed after step {result['kill_after_step']}):"
          f" downtime kill -> first step on the survivors {fmt(t['downtime'])} s over {t['ok_runs']} run(s);"
          f" the engine's own line: {fmt(t['engine_downtime'])} s")


# --------------------------------------------------------------------------------------------- main
def machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                            "kernel": platform.release(), "loadavg_start": os.getloadavg()}
    with contextlib.suppress(Exception):
        import zerospeed

        info["zerospeed"] = zerospeed.__version__
    return info


def available(side: str, args: argparse.Namespace) -> str | None:
    """Why ``side`` cannot run here, or None."""
    from zerospeed.testing.cluster import cluster_unavailable_reason

    reason = cluster_unavailable_reason(SIDE_TOOLS.get(side, ()))
    if reason is not None:
        return reason
    if side == "slurm":
        from zerospeed.testing.slurm_cluster import slurm_unavailable_reason

        return slurm_unavailable_reason()
    if side.startswith("ds-") and not Path(args.deepspeed_python).exists():
        return f"--deepspeed-python {args.deepspeed_python} does not exist (an interpreter with DeepSpeed 0.19.8)"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--parts", default="startup,links,elastic")
    parser.add_argument("--sides", default=",".join((*ZS_RUNNERS, *DS_SIDES)),
                        help="start-up sides: zerospeed runners and ds-pdsh, ds-no_ssh")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--startup-steps", type=int, default=2)
    parser.add_argument("--rates", default=",".join(LINK_RATES), help="link settings for 3 hosts (tc rates)")
    parser.add_argument("--link-steps", type=int, default=12)
    parser.add_argument("--warmup-steps", type=int, default=2, help="first step intervals left out of step times")
    parser.add_argument("--link-runner", default="pdsh", help="the zerospeed runner of the links and elastic parts")
    parser.add_argument("--link-deepspeed", action="store_true",
                        help="links: the same 3-host runs through DeepSpeed's pdsh runner and engine too")
    parser.add_argument("--elastic-rounds", type=int, default=1)
    parser.add_argument("--kill-step", type=int, default=10)
    parser.add_argument("--step-delay", type=float, default=0.3, help="elastic job: pause after each step (s)")
    parser.add_argument("--timeout", type=float, default=300.0, help="per launch (s)")
    parser.add_argument("--no-warmup", dest="warmup_runs", action="store_false",
                        help="no untimed first launch per framework before the start-up rounds")
    parser.add_argument("--deepspeed-python", default="/tmp/dsvenv/bin/python")
    parser.add_argument("--merge", action="store_true",
                        help="update the parts run now in an existing --json file, keep the others")
    parser.add_argument("--keep-logs", default=None, metavar="DIR",
                        help="copy every launch's output (timestamped, seconds after its start) into DIR")
    parser.add_argument("--json", default=None, help=f"results file (default {RESULTS.relative_to(ROOT)})")
    parser.add_argument("--quick", action="store_true",
                        help="make bench: zerospeed pdsh vs DeepSpeed pdsh start-up and the links at "
                             "1 Gbit/s vs one host, one round, no warm-up, no results file")
    args = parser.parse_args()
    if args.quick:
        args.parts, args.sides, args.rounds, args.rates = "startup,links", "pdsh,ds-pdsh", 1, "1gbit"
        args.link_steps, args.warmup_runs = 6, False
    parts = [p for p in args.parts.split(",") if p]
    json_path = Path(args.json) if args.json else (None if args.quick else RESULTS)

    from zerospeed.testing.cluster import cluster_unavailable_reason

    reason = cluster_unavailable_reason()
    if reason is not None:
        print(f"bench_multinode: skipped: {reason}")
        return
    sides, skipped = [], {}
    for side in (s for s in args.sides.split(",") if s):
        why = available(side, args)
        if why is None:
            sides.append(side)
        else:
            skipped[side] = why
            print(f"skipping {side_label(side)}: {why}")
    args.rates = [r for r in args.rates.split(",") if r]
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:],
                               "machine": machine(), "skipped": skipped, "hosts": HOSTS, "slots": SLOTS}
    bench = Bench(args)
    bench.start(with_slurm="startup" in parts and "slurm" in sides)
    try:
        if "startup" in parts and sides:
            print(f"start-up: {', '.join(map(side_label, sides))}; {args.rounds} round(s)", flush=True)
            results["startup"] = bench_startup(bench, sides, args)
        if "links" in parts:
            print("links: " + ", ".join(["one host", *args.rates]), flush=True)
            results["links"] = bench_links(bench, args)
        if "elastic" in parts:
            print("elastic:", flush=True)
            results["elastic"] = bench_elastic(bench, args)
    finally:
        results["machine"]["loadavg_end"] = os.getloadavg()
        bench.stop()
    if "startup" in results:
        print_startup(results["startup"])
    if "links" in results:
        print_links(results["links"])
    if "elastic" in results:
        print_elastic(results["elastic"])
    print(f"\nload average at start {results['machine']['loadavg_start']}, at end {results['machine']['loadavg_end']}")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        if args.merge and json_path.exists():  # e.g. the elastic part run later into the same file
            merged = json.loads(json_path.read_text())
            merged.setdefault("later_runs", []).append({k: results[k] for k in ("date", "argv", "machine")})
            merged.update({k: v for k, v in results.items() if k in ("startup", "links", "elastic")})
            results = merged
        json_path.write_text(json.dumps(results, indent=1) + "\n")
        print(f"results: {json_path}")


if __name__ == "__main__":
    main()
