"""NVMe tier mechanics: run directories and slabs swapped through files (with an in-test I/O handle
that performs each request at once, so the logic is tested apart from the async engine)."""

from __future__ import annotations

import ctypes
import errno
import gc
from pathlib import Path
from typing import Any

import pytest
import torch

from zerospeed.offload.nvme import NvmeSpaceError, RunDirectory, SwappedSlabs


def _buffer(tensor: torch.Tensor) -> Any:
    """The tensor's bytes as a writable buffer, without numpy (which would pin the storage's size)."""
    return (ctypes.c_char * (tensor.numel() * tensor.element_size())).from_address(tensor.data_ptr())


class ImmediateIO:
    """The AsyncIOHandle calls the slabs use, done synchronously; records the requests."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        self.pending = 0

    def async_pwrite(self, tensor: torch.Tensor, path: str, offset: int = 0) -> int:
        with open(path, "r+b" if Path(path).exists() else "wb") as f:
            f.seek(offset)
            f.write(bytes(_buffer(tensor)))
        self.log.append(("write", Path(path).name))
        self.pending += 1
        return 0

    def async_pread(self, tensor: torch.Tensor, path: str, offset: int = 0) -> int:
        nbytes = tensor.numel() * tensor.element_size()
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(nbytes)
        if len(data) != nbytes:
            raise OSError(f"short read of {path}")
        ctypes.memmove(tensor.data_ptr(), data, nbytes)
        self.log.append(("read", Path(path).name))
        self.pending += 1
        return 0

    def wait(self) -> int:
        done, self.pending = self.pending, 0
        return done

    def submit_pread(self, tensor: torch.Tensor, path: str, offset: int = 0) -> "Done":
        self.async_pread(tensor, path, offset)
        return Done(self.log, Path(path).name)

    def submit_pwrite(self, tensor: torch.Tensor, path: str, offset: int = 0) -> "Done":
        self.async_pwrite(tensor, path, offset)
        return Done(self.log, Path(path).name)


class Done:
    """A request that finished when it was submitted; logs when someone waits for it."""

    def __init__(self, log: list[tuple[str, str]], name: str):
        self.log, self.name = log, name

    def done(self) -> bool:
        return True

    def wait(self) -> int:
        self.log.append(("wait", self.name))
        return 0


def _tensors(sizes: list[int]) -> list[torch.Tensor]:
    return [torch.arange(n, dtype=torch.float32) + 1000 * i for i, n in enumerate(sizes)]


def _slabs(tmp_path: Path, sizes: list[int], lookahead: int = 1, tensors: list[torch.Tensor] | None = None,
           attach: list[list[torch.Tensor]] | None = None) -> tuple[SwappedSlabs, list[torch.Tensor], ImmediateIO]:
    directory = RunDirectory(tmp_path, "run-a", rank=0)
    tensors = tensors if tensors is not None else _tensors(sizes)
    originals = [t.clone() for t in tensors]
    io = ImmediateIO()
    return SwappedSlabs(tensors, directory, io, lookahead=lookahead, attach=attach), originals, io


def test_slabs_round_trip_and_views_stay_valid(tmp_path: Path) -> None:
    tensors = _tensors([5, 4096 + 3, 1])
    view = tensors[1][10:20].view(2, 5)  # like an optimizer's state tensor or a master piece
    slabs, originals, io = _slabs(tmp_path, [], tensors=tensors, attach=[[], [view], []])
    assert slabs.resident == [False, False, False]
    assert view.numel() == 0  # while swapped out a stray read is a shape error, not freed memory
    with pytest.raises(ValueError, match="attached tensors must be contiguous views"):
        slabs.swap_in([0])
        slabs.attach(0, torch.zeros(3))
    slabs.swap_out([0])
    assert all(s.untyped_storage().nbytes() == 0 for s in slabs.slabs)
    with slabs.resident_during([1]):
        assert torch.equal(slabs.slabs[1], originals[1])
        assert torch.equal(view, originals[1][10:20].view(2, 5))
        view.add_(1.0)  # changed through the view: written back on the way out
    assert not slabs.resident[1]
    slabs.swap_in([0, 1, 2])
    assert torch.equal(slabs.slabs[1][10:20], originals[1][10:20] + 1)
    assert torch.equal(slabs.slabs[0], originals[0]) and torch.equal(slabs.slabs[2], originals[2])
    assert slabs.bytes_written == sum(slabs.nbytes) + slabs.nbytes[0] + slabs.nbytes[1]


def test_stream_reads_ahead_writes_back_and_bounds_residency(tmp_path: Path) -> None:
    slabs, originals, io = _slabs(tmp_path, [64] * 6, lookahead=1)
    io.log.clear()
    peak = 0
    for i in slabs.stream([0, 1, 2, 3, 4, 5]):
        peak = max(peak, sum(slabs.resident))
        slabs.slabs[i].mul_(2)
        io.log.append(("use", str(i)))
    assert peak <= 3  # the one in use, the one read ahead, the one being written back
    assert not any(slabs.resident)
    reads = [name for kind, name in io.log if kind == "read"]
    assert reads == [f"slab{i}.bin" for i in range(6)]
    # slab 1's read is submitted before slab 0 is used and waited for only after: it overlaps the use
    assert io.log.index(("read", "slab1.bin")) < io.log.index(("use", "0")) < io.log.index(("wait", "slab1.bin"))
    # slab 0's write is submitted after its use and not waited for before slab 1 is used
    assert io.log.index(("use", "0")) < io.log.index(("write", "slab0.bin")) < io.log.index(("use", "1"))
    slabs.swap_in(range(6))
    for i in range(6):
        assert torch.equal(slabs.slabs[i], originals[i] * 2)


def test_a_failed_pass_keeps_the_file_of_the_slab_in_use(tmp_path: Path) -> None:
    slabs, originals, _ = _slabs(tmp_path, [16, 16, 16])
    with pytest.raises(RuntimeError, match="boom"):
        for i in slabs.stream([0, 1, 2]):
            slabs.slabs[i].fill_(-1)
            if i == 1:
                raise RuntimeError("boom")
    assert not any(slabs.resident)
    slabs.swap_in([0, 1, 2])
    assert torch.equal(slabs.slabs[0], torch.full((16,), -1.0))  # finished before the failure: kept
    assert torch.equal(slabs.slabs[1], originals[1])  # in use when it failed: the file is untouched
    assert torch.equal(slabs.slabs[2], originals[2])


def test_run_directories_are_private_and_removed(tmp_path: Path) -> None:
    first = RunDirectory(tmp_path, "run-a", rank=0)
    (first.file("stale.bin")).write_bytes(b"x" * 10)
    second = RunDirectory(tmp_path, "run-b", rank=0)
    assert first.path != second.path and not any(second.path.iterdir())
    with pytest.raises(FileExistsError, match="each run and rank needs its own"):
        RunDirectory(tmp_path, "run-a", rank=0)
    first.close()
    assert not (tmp_path / "zerospeed-run-a").exists()
    del second
    gc.collect()
    assert not (tmp_path / "zerospeed-run-b").exists()


def test_missing_path_and_no_room_are_clear_errors(tmp_path: Path, monkeypatch: Any) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        RunDirectory(tmp_path / "absent", "r", rank=0)
    directory = RunDirectory(tmp_path, "r", rank=0)

    class Usage:
        free = 1 << 30

    monkeypatch.setattr("zerospeed.offload.nvme.shutil.disk_usage", lambda path: Usage())
    with pytest.raises(NvmeSpaceError, match=r"needs 2.00 GiB .* only 1.00 GiB are free") as info:
        directory.check_room(2 << 30, "optimizer states")
    assert info.value.errno == errno.ENOSPC
    directory.check_room(1 << 29, "optimizer states")


def test_resident_slabs_reuse_a_few_page_aligned_buffers_and_free_the_callers_memory(tmp_path: Path) -> None:
    """A pass over many slabs uses at most lookahead + 2 buffers (reused, page-aligned for O_DIRECT), a
    scratch tail is never written back (only by write_region), and the memory handed over at add() is
    freed at once."""
    import mmap

    originals = [torch.randn(1000 + 300 * i) for i in range(6)]
    given = [t.clone() for t in originals]
    slabs = SwappedSlabs([], RunDirectory(tmp_path, "run", 0), ImmediateIO(), lookahead=1)
    for t in given:
        slabs.add(t, keep_numel=t.numel() - 10)  # the last 10 elements are scratch
    assert all(t.untyped_storage().nbytes() == 0 for t in given)  # the caller's copies are gone
    buffers = set()
    for _ in range(2):
        for i in slabs.stream(range(6)):
            slab = slabs.slabs[i]
            assert slab.data_ptr() % mmap.PAGESIZE == 0
            assert torch.equal(slab[:-10], originals[i][:-10])
            assert not slab[-10:].any()  # scratch: zeros in the file until written on its own
            buffers.add(slab.data_ptr())
            slab[-10:].fill_(7.0)  # scratch: changed in memory, not written back
    assert len(buffers) <= 3, len(buffers)
    slabs.write_region(4, torch.full((10,), 3.0), originals[4].numel() - 10)
    with slabs.resident_during([4]):
        assert torch.equal(slabs.slabs[4][:-10], originals[4][:-10])
        assert torch.equal(slabs.slabs[4][-10:], torch.full((10,), 3.0))


def test_a_lease_prefetch_starts_the_read_and_only_ready_waits_for_it(tmp_path: Path) -> None:
    """``acquire(wait=False)`` issues the read and returns; the read is waited for by ``ready()`` (or by a
    waiting holder, or before the last release), and a changed slab is written back once, at the end."""
    from zerospeed.offload.nvme import SlabLease

    io = ImmediateIO()
    slabs = SwappedSlabs(_tensors([64]), RunDirectory(tmp_path, "run", 0), io)
    lease = SlabLease(slabs, 0)
    io.log.clear()
    lease.acquire(wait=False)
    assert io.log == [("read", "slab0.bin")]  # issued, not waited for
    lease.acquire()  # a second holder that needs the values now
    assert io.log[-1] == ("wait", "slab0.bin")
    slabs.slabs[0].add_(1)
    lease.release(changed=True)
    assert slabs.resident[0]  # the prefetching holder still holds it
    lease.release()
    assert not slabs.resident[0] and [op for op, _ in io.log].count("write") == 1
    io.log.clear()
    lease.acquire(wait=False)
    lease.release()  # never used: the read is still waited for before its buffer goes back, nothing written
    assert [op for op, _ in io.log] == ["read", "wait"] and not slabs.resident[0]
    with lease.held():
        assert torch.equal(slabs.slabs[0], _tensors([64])[0] + 1)


def test_a_failed_read_leaves_the_slab_out_and_the_lease_usable(tmp_path: Path) -> None:
    """A read that cannot even start (file gone) is not left marked resident over a reused buffer, the
    lease does not count the failed holder, and the next acquire reads the slab for real."""
    from zerospeed.offload.nvme import SlabLease

    slabs = SwappedSlabs(_tensors([64, 64]), RunDirectory(tmp_path, "run", 0), ImmediateIO())
    with slabs.resident_during([1]):
        pass  # a pool buffer now holds slab 1's bytes, free for reuse
    lease = SlabLease(slabs, 0)
    gone = slabs.paths[0].with_suffix(".gone")
    slabs.paths[0].rename(gone)
    with pytest.raises(OSError):
        lease.acquire()
    assert lease.holders == 0 and not slabs.resident[0]
    gone.rename(slabs.paths[0])
    with lease.held():
        assert torch.equal(slabs.slabs[0], _tensors([64, 64])[0])
