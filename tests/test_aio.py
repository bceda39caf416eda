"""zerospeed.ops.aio: bit-exact tensor <-> file round trips, the DeepSpeed aio_handle API, clear errors."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from zerospeed.config import load_config
from zerospeed.offload.nvme import SlabBuffers
from zerospeed.offload import aio_file
from zerospeed.ops.aio import AioShortReadError, AsyncIOHandle

ALIGN = 4096


def random_tensor(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bits of any dtype (floats may hold NaN patterns: compare with :func:`same_bits`)."""
    size = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=gen).view(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def misaligned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor whose address is NOT page-aligned (forces O_DIRECT bounce buffers)."""
    size = torch.empty((), dtype=dtype).element_size()
    base = torch.empty(numel + ALIGN, dtype=dtype)
    shift = next(i for i in range(1, ALIGN) if (base.data_ptr() + i * size) % ALIGN)
    return base[shift:shift + numel]


def direct_supported(directory: Path) -> bool:
    probe = directory / "probe"
    probe.touch()
    fd = aio_file.open_direct("read", str(probe))
    if fd >= 0:
        os.close(fd)
    return fd >= 0


@pytest.fixture
def aio():
    with AsyncIOHandle(block_size=64 * 1024, queue_depth=4) as handle:
        yield handle


CASES = [(1, torch.uint8), (3, torch.uint8), (4095, torch.uint8), (4096, torch.uint8), (4097, torch.uint8),
         ((1 << 20) + 1, torch.float32), (300_001, torch.bfloat16), (12_345, torch.float64)]
OFFSETS = [0, 1, 4095, 4096, 12_345]


@pytest.mark.parametrize("numel,dtype", CASES)
@pytest.mark.parametrize("memory", ["plain", "locked", "misaligned"])
def test_sync_round_trip_is_bit_exact_at_any_offset(aio, tmp_path, numel, dtype, memory):
    path = tmp_path / "f.bin"
    for i, offset in enumerate(OFFSETS):
        src = random_tensor(numel, dtype, seed=i)
        if memory == "locked":
            src = aio.new_cpu_locked_tensor(numel, dtype).copy_(src)
        nbytes = src.numel() * src.element_size()
        assert aio.sync_pwrite(src, path, offset) == nbytes
        with open(path, "rb") as f:  # parity with plain Python file I/O
            f.seek(offset)
            assert f.read(nbytes) == src.view(torch.uint8).numpy().tobytes()
        dst = {"plain": torch.empty(numel, dtype=dtype), "locked": aio.new_cpu_locked_tensor(numel, dtype),
               "misaligned": misaligned(numel, dtype)}[memory]
        assert aio.sync_pread(dst, str(path), offset) == nbytes
        assert same_bits(src, dst), (numel, dtype, offset)


def test_async_round_trip_of_300mb_of_unaligned_length(tmp_path):
    with AsyncIOHandle() as aio:
        src = random_tensor(300_000_003, torch.uint8)
        dst_plain, dst_locked = torch.empty_like(src), aio.new_cpu_locked_tensor(src.numel(), torch.uint8)
        assert aio.async_pwrite(src, tmp_path / "big.bin", 4097) == 0
        assert aio.wait() == 1
        assert aio.async_pread(dst_plain, tmp_path / "big.bin", 4097) == 0
        assert aio.async_pread(dst_locked, tmp_path / "big.bin", 4097) == 0
        assert aio.wait() == 2
    assert os.path.getsize(tmp_path / "big.bin") == 4097 + 300_000_003
    assert same_bits(src, dst_plain) and same_bits(src, dst_locked)


def test_many_requests_in_flight_share_one_file_without_truncating(aio, tmp_path):
    path = tmp_path / "shared.bin"
    sizes = [1, 5000, 3, 70_000, 4096, 123_457, 2, 300_000]
    srcs = [random_tensor(n, torch.uint8, seed=n) for n in sizes]
    offsets = [sum(sizes[:i]) + 7 * i for i in range(len(sizes))]  # unaligned, with gaps
    for src, off in zip(srcs, offsets, strict=True):
        assert aio.async_pwrite(src, path, off) == 0
    assert aio.wait() == len(srcs)
    assert aio.wait() == 0  # nothing left
    data = path.read_bytes()
    assert len(data) == offsets[-1] + sizes[-1]
    for src, off in zip(srcs, offsets, strict=True):
        assert data[off:off + src.numel()] == src.numpy().tobytes()
    dsts = [torch.empty_like(s) for s in srcs]
    for dst, off in zip(reversed(dsts), reversed(offsets), strict=True):
        aio.async_pread(dst, path, off)
    assert aio.wait() == len(srcs)
    assert all(same_bits(s, d) for s, d in zip(srcs, dsts, strict=True))


@pytest.mark.parametrize("mode", [{}, {"single_submit": True}, {"overlap_events": False},
                                  {"intra_op_parallelism": 3, "queue_depth": 1}, {"use_direct_io": False}])
def test_many_files_in_flight_in_every_mode(tmp_path, mode):
    srcs = [random_tensor(n, torch.bfloat16, seed=n) for n in (1, 40_000, 300_000, 1_000_003)]
    with AsyncIOHandle(block_size=32 * 1024, **mode) as aio:
        for i, src in enumerate(srcs):
            aio.async_pwrite(src, tmp_path / f"{i}.bin", 0)
        assert aio.wait() == len(srcs)
        dsts = [torch.empty_like(s) for s in srcs]
        for i, dst in enumerate(dsts):
            aio.async_pread(dst, tmp_path / f"{i}.bin", 0)
        assert aio.wait() == len(srcs)
    assert all(same_bits(s, d) for s, d in zip(srcs, dsts, strict=True))


def test_o_direct_is_used_zero_copy_for_aligned_tensors(tmp_path, monkeypatch):
    if not direct_supported(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    seen = []
    real = os.preadv

    def spy(fd, buffers, offset):
        direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
        seen.append((direct, memoryview(buffers[0]).nbytes, offset))
        return real(fd, buffers, offset)

    with AsyncIOHandle(block_size=1 << 20) as aio:
        src = random_tensor(4 << 20, torch.uint8)
        aio.sync_pwrite(src, tmp_path / "d.bin", 100)
        monkeypatch.setattr(os, "preadv", spy)
        dst = aio.new_cpu_locked_tensor(3 << 20, torch.uint8)
        aio.sync_pread(dst, tmp_path / "d.bin", 4096 * 5)  # aligned offset and memory
    assert same_bits(dst, src[4096 * 5 - 100:4096 * 5 - 100 + (3 << 20)])
    assert sorted(seen) == [(True, 1 << 20, 4096 * 5 + i * (1 << 20)) for i in range(3)]


def test_refused_o_direct_falls_back_to_buffered_and_is_remembered(tmp_path, monkeypatch):
    calls = []
    real_open = os.open

    def refusing_open(path, flags, mode=0o777, **kw):
        if flags & aio_file.O_DIRECT:
            calls.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(os, "open", refusing_open)
    src = random_tensor(1 << 20, torch.float32)
    dst = torch.empty_like(src)
    with AsyncIOHandle() as aio:
        aio.sync_pwrite(src, tmp_path / "a.bin")
        aio.sync_pread(dst, tmp_path / "a.bin")
        aio.sync_pread(dst, tmp_path / "a.bin")
    assert same_bits(src, dst)
    assert len(calls) == 1  # the file system's answer is remembered


def test_o_direct_io_rejected_by_kernel_is_redone_buffered(tmp_path, monkeypatch):
    if not direct_supported(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    real = os.pwrite
    rejected = []

    def picky_pwrite(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            rejected.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", picky_pwrite)
    src = random_tensor(5 << 20, torch.uint8)
    dst = torch.empty_like(src)
    with AsyncIOHandle(block_size=1 << 20, queue_depth=1) as aio:
        aio.sync_pwrite(src, tmp_path / "a.bin", 3)
        first = len(rejected)
        aio.sync_pwrite(src, tmp_path / "a.bin", 3)
        aio.sync_pread(dst, tmp_path / "a.bin", 3)
    assert same_bits(src, dst)
    assert first >= 1 and len(rejected) == first  # later requests no longer try O_DIRECT


def test_deepspeed_style_api_and_config(tmp_path):
    cfg = load_config({"train_batch_size": 1, "aio": {"block_size": 65536, "queue_depth": 4, "thread_count": 2,
                                                      "single_submit": True, "overlap_events": False}},
                      world_size=1)
    with AsyncIOHandle.from_config(cfg.aio) as aio:
        assert (aio.get_block_size(), aio.get_queue_depth(), aio.get_intra_op_parallelism(),
                aio.get_single_submit(), aio.get_overlap_events()) == (65536, 4, 2, True, False)
        empty = torch.empty(0)
        assert aio.async_pwrite(empty, tmp_path / "e.bin") == 0 and aio.wait() == 1
        assert aio.sync_pwrite(empty, tmp_path / "e.bin") == 0
    defaults = AsyncIOHandle()
    assert (defaults.get_block_size(), defaults.get_queue_depth(), defaults.get_intra_op_parallelism(),
            defaults.get_single_submit(), defaults.get_overlap_events()) == (1048576, 8, 1, False, True)
    defaults.close()
    with pytest.raises(RuntimeError, match="closed"):
        defaults.async_pread(torch.empty(1), tmp_path / "e.bin")
    with pytest.raises(ValueError, match="queue_depth=0"):
        AsyncIOHandle(queue_depth=0)
    with pytest.raises(ValueError, match="use_gds"):
        AsyncIOHandle.from_config({"use_gds": True})


def test_locked_tensors_have_deepspeeds_signature_and_free_semantics(tmp_path):
    with AsyncIOHandle() as aio:
        for dtype, numel in ((torch.uint8, 1), (torch.bfloat16, 5001), (torch.float32, 1 << 20)):
            t = aio.new_cpu_locked_tensor(numel, torch.empty(3, dtype=dtype))  # DeepSpeed: (num_elem, example)
            assert t.data_ptr() % ALIGN == 0 and t.dtype == dtype and t.shape == (numel,) and t.is_contiguous()
            assert aio.free_cpu_locked_tensor(t) is True
            assert t.untyped_storage().nbytes() == 0
            assert aio.free_cpu_locked_tensor(t) is False  # already freed
        named = aio.new_cpu_locked_tensor(num_elem=7, example_tensor=torch.empty(0, dtype=torch.float16))
        assert named.dtype == torch.float16 and named.numel() == 7
        assert aio.new_cpu_locked_tensor(5, torch.int64).dtype == torch.int64  # a dtype works too
        # as in DeepSpeed, tensors the handle did not make are left alone: False, memory untouched
        other = torch.arange(3.0)
        assert aio.free_cpu_locked_tensor(other) is False and other.tolist() == [0.0, 1.0, 2.0]
        assert aio.free_cpu_locked_tensor(named[1:]) is False and named.untyped_storage().nbytes() >= 14
        with pytest.raises(ValueError, match=r"num_elem=-1 must be a non-negative integer"):
            aio.new_cpu_locked_tensor(-1, torch.empty(0))
        with pytest.raises(ValueError, match=r"example_tensor='float' must be a tensor"):
            aio.new_cpu_locked_tensor(4, "float")


def _mapped(address: int) -> bool:
    """Whether ``address`` lies in one of this process's mappings (/proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if start <= address < end:
            return True
    return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists() or aio_file.MADV_HUGEPAGE is None,
                    reason="needs Linux's /proc/self/maps and transparent huge pages")
