"""Tensor-parallel training step: zerospeed's tensor-parallel layers against torch DTensor, same run.

One GPT (``zerospeed.testing.tp_models.TinyGPT``: pre-LN blocks, fused per-head qkv, GELU MLP) is
trained at tensor-parallel degree 2 on 2 gloo ranks (1 thread each), twice from the same seed in the
same processes:

* ``dtensor``: the plain ``TinyGPT(cfg)`` split by ``torch.distributed.tensor.parallel.parallelize_module``:
  qkv and fc1 ``ColwiseParallel``, o and fc2 ``RowwiseParallel``, the token embedding
  ``RowwiseParallel(input_layouts=Replicate())`` (vocabulary rows split), the LM head
  ``ColwiseParallel(output_layouts=Shard(-1))`` and its cross-entropy under ``loss_parallel()``;
* ``zerospeed``: ``TinyGPT(cfg, tp_group=mesh)``: ``ColumnParallelLinear`` / ``RowParallelLinear``, a
  ``VocabParallelEmbedding`` and ``vocab_parallel_cross_entropy`` on the head's vocabulary slice,
  with a plain ``torch.optim.AdamW``;
* ``engine``: the same zerospeed model through ``zerospeed.initialize(..., mpu=mesh)`` (ZeRO stage 0,
  the same AdamW passed as a callable, ``gradient_clipping: 0``): what a user of the engine pays on top.

So both sides split the same weights the same way (vocabulary-parallel embedding, head and loss;
position embedding and norms replicated) and start from the same weights. Each step is forward +
backward + ``torch.optim.AdamW`` step (the same arguments on both sides) + zero grads, fp32.
Both sides see the same batches in the same order. Rounds alternate the sides (the first side swaps
every round), each round ``--steps`` timed steps after warm-up; the ratio is the median of per-round
ratios. Checked in the run: both give the same loss at step 0 (within 1e-4, else the script fails),
and the largest difference between the two sides' parameters after all steps is printed.
Also printed: a phase breakdown (forward / backward / optimizer step) and zerospeed's collectives
per step on the tensor-parallel Comm (``mesh.comm("tp").stats``), and DTensor's (``CommDebugMode``).

    python benchmarks/bench_tp.py [--hidden 512] [--layers 4] [--seq 128] [--batch 2] [--rounds 6] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # so ranks can import this module by name

import torch
import torch.distributed as dist

from zerospeed.testing import run_distributed
from _report import phase_medians, print_ratio, print_step_table

SIDES = ("dtensor", "zerospeed", "engine")
LABELS = {"dtensor": "DTensor", "zerospeed": "zerospeed layers", "engine": "zerospeed engine"}
PHASES = ("forward", "backward", "step")
LOSS_TOLERANCE = 1e-4
SEED = 1234
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
N_BATCHES = 4  # distinct batches, cycled (the same order on both sides)


def _config(spec: dict):
    from zerospeed.testing.tp_models import GPTConfig
    return GPTConfig(vocab=spec["vocab"], seq=spec["seq"], hidden=spec["hidden"], heads=spec["heads"],
                     layers=spec["layers"], ffn=4 * spec["hidden"])


# -- the three sides ------------------------------------------------------------------------------
class _ModelSide:
    """A model trained by a plain AdamW: zerospeed's TP layers, or (subclass) DTensor's split, whose
    loss and its backward must run under ``loss_parallel``."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.opt = torch.optim.AdamW(self.model.parameters(), **ADAMW)

    def context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.context():
            return self.model(ids, targets)

    def step(self, ids: torch.Tensor, targets: torch.Tensor) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        with self.context():  # the loss's backward must run under it too
            loss = self.model(ids, targets)
            t1 = time.perf_counter()
            loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2

    def local_params(self) -> dict[str, torch.Tensor]:
        return {n: (p.to_local() if hasattr(p, "to_local") else p).detach() for n, p in self.model.named_parameters()}


class _ZeroSide(_ModelSide):
    def __init__(self, spec: dict, mesh):
        from zerospeed.testing.tp_models import TinyGPT
        torch.manual_seed(SEED)
        super().__init__(TinyGPT(_config(spec), tp_group=mesh))


class _DTensorSide(_ModelSide):
    def __init__(self, spec: dict, device_mesh):
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        from zerospeed.testing.tp_models import TinyGPT
        cfg = _config(spec)
        torch.manual_seed(SEED)
        model = TinyGPT(cfg)
        plan = {
            "wte": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        }
        for i in range(cfg.layers):
            plan.update({f"blocks.{i}.attn.qkv": ColwiseParallel(), f"blocks.{i}.attn.o": RowwiseParallel(),
                         f"blocks.{i}.mlp.fc1": ColwiseParallel(), f"blocks.{i}.mlp.fc2": RowwiseParallel()})
        super().__init__(parallelize_module(model, device_mesh, plan))
        for block in self.model.blocks:  # local heads: the colwise qkv output is this rank's heads
            block.attn.heads = cfg.heads // device_mesh.size()

    def context(self) -> contextlib.AbstractContextManager:
        from torch.distributed.tensor.parallel import loss_parallel
        return loss_parallel()


