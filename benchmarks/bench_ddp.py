"""Training step time: zerospeed ZeRO stage 0 against torch DistributedDataParallel, same run.

One model (a residual MLP of a few M parameters, or a small transformer encoder) is built twice
from the same seed inside the same gloo ranks: once wrapped by DDP, once by ``zerospeed.initialize``.
Both train on the same per-rank batch with the same work per step: fp32, AdamW (same arguments,
passed by the user on both sides), clipping by global norm on both sides (or on neither with
``--clip 0``), the same gradient bucket size (DDP ``bucket_cap_mb`` = zerospeed
``zero_optimization.reduce_bucket_size`` in fp32 elements) and the same ``torch.set_num_threads``.
Rounds alternate DDP / zerospeed (the first side swaps every round, so neither always follows
the other), each round ``--steps`` timed steps after warm-up. Prints per-side median step time,
the ratio zerospeed / DDP (the median of per-round ratios: a round pairs both sides under the
same machine load, which on a shared machine drifts more than the difference measured), the
spread of the per-step times, a per-phase breakdown (forward, backward, step, and inside the step
the optimizer, the reduce wait and the bucket zeroing: where the time goes), peak RSS per rank,
and a check that both sides ended with the same parameters (same data and steps, so they must).

    python benchmarks/bench_ddp.py [--rounds 8] [--steps 10] [--bucket-mb 4] [--model mlp] [--quick]
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # so ranks can import this module by name

import torch
import torch.distributed as dist
from torch import nn

import zerospeed
from zerospeed.testing import run_distributed
from _report import phase_medians, print_ratio, print_step_table

SIDES = ("ddp", "zerospeed")
PHASES = ("forward", "backward", "step")


# -- models ----------------------------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class ResidualMLP(nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.Sequential(*[_Block(width) for _ in range(depth)])
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


class SmallTransformer(nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        layer = nn.TransformerEncoderLayer(width, nhead=max(1, width // 64), dim_feedforward=4 * width,
                                           dropout=0.0, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _build(spec: dict) -> nn.Module:
    torch.manual_seed(1234)
    if spec["model"] == "transformer":
        return SmallTransformer(spec["width"], spec["depth"])
    return ResidualMLP(spec["width"], spec["depth"])


def _batch(spec: dict, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    shape = (spec["batch"], spec["seq"], spec["width"]) if spec["model"] == "transformer" \
        else (spec["batch"], spec["width"])
    return torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)


def _timed(fn, into: list[float]):
    """``fn`` wrapped to append its wall time to ``into`` (the step phase broken down, no engine edits)."""
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - start)
    return wrapper


# -- one training step per side, timed by phase ------------------------------------------------
class _DDPSide:
    def __init__(self, spec: dict):
        self.model = nn.parallel.DistributedDataParallel(_build(spec), bucket_cap_mb=spec["bucket_mb"])
        self.opt = _adamw(self.model.parameters())
        self.clip = spec["clip"]
        self.parts: dict[str, list[float]] = {"optimizer.step": []}
        self.opt.step = _timed(self.opt.step, self.parts["optimizer.step"])

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        loss = nn.functional.mse_loss(self.model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if self.clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2

    def params(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.model.module.parameters()]


class _ZeroSide:
    def __init__(self, spec: dict):
        elems = int(spec["bucket_mb"] * 2**20) // 4  # DDP's bucket_cap_mb, in fp32 elements
        config = {
            "train_micro_batch_size_per_gpu": spec["batch"], "gradient_accumulation_steps": 1,
            "gradient_clipping": spec["clip"], "steps_per_print": 10**9,
            "zero_optimization": {"stage": 0, "reduce_bucket_size": elems},
        }
        self.parts = {"optimizer.step": [], "buckets.finish (wait reduce)": [], "buckets.zero": []}

        def make_optimizer(params):  # the same AdamW as DDP's, its step timed
            opt = _adamw(params)
            opt.step = _timed(opt.step, self.parts["optimizer.step"])
            return opt

        self.engine, _, _, _ = zerospeed.initialize(model=_build(spec), config=config, optimizer=make_optimizer)
        buckets = self.engine.buckets
        buckets.finish = _timed(buckets.finish, self.parts["buckets.finish (wait reduce)"])
        buckets.zero = _timed(buckets.zero, self.parts["buckets.zero"])

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        loss = nn.functional.mse_loss(self.engine(x), y)
        t1 = time.perf_counter()
        self.engine.backward(loss)
        t2 = time.perf_counter()
        self.engine.step()
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2

    def params(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.engine.module.parameters()]


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _bench(spec: dict) -> dict:
    torch.set_num_threads(spec["threads"])  # the same for both sides (they share the process)
    quiet = logging.StreamHandler()  # zerospeed's warnings still show; its resolved-config dump does not
    quiet.setLevel(logging.WARNING)
    logging.getLogger("zerospeed").addHandler(quiet)
    rank = dist.get_rank()
    x, y = _batch(spec, rank)
    rss = {"start": _rss_mib()}
    sides = {}
    for name, cls in (("ddp", _DDPSide), ("zerospeed", _ZeroSide)):
        sides[name] = cls(spec)
        for _ in range(spec["warmup"]):
            sides[name].step(x, y)
        rss[name] = _rss_mib()  # after build + warm-up (optimizer state and buckets allocated)
        for part in sides[name].parts.values():
            part.clear()
    times: dict[str, list[tuple[float, float, float]]] = {s: [] for s in SIDES}
    rounds: dict[str, list[float]] = {s: [] for s in SIDES}
    for r in range(spec["rounds"]):
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        for name in order:
            dist.barrier()
            per_step = []
            for _ in range(spec["steps"]):
                start = time.perf_counter()
                phases = sides[name].step(x, y)
                per_step.append(time.perf_counter() - start)
                times[name].append(phases)
            rounds[name].append(statistics.median(per_step))
    diff = max(float((a - b).abs().max()) for a, b in zip(sides["ddp"].params(), sides["zerospeed"].params()))
    numel = sum(p.numel() for p in sides["ddp"].params())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    parts = {name: {k: statistics.median(v) for k, v in side.parts.items() if v} for name, side in sides.items()}
    return {"times": times, "rounds": rounds, "parts": parts, "diff": diff, "numel": numel, "rss": rss, "peak_rss": peak,
            "threads": torch.get_num_threads()}


# -- report --------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    parser.add_argument("--width", type=int, default=None, help="default: 512 (mlp) / 256 (transformer)")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=None, help="per rank; default 64 (mlp) / 4 (transformer)")
    parser.add_argument("--seq", type=int, default=128, help="transformer sequence length")
    parser.add_argument("--bucket-mb", type=float, default=4.0,
                        help="DDP bucket_cap_mb; zerospeed gets the same size as reduce_bucket_size elements")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient clipping on both sides (0: neither)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per side before the first round")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank (default cores/ranks)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 2 rounds of 3 steps")
    args = parser.parse_args()
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.world_size)
    spec = {
        "model": args.model, "depth": args.depth, "seq": args.seq, "bucket_mb": args.bucket_mb,
        "clip": args.clip, "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
        "threads": threads,
        "width": args.width or (512 if args.model == "mlp" else 256),
        "batch": args.batch or (64 if args.model == "mlp" else 4),
    }
    if args.quick:
        spec.update(width=128, depth=2, batch=8, seq=16, rounds=2, steps=3, warmup=1, bucket_mb=0.05)
    results = run_distributed(_bench, args.world_size, spec, timeout=3600, threads_per_rank=threads)
    res = results[0]
    elems = int(spec["bucket_mb"] * 2**20) // 4
    print(f"{spec['model']} width {spec['width']} depth {spec['depth']}: {res['numel'] / 1e6:.2f} M params, "
          f"batch {spec['batch']}/rank{', seq ' + str(spec['seq']) if spec['model'] == 'transformer' else ''}; "
          f"gloo, {args.world_size} ranks x {res['threads']} thread(s), torch {torch.__version__}; fp32 AdamW, "
          f"clip {spec['clip']}; bucket {spec['bucket_mb']} MB = {elems} elements")
    print(f"{spec['rounds']} interleaved rounds x {spec['steps']} steps per side (after {spec['warmup']} "
          f"warm-up steps); times from rank 0, ms")
    med = print_step_table(res["times"], res["rounds"], SIDES)
    print_ratio("zerospeed / DDP", res["rounds"]["zerospeed"], res["rounds"]["ddp"], med["zerospeed"], med["ddp"])
    print("phase medians, ms (forward | backward incl. overlapped all-reduce | clip + optimizer step + zero grads):")
    for side in SIDES:
        cols = phase_medians(res["times"][side])
        print(f"  {side:<11}" + "".join(f"{p} {c:7.1f}   " for p, c in zip(PHASES, cols)))
        inside = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in res["parts"][side].items())
        print(f"  {'':<11}inside step: {inside}; other {cols[2] - sum(res['parts'][side].values()) * 1e3:.1f}")
    for r, rank_res in enumerate(results):
        rss = rank_res["rss"]
        print(f"rank {r}: peak RSS {rank_res['peak_rss']:.0f} MiB (both sides in one process); RSS after "
              f"start {rss['start']:.0f}, +DDP {rss['ddp'] - rss['start']:.0f}, "
              f"+zerospeed {rss['zerospeed'] - rss['ddp']:.0f} MiB")
    print(f"max |param difference| DDP vs zerospeed after the same steps: {res['diff']:.2e}")


if __name__ == "__main__":
    main()
