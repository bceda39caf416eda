"""Tensor write and cold-read GB/s: zerospeed's AsyncIOHandle against fio and DeepSpeed's aio handle.

Method: 1 GiB per transfer, for two kinds of tensor:

* ``ordinary``: ``torch.randn`` written, read back into a ``torch.empty`` tensor (PyTorch puts large
  tensors 64 bytes past a page boundary, so O_DIRECT has to bounce their bytes through aligned memory);
* ``aligned``: tensors from ``new_cpu_locked_tensor`` (page-aligned: O_DIRECT straight into them).

Each round runs, in a rotating order, fio (libaio, 1 MiB blocks, iodepth 8, O_DIRECT, buffers on
huge pages when hugetlb pages are reserved: what this disk can do), DeepSpeed 0.19.8's ``aio_handle``
(1 MiB blocks, queue depth 8, in a long-lived ``/tmp/dsvenv/bin/python`` subprocess; its op compiles
for minutes on first use) and ours with the same settings. A write is timed up to its ``fsync``; the
page cache is dropped before every read (``/proc/sys/vm/drop_caches`` when writable, and
``posix_fadvise(DONTNEED)`` on the file), and every read is checked bit-exact afterwards. The disk
and CPUs of this machine are shared and noisy, so the table gives the median over rounds, and each
ratio is the median of the per-round ratios (ours against fio and DeepSpeed of the same round).
Destination tensors are allocated and touched once before timing: a first touch of fresh memory
costs page faults here (seconds per GiB on this VM), which are not I/O.

Command (as root, reserving 32 MiB of hugetlb pages for fio's buffers while it runs):
    echo 16 > /proc/sys/vm/nr_hugepages
    .venv/bin/python benchmarks/bench_aio.py [--rounds 5] [--mib 1024] [--dir DIR] [--no-deepspeed]
        [--block-size 1048576] [--queue-depth 8]
    echo 0 > /proc/sys/vm/nr_hugepages
``--dir`` picks where files go (default: a temporary directory under the current directory).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Protocol

import torch

from bench_checkpoint import _drop_cache as evict_file_pages  # fsync + fadvise(DONTNEED), same script dir
from zerospeed.checkpoint.layout import fsync_dir
from zerospeed.ops.aio import AsyncIOHandle

MIB = 1 << 20
DS_PYTHON = "/tmp/dsvenv/bin/python"
KINDS = ("ordinary", "aligned")
OPS = ("write", "read")


def drop_cache(path: Path) -> None:
    """Evict ``path`` from the page cache so reads hit the disk (all caches too, when allowed)."""
    evict_file_pages(str(path))
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError:
        pass  # not root: the per-file fadvise above is what evicts this file


class System(Protocol):
    """One way of moving a tensor: seconds for a write (to fsync) or a cold read of one kind of tensor."""

    name: str

    def run(self, op: str, kind: str, path: Path) -> float: ...


def free_hugetlb_bytes() -> int:
    """Bytes of reserved, free hugetlb pages (``/proc/sys/vm/nr_hugepages``); 0 when unknown."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        return int(info["HugePages_Free"]) * int(info["Hugepagesize"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0


class Fio:
    """fio's own sequential job (the disk's figure); the tensor kind does not apply.

    Its buffers are on huge pages (``--iomem=shmhuge``) when enough hugetlb pages are reserved: with
    fio's default malloc'd 4 KiB pages, a 1 MiB I/O needs more DMA segments than this VM's virtio disk
    takes per request (254), is split in two, and fio read 0.6-1.2 GB/s, against 1.5-1.9 GB/s on huge
    pages."""

    name = "fio"

    def __init__(self, nbytes: int, block: int, depth: int):
        self.nbytes, self.block, self.depth = nbytes, block, depth
        self.huge = free_hugetlb_bytes() >= block * depth + (4 << 20)
        self.memory = "huge pages (--iomem=shmhuge)" if self.huge else (
            "malloc (reserve hugetlb pages, e.g. echo 16 > /proc/sys/vm/nr_hugepages, for its best figure)")

    def run(self, op: str, kind: str, path: Path) -> float:
        out = subprocess.run(["fio", "--name=seq", f"--rw={op}", f"--bs={self.block}", f"--iodepth={self.depth}",
                              "--ioengine=libaio", "--direct=1", f"--size={self.nbytes}", f"--filename={path}",
                              "--end_fsync=1", "--output-format=json"] + (["--iomem=shmhuge"] if self.huge else []),
                             check=True, capture_output=True, text=True).stdout
        return self.nbytes / json.loads(out)["jobs"][0][op]["bw_bytes"]


