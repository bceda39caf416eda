"""Disk errors with context: a read-only NVMe path, a full NVMe disk, a full checkpoint disk.

Each error names what the user controls (the config key ``...nvme_path`` or ``save_dir``), the path,
the bytes at a scale that shows them, and the fix, on every rank. The file systems are real: small
tmpfs mounts (read-only, or a few KiB), made when the tests run as root and may mount, else skipped.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.checkpoint.layout import CheckpointError
from zerospeed.offload.aio import AsyncIOHandle
from zerospeed.offload.nvme import NvmeSpaceError, RunDirectory, SwappedSlabs
from zerospeed.tensor_bytes import format_bytes
from zerospeed.testing import run_distributed
from zerospeed.testing.configs import adamw, train_config, zero_section
from zerospeed.testing.data import seeded_regression_batch
from zerospeed.testing.models import seeded_mlp

OPT_KEY = "zero_optimization.offload_optimizer.nvme_path"


def _mount(path: Path, options: str) -> None:
    """A tmpfs at ``path`` (skips the test where this process may not mount)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small or read-only tmpfs")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")


def _unmount(path: Path) -> None:
    """Unmount; lazily when a file there is still open (an engine a failed test left alive)."""
    if subprocess.run(["umount", str(path)], check=False, capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Any]:
    """``tmpfs(name, options)`` mounts one under ``tmp_path``; all are unmounted after the test."""
    mounted: list[Path] = []

    def mount(name: str, options: str) -> Path:
        path = tmp_path / name
        _mount(path, options)
        mounted.append(path)
        return path

    try:
        yield mount
    finally:
        for path in reversed(mounted):
            _unmount(path)


def test_format_bytes_shows_small_and_large_sizes() -> None:
    assert [format_bytes(n) for n in (0, 512, 1023, 1024, 1536, 10239, 123456, 18425792, 5 << 30, 3 << 40)] == [
        "0 B", "512 B", "1023 B", "1.00 KiB", "1.50 KiB", "10.0 KiB", "121 KiB", "17.6 MiB", "5.00 GiB", "3.00 TiB"]


# -- NVMe: one rank, in process ------------------------------------------------------------------

def test_a_read_only_nvme_path_names_the_key_the_path_and_the_fix(tmpfs: Any) -> None:
    ro = tmpfs("ro", "ro,size=1M")
    with pytest.raises(OSError) as info:
        RunDirectory(ro, "run", 0, key=OPT_KEY)
    assert info.value.errno == errno.EROFS
    assert str(info.value) == (
        f"[Errno 30] {OPT_KEY} '{ro}' cannot hold this run's swap files: creating '{ro}/zerospeed-run/rank0' failed "
        f"with EROFS (the file system is mounted read-only); point {OPT_KEY} at a writable NVMe directory (or "
        f"remount it read-write)")


def test_an_nvme_path_that_turns_read_only_names_the_key_at_the_write(tmpfs: Any) -> None:
    path = tmpfs("rw", "size=1M")
    directory = RunDirectory(path, "run", 0, key=OPT_KEY)
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
    aio = AsyncIOHandle()
    try:
        slabs = SwappedSlabs([], directory, aio, lookahead=1)
        with pytest.raises(OSError) as info:
            slabs.add(torch.arange(64.0))  # swapped out at once: its file is written
    finally:
        aio.close()
    assert info.value.errno == errno.EROFS
    assert str(info.value).endswith(
        f"Read-only file system; this run's swap files are under {OPT_KEY} '{path}': the file system is mounted "
        f"read-only; point {OPT_KEY} at a writable NVMe directory (or remount it read-write)"), str(info.value)


def test_a_full_nvme_disk_shows_the_bytes(tmpfs: Any) -> None:
    small = tmpfs("small", "size=64k")
    directory = RunDirectory(small, "run", 0, key=OPT_KEY)
    free = shutil.disk_usage(small).free
    with pytest.raises(NvmeSpaceError) as info:
        directory.check_room(1 << 20, "the fp32 masters of 4 units")
    assert info.value.errno == errno.ENOSPC
    assert str(info.value) == (
        f"[Errno 28] the fp32 masters of 4 units needs 1.00 MiB (1048576 bytes) under {small} but only "
        f"{format_bytes(free)} are free ({free} bytes); free space there or point {OPT_KEY} at a larger disk")
    assert format_bytes(free) == "64.0 KiB"


