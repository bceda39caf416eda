"""Compressed gradient communication over a slow link: 1-bit Adam and 0/1 Adam against Adam, DDP and PowerSGD.

Two gloo ranks run in two network namespaces joined by a veth pair shaped with ``tc tbf`` to each
``--rates`` value (Mbit/s, both directions; the shaping is checked by a measured TCP transfer first), so
every byte of gradient exchange crosses a real bottleneck instead of loopback. Each rank is a process
started with ``ip netns exec <ns> python ...`` (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR = rank 0's veth
address, GLOO_SOCKET_IFNAME = the rank's veth). The namespaces are this script's and are removed on exit,
on a signal or when a rank crashes (benchmarks/_netns.py); where namespaces cannot be made (not root, no
iproute2, EPERM) the script prints SKIPPED and exits 0.

Sides, all built in the same two rank processes from the same seeded GPT (examples/gpt.py), trained on
the same per-step batches (a synthetic bigram language over a few token ids, so the loss falls within a
short run), fp32, clipping by global norm (``--clip``, 1.0 = zerospeed's default), no weight decay, the
same lr and betas; step i of every side runs before step i+1 of any (rotating order), so load from other
processes on a shared machine hits all sides alike:

    local      no communication at all: the compute floor of a step (each rank trains alone)
    adam       zerospeed.initialize, optimizer "Adam", ZeRO stage 0 (fp32 gradient all-reduce)
    onebit     zerospeed "OneBitAdam" (freeze_step = the warm-up steps)
    zeroone    zerospeed "ZeroOneAdam" (var_freeze_step = the warm-up steps)
    ddp        torch DistributedDataParallel + torch.optim.Adam
    powersgd   DDP + torch's PowerSGD hook (start_powerSGD_iter = the warm-up steps) + torch.optim.Adam

A side whose optimizer type this build does not implement is reported "not available in this build".
Per side and rate: the warm-up time (the first ``--warmup`` steps: 1-bit Adam's uncompressed phase), the
mean step time over the following ``--steps`` steps (a barrier aligns the ranks before each step; a
step's time is the slower rank's), the
ratio to Adam, the training loss of the last step (mean over ranks), the loss of rank 0's model on a
held-out batch after the run, and for the zerospeed sides the bytes each rank sent per steady step from
``engine.comm_bytes()``.

    python benchmarks/bench_comm_compression.py [--rates 1000,100] [--warmup 10] [--steps 30] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd  # noqa: E402

import _netns  # noqa: E402

SIDES = ("local", "adam", "onebit", "zeroone", "ddp", "powersgd")
LABELS = {"local": "local (no comm)", "adam": "zerospeed Adam", "onebit": "zs OneBitAdam",
          "zeroone": "zs ZeroOneAdam", "ddp": "DDP Adam", "powersgd": "DDP PowerSGD"}
ZEROSPEED_TYPES = {"adam": "Adam", "onebit": "OneBitAdam", "zeroone": "ZeroOneAdam"}
SEED = 1234
PORT = 29561  # the namespaces are fresh, so a fixed port cannot collide with another run


# -- data: a random bigram language over the first ``active`` token ids, the same on every side -----------
def bigram_table(spec: dict) -> torch.Tensor:
    """active x 4 successor table: each used token has 4 equally likely successors (entropy floor ln 4 =
    1.386 nats); a loss below ln(active) means the model learned more than which ids occur."""
    gen = torch.Generator().manual_seed(SEED)
    return torch.randint(0, spec["active"], (spec["active"], 4), generator=gen)


def batch(spec: dict, table: torch.Tensor, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows for (step, rank): seeded by both, so every side sees the same data; step -1 is the held-out batch."""
    gen = torch.Generator().manual_seed(SEED + 7919 * (step + 2) + rank)
    rows = torch.empty(spec["batch"], spec["seq"] + 1, dtype=torch.long)
    rows[:, 0] = torch.randint(0, spec["active"], (spec["batch"],), generator=gen)
    choice = torch.randint(0, 4, (spec["batch"], spec["seq"]), generator=gen)
    for t in range(spec["seq"]):
        rows[:, t + 1] = table[rows[:, t], choice[:, t]]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def build_model(spec: dict) -> nn.Module:
    torch.manual_seed(SEED)
    return GPT(GPTConfig(vocab_size=spec["vocab"], seq_len=spec["seq"], d_model=spec["width"],
                         n_layers=spec["layers"], n_heads=max(1, spec["width"] // 64)))


def adam_params(spec: dict) -> dict:
    return {"lr": spec["lr"], "betas": [0.9, spec["beta2"]], "eps": 1e-8, "weight_decay": 0.0}


def zerospeed_config(side: str, spec: dict) -> dict:
    """The config dict of a zerospeed side: stage 0, the optimizer type and its parameters."""
    params = adam_params(spec)
    if side == "onebit":
        params["freeze_step"] = spec["warmup"]
    elif side == "zeroone":
        params.update(var_freeze_step=spec["warmup"], var_update_scaler=spec["var_update_scaler"],
                      local_step_scaler=spec["local_step_scaler"], local_step_clipper=spec["local_step_clipper"])
    return {"train_micro_batch_size_per_gpu": spec["batch"], "gradient_accumulation_steps": 1,
            "steps_per_print": 10**9, "zero_optimization": {"stage": 0}, "gradient_clipping": spec["clip"],
            "optimizer": {"type": ZEROSPEED_TYPES[side], "params": params}}


# -- rank side: build every side, then train them step by step, interleaved ---------------------------------
class SideUnavailable(Exception):
    """The build refuses this side's optimizer type (not implemented yet)."""


@dataclass
class Side:
    """One side in a rank: its step, the bare model (for evaluation) and its payload counter."""

    step: Callable[[torch.Tensor, torch.Tensor], float]
    model: nn.Module
    sent: Callable[[], int]


def make_side(side: str, spec: dict) -> Side:
    """Build ``side`` from the seeded model; ``SideUnavailable`` when this build refuses its optimizer."""
    model = build_model(spec)
    if side == "local":
        opt = torch.optim.Adam(model.parameters(), **adam_params(spec))
        return Side(_torch_step(model, opt, spec["clip"]), model, lambda: 0)
    if side in ("ddp", "powersgd"):
        if side == "ddp":
            ddp = nn.parallel.DistributedDataParallel(model)  # default buckets, overlapped with backward
        else:
            # one bucket: with gloo, PowerSGD's later collectives are issued from future callbacks on gloo's
            # threads, and several buckets' chains then interleave differently on each rank (a collective
            # mismatch, "op.preamble.length <= op.nbytes"); an explicit cap also sizes the first bucket
            mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
            ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=mib + 1)
            state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=spec["powersgd_rank"],
                                       start_powerSGD_iter=max(2, spec["warmup"]), random_seed=SEED)
            ddp.register_comm_hook(state, psgd.powerSGD_hook)
        opt = torch.optim.Adam(ddp.parameters(), **adam_params(spec))
        return Side(_torch_step(ddp, opt, spec["clip"]), model, lambda: 0)
    import zerospeed

    try:
        engine, _, _, _ = zerospeed.initialize(model=model, config=zerospeed_config(side, spec))
    except NotImplementedError as exc:
        if ZEROSPEED_TYPES[side] in str(exc):
            raise SideUnavailable(str(exc).splitlines()[0]) from exc
        raise

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    def sent() -> int:  # bytes this rank put on the wire, every collective of the engine's mesh
        return int(engine.comm_bytes()["total_sent"])

    return Side(step, engine.module, sent)


def _torch_step(wrapped: nn.Module, opt: torch.optim.Optimizer,
                clip: float) -> Callable[[torch.Tensor, torch.Tensor], float]:
    """forward, backward (DDP reduces in it), clipping by the global norm as zerospeed does, Adam step."""
    params = list(wrapped.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = wrapped(x, y)
        loss.backward()
        if clip > 0:
            nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def train_all(sides: dict[str, Side], spec: dict, table: torch.Tensor, rank: int) -> dict[str, dict]:
    """Step i of every side, then step i+1 ...: the sides share the machine's load alike (other processes
    on a shared machine move a side's time more than what is measured). The order rotates each step; a
    barrier aligns the ranks before each side's step, whose time is the slowest rank's. A side failing on
    a step (on both ranks alike) is dropped and reported."""
    names = list(sides)
    times: dict[str, list[float]] = {s: [] for s in names}
    losses: dict[str, list[float]] = {s: [] for s in names}
    sent_after_warmup: dict[str, int] = {}
    failed: dict[str, dict] = {}
    for i in range(spec["warmup"] + spec["steps"]):
        x, y = batch(spec, table, i, rank)
        if rank == 0 and i % 5 == 0:
            print(f"  [{spec['rate']:g} Mbit/s] step {i}", file=sys.stderr, flush=True)
        for k in range(len(names)):
            name = names[(i + k) % len(names)]
            if name in failed:
                continue
            dist.barrier()
            start = time.perf_counter()
            try:
                losses[name].append(sides[name].step(x, y))
            except Exception as exc:
                traceback.print_exc()
                failed[name] = {"status": "error", "reason": f"step {i}: {type(exc).__name__}: {exc}"[:300]}
                continue
            times[name].append(time.perf_counter() - start)
        if i == spec["warmup"] - 1:
            sent_after_warmup = {s: side.sent() for s, side in sides.items()}
    out: dict[str, dict] = dict(failed)
    all_times = [None] * dist.get_world_size()
    dist.all_gather_object(all_times, times)
    all_losses = [None] * dist.get_world_size()
    dist.all_gather_object(all_losses, losses)
    held_out = batch(spec, table, -1, 0)
    for name, side in sides.items():
        if name in failed:
            continue
        slowest = [max(per_rank) for per_rank in zip(*(t[name] for t in all_times))]
        warm, steady = slowest[:spec["warmup"]], slowest[spec["warmup"]:]
        last = torch.tensor([losses[name][-1]])
        dist.all_reduce(last)
        with torch.no_grad():
            side.model.eval()
            eval_loss = float(side.model(*held_out))
        mean_losses = [statistics.fmean(step) for step in zip(*(per_rank[name] for per_rank in all_losses))]
        out[name] = {"status": "ok", "warmup_s": sum(warm), "mean_step_s": statistics.fmean(steady),
                     "step_s": slowest, "losses": mean_losses,
                     "median_step_s": statistics.median(steady), "train_loss": float(last) / dist.get_world_size(),
                     "eval_loss": eval_loss, "first_loss": losses[name][0],
                     "payload_bytes": ((side.sent() - sent_after_warmup[name]) / spec["steps"]
                                       if name in ZEROSPEED_TYPES else None)}
    return out


def worker(spec_path: str, out_path: str) -> None:
    """One rank (RANK etc. from the environment): every side; rank 0 writes the results as JSON."""
    torch.set_num_threads(1)
    quiet = logging.StreamHandler()  # zerospeed's warnings still show; its resolved-config dump does not
    quiet.setLevel(logging.WARNING)
    logging.getLogger("zerospeed").addHandler(quiet)
    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=spec["timeout"]))
    rank = dist.get_rank()
    sides: dict[str, Side] = {}
    results: dict[str, dict] = {}
    for name in spec["sides"]:
        try:
            sides[name] = make_side(name, spec)
        except SideUnavailable as exc:  # refused alike on both ranks, before any collective of its own
            results[name] = {"status": "unavailable", "reason": str(exc)}
        except Exception as exc:  # e.g. a config the new optimizer refuses: reported, the other sides still run
            traceback.print_exc()
            results[name] = {"status": "error", "reason": f"build: {type(exc).__name__}: {exc}".splitlines()[0][:300]}
        dist.barrier()
    results.update(train_all(sides, spec, bigram_table(spec), rank))
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.destroy_process_group()


