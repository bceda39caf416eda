"""Checkpoint save / load bandwidth against a plain sequential write and read of the same bytes.

One rank at ZeRO stage 0 trains a stack of fp32 linear layers with AdamW for one step, so its saved
state is 12 bytes per parameter (fp32 master + exp_avg + exp_avg_sq): ~85M parameters make ~1 GB.
One rank is the like-for-like comparison with the single-stream baseline: with several ranks every
rank writes its own file in parallel, which on one disk (and 2 cores here) measures contention, not
the checkpoint code. ``--world-size 2 --stage 3`` is there to look at that case anyway (the baseline
stays one stream of the same total bytes).

Each round, in the same process and on the same disk (``--dir``, default the system temp dir):

  baseline write  one file of the checkpoint's size, written sequentially in 64 MB writes, fsync
  baseline read   that file read back sequentially after dropping its pages from the page cache
  write-behind    the same bytes through the checkpoint's StreamingWriter (sync_file_range every
                  32 MB, so the disk writes while later bytes are copied in; then fsync): shows how
                  much of the save's lead over the plain baseline is that overlap
  save            engine.save_checkpoint (safetensors per rank + manifest, fsync, atomic rename)
  load            engine.load_checkpoint of it, its pages dropped first
  torch.save      torch.save of {module state_dict, optimizer state_dict} to one file + fsync (a peer)
  torch.load      torch.load of that file, pages dropped first
  async save      engine.save_checkpoint(async_save=True): the time until it returns (training is
                  blocked) and until engine.wait_for_checkpoint() returns (the whole save)

The cost of the checkpoint's integrity checks (a CRC-32 of every tensor, computed while writing and
checked while loading), in the same rounds:

  save/load (crc32 off)   the same save and load with checkpoint.checksum.crc32 (ISA-L's, else zlib's)
                  replaced by a stub returning 0 (the manifest then records zeros, which the load "checks")
  write-behind + crc32    the write-behind row with the writer's checksums on
  crc32 in memory         checkpoint.checksum.crc32 over the same byte count, already in memory (no disk)

``--crc-thread on|off`` forces ``safetensors_io.CRC_THREAD`` (each piece's CRC on a helper thread while
the next piece is written or read, or inline) for the save/load rows; ``--crc-thread both`` runs the
save and load with the CRCs threaded and inline in the same rounds (rows "(crc32 threaded)" and "(crc32
inline)", beside "(crc32 off)"), so the two compare under the same machine load.

Pages are dropped with posix_fadvise(POSIX_FADV_DONTNEED) on each file after its fsync (per file,
without root; /proc/sys/vm/drop_caches would also evict the other users' caches). GB/s is 1e9
bytes/s of the bytes on disk; ratios are to the baseline write (saves) or read (loads). Prints the
median over ``--rounds`` rounds and each round's figures, then the issue's target (save >= 70% of
the baseline write) with pass/fail.

    python benchmarks/bench_checkpoint.py [--quick] [--size-gb 1.0] [--rounds 3] [--dir DIR]
        [--world-size 1 --stage 0] [--no-torch] [--crc-thread auto|on|off|both]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import contextlib
import tempfile
import time
from typing import Iterator

import torch
from torch import nn

from zerospeed.testing import run_distributed

WRITE_BLOCK = 64 * 1024 * 1024
BYTES_PER_PARAM = 12  # fp32 master + AdamW exp_avg + exp_avg_sq
TARGET = 0.70


def _drop_cache(path: str) -> None:
    """Evict a file's (clean) pages, so the next read comes from the disk."""
    paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _baseline_write(path: str, nbytes: int, block: memoryview) -> float:
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left:
            left -= f.write(block[: min(left, len(block))])
        os.fsync(f.fileno())
    return time.perf_counter() - start


def _baseline_write_behind(path: str, nbytes: int, block: memoryview, checksums: bool = False) -> float:
    """The same bytes through the checkpoint's writer (write-behind, then fsync): what the disk
    gives when copying in and writing out overlap, which the plain baseline leaves serial."""
    from zerospeed.checkpoint.safetensors_io import StreamingWriter

    data = torch.frombuffer(block, dtype=torch.uint8)
    start = time.perf_counter()
    with StreamingWriter(path, [("bytes", torch.uint8, (nbytes,))], checksums=checksums) as writer:
        left = nbytes
        while left:
            writer.write(data[: min(left, data.numel())])
            left -= min(left, data.numel())
    return time.perf_counter() - start


def _crc_in_memory(nbytes: int, block: memoryview) -> float:
    """The checkpoints' CRC-32 over ``nbytes`` bytes already in memory (the checksum's own cost, no disk)."""
    from zerospeed.checkpoint import checksum

    start = time.perf_counter()
    crc, left = 0, nbytes
    while left:
        crc = checksum.crc32(block[: min(left, len(block))], crc)
        left -= min(left, len(block))
    return time.perf_counter() - start


