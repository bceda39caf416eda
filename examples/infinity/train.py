"""ZeRO-Infinity on one machine: train a GPT whose training state does not fit in RAM.

One process, ZeRO stage 3, bf16, activation checkpointing, parameters *and* optimizer states on
NVMe (``offload_param`` / ``offload_optimizer`` with ``device: nvme``). The default size, about
2.5 billion parameters, needs about 16 bytes per parameter of training state (bf16 parameter 2,
fp32 master 4, Adam's two moments 8, gradient 2) -- some 40 GB, well over this machine's RAM --
while the process itself stays under half of RAM. The model is built under ``zero.Init`` so no
full copy of it is ever in memory. A progress bar shows each step's phases and the NVMe traffic;
the summary reports the sizes, peak RSS, seconds and bytes per step and the share of time spent
waiting for I/O. ``--in-memory`` runs the same model and data without any offload (the parity
reference: at a small ``--params`` both give the same losses). Run: ``make infinity``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import zerospeed  # noqa: E402
from zerospeed import checkpointing  # noqa: E402
from zerospeed.ops.adam import CPUAdam  # noqa: E402

from model import InfinityGPT, Shape, shape_for, synthetic_batch  # noqa: E402

#: The issue's accounting of training state per parameter (see the module docstring).
STATE_BYTES_PER_PARAM = 16
#: What the parameter, master/moment and gradient swap files take per parameter (bytes, upper bound).
NVME_BYTES_PER_PARAM = 2 + 12 + 4
ADAM = {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}
PHASES = ("forward", "backward", "optimizer (read/update/write)")
GIB = 2 ** 30


def ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def build_config(args: argparse.Namespace, nvme_dir: Path | None) -> dict[str, Any]:
    """The DeepSpeed-style config: NVMe for both tiers, or (``nvme_dir`` None) nothing offloaded.
    The in-memory run passes the same Adam as a client optimizer, so it has no optimizer section."""
    # gathered bf16 parameters kept between uses: bounded (DeepSpeed's defaults, 1e9 elements each, would
    # keep 2 GB gathered); with activation checkpointing a block's parameters are needed again soon anyway
    # A unit (one transformer block by default) is also what streams through memory at the optimizer
    # step, as one slab of 20 B/param (master, Adam moments, gradient): cutting units at 3e7 elements
    # keeps each slab near 0.5 GB, so the few resident at once stay far below RAM.
    zero: dict[str, Any] = {"stage": 3, "stage3_max_live_parameters": 200_000_000,
                            "stage3_max_reuse_distance": 100_000_000, "reduce_bucket_size": 30_000_000}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
        "steps_per_print": 10 ** 9, "bf16": {"enabled": True}, "zero_optimization": zero,
        "activation_checkpointing": {"profile": True},  # times the checkpointed forwards and recomputes
    }
    if nvme_dir is not None:
        config["optimizer"] = {"type": "AdamW", "params": ADAM}
        zero["offload_param"] = {"device": "nvme", "nvme_path": str(nvme_dir), "max_in_cpu": 0}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": str(nvme_dir)}
        config["aio"] = {}  # block size, queue depth, threads: the defaults
    return config


def in_memory_adam(params: Any) -> torch.optim.Optimizer:
    """The optimizer the NVMe run builds from its config (CPUAdam under offload), for exact parity."""
    return CPUAdam(params, lr=ADAM["lr"], betas=tuple(ADAM["betas"]), eps=ADAM["eps"],
                   weight_decay=ADAM["weight_decay"], adamw_mode=True)


def check_resources(args: argparse.Namespace, shape: Shape, nvme_dir: Path | None) -> None:
    """Refuse a run that cannot work here before spending minutes on it."""
    params, ram = shape.num_params(), ram_bytes()
    if nvme_dir is None and params * STATE_BYTES_PER_PARAM > 0.8 * ram:
        raise SystemExit(f"--in-memory with --params {args.params:g}: the training state "
                         f"({gib(params * STATE_BYTES_PER_PARAM)}) does not fit in RAM ({gib(ram)}); "
                         f"drop --in-memory (NVMe offload) or lower --params")
    if nvme_dir is not None:
        need, free = params * NVME_BYTES_PER_PARAM, shutil.disk_usage(nvme_dir).free
        if need > free:
            raise SystemExit(f"--nvme-path {nvme_dir}: the swap files need about {gib(need)} but only {gib(free)} "
                             f"are free there; point --nvme-path at a larger disk or lower --params")


def build_engine(args: argparse.Namespace, shape: Shape,
                 nvme_dir: Path | None) -> tuple[Any, InfinityGPT, dict[str, float]]:
    """The model built partitioned under ``zero.Init`` (bf16), then the engine; also the build's seconds
    and the peak RSS by its end (to tell the build's memory from the training's)."""
    config = build_config(args, nvme_dir)
    start = time.perf_counter()
    torch.manual_seed(args.seed)
    with zerospeed.zero.Init(config=config):
        model = InfinityGPT(shape)
    client = in_memory_adam if nvme_dir is None else None
    engine, *_ = zerospeed.initialize(model=model, optimizer=client, config=config)
    return engine, model, {"seconds": time.perf_counter() - start, "peak_rss_bytes": peak_rss_bytes()}


def size(n: float) -> str:
    """Bytes for people: 1.2 GB, 34.5 MB (decimal units, as disks are sold)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def gib(n: float) -> str:
    """Memory sizes in GiB (as RAM is counted)."""
    return f"{n / GIB:.2f} GiB"


