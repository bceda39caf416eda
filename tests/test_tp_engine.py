"""Tensor parallelism composed with ZeRO (issue 17): a GPT-like model at tp=2 and tp=4, and at
tp=2 x dp=2 with ZeRO stages 0-3, against the unsharded single-process model trained on the same data.

Each rank also trains the plain reference in-process (the model is tiny), so it compares its own
slices: losses every micro-batch, the global gradient norm every step (it counts every parameter
exactly once across tensor and data parallelism, or clipping would differ), the last step's gradients
and the parameters after 5 steps (AdamW, clipping, accumulation 2).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import zerospeed
from zerospeed.distributed.mesh import ParallelDims
from zerospeed.tensor_parallel import tp_layout
from zerospeed.testing import run_distributed
from zerospeed.testing.configs import adamw, train_config, zero_section
from zerospeed.testing.tp_models import GPTConfig, TinyGPT, token_batch
from zerospeed.utils import safe_get_full_fp32_param, safe_get_full_grad

pytestmark = pytest.mark.spawns

CFG = GPTConfig()
STEPS, ACCUM, MICRO, CLIP, LR = 5, 2, 2, 0.5, 1e-2


def _rows(dp_rank: int, micro_step: int) -> slice:
    start = (dp_rank * ACCUM + micro_step) * MICRO
    return slice(start, start + MICRO)


def _reference(dp: int) -> dict[str, Any]:
    """The unsharded model, one process, the same global batches."""
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses: dict[int, list[float]] = {r: [] for r in range(dp)}
    norms, last_grads = [], {}
    for step in range(STEPS):
        ids, targets = token_batch(step, MICRO * ACCUM * dp, CFG)
        for m in range(ACCUM):
            for r in range(dp):
                loss = model(ids[_rows(r, m)], targets[_rows(r, m)])
                losses[r].append(loss.item())
                (loss / (ACCUM * dp)).backward()
        if step == STEPS - 1:
            last_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms, "grads": last_grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _mine(full: torch.Tensor, name: str, layout: Any) -> torch.Tensor:
    split = layout.splits.get(name)
    return full if split is None else full.chunk(split.degree, split.dim)[split.rank]


def _train_case(mesh: Any, *, stage: int, precision: str = "fp32", sequence_parallel: bool = False) -> dict[str, Any]:
    dp_rank, dp = mesh.dp.rank, mesh.dp.world_size
    torch.manual_seed(0)
    model = TinyGPT(CFG, tp_group=mesh, sequence_parallel=sequence_parallel)
    extra = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    config = train_config(micro=MICRO, accum=ACCUM, clip=CLIP, optimizer=adamw(LR),
                          zero=zero_section(stage, reduce_bucket_size=3000, persistence_threshold=0), **extra)
    engine, *_ = zerospeed.initialize(model=model, config=config, mpu=mesh)
    layout = tp_layout(model)
    losses, norms, grads = [], [], {}
    for step in range(STEPS):
        ids, targets = token_batch(step, MICRO * ACCUM * dp, CFG)
        for m in range(ACCUM):
            loss = engine(ids[_rows(dp_rank, m)], targets[_rows(dp_rank, m)])
            engine.backward(loss)
            if step == STEPS - 1 and m == ACCUM - 1:
                grads = {n: safe_get_full_grad(p) for n, p in model.named_parameters()}
            engine.step()
            losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    params = {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
    ref = _reference(dp)
    out: dict[str, Any] = {"losses": losses, "ref_losses": ref["losses"][dp_rank], "norms": norms,
                           "ref_norms": ref["norms"], "grad_err": 0.0, "param_err": 0.0}
    for name, value in params.items():
        err = (value - _mine(ref["params"][name], name, layout)).abs().max().item()
        out.setdefault("per_name", {})[name] = err
        out["param_err"] = max(out["param_err"], err)
        out["grad_err"] = max(out["grad_err"], (grads[name] - _mine(ref["grads"][name], name, layout)).abs().max().item())
    engine.destroy()
    return out


def _run(tp: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import torch.distributed as dist

    mesh = ParallelDims(world_size=dist.get_world_size(), tp=tp).build()
    return [_train_case(mesh, **case) for case in cases]


def _check(result: dict[str, Any], *, tol: float = 1e-5) -> None:
    assert result["losses"] == pytest.approx(result["ref_losses"], abs=tol)
    assert result["norms"] == pytest.approx(result["ref_norms"], abs=tol)
    assert result["grad_err"] < tol
    assert result["param_err"] < tol


DP_CASES = [dict(stage=s) for s in (0, 1, 2, 3)] + [dict(stage=1, sequence_parallel=True),
                                                     dict(stage=3, sequence_parallel=True)]


@pytest.fixture(scope="module")
def tp2_dp2() -> list[dict[str, Any]]:
    return run_distributed(_run, 4, 2, DP_CASES + [dict(stage=2, precision="bf16")], timeout=600)


@pytest.mark.parametrize("case", range(len(DP_CASES)),
                         ids=[f"stage{c['stage']}{'-sp' if c.get('sequence_parallel') else ''}" for c in DP_CASES])
def test_tp2_dp2_matches_unsharded(tp2_dp2: list[dict[str, Any]], case: int) -> None:
    for rank_results in tp2_dp2:
        _check(rank_results[case])


def test_tp2_dp2_bf16_within_two_percent(tp2_dp2: list[dict[str, Any]]) -> None:
    for rank_results in tp2_dp2:
        result = rank_results[-1]
        assert result["losses"] == pytest.approx(result["ref_losses"], rel=0.02)


@pytest.mark.parametrize("tp", [2, 4])
def test_pure_tensor_parallel_matches_unsharded(tp: int) -> None:
    for rank_results in run_distributed(_run, tp, tp, [dict(stage=0), dict(stage=1, sequence_parallel=True)],
                                        timeout=300):
        for result in rank_results:
            _check(result)