def test_locked_tensors_without_an_accelerator_are_huge_page_memory_unmapped_when_freed(tmp_path):
    """On CPU a locked tensor is io_memory: huge-page aligned, so an O_DIRECT block into it is one DMA
    segment; freeing it unmaps the memory at once (no other view holds it)."""
    with AsyncIOHandle() as aio:
        t = aio.new_cpu_locked_tensor(3 << 20, torch.float32)  # 12 MiB
        assert t.data_ptr() % aio_file.HUGE_PAGE == 0
        src = torch.randn(3 << 20)
        aio.sync_pwrite(src, tmp_path / "a.bin")
        assert aio.sync_pread(t, tmp_path / "a.bin") == 12 << 20 and torch.equal(t, src)
        address = t.data_ptr()
        assert _mapped(address)
        assert aio.free_cpu_locked_tensor(t) is True and t.numel() == 0
        assert not _mapped(address)


def test_a_locked_tensor_is_not_freed_under_an_io_in_flight(tmp_path, monkeypatch):
    (tmp_path / "a.bin").write_bytes(bytes(range(256)) * 64)
    gate, real = threading.Event(), os.preadv

    def held(fd, buffers, offset):
        gate.wait(10)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", held)
    with AsyncIOHandle() as aio:
        locked = aio.new_cpu_locked_tensor(3 * 4096, torch.uint8)
        aio.async_pread(locked[4096:8192], tmp_path / "a.bin")  # a slice: the I/O does not start at its base
        with pytest.raises(ValueError, match="still in flight; call wait"):
            aio.free_cpu_locked_tensor(locked)
        gate.set()
        assert aio.wait() == 1
        assert locked[4096:8192].tolist() == list(range(256)) * 16
        assert aio.free_cpu_locked_tensor(locked) is True