def io_now(engine: Any) -> dict[str, float]:
    return dict(engine.offload_io())


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def traffic(engine: Any, since: dict[str, float]) -> str:
    """NVMe bytes read and written since ``since`` (an earlier :func:`io_now`), for the bar."""
    moved = delta(io_now(engine), since)
    return f"read {size(moved['bytes_read'])}, written {size(moved['bytes_written'])}"


def run_phase(engine: Any, phase: str, batch: tuple[torch.Tensor, torch.Tensor],
              loss: torch.Tensor | None) -> tuple[torch.Tensor | None, dict[str, float]]:
    """One phase of a step; returns the loss (forward) and the phase's seconds and NVMe traffic."""
    before, start = io_now(engine), time.perf_counter()
    if phase == PHASES[0]:
        loss = engine(*batch)
    elif phase == PHASES[1]:
        engine.backward(loss)
    else:
        engine.step()
    return loss, {"seconds": time.perf_counter() - start, **delta(io_now(engine), before)}


def train(engine: Any, model: InfinityGPT, args: argparse.Namespace, show: bool) -> list[dict[str, Any]]:
    """``args.steps`` optimizer steps; per step: loss, seconds and NVMe traffic of each phase."""
    start_io, layers = io_now(engine), model.shape.n_layers
    bar = tqdm(total=args.steps * len(PHASES), disable=not show, ncols=120, unit="phase",
               bar_format="{desc:<42} {bar:12} {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]")

    def show_block(index: int, module: Any, inputs: Any) -> None:  # forward and recompute pass through here
        if show:
            bar.set_postfix_str(f"block {index + 1}/{layers}, {traffic(engine, start_io)}")

    hooks = [block.register_forward_pre_hook(partial(show_block, i)) for i, block in enumerate(model.blocks)]
    batch = synthetic_batch(args.batch, model.shape, args.seed)  # one batch: the falling loss shows real updates
    records = []
    try:
        for step in range(args.steps):
            phases: dict[str, dict[str, float]] = {}
            loss = None
            for phase in PHASES:
                bar.set_description_str(f"step {step + 1}/{args.steps}: {phase}")
                loss, phases[phase] = run_phase(engine, phase, batch, loss)
                bar.update(1)
            assert loss is not None
            records.append({"loss": loss.item(), "phases": phases,
                            "optimizer_times": dict(getattr(engine.state, "last_step_times", {}) or {})})
            if show:
                bar.set_postfix_str(f"loss {records[-1]['loss']:.4f}, {traffic(engine, start_io)}")
    finally:
        for hook in hooks:
            hook.remove()
        bar.close()
    return records


