"""zerospeed's flagship demo (foundation stage): data-parallel training from a DeepSpeed config.

Run it through the launcher, e.g. ``zerospeed --num_procs 2 examples/demo.py``. Each rank
reads the same DeepSpeed-style JSON (the batch triple is derived for the world size), trains a
small MLP on its shard of every global batch, and averages gradients in ``reduce_bucket_size``
buckets through zerospeed's ``Comm``. Rank 0 shows a progress bar, then replays the same run in
one process on the whole batch and reports how far the data-parallel weights are from it.

The training engine (``zerospeed.initialize``) lands in a later issue; this script wires the
foundation pieces together by hand to show they work.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

import zerospeed
from zerospeed.dist import Comm, ParallelDims

HERE = Path(__file__).resolve().parent
IMPLEMENTED = frozenset({"gradient_clipping", "optimizer.type=AdamW"})  # what this hand-written loop honours beyond plain DP


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10))


def make_data(steps: int, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable synthetic task: labels from a fixed random teacher network."""
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(steps * batch, 32, generator=gen)
    teacher = torch.randn(32, 10, generator=gen)
    return x, (x @ teacher).argmax(dim=1)


def make_optimizer(model: nn.Module, cfg: zerospeed.Config) -> torch.optim.Optimizer:
    params = dict(cfg.optimizer.params)
    return torch.optim.AdamW(model.parameters(), lr=params["lr"], betas=tuple(params["betas"]),
                             eps=params["eps"], weight_decay=params["weight_decay"])


def average_gradients(model: nn.Module, comm: Comm, bucket_elems: int) -> None:
    """Average gradients across ranks, one flat bucket of about ``bucket_elems`` at a time."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    bucket: list[torch.Tensor] = []

    def flush() -> None:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        comm.all_reduce(flat, op="avg")
        for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(part.view_as(g))
        bucket.clear()

    for g in grads:
        bucket.append(g)
        if sum(b.numel() for b in bucket) >= bucket_elems:
            flush()
    if bucket:
        flush()


def train(cfg: zerospeed.Config, steps: int, seed: int, rank: int, world: int, comm: Comm | None,
          progress: bool) -> tuple[nn.Module, list[float]]:
    """Train; with ``comm`` each rank takes its slice of every global batch, else one process takes all."""
    model = make_model(seed)
    opt = make_optimizer(model, cfg)
    micro, accum = cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
    x, y = make_data(steps, cfg.train_batch_size, seed)
    per_rank = micro * accum
    if comm is None:
        accum *= world  # one process walks the whole global batch in micro-batches
    losses = []
    bar = tqdm(range(steps), desc=f"training on {world} rank(s)", disable=not progress, ncols=90)
    for step in bar:
        batch = slice(step * cfg.train_batch_size, (step + 1) * cfg.train_batch_size)
        xb, yb = x[batch], y[batch]
        if comm is not None:
            xb, yb = xb[rank * per_rank:(rank + 1) * per_rank], yb[rank * per_rank:(rank + 1) * per_rank]
        total = 0.0
        for m in range(accum):
            part = slice(m * micro, (m + 1) * micro)
            loss = nn.functional.cross_entropy(model(xb[part]), yb[part]) / accum
            loss.backward()
            total += loss.item()
        if comm is not None:
            average_gradients(model, comm, int(cfg.zero_optimization.reduce_bucket_size))
            loss_t = torch.tensor([total])
            comm.all_reduce(loss_t, op="avg")
            total = loss_t.item()
        if cfg.gradient_clipping:
            nn.utils.clip_grad_norm_(model.parameters(), cfg.gradient_clipping)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        bar.set_postfix(loss=f"{total:.4f}", refresh=False)
    return model, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed_config", default=str(HERE / "demo_config.json"))
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    info = zerospeed.init_distributed()
    cfg = zerospeed.load_config(args.deepspeed_config, world_size=info.world_size)
    cfg.check_implemented(IMPLEMENTED)
    mesh = ParallelDims(world_size=info.world_size).build()
    rank, world = info.rank, info.world_size
    if rank == 0:
        print(f"zerospeed {zerospeed.__version__}: {world} {mesh.dp.group.name()} rank(s); batch "
              f"{cfg.train_batch_size} = micro {cfg.train_micro_batch_size_per_gpu} x accumulation "
              f"{cfg.gradient_accumulation_steps} x world {world}", flush=True)
    torch.set_num_threads(1)
    start = time.perf_counter()
    model, losses = train(cfg, args.steps, args.seed, rank, world, mesh.dp, progress=rank == 0)
    elapsed = time.perf_counter() - start
    stats = mesh.dp.stats
    if rank == 0:
        reference, ref_losses = train(cfg, args.steps, args.seed, 0, world, None, progress=False)
        gap = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
        loss_gap = max(abs(a - b) for a, b in zip(losses, ref_losses))
        print("\nsummary")
        print(f"  steps                 {args.steps} ({args.steps * cfg.train_batch_size} samples, "
              f"{args.steps * cfg.train_batch_size / elapsed:.0f} samples/s)")
        print(f"  loss                  {losses[0]:.4f} -> {losses[-1]:.4f}")
        print(f"  gradient all-reduce   {stats.calls['all_reduce']} calls, {stats.bytes['all_reduce'] / 1e6:.1f} MB")
        print(f"  vs 1-process replay   max |weight diff| {gap:.2e}, max |loss diff| {loss_gap:.2e}")
        ok = gap < 1e-4 and losses[-1] < losses[0]
        print(f"  result                {'OK: data-parallel run matches the single-process reference' if ok else 'MISMATCH'}")
        if not ok:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
