"""zerospeed's demo: a small GPT learns English from the Python standard library's docstrings.

Run it through the launcher: ``zerospeed --num_procs 2 examples/demo.py`` (``make demo``). Every
rank builds the same byte-level corpus (no downloads), ``zerospeed.initialize`` turns the model and
the DeepSpeed JSON config into a data-parallel bf16 engine with AdamW, a warmup-cosine schedule and
gradient clipping, and its loader gives each rank its share of fixed-length token windows. Rank 0
shows progress and ends with a summary: train and validation loss before/after, throughput, peak
memory of every rank, the config settings in force beyond the defaults, and a sampled continuation.
The config's ``csv_monitor`` writes DeepSpeed's per-step events (loss, learning rate, throughput,
memory) as CSV files under ``--monitor_dir``/demo (a run appends to them), and the summary names the
picture ``zerospeed plot`` draws from them, after checking that its loss curve is the printed losses.

``--moe_experts 4 --ep_size 2`` trains the mixture-of-experts variant instead: every other block's MLP
becomes DeepSpeed's ``MoE`` layer over 4 experts (top-2, dropless), each rank holding 2 of them and
exchanging tokens with the other by all-to-all (``zerospeed --num_procs 2 examples/demo.py --moe_experts 4
--ep_size 2``).

``--pld 0.5`` turns on progressive layer drop (``"progressive_layer_drop": {"enabled": true, "theta": 0.5,
"gamma": --pld_gamma}``): the engine passes theta(t) to the GPT, which skips deeper blocks more often in
training (evaluation and sampling run every block).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the demo's own modules, wherever the launcher starts us

import zerospeed  # noqa: E402
from zerospeed.data.loader import DistributedLoader  # noqa: E402
from zerospeed.utils import RepeatingLoader  # noqa: E402

from corpus import TokenWindows, build_corpus, decode, encode, split, stdlib_dir  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402
from report import format_settings, non_default_settings, peak_memory_mb  # noqa: E402

PROMPT = "Return the "


def cached_corpus(max_bytes: int) -> bytes:
    """The docstring corpus, built once per Python install and reused (parsing the stdlib takes seconds)."""
    key = hashlib.sha256(f"{stdlib_dir()}|{sys.version}|{max_bytes}|v1".encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / "zerospeed-demo" / f"docstrings-{key}.txt"
    if path.exists():
        return path.read_bytes()
    corpus = build_corpus(max_bytes)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(corpus)
    os.replace(tmp, path)  # atomic: a rank never reads a half-written file
    return corpus


def load_demo_config(path: str, steps: int, zero_stage: int | None = None,
                     layer_drop: tuple[float, float] | None = None, monitor_dir: str | None = None) -> dict:
    """The JSON config, with a decaying schedule stretched to the requested number of steps (and the
    ZeRO stage replaced when one is asked for, to compare stages on the same run; ``layer_drop``:
    (theta, gamma) of a ``progressive_layer_drop`` section; ``monitor_dir``: the CSV monitor's
    output_path when the config leaves it empty)."""
    config = json.loads(Path(path).read_text())
    monitor = config.get("csv_monitor") or {}
    if monitor.get("enabled") and not monitor.get("output_path") and monitor_dir:
        monitor["output_path"] = monitor_dir
    if zero_stage is not None:
        config.setdefault("zero_optimization", {})["stage"] = zero_stage
    if layer_drop is not None:
        config["progressive_layer_drop"] = {"enabled": True, "theta": layer_drop[0], "gamma": layer_drop[1]}
    params = (config.get("scheduler") or {}).get("params", {})
    if "total_num_steps" in params:
        params["total_num_steps"] = steps
        params["warmup_num_steps"] = min(params.get("warmup_num_steps", 0), max(1, steps // 10))
    return config


@torch.no_grad()
def evaluate(engine: zerospeed.Engine, data: TokenWindows, windows: int, batch: int = 8) -> float:
    """Mean loss over the first ``windows`` validation windows, split across ranks and averaged."""
    comm = engine.comm
    engine.eval()
    total = torch.zeros(2)
    mine = list(range(comm.rank, min(windows, len(data)), comm.world_size))
    for start in range(0, len(mine), batch):
        x, y = (torch.stack(t) for t in zip(*(data[i] for i in mine[start:start + batch])))
        total += torch.tensor([float(engine(x, y)) * len(x), float(len(x))])
    comm.all_reduce(total, op="sum")
    engine.train()
    return float(total[0] / total[1])


def train(engine: zerospeed.Engine, loader: DistributedLoader, steps: int,
          show: bool) -> tuple[list[float], float, int]:
    """Run ``steps`` optimizer steps; returns per-step mean loss over all ranks, seconds and tokens."""
    accum = engine.gradient_accumulation_steps()
    local = torch.zeros(steps)
    tokens = 0
    batches = iter(RepeatingLoader(loader))
    bar = tqdm(total=steps, desc="training", disable=not show, ncols=100, mininterval=0.5)
    start = time.perf_counter()
    for step in range(steps):
        for _ in range(accum):
            x, y = next(batches)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            local[step] += loss.item() / accum
            tokens += x.numel()
        if show and (step % 10 == 0 or step == steps - 1):
            rate = tokens * engine.comm.world_size / (time.perf_counter() - start)
            bar.set_postfix_str(f"step {engine.global_steps} loss {local[step]:.3f} "
                                f"lr {engine.get_lr()[0]:.2e} {rate:,.0f} tok/s", refresh=False)
        bar.update(1)
    elapsed = time.perf_counter() - start
    bar.close()
    engine.comm.all_reduce(local, op="avg")  # one collective for the whole history, not one per step
    return local.tolist(), elapsed, tokens * engine.comm.world_size


def moe_options(args: argparse.Namespace) -> dict:
    """The GPTConfig fields of the MoE variant (none for the dense demo)."""
    if not args.moe_experts:
        return {}
    return {"moe_experts": args.moe_experts, "moe_every": args.moe_every, "moe_k": args.moe_k,
            "ep_size": args.ep_size}


def describe_moe(cfg: GPTConfig) -> str:
    """The MoE part of the opening line (empty for the dense GPT, whose output stays as it was)."""
    if not cfg.moe_experts:
        return ""
    routing = f"capacity {cfg.moe_capacity_factor}" if cfg.moe_drop_tokens else "dropless"
    return (f"; MoE in blocks {list(cfg.moe_blocks())}: {cfg.moe_experts} experts, top-{cfg.moe_k}, "
            f"ep_size {cfg.ep_size}, {routing}")


def sample(model: GPT, prompt: str, new_tokens: int, seed: int) -> str:
    model.eval()
    out = model.generate(encode(prompt)[None], new_tokens, generator=torch.Generator().manual_seed(seed))
    return decode(out[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed_config", default=str(HERE / "demo_config.json"))
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--zero_stage", type=int, choices=(0, 1, 2, 3), default=None,
                        help="ZeRO stage instead of the config's (e.g. to compare step times across stages)")
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--corpus_bytes", type=int, default=2_000_000)
    parser.add_argument("--val_windows", type=int, default=64)
    parser.add_argument("--sample_tokens", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--full_config", action="store_true", help="print the whole resolved config")
    parser.add_argument("--moe_experts", type=int, default=0,
                        help="experts per MoE layer (0: the dense GPT); MoE runs at ZeRO stage 0")
    parser.add_argument("--moe_every", type=int, default=2, help="every n-th block gets an MoE MLP")
    parser.add_argument("--moe_k", type=int, default=2, help="experts per token")
    parser.add_argument("--ep_size", type=int, default=1, help="expert-parallel degree (divides the rank count)")
    parser.add_argument("--pld", type=float, default=None, metavar="THETA",
                        help="progressive layer drop with this theta-bar (0.5 in the paper; off by default)")
    parser.add_argument("--pld_gamma", type=float, default=0.01, help="theta(t)'s decay rate with --pld")
    parser.add_argument("--monitor_dir", default=str(Path(tempfile.gettempdir()) / "zerospeed-demo" / "monitor"),
                        help="where the config's csv_monitor writes (when its output_path is empty)")
    args = parser.parse_args()

    # The progress bar and summary say what the engine's INFO lines would (the full config is --full_config).
    logging.getLogger("zerospeed").addHandler(logging.NullHandler())
    logging.getLogger("zerospeed").setLevel(logging.WARNING)
    torch.manual_seed(args.seed)
    train_tokens, val_tokens = split(cached_corpus(args.corpus_bytes))
    train_data, val_data = TokenWindows(train_tokens, args.seq_len), TokenWindows(val_tokens, args.seq_len)
    model = GPT(GPTConfig(seq_len=args.seq_len, **moe_options(args)))
    config = load_demo_config(args.deepspeed_config, args.steps, args.zero_stage,
                              None if args.pld is None else (args.pld, args.pld_gamma), args.monitor_dir)
    engine, _, loader, _ = zerospeed.initialize(model=model, config=config, training_data=train_data)
    comm, cfg, show = engine.comm, engine.config, engine.comm.rank == 0
    if show:
        print(f"zerospeed {zerospeed.__version__}: {comm.world_size} ranks, {cfg.precision.value}, "
              f"GPT {model.num_params() / 1e6:.2f}M params ({model.cfg.n_layers} layers, d_model {model.cfg.d_model})"
              f"{describe_moe(model.cfg)}\n"
              f"data: stdlib docstrings, bytes as tokens, {len(train_tokens) / 1e6:.2f}M train / "
              f"{len(val_tokens) / 1e3:.0f}K validation\n"
              f"batch {cfg.train_batch_size} x {args.seq_len} tokens = micro {cfg.train_micro_batch_size_per_gpu} "
              f"x accumulation {cfg.gradient_accumulation_steps} x world {comm.world_size}", flush=True)

    val_before = evaluate(engine, val_data, args.val_windows)
    losses, elapsed, tokens = train(engine, loader, args.steps, show)
    val_after = evaluate(engine, val_data, args.val_windows)
    memory = comm.all_gather_object(peak_memory_mb(next(model.parameters()).device))
    # experts split over ranks answer a forward only when every rank runs it: then all ranks sample
    # (the same tokens, from the same seed); otherwise rank 0 alone
    text = (sample(model, PROMPT, args.sample_tokens, args.seed)
            if args.sample_tokens and (show or model.cfg.ep_size > 1) else "")
    if not show:
        return
    fell = print_summary(engine, args, losses, (val_before, val_after), elapsed, tokens, memory)
    print_plot(engine, losses)
    if args.sample_tokens:
        print(f"  sample               {text!r}")
    if args.full_config:
        print(engine.config.to_json())
    print(f"  result               {'OK: the loss fell' if fell else 'FAILED: the loss did not fall'}")
    if not fell:
        raise SystemExit(1)


def print_summary(engine: zerospeed.Engine, args: argparse.Namespace, losses: list[float],
                  val: tuple[float, float], elapsed: float, tokens: int, memory: list[float]) -> bool:
    """Print the run's summary on rank 0; returns whether both train and validation loss fell."""
    tail = losses[-min(10, len(losses)):]
    last = sum(tail) / len(tail)
    cuda = next(engine.module.parameters()).device.type == "cuda"
    print("\nsummary")
    print(f"  steps                {args.steps} ({tokens:,} tokens in {elapsed:.1f} s, "
          f"{tokens / elapsed:,.0f} tokens/s)")
    print(f"  train loss           {losses[0]:.3f} -> {last:.3f} "
          f"(first step -> mean of last {len(tail)}; ln 256 = 5.545)")
    print(f"  validation loss      {val[0]:.3f} -> {val[1]:.3f}")
    print("  peak memory          " + ", ".join(f"rank {r}: {mb:.0f} MB" for r, mb in enumerate(memory))
          + (" (max allocated)" if cuda else " (max RSS)"))
    states = engine.memory_breakdown()
    print(f"  model states         {states['total'] / 2**20:.1f} MiB on rank 0 (params "
          f"{states['params'] / 2**20:.1f}, grads {states['grads'] / 2**20:.1f}, optimizer "
          f"{states['optimizer_states'] / 2**20:.1f}; ZeRO stage {engine.config.zero_optimization.stage})")
    print(f"  optimizer steps      {engine.global_steps} applied, {engine.skipped_steps} skipped; "
          f"final lr {engine.get_lr()[0]:.2e}")
    theta = engine.get_pld_theta()
    if theta is not None:
        print(f"  layer drop           theta now {theta:.3f} (the last block kept with that probability)")
    print("  config beyond defaults (resolved; --full_config prints all of it):")
    print(format_settings(non_default_settings(engine.config, engine.comm.world_size), "    "))
    return last < losses[0] and val[1] < val[0]

def print_plot(engine: zerospeed.Engine, losses: list[float]) -> None:
    """Draw the CSV monitor's run (``zerospeed plot``), check its loss curve against ``losses`` (the
    printed per-step losses: each step's mean over micro-batches and ranks, as the monitor's
    ``Train/Samples/train_loss``) and name the PNG."""
    monitor = engine.config.csv_monitor
    if not monitor.enabled:
        return
    from zerospeed.monitor.plot import plot_run

    run_dir = Path(monitor.output_path) / monitor.job_name
    result = plot_run(run_dir)
    drawn = result.drawn["Train/Samples/train_loss"].values
    if len(drawn) != len(losses):
        raise SystemExit(f"the plot drew {len(drawn)} losses, the run printed {len(losses)}")
    gap = max(abs(a - b) for a, b in zip(drawn, losses))
    if gap > 1e-4:
        raise SystemExit(f"the plot's loss curve differs from the printed losses by up to {gap:.2e}")
    print(f"  monitor (csv)        {run_dir}")
    print(f"  training plot        {result.path} (its loss curve = the {len(losses)} per-step losses above, "
          f"max difference {gap:.1e})")


if __name__ == "__main__":
    main()
