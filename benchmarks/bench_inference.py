"""Inference throughput: Hugging Face ``generate()`` against zerospeed's sides, same weights, same run.

For each model (a GPT-2-small-sized GPT-2 and a Llama of similar size, built from configs with seeded
random weights: nothing is downloaded), dtype and batch size, every side is the same model driven by
the same ``model.generate(...)`` call (greedy, ``min_new_tokens == max_new_tokens`` so every side
generates the same count):

* ``hf``: plain Hugging Face, its default ``DynamicCache`` (the peer);
* ``fused``: ``zerospeed.inference.fused.inject_fused`` (kernel injection: fused attention over a
  preallocated cache), on a deep copy of the same model;
* ``int8``: ``init_inference(dtype=torch.int8, replace_with_kernel_inject=True)``: the fused decoder with
  group-wise int8 weights (its tokens may differ from fp32's where logits nearly tie: the share is printed).

More sides plug in as functions in :data:`SIDES` (``name -> builder(model, args) -> model``). With
``--sides ... tp2 tp2-int8`` the same model is also served at tensor-parallel size 2 (``init_inference`` with
``tp_size`` 2 and kernel injection, fp32 or int8) on 2 gloo ranks of one thread each, timed in their own
processes after the single-process rounds (not interleaved with them).

Per round and side, one ``generate(max_new_tokens=N)`` call with a streamer that only stamps the time of
each token: the first token's stamp is the time to first token (prefill), the span from the first to the
last token over ``N - 1`` the time per generated token (decode). Rounds rotate the order of the sides; the figures are medians over rounds, the ratios
medians of per-round ratios against ``hf``. ``tokens`` says whether a side's greedy tokens equal
``hf``'s (in bf16 a different rounding order may legitimately change a near-tie; the share of equal
tokens is printed).

    python benchmarks/bench_inference.py [--models gpt2 llama] [--dtypes fp32 bf16] [--batches 1 4]
        [--prompt 128] [--new 64] [--rounds 3] [--threads N] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # so the tp=2 ranks can import this module by name

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_model(kind: str, dtype: torch.dtype, *, quick: bool) -> nn.Module:
    """GPT-2 small (12 layers, 768 wide, 50257 vocabulary) or a Llama of similar size (GQA 12/4 heads)."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    layers, width = (4, 256) if quick else (12, 768)
    if kind == "gpt2":
        config: Any = GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64, vocab_size=50257, n_positions=1024)
    elif kind == "llama":
        config = LlamaConfig(hidden_size=width, intermediate_size=width * 8 // 3, num_hidden_layers=layers,
                             num_attention_heads=width // 64, num_key_value_heads=max(2, width // 192),
                             vocab_size=32000, max_position_embeddings=1024)
    else:
        raise ValueError(f"--models: unknown model {kind!r}; expected gpt2 or llama")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval().to(dtype)


def side_hf(model: nn.Module, args: argparse.Namespace) -> nn.Module:
    return model


def side_fused(model: nn.Module, args: argparse.Namespace) -> nn.Module:
    from zerospeed.inference.fused import inject_fused

    fused = copy.deepcopy(model)
    inject_fused(fused, max_out_tokens=args.prompt + args.new)
    return fused


def side_int8(model: nn.Module, args: argparse.Namespace) -> nn.Module:
    """The serving engine's own path: ``init_inference(dtype=torch.int8, replace_with_kernel_inject=True)``
    (fused decoder, then group-wise int8 weights with the native kernel; activations in the model's dtype)."""
    import zerospeed

    engine = zerospeed.init_inference(copy.deepcopy(model), dtype=torch.int8, replace_with_kernel_inject=True,
                                      max_out_tokens=args.prompt + args.new)
    return engine.module


#: name -> builder of that side's model from the shared Hugging Face model ("hf" first: the peer).
SIDES: dict[str, Callable[[nn.Module, argparse.Namespace], nn.Module]] = {"hf": side_hf, "fused": side_fused,
                                                                          "int8": side_int8}


#: the tensor-parallel sides, run on 2 ranks: fused fp32 (or the model's dtype), and fused + int8
TP2_SIDES = ("tp2", "tp2-int8")


@dataclass
class Timing:
    ttft: list[float]
    per_token: list[float]


