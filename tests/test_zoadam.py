"""0/1 Adam (issue 21) against an independent replay of DeepSpeed 0.19.6's ``ZeroOneAdam``, on gloo ranks.

Each rank records the gradients its optimizer is handed; the ranks all-gather them and replay the
algorithm by hand for every rank at once (in the local phase each rank's parameters are its own):
the set-up step, variance updates on multiples of a doubling interval with the engine's all-reduce,
the 1-bit averaged gradient on the other steps, then local steps with the accumulated steps
averaged by the single-process simulation of the compressed all-reduce every (doubling, clipped)
local interval. The engine's parameters must equal the replay exactly, at every step.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.distributed.compressed import simulate_compressed_allreduce
from zerospeed.optim.factory import UNIMPLEMENTED
from zerospeed.optim.onebit import ZeroOneAdam, padded_length
from zerospeed.testing import run_distributed
from zerospeed.testing.configs import train_config
from zerospeed.testing.data import train_on_regression_batches
from zerospeed.testing.models import seeded_mlp
from zerospeed.testing.parity import as_numpy_tree

IN, HIDDEN, OUT, ROWS = 6, 10, 3, 4
LR, BETAS, EPS, WD = 0.01, (0.9, 0.999), 1e-8, 0.01
# every phase within 14 steps: variance interval 1 -> 2 -> 4, freeze after step 7, local interval 1 -> 2 -> 4
# (meetings at steps 8, 9, 10, 12; steps 11, 13, 14 local only)
SCHEDULE = {"var_freeze_step": 6, "var_update_scaler": 2, "local_step_scaler": 2, "local_step_clipper": 4}


def _config(accum: int, **top: Any) -> dict[str, Any]:
    optimizer = {"type": "ZeroOneAdam", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD,
                                                   "comm_backend_name": "compressed", "cuda_aware": False,
                                                   **SCHEDULE}}
    return train_config(micro=ROWS, accum=accum, optimizer=optimizer, zero={"stage": 0}, **top)


def _engine(accum: int = 1, **top: Any) -> tuple[Any, Any]:
    engine, opt, _, _ = zerospeed.initialize(model=seeded_mlp(IN, HIDDEN, OUT, seed=3), config=_config(accum, **top))
    return engine, opt


def _train(engine: Any, steps: int, accum: int = 1, start: int = 0) -> list[float]:
    return train_on_regression_batches(engine, steps, accum=accum, start=start, rows=ROWS, inputs=IN, outputs=OUT)


def _flat(tensors: list[torch.Tensor], padded: int) -> torch.Tensor:
    out = torch.zeros(padded)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    out[: flat.numel()] = flat
    return out


def _pieces(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in like:
        out.append(flat[offset: offset + t.numel()].view_as(t).clone())
        offset += t.numel()
    return out


def _replay(world: int, start: list[torch.Tensor], grads: list[list[list[torch.Tensor]]]) -> dict[str, Any]:
    """DeepSpeed's 0/1 Adam by hand for all ranks: ``grads[step][rank]`` is what each rank's optimizer
    saw. Returns every rank's parameters after every step, the all-reduce answer before every step and
    which steps communicated nothing."""
    V, kv, ks, kc = (SCHEDULE[k] for k in ("var_freeze_step", "var_update_scaler", "local_step_scaler",
                                           "local_step_clipper"))
    n = len(start)
    params = [[p.clone() for p in start] for _ in range(world)]
    m = [[torch.zeros_like(p) for p in start] for _ in range(world)]
    v = [[torch.zeros_like(p) for p in start] for _ in range(world)]
    acc = [[torch.zeros_like(p) for p in start] for _ in range(world)]
    lrs = [0.0] * world
    padded = padded_length(sum(p.numel() for p in start), world)

    def fresh_errors() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [torch.zeros(padded) for _ in range(world)], [torch.zeros(padded // world) for _ in range(world)]

    worker, server = fresh_errors()
    var_interval, var_counter, local_interval, local_counter = 1, 0, 1, 0
    frozen, allreduce = False, True
    out, flags, silent = [], [], []
    beta1, beta2 = BETAS
    for t, per_rank in enumerate(grads, start=1):
        flags.append(allreduce)
        talked = False
        if t > 1:
            if not frozen and t % var_interval == 0:
                for r in range(world):
                    for i in range(n):
                        g = per_rank[r][i]
                        v[r][i] = v[r][i].mul(beta2).addcmul(g, g, value=1 - beta2)
                        m[r][i] = m[r][i].mul(beta1).add(g, alpha=1 - beta1)
            elif not frozen and world > 1:
                sim = simulate_compressed_allreduce([_flat(per_rank[r], padded) for r in range(world)], worker, server)
                worker, server, talked = sim.worker_errors, sim.server_errors, True
                for r in range(world):
                    avg = _pieces(sim.results[r], start)
                    m[r] = [m[r][i].mul(beta1).add(avg[i], alpha=1 - beta1) for i in range(n)]
            elif frozen:
                for r in range(world):
                    m[r] = [m[r][i].mul(beta1).add(per_rank[r][i], alpha=1 - beta1) for i in range(n)]
                    lrs[r] += LR
            for r in range(world):
                for i in range(n):
                    update = m[r][i] / (v[r][i].sqrt() + EPS)
                    update += WD * params[r][i]
                    params[r][i] = params[r][i].add(-LR * update)
                    if frozen:
                        acc[r][i] = acc[r][i].add(-LR * update)
            if frozen and t % local_interval == 0:  # the ranks meet
                for r in range(world):
                    for i in range(n):
                        params[r][i] = params[r][i].add(-1 * acc[r][i])
                        acc[r][i] = acc[r][i].mul(v[r][i].sqrt() + EPS)
                if world > 1:
                    sim = simulate_compressed_allreduce([_flat(acc[r], padded) for r in range(world)], worker, server)
                    worker, server, talked = sim.worker_errors, sim.server_errors, True
                    acc = [_pieces(sim.results[r], start) for r in range(world)]
                for r in range(world):
                    for i in range(n):
                        m[r][i] = torch.zeros_like(m[r][i]).add(acc[r][i] / lrs[r], alpha=-1)
                        params[r][i] = params[r][i].add(acc[r][i] / (v[r][i].sqrt() + EPS))
                        acc[r][i] = torch.zeros_like(acc[r][i])
                    lrs[r] = 0.0
            if not frozen:
                if t % var_interval == 0:
                    var_counter += 1
                    if var_counter == kv:
                        var_counter, var_interval = 0, var_interval * 2
                allreduce = (t + 1) % var_interval == 0
            else:
                local_counter += 1
                if local_counter == ks:
                    local_counter, local_interval = 0, min(kc, local_interval * 2)
            if not frozen and t > V:
                frozen = True
                worker, server = fresh_errors()
            if frozen:
                allreduce = False
        silent.append(frozen and not talked and t > V + 1)
        out.append([[p.clone() for p in params[r]] for r in range(world)])
    return {"params": out, "flags": flags, "silent": silent}


def _parity_case(steps: int, accum: int) -> dict[str, Any]:
    engine, opt = _engine(accum)
    comm = engine.comm
    masters = [p for g in opt.param_groups for p in g["params"]]
    start = [p.detach().clone() for p in masters]
    seen: list[list[torch.Tensor]] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append([p.grad.detach().clone() for p in masters]))
    after, flags, calls, payload = [], [], [], []
    for step in range(steps):
        flags.append(opt.reduces_gradients())
        calls_before, bytes_before = Counter(comm.stats.calls), Counter(comm.stats.bytes)
        _train(engine, 1, accum, start=step)
        calls.append(dict(Counter(comm.stats.calls) - calls_before))
        payload.append(dict(Counter(comm.stats.bytes) - bytes_before))
        after.append([p.detach().clone() for p in masters])
    everyone = comm.all_gather_object(seen)  # [rank][step][param]
    grads = [[everyone[r][t] for r in range(comm.world_size)] for t in range(steps)]
    expected = _replay(comm.world_size, start, grads)
    mismatch = [(t, i) for t in range(steps) for i in range(len(masters))
                if not torch.equal(after[t][i], expected["params"][t][comm.rank][i])]
    same_grads = [all(torch.equal(a, b) for a, b in zip(grads[t][0], grads[t][-1])) for t in range(steps)]
    return {"mismatch": mismatch, "flags": flags, "expected_flags": expected["flags"], "same_grads": same_grads,
            "silent": expected["silent"], "calls": calls, "payload": payload, "frozen": opt.frozen,
            "differ": not torch.equal(*comm.all_gather_object(after[-1][0])[:2])}


@pytest.mark.spawns
@pytest.mark.parametrize("world,accum", [(2, 1), (4, 2)])
def test_zero_one_adam_follows_deepspeeds_algorithm_exactly(world: int, accum: int) -> None:
    steps = 14
    results = run_distributed(_parity_case, world, steps, accum)
    for rank, r in enumerate(results):
        assert r["mismatch"] == [], f"rank {rank}: (step, parameter) differing from the replay: {r['mismatch']}"
        assert r["frozen"]
        # the engine averaged exactly in the windows DeepSpeed's enable_backward_allreduce names:
        # the set-up step, the variance steps (2, 3, 4, 6 as the interval doubles; 8 would be one, but
        # the variance froze after step 7), never after the freeze
        assert r["flags"] == r["expected_flags"]
        assert r["flags"] == [True] * 4 + [False, True] + [False] * 8, r["flags"]
        assert r["same_grads"] == r["flags"]
        # local steps without a meeting (11, 13, 14 by the optimizer's count) send nothing but the
        # engine's one-element overflow flag
        assert [t + 1 for t, s in enumerate(r["silent"]) if s] == [11, 13, 14]
        for t, silent in enumerate(r["silent"]):
            if silent:
                assert r["calls"][t] == {"all_reduce": 1} and r["payload"][t] == {"all_reduce": 8}, (t, r["calls"][t])
            elif r["flags"][t]:  # the engine's gradient all-reduce
                assert r["payload"][t].get("all_reduce", 0) >= 4 * 103
    assert results[0]["differ"]  # the local steps leave each rank its own parameters


SAVE_AT = 11  # after optimizer step 11: in the local phase, mid local interval (the ranks last met at step 10)


def _uninterrupted(path: str, top: dict[str, Any]) -> dict[str, Any]:
    engine, opt = _engine(**top)
    _train(engine, SAVE_AT)
    engine.save_checkpoint(path, tag="t")
    tail = _train(engine, 4, start=SAVE_AT)
    return as_numpy_tree({"tail": tail, "params": list(engine.module.parameters()),
                   "lrs": [s["lrs"] for s in opt.state.values()]})


def _resumed(path: str, top: dict[str, Any]) -> dict[str, Any]:
    engine, opt = _engine(**top)
    engine.load_checkpoint(path, tag="t")
    loaded = {"frozen": opt.frozen, "initialized": opt.initialized, "reduces": opt.reduces_gradients(),
              "intervals": sorted({s["local_step_interval"] for s in opt.state.values()})}
    tail = _train(engine, 4, start=SAVE_AT)
    return as_numpy_tree({"tail": tail, "params": list(engine.module.parameters()), **loaded})


@pytest.mark.spawns
@pytest.mark.parametrize("top", [{}, {"bf16": {"enabled": True}}], ids=["fp32", "bf16"])
def test_resume_continues_the_local_phase_exactly_and_runs_at_another_world_size(top: dict[str, Any]) -> None:
    """Each rank's own parameters come back (with bf16, also into the bf16 model the next forward uses)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        first = run_distributed(_uninterrupted, 2, path, top)
        assert first[0]["lrs"][0] > 0  # saved with local steps not yet averaged
        again = run_distributed(_resumed, 2, path, top)
        for r in range(2):
            assert again[r]["frozen"] and again[r]["initialized"] and not again[r]["reduces"]
            assert again[r]["intervals"] == [4]
            assert again[r]["tail"] == first[r]["tail"]
            assert all((a == b).all() for a, b in zip(again[r]["params"], first[r]["params"]))
        if top:
            return
        grown = run_distributed(_resumed, 4, path, top)
    for g in grown:
        assert g["frozen"] and not g["reduces"] and g["intervals"] == [4]
        assert all(abs(loss) < 1e3 for loss in g["tail"])