@contextlib.contextmanager
def _crc_off() -> Iterator[None]:
    """The checkpoints' CRC-32 (``checksum.crc32``, which every checkpoint module calls through its module)
    stubbed to 0 (saves record 0, loads compare 0 with 0): the same save and load without the cost of the
    checksums, for the A/B rows."""
    from zerospeed.checkpoint import checksum

    original = checksum.crc32
    checksum.crc32 = lambda data, value=0: 0  # type: ignore[assignment]
    try:
        yield
    finally:
        checksum.crc32 = original  # type: ignore[assignment]


@contextlib.contextmanager
def _crc_thread(threaded: bool | None) -> Iterator[None]:
    """``safetensors_io.CRC_THREAD`` forced to ``threaded`` (None: as the machine sets it)."""
    from zerospeed.checkpoint import safetensors_io

    saved = safetensors_io.CRC_THREAD
    if threaded is not None:
        safetensors_io.CRC_THREAD = threaded
    try:
        yield
    finally:
        safetensors_io.CRC_THREAD = saved


def _variants(crc_thread: str) -> list[tuple[str, bool, bool | None]]:
    """The save/load variants of a round: (row suffix, checksums on, CRC_THREAD forced or None)."""
    off = (" (crc32 off)", False, None)
    if crc_thread == "both":
        return [(" (crc32 threaded)", True, True), (" (crc32 inline)", True, False), off]
    return [("", True, {"auto": None, "on": True, "off": False}[crc_thread]), off]


def _baseline_read(path: str, buffer: memoryview) -> float:
    _drop_cache(path)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass
    return time.perf_counter() - start


def _torch_save(path: str, state: dict) -> float:
    start = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start


def _model(params: int, width: int) -> nn.Module:
    layers = max(1, round(params / (width * width)))
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    model = model.to_empty(device="cpu")
    base = torch.randn(width, width, generator=torch.Generator().manual_seed(0)) * width ** -0.5
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            torch.mul(base, 1.0 + i / 64, out=p)
    return model