class TokenClock:
    """A ``generate(streamer=...)`` that only records when each put arrives: the prompt first, then each new
    token, so one call gives both the time to the first token and the time between later tokens."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.stamps: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def generate(model: nn.Module, ids: torch.Tensor, new: int) -> tuple[float, float, torch.Tensor]:
    """Time to first token, mean time per later token (seconds), and the output of one greedy call."""
    clock = TokenClock()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,  # type: ignore[operator]
                             min_new_tokens=new, do_sample=False, pad_token_id=0, streamer=clock)
    first, last = clock.stamps[1], clock.stamps[-1]  # stamps[0]: the prompt, before any forward
    return first - clock.start, (last - first) / (new - 1), out


def _prompt_ids(batch: int, prompt: int) -> torch.Tensor:
    return torch.randint(2, 1000, (batch, prompt), generator=torch.Generator().manual_seed(1))


def _tp2_rank(kind: str, dtype_name: str, batch: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One of 2 ranks: ``init_inference(tensor_parallel={"tp_size": 2}, replace_with_kernel_inject=True)`` on the
    same seeded model, optionally int8; the same generate calls as the single-process sides."""
    import zerospeed

    base = build_model(kind, DTYPES[dtype_name], quick=spec["quick"])
    extra: dict[str, Any] = {"dtype": torch.int8} if spec["int8"] else {}
    engine = zerospeed.init_inference(base, tensor_parallel={"tp_size": 2}, replace_with_kernel_inject=True,
                                      max_out_tokens=spec["prompt"] + spec["new"], **extra)
    ids = _prompt_ids(batch, spec["prompt"])
    generate(engine.module, ids, 2)
    tokens = generate(engine.module, ids, spec["new"])[2][:, spec["prompt"]:]
    timing = Timing([], [])
    for _ in range(spec["rounds"]):
        first, per_token, _ = generate(engine.module, ids, spec["new"])
        timing.ttft.append(first)
        timing.per_token.append(per_token)
    return {"ttft": timing.ttft, "per_token": timing.per_token, "tokens": tokens.tolist()}


def _tp2_sides(kind: str, dtype_name: str, batch: int, args: argparse.Namespace) -> dict[str, tuple[Timing, torch.Tensor]]:
    """tp=2 sides: 2 gloo ranks on this machine, one torch thread each (the single-process sides use the
    same 2 cores through torch's threads). Timed in their own processes, after the single-process rounds."""
    from zerospeed.testing import run_distributed

    out: dict[str, tuple[Timing, torch.Tensor]] = {}
    for name, int8 in (("tp2", False), ("tp2-int8", True)):
        if name not in args.sides:
            continue
        spec = {"quick": args.quick, "int8": int8, "prompt": args.prompt, "new": args.new, "rounds": args.rounds}
        rank0 = run_distributed(_tp2_rank, 2, kind, dtype_name, batch, spec, timeout=3600, threads_per_rank=1)[0]
        out[name] = (Timing(rank0["ttft"], rank0["per_token"]), torch.tensor(rank0["tokens"]))
    return out


def run_case(kind: str, dtype_name: str, batch: int, args: argparse.Namespace) -> None:
    base = build_model(kind, DTYPES[dtype_name], quick=args.quick)
    models = {name: build(base, args) for name, build in SIDES.items() if name in args.sides}
    ids = _prompt_ids(batch, args.prompt)
    timings = {name: Timing([], []) for name in models}
    tokens: dict[str, torch.Tensor] = {}
    for name, model in models.items():  # warm-up, and the tokens each side generates
        generate(model, ids, 2)
        tokens[name] = generate(model, ids, args.new)[2][:, args.prompt:]
    order = list(models)
    for r in range(args.rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            first, per_token, _ = generate(models[name], ids, args.new)
            timings[name].ttft.append(first)
            timings[name].per_token.append(per_token)
    for name, (timing, generated) in _tp2_sides(kind, dtype_name, batch, args).items():
        timings[name], tokens[name] = timing, generated
    print(f"\n{kind} {dtype_name} batch {batch}: prompt {args.prompt}, {args.new} new tokens, {args.rounds} rounds")
    print(f"{'side':<8}{'ttft ms':>10}{'prefill tok/s':>15}{'decode ms/tok':>15}{'decode tok/s':>14}"
          f"{'decode x hf':>13}{'prefill x hf':>14}  tokens")
    peer = timings.get("hf")
    for name, t in timings.items():
        ttft, per_token = statistics.median(t.ttft), statistics.median(t.per_token)
        if peer is not None:
            decode_ratio = statistics.median(p / s for p, s in zip(peer.per_token, t.per_token, strict=True))
            prefill_ratio = statistics.median(p / s for p, s in zip(peer.ttft, t.ttft, strict=True))
            same = (tokens[name] == tokens["hf"]).float().mean().item()
            agree = "equal" if same == 1.0 else f"{same:.1%} equal"
        else:
            decode_ratio = prefill_ratio = float("nan")
            agree = "-"
        print(f"{name:<8}{ttft * 1e3:>10.1f}{batch * args.prompt / ttft:>15.0f}{per_token * 1e3:>15.2f}"
              f"{batch / per_token:>14.1f}{decode_ratio:>13.2f}{prefill_ratio:>14.2f}  {agree}")
        print(f"{'':<8}rounds: decode ms/tok {[round(x * 1e3, 1) for x in t.per_token]}, "
              f"ttft ms {[round(x * 1e3) for x in t.ttft]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama"])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=[*SIDES, *TP2_SIDES],
                        help=f"single-process sides (default: all) and the tp=2 sides {TP2_SIDES} (2 ranks)")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--quick", action="store_true", help="small models, short runs (a smoke test)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.prompt, args.new, args.rounds = min(args.prompt, 32), min(args.new, 8), 1
    if args.new < 2:
        parser.error("--new must be >= 2 (decode time is measured between the first and the last token)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for kind in args.models:
        for dtype_name in args.dtypes:
            for batch in args.batches:
                run_case(kind, dtype_name, batch, args)


if __name__ == "__main__":
    main()
