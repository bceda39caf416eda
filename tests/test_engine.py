"""Engine parity (fp32) against a single-process plain PyTorch reference on the same global batches."""

from __future__ import annotations

import argparse
import contextlib
import logging

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.testing import log_messages, run_distributed
from zerospeed.testing.data import micro_batch_rows
from zerospeed.testing.models import TanhMLP
from zerospeed.testing.reference import train_reference

MICRO = 2
STEPS = 5


class Net(TanhMLP):
    def __init__(self) -> None:
        super().__init__(6, 11, 3)


def _config(world: int, accum: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": accum, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05,
                                                      "warmup_num_steps": 3, "warmup_type": "linear"}},
        "zero_optimization": {"stage": 0, "reduce_bucket_size": 50},
    }


def _data(world: int, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    n = STEPS * world * accum * MICRO
    return torch.randn(n, 6, generator=gen) * 3, torch.randn(n, 3, generator=gen)


def _rows(step: int, rank: int, micro_step: int, world: int, accum: int) -> slice:
    """Rows of the shared data set that ``rank`` trains on in micro-step ``micro_step`` of ``step``."""
    return micro_batch_rows(step, rank, micro_step, world=world, accum=accum, micro=MICRO)


def _plain_reference(model: nn.Module, opt: torch.optim.Optimizer, world: int, accum: int,
                     sched: torch.optim.lr_scheduler.LRScheduler | None = None) -> None:
    """Plain single-process PyTorch on the same global batches (MSE, clipping at 1.0)."""
    x, y = _data(world, accum)

    def batch(step: int, rank: int, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = _rows(step, rank, micro_step, world, accum)
        return x[rows], y[rows]

    train_reference(model, opt, batch=batch, loss_fn=nn.functional.mse_loss, steps=STEPS, world=world, accum=accum,
                    clip=1.0, scheduler=sched)


def _reference_with(opt_factory, world: int, accum: int, sched_factory=None) -> list[torch.Tensor]:
    """Plain single-process PyTorch on the same global batches: the result every parity test expects."""
    torch.manual_seed(0)
    model = Net()
    opt = opt_factory(model.parameters())
    _plain_reference(model, opt, world, accum, sched_factory(opt) if sched_factory is not None else None)
    return [p.detach() for p in model.parameters()]


def _reference(world: int, accum: int) -> list[torch.Tensor]:
    from zerospeed.optim.schedules import WarmupLR

    return _reference_with(
        lambda params: torch.optim.AdamW(params, lr=0.05, weight_decay=0.01), world, accum,
        lambda opt: WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.05, warmup_num_steps=3, warmup_type="linear"))


def _train(accum: int) -> list[torch.Tensor]:
    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    torch.manual_seed(rank)  # different init per rank: initialize must broadcast rank 0's weights
    model = Net()
    if rank == 0:
        torch.manual_seed(0)
        model = Net()
    engine, opt, _, sched = zerospeed.initialize(model=model, config=_config(world, accum))
    x, y = _data(world, accum)
    for step in range(STEPS):
        for m in range(accum):
            rows = _rows(step, rank, m, world, accum)
            loss = nn.functional.mse_loss(engine(x[rows]), y[rows])
            engine.backward(loss)
            engine.step()
            assert engine.was_step_applied() == (m == accum - 1)
    assert engine.global_steps == STEPS and engine.skipped_steps == 0
    assert engine.get_lr() == sched.get_last_lr()
    assert opt is engine.optimizer and isinstance(opt, torch.optim.AdamW) and opt.cur_scale == 1.0
    assert opt.param_groups[0]["lr"] == engine.get_lr()[0]
    reference = _reference(world, accum)
    for got, expected in zip(engine.module.parameters(), reference, strict=True):
        torch.testing.assert_close(got.detach(), expected, rtol=0, atol=1e-5)
    return [float(engine.get_global_grad_norm())]


@pytest.mark.parametrize("world_size", [2, 3])
def test_fp32_parity_with_plain_pytorch(world_size: int) -> None:
    for accum in (1, 3):
        results = run_distributed(_train, world_size, accum)
        assert len({r[0] for r in results}) == 1  # every rank saw the same averaged gradient norm


def _overflow_on_one_rank() -> dict:
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0,
              "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "hysteresis": 1},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 10}}}
    engine, opt, _, sched = zerospeed.initialize(
        model=Net(), config=config, optimizer=lambda params: torch.optim.Adam(params, lr=0.01))
    x, y = _data(torch.distributed.get_world_size(), 1)
    out = {}
    for step in range(3):
        rows = slice((step * 2 + rank) * MICRO, (step * 2 + rank + 1) * MICRO)
        loss = nn.functional.mse_loss(engine(x[rows]).float(), y[rows])
        if step == 1:
            before = [p.detach().clone() for p in engine.module.parameters()]
            state_before = [{k: torch.as_tensor(v).clone() for k, v in opt.state[p].items()}
                            for p in opt.param_groups[0]["params"]]
            lr_before, scale_before = engine.get_lr(), engine.cur_scale
            if rank == 1:
                loss = loss * float("inf")  # only this rank overflows
        engine.backward(loss)
        engine.step()
        if step == 1:
            out["applied"] = engine.was_step_applied()
            out["params_kept"] = all(torch.equal(a, b.detach())
                                     for a, b in zip(before, engine.module.parameters(), strict=True))
            out["state_kept"] = all(torch.equal(v, torch.as_tensor(opt.state[p][k]))
                                    for a, p in zip(state_before, opt.param_groups[0]["params"], strict=True)
                                    for k, v in a.items())
            out["lr_kept"] = engine.get_lr() == lr_before
            out["scale"] = (scale_before, engine.optimizer.cur_scale)
    out["skipped"], out["steps"] = engine.skipped_steps, engine.global_steps
    return out


@pytest.mark.smoke
def test_an_inf_on_one_rank_skips_the_step_everywhere() -> None:
    for result in run_distributed(_overflow_on_one_rank, 2):
        # as in DeepSpeed, a skipped step still counts in global_steps
        assert result == {"applied": False, "params_kept": True, "state_kept": True, "lr_kept": True,
                          "scale": (256.0, 128.0), "skipped": 1, "steps": 3}


def _misuse() -> list[str]:
    messages = []
    engine, *_ = zerospeed.initialize(model=Net(), config={"train_micro_batch_size_per_gpu": 2})
    loss = engine(torch.ones(2, 6)).sum()
    engine.backward(loss)
    try:
        engine.step()
    except RuntimeError as exc:
        messages.append(str(exc))
    engine2, *_ = zerospeed.initialize(model=Net(), config={"train_micro_batch_size_per_gpu": 2},
                                       optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    with engine2.no_sync():
        engine2.backward(engine2(torch.ones(2, 6)).sum())
        try:
            engine2.step()
        except RuntimeError as exc:
            messages.append(str(exc))
    loss = engine2(torch.ones(2, 6)).sum()
    engine2.backward(loss, retain_graph=True)
    try:
        engine2.backward(loss)
    except RuntimeError as exc:
        messages.append(str(exc))
    try:
        zerospeed.initialize(model=Net(), config={"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8,
                                                   "gradient_accumulation_steps": 1})
    except ValueError as exc:
        messages.append(str(exc))
    try:
        zerospeed.initialize(Net(), config={"train_batch_size": 8})
    except TypeError as exc:
        messages.append(str(exc))
    return messages


def test_clear_errors() -> None:
    messages = run_distributed(_misuse, 2)[0]
    assert messages[0].startswith("engine.step() needs an optimizer")
    assert messages[1].startswith("engine.step() inside no_sync() (as in DeepSpeed, this is not allowed)")
    assert messages[2].startswith("a second engine.backward() on the last micro-batch of an accumulation window")
    assert messages[3].startswith("train_batch_size: 8 != train_micro_batch_size_per_gpu (8) * "
                                  "gradient_accumulation_steps (1) * world_size (2) = 16")
    assert messages[4] == "zerospeed.initialize got a model as its first argument (args); pass it as model=..."


def _train_from_config(optimizer_section: dict, accum: int) -> None:
    from zerospeed.optim import Lamb

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": accum,
              "gradient_clipping": 1.0, "optimizer": optimizer_section}
    engine, *_ = zerospeed.initialize(model=Net(), config=config)
    x, y = _data(world, accum)
    for step in range(STEPS):
        for m in range(accum):
            rows = _rows(step, rank, m, world, accum)
            engine.backward(nn.functional.mse_loss(engine(x[rows]), y[rows]))
            engine.step()
    params = optimizer_section["params"]
    if optimizer_section["type"] == "SGD":
        factory = lambda p: torch.optim.SGD(p, **params)  # noqa: E731
    else:
        factory = lambda p: Lamb(p, **params)  # noqa: E731
    for got, expected in zip(engine.module.parameters(), _reference_with(factory, world, accum), strict=True):
        torch.testing.assert_close(got.detach(), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("world_size", [2, 3])
def test_sgd_momentum_and_lamb_from_config_match_the_reference(world_size: int) -> None:
    for section in ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}},
                    {"type": "Lamb", "params": {"lr": 0.02, "weight_decay": 0.01}}):
        for accum in (1, 3):
            run_distributed(_train_from_config, world_size, section, accum)