def summarize(args: argparse.Namespace, shape: Shape, engine: Any, records: list[dict[str, Any]],
              build: dict[str, float]) -> dict[str, Any]:
    """The run's numbers (also what ``--json`` writes)."""
    params, ram = shape.num_params(), ram_bytes()
    state = params * STATE_BYTES_PER_PARAM
    step_seconds = [sum(p["seconds"] for p in r["phases"].values()) for r in records]
    per_step = [{k: sum(p[k] for p in r["phases"].values()) for k in
                 ("bytes_read", "bytes_written", "read_wait_s", "write_wait_s")} for r in records]
    timings = checkpointing.get_recomputer().timings
    peak = peak_rss_bytes()
    return {
        "mode": "in-memory" if args.in_memory else "nvme", "params": params,
        "shape": vars(shape) | {"n_heads": shape.n_heads}, "batch": args.batch, "steps": args.steps,
        "ram_bytes": ram, "training_state_bytes": state, "state_to_ram": state / ram,
        "peak_rss_bytes": peak, "peak_rss_share_of_ram": peak / ram,
        "build_seconds": build["seconds"], "peak_rss_after_build_bytes": build["peak_rss_bytes"],
        "step_seconds": step_seconds,
        "bytes_read_per_step": [s["bytes_read"] for s in per_step],
        "bytes_written_per_step": [s["bytes_written"] for s in per_step],
        "io_wait_share_per_step": [(s["read_wait_s"] + s["write_wait_s"]) / t
                                   for s, t in zip(per_step, step_seconds)],
        "losses": [r["loss"] for r in records], "phases": [r["phases"] for r in records],
        "optimizer_times": [r["optimizer_times"] for r in records],
        "recompute_seconds": timings.recompute_seconds, "checkpointed_forwards": timings.forward_calls,
        "recomputed_blocks": timings.recompute_calls,
        "memory_breakdown": dict(engine.memory_breakdown()),
    }


def print_summary(s: dict[str, Any]) -> None:
    shape, n = s["shape"], len(s["step_seconds"])
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    print("\nsummary")
    print(f"  model                GPT {s['params'] / 1e9:.3f}B parameters ({shape['n_layers']} layers, d_model "
          f"{shape['d_model']}, {shape['n_heads']} heads, vocab {shape['vocab_size']}), batch {s['batch']} x "
          f"{shape['seq_len']} tokens, bf16, ZeRO stage 3, {s['mode']}")
    print(f"  training state       {gib(s['training_state_bytes'])} ({STATE_BYTES_PER_PARAM} B/param) = "
          f"{s['state_to_ram']:.2f} x RAM ({gib(s['ram_bytes'])}); in swap files now "
          f"{gib(s['memory_breakdown'].get('on_nvme', 0))}")
    print(f"  peak RSS             {gib(s['peak_rss_bytes'])} = {s['peak_rss_share_of_ram']:.1%} of RAM")
    print(f"  model build          {s['build_seconds']:.1f} s (zero.Init + initialize), peak RSS by its end "
          f"{gib(s['peak_rss_after_build_bytes'])}")
    steady = s["step_seconds"][1:] or s["step_seconds"]
    print(f"  seconds per step     {', '.join(f'{t:.1f}' for t in s['step_seconds'])} "
          f"(mean {mean(s['step_seconds']):.1f}; without the first {mean(steady):.1f})")
    for phase in PHASES:  # means over the steps
        avg = {k: mean([p[phase][k] for p in s["phases"]]) for k in s["phases"][0][phase]}
        print(f"    {phase:<31} {avg['seconds']:6.1f} s, read {size(avg['bytes_read']):>8}, written "
              f"{size(avg['bytes_written']):>8}, I/O wait {avg['read_wait_s'] + avg['write_wait_s']:.1f} s")
    print(f"    (of backward: recomputing checkpointed blocks {s['recompute_seconds'] / n:.1f} s; "
          f"means over {n} steps)")
    print(f"  NVMe per step        read {size(mean(s['bytes_read_per_step']))}, "
          f"written {size(mean(s['bytes_written_per_step']))}")
    print(f"  I/O-wait share       {', '.join(f'{w:.0%}' for w in s['io_wait_share_per_step'])} of each step")
    print(f"  losses               {', '.join(f'{x:.4f}' for x in s['losses'])} (the same batch at every step)")


