"""Lightning and Fabric on zerospeed vs DDP, run under ``torch.distributed.run --nproc_per_node 2``.

``python -m torch.distributed.run --nproc_per_node 2 parity.py first OUT`` trains every configuration
for 30 steps (two epochs of 15 batches per rank) and saves a Trainer checkpoint at the end of epoch 1
and a Fabric checkpoint at step 15; ``... parity.py resume OUT`` resumes both in a new process. Each
rank writes ``OUT/<phase>-rank<r>.json``: per-step losses (this rank's batches) by configuration name.
tests/test_lightning.py compares them.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zerospeed.integrations.lightning import ZeroSpeedPrecision, ZeroSpeedStrategy
from zerospeed.integrations.lightning_fabric import ZeroSpeedFabricStrategy

warnings.filterwarnings("ignore")
BATCHES, BATCH, DIM = 15, 4, 8  # per rank and epoch; two epochs = 30 steps


def data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows, the same in every configuration (no sampler, no shuffle)."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(2, BATCHES * BATCH, DIM, generator=g)
    y = torch.sin(x.sum(-1, keepdim=True)) + 0.1 * torch.randn(2, BATCHES * BATCH, 1, generator=g)
    return x[rank], y[rank]


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


def optimizer_and_scheduler(params: Any) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)


class RegressionWithoutOptimizer(pl.LightningModule):
    """configure_optimizers returns None: the optimizer comes from the config's section."""

    def __init__(self) -> None:
        super().__init__()
        self.net = net()
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x).float(), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return None

    def train_dataloader(self) -> DataLoader:
        x, y = data(self.trainer.global_rank)
        return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


class Regression(RegressionWithoutOptimizer):
    def configure_optimizers(self) -> Any:
        opt, sched = optimizer_and_scheduler(self.parameters())
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class RegressionConstantLR(RegressionWithoutOptimizer):
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


class SaveAtEpochEnd(pl.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


def trainer_run(strategy: Any, *, epochs: int = 2, ckpt_path: str | None = None,
                callbacks: list[pl.Callback] | None = None, module_class: type = Regression,
                **flags: Any) -> list[float]:
    module = module_class()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=epochs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, callbacks=callbacks, **flags)
    trainer.fit(module, ckpt_path=ckpt_path)
    return module.losses


def fabric_run(strategy: Any, *, start: int = 0, save: str | None = None, load: str | None = None) -> list[float]:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = net()
    opt, sched = optimizer_and_scheduler(model.parameters())
    zs = isinstance(strategy, ZeroSpeedFabricStrategy)
    if zs:  # the engine steps the scheduler it was given (as DeepSpeed's does)
        model, opt, sched = fabric.setup(model, opt, scheduler=sched)
    else:
        model, opt = fabric.setup(model, opt)
    x, y = data(fabric.global_rank)
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 0}
    if not zs:
        state["scheduler"] = sched
    if load is not None:
        fabric.load(load, state)
        start = state["step"]
    losses = []
    for step in range(start, 2 * BATCHES):
        rows = slice((step % BATCHES) * BATCH, (step % BATCHES + 1) * BATCH)
        loss = F.mse_loss(model(x[rows]).float(), y[rows])
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        if not zs:
            sched.step()
        losses.append(float(loss.detach()))
        if save is not None and step + 1 == BATCHES:
            state["step"] = step + 1
            fabric.save(save, state)
    return losses


def zero(stage: int, **extra: Any) -> dict[str, Any]:
    return {"zero_optimization": {"stage": stage, **extra}}


def main() -> None:
    phase, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    ckpt, fabric_ckpt = str(out / "trainer.ckpt"), str(out / "fabric_ckpt")
    results: dict[str, list[float]] = {}
    if phase == "first":
        results["ddp"] = trainer_run("ddp")
        for stage in range(4):
            callbacks = [SaveAtEpochEnd(ckpt)] if stage == 3 else None
            config: Any = zero(stage)
            if stage == 1:  # a config file instead of a dict
                config = out / f"zs1-rank{rank}.json"
                config.write_text(json.dumps(zero(1)))
            results[f"zs{stage}"] = trainer_run(ZeroSpeedStrategy(config=config), callbacks=callbacks)
        results["ddp_acc_clip"] = trainer_run("ddp", accumulate_grad_batches=2, gradient_clip_val=0.05)
        results["zs2_acc_clip"] = trainer_run(ZeroSpeedStrategy(config=zero(2)), accumulate_grad_batches=2,
                                              gradient_clip_val=0.05)
        results["ddp_acc"] = trainer_run("ddp", accumulate_grad_batches=3)
        results["zs0_acc"] = trainer_run(ZeroSpeedStrategy(config=zero(0)), accumulate_grad_batches=3)
        results["zs3_offload"] = trainer_run(ZeroSpeedStrategy(config=zero(
            3, offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})))
        results["zs2_bf16"] = trainer_run("zerospeed", precision="bf16-mixed")
        # Trainer(precision="16-mixed") on CPU becomes bf16 in Lightning's connector: fp16 goes by the plugin
        results["zs2_fp16"] = trainer_run(ZeroSpeedStrategy(config=zero(2), precision_plugin=ZeroSpeedPrecision(
            "16-mixed")))
        results["ddp_const_lr"] = trainer_run("ddp", module_class=RegressionConstantLR)
        section = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}, **zero(2)}
        results["zs2_config_optimizer"] = trainer_run(ZeroSpeedStrategy(config=section),
                                                      module_class=RegressionWithoutOptimizer)
        results["fabric_ddp"] = fabric_run("ddp")
        results["fabric_zs2"] = fabric_run(ZeroSpeedFabricStrategy(config=zero(2)))
        results["fabric_zs3"] = fabric_run(ZeroSpeedFabricStrategy(config=zero(3)), save=fabric_ckpt)
    else:
        results["zs3_resumed"] = trainer_run(ZeroSpeedStrategy(config=zero(3)), ckpt_path=ckpt)
        results["zs1_resumed"] = trainer_run(ZeroSpeedStrategy(config=zero(1)), ckpt_path=ckpt)
        results["fabric_zs3_resumed"] = fabric_run(ZeroSpeedFabricStrategy(config=zero(3)), load=fabric_ckpt)
    (out / f"{phase}-rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
