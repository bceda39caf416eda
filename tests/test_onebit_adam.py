"""1-bit Adam (issue 21) against an independent reference of DeepSpeed's algorithm, on real gloo ranks.

Each rank records the gradients its optimizer is handed (``register_step_pre_hook``); the ranks
all-gather them, and every rank replays the algorithm by hand: the set-up step, Adam without bias
correction (eps outside the square root) while warming up, then the local momenta averaged by the
single-process simulation of the compressed all-reduce with the variance frozen. The engine's
parameters must equal the replay exactly, at every step.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.distributed.compressed import simulate_compressed_allreduce
from zerospeed.optim.onebit import OnebitAdam, padded_length
from zerospeed.testing import run_distributed
from zerospeed.testing.configs import train_config
from zerospeed.testing.data import seeded_regression_batch, train_on_regression_batches
from zerospeed.testing.models import seeded_mlp
from zerospeed.testing.parity import as_numpy_tree

pytestmark = pytest.mark.spawns

IN, HIDDEN, OUT, ROWS = 6, 10, 3, 4
LR, BETAS, EPS, WD = 0.01, (0.9, 0.999), 1e-8, 0.01


def _onebit(freeze_step: int, **extra: Any) -> dict[str, Any]:
    return {"type": "OneBitAdam", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD,
                                             "freeze_step": freeze_step, "comm_backend_name": "nccl", **extra}}


def _engine(freeze_step: int, accum: int = 1, hidden: int = HIDDEN, **top: Any) -> tuple[Any, torch.optim.Optimizer]:
    model = seeded_mlp(IN, hidden, OUT, seed=3)
    config = train_config(micro=ROWS, accum=accum, optimizer=_onebit(freeze_step), zero={"stage": 0}, **top)
    engine, opt, _, _ = zerospeed.initialize(model=model, config=config)
    return engine, opt


def _train(engine: Any, steps: int, accum: int, start: int = 0) -> list[float]:
    return train_on_regression_batches(engine, steps, accum=accum, start=start, rows=ROWS, inputs=IN, outputs=OUT)


def _replay(world: int, rank: int, start: list[torch.Tensor], grads: list[list[list[torch.Tensor]]],
            freeze_step: int) -> list[list[torch.Tensor]]:
    """DeepSpeed's 1-bit Adam by hand: ``grads[step][rank]`` is what each rank's optimizer saw; returns
    the parameters after every step."""
    params = [p.clone() for p in start]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    numel = sum(p.numel() for p in params)
    padded = padded_length(numel, world)
    worker = [torch.zeros(padded) for _ in range(world)]
    server = [torch.zeros(padded // world) for _ in range(world)]
    beta1, beta2 = BETAS
    out = []
    for t, per_rank in enumerate(grads, start=1):
        if t == 1:  # the set-up step: nothing moves
            out.append([p.clone() for p in params])
            continue
        if t <= freeze_step:  # warm-up: the gradients were averaged, plain uncorrected Adam
            g = per_rank[rank]
            for i in range(len(params)):
                m[i].mul_(beta1).add_(g[i], alpha=1 - beta1)
                v[i].mul_(beta2).addcmul_(g[i], g[i], value=1 - beta2)
        else:  # each rank's own momentum, averaged through the compressed exchange
            buffers = []
            for r in range(world):
                local = torch.zeros(padded)
                local[:numel] = torch.cat([m[i].clone().mul_(beta1).add_(per_rank[r][i], alpha=1 - beta1).reshape(-1)
                                           for i in range(len(params))])
                buffers.append(local)
            sim = simulate_compressed_allreduce(buffers, worker, server) if world > 1 else None
            if sim is not None:
                worker, server = sim.worker_errors, sim.server_errors
                flat = sim.results[rank][:numel]
            else:
                flat = buffers[0][:numel]
            offset = 0
            for i in range(len(params)):
                m[i] = flat[offset: offset + params[i].numel()].view_as(params[i]).clone()
                offset += params[i].numel()
        for i in range(len(params)):
            update = m[i] / (v[i].sqrt() + EPS)
            update += WD * params[i]
            params[i].add_(-LR * update)
        out.append([p.clone() for p in params])
    return out


def _parity_case(freeze_step: int, steps: int, accum: int) -> dict[str, Any]:
    engine, opt = _engine(freeze_step, accum)
    masters = [p for g in opt.param_groups for p in g["params"]]
    start = [p.detach().clone() for p in masters]
    seen: list[list[torch.Tensor]] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append([p.grad.detach().clone() for p in masters]))
    after: list[list[torch.Tensor]] = []
    reduced_flags = []
    for step in range(steps):
        reduced_flags.append(opt.reduces_gradients())
        _train(engine, 1, accum, start=step)
        after.append([p.detach().clone() for p in masters])
    comm = engine.comm
    everyone = comm.all_gather_object(seen)  # [rank][step][param]
    grads = [[everyone[r][t] for r in range(comm.world_size)] for t in range(steps)]
    expected = _replay(comm.world_size, comm.rank, start, grads, freeze_step)
    mismatch = [(t, i) for t in range(steps) for i in range(len(masters))
                if not torch.equal(after[t][i], expected[t][i])]
    same_grads = [all(torch.equal(a, b) for a, b in zip(grads[t][0], grads[t][-1])) for t in range(steps)]
    return {"mismatch": mismatch, "reduced": reduced_flags, "same_grads": same_grads,
            "moved": [not torch.equal(after[t][0], start[0]) for t in range(steps)]}


@pytest.mark.parametrize("world,accum", [(2, 1), (4, 2)])
def test_onebit_adam_follows_deepspeeds_algorithm_exactly(world: int, accum: int) -> None:
    freeze, steps = 3, 7
    results = run_distributed(_parity_case, world, freeze, steps, accum)
    for rank, r in enumerate(results):
        assert r["mismatch"] == [], f"rank {rank}: (step, parameter) differing from the replay: {r['mismatch']}"
        # the set-up step moves nothing; every later step does
        assert r["moved"] == [False] + [True] * (steps - 1)
        # the engine averages through step freeze_step, then each rank keeps its own gradients
        assert r["reduced"] == [True] * freeze + [False] * (steps - freeze)
        assert r["same_grads"] == [True] * freeze + [False] * (steps - freeze)


def _bytes_case(freeze_step: int) -> dict[str, Any]:
    engine, opt = _engine(freeze_step, hidden=2048)
    out: dict[str, Any] = {"numel": sum(p.numel() for p in engine.module.parameters()), "steps": []}
    for step in range(freeze_step + 2):
        _train(engine, 1, 1, start=step)
        out["steps"].append(engine.comm_bytes()["step"])
    return out


def test_compressed_steps_send_a_twentieth_of_the_all_reduce() -> None:
    """Bytes sent per step (``engine.comm_bytes()``), 2 ranks: the warm-up's fp32 all-reduce (a ring sends
    2(W-1)/W of the buffer), then after the freeze the packed signs with their scales and one overflow flag."""
    r = run_distributed(_bytes_case, 2, 2)[0]
    numel, steps = r["numel"], r["steps"]
    dense = numel * 4  # 2 (W - 1) / W = 1 at W = 2
    padded = padded_length(numel, 2)
    assert steps[0]["dp.all_reduce"] == dense  # (the first window also agrees on the bucket order)
    assert steps[1] == {"dp.all_reduce": dense}
    # phase 1: the other rank's half of the signs + its scale; phase 2: this rank's chunk of signs + scale
    compressed = {"dp.all_to_all": padded // 8 // 2 + 4, "dp.all_gather": padded // 8 // 2 + 4,
                  "dp.all_reduce": 8}  # the overflow flag (float64)
    for late in steps[3:]:
        assert late == compressed
        assert sum(late.values()) <= dense / 20

def _resume_case(path: str, world_before: int) -> dict[str, Any]:
    engine, opt = _engine(2)
    rank = engine.comm.rank
    if engine.comm.world_size == world_before:
        _train(engine, 4, 1)
        engine.save_checkpoint(path, tag="t")
        tail = _train(engine, 3, 1, start=4)
        return as_numpy_tree({"tail": tail, "params": list(engine.module.parameters()), "state": opt.rank_state()})
    engine.load_checkpoint(path, tag="t")
    state = opt.rank_state()
    tail = _train(engine, 3, 1, start=4)
    return as_numpy_tree({"tail": tail, "params": list(engine.module.parameters()), "frozen": opt.frozen,
                   "loaded_state": state, "rank": rank})


def test_resume_restores_error_buffers_exactly_and_reshapes_them_at_another_world_size() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        first = run_distributed(_resume_case, 2, path, 2)
        # same world size: a fresh engine loads and continues exactly like the uninterrupted run
        again = run_distributed(_load_and_continue, 2, path)
        for r in range(2):
            assert again[r]["tail"] == first[r]["tail"]
            assert all((a == b).all() for a, b in zip(again[r]["params"], first[r]["params"]))
        # another world size: worker errors become the mean, server chunks are re-cut
        saved = [torch.load(os.path.join(path, "t", f"rank{r:05d}.state.pt"), weights_only=True)["optimizer"]
                 for r in range(2)]
        grown = run_distributed(_resume_case, 4, path, 2)
    numel = saved[0]["groups"][0]["numel"]
    mean = (saved[0]["groups"][0]["worker_error"][:numel] + saved[1]["groups"][0]["worker_error"][:numel]) / 2
    servers = torch.cat([saved[0]["groups"][0]["server_error"], saved[1]["groups"][0]["server_error"]])[:numel]
    rebuilt = torch.cat([torch.from_numpy(g["loaded_state"]["groups"][0]["server_error"]) for g in grown])[:numel]
    for g in grown:
        assert g["frozen"]
        loaded = torch.from_numpy(g["loaded_state"]["groups"][0]["worker_error"][:numel])
        assert torch.allclose(loaded, mean, atol=0, rtol=1e-6)
    assert torch.equal(rebuilt, servers)


def _load_and_continue(path: str) -> dict[str, Any]:
    engine, opt = _engine(2)
    engine.load_checkpoint(path, tag="t")
    assert opt.frozen and opt.initialized
    tail = _train(engine, 3, 1, start=4)
    return as_numpy_tree({"tail": tail, "params": list(engine.module.parameters())})


def test_constructor_refusals() -> None:
    params = [nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="comm_backend_name: 'tcp'"):
        OnebitAdam(params, comm_backend_name="tcp")
    with pytest.raises(ValueError, match="amsgrad"):
        OnebitAdam(params, amsgrad=True)
    with pytest.raises(ValueError, match="freeze_step: 0"):
        OnebitAdam(params, freeze_step=0)
    with pytest.raises(RuntimeError, match="no data-parallel group"):
        OnebitAdam(params).comm


def _overflow_case() -> dict[str, Any]:
    engine, opt = _engine(2, fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1}, gradient_clipping=0.5)
    rank = engine.comm.rank
    out: dict[str, Any] = {"skipped": [], "moved": [], "scale": []}
    for step in range(6):
        before = [p.detach().clone() for p in engine.module.parameters()]
        x, y = seeded_regression_batch(step, rank, rows=ROWS, inputs=IN, outputs=OUT)
        loss = nn.functional.mse_loss(engine(x).float(), y)
        if step == 4 and rank == 1:  # only one rank overflows, in the compressed phase
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        out["skipped"].append(engine.skipped_steps)
        out["moved"].append(any(not torch.equal(a, b) for a, b in zip(before, engine.module.parameters())))
        out["scale"].append(engine.cur_scale)
    return out


def test_an_overflow_on_one_rank_in_the_compressed_phase_skips_the_step_everywhere() -> None:
    results = run_distributed(_overflow_case, 2)
    assert results[0] == results[1]
    r = results[0]
    assert r["skipped"] == [0, 0, 0, 0, 1, 1]
    assert r["moved"] == [False, True, True, True, False, True]  # the set-up step and the skipped one
    assert r["scale"][4] == r["scale"][3] / 2


def _memory_case() -> dict[str, int]:
    engine, opt = _engine(2)
    numel = sum(p.numel() for p in engine.module.parameters())
    _train(engine, 2, 1)
    before = engine.memory_breakdown()["optimizer_states"]
    _train(engine, 2, 1, start=2)  # the compressed phase: error buffers, workspace, frozen denominators
    return {"numel": numel, "before": before, "after": engine.memory_breakdown()["optimizer_states"]}


def test_memory_breakdown_counts_the_compression_buffers() -> None:
    r = run_distributed(_memory_case, 2)[0]
    padded = padded_length(r["numel"], 2)
    # worker error + server error (a chunk) + padding carry + the padded workspace + sqrt(v) + eps per element
    side = 4 * (padded + padded // 2 + (padded - r["numel"]) + padded + r["numel"])
    assert r["after"] - r["before"] == side, (r, side)
