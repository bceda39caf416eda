"""The model, data and per-rank training loops behind ``bench_zero.py``.

Importable by both interpreters: the main venv (zerospeed, torch peers) and the DeepSpeed venv
(``/tmp/dsvenv``, no zerospeed). So at module level this imports only the standard library, torch
and the model, ``examples/gpt.py`` (torch only); zerospeed and deepspeed are imported inside the
functions that use them.

Run as a script by the DeepSpeed interpreter:

    PYTHONPATH=benchmarks /tmp/dsvenv/bin/python benchmarks/_gpt_bench.py deepspeed '<json list of specs>'

runs, per spec, ``spec["world"]`` fresh ranks (torch.multiprocessing forkserver with deepspeed
preloaded, gloo, MASTER_ADDR/PORT in the environment) through DeepSpeed ZeRO ``spec["stage"]``
and prints one ``RESULT <json>`` line per spec.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

SEED = 1234
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
CLIP = 1.0


# -- model: examples/gpt.py (pre-LN blocks in a ModuleList, tied embedding / LM head; imports only torch)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402


def _config(spec: dict) -> GPTConfig:
    return GPTConfig(vocab_size=spec["vocab"], seq_len=spec["seq"], d_model=spec["width"], n_layers=spec["layers"],
                     n_heads=max(1, spec["width"] // 64))


def build_model(spec: dict) -> GPT:
    torch.manual_seed(SEED)
    return GPT(_config(spec))


def num_params(spec: dict) -> int:
    with torch.device("meta"):
        return GPT(_config(spec)).num_params()


def make_batch(spec: dict, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids from a seeded generator (one fixed batch per rank, reused every step)."""
    gen = torch.Generator().manual_seed(SEED + 1 + rank)
    tokens = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"] + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# -- measurement ---------------------------------------------------------------------------------
def vm_hwm_mib() -> float:
    """Peak resident set size of this process (VmHWM), MiB."""
    from zerospeed.accelerator.host_memory import peak_rss_bytes

    return peak_rss_bytes() / 2**20


class StateBytes:
    """Sums the bytes of distinct tensor storages, each counted once (tied weights, flat buffers)."""

    def __init__(self):
        self.seen: set[int] = set()
        self.total = 0

    def add(self, t) -> int:
        if t is None or not isinstance(t, torch.Tensor):
            return 0
        if hasattr(t, "to_local"):  # DTensor: this rank's shard
            t = t.to_local()
        if t.device.type == "meta" or t.numel() == 0:
            return 0
        try:
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except Exception:
            key, size = t.data_ptr(), t.numel() * t.element_size()
        if key in self.seen:
            return 0
        self.seen.add(key)
        self.total += size
        return size


def optimizer_state_tensors(opt: torch.optim.Optimizer):
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                yield v


def model_state_bytes(module_params, module_grads, inner_opt: torch.optim.Optimizer | None) -> dict:
    """params / grads / optimizer states of this rank. ``inner_opt`` is the torch optimizer that
    updates the weights: its own parameters, when distinct from the module's (fp32 master copies),
    count as optimizer states, their gradients (the fp32 gradient partitions) as grads."""
    seen = StateBytes()
    out = {"params": sum(seen.add(p) for p in module_params), "grads": sum(seen.add(g) for g in module_grads)}
    opt_states = 0
    if inner_opt is not None:
        for group in inner_opt.param_groups:
            for p in group["params"]:
                out["grads"] += seen.add(p.grad)
                opt_states += seen.add(p)
        opt_states += sum(seen.add(t) for t in optimizer_state_tensors(inner_opt))
    out["optimizer_states"] = opt_states
    out["total"] = out["params"] + out["grads"] + out["optimizer_states"]
    return out


def train(spec: dict, rank: int, step_fn, state_fn=None) -> dict:
    """Warm-up steps, then timed steps (ranks aligned by a barrier before each); ``state_fn``
    (called with the last step's gradients still present) reports the model-state bytes."""
    x, y = make_batch(spec, rank)
    losses = []
    for _ in range(spec["warmup"]):
        losses.append(step_fn(x, y, True))
    times = []
    for i in range(spec["steps"]):
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(step_fn(x, y, i < spec["steps"] - 1 or state_fn is None))
        times.append(time.perf_counter() - t0)
    states = state_fn() if state_fn is not None else None
    return {"times": times, "losses": losses, "hwm_mib": vm_hwm_mib(), "states": states,
            "threads": torch.get_num_threads()}


def _loss_value(loss: torch.Tensor) -> float:
    return float(loss.detach().float())