# -- parent: namespaces, rate, ranks, report ----------------------------------------------------------------
def run_rate(link: _netns.VethLink, spec: dict, workdir: Path) -> dict:
    """Start the two ranks in their namespaces for one rate and return rank 0's results."""
    spec_path, out_path = workdir / f"spec-{spec['rate']}.json", workdir / f"out-{spec['rate']}.json"
    spec_path.write_text(json.dumps(spec))
    procs, logs = [], []
    try:
        for rank, end in enumerate(link.ends):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                       MASTER_ADDR=link.ends[0].address, MASTER_PORT=str(PORT), GLOO_SOCKET_IFNAME=end.ifname,
                       OMP_NUM_THREADS="1", ZEROSPEED_ACCELERATOR="cpu",
                       # c10d warns that it cannot resolve the peer's name: the namespaces have no DNS, harmless
                       TORCH_CPP_LOG_LEVEL=os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"))
            log = open(workdir / f"rank{rank}-{spec['rate']}.log", "w")
            logs.append(log)
            argv = end.exec_prefix() + [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path),
                                        str(out_path)]
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=sys.stderr if rank == 0 else log,
                                          preexec_fn=_netns.die_with_parent))
        codes = _netns.wait_all(procs, timeout=spec["run_timeout"])
    finally:
        _netns.kill_all(procs)
        for log in logs:
            log.close()
    if any(codes) or not out_path.exists():
        tail = (workdir / f"rank1-{spec['rate']}.log").read_text()[-3000:]
        raise RuntimeError(f"ranks at {spec['rate']} Mbit/s exited with {codes}; rank 1's log ends:\n{tail}")
    return json.loads(out_path.read_text())


