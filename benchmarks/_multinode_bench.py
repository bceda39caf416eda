"""The job ``bench_multinode.py`` launches: the multi-node acceptance GPT with a model size of its choosing.

Run by every rank of a job, under zerospeed's runner (this file, the zerospeed flavour) or DeepSpeed's
(``_ds_multinode_job.py``, the DeepSpeed flavour, which imports the torch-only pieces from here). Both
flavours train the same model on the same data in the same order as ``tests/launcher_scripts/multinode_gpt.py``
(the lead's acceptance job; its defaults are this file's defaults), with the model's size as arguments,
because the step-time benchmark needs a model whose gradients make the links matter.

What a run leaves in ``--out`` (the benchmark reads nothing else):

- ``start-rank<R>-<pid>.json`` per rank: ``t0`` (the unix time the script began, before torch was
  imported), ``t_imported`` (torch and the framework imported), ``t_init`` (the process group and the
  engine ready), hostname and network-namespace inode;
- ``losses.jsonl`` (rank 0): one line per optimizer step ``{"step", "world", "loss", "time"}``, ``time``
  the unix time right after the step's loss all-reduce (so the first line's time is "first step").

At module level this imports only the standard library and torch (the DeepSpeed interpreter in
``/tmp/dsvenv`` has no zerospeed); zerospeed is imported in ``main``.
"""

from __future__ import annotations

import time

T0 = time.time()  # before anything heavy is imported: "the rank's process is running"

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from gpt import GPT, GPTConfig  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The job's arguments; the defaults are ``tests/launcher_scripts/multinode_gpt.py``'s model and batch."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro_batch", type=int, default=2)
    parser.add_argument("--global_batch", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--d_model", type=int, default=32)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args, _ = parser.parse_known_args(argv)
    return args


def sample(index: int, vocab: int, seq: int) -> torch.Tensor:
    """Sample ``index`` of the synthetic corpus: ``seq + 1`` tokens (multinode_gpt.py's, any vocab/seq)."""
    gen = torch.Generator().manual_seed(1000 + index)
    start = torch.randint(0, vocab, (1,), generator=gen)
    step = torch.randint(1, 4, (1,), generator=gen)
    return (start + step * torch.arange(seq + 1)) % vocab


def rows_for(step: int, micro: int, rank: int, world: int, args: argparse.Namespace) -> torch.Tensor:
    """The micro-batch rank ``rank`` trains on at ``step``/``micro``: a function of the global batch only."""
    accum = args.global_batch // (world * args.micro_batch)
    if accum * world * args.micro_batch != args.global_batch:
        raise ValueError(f"--global_batch={args.global_batch} is not a multiple of world {world} x "
                         f"--micro_batch={args.micro_batch}")
    first = step * args.global_batch + (micro * world + rank) * args.micro_batch
    return torch.stack([sample(first + i, args.vocab, args.seq) for i in range(args.micro_batch)])


def build_model(args: argparse.Namespace) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model, n_heads=args.heads,
                         n_layers=args.layers))


def config(args: argparse.Namespace) -> dict[str, object]:
    """The same DeepSpeed-format config for both frameworks."""
    return {"train_micro_batch_size_per_gpu": args.micro_batch, "train_batch_size": args.global_batch,
            "zero_optimization": {"stage": args.stage}, "steps_per_print": 10**9,
            "wall_clock_breakdown": False}


def record_start(out: Path, rank: int, t_imported: float, t_init: float) -> None:
    (out / f"start-rank{rank}-{os.getpid()}.json").write_text(json.dumps(
        {"rank": rank, "t0": T0, "t_imported": t_imported, "t_init": t_init, "hostname": socket.gethostname(),
         "netns": os.stat("/proc/self/ns/net").st_ino}))


def record_step(out: Path, step: int, world: int, loss: float) -> None:
    with open(out / "losses.jsonl", "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"step": step, "world": world, "loss": loss, "time": time.time()}) + "\n")


def train_loop(engine, rank: int, world: int, args: argparse.Namespace, out: Path, all_reduce) -> None:
    """multinode_gpt.py's loop: ``accum`` micro steps, the global-batch mean loss all-reduced, rank 0 records."""
    accum = args.global_batch // (world * args.micro_batch)
    for step in range(args.steps):
        total = torch.zeros(())
        for micro in range(accum):
            tokens = rows_for(step, micro, rank, world, args)
            loss = engine(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        all_reduce(total)
        if rank == 0:
            record_step(out, step + 1, world, float(total) / (accum * world))


def main() -> None:
    """The zerospeed flavour (run by the ranks zerospeed's runner starts)."""
    args = parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import zerospeed
    from zerospeed import comm as dist

    t_imported = time.time()
    engine, _, _, _ = zerospeed.initialize(model=build_model(args), config={
        **config(args), "optimizer": {"type": "Adam", "params": {"lr": 3e-3}}})
    rank, world = dist.get_rank(), dist.get_world_size()
    record_start(out, rank, t_imported, time.time())
    train_loop(engine, rank, world, args, out, dist.all_reduce)
    engine.destroy()


if __name__ == "__main__":
    main()