def test_constructor_refusals() -> None:
    params = [nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="comm_backend_name: 'gloo'"):
        ZeroOneAdam(params, comm_backend_name="gloo")
    with pytest.raises(ValueError, match="amsgrad"):
        ZeroOneAdam(params, amsgrad=True)
    with pytest.raises(ValueError, match="var_update_scaler: 0"):
        ZeroOneAdam(params, var_update_scaler=0)
    with pytest.raises(ValueError, match="local_step_clipper: 0"):
        ZeroOneAdam(params, local_step_clipper=0)
    with pytest.raises(ValueError, match="var_freeze_step: -1"):
        ZeroOneAdam(params, var_freeze_step=-1)
    with pytest.raises(RuntimeError, match="no data-parallel group"):
        ZeroOneAdam(params).comm
    for backend in ("nccl", "mpi", "hccl", "compressed"):
        ZeroOneAdam(params, comm_backend_name=backend, cuda_aware=True)


def test_registered_and_at_deepspeeds_path() -> None:
    from zerospeed.config import load_config
    from zerospeed.config.specs import OptimizerSpec
    from zerospeed.optim.factory import build_optimizer
    from zerospeed.runtime.fp16.onebit.zoadam import ZeroOneAdam as at_path

    assert at_path is ZeroOneAdam and "ZeroOneAdam" not in UNIMPLEMENTED
    section = load_config(_config(1)).optimizer
    assert section is not None
    opt = build_optimizer(OptimizerSpec.from_config(section), [nn.Parameter(torch.zeros(3))])
    assert isinstance(opt, ZeroOneAdam) and opt.var_update_scaler == 2 and opt.reduces_gradients()


def test_rank_local_values_that_fit_no_parameter_are_refused_on_whole_tensors() -> None:
    """A checkpoint's per-rank parameters of other shapes (another model) are an error where the optimizer
    holds whole tensors; only ZeRO's pieces defer them to the hand-over (test_onebit_zero)."""
    p = nn.Parameter(torch.zeros(4))
    opt = ZeroOneAdam([p], var_freeze_step=1)
    opt.state[p].update(step=5, exp_avg=torch.zeros(4), exp_avg_sq=torch.ones(4), momentum_accumulator=torch.zeros(4),
                        var_interval=1, var_counter=0, local_step_interval=1, local_step_counter=0, lrs=0.0)
    saved = {"own": [{"group": 0, "index": 0, "param": torch.ones(3), "exp_avg": torch.ones(3),
                      "momentum_accumulator": torch.ones(3)}]}
    with pytest.raises(ValueError, match=r"parameter 0 of group 0 \(shape \(3,\)\)"):
        opt.load_rank_states(lambda rank: saved, 2, 0, 2)
    assert torch.equal(p.detach(), torch.zeros(4))