def memory_verdict(s: dict[str, Any]) -> list[str]:
    """What ``--check-memory`` found wrong (empty: the run showed what it is for)."""
    problems = []
    if s["peak_rss_share_of_ram"] >= 0.5:
        problems.append(f"peak RSS {gib(s['peak_rss_bytes'])} is not below half of RAM ({gib(s['ram_bytes'] / 2)})")
    if s["state_to_ram"] < 1.5:
        problems.append(f"the training state is only {s['state_to_ram']:.2f} x RAM; the demonstration needs >= 1.5 x "
                        f"(raise --params, or pass --no-check-memory for a small run)")
    return problems


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=2.5e9, help="target parameter count (default 2.5e9)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--nvme-path", type=Path, default=Path(tempfile.gettempdir()) / "zerospeed-infinity",
                        help="directory for the swap files (created; a fast local disk)")
    parser.add_argument("--in-memory", action="store_true", help="no offload at all (parity reference)")
    parser.add_argument("--check-memory", action=argparse.BooleanOptionalAction, default=None,
                        help="fail unless the state is >= 1.5 x RAM and peak RSS < RAM / 2 "
                             "(default: on when the training state exceeds RAM)")
    parser.add_argument("--json", type=Path, default=None, help="also write the summary here as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    for name in ("steps", "seq_len", "batch", "vocab"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    return args


def return_freed_memory_promptly() -> None:
    """Ask glibc to serve every allocation above 1 MiB from its own mapping, returned on free.

    By default glibc raises its mmap threshold up to 32 MiB as large blocks are freed, and keeps
    freed heap blocks below it for reuse; with layers built, gathered and released one after another
    the heap fragments and the process holds far more than it uses (measured on a 0.24B model: 3.6
    GiB peak RSS by default, 1.8 GiB with this). A program, not a library, should choose its
    allocator policy, so the example does it here. A no-op off glibc."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    M_MMAP_THRESHOLD = -3
    mallopt(M_MMAP_THRESHOLD, 1 << 20)


def main(argv: list[str] | None = None) -> int:
    return_freed_memory_promptly()
    args = parse_args(argv)
    logging.getLogger("zerospeed").addHandler(logging.NullHandler())  # the bar and summary say it
    logging.getLogger("zerospeed").setLevel(logging.WARNING)
    shape = shape_for(args.params, args.vocab, args.seq_len)
    nvme_dir = None if args.in_memory else args.nvme_path
    made_dir = nvme_dir is not None and not nvme_dir.exists()
    if nvme_dir is not None:
        nvme_dir.mkdir(parents=True, exist_ok=True)
    check = args.check_memory
    if check is None:
        check = shape.num_params() * STATE_BYTES_PER_PARAM > ram_bytes()
    check_resources(args, shape, nvme_dir)
    print(f"zerospeed {zerospeed.__version__}: ZeRO-Infinity example, GPT {shape.num_params() / 1e9:.3f}B params, "
          f"training state {gib(shape.num_params() * STATE_BYTES_PER_PARAM)} vs RAM {gib(ram_bytes())}, "
          + ("in memory" if nvme_dir is None else f"swap files under {nvme_dir}"), flush=True)
    try:
        engine, model, build = build_engine(args, shape, nvme_dir)
        try:
            records = train(engine, model, args, show=not args.quiet)
            summary = summarize(args, shape, engine, records, build)
        finally:
            engine.destroy()  # removes this run's swap files
    finally:
        if made_dir and nvme_dir is not None and not any(nvme_dir.iterdir()):
            nvme_dir.rmdir()  # ours, and empty: leave no trace
    print_summary(summary)
    summary["check_memory"] = check
    summary["problems"] = memory_verdict(summary) if check else []
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1))
    if summary["problems"]:
        print("  result               FAILED: " + "; ".join(summary["problems"]))
        return 1
    print("  result               OK" + (": state >= 1.5 x RAM with peak RSS < RAM / 2" if check else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