def _losses(precision: str) -> list[float]:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif precision == "fp16":  # a start scale this small model's gradients do not overflow
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    engine, *_ = zerospeed.initialize(model=Net(), config=config)
    gen = torch.Generator().manual_seed(3)
    teacher = torch.randn(6, 3, generator=gen)
    losses = []
    for _ in range(30):
        x = torch.randn(world * 8, 6, generator=gen)
        rows = slice(rank * 8, rank * 8 + 8)
        loss = nn.functional.mse_loss(engine(x[rows]).float(), (x @ teacher)[rows])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert engine.skipped_steps == 0
    return losses


def test_bf16_and_fp16_track_fp32_within_2_percent() -> None:
    fp32 = run_distributed(_losses, 2, "fp32")[0]
    for precision in ("bf16", "fp16"):
        low = run_distributed(_losses, 2, precision)[0]
        worst = max(abs(a - b) / b for a, b in zip(low, fp32, strict=True))
        assert worst < 0.02, f"{precision} strays {worst:.1%} from fp32"
    assert fp32[-1] < fp32[0] * 0.5


def _plumbing() -> dict:
    with log_messages() as records:
        return _plumbing_logged(records)


def _plumbing_logged(records: list[str]) -> dict:
    import argparse

    from torch.utils.data import TensorDataset

    parser = zerospeed.add_config_arguments(argparse.ArgumentParser())
    import json
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 3, "steps_per_print": 2,
                   "gradient_accumulation_steps": "auto", "dataloader_drop_last": True,
                   "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, f)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", f.name])
    data = TensorDataset(torch.randn(20, 6), torch.randn(20, 3))
    engine, _, loader, _ = zerospeed.initialize(args=args, model=Net(), training_data=data)
    shapes = []
    for x, y in loader:
        shapes.append(tuple(x.shape))
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
    return {"batch": (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                      engine.gradient_accumulation_steps()),
            "shapes": shapes, "steps": engine.global_steps, "samples": engine.global_samples,
            "config_logged": any(r.startswith("zerospeed config (resolved") for r in records),
            "step_lines": [r.split("  ")[0] for r in records if r.startswith("step ")]}


