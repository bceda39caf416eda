"""Quality and traffic of the communication-compressed optimizers (issue 21) on the example GPT.

Every side trains the same GPT (examples/gpt.py, seeded) on the same byte windows of the stdlib
docstring corpus (examples/corpus.py) for ``--steps`` optimizer steps on ``--world`` gloo ranks, with
the same WarmupLR schedule, and reports the held-out loss at the end (fixed validation windows, every
rank evaluates the same ones), the mean training loss over the last 20 steps, and the bytes each rank
sent per step (``comm.stats.sent``) before and after the compressed phase starts.

Sides: Adam (DeepSpeed's ``Adam`` type, AdamW with bias correction), OneBitAdam (freeze_step =
``--freeze``), ZeroOneAdam (var_freeze_step = ``--freeze``), Lamb and OneBitLamb (freeze_step =
``--freeze``). Target (issue 21): the 1-bit sides' final loss within 3% of Adam's (of Lamb's for
1-bit LAMB), and their bytes per step after the freeze <= 1/20 of Adam's.

With ``--stage 1`` or ``2`` every side runs at that ZeRO stage: the 1-bit sides warm up on ZeRO's shards
and hand their state over to a replicated one when they start compressing (zerospeed.zero.handover);
the report adds each side's model-state bytes per rank (``memory_breakdown()["total"]``) in the
middle of the warm-up and at the end.

    python benchmarks/bench_onebit.py [--world 2] [--steps 300] [--freeze 60] [--stage 0] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import torch

from zerospeed.testing import run_distributed

MICRO, SEQ, EVAL_WINDOWS = 8, 64, 64


def side_configs(freeze: int, lr: float, beta2: float) -> dict[str, dict[str, Any]]:
    adam = {"lr": lr, "betas": [0.9, beta2], "weight_decay": 0.0}
    return {
        "Adam": {"type": "Adam", "params": adam},
        "OneBitAdam": {"type": "OneBitAdam", "params": {**adam, "freeze_step": freeze}},
        # the variance updated every step until the freeze (var_update_scaler > freeze), then local steps:
        # the ranks meet every 1, 2, then 4 steps (the interval doubles every 32 steps up to the clipper)
        "ZeroOneAdam": {"type": "ZeroOneAdam", "params": {**adam, "var_freeze_step": freeze,
                                                          "var_update_scaler": freeze + 4, "local_step_scaler": 32,
                                                          "local_step_clipper": 4}},
        "Lamb": {"type": "Lamb", "params": adam},
        "OneBitLamb": {"type": "OneBitLamb", "params": {**adam, "freeze_step": freeze}},
    }


def _windows(data: torch.Tensor, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.stack([data[(start + i) * SEQ: (start + i) * SEQ + SEQ + 1] for i in range(count)])
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def _rank(name: str, optimizer: dict[str, Any], steps: int, warmup: int, lr: float, stage: int = 0) -> dict[str, Any]:
    import logging

    import zerospeed
    from corpus import build_corpus, split
    from gpt import GPT, GPTConfig

    quiet = logging.StreamHandler()  # warnings still show; the resolved-config dump (INFO) does not
    quiet.setLevel(logging.WARNING)
    logging.getLogger("zerospeed").addHandler(quiet)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=SEQ, d_model=128, n_layers=4, n_heads=4))
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
              "steps_per_print": 10**9, "optimizer": optimizer, "zero_optimization": {"stage": stage},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                                           "warmup_num_steps": warmup}}}
    try:
        engine, opt, _, _ = zerospeed.initialize(model=model, config=config)
    except NotImplementedError as err:
        return {"skipped": str(err)}
    train, val = split(build_corpus(1_500_000))
    rank, world = engine.comm.rank, engine.comm.world_size
    per_step = MICRO * world
    losses, sent, times = [], [], []
    state_bytes = {}
    for step in range(steps):
        first = (step * per_step + rank * MICRO) % ((len(train) - 1) // SEQ - MICRO)
        x, y = _windows(train, first, MICRO)
        before = sum(engine.comm.stats.sent.values())
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        sent.append(sum(engine.comm.stats.sent.values()) - before)
        losses.append(float(loss.detach()))
        if step == warmup // 2:
            state_bytes["warm-up"] = engine.memory_breakdown()["total"]
    state_bytes["end"] = engine.memory_breakdown()["total"]
    engine.module.eval()
    with torch.no_grad():
        x, y = _windows(val, 0, EVAL_WINDOWS)
        held_out = float(engine.module(x, y))
    return {"losses": losses, "sent": sent, "times": times, "held_out": held_out, "state_bytes": state_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--freeze", type=int, default=60)
    parser.add_argument("--lr", type=float, default=2e-3)
    # GPT training's usual beta2 (GPT-3, Megatron). The 1-bit optimizers have no bias correction and freeze
    # the variance at --freeze: with 0.999 a 60-step warm-up freezes it at 1 - 0.999^60 = 6% of its value.
    parser.add_argument("--beta2", type=float, default=0.95)
    parser.add_argument("--sides", default="Adam,OneBitAdam,ZeroOneAdam,Lamb,OneBitLamb")
    parser.add_argument("--stage", type=int, default=0, choices=(0, 1, 2), help="ZeRO stage of every side")
    parser.add_argument("--quick", action="store_true", help="60 steps, freeze 12 (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.freeze = 60, 12
    warmup = max(args.freeze // 2, 1)
    configs = side_configs(args.freeze, args.lr, args.beta2)
    print(f"example GPT (d 128, 4 layers, seq {SEQ}), {args.world} gloo ranks x micro {MICRO}, {args.steps} steps, "
          f"freeze {args.freeze}, WarmupLR {warmup} steps to lr {args.lr}, betas (0.9, {args.beta2}), ZeRO stage {args.stage}")
    results: dict[str, dict[str, Any]] = {}
    for name in args.sides.split(","):
        out = run_distributed(_rank, args.world, name, configs[name], args.steps, warmup, args.lr, args.stage,
                              timeout=3600)[0]
        if "skipped" in out:
            print(f"{name:12s} skipped: {out['skipped'][:100]}")
            continue
        results[name] = out
        early = statistics.mean(out["sent"][1: args.freeze])
        late = statistics.mean(out["sent"][args.freeze + 2:])
        tail = statistics.mean(out["losses"][-20:])
        print(f"{name:12s} held-out {out['held_out']:.4f}  train(last 20) {tail:.4f}  sent/step warm-up "
              f"{early / 1e3:9.1f} kB  after {late / 1e3:9.2f} kB  step {statistics.median(out['times']) * 1e3:6.1f} ms  "
              f"state/rank warm-up {out['state_bytes']['warm-up'] / 2**20:5.2f} MiB  end "
              f"{out['state_bytes']['end'] / 2**20:5.2f} MiB")
    for side, base in (("OneBitAdam", "Adam"), ("ZeroOneAdam", "Adam"), ("OneBitLamb", "Lamb")):
        if side in results and base in results:
            a, b = results[side], results[base]
            gap = a["held_out"] / b["held_out"] - 1
            traffic = statistics.mean(a["sent"][args.freeze + 2:]) / statistics.mean(b["sent"][args.freeze + 2:])
            print(f"{side} vs {base}: held-out loss {gap * 100:+.2f}% (target within 3%), bytes/step after freeze "
                  f"{traffic:.4f}x (1/{1 / traffic:.0f}; target <= 1/20)")


if __name__ == "__main__":
    main()