# -- torch peers and zerospeed (main venv, under zerospeed.testing.run_distributed) ---------------
def run_system(system: str, precision: str, spec: dict) -> dict:
    """Per-rank entry for the main venv: ``system`` in ddp, zero_opt, fsdp2, zerospeed0..3."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    start_hwm = vm_hwm_mib()
    try:
        if system.startswith("zerospeed"):
            out = _run_zerospeed(int(system[-1]), precision, spec, rank)
        elif system == "fsdp2":
            out = _run_fsdp2(precision, spec, rank)
        elif system in ("ddp", "zero_opt"):
            out = _run_ddp(system == "zero_opt", precision, spec, rank)
        else:
            raise ValueError(f"unknown system {system!r}")
    except Exception as exc:  # reported, not raised: the bench prints it and goes on
        return {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300], "trace": traceback.format_exc()}
    out["start_hwm_mib"] = start_hwm
    return out


def _train_torch(spec: dict, rank: int, model: nn.Module, opt, inner: torch.optim.Optimizer, autocast: bool) -> dict:
    """The plain torch loop (bf16 via autocast when asked); ``inner`` is the optimizer holding the states."""
    params = list(model.parameters())

    def step(x, y, zero_grad):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x, y)
        loss.backward()
        nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        if zero_grad:
            opt.zero_grad(set_to_none=True)
        return _loss_value(loss)

    def states():
        return model_state_bytes(params, [p.grad for p in params], inner)

    return train(spec, rank, step, states)


def _run_ddp(zero_opt: bool, precision: str, spec: dict, rank: int) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = nn.parallel.DistributedDataParallel(build_model(spec))
    if zero_opt:
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW)
        inner = opt.optim
    else:
        opt = inner = torch.optim.AdamW(model.parameters(), **ADAMW)
    return _train_torch(spec, rank, model, opt, inner, autocast=precision == "bf16")


def _run_fsdp2(precision: str, spec: dict, rank: int) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build_model(spec)
    kwargs = {}
    if precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    return _train_torch(spec, rank, model, opt, opt, autocast=False)


def _run_zerospeed(stage: int, precision: str, spec: dict, rank: int) -> dict:
    import logging

    import zerospeed

    quiet = logging.StreamHandler()  # warnings still show; the resolved-config dump (INFO) does not
    quiet.setLevel(logging.WARNING)
    logging.getLogger("zerospeed").addHandler(quiet)
    config = {
        "train_micro_batch_size_per_gpu": spec["batch"], "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {k: list(v) if isinstance(v, tuple) else v
                                                  for k, v in ADAMW.items()}},
        "gradient_clipping": CLIP, "zero_optimization": {"stage": stage}, "steps_per_print": 10**9,
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    engine, _, _, _ = zerospeed.initialize(model=build_model(spec), config=config)

    def step(x, y, zero_grad):  # the engine clears gradients itself
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return _loss_value(loss)

    def states():
        if hasattr(engine, "memory_breakdown"):
            mb = engine.memory_breakdown()
            return {k: int(mb[k]) for k in ("params", "grads", "optimizer_states", "total") if k in mb}
        return None

    return train(spec, rank, step, states)


# -- DeepSpeed (run by /tmp/dsvenv/bin/python) ------------------------------------------------------
def _ds_rank(rank: int, world: int, spec: dict, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    start_hwm = vm_hwm_mib()
    try:
        import logging

        import deepspeed
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="gloo")
        config = {
            "train_micro_batch_size_per_gpu": spec["batch"], "gradient_accumulation_steps": 1,
            "gradient_clipping": CLIP, "steps_per_print": 10**9, "wall_clock_breakdown": False,
            "zero_optimization": {"stage": spec["stage"]}, "zero_allow_untested_optimizer": True,
        }
        if spec["precision"] == "bf16":
            config["bf16"] = {"enabled": True}
        model = build_model(spec)
        client_opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client_opt, config=config)

        def step(x, y, zero_grad):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return _loss_value(loss)

        inner = {}
        base = engine.optimizer
        while hasattr(base, "optimizer") and not type(base).__module__.startswith("torch.optim"):
            base = base.optimizer  # ZeRO wrapper -> the client torch AdamW stepping the fp32 partitions
        orig_step = base.step

        def snapshot_step(*args, **kwargs):  # grads of the partitions exist only around the step
            result = orig_step(*args, **kwargs)
            params = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
            grads = [p.grad for p in engine.module.parameters()]
            inner["states"] = model_state_bytes(params, grads, base)
            return result

        base.step = snapshot_step
        out = train(spec, rank, step, lambda: inner.get("states"))
        out["start_hwm_mib"] = start_hwm
    except Exception as exc:
        out = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300], "trace": traceback.format_exc()}
    queue.put((rank, out))
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_main(jobs: list[dict]) -> None:
    """Each job (a spec with stage, precision, world) on its own fresh ranks, forked from a server
    that has deepspeed imported already (its import costs many seconds per process); one
    ``RESULT <json>`` line per job, in order."""
    import torch.multiprocessing as mp

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "deepspeed", "_gpt_bench"])
    for spec in jobs:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        world = spec["world"]
        queue = ctx.SimpleQueue()
        procs = [ctx.Process(target=_ds_rank, args=(r, world, spec, queue)) for r in range(world)]
        for p in procs:
            p.start()
        results = {}
        for _ in range(world):
            rank, out = queue.get()
            results[rank] = out
        for p in procs:
            p.join()
        print("RESULT " + json.dumps({"stage": spec["stage"], "precision": spec["precision"],
                                      "ranks": [results[r] for r in range(world)]}), flush=True)


def summarize(per_rank: list[dict]) -> dict:
    """Median over steps of the slowest rank's step time; per-rank peaks and state bytes."""
    steps = [max(ts) for ts in zip(*(r["times"] for r in per_rank))]
    return {"median": statistics.median(steps), "steps": steps,
            "hwm": [r["hwm_mib"] for r in per_rank], "start_hwm": [r.get("start_hwm_mib") for r in per_rank],
            "states": [r.get("states") for r in per_rank], "losses": per_rank[0]["losses"],
            "threads": per_rank[0].get("threads")}


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "deepspeed":
        sys.exit("usage: python _gpt_bench.py deepspeed '<json list of specs>'")
    import _gpt_bench  # by name, so the forked ranks find _ds_rank (PYTHONPATH has this directory)

    _gpt_bench.deepspeed_main(json.loads(sys.argv[2]))