def test_args_config_auto_batch_loader_and_step_logging() -> None:
    rank0, rank1 = run_distributed(_plumbing, 2)
    assert rank0["batch"] == (6, 3, 1)  # "auto" derived from the micro batch and the world size
    assert rank0["shapes"] == [(3, 6)] * 3  # 10 samples per rank, drop_last -> 3 micro-batches of 3
    assert (rank0["steps"], rank0["samples"]) == (3, 18)
    assert rank0["config_logged"] and not rank1["config_logged"]
    assert rank0["step_lines"] == ["step 2"] and rank1["step_lines"] == []


def _no_sync_then_sync(accum: int) -> None:
    """The DDP idiom: backward under no_sync() for the first micro-batches of a window, the last one
    outside it, engine.step() after each (outside no_sync, as DeepSpeed requires)."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    torch.manual_seed(0)
    config = _config(world, accum)
    engine, *_ = zerospeed.initialize(model=Net(), config=config)
    x, y = _data(world, accum)
    for step in range(STEPS):
        for m in range(accum):
            rows = _rows(step, rank, m, world, accum)
            context = engine.no_sync() if m < accum - 1 else contextlib.nullcontext()
            with context:
                engine.backward(nn.functional.mse_loss(engine(x[rows]), y[rows]))
            engine.step()
    for got, expected in zip(engine.module.parameters(), _reference(world, accum), strict=True):
        torch.testing.assert_close(got.detach(), expected, rtol=0, atol=1e-5)


def test_no_sync_for_all_but_the_last_micro_batch_matches_the_reference() -> None:
    run_distributed(_no_sync_then_sync, 2, 3)


def _torch_scheduler_on_the_returned_optimizer() -> list[float]:
    torch.manual_seed(0)
    engine, opt, _, _ = zerospeed.initialize(model=Net(), config={"train_micro_batch_size_per_gpu": 2},
                                             optimizer=lambda p: torch.optim.SGD(p, lr=1.0))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    engine.lr_scheduler = sched
    for _ in range(3):
        engine.backward(engine(torch.ones(2, 6)).sum())
        engine.step()
    return engine.get_lr()


def test_torch_schedulers_accept_the_returned_optimizer() -> None:
    assert run_distributed(_torch_scheduler_on_the_returned_optimizer, 2)[0] == [0.125]


class TiedFrozen(nn.Module):
    """A tied weight (used twice), a frozen layer and a buffer: what real models carry."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.register_buffer("shift", torch.linspace(-1, 1, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(x) + self.shift)
        h = self.frozen(h)
        return nn.functional.linear(h, self.proj.weight)[:, :3]  # proj.weight again