class _EngineSide:
    def __init__(self, spec: dict, mesh):
        import zerospeed
        from zerospeed.testing.tp_models import TinyGPT
        torch.manual_seed(SEED)
        config = {"train_micro_batch_size_per_gpu": spec["batch"], "gradient_accumulation_steps": 1,
                  "gradient_clipping": 0.0, "steps_per_print": 10**9, "zero_optimization": {"stage": 0}}
        self.engine, _, _, _ = zerospeed.initialize(model=TinyGPT(_config(spec), tp_group=mesh), config=config,
                                                    optimizer=lambda params: torch.optim.AdamW(params, **ADAMW),
                                                    mpu=mesh)

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.engine(ids, targets)

    def step(self, ids: torch.Tensor, targets: torch.Tensor) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        loss = self.engine(ids, targets)
        t1 = time.perf_counter()
        self.engine.backward(loss)
        t2 = time.perf_counter()
        self.engine.step()
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2

    def local_params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.engine.module.named_parameters()}


def _bench(spec: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from zerospeed.distributed.mesh import ParallelDims
    from zerospeed.testing.tp_models import token_batch

    torch.set_num_threads(spec["threads"])
    quiet = logging.StreamHandler()  # zerospeed's warnings still show; the engine's resolved-config dump does not
    quiet.setLevel(logging.WARNING)
    logging.getLogger("zerospeed").addHandler(quiet)
    world = dist.get_world_size()
    mesh = ParallelDims(world_size=world, tp=world).build()
    tp_comm = mesh.comm("tp")
    device_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    cfg = _config(spec)
    batches = [token_batch(i, spec["batch"], cfg, seed=SEED) for i in range(N_BATCHES)]
    sides = {"dtensor": _DTensorSide(spec, device_mesh), "zerospeed": _ZeroSide(spec, mesh),
             "engine": _EngineSide(spec, mesh)}
    assert sides["engine"].engine.mesh.comm("tp") is tp_comm, "the engine must talk over the mesh it was given"
    numel = sum(p.numel() for p in sides["zerospeed"].model.parameters())  # this rank's share

    # same model, same data: the same loss before any step, or the comparison means nothing
    with torch.no_grad():
        loss0 = {}
        for name, side in sides.items():
            loss = side.loss(*batches[0])
            loss0[name] = float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
    for name in SIDES[1:]:
        if abs(loss0["dtensor"] - loss0[name]) > LOSS_TOLERANCE:
            raise AssertionError(f"step-0 losses differ: DTensor {loss0['dtensor']:.6f} vs {LABELS[name]} "
                                 f"{loss0[name]:.6f} (> {LOSS_TOLERANCE}); the sides do not compute the same model")

    counters = {name: 0 for name in SIDES}  # each side's own batch index, so all see the same sequence
    tp_calls = {name: Counter() for name in SIDES}  # the tp Comm's calls and bytes made by each side's steps
    tp_bytes = {name: Counter() for name in SIDES}

    def run(name: str) -> tuple[float, float, float]:
        ids, targets = batches[counters[name] % N_BATCHES]
        counters[name] += 1
        calls, nbytes = Counter(tp_comm.stats.calls), Counter(tp_comm.stats.bytes)
        out = sides[name].step(ids, targets)
        tp_calls[name].update(tp_comm.stats.calls - calls)
        tp_bytes[name].update(tp_comm.stats.bytes - nbytes)
        return out

    from torch.distributed.tensor.debug import CommDebugMode
    debug = CommDebugMode()
    with debug, warnings.catch_warnings():  # DTensor's collectives in its first warm-up step, for the printout
        warnings.filterwarnings("ignore", message="Full backward hook")  # CommDebugMode's module tracker
        run("dtensor")
    from torch.nn.modules import module as _module
    assert not (_module._global_forward_pre_hooks or _module._global_forward_hooks
                or _module._global_backward_hooks), "CommDebugMode left hooks behind: the timing would pay them"
    dtensor_calls = {str(op).split(".")[-1]: n for op, n in debug.get_comm_counts().items()}
    for name in SIDES:
        for _ in range(spec["warmup"] - (name == "dtensor")):
            run(name)
    for name in SIDES:
        tp_calls[name].clear()
        tp_bytes[name].clear()
    times: dict[str, list[tuple[float, float, float]]] = {s: [] for s in SIDES}
    rounds: dict[str, list[float]] = {s: [] for s in SIDES}
    for r in range(spec["rounds"]):
        for name in SIDES[r % len(SIDES):] + SIDES[:r % len(SIDES)]:  # each side leads in turn
            dist.barrier()
            per_step = []
            for _ in range(spec["steps"]):
                start = time.perf_counter()
                phases = run(name)
                per_step.append(time.perf_counter() - start)
                times[name].append(phases)
            rounds[name].append(statistics.median(per_step))
    timed = spec["rounds"] * spec["steps"]
    per_step_calls = {name: {op: n / timed for op, n in tp_calls[name].items()} for name in SIDES[1:]}
    per_step_bytes = {name: {op: b / timed for op, b in tp_bytes[name].items()} for name in SIDES[1:]}
    assert not tp_calls["dtensor"], "the DTensor side must not use zerospeed's Comm"
    ref = sides["dtensor"].local_params()
    diff = {}
    for name in SIDES[1:]:
        mine = sides[name].local_params()
        assert mine.keys() == ref.keys()
        diff[name] = max(float((ref[n] - mine[n]).abs().max()) for n in mine)
    return {"times": times, "rounds": rounds, "loss0": loss0, "diff": diff, "numel": numel,
            "calls": per_step_calls, "bytes": per_step_bytes, "threads": torch.get_num_threads(),
            "steps_per_side": counters, "dtensor_calls": dtensor_calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round and side")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps per side before the first round (at least 1: DTensor's first is counted)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--quick", action="store_true", help="smoke run: small model, 2 rounds of 3 steps")
    args = parser.parse_args()
    spec = {k: getattr(args, k) for k in ("hidden", "heads", "layers", "seq", "batch", "vocab", "rounds", "steps",
                                          "warmup", "threads")}
    spec["warmup"] = max(1, spec["warmup"])
    if args.quick:
        spec.update(hidden=256, heads=4, layers=2, seq=64, batch=4, vocab=2048, rounds=2, steps=3, warmup=1)
    world = 2
    results = run_distributed(_bench, world, spec, timeout=3600, threads_per_rank=spec["threads"])
    res = results[0]
    print(f"TinyGPT hidden {spec['hidden']}, {spec['heads']} heads, {spec['layers']} layers, ffn {4 * spec['hidden']}, "
          f"vocab {spec['vocab']}, seq {spec['seq']}, batch {spec['batch']}: {res['numel'] / 1e6:.2f} M params per "
          f"rank; tp={world} over gloo, {world} ranks x {res['threads']} thread, torch {torch.__version__}; "
          f"fp32 AdamW")
    loss0 = res["loss0"]
    print("step-0 loss: " + ", ".join(f"{LABELS[n]} {loss0[n]:.6f}" for n in SIDES) + " (max |diff| from DTensor "
          f"{max(abs(loss0[n] - loss0['dtensor']) for n in SIDES[1:]):.1e} <= {LOSS_TOLERANCE})")
    print(f"{spec['rounds']} interleaved rounds x {spec['steps']} steps per side (after {spec['warmup']} warm-up "
          f"steps; each side leads in turn); times from rank 0, ms")
    med = print_step_table(res["times"], res["rounds"], SIDES, LABELS, width=18)
    for side in SIDES[1:]:
        print_ratio(f"{LABELS[side]} / DTensor (target <= 1.0)", res["rounds"][side], res["rounds"]["dtensor"],
                    med[side], med["dtensor"])
    print("phase medians, ms (forward incl. loss | backward | optimizer step + zero grads):")
    for side in SIDES:
        cols = phase_medians(res["times"][side])
        print(f"  {LABELS[side]:<18}" + "".join(f"{p} {c:7.1f}   " for p, c in zip(PHASES, cols)))
    for side in SIDES[1:]:
        calls, nbytes = res["calls"][side], res["bytes"][side]
        ops = ", ".join(f"{op} {n:g} ({nbytes[op] / 2**20:.2f} MiB)" for op, n in sorted(calls.items()))
        print(f"{LABELS[side]}: tp Comm collectives per step: {sum(calls.values()):g}: {ops}")
    dt_ops = ", ".join(f"{op} {n}" for op, n in sorted(res["dtensor_calls"].items()))
    print(f"DTensor: collectives per step (CommDebugMode, one warm-up step): {sum(res['dtensor_calls'].values())}: "
          f"{dt_ops}")
    for side in SIDES[1:]:
        print(f"max |param difference| DTensor vs {LABELS[side]} after the same {res['steps_per_side'][side]} steps: "
              f"{res['diff'][side]:.2e}")


if __name__ == "__main__":
    main()