def _bench(size_gb: float, width: int, stage: int, rounds: int, workdir: str, with_torch: bool,
           crc_thread: str = "auto") -> dict:
    import zerospeed

    log = logging.getLogger("zerospeed")  # warnings only, not the resolved config dump at INFO
    log.addHandler(logging.StreamHandler())
    log.setLevel(logging.WARNING)
    comm_rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    model = _model(int(size_gb * 1e9 / BYTES_PER_PARAM), width)
    n_params = sum(p.numel() for p in model.parameters())  # before ZeRO-3 empties the parameters
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": stage}}
    engine, *_ = zerospeed.initialize(model=model, config=config)
    engine.backward(engine(torch.full((1, width), 1e-3)).sum())  # one step: AdamW states exist
    engine.step()
    ckpt = os.path.join(workdir, "ckpt")
    engine.save_checkpoint(ckpt, tag="warmup")  # warm the code paths; its size is the baseline's
    ckpt_bytes = _dir_bytes(os.path.join(ckpt, "warmup"))
    lead = comm_rank == 0
    torch.distributed.barrier()
    if lead:
        shutil.rmtree(os.path.join(ckpt, "warmup"))
    block = memoryview(bytearray(os.urandom(1 << 20)) * (WRITE_BLOCK >> 20))
    rows: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        rows.setdefault(name, []).append(seconds)

    for r in range(rounds):
        if lead:
            base = os.path.join(workdir, "baseline.bin")
            add("baseline write", _baseline_write(base, ckpt_bytes, block))
            add("baseline read", _baseline_read(base, block))
            os.remove(base)
            add("write-behind write", _baseline_write_behind(base, ckpt_bytes, block))
            os.remove(base)
            add("write-behind + crc32", _baseline_write_behind(base, ckpt_bytes, block, checksums=True))
            os.remove(base)
            add("crc32 in memory", _crc_in_memory(ckpt_bytes, block))
        # with and without the checksums (threaded and inline), in rotating order from round to round
        variants = _variants(crc_thread)
        for v, (suffix, crc, threaded) in enumerate(variants[r % len(variants):] + variants[:r % len(variants)]):
            torch.distributed.barrier()
            tag = f"round{r}-{v}"
            with contextlib.nullcontext() if crc else _crc_off(), _crc_thread(threaded):
                start = time.perf_counter()
                engine.save_checkpoint(ckpt, tag=tag)
                add("save" + suffix, time.perf_counter() - start)
                torch.distributed.barrier()
                if lead:
                    _drop_cache(os.path.join(ckpt, tag))
                torch.distributed.barrier()
                start = time.perf_counter()
                engine.load_checkpoint(ckpt, tag=tag)
                add("load" + suffix, time.perf_counter() - start)
            torch.distributed.barrier()
            if lead:
                shutil.rmtree(os.path.join(ckpt, tag))
        if with_torch:
            path = os.path.join(workdir, f"torch{comm_rank}.pt")
            state = {"module": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict()}
            add("torch.save", _torch_save(path, state))
            del state
            _drop_cache(path)
            start = time.perf_counter()
            loaded = torch.load(path, map_location="cpu", weights_only=True)
            add("torch.load", time.perf_counter() - start)
            del loaded
            add("torch.save bytes", float(os.path.getsize(path)))
            os.remove(path)
        torch.distributed.barrier()
        tag = f"async{r}"
        start = time.perf_counter()
        engine.save_checkpoint(ckpt, tag=tag, async_save=True)
        add("async save (returns)", time.perf_counter() - start)
        engine.wait_for_checkpoint()
        add("async save (total)", time.perf_counter() - start)
        torch.distributed.barrier()
        if lead:
            shutil.rmtree(os.path.join(ckpt, tag))
        torch.distributed.barrier()
    return {"rows": rows, "bytes": ckpt_bytes, "params": n_params, "world": world}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="saved state size (12 bytes per parameter)")
    parser.add_argument("--quick", action="store_true", help="0.1 GB, 2 rounds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=4096, help="layer width (the model is width x width layers)")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch.save / torch.load peer")
    parser.add_argument("--crc-thread", choices=["auto", "on", "off", "both"], default="auto",
                        help="CRC-32s on a helper thread (on), inline (off), as the machine sets it (auto), or "
                             "both in the same rounds (both)")
    args = parser.parse_args()
    if args.quick:
        args.size_gb, args.rounds, args.width = 0.1, 2, 1024
    workdir = tempfile.mkdtemp(prefix="zerospeed-bench-ckpt-", dir=args.dir)
    try:
        results = run_distributed(_bench, args.world_size, args.size_gb, args.width, args.stage, args.rounds,
                                  workdir, not args.no_torch, args.crc_thread, timeout=3600, threads_per_rank=1)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    lead = results[0]
    rows = {k: list(v) for k, v in lead["rows"].items()}
    for other in results[1:]:  # a collective save or load takes as long as its slowest rank
        for name in [n for n in rows if n.startswith(("save", "load", "async save"))]:
            rows[name] = [max(a, b) for a, b in zip(rows[name], other["rows"][name])]
    nbytes = lead["bytes"]
    torch_bytes = int(rows.pop("torch.save bytes", [nbytes])[0]) * lead["world"]
    print(f"checkpoint of {lead['params'] / 1e6:.1f}M fp32 params + AdamW states, {lead['world']} rank(s), "
          f"ZeRO stage {args.stage}: {nbytes / 1e9:.3f} GB on disk in {workdir.rsplit('/', 1)[0]}; "
          f"torch {torch.__version__}; median of {args.rounds} rounds (each round's GB/s in brackets)")
    base_write = statistics.median(rows["baseline write"])
    base_read = statistics.median(rows["baseline read"])
    print(f"{'operation':<22}{'bytes':>14}{'seconds':>9}{'GB/s':>7}{'vs baseline':>13}   rounds GB/s")
    for name, times in rows.items():
        size = torch_bytes if name.startswith("torch") else nbytes
        operation = name.split(" (")[0]  # not its variant: "threaded" is no read
        reference = base_read if "read" in operation or "load" in operation else base_write
        median = statistics.median(times)
        ratio = (size / median) / (nbytes / reference)
        each = " ".join(f"{size / t / 1e9:.2f}" for t in times)
        print(f"{name:<22}{size:>14,}{median:>9.2f}{size / median / 1e9:>7.2f}{ratio:>12.0%}   [{each}]")
    med = {name: statistics.median(times) for name, times in rows.items()}
    shipped = [suffix for suffix, crc, _ in _variants(args.crc_thread) if crc]
    for suffix in shipped:
        save_ratio = (nbytes / med["save" + suffix]) / (nbytes / base_write)
        load_ratio = (nbytes / med["load" + suffix]) / (nbytes / base_read)
        print(f"target: save{suffix} >= {TARGET:.0%} of the baseline write: {save_ratio:.0%} "
              f"{'PASS' if save_ratio >= TARGET else 'FAIL'}; load{suffix} vs baseline read: {load_ratio:.0%}")
    for suffix in shipped:
        save, load = med["save" + suffix] / med["save (crc32 off)"], med["load" + suffix] / med["load (crc32 off)"]
        print(f"checksums{suffix or ' (crc32 per tensor)'}: save {save - 1:+.0%} time, load {load - 1:+.0%} "
              f"time against the same with crc32 off")
    from zerospeed.checkpoint import checksum

    print(f"crc32 ({checksum.IMPLEMENTATION}) in memory {nbytes / med['crc32 in memory'] / 1e9:.2f} GB/s vs the plain disk write "
          f"{nbytes / base_write / 1e9:.2f} GB/s; write-behind "
          f"{med['write-behind + crc32'] / med['write-behind write'] - 1:+.0%} time with crc32 "
          f"(CRC_THREAD as the machine sets it)")


if __name__ == "__main__":
    sys.exit(main())
