"""1-bit LAMB (issue 21) against an independent replay of DeepSpeed 0.19.6's ``OnebitLamb``, on gloo ranks.

Each rank records the gradients its optimizer is handed; the ranks all-gather them and every rank
replays the algorithm by hand: the set-up step, warm-up LAMB (uncorrected, trust ratio clipped,
the coefficient average skipping ratios of exactly 1), then the scaled momenta of all tensors in
one padded buffer averaged by the single-process simulation of the compressed all-reduce (the
padding carrying the last result), the frozen coefficient scaled by the clipped, rate-limited
factor. The engine's parameters must equal the replay exactly, at every step.
"""

from __future__ import annotations

import math
import os
import tempfile
from typing import Any

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.distributed.compressed import simulate_compressed_allreduce
from zerospeed.optim.factory import UNIMPLEMENTED
from zerospeed.optim.onebit import OnebitLamb, padded_length
from zerospeed.testing import run_distributed
from zerospeed.testing.configs import train_config
from zerospeed.testing.data import train_on_regression_batches
from zerospeed.testing.models import seeded_mlp
from zerospeed.testing.parity import as_numpy_tree

IN, HIDDEN, OUT, ROWS = 6, 10, 3, 4  # 103 elements: padded to 112 on 2 ranks, 128 on 4
LR, BETAS, EPS, WD = 0.02, (0.9, 0.999), 1e-8, 0.01
MAX_COEFF, MIN_COEFF, COEFF_BETA = 10.0, 0.01, 0.8
FACTOR_MAX, FACTOR_MIN, FACTOR_THRESHOLD = 4.0, 0.5, 0.1
FREEZE = 4  # warm-up LAMB at steps 2-4, compressed from step 5


def _config(accum: int, **top: Any) -> dict[str, Any]:
    optimizer = {"type": "OneBitLamb", "params": {
        "lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD, "freeze_step": FREEZE,
        "max_coeff": MAX_COEFF, "min_coeff": MIN_COEFF, "coeff_beta": COEFF_BETA, "factor_max": FACTOR_MAX,
        "factor_min": FACTOR_MIN, "factor_threshold": FACTOR_THRESHOLD, "comm_backend_name": "nccl"}}
    return train_config(micro=ROWS, accum=accum, optimizer=optimizer, zero={"stage": 0}, **top)


def _engine(accum: int = 1) -> tuple[Any, Any]:
    engine, opt, _, _ = zerospeed.initialize(model=seeded_mlp(IN, HIDDEN, OUT, seed=5), config=_config(accum))
    return engine, opt


def _train(engine: Any, steps: int, accum: int = 1, start: int = 0) -> list[float]:
    return train_on_regression_batches(engine, steps, accum=accum, start=start, rows=ROWS, inputs=IN, outputs=OUT)


def _clip(value: float, low: float, high: float) -> float:
    return low if value < low else high if value > high else value