# -- every rank: NVMe offload on a read-only path, a save onto a full disk ------------------------

def _config(zero: dict[str, Any]) -> dict[str, Any]:
    return train_config(micro=2, optimizer=adamw(1e-3), zero=zero)


def _ranks(ro: str, full: str) -> dict[str, str]:
    out = {}
    zero = zero_section(2, reduce_bucket_size=200, persistence_threshold=10)
    try:
        zerospeed.initialize(model=seeded_mlp(6, 8, 3),
                             config=_config({**zero, "offload_optimizer": {"device": "nvme", "nvme_path": ro}}))
        out["nvme"] = "no error"
    except Exception as exc:
        out["nvme"] = f"{type(exc).__name__}: {exc}"
    engine, *_ = zerospeed.initialize(model=seeded_mlp(64, 128, 3), config=_config(zero))
    x, y = seeded_regression_batch(0, engine.comm.rank, rows=2, inputs=64, outputs=3)
    engine.backward(nn.functional.mse_loss(engine(x), y))
    engine.step()
    try:
        engine.save_checkpoint(full, tag="step1")
        out["save"] = "no error"
    except Exception as exc:
        out["save"] = f"{type(exc).__name__}: {exc}"
    return out


def test_disk_errors_reach_every_rank_with_the_path_and_the_fix(tmpfs: Any) -> None:
    ro, full = tmpfs("ro", "ro,size=1M"), tmpfs("full", "size=16k")
    outs = run_distributed(_ranks, 2, str(ro), str(full), timeout=120)
    for rank, out in enumerate(outs):
        # NVMe on a read-only file system: each rank names the key, the path, the cause and the fix
        assert out["nvme"] == (
            f"OSError: [Errno 30] {OPT_KEY} '{ro}' cannot hold this run's swap files: creating "
            f"'{ro}/zerospeed-{_run_id(out['nvme'])}/rank{rank}' failed with EROFS (the file system is mounted "
            f"read-only); point {OPT_KEY} at a writable NVMe directory (or remount it read-write)"), out["nvme"]
    # a full checkpoint disk: the failing rank raises the CheckpointError its peers get (tag, path, bytes)
    failing = [rank for rank, out in enumerate(outs) if f"rank {rank} could not write its files" in out["save"]]
    assert failing, outs
    for rank, out in enumerate(outs):
        message = out["save"]
        assert message.startswith("CheckpointError: "), message
        assert "could not write its files of checkpoint 'step1' into " + str(full) in message, message
        assert "(ENOSPC: the disk is full: No space left on device); this rank's files need " in message, message
        assert " bytes) are free there now; free space there or save to a larger disk (save_checkpoint's save_dir). " \
               "The checkpoint was not committed ('latest' is unchanged)" in message, message
    assert not (full / "latest").exists() and not (full / "step1").exists()


def _run_id(message: str) -> str:
    return message.split("/zerospeed-", 1)[1].split("/", 1)[0]


def test_a_full_checkpoint_disk_names_tag_path_and_bytes_on_the_failing_rank(tmpfs: Any) -> None:
    """In process: the one rank's save fails with the bytes its files need and those free."""
    from zerospeed.testing import one_process_group

    full = tmpfs("full1", "size=16k")
    with one_process_group():
        engine, *_ = zerospeed.initialize(model=seeded_mlp(64, 128, 3), config=_config(
            zero_section(1, reduce_bucket_size=200, persistence_threshold=10)))
        with pytest.raises(CheckpointError) as info:
            engine.save_checkpoint(str(full), tag="step0")
        # the same state where there is room: what the message said this rank's files need is what they hold
        saved = Path(engine.save_checkpoint(str(full.parent / "roomy"), tag="step0"))
    message = str(info.value)
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    assert message.startswith(f"rank 0 could not write its files of checkpoint 'step0' into {full}/.tmp-step0-"), message
    needed = int(message.split("this rank's files need ", 1)[1].split("(", 1)[1].split(" bytes)", 1)[0])
    assert f"this rank's files need {format_bytes(needed)} ({needed} bytes), " in message
    written = sum(f.stat().st_size for f in saved.iterdir() if f.name.startswith("rank0") or f.name.startswith("engine"))
    params = sum(p.numel() for p in engine.module.parameters())
    assert params * 4 < needed < written  # the tensors and pickled state, without headers and index


