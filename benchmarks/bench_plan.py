"""``zerospeed plan``'s predicted peak RSS against the measured one, per (model, stage, offload).

Each case trains for a few steps on 2 gloo ranks, each rank its own process started as the launcher
starts ranks (``_plan_worker.py``; RANK/WORLD_SIZE/MASTER_* in the environment), and reads each rank's
peak RSS (VmHWM); the plan is computed for the same config (baseline measured once, as `zerospeed plan`
does) and the error of its per-rank peak against the larger measured rank is printed.

    PYTHONPATH=src python benchmarks/bench_plan.py [--model demo|98m|all] [--steps 3]

The 98M cases need ~2.5 GB per rank; they run one at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"demo": (f"{ROOT}/examples/plan_models.py:demo_gpt", ROOT / "examples" / "demo_config.json"),
          "98m": (f"{ROOT}/examples/plan_models.py:gpt_98m", None)}
BENCH_98M = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                       "weight_decay": 0.1}},
             "gradient_clipping": 1.0, "zero_optimization": {"stage": 0}}  # bench_zero.py's fp32 run
FIXED_MMAP_THRESHOLD = 128 * 1024  # glibc's default starting value, kept from rising
CASES = [(0, False), (1, False), (2, False), (3, False), (1, True), (2, True), (3, True)]


def run_ranks(args: list[str], world: int = 2, malloc: str = "default") -> list[dict]:
    """Start ``world`` worker ranks; ``malloc="fixed"``: glibc's mmap threshold pinned at 128 KiB
    (``MALLOC_MMAP_THRESHOLD_``), so freed large tensors go back to the system (see docs/memory_plan.md)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
        if malloc == "fixed":
            env["MALLOC_MMAP_THRESHOLD_"] = str(FIXED_MMAP_THRESHOLD)
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "_plan_worker.py"), *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=1800)
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        if not lines:
            raise RuntimeError(f"a rank failed (exit {proc.returncode}):\n{stderr[-3000:]}")
        out.append(json.loads(lines[0][len("RESULT "):]))
    return out


def case_config(base: dict, stage: int, offload: bool) -> dict:
    config = json.loads(json.dumps(base))
    config.pop("scheduler", None)  # (the demo's schedule needs a step count; memory does not)
    for monitor in ("csv_monitor", "tensorboard", "wandb", "comet"):  # no files written (the demo's go to the cwd)
        config.pop(monitor, None)
    config["zero_optimization"] = {**config.get("zero_optimization", {}), "stage": stage}
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    config["steps_per_print"] = 10**9
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["demo", "98m", "all"], default="demo")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--malloc", choices=["default", "fixed", "both"], default="both",
                        help="glibc's dynamic mmap threshold (default) and/or one pinned at 128 KiB (fixed)")
    parser.add_argument("--cases", help="JSON list of [stage, offload] pairs (default: stages 0-3, offload at 1-3)")
    args = parser.parse_args()
    from zerospeed.plan.activations import trace_activations
    from zerospeed.plan.baseline import measure_baseline
    from zerospeed.plan.factory import build_on_meta
    from zerospeed.plan.memory_plan import plan_memory
    from zerospeed.plan.settings import run_settings

    baseline = measure_baseline()
    print(f"baseline: idle {baseline.idle / 2**20:.1f} MiB, first-step runtime {baseline.runtime / 2**20:.1f} MiB")
    cases = [tuple(c) for c in json.loads(args.cases)] if args.cases else CASES
    mallocs = ["default", "fixed"] if args.malloc == "both" else [args.malloc]
    print(f"{'model':<6}{'stage':>6}{'offload':>9}{'malloc':>9}{'predicted MiB':>15}{'rank 0 MiB':>12}"
          f"{'rank 1 MiB':>12}{'error':>8}")
    for name in (["demo", "98m"] if args.model == "all" else [args.model]):
        spec, config_path = MODELS[name]
        base = json.loads(config_path.read_text()) if config_path else BENCH_98M
        model, example = build_on_meta(spec)
        for stage, offload in cases:
            config = case_config(base, stage, offload)
            settings = run_settings(config, 2)
            trace = trace_activations(model, example, micro_batch=settings.micro_batch,
                                      compute_dtype=settings.states.param_dtype)
            for malloc in mallocs:
                predicted = plan_memory(model, trace, settings, baseline, traced_batch=settings.micro_batch,
                                        malloc=malloc).peak
                measured = [r["peak"] for r in run_ranks([spec, json.dumps(config), str(args.steps)], malloc=malloc)]
                error = (predicted - max(measured)) / max(measured)
                print(f"{name:<6}{stage:>6}{'cpu' if offload else 'none':>9}{malloc:>9}{predicted / 2**20:>15.1f}"
                      f"{measured[0] / 2**20:>12.1f}{measured[1] / 2**20:>12.1f}{error:>+8.1%}", flush=True)


if __name__ == "__main__":
    main()
