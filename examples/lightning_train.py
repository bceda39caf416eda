"""An ordinary PyTorch Lightning script trained by zerospeed: the only zerospeed line is ``strategy=``.

Offline (the data is generated) and CPU-friendly:

    PYTHONPATH=src python examples/lightning_train.py                    # 2 CPU processes, ZeRO stage 3
    PYTHONPATH=src python examples/lightning_train.py --stage 2 --precision bf16-mixed --accumulate 2

Lightning starts the second process itself (it re-runs this script); ``trainer.save_checkpoint`` writes
the engine's sharded checkpoint directory, and ``--resume DIR`` continues from one (any stage, any
number of devices).
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zerospeed.integrations.lightning import ZeroSpeedStrategy


class Regression(pl.LightningModule):
    """A small MLP fitting y = sin(sum(x)) + noise."""

    def __init__(self, width: int = 64, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                                 nn.Linear(width, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x).float(), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x).float(), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=200)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader(n: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = torch.sin(x.sum(-1, keepdim=True)) + 0.05 * torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=seed == 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=3, choices=range(4))
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed", "16-mixed"])
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save", default="lightning_zerospeed.ckpt", help="checkpoint directory to write")
    parser.add_argument("--resume", default=None, help="checkpoint directory to resume from")
    args = parser.parse_args()

    pl.seed_everything(0)
    config = {"zero_optimization": {"stage": args.stage}, "train_micro_batch_size_per_gpu": 16}
    trainer = pl.Trainer(
        strategy=ZeroSpeedStrategy(config=config),  # <- the one zerospeed line (or strategy="zerospeed")
        accelerator="cpu", devices=args.devices, precision=args.precision, max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate, gradient_clip_val=1.0, logger=False,
        enable_checkpointing=False, limit_val_batches=4)
    model = Regression()
    trainer.fit(model, loader(2048, 0), loader(256, 1), ckpt_path=args.resume)
    train_loss = float(trainer.callback_metrics["train_loss"])
    trainer.save_checkpoint(args.save)  # a directory: the engine's shards plus Lightning's state
    (metrics,) = trainer.validate(model, loader(256, 1))  # evaluation only: an engine without optimizer
    if trainer.is_global_zero:
        print(f"final train_loss {train_loss:.4f}, val_loss {metrics['val_loss']:.4f}, checkpoint in {args.save}")


if __name__ == "__main__":
    main()