class Ours:
    """zerospeed's AsyncIOHandle in this process."""

    name = "zerospeed"

    def __init__(self, nbytes: int, block: int, depth: int):
        self.handle = AsyncIOHandle(block_size=block, queue_depth=depth)
        numel = nbytes // 4
        src = torch.randn(numel)
        aligned_src = self.handle.new_cpu_locked_tensor(numel, src)
        aligned_src.copy_(src)
        self.tensors = {"ordinary": (src, torch.zeros(numel)),
                        "aligned": (aligned_src, self.handle.new_cpu_locked_tensor(numel, src).zero_())}

    def addresses(self) -> str:
        return ", ".join(f"{kind} at page offset {src.data_ptr() % 4096}/{dst.data_ptr() % 4096}"
                         for kind, (src, dst) in self.tensors.items())

    def run(self, op: str, kind: str, path: Path) -> float:
        src, dst = self.tensors[kind]
        start = time.perf_counter()
        if op == "write":
            self.handle.async_pwrite(src, path)
            self.handle.wait()
            fsync_dir(str(path))  # opens read-only and fsyncs: works for a file too
        else:
            self.handle.async_pread(dst, path)
            self.handle.wait()
        seconds = time.perf_counter() - start
        if op == "read":
            if not torch.equal(src, dst):
                raise SystemExit(f"zerospeed: {kind} round trip is not bit-exact")
            dst.zero_()
        return seconds


DS_SERVER = r"""
import json, os, sys, time, torch
from deepspeed.ops.op_builder import AsyncIOBuilder
nbytes, block, depth = (int(a) for a in sys.argv[1:4])
h = AsyncIOBuilder().load(verbose=False).aio_handle(block, depth, False, True, 1)
numel = nbytes // 4
src = torch.randn(numel)
aligned_src = h.new_cpu_locked_tensor(numel, src)
aligned_src.copy_(src)
tensors = {"ordinary": (src, torch.zeros(numel)),
           "aligned": (aligned_src, h.new_cpu_locked_tensor(numel, src).zero_())}
print("@@", json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    src, dst = tensors[cmd["kind"]]
    t = time.perf_counter()
    if cmd["op"] == "write":
        h.async_pwrite(src, cmd["path"]); h.wait()
        fd = os.open(cmd["path"], os.O_RDONLY); os.fsync(fd); os.close(fd)
    else:
        h.async_pread(dst, cmd["path"]); h.wait()
    seconds = time.perf_counter() - t
    ok = cmd["op"] == "write" or bool(torch.equal(src, dst))
    if cmd["op"] == "read":
        dst.zero_()
    print("@@", json.dumps({"seconds": seconds, "ok": ok}), flush=True)
"""


class DeepSpeed:
    """DeepSpeed's aio_handle in a long-lived interpreter of its own venv (loaded and allocated once)."""

    name = "DeepSpeed"

    def __init__(self, nbytes: int, block: int, depth: int):
        self.proc = subprocess.Popen([DS_PYTHON, "-c", DS_SERVER, str(nbytes), str(block), str(depth)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._reply()

    def _reply(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        while line and not line.startswith("@@ "):  # DeepSpeed's own log lines
            line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"DeepSpeed's aio_handle did not start or died (exit code {self.proc.wait()}); "
                             f"run {DS_PYTHON} -c 'from deepspeed.ops.op_builder import AsyncIOBuilder; "
                             f"AsyncIOBuilder().load()' to see why, or pass --no-deepspeed")
        return json.loads(line[3:])

    def run(self, op: str, kind: str, path: Path) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, "kind": kind, "path": str(path)}) + "\n")
        self.proc.stdin.flush()
        reply = self._reply()
        if not reply["ok"]:
            raise SystemExit(f"DeepSpeed: {kind} round trip is not bit-exact")
        return reply["seconds"]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def one_round(systems: list[System], index: int, workdir: Path, nbytes: int) -> dict[tuple[str, str, str], float]:
    """Every system writes then cold-reads each kind once; GB/s by (system, kind, op). The order of
    the systems rotates from round to round so none is always first after the disk's idle time."""
    shift = index % len(systems)
    result = {}
    for system in systems[shift:] + systems[:shift]:
        for kind in (KINDS[:1] if isinstance(system, Fio) else KINDS):
            path = workdir / f"{system.name}-{kind}.bin"
            path.unlink(missing_ok=True)
            for op in OPS:
                if op == "read":
                    drop_cache(path)
                result[system.name, kind, op] = nbytes / system.run(op, kind, path) / 1e9
            path.unlink()
    return result