def _replay(world: int, rank: int, start: list[torch.Tensor], grads: list[list[list[torch.Tensor]]]) -> dict[str, Any]:
    """DeepSpeed's 1-bit LAMB by hand: ``grads[step][rank]`` is what each rank's optimizer saw. Returns
    the parameters and the coefficients after every step."""
    n = len(start)
    params = [p.clone() for p in start]
    m = [torch.zeros_like(p) for p in start]
    v = [torch.zeros_like(p) for p in start]
    fresh = [torch.zeros_like(p) for p in start]
    coeff_avg, last_factor = [0.0] * n, [1.0] * n
    scaling: list[float] | None = None
    numel = sum(p.numel() for p in start)
    padded = padded_length(numel, world)
    worker = [torch.zeros(padded) for _ in range(world)]
    server = [torch.zeros(padded // world) for _ in range(world)]
    tail = torch.zeros(padded - numel)
    beta1, beta2 = BETAS
    frozen = False
    out, coeffs = [], []
    for t, per_rank in enumerate(grads, start=1):
        step_coeffs = []
        if t > 1 and not frozen:
            g = per_rank[rank]
            for i in range(n):
                m[i] = m[i].mul(beta1).add(g[i], alpha=1 - beta1)
                v[i] = v[i].mul(beta2).addcmul(g[i], g[i], value=1 - beta2)
                if t == FREEZE:
                    fresh[i] = v[i].clone()
                weight_norm = params[i].pow(2).sum().sqrt()
                update = m[i] / (v[i].sqrt() + EPS)
                update += WD * params[i]
                update_norm = update.pow(2).sum().sqrt()
                c = 1.0
                if weight_norm != 0 and update_norm != 0:
                    c = _clip((weight_norm / update_norm).item(), MIN_COEFF, MAX_COEFF)
                if c != 1.0:
                    coeff_avg[i] = COEFF_BETA * coeff_avg[i] + (1 - COEFF_BETA) * c
                step_coeffs.append(c)
                params[i] = params[i].add(-LR * c * update)
            frozen = t >= FREEZE
        elif t > 1:
            if scaling is None:
                rms = [(torch.linalg.vector_norm(m[i]) / math.sqrt(m[i].numel())).item() for i in range(n)]
                scaling = [sum(rms) / n / s for s in rms]
            last = [x.clone() for x in m]
            buffers = []
            for r in range(world):
                local = torch.cat([(m[i].mul(beta1).add(per_rank[r][i], alpha=1 - beta1) * scaling[i]).reshape(-1)
                                   for i in range(n)])
                buffers.append(torch.cat([local, tail]))
            if world > 1:
                sim = simulate_compressed_allreduce(buffers, worker, server)
                worker, server = sim.worker_errors, sim.server_errors
                flat = sim.results[rank]
                tail = flat[numel:].clone()
            else:
                flat = buffers[0]
            offset = 0
            for i in range(n):
                m[i] = flat[offset: offset + m[i].numel()].view_as(m[i]).clone() / scaling[i]
                offset += m[i].numel()
                g = (m[i] - last[i] * beta1) / (1 - beta1)
                fresh[i] = fresh[i].mul(beta2).addcmul(g, g, value=1 - beta2)
                denom = v[i].sqrt() + EPS
                prelim = m[i] / denom
                update = prelim + WD * params[i]
                update_norm = update.pow(2).sum().sqrt()
                factor = (denom / (fresh[i].sqrt() + EPS)).max().item()
                ratio = min(1.0, (prelim.pow(2).sum().sqrt() / update_norm).item())
                factor = factor * ratio + (1.0 - ratio)
                factor = _clip(factor, FACTOR_MIN, FACTOR_MAX)
                factor = _clip(factor, last_factor[i] * (1 - FACTOR_THRESHOLD), last_factor[i] * (1 + FACTOR_THRESHOLD))
                last_factor[i] = factor
                c = coeff_avg[i] * factor
                step_coeffs.append(c)
                params[i] = params[i].add(-LR * c * update)
        out.append([p.clone() for p in params])
        coeffs.append(step_coeffs)
    return {"params": out, "coeffs": coeffs}


def _parity_case(steps: int, accum: int) -> dict[str, Any]:
    engine, opt = _engine(accum)
    comm = engine.comm
    masters = [p for g in opt.param_groups for p in g["params"]]
    start = [p.detach().clone() for p in masters]
    seen: list[list[torch.Tensor]] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append([p.grad.detach().clone() for p in masters]))
    after, flags, coeffs = [], [], []
    for step in range(steps):
        flags.append(opt.reduces_gradients())
        _train(engine, 1, accum, start=step)
        after.append([p.detach().clone() for p in masters])
        coeffs.append(opt.get_lamb_coeffs())
    everyone = comm.all_gather_object(seen)  # [rank][step][param]
    grads = [[everyone[r][t] for r in range(comm.world_size)] for t in range(steps)]
    expected = _replay(comm.world_size, comm.rank, start, grads)
    mismatch = [(t, i) for t in range(steps) for i in range(len(masters))
                if not torch.equal(after[t][i], expected["params"][t][i])]
    same_grads = [all(torch.equal(a, b) for a, b in zip(grads[t][0], grads[t][-1])) for t in range(steps)]
    return {"mismatch": mismatch, "flags": flags, "same_grads": same_grads, "coeffs": coeffs,
            "expected_coeffs": expected["coeffs"], "frozen": opt.frozen,
            "scaling": [opt.state[p]["scaling_coeff"] for p in masters]}


@pytest.mark.spawns
@pytest.mark.parametrize("world,accum", [(2, 1), (4, 2)])
def test_onebit_lamb_follows_deepspeeds_algorithm_exactly(world: int, accum: int) -> None:
    steps = 8
    results = run_distributed(_parity_case, world, steps, accum)
    for rank, r in enumerate(results):
        assert r["mismatch"] == [], f"rank {rank}: (step, parameter) differing from the replay: {r['mismatch']}"
        assert r["coeffs"] == r["expected_coeffs"]
        assert r["coeffs"][0] == [] and all(len(c) == 4 for c in r["coeffs"][1:])
        assert r["frozen"]
        # the engine averages through step freeze_step, then each rank keeps its own gradients
        assert r["flags"] == [True] * FREEZE + [False] * (steps - FREEZE)
        assert r["same_grads"] == r["flags"]
        assert all(isinstance(s, float) for s in r["scaling"])
    assert all(r["coeffs"] == results[0]["coeffs"] for r in results)  # the averaged momentum is the same everywhere


def _uninterrupted(path: str, save_at: int) -> dict[str, Any]:
    engine, opt = _engine()
    _train(engine, save_at)
    engine.save_checkpoint(path, tag="t")
    tail = _train(engine, 4, start=save_at)
    return as_numpy_tree({"tail": tail, "params": list(engine.module.parameters())})


def _resumed(path: str, save_at: int) -> dict[str, Any]:
    engine, opt = _engine()
    engine.load_checkpoint(path, tag="t")
    masters = [p for g in opt.param_groups for p in g["params"]]
    loaded = {"frozen": opt.frozen, "reduces": opt.reduces_gradients(),
              "scalars": [{k: v for k, v in opt.state[p].items() if not isinstance(v, torch.Tensor)} for p in masters]}
    tail = _train(engine, 4, start=save_at)
    return as_numpy_tree({"tail": tail, "params": list(engine.module.parameters()), **loaded})


@pytest.mark.spawns
@pytest.mark.parametrize("save_at", [3, 6])  # in warm-up (the coefficient average) and in compression
def test_resume_continues_exactly_and_runs_at_another_world_size(save_at: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        first = run_distributed(_uninterrupted, 2, path, save_at)
        again = run_distributed(_resumed, 2, path, save_at)
        for r in range(2):
            assert again[r]["frozen"] == (save_at >= FREEZE) and again[r]["reduces"] == (save_at < FREEZE)
            assert all(isinstance(s["lamb_coeff_freeze"], float) and s["lamb_coeff_freeze"] > 0
                       for s in again[r]["scalars"])
            assert all(("scaling_coeff" in s) == (save_at > FREEZE) for s in again[r]["scalars"])
            assert again[r]["tail"] == first[r]["tail"]
            assert all((a == b).all() for a, b in zip(again[r]["params"], first[r]["params"]))
        if save_at > FREEZE:
            grown = run_distributed(_resumed, 4, path, save_at)
            for g in grown:
                assert g["frozen"] and g["scalars"] == again[0]["scalars"]
                assert all(abs(loss) < 1e3 for loss in g["tail"])


def test_constructor_refusals_and_empty_parameters() -> None:
    params = [nn.Parameter(torch.ones(3))]
    with pytest.raises(ValueError, match="comm_backend_name: 'gloo'"):
        OnebitLamb(params, comm_backend_name="gloo")
    with pytest.raises(ValueError, match="amsgrad"):
        OnebitLamb(params, amsgrad=True)
    with pytest.raises(ValueError, match="freeze_step: 0"):
        OnebitLamb(params, freeze_step=0)
    with pytest.raises(ValueError, match="min_coeff, max_coeff: 2.0, 1.0"):
        OnebitLamb(params, min_coeff=2.0, max_coeff=1.0)
    with pytest.raises(ValueError, match="factor_min, factor_max: 0.0, 4.0"):
        OnebitLamb(params, factor_min=0.0)
    with pytest.raises(ValueError, match="coeff_beta: 1.0"):
        OnebitLamb(params, coeff_beta=1.0)
    with pytest.raises(ValueError, match="factor_threshold: -0.1"):
        OnebitLamb(params, factor_threshold=-0.1)
    with pytest.raises(RuntimeError, match="no data-parallel group"):
        OnebitLamb(params).comm
    empty = nn.Parameter(torch.zeros(0))
    opt = OnebitLamb([{"params": [params[0], empty]}, {"params": [empty], "lr": 0.5}], cuda_aware=True,
                     comm_backend_name="mpi")
    assert [len(g["params"]) for g in opt.param_groups] == [1]  # DeepSpeed's filter_empty_parameters


def test_registered_and_at_deepspeeds_path() -> None:
    from zerospeed.config import load_config
    from zerospeed.config.specs import OptimizerSpec
    from zerospeed.optim.factory import build_optimizer
    from zerospeed.runtime.fp16.onebit import OnebitAdam, ZeroOneAdam
    from zerospeed.runtime.fp16.onebit.lamb import OnebitLamb as at_path

    assert at_path is OnebitLamb and "OneBitLamb" not in UNIMPLEMENTED
    assert OnebitAdam.__module__ == "zerospeed.optim.onebit.adam" and ZeroOneAdam.__module__.endswith("zoadam")
    section = load_config(_config(1)).optimizer
    assert section is not None
    opt = build_optimizer(OptimizerSpec.from_config(section), [nn.Parameter(torch.ones(3))])
    assert isinstance(opt, OnebitLamb) and opt.coeff_beta == COEFF_BETA and opt.reduces_gradients()