def test_missing_directory_and_missing_file_name_the_path(aio, tmp_path):
    missing = tmp_path / "no_such_dir" / "x.bin"
    with pytest.raises(FileNotFoundError, match="no_such_dir.*does not exist"):
        aio.async_pwrite(torch.ones(4), missing)
    with pytest.raises(FileNotFoundError, match=r"x\.bin.*does not exist"):
        aio.sync_pread(torch.ones(4), tmp_path / "x.bin")
    assert aio.wait() == 0


@pytest.mark.parametrize("numel,offset", [(10, 0), (3 << 20, 4096), (3 << 20, 5)])
def test_read_past_end_raises_never_zero_fills(aio, tmp_path, numel, offset):
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(range(256)) * ((offset + numel - 1) // 256 + 1))
    os.truncate(path, offset + numel - 1)  # one byte short
    dst = torch.full((numel,), 7, dtype=torch.uint8)
    aio.async_pread(dst, path, offset)
    with pytest.raises(AioShortReadError) as info:
        aio.wait()
    err = info.value
    assert (err.path, err.offset, err.expected, err.got) == (str(path), offset, numel, numel - 1)
    assert str(path) in str(err) and f"expected {numel} bytes at offset {offset}" in str(err)
    assert f"only {numel - 1} bytes" in str(err)


def test_wait_finishes_everything_then_raises_the_first_error(aio, tmp_path):
    good = random_tensor(200_000, torch.uint8)
    aio.async_pwrite(good, tmp_path / "a.bin", 0)
    aio.async_pread(torch.empty(10, dtype=torch.uint8), tmp_path / "a.bin", 199_995)  # past the end
    aio.async_pread(torch.empty(10, dtype=torch.uint8), tmp_path / "a.bin", 10**9)
    aio.async_pwrite(good, tmp_path / "b.bin", 0)
    with pytest.raises(AioShortReadError) as info:
        aio.wait()
    assert info.value.offset == 199_995 or info.value.offset == 10**9
    assert (tmp_path / "b.bin").read_bytes() == good.numpy().tobytes()  # the others completed
    assert aio.wait() == 0


def test_bad_tensors_are_refused_with_the_fix(aio, tmp_path):
    with pytest.raises(ValueError, match=r"contiguous.*\.contiguous\(\)"):
        aio.async_pwrite(torch.ones(4, 4).t(), tmp_path / "a.bin")
    with pytest.raises(ValueError, match="CPU tensor.*meta"):
        aio.async_pread(torch.empty(4, device="meta"), tmp_path / "a.bin")
    with pytest.raises(ValueError, match="offset=-1"):
        aio.async_pwrite(torch.ones(4), tmp_path / "a.bin", -1)
    assert aio.wait() == 0


@pytest.mark.parametrize("numel", [100, 4 << 20])
def test_full_disk_names_path_and_size(tmp_path, monkeypatch, numel):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    monkeypatch.setattr(os, "pwritev", full)
    with AsyncIOHandle(block_size=1 << 20) as aio:
        aio.async_pwrite(random_tensor(numel, torch.uint8), tmp_path / "full.bin", 1)
        with pytest.raises(OSError) as info:
            aio.wait()
    err = info.value
    assert err.errno == errno.ENOSPC
    assert "disk full" in str(err) and str(tmp_path / "full.bin") in str(err)
    assert f"{numel}-byte write at offset 1" in str(err)


def test_async_calls_return_before_the_io_is_done(tmp_path, monkeypatch):
    real = os.pwrite

    def slow(fd, data, offset):
        time.sleep(0.2)
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", slow)
    with AsyncIOHandle() as aio:
        start = time.perf_counter()
        aio.async_pwrite(torch.ones(10), tmp_path / "a.bin")
        assert time.perf_counter() - start < 0.15
        assert aio.wait() == 1 and time.perf_counter() - start >= 0.2


def test_plan_covers_every_byte_once_with_aligned_direct_pieces():
    for nbytes, offset, address in [(1, 0, 0), (4095, 1, 64), (10 << 20, 4097, 4096 * 3 - 1), (8 << 20, 0, 0),
                                    (5 << 20, 4096, 64)]:
        pieces = aio_file.plan_pieces(nbytes, offset, address, block_size=1 << 20, direct=True)
        assert [p.mem_start for p in pieces] == [sum(q.length for q in pieces[:i]) for i in range(len(pieces))]
        assert sum(p.length for p in pieces) == nbytes
        assert all(p.file_offset == offset + p.mem_start and 0 < p.length <= 1 << 20 for p in pieces)
        for p in pieces:
            if p.mode != "buffered":
                assert p.file_offset % ALIGN == 0 and p.length % ALIGN == 0
                assert p.mode == ("direct" if (address + p.mem_start) % ALIGN == 0 else "bounce")
            else:
                assert p.length < ALIGN
    assert {p.mode for p in aio_file.plan_pieces(5 << 20, 4096, 64, 1 << 20, True)} == {"bounce"}
    assert {p.mode for p in aio_file.plan_pieces(5 << 20, 4096, 0, 1 << 20, False)} == {"buffered"}


def _timed_writes(tmp_path, monkeypatch, **mode) -> list[tuple[str, float, float]]:
    """Write two 4-block tensors to two files with slow pwrites; returns (file, start, end) per block."""
    real = os.pwrite
    spans = []

    def slow(fd, data, offset):
        start = time.perf_counter()
        time.sleep(0.03)
        result = real(fd, data, offset)
        spans.append((os.readlink(f"/proc/self/fd/{fd}"), start, time.perf_counter()))
        return result

    monkeypatch.setattr(os, "pwrite", slow)
    with AsyncIOHandle(block_size=4096, queue_depth=4, use_direct_io=False, **mode) as aio:
        aio.async_pwrite(torch.ones(4 * 4096, dtype=torch.uint8), tmp_path / "a.bin")
        aio.async_pwrite(torch.ones(4 * 4096, dtype=torch.uint8), tmp_path / "b.bin")
        assert aio.wait() == 2
    return spans


def _overlap(spans, a: str, b: str) -> bool:
    return any(s1 < e2 and s2 < e1 for f1, s1, e1 in spans for f2, s2, e2 in spans
               if f1.endswith(a) and f2.endswith(b) and (s1, e1) != (s2, e2))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to map fds to files")
def test_single_submit_and_overlap_events_change_scheduling(tmp_path, monkeypatch):
    default = _timed_writes(tmp_path, monkeypatch)
    assert _overlap(default, "a.bin", "a.bin")  # blocks of one request run in parallel
    serial_requests = _timed_writes(tmp_path, monkeypatch, overlap_events=False)
    assert not _overlap(serial_requests, "a.bin", "b.bin")
    assert _overlap(serial_requests, "a.bin", "a.bin")
    serial_blocks = _timed_writes(tmp_path, monkeypatch, single_submit=True)
    assert not _overlap(serial_blocks, "a.bin", "a.bin") and not _overlap(serial_blocks, "b.bin", "b.bin")
    assert _overlap(serial_blocks, "a.bin", "b.bin")  # but the two requests do overlap


def test_full_disk_found_while_reserving_space_fails_at_submit(tmp_path, monkeypatch):
    if not direct_supported(tmp_path):
        pytest.skip("space is reserved only for O_DIRECT writes")

    def no_space(fd, mode, offset, length):
        ctypes.set_errno(errno.ENOSPC)
        return -1

    monkeypatch.setattr(aio_file, "_FALLOCATE", no_space)
    with AsyncIOHandle() as aio:
        with pytest.raises(OSError, match=r"disk full.*1048576 bytes at offset 0 of .*big\.bin") as info:
            aio.async_pwrite(torch.ones(1 << 20, dtype=torch.uint8), tmp_path / "big.bin")
        assert info.value.errno == errno.ENOSPC and aio.wait() == 0


def _smaps_entry(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``address``."""
    entry: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            start, end = (int(x, 16) for x in head.split("-"))
            entry = {} if start <= address < end else None
        elif entry is not None and ":" in line:
            key, value = line.split(":", 1)
            entry[key] = value.strip()
            if key == "VmFlags":
                return entry
    raise AssertionError(f"no mapping holds address {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps") or "[never]" in
                    (Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
                     if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled") else "[never]"),
                    reason="needs Linux transparent huge pages")
@pytest.mark.parametrize("kind", ["bounce buffer", "NVMe slab buffer"])
def test_io_buffers_are_private_and_may_use_huge_pages(kind):
    # shared anonymous memory (shmem) read 1.5x slower; 4 KiB pages scatter a 1 MiB block over more
    # DMA segments than a virtio disk takes per request, which split every read in two
    if kind == "bounce buffer":
        scratch = aio_file.Scratch(1 << 20)
        address = scratch.address
        assert scratch.size == len(scratch.view) == 1 << 20
    else:
        buffers = SlabBuffers(keep=1)
        buffers.fit(3 << 20)
        buffer = buffers.take()
        address = buffer.data_ptr()
        assert buffer.numel() == 3 << 20
    fields = _smaps_entry(address)
    assert "sh" not in fields["VmFlags"].split() and "hg" in fields["VmFlags"].split()
    assert fields["THPeligible"] == "1" and address % (2 << 20) == 0
    small, offset = aio_file.io_memory(8192)  # below half a huge page: private, not rounded up
    small_address = ctypes.addressof(ctypes.c_char.from_buffer(small))
    assert offset == 0 and len(small) == 8192 and "sh" not in _smaps_entry(small_address)["VmFlags"].split()


@pytest.mark.skipif(shutil.which("fio") is None, reason="benchmarks/bench_aio.py compares against fio")
def test_bench_aio_compares_ordinary_and_aligned_tensors_with_fio(tmp_path):
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_aio.py"
    out = subprocess.run([sys.executable, str(bench), "--mib", "4", "--rounds", "2", "--no-deepspeed",
                          "--dir", str(tmp_path)], check=True, capture_output=True, text=True, timeout=300).stdout
    assert "tensors: ordinary at page offset" in out and "aligned at page offset 0/0" in out
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in out.splitlines()
            if line.split()[:1] in (["ordinary"], ["aligned"])}
    assert set(rows) == {(kind, op) for kind in ("ordinary", "aligned") for op in ("write", "read")}
    for cells in rows.values():  # fio GB/s, ours GB/s, ours / fio
        assert len(cells) == 3 and all(float(c) > 0 for c in cells)