# -- in process, monkeypatched (no root needed) ----------------------------------------------------

def test_a_full_disk_at_the_commit_raises_the_message_the_peers_are_told(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC at rank 0's manifest write: a CheckpointError naming the tag, the folder and the manifest's
    bytes, with the OSError as its cause, and the very same text published to the other ranks."""
    from zerospeed.checkpoint import commit, layout
    from zerospeed.testing import one_process_group

    real_write = layout.write_file_atomic
    written: dict[str, int] = {}

    def full_at_the_manifest(path: str, data: bytes) -> None:
        if path.endswith(layout.MANIFEST) and "full" in path:
            written["manifest"] = len(data)
            raise OSError(errno.ENOSPC, "No space left on device", path)
        real_write(path, data)

    published: list[tuple[str, str]] = []
    real_publish = commit.RankSync.publish

    def publish(self: commit.RankSync, step: str, value: str) -> None:
        published.append((step, value))
        real_publish(self, step, value)

    monkeypatch.setattr(layout, "write_file_atomic", full_at_the_manifest)
    monkeypatch.setattr(commit.RankSync, "publish", publish)
    full = tmp_path / "full"
    with one_process_group():
        engine, *_ = zerospeed.initialize(model=seeded_mlp(6, 8, 3), config=_config(
            zero_section(1, reduce_bucket_size=200, persistence_threshold=10)))
        with pytest.raises(CheckpointError) as info:
            engine.save_checkpoint(str(full), tag="step0")
        engine.destroy()
    message, needed = str(info.value), written["manifest"]
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    head, free = message.split(" are free there now; ")[0].rsplit(", ", 1)
    assert head == (f"rank 0 could not commit checkpoint 'step0' in {full} (writing its manifest, renaming it into place "
                    f"or rewriting 'latest') (ENOSPC: the disk is full: No space left on device); the manifest needs "
                    f"{format_bytes(needed)} ({needed} bytes)"), message
    assert free.endswith(" bytes)") and message.endswith(
        " are free there now; free space there or save to a larger disk (save_checkpoint's save_dir). 'latest' was not "
        "changed to name it"), message
    assert ("committed", message) in published  # what every other rank raises, after its own prefix
    assert not (full / "step0").exists() and not (full / "latest").exists()


def test_one_errno_table_explains_refused_writes_for_checkpoints_and_nvme() -> None:
    """Checkpoint saves and NVMe offload read one table (zerospeed.disk_errors): the same cause for the
    same errno, each with its own way of moving the files."""
    from zerospeed import disk_errors
    from zerospeed.checkpoint.commit import disk_error
    from zerospeed.checkpoint.layout import save_refusal
    from zerospeed.offload.nvme import unusable_path

    codes = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM)
    for code in codes:
        saved = save_refusal(OSError(code, os.strerror(code)))
        swapped = disk_errors.refusal(code, to=f"point {OPT_KEY} at", where="NVMe directory")
        assert saved is not None and swapped is not None and saved.cause == swapped.cause, code
        assert saved.name == swapped.name == errno.errorcode[code]
    assert disk_errors.refusal(OSError(errno.EIO, "I/O error"), to="save to") is None
    assert disk_errors.refusal(ValueError("not a disk"), to="save to") is None
    assert str(unusable_path(OPT_KEY, Path("/nvme"), Path("/nvme/zerospeed-r/rank0"),
                             PermissionError(errno.EACCES, "Permission denied"))) == (
        f"[Errno 13] {OPT_KEY} '/nvme' cannot hold this run's swap files: creating '/nvme/zerospeed-r/rank0' failed "
        f"with EACCES (this user may not write there); point {OPT_KEY} at another NVMe directory this user can write")
    error = disk_error(OSError(errno.EROFS, "Read-only file system"), rank=1, tag="step3", directory="/ckpt/.tmp-x",
                       needed=None)
    assert str(error) == (
        "rank 1 could not write its files of checkpoint 'step3' into /ckpt/.tmp-x (EROFS: the file system is mounted "
        "read-only: Read-only file system); save to a writable directory (save_checkpoint's save_dir) (or remount it "
        "read-write). The checkpoint was not committed ('latest' is unchanged)")