def report(rounds: list[dict[tuple[str, str, str], float]], names: list[str]) -> None:
    """Median GB/s per row and the median per-round ratio of ours to fio and to DeepSpeed."""
    def gbps(name: str, kind: str, op: str) -> list[float]:
        return [r[name, "ordinary" if name == "fio" else kind, op] for r in rounds]

    print(f"\nmedian of {len(rounds)} rounds, GB/s (ratio: median of per-round ratios)")
    print(f"{'tensor':<9} {'op':<6} {'fio':>6} " + "".join(f"{n:>10}" for n in names if n != "fio")
          + "   zerospeed/fio  zerospeed/DeepSpeed")
    for kind in KINDS:
        for op in OPS:
            ours = gbps("zerospeed", kind, op)
            cells = "".join(f"{statistics.median(gbps(n, kind, op)):10.2f}" for n in names if n != "fio")
            line = f"{kind:<9} {op:<6} {statistics.median(gbps('fio', kind, op)):6.2f} {cells}"
            for other in ("fio", "DeepSpeed"):
                if other in names:
                    ratio = statistics.median(o / b for o, b in zip(ours, gbps(other, kind, op), strict=True))
                    line += f"   {ratio:13.2f}" if other == "fio" else f"  {ratio:19.2f}"
            print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="rounds of every system and tensor kind (median shown)")
    ap.add_argument("--mib", type=int, default=1024, help="MiB per transfer")
    ap.add_argument("--dir", type=Path, default=None, help="directory for the test files (default: temp dir here)")
    ap.add_argument("--no-deepspeed", action="store_true", help=f"skip DeepSpeed's aio_handle ({DS_PYTHON})")
    ap.add_argument("--block-size", type=int, default=MIB, help="block size of both handles and fio")
    ap.add_argument("--queue-depth", type=int, default=8, help="queue depth of both handles and fio's iodepth")
    args = ap.parse_args()
    nbytes = args.mib * MIB
    if shutil.which("fio") is None:
        raise SystemExit("fio is not installed (apt-get install fio); it is the disk's reference figure")
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="bench_aio_", dir=args.dir or Path.cwd()))
    settings = (nbytes, args.block_size, args.queue_depth)
    ours, fio = Ours(*settings), Fio(*settings)
    systems: list[System] = [fio, ours]
    if not args.no_deepspeed:
        if not os.path.exists(DS_PYTHON):
            raise SystemExit(f"{DS_PYTHON} not found; build DeepSpeed's venv there or pass --no-deepspeed")
        systems.append(DeepSpeed(*settings))
    names = [s.name for s in systems]
    print(f"{args.mib} MiB per transfer in {workdir}; block {args.block_size}, queue depth {args.queue_depth}; "
          f"{ours.handle!r}; tensors: {ours.addresses()}; fio buffers: {fio.memory}; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    rounds = []
    try:
        for index in range(args.rounds):
            rounds.append(one_round(systems, index, workdir, nbytes))
            print(f"round {index + 1}: " + "  ".join(f"{n} {k[:3]} {op[0]} {v:.2f}" for (n, k, op), v
                                                    in sorted(rounds[-1].items())), flush=True)
        report(rounds, names)
        print(f"load average at the end {os.getloadavg()[0]:.1f}")
    finally:
        for system in systems:
            if isinstance(system, DeepSpeed):
                system.close()
        ours.handle.close()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
