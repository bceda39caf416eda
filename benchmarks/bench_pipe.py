"""Pipeline-parallel training throughput: zerospeed's PipelineEngine (every schedule) against DeepSpeed's
PipelineEngine and torch.distributed.pipelining, on the same model, ranks and micro-batches.

The model (``_pipe_bench.py``): the GPT-like pipeline of ``zerospeed.testing.pipe_models``, a token
embedding tied with the output head, ``--blocks`` pre-norm MLP blocks (4x expansion), a final norm and
a cross-entropy loss; the blocks split evenly over ``--stages`` stages (pp = world size, dp = 1), the
embedding on the first stage, the norm and the head on the last. One batch is ``--micro-batches``
micro-batches of ``--micro`` sequences of ``--seq`` tokens, then one optimizer step. Every side:
fp32, AdamW (same arguments), gradient clipping to global norm 1.0 (over all stages, the tied weight
counted once), no ZeRO, the same ``torch.set_num_threads`` (``--threads``, default 1) per rank, gloo.

Sides:
  zs-1f1b, zs-gpipe, zs-interleaved (chunks=2: each rank two model chunks, one block each at pp=4),
  zs-zb_h1     zerospeed PipelineEngine with ``pipeline.schedule`` 1f1b / gpipe / interleaved_1f1b / zb_h1
  torch-1f1b, torch-gpipe
               torch.distributed.pipelining PipelineStage + Schedule1F1B / ScheduleGPipe. It has no tied
               weights across stages, so the last stage holds its own copy of the embedding and the
               benchmark sums the two copies' gradients (one all-reduce over stages {0, last}, as
               DeepSpeed and zerospeed do) before clipping and the step; clipping is done by hand
               (one all-reduce of the squared norm over the pipeline).
  deepspeed    DeepSpeed 0.19.8 PipelineEngine (TrainSchedule = 1F1B), ZeRO stage 0, the same layers as a
               DeepSpeed PipelineModule with TiedLayerSpec; run by ``/tmp/dsvenv/bin/python`` in its own
               4 ranks (``--no-deepspeed`` skips it).

``--device-ms T`` simulates accelerators: every MLP block also keeps its stage's "device" busy T ms in
forward, T ms in the input gradient and T ms in the weight gradient, by sleeping (no host CPU used), so
each stage behaves as if it had a device of its own. On this 2-core machine 4 stages share the cores,
and an idle stage lends its core to a busy one: the pipeline bubble costs almost no wall time with real
compute, and the schedules that shrink it cannot show their gain. Simulated device time restores the
bubble's cost; real compute still runs (make it small, e.g. ``--hidden 32``).

The zerospeed and torch sides share one set of ranks and run in interleaved rounds (the order rotates
every round), so each round measures them under the same machine load; DeepSpeed runs in its own
process group, half its batches before them and half after (both medians printed), so its figure is
not paired with theirs round by round.
Each timed batch starts after a barrier; a batch's time is the slowest rank's. Prints samples/s per
side (median over the timed batches), the spread, and each zerospeed schedule's ratio against the
better of DeepSpeed 1F1B and torch pipelining (> 1: zerospeed is faster).

    python benchmarks/bench_pipe.py [--rounds 5] [--steps 4] [--hidden 256] [--quick] [--no-deepspeed]
        [--device-ms 0]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # so ranks can import this module by name

import torch
import torch.distributed as dist

from zerospeed.testing import run_distributed
from _pipe_bench import (ADAMW, BASE_SEED, CLIP, batch_iter, layer_specs, lm_loss, micro_batches, samples_per_batch,
                         stage_blocks, timed_batches, torch_stage_module)
from _report import percentile

ZS_SCHEDULES = {"zs-1f1b": ("1f1b", 1), "zs-gpipe": ("gpipe", 1), "zs-interleaved": ("interleaved_1f1b", 2),
                "zs-zb_h1": ("zb_h1", 1)}
TORCH_SCHEDULES = {"torch-1f1b": "Schedule1F1B", "torch-gpipe": "ScheduleGPipe"}
DS_VENV = Path("/tmp/dsvenv/bin/python")
PEERS = ("deepspeed", "torch-1f1b", "torch-gpipe")


# -- zerospeed ----------------------------------------------------------------------------------
class _ZeroSide:
    def __init__(self, spec: dict, schedule: str, chunks: int):
        import zerospeed
        from zerospeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

        module = PipelineModule(layer_specs(spec, LayerSpec, TiedLayerSpec), num_stages=dist.get_world_size(),
                                loss_fn=lm_loss, partition_method="type:MLPBlock", seed_layers=True,
                                base_seed=BASE_SEED, seed_fn=lambda seed: torch.manual_seed(int(seed)), chunks=chunks)
        module.seed_layers = False  # seeded at build only, as the other sides (_pipe_bench.SEEDING)
        config = {
            "train_micro_batch_size_per_gpu": spec["micro"], "gradient_accumulation_steps": spec["micro_batches"],
            "gradient_clipping": CLIP, "zero_optimization": {"stage": 0}, "steps_per_print": 10**9,
            "pipeline": {"schedule": schedule},
        }
        self.engine, _, _, _ = zerospeed.initialize(
            model=module, config=config,
            optimizer=lambda params: torch.optim.AdamW(params, **ADAMW))  # the same AdamW as the peers'
        self.batch = micro_batches(spec)

    def run_batch(self) -> float:
        return float(self.engine.train_batch(batch_iter(self.batch)))


# -- torch.distributed.pipelining ----------------------------------------------------------------
class _TorchSide:
    def __init__(self, spec: dict, schedule: str):
        from torch.distributed import pipelining

        rank, world = dist.get_rank(), dist.get_world_size()
        self.rank, self.world = rank, world
        self.model = torch_stage_module(spec, rank, world)
        stage = pipelining.PipelineStage(self.model, rank, world, torch.device("cpu"))
        self.schedule = getattr(pipelining, schedule)(stage, spec["micro_batches"], loss_fn=lm_loss)
        self.opt = torch.optim.AdamW(self.model.parameters(), **ADAMW)
        batch = micro_batches(spec)
        self.ids = torch.cat([ids for ids, _ in batch])  # the schedule splits the batch into the same micro-batches
        self.labels = torch.cat([labels for _, labels in batch])
        # the tied embedding: stage 0's Embedding and the last stage's Head copy, gradients summed
        self.tied_group = dist.new_group([0, world - 1])
        self.tied = self.model[0].weight if rank == 0 else self.model[-1].embed.weight if rank == world - 1 else None
        self.norm_params = [p for p in self.model.parameters() if rank != world - 1 or p is not self.tied]

    def run_batch(self) -> float:
        losses: list[torch.Tensor] = []
        if self.rank == 0:
            self.schedule.step(self.ids, return_outputs=False)
        elif self.rank == self.world - 1:
            self.schedule.step(target=self.labels, losses=losses, return_outputs=False)
        else:
            self.schedule.step(return_outputs=False)
        if self.tied is not None:
            dist.all_reduce(self.tied.grad, group=self.tied_group)
        sq = torch.zeros(1)
        for p in self.norm_params:
            if p.grad is not None:
                sq += p.grad.pow(2).sum()
        dist.all_reduce(sq)
        coef = CLIP / (float(sq.sqrt()) + 1e-6)
        if coef < 1:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(torch.stack(losses).detach().mean()) if losses else float("nan")


# -- one process group: the zerospeed and torch sides in interleaved rounds --------------------------
def _bench(spec: dict, sides: list[str]) -> dict:
    torch.set_num_threads(spec["threads"])
    quiet = logging.StreamHandler()  # zerospeed's warnings still show; its resolved-config dump does not
    quiet.setLevel(logging.WARNING)
    logging.getLogger("zerospeed").addHandler(quiet)
    built = {}
    for name in sides:
        built[name] = _ZeroSide(spec, *ZS_SCHEDULES[name]) if name in ZS_SCHEDULES \
            else _TorchSide(spec, TORCH_SCHEDULES[name])
        timed_batches(spec, built[name].run_batch, spec["warmup"])
    times: dict[str, list[float]] = {s: [] for s in sides}
    rounds: dict[str, list[int]] = {s: [] for s in sides}  # per timed batch: its round
    losses: dict[str, list[float]] = {s: [] for s in sides}
    for r in range(spec["rounds"]):
        shift = r % len(sides)
        for name in sides[shift:] + sides[:shift]:
            t, l = timed_batches(spec, built[name].run_batch, spec["steps"])
            times[name] += t
            rounds[name] += [r] * len(t)
            losses[name] += l
    return {"times": times, "rounds": rounds, "losses": losses, "threads": torch.get_num_threads()}


def _run_deepspeed(spec: dict) -> dict:
    """DeepSpeed's side in /tmp/dsvenv: its slowest-rank batch times (or an error)."""
    if not DS_VENV.exists():
        return {"error": f"{DS_VENV} not found (see the benchmark's docstring to build it)"}
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent), DS_ACCELERATOR="cpu",
               OMP_NUM_THREADS=str(spec["threads"]))
    ds_spec = dict(spec, world=spec["stages"], rounds=spec["ds_rounds"])
    try:
        proc = subprocess.run([str(DS_VENV), str(Path(__file__).resolve().parent / "_pipe_bench.py"), "deepspeed",
                               json.dumps(ds_spec)], capture_output=True, text=True, env=env, timeout=3600)
    except subprocess.TimeoutExpired:
        return {"error": "DeepSpeed side timed out"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return {"error": f"DeepSpeed side failed (exit {proc.returncode}): {proc.stderr.strip()[-1500:]}"}
    ranks = json.loads(lines[-1][len("RESULT "):])["ranks"]
    errors = [r for r in ranks if "error" in r]
    if errors:
        return {"error": errors[0]["error"], "trace": errors[0].get("trace")}
    return {"times": [max(ts) for ts in zip(*(r["times"] for r in ranks))], "losses": ranks[-1]["losses"],
            "threads": ranks[0]["threads"]}


# -- report --------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4, help="pipeline stages = ranks (dp=1)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=8, help="MLP blocks (a multiple of 2 x stages)")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches per batch (a multiple of stages)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="timed batches per side per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed batches per side before the first round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank, every side")
    parser.add_argument("--sides", default=",".join(list(ZS_SCHEDULES) + list(TORCH_SCHEDULES)),
                        help="comma-separated zerospeed / torch sides (default: all)")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed side")
    parser.add_argument("--device-ms", type=float, default=0.0,
                        help="simulated device ms per MLP block for each of forward, input and weight gradient")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 1 round of 2 batches")
    args = parser.parse_args()
    spec = {"stages": args.stages, "hidden": args.hidden, "blocks": args.blocks, "vocab": args.vocab, "seq": args.seq,
            "micro": args.micro, "micro_batches": args.micro_batches, "rounds": args.rounds, "steps": args.steps,
            "warmup": args.warmup, "threads": args.threads, "device_ms": args.device_ms}
    if args.quick:
        spec.update(hidden=32, vocab=64, seq=8, micro=2, rounds=1, steps=2, warmup=1)
    if spec["blocks"] % (2 * spec["stages"]) or spec["micro_batches"] % spec["stages"]:
        sys.exit("--blocks must be a multiple of 2 x stages and --micro-batches of stages (interleaved schedule)")
    spec["ds_rounds"] = spec["rounds"]
    sides = [s for s in args.sides.split(",") if s]
    unknown = set(sides) - set(ZS_SCHEDULES) - set(TORCH_SCHEDULES)
    if unknown:
        sys.exit(f"unknown sides {sorted(unknown)}; choose from {list(ZS_SCHEDULES) + list(TORCH_SCHEDULES)}")

    samples = samples_per_batch(spec)
    block_params = 8 * spec["hidden"] ** 2 + 7 * spec["hidden"]
    numel = spec["vocab"] * spec["hidden"] + spec["blocks"] * block_params + 2 * spec["hidden"]
    print(f"GPT-like pipeline: vocab {spec['vocab']}, hidden {spec['hidden']}, {spec['blocks']} MLP blocks "
          f"({numel / 1e6:.2f} M params, head tied to the embedding); {spec['stages']} stages (pp={spec['stages']}, "
          f"dp=1), {spec['blocks'] // spec['stages']} blocks per stage; batch = {spec['micro_batches']} micro-batches "
          f"x {spec['micro']} x seq {spec['seq']} = {samples} samples")
    print(f"fp32 AdamW, clip {CLIP}, no ZeRO; gloo, {spec['stages']} ranks x {spec['threads']} thread(s) on "
          f"{os.cpu_count()} cores; torch {torch.__version__}")
    if spec["device_ms"]:
        per_stage = spec["device_ms"] * spec["blocks"] // spec["stages"]
        print(f"simulated devices: {spec['device_ms']:g} ms per block for each of forward, input gradient and weight "
              f"gradient ({per_stage:g} ms each per stage and micro-batch, by sleeping)")

    results: dict[str, dict] = {}
    ds_runs = []
    if not args.no_deepspeed:  # half its rounds before the other sides, half after (brackets the load drift)
        ds_runs.append(_run_deepspeed(dict(spec, ds_rounds=max(1, spec["rounds"] // 2))))
    if sides:
        per_rank = run_distributed(_bench, spec["stages"], spec, sides, timeout=3600, threads_per_rank=spec["threads"])
        for name in sides:
            batch_times = [max(ts) for ts in zip(*(r["times"][name] for r in per_rank))]
            round_of = per_rank[0]["rounds"][name]
            per_round = [statistics.median(t for t, rr in zip(batch_times, round_of) if rr == r)
                         for r in sorted(set(round_of))]
            results[name] = {"times": batch_times, "round_medians": per_round,
                             "losses": per_rank[-1]["losses"][name], "threads": per_rank[0]["threads"]}
    if not args.no_deepspeed:
        if spec["rounds"] > 1 and "error" not in ds_runs[0]:
            ds_runs.append(_run_deepspeed(dict(spec, ds_rounds=spec["rounds"] - spec["rounds"] // 2)))
        failed = [run for run in ds_runs if "error" in run]
        results["deepspeed"] = failed[0] if failed else {
            "times": [t for run in ds_runs for t in run["times"]], "losses": ds_runs[0]["losses"],
            "runs": [statistics.median(run["times"]) for run in ds_runs]}
    print(f"{spec['warmup']} warm-up batches per side, then {spec['rounds']} rounds x {spec['steps']} timed batches; "
          "a batch's time is the slowest rank's")
    print(f"{'side':<16}{'samples/s':>10}{'batch ms':>10}{'p10':>9}{'p90':>9}{'round medians ms':>22}   first loss")
    throughput = {}
    for name in (["deepspeed"] if "deepspeed" in results else []) + sides:
        res = results[name]
        if "error" in res:
            print(f"{name:<16} failed: {res['error']}")
            if res.get("trace"):
                print(res["trace"])
            continue
        ms = [t * 1e3 for t in res["times"]]
        med = statistics.median(ms)
        throughput[name] = samples / (med / 1e3)
        rm = res.get("round_medians")
        rounds_text = f"{min(rm) * 1e3:.0f} - {max(rm) * 1e3:.0f}" if rm else \
            "before " + " / after ".join(f"{t * 1e3:.0f}" for t in res["runs"])
        print(f"{name:<16}{throughput[name]:>10.1f}{med:>10.1f}{percentile(ms, 0.1):>9.1f}{percentile(ms, 0.9):>9.1f}"
              f"{rounds_text:>22}   {res['losses'][0]:.4f}")
    peers = {name: throughput[name] for name in PEERS if name in throughput}
    if peers:
        _print_ratios(results, throughput, peers)
    if len(throughput) < len(results):
        sys.exit(1)  # a side failed (printed above)


def _print_ratios(results: dict[str, dict], throughput: dict[str, float], peers: dict[str, float]) -> None:
    best = max(peers, key=peers.get)
    print(f"best peer: {best} ({peers[best]:.1f} samples/s). Throughput ratios zerospeed / peer (> 1: zerospeed "
          "faster), from the pooled medians; [in brackets: the median and range of the per-round ratios, for the "
          "torch peers, which ran in the same rounds]")
    for name in ZS_SCHEDULES:
        if name not in throughput:
            continue
        parts = []
        for peer in sorted(peers, key=lambda p: p != best):
            text = f"{peer} {throughput[name] / peers[peer]:.3f}"
            if "round_medians" in results[peer]:
                per_round = [p / z for z, p in zip(results[name]["round_medians"], results[peer]["round_medians"])]
                text += f" [{statistics.median(per_round):.3f}, {min(per_round):.3f} - {max(per_round):.3f}]"
            parts.append(text)
        print(f"ratio {name}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
