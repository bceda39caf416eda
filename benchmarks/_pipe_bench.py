"""The model, data and DeepSpeed side of ``bench_pipe.py``.

Importable by both interpreters: the main venv (zerospeed, torch.distributed.pipelining) and the
DeepSpeed venv (``/tmp/dsvenv``, no zerospeed). So at module level this imports only the standard
library and torch; zerospeed and deepspeed are imported inside the functions that use them.

The model is the GPT-like pipeline of ``zerospeed.testing.pipe_models`` (re-declared here, torch only,
so the DeepSpeed interpreter can build it): a token embedding tied with the output head, ``blocks``
pre-norm MLP blocks (``x + fc2(gelu(fc1(ln(x))))``, 4x expansion), a final LayerNorm, the head
``x @ embedding.T`` and a cross-entropy loss. Every side partitions it the same way: the MLP blocks
evenly over the stages (``partition_method="type:MLPBlock"``), the embedding on the first stage, the
final norm and the head on the last.

Run as a script by the DeepSpeed interpreter:

    PYTHONPATH=benchmarks /tmp/dsvenv/bin/python benchmarks/_pipe_bench.py deepspeed '<json spec>'

runs ``spec["world"]`` fresh ranks (torch.multiprocessing forkserver with deepspeed preloaded, gloo)
through DeepSpeed's PipelineEngine (its 1F1B ``TrainSchedule``) and prints one ``RESULT <json>`` line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

BASE_SEED = 1234
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
CLIP = 1.0


# Every side builds layer i after torch.manual_seed(BASE_SEED + i) (the tied embedding / head from the
# embedding's seed), so all start from the same weights and the first losses agree. With
# seed_layers=True, DeepSpeed's and zerospeed's PipelineModule also reseed before every layer of every
# forward (for reproducible dropout; ~0.3 ms per torch.manual_seed here); torch.distributed.pipelining
# has no such thing and this model no dropout, so both turn it off after the build (SEEDING).
SEEDING = "layers seeded at build only"


# -- the model (as zerospeed.testing.pipe_models, torch only) -------------------------------------
class Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, hidden) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


def lm_head(embedding: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The output head tied to the embedding: logits over the vocabulary."""
    return x @ embedding.weight.t()


