"""Tensor parallelism composed with ZeRO (issue 17): a GPT-like model at tp=2 and tp=4, and at
tp=2 x dp=2 with ZeRO stages 0-3, against the unsharded single-process model trained on the same data.

Each rank also trains the plain reference in-process (the model is tiny), so it compares its own
slices: losses every micro-batch, the global gradient norm every step (it counts every parameter
exactly once across tensor and data parallelism, or clipping would differ), the last step's gradients
and the parameters after 5 steps (AdamW, clipping, accumulation 2).
"""

from __future__ import annotations

import shutil
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


def _train_case(mesh: Any, *, stage: int, precision: str = "fp32", sequence_parallel: bool = False,
                offload: str | None = None) -> dict[str, Any]:
    dp_rank, dp = mesh.dp.rank, mesh.dp.world_size
    torch.manual_seed(0)
    model = TinyGPT(CFG, tp_group=mesh, sequence_parallel=sequence_parallel)
    extra = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    zero_extra: dict[str, Any] = {}
    nvme = _nvme_dir() if offload == "nvme" else None
    if offload is not None:  # the optimizer offloaded to CPU memory, or to NVMe (its shards in swap files)
        zero_extra["offload_optimizer"] = {"device": offload, **({"nvme_path": nvme} if nvme else {})}
    config = train_config(micro=MICRO, accum=ACCUM, clip=CLIP, optimizer=adamw(LR),
                          zero=zero_section(stage, reduce_bucket_size=3000, persistence_threshold=0, **zero_extra),
                          **extra)
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
    if nvme is not None:
        shutil.rmtree(nvme, ignore_errors=True)
    return out


def _nvme_dir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="zerospeed-tp-nvme-")


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
                                                     dict(stage=3, sequence_parallel=True),
                                                     dict(stage=2, offload="cpu"), dict(stage=2, offload="nvme")]


@pytest.fixture(scope="module")
def tp2_dp2() -> list[dict[str, Any]]:
    return run_distributed(_run, 4, 2, DP_CASES + [dict(stage=2, precision="bf16")], timeout=600)


@pytest.mark.parametrize("case", range(len(DP_CASES)),
                         ids=[f"stage{c['stage']}{'-sp' if c.get('sequence_parallel') else ''}"
                              f"{'-' + str(c['offload']) if c.get('offload') else ''}" for c in DP_CASES])
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


# -- Megatron's mpu, the data loader, overflow -------------------------------------------------------
class MegatronMPU:
    """What Megatron-LM hands DeepSpeed: process groups and their sizes and ranks."""

    def __init__(self, dp_group: Any, tp_group: Any):
        import torch.distributed as dist

        self._dist, self.dp, self.tp = dist, dp_group, tp_group

    def get_data_parallel_group(self) -> Any:
        return self.dp

    def get_model_parallel_group(self) -> Any:
        return self.tp

    def get_data_parallel_world_size(self) -> int:
        return self._dist.get_world_size(self.dp)

    def get_model_parallel_world_size(self) -> int:
        return self._dist.get_world_size(self.tp)

    def get_data_parallel_rank(self) -> int:
        return self._dist.get_rank(self.dp)

    def get_model_parallel_rank(self) -> int:
        return self._dist.get_rank(self.tp)


class Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def _megatron_and_loader() -> dict[str, Any]:
    import torch.distributed as dist

    world = dist.get_world_size()
    mesh = ParallelDims(world_size=world, tp=2).build()
    out: dict[str, Any] = {}
    # Megatron's mpu, whose groups the model's layers were built with (torch ProcessGroups)
    mpu = MegatronMPU(mesh.get_data_parallel_group(), mesh.get_tensor_model_parallel_group())
    torch.manual_seed(0)
    model = TinyGPT(CFG, tp_group=mpu.get_model_parallel_group())
    config = train_config(micro=MICRO, accum=1, optimizer=adamw(LR), zero=zero_section(1, reduce_bucket_size=3000,
                                                                                     persistence_threshold=0))
    engine, _, loader, _ = zerospeed.initialize(model=model, config=config, mpu=mpu, training_data=Rows())
    out["dp_world"] = engine.mesh.dp.world_size
    out["tp_ranks"] = engine.mesh.ranks("tp")
    ids, targets = token_batch(0, MICRO * ACCUM * 2, CFG)
    rows = _rows(engine.mesh.dp.rank, 0)
    out["loss"] = engine(ids[rows], targets[rows]).item()
    torch.manual_seed(0)
    out["ref_loss"] = TinyGPT(CFG)(ids[rows], targets[rows]).item()
    # the loader: tensor-parallel peers read the same rows, data-parallel peers different ones
    assert loader is not None
    out["first_batch"] = next(iter(loader)).reshape(-1).tolist()
    engine.destroy()
    # an mpu laid out otherwise than zerospeed's mesh is refused, naming both layouts
    odd = [dist.new_group([0, 2]), dist.new_group([1, 3])][dist.get_rank() % 2]
    dp_odd = [dist.new_group([0, 1]), dist.new_group([2, 3])][dist.get_rank() // 2]
    try:
        zerospeed.initialize(model=TinyGPT(CFG), config=config, mpu=MegatronMPU(dp_odd, odd))
    except ValueError as exc:
        out["layout_error"] = str(exc)
    return out


def test_megatron_mpu_and_the_data_loader() -> None:
    results = run_distributed(_megatron_and_loader, 4, timeout=300)
    for rank, r in enumerate(results):
        assert r["dp_world"] == 2 and r["tp_ranks"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert r["loss"] == pytest.approx(r["ref_loss"], abs=1e-5)
        assert "the mpu's tp group holds ranks" in r["layout_error"] and "build the mpu with that order" in r["layout_error"]
    batches = [r["first_batch"] for r in results]
    assert batches[0] == batches[1] and batches[2] == batches[3]  # tensor-parallel peers
    assert batches[0] != batches[2]  # data-parallel peers


def _overflow_on_one_rank() -> dict[str, Any]:
    import torch.distributed as dist

    mesh = ParallelDims(world_size=dist.get_world_size(), tp=2).build()
    torch.manual_seed(0)
    model = TinyGPT(CFG, tp_group=mesh)
    config = train_config(micro=MICRO, accum=1, optimizer=adamw(LR),
                          zero=zero_section(1, reduce_bucket_size=3000, persistence_threshold=0),
                          fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1})
    engine, *_ = zerospeed.initialize(model=model, config=config, mpu=mesh)
    poison = dist.get_rank() == 3  # one rank: tensor-parallel rank 1 of the second replica
    target = model.blocks[0].mlp.fc1.weight
    target.register_hook(lambda g: g * float("inf") if poison else g)
    before = safe_get_full_fp32_param(target)
    ids, targets = token_batch(0, MICRO * ACCUM * 2, CFG)
    rows = _rows(mesh.dp.rank, 0)
    engine.backward(engine(ids[rows], targets[rows]))
    engine.step()
    return {"skipped": engine.skipped_steps, "scale": engine.cur_scale, "applied": engine.was_step_applied(),
            "unchanged": torch.equal(before, safe_get_full_fp32_param(target))}


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere() -> None:
    for r in run_distributed(_overflow_on_one_rank, 4, timeout=300):
        assert r == {"skipped": 1, "scale": 128.0, "applied": False, "unchanged": True}
