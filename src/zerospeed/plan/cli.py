"""``zerospeed plan CONFIG --model MODULE:FACTORY [--world-size N] [--memory 16GB]``.

Prints one rank's peak memory by kind for the config as written, then the cheapest configs (ZeRO
stage, offload, activation checkpointing, micro-batch) whose peak fits ``--memory``.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import NoReturn, Sequence

__all__ = ["parse_memory", "plan_main"]

_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9,
          "T": 10**12, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class PlanUsageError(ValueError):
    """A bad argument of ``zerospeed plan``; the message names it and the fix."""


def parse_memory(text: str) -> int:
    """``"16GB"``, ``"1.5GiB"``, ``"800MB"``, ``"2e9"`` -> bytes (GB = 10^9, GiB = 2^30)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if not match or unit not in _UNITS:
        raise PlanUsageError(f"--memory {text!r}: expected a size such as 16GB, 1.5GiB or 800MB (units B, KB, MB, GB, "
                             f"TB, KiB, MiB, GiB, TiB)")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise PlanUsageError(f"--memory {text!r}: must be more than 0 bytes")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise PlanUsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="zerospeed plan", description="Per-rank peak memory of a training config, before running it.")
    p.add_argument("config", help="DeepSpeed JSON config (train_micro_batch_size_per_gpu, zero_optimization, ...)")
    p.add_argument("--model", required=True, metavar="MODULE:FACTORY",
                   help="zero-argument callable returning the model or (model, example_inputs); MODULE is an "
                        "importable module or a .py path")
    p.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (default 1)")
    p.add_argument("--memory", help="per-rank memory budget (e.g. 16GB): list the cheapest configs that fit")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="the model checkpoints its repeated blocks (deepspeed.checkpointing)")
    p.add_argument("--malloc", choices=["default", "fixed"], default="default",
                   help="CPU ranks' allocator: glibc's default dynamic mmap threshold (the heap keeps freed "
                        "activations: adds an allocator line) or fixed (MALLOC_MMAP_THRESHOLD_ set in the ranks)")
    p.add_argument("--baseline", metavar="SIZE", help="skip measuring the idle rank: its peak RSS (e.g. 235MiB)")
    p.add_argument("--runtime", metavar="SIZE", default=None,
                   help="with --baseline: the first training step's fixed cost (e.g. 87MiB)")
    return p


def _mib(n: int) -> str:
    return f"{n / 2**20:10.1f} MiB"


def plan_main(argv: Sequence[str]) -> int:
    """Run the subcommand; returns the exit code (2 on a usage error, printed with the fix)."""
    try:
        return _run(list(argv))
    except PlanUsageError as err:
        print(f"zerospeed plan: error: {err}", file=sys.stderr)
        return 2


def _run(argv: list[str]) -> int:
    # Arguments first: --help and usage errors answer before torch is imported (seconds on a busy machine).
    args = _parser().parse_args(argv)
    if args.world_size < 1:
        raise PlanUsageError(f"--world-size {args.world_size}: must be at least 1")
    budget = parse_memory(args.memory) if args.memory is not None else None
    from zerospeed.accelerator import get_accelerator
    from zerospeed.config import ConfigError
    from zerospeed.plan.activations import trace_activations
    from zerospeed.plan.baseline import Baseline, measure_baseline
    from zerospeed.plan.factory import ModelSpecError, build_on_meta
    from zerospeed.plan.memory_plan import cheapest_fitting, plan_memory
    from zerospeed.plan.settings import model_layout_unplanned, run_settings

    try:
        model, example = build_on_meta(args.model)
    except ModelSpecError as err:
        raise PlanUsageError(str(err)) from err
    refusal = model_layout_unplanned(model)
    if refusal is not None:
        raise PlanUsageError(f"--model {args.model!r}: {refusal}")
    try:
        settings = run_settings(args.config, args.world_size, checkpoint_activations=args.activation_checkpointing)
    except (ConfigError, OSError, ValueError) as err:
        raise PlanUsageError(f"CONFIG {args.config!r}: {err}") from err
    if example is None:
        raise PlanUsageError(f"--model {args.model!r}: the factory returned only the model; return (model, "
                             f"example_inputs) so the plan can trace the activations of one micro-batch")
    if args.baseline is not None:
        baseline = Baseline(idle=parse_memory(args.baseline),
                            runtime=parse_memory(args.runtime) if args.runtime else 0)
    else:
        baseline = measure_baseline()
    trace = trace_activations(model, example, micro_batch=settings.micro_batch,
                              compute_dtype=settings.states.param_dtype)
    on_cpu = get_accelerator().device_type == "cpu"
    malloc = args.malloc if on_cpu else "fixed"
    plan = plan_memory(model, trace, settings, baseline, traced_batch=settings.micro_batch, malloc=malloc)
    st = settings.states
    print(f"zerospeed plan: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"{args.world_size} rank(s), ZeRO stage {st.stage}, {str(st.param_dtype).replace('torch.', '')}, "
          f"{st.optimizer}, offload_optimizer={st.zero.offload_optimizer.device.value}, "
          f"offload_param={st.zero.offload_param.device.value}, micro-batch {settings.micro_batch}, "
          f"activation checkpointing {'on' if settings.checkpoint_activations else 'off'}")
    for name, value in plan.lines():
        print(f"  {name:<55}{_mib(value)}")
    if on_cpu and malloc == "default":
        print("  (allocator: glibc's default mmap threshold rises as tensors are freed and the heap then keeps freed "
              "activations; MALLOC_MMAP_THRESHOLD_=131072 in the ranks' environment avoids it at a cost in step "
              "time (the 98M GPT: 12-20% less memory, 16-26% slower steps): --malloc fixed, see docs/memory_plan.md)")
    if budget is None:
        return 0
    fits = cheapest_fitting(model, trace, settings, baseline, traced_batch=settings.micro_batch, budget=budget,
                            on_device=not on_cpu, malloc=malloc)
    what = "peak per rank" if on_cpu else "device peak"
    if not fits:
        print(f"no config fits {args.memory} ({what}); the smallest needs more: try more ranks or NVMe offload")
        return 1
    print(f"cheapest configs whose {what} fits {args.memory}:")
    for cand in fits:
        print(f"  {cand.label:<95}{_mib(cand.plan.peak if on_cpu else cand.plan.device_peak)}")
    return 0
