"""ZeRO-Inference on one machine: generate with a model ~1.5x larger than free RAM, its weights on NVMe.

A Llama (Hugging Face ``LlamaForCausalLM`` from a config in code; default ~9.6B parameters in fp32,
~38 GB of weights) is built on the meta device and materialised one module at a time, each filled with
name-seeded values and partitioned by ``zerospeed.zero.Init`` straight into swap files, so the model
never exists in memory. ``zero_inference`` (ZeRO stage 3 with ``offload_param: nvme``, no optimizer)
moves the partitions into the engine's files, and ``generate`` streams every layer from disk once per
token while the previous one computes. Reported: tokens, tokens/s, bytes read per token, the disk's
sequential read rate measured in the same run with the same I/O engine on the same files, the
bandwidth-bound speed (read rate / bytes per token) and the ratio, where a token's time goes (blocked
on reads vs computing and copying), and the peak RSS. Then the same architecture at a smaller depth
(same width and vocabulary, hence the same embedding, head and first layers) runs both in memory with
plain Hugging Face and through ZeRO-Inference on NVMe: the greedy tokens must be equal.
Run: ``make zero-inference``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "infinity"))

import zerospeed  # noqa: E402
from zerospeed.inference.zero_inference import ZeroInference, zero_inference  # noqa: E402
from zerospeed.offload.aio import AsyncIOHandle  # noqa: E402
from zerospeed.offload.nvme import SlabBuffers  # noqa: E402

from seeded_llama import Shape, build  # noqa: E402
from train import gib, peak_rss_bytes, ram_bytes, return_freed_memory_promptly, size  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
AIO: dict[str, Any] = {"block_size": 1 << 20, "queue_depth": 8}  # the engine's and the rate measurement's
DISK_SLACK = 1.05  # swap files: the weights, plus a unit while zero.Init's files are moved into the engine's


def available_ram() -> int:
    """MemAvailable (what ``free`` calls available): what a new process can use without swapping."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def zero_section(nvme_dir: Path) -> dict[str, Any]:
    # every shard on disk (max_in_cpu 0); the look-ahead is the next unit (the stage-3 default budget,
    # 5e7 elements, is smaller than a layer, and the next unit is always fetched)
    return {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(nvme_dir), "max_in_cpu": 0}}


def init_config(nvme_dir: Path, dtype: torch.dtype) -> dict[str, Any]:
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero_section(nvme_dir),
                              "aio": AIO}
    if dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    return config


def build_on_nvme(shape: Shape, dtype: torch.dtype, seed: int, nvme_dir: Path, show: bool) -> ZeroInference:
    """zero.Init partitions each module into swap files as it is filled; then the engine takes them."""
    init = zerospeed.zero.Init(config=init_config(nvme_dir, dtype))
    modules = 7 * shape.layers + 3 + 2 * shape.layers  # q,k,v,o, gate,up,down + 2 norms per layer; embed, norm, head
    bar = tqdm(total=modules, disable=not show, ncols=110, unit="module", desc="build on NVMe (zero.Init)")
    model = build(shape, dtype, seed, partition=init.partition, progress=lambda path: bar.update(1))
    bar.close()
    if show:
        print("moving the partitions into the engine's swap files (zero_inference)...", flush=True)
    return zero_inference(model, zero_section(nvme_dir), dtype=dtype, aio=AIO)


def measure_read_rate(z: ZeroInference, sample_bytes: float) -> dict[str, float]:
    """Sequential read rate of the engine's own swap files, with the engine's I/O engine and settings and
    the same kind of buffers, two requests in flight (as a decode step keeps them): bytes / seconds."""
    swapped = z.engine.state.param_swap
    if swapped is None or not swapped.nbytes:
        raise SystemExit("nothing went to NVMe: every parameter is below stage3_param_persistence_threshold "
                         "(1e5 elements) and stays in memory; raise --hidden")
    buffers = SlabBuffers(keep=2)
    buffers.fit(max(swapped.nbytes))
    slots = [buffers.take(), buffers.take()]
    handle = AsyncIOHandle(**AIO)
    moved, start, pending = 0, time.perf_counter(), []
    try:
        for i, (path, nbytes) in enumerate(zip(swapped.paths, swapped.nbytes)):
            if moved >= sample_bytes:
                break
            if len(pending) == 2:
                pending.pop(0).wait()
            pending.append(handle.submit_pread(slots[i % 2][:nbytes], str(path), 0))
            moved += nbytes
        for request in pending:
            request.wait()
        seconds = time.perf_counter() - start
    finally:
        handle.close()
    return {"bytes": moved, "seconds": seconds, "rate": moved / seconds}


