"""Mixture-of-experts layer throughput: zerospeed's ``MoE`` (dropless and capacity-based) against a naive
per-expert Python loop and DeepSpeed 0.19.8's ``MoE``, forward + backward, on the same inputs and weights.

One MoE layer, ``--experts`` copies of an MLP expert (hidden -> 4 hidden -> hidden, GELU), ``--tokens``
tokens of width ``--hidden``, top-1 and top-2 (``--k``), single process, ep_size 1, fp32, the same
``torch.set_num_threads`` (``--threads``) on every side. A step is a forward and a backward of
``output.square().mean() + 0.01 * l_aux`` (the input requires grad, so the dispatch's backward runs
too); no optimizer step. Every side of a given k starts from the same weights (one zerospeed layer is
built with a fixed seed and its state dict is loaded by all the others).

Sides (per k):
  zs-dropless-kK   zerospeed MoE, drop_tokens=False: routes sorted by expert, each expert one matmul over
                   its contiguous rows, nothing padded or dropped
  zs-capF-kK       zerospeed MoE, drop_tokens=True, capacity_factor F (``--capacity-factors``)
  naive-kK         softmax gate, top-k, ``for e in range(E): out[idx] += w * expert_e(x[idx])``
  ds-dropless-kK   DeepSpeed MoE, drop_tokens=False: it raises the capacity to the largest expert load
                   (an all-reduce MAX over the expert group) and pads every expert to it, so nothing drops
  ds-capF-kK       DeepSpeed MoE, drop_tokens=True, capacity_factor F
Both layers get the same arguments (use_rts=True, min_capacity 4, top2_2nd_expert_sampling=False so the
naive loop can route top-2 exactly as they do). DeepSpeed runs in ``/tmp/dsvenv`` (its own interpreter,
one gloo rank, DS_ACCELERATOR=cpu) as a server process that times its steps on request, so its sides
run in the same rotating rounds as the others (never concurrently with them). ``--quick`` leaves it out
unless ``--deepspeed`` is given; without /tmp/dsvenv it prints ``skipped: ...`` and the rest runs.

Checks, printed: the first (seeded) forward's outputs of zerospeed dropless, the naive loop and DeepSpeed
dropless agree, and zerospeed's capacity path agrees with DeepSpeed's (same random token selection draws);
the fraction of routes the capacity path drops and its relative output difference from the dropless
output; and a short training comparison (a tiny regression through one MoE layer in each mode, the same
data and initial weights, Adam), so the quality of each mode is measured rather than assumed.

Prints tokens/s per side (median over the timed steps), the spread, and the ratios (> 1: zerospeed
faster): zs-dropless / naive (target >= 1.5), zs-capF / ds-capF and zs-dropless / ds-dropless (target
>= 1.0), each as the median of the per-round ratios and from the pooled medians.

    python benchmarks/bench_moe.py [--rounds 5] [--steps 2] [--tokens 2048] [--hidden 512] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F

from _moe_bench import (INPUT_SEED, PROTOCOL, WEIGHT_SEED, NaiveMoE, expert_mlp, first_forward, make_step,
                        moe_kwargs, side_config, timed_steps)
from _report import percentile, print_ratio
from zerospeed.moe.gating import expert_capacity
from zerospeed.moe.layer import MoE

DS_VENV = Path("/tmp/dsvenv/bin/python")


# -- DeepSpeed, as a server in its own interpreter ---------------------------------------------------
class DeepSpeedServer:
    def __init__(self, state_path: str, threads: int) -> None:
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent), DS_ACCELERATOR="cpu",
                   OMP_NUM_THREADS=str(threads))
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([str(DS_VENV), str(Path(__file__).resolve().parent / "_moe_bench.py"), "serve",
                                      state_path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True, env=env)
        self.ready = self._read()

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PROTOCOL):
                kind, payload = line[len(PROTOCOL):].split(" ", 1)
                out = json.loads(payload)
                if kind == "ERROR":
                    raise RuntimeError(out["error"] + "\n" + out.get("trace", ""))
                return out
        self.stderr.seek(0)
        raise RuntimeError(f"DeepSpeed side exited ({self.proc.wait()}): {self.stderr.read()[-1500:]}")

    def run(self, side: str, steps: int) -> list[float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"run {side} {steps}\n")
        self.proc.stdin.flush()
        return self._read()["times"]

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


# -- the in-process sides ----------------------------------------------------------------------------
def build_local(side: str, spec: dict, weights: dict[int, dict]) -> torch.nn.Module:
    impl, drop, factor, k = side_config(side)
    if impl == "naive":
        module = NaiveMoE(spec["hidden"], spec["experts"], k)
        module.load_moe_state(weights[k])
        return module
    module = MoE(spec["hidden"], expert_mlp(spec["hidden"]), **moe_kwargs(spec, k, drop, factor))
    module.load_state_dict(weights[k])
    return module


def initial_weights(spec: dict, k: int, hidden: int | None = None) -> dict:
    """The layer's weights, every expert initialised on its own: both layers deep-copy the one expert module
    they are given, so all experts would start identical and a top-2 token's output would not depend on
    which of its routes were kept or where they went (the checks below could not see a routing error)."""
    hidden = hidden or spec["hidden"]
    torch.manual_seed(WEIGHT_SEED)
    layer = MoE(hidden, expert_mlp(hidden), **moe_kwargs(spec, k, False, 1.0))
    for module in layer.deepspeed_moe.experts.modules():
        if isinstance(module, torch.nn.Linear):
            module.reset_parameters()
    return {name: t.detach().clone() for name, t in layer.state_dict().items()}


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def relative_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# -- quality: a tiny regression through one layer in each mode ------------------------------------------
def train_compare(spec: dict, k: int, modes: list[tuple[str, bool, float]]) -> dict[str, tuple[float, float]]:
    """``steps`` Adam steps of a regression onto a fixed random teacher, every mode from the same weights on
    the same batches. Returns each mode's (mean training loss over the last 10 steps, held-out loss)."""
    hidden, tokens, steps = spec["train_hidden"], spec["train_tokens"], spec["train_steps"]
    tspec = dict(spec, hidden=hidden)
    gen = torch.Generator().manual_seed(7)
    teacher = [torch.randn(hidden, 4 * hidden, generator=gen) / hidden ** 0.5,
               torch.randn(4 * hidden, hidden, generator=gen) / (4 * hidden) ** 0.5]

    def target(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ teacher[0]) @ teacher[1]

    batches = [torch.randn(tokens, hidden, generator=gen) for _ in range(steps)]
    held_out = torch.randn(4 * tokens, hidden, generator=gen)
    init = initial_weights(tspec, k)
    results = {}
    for name, drop, factor in modes:
        layer = MoE(hidden, expert_mlp(hidden), **moe_kwargs(tspec, k, drop, factor))
        layer.load_state_dict(init)
        opt = torch.optim.Adam(layer.parameters(), lr=spec["train_lr"])
        torch.manual_seed(FORWARD_SEED_TRAIN)
        losses = []
        for x in batches:
            out, l_aux, _ = layer(x)
            mse = F.mse_loss(out, target(x))
            (mse + 0.01 * l_aux).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(mse.detach()))
        layer.eval()  # eval capacity factor = the training one (moe_kwargs)
        with torch.no_grad():
            held = float(F.mse_loss(layer(held_out)[0], target(held_out)))
        results[name] = (statistics.mean(losses[-10:]), held)
    return results