def _load_device_time() -> Any:
    """zerospeed.testing.device_time, loaded from its file (torch only; DeepSpeed's interpreter has no zerospeed)."""
    path = Path(__file__).resolve().parent.parent / "src" / "zerospeed" / "testing" / "device_time.py"
    spec = importlib.util.spec_from_file_location("_device_time", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_device_time = _load_device_time()


class MLPBlock(nn.Module):
    """``device_s`` > 0 adds a simulated device's time to the block: ``device_s`` each for forward, the
    input gradient and the weight gradient (``bench_pipe.py --device-ms``)."""

    def __init__(self, hidden: int, device_s: float = 0.0) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.device_s = device_s
        if device_s:  # a weight of its own: one the block also used elsewhere would make it a shared weight,
            self.device_weight = nn.Parameter(torch.zeros(1))  # whose backward a zero-bubble split cannot divide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + self.fc2(F.gelu(self.fc1(self.ln(x))))
        if self.device_s:
            busy = _device_time.DeviceTime.apply(y, self.device_s, self.device_s)
            y = busy + _device_time.DeviceWeightTime.apply(self.device_weight, self.device_s)
        return y


class FinalNorm(nn.LayerNorm):
    pass


class Head(nn.Module):
    """torch.distributed.pipelining's side of the tied head: the last stage's own copy of the embedding
    (built from the embedding's seed); its gradient is summed with the first stage's every batch."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        torch.manual_seed(BASE_SEED)
        self.embed = Embedding(vocab, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return lm_head(self.embed, x)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def layer_specs(spec: dict, LayerSpec: Any, TiedLayerSpec: Any) -> list[Any]:
    """The layers as zerospeed's or DeepSpeed's spec classes (the same signatures)."""
    vocab, hidden = spec["vocab"], spec["hidden"]
    return ([TiedLayerSpec("embed", Embedding, vocab, hidden, tied_weight_attr="weight")]
            + [LayerSpec(MLPBlock, hidden, device_seconds(spec)) for _ in range(spec["blocks"])]
            + [LayerSpec(FinalNorm, hidden),
               TiedLayerSpec("embed", Embedding, vocab, hidden, forward_fn=lm_head, tied_weight_attr="weight")])


def device_seconds(spec: dict) -> float:
    """The simulated device time per block and pass (0: real compute only)."""
    return spec.get("device_ms", 0) / 1e3


def stage_blocks(spec: dict, stage: int, stages: int) -> range:
    """The MLP blocks (1-based layer indices) of virtual stage ``stage`` out of ``stages``: the blocks
    split evenly, as ``partition_method="type:MLPBlock"`` does when ``stages`` divides them."""
    per = spec["blocks"] // stages
    return range(1 + stage * per, 1 + (stage + 1) * per)


def torch_stage_module(spec: dict, stage: int, stages: int) -> nn.Module:
    """Virtual stage ``stage``'s layers as one ``nn.Sequential``; layer ``i`` seeded ``BASE_SEED + i``."""
    layers: list[nn.Module] = []
    if stage == 0:
        torch.manual_seed(BASE_SEED)
        layers.append(Embedding(spec["vocab"], spec["hidden"]))
    for i in stage_blocks(spec, stage, stages):
        torch.manual_seed(BASE_SEED + i)
        layers.append(MLPBlock(spec["hidden"], device_seconds(spec)))
    if stage == stages - 1:
        torch.manual_seed(BASE_SEED + spec["blocks"] + 1)
        layers.append(FinalNorm(spec["hidden"]))
        layers.append(Head(spec["vocab"], spec["hidden"]))
    return nn.Sequential(*layers)


# -- data ----------------------------------------------------------------------------------------
def micro_batches(spec: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batch: ``spec["micro_batches"]`` micro-batches of (ids, next-token labels), the same on every
    rank and every side (reused every step)."""
    gen = torch.Generator().manual_seed(BASE_SEED + 1)
    tokens = torch.randint(0, spec["vocab"], (spec["micro_batches"], spec["micro"], spec["seq"] + 1), generator=gen)
    return [(tokens[m, :, :-1].contiguous(), tokens[m, :, 1:].contiguous()) for m in range(spec["micro_batches"])]


def batch_iter(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    return iter(batch)


def samples_per_batch(spec: dict) -> int:
    return spec["micro"] * spec["micro_batches"]


def timed_batches(spec: dict, run_batch, count: int) -> tuple[list[float], list[float]]:
    """``count`` batches, the ranks aligned by a barrier before each: (seconds per batch, losses)."""
    times, losses = [], []
    for _ in range(count):
        dist.barrier()
        start = time.perf_counter()
        loss = run_batch()
        times.append(time.perf_counter() - start)
        losses.append(loss)
    return times, losses


# -- DeepSpeed (run by /tmp/dsvenv/bin/python) --------------------------------------------------------
def _ds_rank(rank: int, world: int, spec: dict, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(spec["threads"])
    try:
        import logging

        import deepspeed
        from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="gloo")
        config = {
            "train_micro_batch_size_per_gpu": spec["micro"], "gradient_accumulation_steps": spec["micro_batches"],
            "gradient_clipping": CLIP, "steps_per_print": 10**9, "wall_clock_breakdown": False,
            "zero_optimization": {"stage": 0},
        }
        module = PipelineModule(layer_specs(spec, LayerSpec, TiedLayerSpec), num_stages=world, loss_fn=lm_loss,
                                partition_method="type:MLPBlock", seed_layers=True, base_seed=BASE_SEED,
                                # its type: partition gives numpy ints, which its default seeding (random.seed)
                                # refuses on Python 3.11: seed torch with a plain int instead
                                seed_fn=lambda seed: torch.manual_seed(int(seed)))
        module.seed_layers = False  # seeded at build only, as the other sides (see SEEDING)
        opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], **ADAMW)
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=opt, config=config)
        batch = micro_batches(spec)

        def run_batch() -> float:
            return float(engine.train_batch(data_iter=batch_iter(batch)))

        timed_batches(spec, run_batch, spec["warmup"])
        times, losses = timed_batches(spec, run_batch, spec["rounds"] * spec["steps"])
        out = {"times": times, "losses": losses, "threads": torch.get_num_threads(),
               "parts": [int(p) for p in module.parts]}
    except Exception as exc:
        out = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300], "trace": traceback.format_exc()}
    queue.put((rank, out))
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_main(spec: dict) -> None:
    import torch.multiprocessing as mp

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "deepspeed", "_pipe_bench"])
    world = spec["world"]
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_ds_rank, args=(r, world, spec, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    for _ in range(world):
        rank, out = queue.get()
        results[rank] = out
    for p in procs:
        p.join()
    print("RESULT " + json.dumps({"ranks": [results[r] for r in range(world)]}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "deepspeed":
        sys.exit("usage: python _pipe_bench.py deepspeed '<json spec>'")
    import _pipe_bench  # by name, so the forked ranks find _ds_rank (PYTHONPATH has this directory)

    _pipe_bench.deepspeed_main(json.loads(sys.argv[2]))
