"""Progressive layer drop: the example GPT trained with and without ``progressive_layer_drop``.

Both sides are the same GPT (``examples/gpt.py``, same seed), the same byte-level text (the demo's stdlib
docstring corpus, nothing downloaded), the same batches in the same order, AdamW with a linear warmup then a
constant learning rate (so "steps to reach a loss" does not depend on where a decay ends), clipping 1.0,
fp32, 1 torch thread per rank, on ``--world`` gloo ranks. The only difference is the config section
``"progressive_layer_drop": {"enabled": true, "theta": ..., "gamma": ...}`` on the PLD side, with which
the engine passes ``pld_theta`` to the GPT, which skips block ``l`` with probability ``1 - p_l``.

The two engines live in the same rank processes and train in interleaved segments of ``--eval_every``
steps (alternating which side goes first), so machine load falls on both alike; each segment's time is the
slowest rank's, training only. After each segment a side's held-out loss (the corpus tail, never trained
on; ``--val_windows`` windows, averaged over ranks) is measured, and smoothed as the mean of the last
``--smooth`` measurements (a constant learning rate leaves the loss wobbling by a few hundredths from one
segment to the next). The baseline runs ``--steps`` steps; its final smoothed held-out loss is the target.
The PLD side runs until its smoothed held-out loss reaches the target or ``--max_ratio`` times the
baseline's steps.

Prints: tokens/s of both sides over the common steps (median of the per-segment ratios, as the other
benchmarks), the held-out loss of both at the baseline's last step, and the steps and training seconds
the PLD run took to reach the baseline's final smoothed held-out loss (checked at segment ends), with the
ratios. The PLD side's segments after the baseline has stopped run alone (not interleaved).

    python benchmarks/bench_pld.py [--quick] [--world 1] [--steps 300] [--layers 8] [--width 128] [--seq 64]
        [--batch 8] [--theta 0.5] [--gamma <default 4/steps>] [--eval_every 25] [--smooth 3] [--max_ratio 2.0]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))

import torch  # noqa: E402

SEED = 1234


def _config(spec: dict[str, Any], pld: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": spec["batch"], "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": spec["lr"], "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": spec["lr"],
                                                      "warmup_num_steps": spec["warmup"], "warmup_type": "linear"}},
        "gradient_clipping": 1.0, "zero_optimization": {"stage": 0}, "steps_per_print": 10**9,
    }
    if pld:
        config["progressive_layer_drop"] = {"enabled": True, "theta": spec["theta"], "gamma": spec["gamma"]}
    return config


class Side:
    """One engine, its batch order and its history of (steps, training seconds, held-out loss)."""

    def __init__(self, name: str, spec: dict[str, Any], train: Any, rank: int, world: int) -> None:
        import zerospeed
        from gpt import GPT, GPTConfig

        torch.manual_seed(SEED)
        self.model = GPT(GPTConfig(vocab_size=256, seq_len=spec["seq"], d_model=spec["width"],
                                   n_layers=spec["layers"], n_heads=max(1, spec["width"] // 32)))
        self.engine, *_ = zerospeed.initialize(model=self.model, config=_config(spec, name == "pld"))
        self.name, self.train, self.batch, self.world = name, train, spec["batch"], world
        self.order = torch.Generator().manual_seed(SEED + rank)  # the same batches on both sides
        self.steps, self.seconds, self.tokens = 0, 0.0, 0
        self.history: list[tuple[int, float, float, float]] = []  # steps, seconds, held-out, smoothed
        self.segment_seconds: list[float] = []
        self.thetas: list[float] = []

    def run(self, steps: int) -> None:
        """``steps`` optimizer steps, timed (the slowest rank's time)."""
        start = time.perf_counter()
        for _ in range(steps):
            rows = torch.randint(0, len(self.train), (self.batch,), generator=self.order).tolist()
            x, y = (torch.stack(t) for t in zip(*(self.train[i] for i in rows)))
            theta = self.engine.get_pld_theta()
            if theta is not None:
                self.thetas.append(theta)
            loss = self.engine(x, y)
            self.engine.backward(loss)
            self.engine.step()
            self.tokens += x.numel() * self.world
        elapsed = torch.tensor([time.perf_counter() - start])
        self.engine.comm.all_reduce(elapsed, op="max")
        self.seconds += float(elapsed)
        self.segment_seconds.append(float(elapsed))
        self.steps += steps

    @torch.no_grad()
    def evaluate(self, val: Any, windows: int, smooth: int) -> float:
        comm = self.engine.comm
        self.engine.eval()
        total = torch.zeros(2)
        mine = list(range(comm.rank, min(windows, len(val)), comm.world_size))
        for start in range(0, len(mine), 16):
            x, y = (torch.stack(t) for t in zip(*(val[i] for i in mine[start:start + 16])))
            total += torch.tensor([float(self.engine(x, y)) * len(x), float(len(x))])
        comm.all_reduce(total, op="sum")
        self.engine.train()
        loss = float(total[0] / total[1])
        recent = [h[2] for h in self.history[1:]][-(smooth - 1):] if smooth > 1 else []  # not the untrained start
        smoothed = statistics.fmean([*recent, loss]) if self.steps else loss
        self.history.append((self.steps, self.seconds, loss, smoothed))
        return smoothed


def run_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """Both sides on this rank, interleaved; returns what rank 0 prints."""
    import logging

    import torch.distributed as dist
    from corpus import TokenWindows, split
    from demo import cached_corpus

    logging.getLogger("zerospeed").addHandler(logging.NullHandler())  # no config dump (as the demo)
    logging.getLogger("zerospeed").setLevel(logging.WARNING)
    rank, world = dist.get_rank(), dist.get_world_size()
    train_tokens, val_tokens = split(cached_corpus(spec["corpus_bytes"]))
    train, val = TokenWindows(train_tokens, spec["seq"]), TokenWindows(val_tokens, spec["seq"])
    base, pld = Side("baseline", spec, train, rank, world), Side("pld", spec, train, rank, world)
    every, steps = spec["eval_every"], spec["steps"]
    for side in (base, pld):
        side.evaluate(val, spec["val_windows"], spec["smooth"])
    rounds = 0
    while base.steps < steps:  # interleaved segments over the common steps
        n = min(every, steps - base.steps)
        for side in ((base, pld) if rounds % 2 == 0 else (pld, base)):
            side.run(n)
            side.evaluate(val, spec["val_windows"], spec["smooth"])
        rounds += 1
    target = base.history[-1][3]
    limit = int(spec["max_ratio"] * steps)
    while pld.history[-1][3] > target and pld.steps < limit:  # the PLD side alone, until it reaches the target
        pld.run(min(every, limit - pld.steps))
        pld.evaluate(val, spec["val_windows"], spec["smooth"])
    reached = next(((s, t, v) for s, t, _, v in pld.history if v <= target and s > 0), None)
    common = len(base.segment_seconds)
    return {"base": base.history, "pld": pld.history, "target": target, "reached": reached,
            "base_tokens_per_s": base.tokens / base.seconds,
            "pld_tokens_per_s": base.tokens / sum(pld.segment_seconds[:common]),  # same tokens per step
            "segment_ratios": [b / p for b, p in zip(base.segment_seconds, pld.segment_seconds[:common],
                                                     strict=True)],
            "mean_theta": statistics.fmean(pld.thetas[:steps]) if pld.thetas else float("nan"),
            "params": base.model.num_params()}


def expected_kept(theta: float, layers: int) -> float:
    """Share of blocks run at keep ratio ``theta``: the mean of p_l = 1 - (l / L)(1 - theta)."""
    return statistics.fmean(1 - (l + 1) / layers * (1 - theta) for l in range(layers))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small run under a minute (fewer steps and layers)")
    parser.add_argument("--world", type=int, default=1, help="gloo ranks (data parallel)")
    parser.add_argument("--steps", type=int, default=300, help="baseline optimizer steps")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="micro-batch per rank (sequences)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=20, help="linear warmup steps, then constant")
    parser.add_argument("--theta", type=float, default=0.5, help="theta-bar, the keep ratio theta(t) tends to")
    parser.add_argument("--gamma", type=float, default=None, help="theta(t)'s decay rate (default 4 / steps)")
    parser.add_argument("--eval_every", type=int, default=25, help="steps per segment (held-out loss after each)")
    parser.add_argument("--val_windows", type=int, default=96)
    parser.add_argument("--smooth", type=int, default=3, help="held-out losses averaged for the target and its check")
    parser.add_argument("--max_ratio", type=float, default=2.0, help="the PLD side stops at this many x steps")
    parser.add_argument("--corpus_bytes", type=int, default=2_000_000)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.layers, args.width, args.eval_every, args.val_windows, args.smooth = 80, 6, 96, 20, 48, 2
    spec = dict(vars(args), gamma=args.gamma if args.gamma is not None else 4.0 / args.steps)
    from zerospeed.testing import run_distributed

    started = time.perf_counter()
    out = run_distributed(run_rank, args.world, spec, timeout=3600, threads_per_rank=1)[0]
    layers = args.layers
    print(f"GPT {out['params'] / 1e6:.2f}M params ({layers} layers, d_model {args.width}), seq {args.seq}, "
          f"{args.world} rank(s) x micro-batch {args.batch}, fp32, 1 thread/rank; theta-bar {args.theta}, "
          f"gamma {spec['gamma']:.4g} (theta({args.steps}) = "
          f"{(1 - args.theta) * math.exp(-spec['gamma'] * args.steps) + args.theta:.3f}); "
          f"mean theta over the run {out['mean_theta']:.3f}, blocks run at that theta "
          f"{expected_kept(out['mean_theta'], layers):.0%}")
    print(f"{'side':<10}{'steps':>7}{'train s':>9}{'tokens/s':>10}{'held-out loss':>15}   (start -> end of common "
          f"steps, smoothed over {args.smooth})")
    base, pld = out["base"], out["pld"]
    common = next(h for h in pld if h[0] == base[-1][0])
    print(f"{'baseline':<10}{base[-1][0]:>7}{base[-1][1]:>9.1f}{out['base_tokens_per_s']:>10.0f}"
          f"{base[0][2]:>8.3f} -> {base[-1][2]:.3f} ({base[-1][3]:.3f})")
    print(f"{'pld':<10}{common[0]:>7}{common[1]:>9.1f}{out['pld_tokens_per_s']:>10.0f}"
          f"{pld[0][2]:>8.3f} -> {common[2]:.3f} ({common[3]:.3f})")
    ratios = out["segment_ratios"]
    print(f"ratio tokens/s pld/baseline: {statistics.median(ratios):.3f} (median of the {len(ratios)} per-segment "
          f"ratios, range {min(ratios):.3f} - {max(ratios):.3f}); "
          f"{out['pld_tokens_per_s'] / out['base_tokens_per_s']:.3f} from the totals")
    reached = out["reached"]
    if reached is None:
        print(f"PLD did not reach the baseline's final smoothed held-out loss {out['target']:.3f} within "
              f"{pld[-1][0]} steps ({pld[-1][1]:.1f} s; its smoothed loss then {pld[-1][3]:.3f})")
    else:
        steps, seconds, loss = reached
        print(f"PLD reached the baseline's final smoothed held-out loss {out['target']:.3f} ({loss:.3f} at a segment end) "
              f"at step {steps} after {seconds:.1f} s of training; the baseline took {base[-1][0]} steps, "
              f"{base[-1][1]:.1f} s")
        print(f"ratio steps to target pld/baseline: {steps / base[-1][0]:.3f}; wall-clock to target pld/baseline: "
              f"{seconds / base[-1][1]:.3f} (speedup {base[-1][1] / seconds:.2f}x)")
    print("held-out loss per segment (steps: baseline / pld): " + ", ".join(
        f"{s}: {b:.3f}/{p:.3f}" for (s, _, b, _), (_, _, p, _) in zip(base, pld)) + (
        ", then pld: " + ", ".join(f"{s}: {p:.3f}" for s, _, p, _ in pld[len(base):]) if len(pld) > len(base) else ""))
    print(f"({time.perf_counter() - started:.0f} s in all)")


if __name__ == "__main__":
    main()
