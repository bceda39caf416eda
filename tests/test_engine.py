"""Engine parity (fp32) against a single-process plain PyTorch reference on the same global batches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.testing import run_distributed

MICRO = 2
STEPS = 5


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 11)
        self.b = nn.Linear(11, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _config(world: int, accum: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": accum, "gradient_clipping": 1.0,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05,
                                                      "warmup_num_steps": 3, "warmup_type": "linear"}},
        "zero_optimization": {"stage": 0, "reduce_bucket_size": 50},
    }


def _data(world: int, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    n = STEPS * world * accum * MICRO
    return torch.randn(n, 6, generator=gen) * 3, torch.randn(n, 3, generator=gen)


def _reference(world: int, accum: int) -> list[torch.Tensor]:
    from zerospeed.optim.schedules import WarmupLR

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.05, warmup_num_steps=3, warmup_type="linear")
    x, y = _data(world, accum)
    per_step = world * accum * MICRO
    for step in range(STEPS):
        for r in range(world):
            for m in range(accum):
                start = step * per_step + (r * accum + m) * MICRO
                rows = slice(start, start + MICRO)
                (nn.functional.mse_loss(model(x[rows]), y[rows]) / accum / world).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
    return [p.detach() for p in model.parameters()]


def _train(accum: int) -> list[torch.Tensor]:
    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    torch.manual_seed(rank)  # different init per rank: initialize must broadcast rank 0's weights
    model = Net()
    if rank == 0:
        torch.manual_seed(0)
        model = Net()
    engine, opt, _, sched = zerospeed.initialize(
        model=model, config=_config(world, accum),
        optimizer=lambda params: torch.optim.AdamW(params, lr=0.05, weight_decay=0.01))
    x, y = _data(world, accum)
    per_step = world * accum * MICRO
    for step in range(STEPS):
        for m in range(accum):
            start = step * per_step + (rank * accum + m) * MICRO
            rows = slice(start, start + MICRO)
            loss = nn.functional.mse_loss(engine(x[rows]), y[rows])
            engine.backward(loss)
            engine.step()
            assert engine.was_step_applied() == (m == accum - 1)
    assert engine.global_steps == STEPS and engine.skipped_steps == 0
    assert engine.get_lr() == sched.get_last_lr()
    reference = _reference(world, accum)
    for got, expected in zip(engine.module.parameters(), reference):
        torch.testing.assert_close(got.detach(), expected, rtol=0, atol=1e-5)
    return [float(engine.get_global_grad_norm())]


@pytest.mark.parametrize("world_size", [2, 3])
def test_fp32_parity_with_plain_pytorch(world_size: int) -> None:
    for accum in (1, 3):
        results = run_distributed(_train, world_size, accum)
        assert len({r[0] for r in results}) == 1  # every rank saw the same averaged gradient norm