def generate(z: ZeroInference, prompt: torch.Tensor, new_tokens: int, show: bool) -> dict[str, Any]:
    """Greedy generation; per forward: its end time, NVMe bytes read and seconds blocked on reads."""
    layers = list(z.module.model.layers)
    forwards: list[dict[str, float]] = []
    bar = tqdm(total=new_tokens * len(layers), disable=not show, ncols=110, unit="layer",
               bar_format="{desc:<24} {bar:16} {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]")
    start_io = z.io_stats()

    def on_layer(index: int) -> Any:
        def hook(module: Any, args: Any) -> None:
            bar.update(1)
            if show:
                read = z.io_stats()["bytes_read"] - start_io["bytes_read"]
                bar.set_postfix_str(f"layer {index + 1}/{len(layers)}, read {size(read)}")
        return hook

    def on_forward(module: Any, args: Any, output: Any) -> None:
        io = z.io_stats()
        forwards.append({"end": time.perf_counter(), "bytes_read": io["bytes_read"], "read_wait_s": io["read_wait_s"]})
        bar.set_description_str(f"token {len(forwards)}/{new_tokens} done")

    hooks = [layer.register_forward_pre_hook(on_layer(i)) for i, layer in enumerate(layers)]
    hooks.append(z.module.register_forward_hook(on_forward))
    bar.set_description_str(f"token 1/{new_tokens} (prefill)")
    start = time.perf_counter()
    try:
        tokens = z.generate(prompt, max_new_tokens=new_tokens, do_sample=False, use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
        bar.close()
    begin = {"end": start, "bytes_read": start_io["bytes_read"], "read_wait_s": start_io["read_wait_s"]}
    steps = [{k: b[k] - a[k] for k in b} for a, b in zip([begin, *forwards], forwards)]
    swapped = z.engine.state.param_swap
    return {"tokens": tokens[0, prompt.shape[1]:].tolist(), "steps": steps,
            "seconds": time.perf_counter() - start, "model_bytes": sum(swapped.nbytes) if swapped is not None else 0,
            "prefetch": {k: v for k, v in vars(z.prefetch_stats).items() if k != "last_forward"}}


def parity_check(shape: Shape, dtype: torch.dtype, seed: int, prompt: torch.Tensor, new_tokens: int,
                 nvme_dir: Path) -> dict[str, Any]:
    """The same architecture at ``shape.layers`` layers: plain HF in memory vs ZeRO-Inference on NVMe."""
    reference = build(shape, dtype, seed)
    with torch.no_grad():
        want = reference.generate(prompt, max_new_tokens=new_tokens, do_sample=False)[0, prompt.shape[1]:].tolist()
    del reference
    with build_on_nvme(shape, dtype, seed, nvme_dir, show=False) as z:
        got = z.generate(prompt, max_new_tokens=new_tokens, do_sample=False)[0, prompt.shape[1]:].tolist()
    return {"layers": shape.layers, "params": shape.num_params(), "in_memory": want, "zero_inference": got,
            "equal": want == got}


def summarize(args: argparse.Namespace, shape: Shape, build_s: float, rate: dict[str, float],
              run: dict[str, Any], peak: int, itemsize: int) -> dict[str, Any]:
    decode = run["steps"][1:]  # the prefill is the first forward
    decode_s = sum(s["end"] for s in decode)
    # what a token must read: every swapped weight once (the measured reads per decode step also count
    # the next forward's first unit, fetched during the last step for a forward that never comes)
    bytes_per_token = run["model_bytes"]
    measured_per_token = sum(s["bytes_read"] for s in decode) / len(decode)
    tokens_per_s = len(decode) / decode_s
    bound = rate["rate"] / bytes_per_token
    wait = sum(s["read_wait_s"] for s in decode) / len(decode)
    return {
        "params": shape.num_params(), "shape": vars(shape), "dtype": args.dtype,
        "weights_bytes": shape.num_params() * itemsize, "ram_bytes": ram_bytes(), "available_ram_bytes": args.available,
        "weights_to_available_ram": shape.num_params() * itemsize / args.available,
        "build_seconds": build_s, "tokens": run["tokens"], "new_tokens": args.new_tokens,
        "prefill_seconds": run["steps"][0]["end"], "decode_seconds_per_token": decode_s / len(decode),
        "decode_tokens_per_s": tokens_per_s, "bytes_read_per_token": bytes_per_token,
        "measured_bytes_read_per_decode_step": measured_per_token, "prefetch": run["prefetch"],
        "disk_read_rate": rate["rate"], "disk_read_sample_bytes": rate["bytes"],
        "disk_read_rate_before": rate["before"], "disk_read_rate_after": rate["after"],
        "bandwidth_bound_tokens_per_s": bound, "ratio_to_bound": tokens_per_s / bound,
        "read_wait_per_token_s": wait, "other_per_token_s": decode_s / len(decode) - wait,
        "effective_read_rate": bytes_per_token * tokens_per_s,
        "peak_rss_bytes": peak, "peak_rss_share_of_ram": peak / ram_bytes(),
        "per_forward": run["steps"],
    }


def print_summary(s: dict[str, Any]) -> None:
    sh = s["shape"]
    print("\nsummary")
    print(f"  model                Llama {s['params'] / 1e9:.2f}B parameters ({sh['layers']} layers, hidden {sh['hidden']}, "
          f"MLP {sh['intermediate']}, {sh['heads']} heads, vocab {sh['vocab']}), {s['dtype']}, HF LlamaForCausalLM")
    print(f"  weights              {gib(s['weights_bytes'])} = {s['weights_to_available_ram']:.2f} x available RAM "
          f"({gib(s['available_ram_bytes'])} of {gib(s['ram_bytes'])}), on NVMe; built in {s['build_seconds']:.0f} s")
    print(f"  tokens               {s['tokens']} (greedy, KV cache on)")
    print(f"  prefill              {s['prefill_seconds']:.1f} s (the first forward also records the layer order)")
    print(f"  decode               {s['decode_seconds_per_token']:.1f} s/token = {s['decode_tokens_per_s']:.4f} tokens/s")
    print(f"    of which blocked on reads {s['read_wait_per_token_s']:.1f} s, computing and copying "
          f"{s['other_per_token_s']:.1f} s (overlapping the reads)")
    print(f"  read per token       {size(s['bytes_read_per_token'])} (every weight once; measured per decode step "
          f"{size(s['measured_bytes_read_per_decode_step'])}, which includes the look-ahead of the last step); "
          f"effective {size(s['effective_read_rate'])}/s")
    p = s["prefetch"]
    print(f"  prefetch             {p['prefetched']} units fetched ahead, {p['on_demand']} on demand (first two "
          f"forwards), {p['prefetch_wasted']} wasted; peak gathered {p['peak_live_elems'] / 1e9:.2f}B elements")
    print(f"  disk read rate       {size(s['disk_read_rate'])}/s (same files, same I/O engine, "
          f"{size(s['disk_read_sample_bytes'])} read; before generating {size(s['disk_read_rate_before'])}/s, "
          f"after {size(s['disk_read_rate_after'])}/s: the faster is used)")
    print(f"  bandwidth bound      {s['bandwidth_bound_tokens_per_s']:.4f} tokens/s; achieved "
          f"{s['ratio_to_bound']:.0%} of it")
    print(f"  peak RSS             {gib(s['peak_rss_bytes'])} = {s['peak_rss_share_of_ram']:.1%} of RAM")


def verdict(s: dict[str, Any], check: dict[str, Any] | None, strict: bool) -> list[str]:
    problems = []
    if check is not None and not check["equal"]:
        problems.append(f"tokens differ at {check['layers']} layers: in memory {check['in_memory']}, "
                        f"ZeRO-Inference {check['zero_inference']}")
    if strict:
        if s["peak_rss_share_of_ram"] >= 0.5:
            problems.append(f"peak RSS {gib(s['peak_rss_bytes'])} is not below half of RAM")
        if s["weights_to_available_ram"] < 1.5:
            problems.append(f"the weights are only {s['weights_to_available_ram']:.2f} x available RAM; the "
                            f"demonstration needs >= 1.5 x (raise --layers, or --no-check-memory for a small run)")
    return problems


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=46)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=11008)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--check-layers", type=int, default=2,
                        help="layers of the parity instance (0: skip the check)")
    parser.add_argument("--read-sample-gb", type=float, default=8.0,
                        help="GB of the swap files read to measure the disk's rate")
    parser.add_argument("--nvme-path", type=Path, default=Path(tempfile.gettempdir()) / "zerospeed-zero-inference",
                        help="directory for the swap files (created; a fast local disk)")
    parser.add_argument("--check-memory", action=argparse.BooleanOptionalAction, default=None,
                        help="fail unless weights >= 1.5 x available RAM and peak RSS < RAM / 2 "
                             "(default: on when the weights exceed available RAM)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    for name in ("layers", "hidden", "intermediate", "heads", "vocab", "new_tokens", "prompt_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (the first forward is the prefill; decode is measured after)")
    if args.hidden % args.heads:
        parser.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    return args


def check_disk(nvme_dir: Path, need: float) -> None:
    free = shutil.disk_usage(nvme_dir).free
    if need > free:
        raise SystemExit(f"--nvme-path {nvme_dir}: the swap files need about {size(need)} but only {size(free)} are "
                         f"free there; free space, point --nvme-path at a larger disk, or lower --layers")


def main(argv: list[str] | None = None) -> int:
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>`: where a long run is, without stopping it
    return_freed_memory_promptly()
    args = parse_args(argv)
    logging.getLogger("zerospeed").addHandler(logging.NullHandler())
    logging.getLogger("zerospeed").setLevel(logging.WARNING)
    dtype = DTYPES[args.dtype]
    itemsize = torch.empty(0, dtype=dtype).element_size()
    shape = Shape(args.hidden, args.layers, args.intermediate, args.heads, args.vocab)
    args.available = available_ram()
    weights = shape.num_params() * itemsize
    check = args.check_memory if args.check_memory is not None else weights > args.available
    made_dir = not args.nvme_path.exists()
    args.nvme_path.mkdir(parents=True, exist_ok=True)
    show = not args.quiet
    prompt = torch.randint(0, args.vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(args.seed))
    try:
        check_disk(args.nvme_path, weights * DISK_SLACK)
        print(f"zerospeed {zerospeed.__version__}: ZeRO-Inference example, Llama {shape.num_params() / 1e9:.2f}B "
              f"params in {args.dtype} = {gib(weights)} of weights vs {gib(args.available)} available RAM "
              f"({gib(ram_bytes())} total); swap files under {args.nvme_path}", flush=True)
        torch.manual_seed(args.seed)
        start = time.perf_counter()
        z = build_on_nvme(shape, dtype, args.seed, args.nvme_path, show)
        build_s = time.perf_counter() - start
        try:
            rate = measure_read_rate(z, args.read_sample_gb * 1e9)
            if show:
                print(f"disk read rate: {size(rate['rate'])}/s ({size(rate['bytes'])} of the swap files)", flush=True)
            run = generate(z, prompt, args.new_tokens, show)
            # again once the disk has settled (right after the build it is still writing back): the bound
            # uses the faster of the two measurements, so the ratio is never flattered
            after = measure_read_rate(z, args.read_sample_gb * 1e9)
            rate = max(rate, after, key=lambda r: r["rate"]) | {"before": rate["rate"], "after": after["rate"]}
        finally:
            z.close()  # removes this run's swap files
        summary = summarize(args, shape, build_s, rate, run, peak_rss_bytes(), itemsize)
        print_summary(summary)
        parity = None
        if args.check_layers > 0:
            small = shape.with_layers(args.check_layers)
            check_disk(args.nvme_path, small.num_params() * itemsize * DISK_SLACK)
            print(f"\nparity check: the same architecture at {small.layers} layers ({small.num_params() / 1e9:.2f}B "
                  f"params), in memory (plain HF) and through ZeRO-Inference on NVMe...", flush=True)
            parity = parity_check(small, dtype, args.seed, prompt, args.new_tokens, args.nvme_path)
            print(f"  in memory            {parity['in_memory']}\n  ZeRO-Inference       {parity['zero_inference']}"
                  f"\n  equal                {parity['equal']}")
    finally:
        if made_dir and args.nvme_path.exists() and not any(args.nvme_path.iterdir()):
            args.nvme_path.rmdir()
    problems = verdict(summary, parity, check)
    summary |= {"parity": parity, "problems": problems}
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1))
    met = ": weights >= 1.5 x available RAM with peak RSS < RAM / 2" if check else ""
    print("  result               " + ("FAILED: " + "; ".join(problems) if problems else "OK" + met))
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