def report(rate: float, measured_mbit: float, spec: dict, res: dict) -> None:
    print(f"\n== link {rate:g} Mbit/s (tbf, both directions; measured TCP {measured_mbit:.0f} Mbit/s) ==")
    print(f"{'side':<17}{'warm-up s':>10}{'mean ms':>9}{'median':>8}{'vs Adam':>8}{'train loss':>11}"
          f"{'eval loss':>10}{'MB/step':>9}")
    adam = res.get("adam", {}).get("mean_step_s")
    for side in spec["sides"]:
        r = res[side]
        if r["status"] != "ok":
            what = "not available in this build" if r["status"] == "unavailable" else "FAILED"
            print(f"{LABELS[side]:<17}{what}: {r['reason']}")
            continue
        ratio = f"{adam / r['mean_step_s']:.2f}x" if adam else "-"
        payload = f"{r['payload_bytes'] / 1e6:.2f}" if r["payload_bytes"] is not None else "-"
        print(f"{LABELS[side]:<17}{r['warmup_s']:>10.1f}{r['mean_step_s'] * 1e3:>9.0f}"
              f"{r['median_step_s'] * 1e3:>8.0f}{ratio:>8}{r['train_loss']:>11.3f}{r['eval_loss']:>10.3f}{payload:>9}")
    ok = {s: r for s, r in res.items() if r["status"] == "ok"}
    if "onebit" in ok and "adam" in ok:
        speedup = ok["adam"]["mean_step_s"] / ok["onebit"]["mean_step_s"]
        print(f"1-bit Adam speed-up per steady step vs Adam: {speedup:.2f}x (target >= 3x on the slow link)")
        if "powersgd" in ok:
            p, o = ok["powersgd"], ok["onebit"]
            print(f"1-bit Adam vs PowerSGD: {p['mean_step_s'] / o['mean_step_s']:.2f}x faster per step, eval loss "
                  f"{o['eval_loss']:.3f} vs {p['eval_loss']:.3f}")
    elif "onebit" not in ok:
        print("1-bit Adam targets (>= 3x Adam on the slow link, faster than PowerSGD at equal loss): not measured")
    if "onebit" in ok and "powersgd" in ok:
        time_to_equal_loss(ok["onebit"], ok["powersgd"])


