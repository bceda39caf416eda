"""The multi-node acceptance job: the example GPT trained with zerospeed, run by every rank.

Each rank records where it ran (hostname, IP, network-namespace inode) and one variable the launcher
should have carried (``ZS_MARKER``, set by a ``.deepspeed_env`` file) into ``<out>/where-rank<R>-<pid>.json``;
rank 0 appends one JSON line per optimizer step ``{"stage", "step", "world", "loss"}`` to
``<out>/losses.jsonl``, the loss being the mean over the whole global batch (an all-reduce), so the
same job on 6 ranks of one host and on 3 hosts x 2 ranks must write the same numbers.

Data is a pure function of the global sample index (a generator seeded per sample), and step ``s``
uses samples ``s*B .. s*B+B-1`` split over the ranks and micro steps in rank order, so the batch a
step sees depends on the global batch ``B`` only, never on the world size: an elastic run that goes
from 6 to 4 ranks trains on the same samples as a run that never lost a host. With ``--ckpt DIR``
the job resumes from the newest checkpoint there (at whatever world size it now has) and saves every
``--save_every`` steps, which is what an elastic restart needs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import zerospeed  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402
from zerospeed import comm as dist  # noqa: E402

VOCAB, SEQ = 64, 16


def sample(index: int) -> torch.Tensor:
    """Sample ``index`` of the endless synthetic corpus: ``SEQ + 1`` tokens with a learnable pattern."""
    gen = torch.Generator().manual_seed(1000 + index)
    start = torch.randint(0, VOCAB, (1,), generator=gen)
    step = torch.randint(1, 4, (1,), generator=gen)
    return (start + step * torch.arange(SEQ + 1)) % VOCAB


def rows_for(step: int, micro: int, rank: int, *, world: int, micro_batch: int, global_batch: int) -> torch.Tensor:
    accum = global_batch // (world * micro_batch)
    first = step * global_batch + (micro * world + rank) * micro_batch
    assert accum * world * micro_batch == global_batch
    return torch.stack([sample(first + i) for i in range(micro_batch)])


def where() -> dict[str, object]:
    host = socket.gethostname()
    try:
        ip = socket.gethostbyname(host)
    except OSError:
        ip = None
    return {"hostname": host, "ip": ip, "netns": os.stat("/proc/self/ns/net").st_ino,
            "marker": os.environ.get("ZS_MARKER"), "pid": os.getpid()}


def config(stage: int, args: argparse.Namespace) -> dict[str, object]:
    cfg: dict[str, object] = {
        "optimizer": {"type": "Adam", "params": {"lr": 3e-3}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    if args.elastic:
        cfg["elasticity"] = {"enabled": True, "max_train_batch_size": args.global_batch,
                             "micro_batch_sizes": [args.micro_batch], "min_gpus": 1, "max_gpus": 64,
                             "version": 0.1}
    else:  # elasticity derives both from the world size
        cfg["train_batch_size"] = args.global_batch
        cfg["train_micro_batch_size_per_gpu"] = args.micro_batch
    return cfg


def train(stage: int, args: argparse.Namespace, out: Path) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_heads=2, n_layers=2))
    engine, _, _, _ = zerospeed.initialize(model=model, config=config(stage, args))
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = Path(args.ckpt) / f"stage{stage}" if args.ckpt else None
    if ckpt is not None and ckpt.exists():
        engine.load_checkpoint(str(ckpt))
    accum = engine.gradient_accumulation_steps()
    while engine.global_steps < args.steps:
        step = engine.global_steps
        total = torch.zeros(())
        for micro in range(accum):
            tokens = rows_for(step, micro, rank, world=world, micro_batch=args.micro_batch,
                              global_batch=args.global_batch)
            loss = engine(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        if rank == 0:
            with open(out / "losses.jsonl", "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"stage": stage, "step": step + 1, "world": world,
                                     "loss": float(total) / (accum * world), "time": time.time()}) + "\n")
        if ckpt is not None and engine.global_steps % args.save_every == 0:
            engine.save_checkpoint(str(ckpt))
        if args.step_delay:
            time.sleep(args.step_delay)
    engine.destroy()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro_batch", type=int, default=2)
    parser.add_argument("--global_batch", type=int, default=24)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--save_every", type=int, default=4)
    parser.add_argument("--step_delay", type=float, default=0.0)
    parser.add_argument("--elastic", action="store_true")
    args, _ = parser.parse_known_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"where-rank{os.environ.get('RANK', '0')}-{os.getpid()}.json").write_text(json.dumps(where()))
    for stage in (int(s) for s in args.stages.split(",")):
        train(stage, args, out)


if __name__ == "__main__":
    main()