def _tied_frozen() -> None:
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    torch.manual_seed(0)
    engine, *_ = zerospeed.initialize(model=TiedFrozen(), config={
        "train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}})
    x, y = _data(world, 1)
    for step in range(STEPS):
        rows = _rows(step, rank, 0, world, 1)
        engine.backward(nn.functional.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
    torch.manual_seed(0)
    ref = TiedFrozen()
    _plain_reference(ref, torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1, momentum=0.9),
                     world, 1)
    for (name, got), expected in zip(engine.module.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got.detach(), expected.detach(), rtol=0, atol=1e-5, msg=name)
    assert torch.equal(engine.module.frozen.weight, ref.frozen.weight)  # never updated


@pytest.mark.smoke
def test_tied_and_frozen_parameters_match_the_reference() -> None:
    run_distributed(_tied_frozen, 2)


def test_config_source_one_of_config_args_or_deepscale() -> None:
    """As ``deepspeed.initialize``: one config, from ``config=``/``config_params=`` or the arguments
    (``--deepscale_config`` is the deprecated spelling); two are refused instead of one winning."""
    from zerospeed.entry import _config_source

    parser = zerospeed.add_config_arguments(argparse.ArgumentParser())
    plain = parser.parse_args(["--deepspeed"])
    assert _config_source(plain, {"a": 1}, None) == {"a": 1}
    assert _config_source(plain, None, {"b": 2}) == {"b": 2}
    assert _config_source(parser.parse_args(["--deepspeed_config", "x.json"]), None, None) == "x.json"
    with log_messages(logging.WARNING) as warnings:
        assert _config_source(parser.parse_args(["--deepscale", "--deepscale_config", "old.json"]), None, None) == "old.json"
    assert warnings == ["--deepscale_config is deprecated; use --deepspeed_config"]
    with pytest.raises(ValueError, match="two configs: config= was passed to initialize and args.deepspeed_config is 'x.json'"):
        _config_source(parser.parse_args(["--deepspeed_config", "x.json"]), {"a": 1}, None)
    with pytest.raises(ValueError, match="both --deepscale_config and --deepspeed_config"):
        _config_source(parser.parse_args(["--deepspeed_config", "x", "--deepscale_config", "y"]), None, None)
    with pytest.raises(ValueError, match="no config: pass config="):
        _config_source(plain, None, None)


def _train_manual_boundary(stage: int) -> None:
    """accelerate's way: set the boundary before each backward, one engine.step() per window."""
    world, rank, accum = torch.distributed.get_world_size(), torch.distributed.get_rank(), 3
    torch.manual_seed(0)
    config = dict(_config(world, accum), zero_optimization={"stage": stage, "reduce_bucket_size": 50})
    engine, _, _, sched = zerospeed.initialize(model=Net(), config=config)
    x, y = _data(world, accum)
    for step in range(STEPS):
        for m in range(accum):
            engine.set_gradient_accumulation_boundary(m == accum - 1)
            assert engine.is_gradient_accumulation_boundary() == (m == accum - 1)
            rows = _rows(step, rank, m, world, accum)
            engine.backward(nn.functional.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
        assert engine.was_step_applied()
    assert engine.global_steps == STEPS
    with zerospeed.zero.GatheredParameters(list(engine.module.parameters())):
        got = [p.detach().clone() for p in engine.module.parameters()]
    for g, expected in zip(got, _reference(world, accum), strict=True):
        torch.testing.assert_close(g, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_manual_accumulation_boundary_matches_plain_pytorch(stage: int) -> None:
    run_distributed(_train_manual_boundary, 2, stage)