FORWARD_SEED_TRAIN = 5


# -- report ------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--k", default="1,2", help="comma-separated top-k values")
    parser.add_argument("--capacity-factors", default="1.0,1.25", help="the capacity-based sides' factors")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per side per round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per side before the first round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, every side")
    parser.add_argument("--train-steps", type=int, default=100, help="steps of the quality comparison (0: skip)")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed sides")
    parser.add_argument("--deepspeed", action="store_true", help="with --quick: run the DeepSpeed sides anyway")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, 1 round, no DeepSpeed")
    args = parser.parse_args()
    spec = {"hidden": args.hidden, "experts": args.experts, "tokens": args.tokens, "rounds": args.rounds,
            "steps": args.steps, "warmup": args.warmup, "threads": args.threads, "train_steps": args.train_steps,
            "train_hidden": 64, "train_tokens": 512, "train_lr": 3e-3}
    with_ds = not args.no_deepspeed and (args.deepspeed or not args.quick)
    if args.quick:
        spec.update(hidden=64, tokens=512, rounds=1, steps=2, warmup=1, train_steps=min(args.train_steps, 30),
                    train_tokens=256)
    ks = [int(k) for k in args.k.split(",")]
    factors = [float(f) for f in args.capacity_factors.split(",")]
    torch.set_num_threads(spec["threads"])

    local, remote = [], []
    for k in ks:
        local += [f"zs-dropless-k{k}"] + [f"zs-cap{f}-k{k}" for f in factors] + [f"naive-k{k}"]
        remote += [f"ds-dropless-k{k}"] + [f"ds-cap{f}-k{k}" for f in factors]
    E, H, S = spec["experts"], spec["hidden"], spec["tokens"]
    print(f"MoE layer: {E} experts of MLP {H} -> {4 * H} -> {H} (GELU), {S} tokens x hidden {H}, top-k {ks}, "
          f"ep_size 1, fp32; step = forward + backward of output.square().mean() + 0.01 * l_aux (input requires "
          f"grad), no optimizer step")
    print(f"torch {torch.__version__}, torch.set_num_threads({torch.get_num_threads()}) on {os.cpu_count()} cores, "
          f"single process; capacity factors {factors}, min_capacity 4, use_rts=True, "
          f"top2_2nd_expert_sampling=False on every side")

    weights = {k: initial_weights(spec, k) for k in ks}
    torch.manual_seed(INPUT_SEED)
    x = torch.randn(S, H).requires_grad_(True)
    modules = {side: build_local(side, spec, weights) for side in local}
    steps = {side: make_step(modules[side], x) for side in local}
    firsts = {side: first_forward(modules[side], x) for side in local}

    tmp = tempfile.TemporaryDirectory()
    server = None
    if with_ds:
        if not DS_VENV.exists():
            print(f"deepspeed sides skipped: {DS_VENV} not found (a venv with deepspeed 0.19.8 and torch, CPU)")
        else:
            state_path = os.path.join(tmp.name, "state.pt")
            torch.save({"spec": spec, "sides": remote, "weights": weights, "x": x.detach()}, state_path)
            try:
                server = DeepSpeedServer(state_path, spec["threads"])
                firsts.update(torch.load(state_path + ".deepspeed_out.pt"))
                print(f"deepspeed {server.ready['version']} (torch {server.ready['torch']}, "
                      f"{server.ready['threads']} thread(s)) in {DS_VENV.parent.parent}, one gloo rank")
            except RuntimeError as exc:
                print(f"deepspeed sides skipped: {str(exc)[:2000]}")
                server = None
    sides = local + (remote if server is not None else [])

    # -- the first forward: do the implementations compute the same thing? ----------------------------
    print("first forward (seeded, same weights and inputs), max |difference| of the outputs:")
    for k in ks:
        ref = firsts[f"zs-dropless-k{k}"][0]
        parts = [f"zs-dropless vs naive {max_diff(ref, firsts[f'naive-k{k}'][0]):.2e}"]
        if server is not None:
            parts.append(f"zs-dropless vs ds-dropless {max_diff(ref, firsts[f'ds-dropless-k{k}'][0]):.2e}")
            for f in factors:
                zs, ds = firsts[f"zs-cap{f}-k{k}"], firsts[f"ds-cap{f}-k{k}"]
                same = "same" if torch.equal(zs[1].long(), ds[1].long()) else "DIFFERENT"
                parts.append(f"zs-cap{f} vs ds-cap{f} {max_diff(zs[0], ds[0]):.2e} ({same} expert counts)")
        agree = max_diff(ref, firsts[f"naive-k{k}"][0]) < 1e-4
        print(f"  k={k}: " + "; ".join(parts) + ("" if agree else "  <-- zerospeed and the naive loop DISAGREE"))
        print(f"check k={k}: outputs {'agree' if agree else 'DISAGREE'}")

    # -- timing: rotating rounds ---------------------------------------------------------------------
    for side in local:
        timed_steps(steps[side], spec["warmup"])
    times: dict[str, list[float]] = {s: [] for s in sides}
    round_medians: dict[str, list[float]] = {s: [] for s in sides}
    for r in range(spec["rounds"]):
        shift = r % len(sides)
        for side in sides[shift:] + sides[:shift]:
            t = server.run(side, spec["steps"]) if side in remote else timed_steps(steps[side], spec["steps"])
            times[side] += t
            round_medians[side].append(S / statistics.median(t))
    if server is not None:
        server.close()
    print(f"{spec['warmup']} warm-up step(s) per side, then {spec['rounds']} rounds x {spec['steps']} timed steps, "
          "side order rotating every round")
    print(f"{'side':<18}{'tokens/s':>10}{'step ms':>10}{'p10':>9}{'p90':>9}{'round tokens/s (min-max)':>28}")
    tput = {}
    for side in sides:
        ms = [t * 1e3 for t in times[side]]
        med = statistics.median(ms)
        tput[side] = S / (med / 1e3)
        rm = round_medians[side]
        print(f"{side:<18}{tput[side]:>10.0f}{med:>10.1f}{percentile(ms, 0.1):>9.1f}{percentile(ms, 0.9):>9.1f}"
              f"{min(rm):>19.0f} - {max(rm):.0f}")

    print("ratios of tokens/s (> 1: the first side is faster)")
    pairs = []
    for k in ks:
        pairs.append((f"zs-dropless-k{k}", f"naive-k{k}", 1.5))
        if server is not None:
            pairs.append((f"zs-dropless-k{k}", f"ds-dropless-k{k}", 1.0))
            pairs += [(f"zs-cap{f}-k{k}", f"ds-cap{f}-k{k}", 1.0) for f in factors]
            pairs.append((f"zs-dropless-k{k}", f"ds-cap{factors[0]}-k{k}", None))
    for side, peer, target in pairs:
        print_ratio(f"{side} / {peer}", round_medians[side], round_medians[peer], tput[side], tput[peer])
        if target is not None:
            ratio = statistics.median(s / p for s, p in zip(round_medians[side], round_medians[peer]))
            print(f"  target >= {target}: {'met' if ratio >= target else 'NOT met'}")

    # -- quality: what the capacity path drops -------------------------------------------------------
    print("capacity-based vs dropless on the first forward: routes dropped (a route = one token's choice), tokens "
          "with every route dropped (output 0), relative L2 difference of the outputs from the dropless one")
    for k in ks:
        dropless_out, counts = firsts[f"zs-dropless-k{k}"]
        for f in factors:
            cap = expert_capacity(S, E, f * k, 4)
            dropped = int((counts - cap).clamp(min=0).sum())
            out = firsts[f"zs-cap{f}-k{k}"][0]
            zero_rows = int((out.abs().sum(dim=-1) == 0).sum())
            print(f"  k={k} capacity_factor {f}: capacity {cap} per expert (max load {int(counts.max())}); "
                  f"{dropped}/{k * S} routes dropped ({dropped / (k * S):.2%}), {zero_rows / S:.2%} tokens get 0; "
                  f"relative difference {relative_diff(out, dropless_out):.3f}")
    if spec["train_steps"]:
        print(f"training comparison: {spec['train_steps']} Adam steps (lr {spec['train_lr']}) of a regression onto a "
              f"fixed random tanh-MLP teacher through one MoE layer ({E} experts, hidden {spec['train_hidden']}, "
              f"{spec['train_tokens']} fresh tokens per step), mse + 0.01 * l_aux, same initial weights and batches")
        for k in ks:
            modes = [("dropless", False, 1.0)] + [(f"cap{f}", True, f) for f in factors]
            res = train_compare(spec, k, modes)
            print(f"  k={k}: " + "; ".join(f"{name} train mse {tr:.4f} held-out {ho:.4f}"
                                          for name, (tr, ho) in res.items()))
    tmp.cleanup()


if __name__ == "__main__":
    main()
