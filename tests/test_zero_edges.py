"""ZeRO edge cases found in review: nanoGPT-style containers, a second initialize, misuse at stage 1."""

from __future__ import annotations

import torch
from torch import nn

import zerospeed
from zerospeed.testing import run_distributed


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class NanoGPTish(nn.Module):
    """Parameters under a ModuleDict whose own forward never runs (nanoGPT's layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(11, 8), h=nn.ModuleList(Block() for _ in range(2)),
                                              ln_f=nn.LayerNorm(8)))
        self.lm_head = nn.Linear(8, 11, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class ReadsAChildsWeight(NanoGPTish):
    """The root's forward reads a block's weight directly: it must be declared external."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        hidden = self.transformer.ln_f(self.transformer.wte(idx))
        hidden = hidden + nn.functional.linear(hidden, self.transformer.h[1].fc.weight)
        return self.lm_head(hidden)


def _config(stage: int, accum: int = 1) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accum, "steps_per_print": 1000,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def _loss(engine: zerospeed.Engine, step: int) -> torch.Tensor:
    idx = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(10 * step + engine.comm.rank))
    return nn.functional.cross_entropy(engine(idx).reshape(-1, 11), idx.roll(1, 1).reshape(-1))


def _params(engine: zerospeed.Engine) -> list[list[float]]:
    with zerospeed.zero.GatheredParameters(list(engine.module.parameters())):
        return [p.detach().reshape(-1).tolist() for p in engine.module.parameters()]


def _trained(model: nn.Module, stage: int, steps: int = 3) -> list[list[float]]:
    engine, *_ = zerospeed.initialize(model=model, config=_config(stage))
    for step in range(steps):
        engine.backward(_loss(engine, step))
        engine.step()
    return _params(engine)


def _edges() -> dict:
    out: dict = {}
    for stage in (0, 3):  # each trains at stage 3 exactly as at stage 0
        torch.manual_seed(0)
        out[f"nanogpt_{stage}"] = _trained(NanoGPTish(), stage)  # a container that is never called
        torch.manual_seed(0)
        model = ReadsAChildsWeight()
        zerospeed.zero.register_external_parameter(model, model.transformer.h[1].fc.weight)
        out[f"external_{stage}"] = _trained(model, stage)
    # initialize twice on one model: the second engine trains it, the first lets go
    for stage in (1, 3):
        torch.manual_seed(0)
        model = NanoGPTish()
        first, *_ = zerospeed.initialize(model=model, config=_config(stage))
        first.backward(_loss(first, 0))
        first.step()
        before = _params(first)
        second, *_ = zerospeed.initialize(model=model, config=_config(stage))
        out[f"reinit_same_start_{stage}"] = _params(second) == before
        second.backward(_loss(second, 1))
        second.step()
        out[f"reinit_trains_{stage}"] = _params(second) != before
    # stage 1: a second backward on the boundary micro-batch is refused (its reduction already ran)
    engine, *_ = zerospeed.initialize(model=NanoGPTish(), config=_config(1))
    engine.backward(_loss(engine, 0))
    try:
        engine.backward(_loss(engine, 1))
        out["double_backward"] = "no error"
    except RuntimeError as exc:
        out["double_backward"] = str(exc)
    # stage 1: a window whose last backward ran inside no_sync() is still averaged at the step
    results = []
    for stage in (0, 1):
        torch.manual_seed(0)
        engine, *_ = zerospeed.initialize(model=NanoGPTish(), config=_config(stage, accum=2))
        for micro in range(2):
            with engine.no_sync():
                engine.backward(_loss(engine, micro))
            engine.step()
        results.append(_params(engine))
    out["no_sync_boundary_equal"] = results[0] == results[1] or max(
        abs(a - b) for x, y in zip(*results, strict=True) for a, b in zip(x, y, strict=True)) < 1e-6
    return out


def test_zero_edge_cases() -> None:
    for rank, out in enumerate(run_distributed(_edges, 2, timeout=180)):
        for case in ("nanogpt", "external"):
            diff = max(abs(a - b) for x, y in zip(out[f"{case}_0"], out[f"{case}_3"], strict=True)
                       for a, b in zip(x, y, strict=True))
            assert diff < 1e-6, (rank, case, diff)
        for stage in (1, 3):
            assert out[f"reinit_same_start_{stage}"] and out[f"reinit_trains_{stage}"], (rank, stage)
        assert "second engine.backward()" in out["double_backward"], out["double_backward"]
        assert out["no_sync_boundary_equal"], rank