def smoothed(losses: list[float], window: int = 10) -> list[float]:
    """Each step's training loss averaged with the ``window - 1`` before it (the batches differ step to step)."""
    return [statistics.fmean(losses[max(0, i - window + 1): i + 1]) for i in range(len(losses))]


def time_to_equal_loss(onebit: dict, powersgd: dict) -> None:
    """Seconds (warm-up included) each side needs until its smoothed training loss first reaches the loss both
    reach: the higher of the two final smoothed losses."""
    curves = {"1-bit Adam": (smoothed(onebit["losses"]), onebit["step_s"]),
              "PowerSGD": (smoothed(powersgd["losses"]), powersgd["step_s"])}
    target = max(curve[-1] for curve, _ in curves.values())
    reached = {}
    for name, (curve, step_s) in curves.items():
        step = next(i for i, loss in enumerate(curve) if loss <= target)
        reached[name] = (step + 1, sum(step_s[: step + 1]))
    (o_steps, o_s), (p_steps, p_s) = reached["1-bit Adam"], reached["PowerSGD"]
    print(f"time to the smoothed training loss both reach ({target:.3f}): 1-bit Adam {o_s:.1f} s ({o_steps} steps), "
          f"PowerSGD {p_s:.1f} s ({p_steps} steps): 1-bit Adam {p_s / o_s:.2f}x faster at equal loss")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="1000,100", help="link rates in Mbit/s, comma-separated")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--warmup", type=int, default=10,
                        help="warm-up steps, reported as a total (OneBitAdam's freeze_step: uncompressed)")
    parser.add_argument("--steps", type=int, default=30, help="steady steps after the warm-up (mean reported)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    parser.add_argument("--active-tokens", type=int, default=16,
                        help="token ids the synthetic data uses (of --vocab): small, so the loss falls in a short run")
    parser.add_argument("--lr", type=float, default=1e-3)
    # GPT training's usual beta2 (GPT-3, Megatron). The 1-bit optimizers have no bias correction and freeze the
    # variance after the warm-up: with 0.999 and 10 warm-up steps it would freeze at 1% of its value.
    parser.add_argument("--beta2", type=float, default=0.95)
    parser.add_argument("--clip", type=float, default=1.0,
                        help="gradient clipping by global norm on every side (zerospeed's and DeepSpeed's default "
                             "1.0; 0: none). Unclipped, this model stalls near ln(active) within the run")
    parser.add_argument("--powersgd-rank", type=int, default=4, help="PowerSGD matrix_approximation_rank")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1M-param model, 3 + 5 steps (~1.5 min)")
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    spec = {"vocab": args.vocab, "width": args.width, "layers": args.layers, "seq": args.seq, "batch": args.batch,
            "lr": args.lr, "beta2": args.beta2, "clip": args.clip, "active": args.active_tokens, "warmup": args.warmup,
            "steps": args.steps, "powersgd_rank": args.powersgd_rank,
            "sides": [s for s in args.sides.split(",") if s], "timeout": 300}
    if args.quick:
        spec.update(vocab=2048, width=128, layers=4, seq=32, warmup=3, steps=5)
    unknown = set(spec["sides"]) - set(SIDES)
    if unknown:
        parser.error(f"--sides: unknown {sorted(unknown)}; choose from {', '.join(SIDES)}")
    # 0/1 Adam's schedule scaled to a short run: variance updates at doubling intervals, every 4th
    # interval doubling; local steps doubling every quarter of the steady steps, at most 4 apart
    spec.update(var_update_scaler=4, local_step_scaler=max(1, spec["steps"] // 4), local_step_clipper=4)
    rates = [float(r) for r in args.rates.split(",")]
    try:
        _netns.check_available()
    except _netns.NetnsUnavailable as exc:
        print(f"SKIPPED bench_comm_compression: {exc}")
        return
    with torch.device("meta"):
        numel = sum(p.numel() for p in build_model(spec).parameters())
    print(f"GPT vocab {spec['vocab']} width {spec['width']} layers {spec['layers']} seq {spec['seq']}: "
          f"{numel / 1e6:.2f} M params ({numel * 4 / 1e6:.1f} MB fp32 gradient); "
          f"{spec['batch']}x{spec['seq']} tokens/rank "
          f"(bigram data over {spec['active']} token ids); "
          f"2 gloo ranks x 1 thread in 2 network namespaces; torch {torch.__version__}")
    print(f"Adam lr {spec['lr']} betas (0.9, {spec['beta2']}), fp32, clipping {spec['clip']:g}; {spec['warmup']} warm-up "
          f"steps "
          f"(OneBitAdam freeze_step, ZeroOneAdam var_freeze_step, PowerSGD start_powerSGD_iter), then "
          f"{spec['steps']} timed steps; PowerSGD rank {spec['powersgd_rank']}; ZeroOneAdam var_update_scaler "
          f"{spec['var_update_scaler']}, local_step_scaler {spec['local_step_scaler']}, local_step_clipper "
          f"{spec['local_step_clipper']}")
    started = time.perf_counter()
    try:
        with _netns.signals_as_exceptions(), tempfile.TemporaryDirectory(prefix="zsnb-") as tmp, \
                _netns.veth_link() as link:
            print(f"namespaces {link.ends[0].netns} ({link.ends[0].address}) <-> {link.ends[1].netns} "
                  f"({link.ends[1].address}) over {link.ends[0].ifname}/{link.ends[1].ifname}")
            for rate in rates:
                _netns.set_rate(link, rate)
                measured = _netns.measure_throughput(link, int(rate * 1e6 / 8 * (0.5 if args.quick else 1.0)))
                if not 0.7 * rate <= measured / 1e6 <= 1.1 * rate:
                    print(f"WARNING: link set to {rate:g} Mbit/s measures {measured / 1e6:.0f} Mbit/s")
                rate_spec = dict(spec, rate=rate, run_timeout=1800)
                report(rate, measured / 1e6, spec, run_rate(link, rate_spec, Path(tmp)))
    except _netns.NetnsUnavailable as exc:
        print(f"SKIPPED bench_comm_compression: {exc}")
        return
    except (_netns.Interrupted, KeyboardInterrupt) as exc:
        sys.exit(f"bench_comm_compression interrupted ({exc or 'SIGINT'}); namespaces and ranks removed")
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
