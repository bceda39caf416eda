"""GPT training step time and memory: zerospeed ZeRO stages 0-3 against torch and DeepSpeed peers.

One GPT-style model (pre-LN blocks, tied embedding / LM head; ~100M parameters by default, see
``_gpt_bench.py``) trains on 2 gloo ranks, 1 torch thread per rank, the same seed, the same random
token batch per rank (seeded generator, nothing downloaded), AdamW with the same arguments and
gradient clipping 1.0 on every side, through:

  ddp            torch DistributedDataParallel (bf16: torch.autocast, fp32 weights)
  zero_opt       DDP + torch.distributed.optim.ZeroRedundancyOptimizer (bf16: autocast)
  fsdp2          fully_shard per transformer block + root (bf16: MixedPrecisionPolicy bf16 params/reduce)
  zerospeed0..3  zerospeed.initialize, zero_optimization.stage 0..3 (bf16: "bf16": {"enabled": true})
  deepspeed1..3  DeepSpeed ZeRO 1..3 with a torch AdamW client optimizer (bf16: "bf16" enabled),
                 run by /tmp/dsvenv/bin/python (skipped when that interpreter is missing)

Each system and precision runs in its own fresh set of rank processes, so the peak RSS (VmHWM)
of one does not include another's. Prints the median step time (slowest rank per step), the
ratio to DDP of the same precision, peak RSS per rank, and model-state bytes per rank (params +
grads + optimizer states as allocated: zerospeed's ``engine.memory_breakdown()`` when it exists,
else n/a; for peers summed over the actual tensors, each storage once: local shards of params,
gradients, optimizer states, fp32 master partitions counted as optimizer states), then the
issue's targets with pass/fail. A system that fails prints its error and the run goes on.

    python benchmarks/bench_zero.py [--quick] [--systems ddp,fsdp2,zerospeed3] [--precisions fp32,bf16]
        [--steps 5] [--warmup 2] [--layers 12 --width 768 --vocab 16384 --seq 128 --batch 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # ranks import _gpt_bench by name

import torch  # noqa: E402

import _gpt_bench as gb  # noqa: E402

DS_PYTHON = "/tmp/dsvenv/bin/python"
SYSTEMS = ("ddp", "zero_opt", "fsdp2", "zerospeed0", "zerospeed1", "zerospeed2", "zerospeed3",
           "deepspeed1", "deepspeed2", "deepspeed3")
WORLD = 2


def _run_torch_side(system: str, precision: str, spec: dict, timeout: float) -> list[dict]:
    from zerospeed.testing import run_distributed

    return run_distributed(gb.run_system, WORLD, system, precision, spec, timeout=timeout, threads_per_rank=1)


def _run_deepspeed(jobs: list[tuple[str, str]], spec: dict, timeout: float):
    """All DeepSpeed (system, precision) jobs through one /tmp/dsvenv interpreter (each job still on
    fresh ranks); yields (job, per-rank results or an exception) as each finishes."""
    specs = [dict(spec, stage=int(system[-1]), precision=precision, world=WORLD) for system, precision in jobs]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(HERE))
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([DS_PYTHON, str(HERE / "_gpt_bench.py"), "deepspeed", json.dumps(specs)],
                                stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=str(HERE))
        timer = threading.Timer(timeout * max(1, len(jobs)), proc.kill)
        timer.start()
        try:
            done = 0
            for line in proc.stdout:
                if line.startswith("RESULT "):
                    yield jobs[done], json.loads(line[len("RESULT "):])["ranks"]
                    done += 1
            proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        err.seek(0)
        tail = [ln for ln in err.read().strip().splitlines() if ln.strip()] or ["(no stderr)"]
        for job in jobs[done:]:
            yield job, RuntimeError(f"deepspeed subprocess exit {proc.returncode} before this job finished: "
                                    f"{tail[-1]}")


def _load() -> str:
    """The 1-minute load average: on a shared machine, other work skews the step times."""
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "n/a"


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.0f}"


def _states_cell(states: list) -> str:
    if not states or any(s is None for s in states):
        return "n/a"
    totals = [s.get("total", sum(s.get(k, 0) for k in ("params", "grads", "optimizer_states"))) for s in states]
    parts = states[0]
    detail = "/".join(_mib(parts.get(k)) for k in ("params", "grads", "optimizer_states"))
    return f"{'/'.join(_mib(t) for t in totals)} (r0 p/g/o {detail})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="micro-batch per rank")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per system and precision")
    parser.add_argument("--quick", action="store_true",
                        help="small model (2 layers, width 128, vocab 1024, seq 64, batch 4), 3+1 steps")
    args = parser.parse_args()
    spec = {"layers": args.layers, "width": args.width, "vocab": args.vocab, "seq": args.seq,
            "batch": args.batch, "steps": args.steps, "warmup": args.warmup}
    if args.quick:
        spec.update(layers=2, width=128, vocab=1024, seq=64, batch=4, steps=3, warmup=1)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    if any(p not in ("fp32", "bf16") for p in precisions):
        parser.error("--precisions takes fp32 and/or bf16")
    have_ds = os.access(DS_PYTHON, os.X_OK)

    print(f"GPT {spec['layers']} layers, width {spec['width']}, vocab {spec['vocab']}, seq {spec['seq']}: "
          f"{gb.num_params(spec) / 1e6:.1f} M params; micro-batch {spec['batch']}/rank; {WORLD} gloo ranks x 1 "
          f"thread; torch {torch.__version__}; AdamW {gb.ADAMW}, clip {gb.CLIP}; "
          f"{spec['warmup']} warm-up + {spec['steps']} timed steps; {os.cpu_count()} cores, load average "
          f"{_load()} at start", flush=True)
    results: dict[tuple[str, str], dict] = {}
    errors: dict[tuple[str, str], str] = {}

    def record(key: tuple[str, str], outcome, t0: float) -> None:
        system, precision = key
        try:
            if isinstance(outcome, Exception):
                raise outcome
            failed = [r for r in outcome if "error" in r]
            if failed:
                raise RuntimeError(failed[0]["error"])
            results[key] = gb.summarize(outcome)
            print(f"  {system:<11} {precision}: {results[key]['median']:.3f} s/step "
                  f"(wall {time.perf_counter() - t0:.0f} s incl. start-up; load average {_load()})", flush=True)
        except Exception as exc:  # noqa: BLE001 - print and go on
            msg = [ln for ln in f"{type(exc).__name__}: {exc}".strip().splitlines() if ln.strip()]
            errors[key] = next((ln for ln in reversed(msg) if "Error" in ln), msg[0])[:300]
            print(f"  {system:<11} {precision}: FAILED {errors[key]}", flush=True)

    ds_jobs = []
    for precision in precisions:
        for system in systems:
            if system.startswith("deepspeed"):
                ds_jobs.append((system, precision))
                continue
            t0 = time.perf_counter()
            try:
                outcome = _run_torch_side(system, precision, spec, args.timeout)
            except Exception as exc:  # noqa: BLE001
                outcome = exc
            record((system, precision), outcome, t0)
    if ds_jobs and not have_ds:
        for key in ds_jobs:
            errors[key] = f"skipped: {DS_PYTHON} not found"
            print(f"  {key[0]:<11} {key[1]}: {errors[key]}", flush=True)
    elif ds_jobs:
        t0 = time.perf_counter()
        for key, outcome in _run_deepspeed(ds_jobs, spec, args.timeout):
            record(key, outcome, t0)
            t0 = time.perf_counter()

    for precision in precisions:
        ddp = results.get(("ddp", precision))
        print(f"\n{precision}: median s/step (slowest rank per step), ratio to DDP, peak RSS (VmHWM) per rank MiB, "
              f"model-state MiB per rank (rank0 params/grads/optimizer states)")
        print(f"{'system':<12}{'s/step':>9}{'x DDP':>8}{'peak RSS r0/r1':>17}  model states")
        for system in systems:
            key = (system, precision)
            if key in errors:
                print(f"{system:<12}  FAILED/SKIPPED: {errors[key]}")
                continue
            if key not in results:
                continue
            r = results[key]
            ratio = f"{r['median'] / ddp['median']:.2f}" if ddp else "n/a"
            hwm = "/".join(f"{h:.0f}" for h in r["hwm"])
            print(f"{system:<12}{r['median']:>9.3f}{ratio:>8}{hwm:>17}  {_states_cell(r['states'])}")

    print("\ntargets (issue 4):")
    checks = [("zerospeed3", "fsdp2", 0.9), ("zerospeed3", "deepspeed3", 0.9)]
    for stage in (1, 2):
        checks += [(f"zerospeed{stage}", "zero_opt", 1.0), (f"zerospeed{stage}", f"deepspeed{stage}", 1.0)]
    for precision in precisions:
        for ours, peer, limit in checks:
            if ours not in systems or peer not in systems:
                continue
            a, b = results.get((ours, precision)), results.get((peer, precision))
            label = f"  {precision} {ours} <= {limit:.1f}x {peer}:"
            if a is None or b is None:
                missing = ours if a is None else peer
                print(f"{label} n/a ({missing}: {errors.get((missing, precision), 'no result')})")
                continue
            ratio = a["median"] / b["median"]
            print(f"{label} {'PASS' if ratio <= limit else 'FAIL'} ({a['median']:.3f} vs {b['median']:.3f} s/step, "
                  f"ratio {ratio:.2f})")


if __name__ == "__main__":
    main()
