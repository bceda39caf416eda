"""ZeRO-Infinity against DeepSpeed: one process, stage 3, parameters and optimizer states on NVMe, bf16.

The same GPT (``examples/gpt.py``, seeded, built in memory so both systems start from the same
weights) trains for a few steps under zerospeed and under DeepSpeed 0.19.8 (run from its own venv,
``/tmp/dsvenv``, when present), each in a fresh process with its swap files on this disk. Two
settings of ``offload_param.max_in_cpu``: DeepSpeed's default (1e9 elements: a model this size keeps
its parameters in CPU memory) and 0 (every parameter shard on NVMe). Printed per run: build seconds,
median seconds per step after the first, peak RSS, the losses, or the error that ended it.

    .venv/bin/python benchmarks/bench_infinity.py [--width 1024] [--layers 8] [--steps 4] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DS_PYTHON = "/tmp/dsvenv/bin/python"
SETTINGS = {"default": {}, "max_in_cpu=0": {"max_in_cpu": 0}}


def config(nvme: str, offload_param: dict[str, Any]) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
            "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 3,
                                  "offload_param": {"device": "nvme", "nvme_path": nvme, **offload_param},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}}


def worker(system: str, width: int, layers: int, steps: int, nvme: str, offload_param: dict[str, Any]) -> dict:
    """One run in this process; returns the figures (or the error)."""
    sys.path.insert(0, str(HERE.parent / "examples"))
    import torch
    from gpt import GPT, GPTConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    cfg = config(nvme, offload_param)
    start = time.perf_counter()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=8192, seq_len=64, d_model=width, n_layers=layers, n_heads=width // 64))
    if system == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    else:
        import zerospeed

        engine, *_ = zerospeed.initialize(model=model, config=cfg)
    out: dict[str, Any] = {"params": sum(p.numel() for p in model.parameters()) or None,
                           "build_s": time.perf_counter() - start, "step_s": [], "losses": []}
    x = torch.randint(0, 8192, (1, 64), generator=torch.Generator().manual_seed(0))
    try:
        for _ in range(steps):
            start = time.perf_counter()
            loss = engine(x, x.roll(-1, 1))
            engine.backward(loss)
            engine.step()
            out["step_s"].append(time.perf_counter() - start)
            out["losses"].append(round(loss.item(), 4))
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the other runs go on
        out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


def run(python: str, system: str, args: argparse.Namespace, setting: str) -> dict:
    with tempfile.TemporaryDirectory(dir=args.dir, prefix=f"bench-infinity-{system}-") as nvme:
        cmd = [python, __file__, "--worker", system, "--width", str(args.width), "--layers", str(args.layers),
               "--steps", str(args.steps), "--nvme", nvme, "--offload-param", json.dumps(SETTINGS[setting])]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {proc.returncode}: {tail[:160]}"}
    return json.loads(lines[-1][len("RESULT "):])


def describe(result: dict) -> str:
    steps = result.get("step_s", [])
    later = steps[1:] or steps
    parts = []
    if "build_s" in result:
        parts.append(f"build {result['build_s']:5.1f} s")
    if later:
        parts.append(f"{statistics.median(later):6.2f} s/step")
    if "peak_rss_gib" in result:
        parts.append(f"peak RSS {result['peak_rss_gib']:5.2f} GiB")
    if result.get("losses"):
        parts.append(f"losses {result['losses']}")
    if "error" in result:
        parts.append(f"FAILED after {len(steps)} step(s): {result['error']}")
    return ", ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dir", default=None, help="where the swap files go (default: the temp dir)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--worker", choices=["zerospeed", "deepspeed"], help=argparse.SUPPRESS)
    ap.add_argument("--nvme", help=argparse.SUPPRESS)
    ap.add_argument("--offload-param", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        result = worker(args.worker, args.width, args.layers, args.steps, args.nvme, json.loads(args.offload_param))
        print("RESULT " + json.dumps(result), flush=True)
        sys.stdout.flush()
        os._exit(0)  # past any process-group teardown trouble at exit: the figures are out
    print(f"GPT width {args.width}, {args.layers} layers, vocab 8192, 64 tokens, batch 1; stage 3, offload_param "
          f"and offload_optimizer on NVMe, bf16, AdamW, {args.steps} steps, one process each")
    systems = [("zerospeed", sys.executable)]
    systems += [("deepspeed", DS_PYTHON)] if os.access(DS_PYTHON, os.X_OK) else []
    results: dict[tuple[str, str], dict] = {}
    for setting in SETTINGS:
        for system, python in systems:
            results[(system, setting)] = result = run(python, system, args, setting)
            print(f"  {system:9s} {setting:13s} {describe(result)}", flush=True)
    if len(systems) == 1:
        print(f"  deepspeed: skipped ({DS_PYTHON} not found)")
    for setting in SETTINGS:
        ours, theirs = results[("zerospeed", setting)], results.get(("deepspeed", setting), {})
        if ours.get("step_s") and theirs.get("step_s") and "error" not in theirs and "error" not in ours:
            ratio = statistics.median(theirs["step_s"][1:] or theirs["step_s"]) / \
                statistics.median(ours["step_s"][1:] or ours["step_s"])
            rss = theirs["peak_rss_gib"] / ours["peak_rss_gib"]
            print(f"{setting}: zerospeed is {ratio:.2f}x DeepSpeed's speed with {1 / rss:.2f}x its peak RSS")


if __name__ == "__main__":
    main()
