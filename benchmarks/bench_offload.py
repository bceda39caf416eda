"""ZeRO-Offload step time: where a training step's time goes, and how much optimizer time hides under backward.

One GPT-style model (``_gpt_bench.py``: pre-LN blocks, tied embedding / LM head) trains in bf16 on 2
gloo ranks with 1 torch thread per rank, the same seed and the same token batch per rank, AdamW, no
gradient clipping, for each of these configurations (each in a fresh set of rank processes):

  zero2 / zero3                 ZeRO stage 2 / 3, optimizer on the compute device (no offload)
  zero2+offload / zero3+offload offload_optimizer cpu (+ offload_param cpu at stage 3), bf16's overflow
                                check on (DeepSpeed's default): it must see every gradient first, so the
                                CPU step runs after backward
  zero2+overlap / zero3+overlap the same with the overflow check off: sub-groups of sub_group_size
                                elements step on a worker thread as soon as their gradients are final,
                                while backward goes on

The +offload and +overlap runs differ only in that check (one ``isfinite`` on a norm computed
anyway), so their difference is the overlap. For each step the slowest rank's times are taken and
the median over steps printed: forward, backward, step (the ``engine.step()`` call), the optimizer
update run during ``step()``, the update run early on the worker (wall time) and the part of it that
ran before backward ended, how long ``step()`` waited for the early updates, the copies (casting the
updated shards to bf16 and all-gathering them), and the whole step. "hidden" is the early update
that ran before backward ended, as a share of all update time; "saved" is what the whole step gained
over the same run without overlap, and "backward +" how much longer backward took meanwhile.

The compute device here is the CPU, so offload moves no bytes over a bus; what it changes is which
optimizer runs (CPUAdam writing the bf16 copy in the same pass) and when it runs. With 2 cores shared
by 2 ranks an early step competes with backward for the same cores, so hidden time is partly paid by
a slower backward: "saved" is the honest figure.

    python benchmarks/bench_offload.py [--quick] [--configs zero2,zero2+overlap] [--steps 8 --warmup 2]
        [--layers 8 --width 1024 --vocab 16384 --seq 16 --batch 1] [--sub-group 8000000]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # ranks import _gpt_bench by name

import torch  # noqa: E402

import _gpt_bench as gb  # noqa: E402

WORLD = 2
CONFIGS = ("zero2", "zero2+offload", "zero2+overlap", "zero2+nvme", "zero3", "zero3+offload", "zero3+overlap",
           "zero3+nvme")
PHASES = ("forward", "backward", "step", "update", "early_update", "early_under_backward", "early_wait",
          "publish", "total")


def _config(name: str, spec: dict, sub_group: int, nvme_dir: str) -> dict:
    stage = int(name[4])
    zero: dict = {"stage": stage, "sub_group_size": sub_group}
    if "+" in name:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if name.endswith("+nvme"):  # ZeRO-Infinity: optimizer state (and at stage 3 the parameters) on NVMe
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir, "pipeline_read": True,
                                     "pipeline_write": True, "buffer_count": 4}
        if stage == 3:
            zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir, "max_in_cpu": 0}
    return {"train_micro_batch_size_per_gpu": spec["batch"], "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {k: list(v) if isinstance(v, tuple) else v
                                                      for k, v in gb.ADAMW.items()}},
            "gradient_clipping": 0.0, "bf16": {"enabled": True, "check_grad_overflow": not name.endswith("+overlap")},
            "zero_optimization": zero, "steps_per_print": 10**9}


def run_rank(name: str, spec: dict, sub_group: int, steps: int, warmup: int, nvme_dir: str) -> dict:
    """One rank: train ``warmup + steps`` steps, timing each phase."""
    import logging

    import zerospeed

    quiet = logging.StreamHandler()  # warnings still show; the resolved-config dump (INFO) does not
    quiet.setLevel(logging.WARNING)
    logging.getLogger("zerospeed").addHandler(quiet)
    rank = torch.distributed.get_rank()
    engine, optimizer, _, _ = zerospeed.initialize(model=gb.build_model(spec),
                                                   config=_config(name, spec, sub_group, nvme_dir))
    swapped = engine.state.zero_optimizer.swapped  # the optimizer's slabs (parameter reads not counted)
    x, y = gb.make_batch(spec, rank)
    rows, losses = [], []
    for i in range(warmup + steps):
        moved = swapped.bytes_moved if swapped is not None else (0, 0)
        t0 = time.perf_counter()
        loss = engine(x, y)
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        t3 = time.perf_counter()
        losses.append(float(loss.detach().float()))
        if i >= warmup:
            times = engine.state.last_step_times
            after = swapped.bytes_moved if swapped is not None else (0, 0)
            rows.append({"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2, "total": t3 - t0,
                         "read_bytes": after[0] - moved[0], "written_bytes": after[1] - moved[1],
                         **{k: times.get(k, 0.0) for k in ("update", "early_update", "early_under_backward",
                                                           "early_wait", "publish")}})
    out = {"rows": rows, "losses": losses, "optimizer": type(optimizer).__name__,
           "how": engine.state.describe_offload(), "hwm_mib": gb.vm_hwm_mib()}
    engine.destroy()  # removes the NVMe swap files
    return out


def _summarize(per_rank: list[dict]) -> dict:
    """Per step the slowest rank (by total), then the median of each phase over steps."""
    steps = len(per_rank[0]["rows"])
    slowest = [max((r["rows"][i] for r in per_rank), key=lambda row: row["total"]) for i in range(steps)]
    out = {k: statistics.median(row[k] for row in slowest) for k in PHASES}
    hidden = [row["early_under_backward"] / (row["early_update"] + row["update"])
              if row["early_update"] + row["update"] else 0.0 for row in slowest]
    out["hidden"] = statistics.median(hidden)
    out["read_bytes"] = statistics.median(row["read_bytes"] for row in slowest)
    out["written_bytes"] = statistics.median(row["written_bytes"] for row in slowest)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    # few tokens per step on a wide model: the optimizer is a large share of the step, as it is when
    # an accelerator runs forward and backward and the CPU runs the offloaded step
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--sub-group", type=int, default=8_000_000, help="sub_group_size (elements per sub-group)")
    parser.add_argument("--quick", action="store_true", help="a small model and 3 steps (make bench)")
    parser.add_argument("--nvme-dir", default=None, help="where the +nvme runs swap (default: a temporary "
                                                        "directory under the current one, removed after)")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.width, args.vocab, args.steps, args.warmup = 4, 256, 4096, 3, 1
        args.sub_group = min(args.sub_group, 500_000)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    spec = {"layers": args.layers, "width": args.width, "vocab": args.vocab, "seq": args.seq, "batch": args.batch}
    print(f"GPT {gb.num_params(spec) / 1e6:.1f}M parameters ({spec}), bf16, {WORLD} gloo ranks x 1 thread, "
          f"{args.steps} steps after {args.warmup} warm-up; overlap sub_group_size {args.sub_group:,}")

    from zerospeed.testing import run_distributed

    scratch = tempfile.TemporaryDirectory(prefix="bench-offload-nvme-", dir=".") if args.nvme_dir is None else None
    nvme_dir = args.nvme_dir or scratch.name  # type: ignore[union-attr]
    results = {}
    for name in configs:
        try:
            per_rank = run_distributed(run_rank, WORLD, name, spec, args.sub_group, args.steps, args.warmup,
                                       nvme_dir, timeout=1800, threads_per_rank=1)
        except Exception as exc:  # noqa: BLE001 - report and go on with the other configurations
            print(f"{name}: failed: {exc}")
            continue
        results[name] = _summarize(per_rank)
        results[name]["losses"] = per_rank[0]["losses"]
        print(f"  {name}: {per_rank[0]['optimizer']}; {per_rank[0]['how'] if '+' in name else 'no offload'}; "
              f"peak RSS {max(r['hwm_mib'] for r in per_rank):.0f} MiB/rank")

    width = {k: max(11, len(k) + 2) for k in PHASES}
    header = f"{'config':<15}" + "".join(f"{k:>{width[k]}}" for k in PHASES) + f"{'hidden':>9}"
    print("\nseconds per step (median over steps of the slowest rank)\n" + header)
    for name, r in results.items():
        print(f"{name:<15}" + "".join(f"{r[k]:>{width[k]}.4f}" for k in PHASES) + f"{r['hidden']:>9.0%}")
    for stage in ("zero2", "zero3"):
        base, off, lap = (results.get(stage + s) for s in ("", "+offload", "+overlap"))
        if off and lap:
            print(f"{stage}: overlap hid {lap['hidden']:.0%} of the update under backward; whole step "
                  f"{off['total']:.4f} -> {lap['total']:.4f} s (saved {off['total'] - lap['total']:+.4f} s, "
                  f"{off['total'] / lap['total']:.2f}x), backward {lap['backward'] - off['backward']:+.4f} s, "
                  f"step() {off['step']:.4f} -> {lap['step']:.4f} s")
        if base and off:
            print(f"{stage}: offload vs optimizer on the device: whole step {base['total']:.4f} -> "
                  f"{off['total']:.4f} s ({base['total'] / off['total']:.2f}x)")
    for name, r in results.items():
        if name.endswith("+nvme"):
            step_io = (r["read_bytes"] + r["written_bytes"]) / 1e9
            print(f"{name}: per step and rank {r['read_bytes'] / 1e9:.3f} GB read + {r['written_bytes'] / 1e9:.3f} GB "
                  f"written in a {r['step']:.3f} s step() ({step_io / r['step']:.2f} GB/s); whole step "
                  f"{r['total']:.3f} s vs {results[name[:5] + '+offload']['total']:.3f} s with CPU offload"
                  if name[:5] + "+offload" in results else f"{name}: {step_io:.3f} GB moved per step")
    if scratch is not None:
        scratch.cleanup()
    for stage in ("zero2", "zero3"):
        runs = {s: results[stage + s]["losses"] for s in ("", "+offload") if stage + s in results}
        if len(runs) == 2:  # bf16: CPUAdam and torch's AdamW round differently, the losses stay close
            diff = max(abs(a - b) for a, b in zip(*runs.values()))
            print(f"{stage}: largest loss difference offload vs not over {len(runs[''])} steps: {diff:.2e}")


if __name__ == "__main__":
    main()
