"""One writer per checkpoint folder (issue 32, item 2): a job's first save into a folder takes
``<folder>/.zerospeed-save.lock`` (an exclusive ``flock`` naming host, PID and job) for the engine's
lifetime; a second live job is refused by name and changes nothing; a lock whose holder was killed
does not block the next job; a sweep never deletes a temporary that a live process owns.

Real processes: a 1-rank and a 2-rank job saving into one folder, and a plain subprocess holding the lock
and two temporaries, killed with SIGKILL. In process, with monkeypatched failures (no root needed): a
failed record write, a file system without flock, a name reused under a sweep, an NFS-style rename of the
lock file, a host name and PID shared across PID namespaces, a folder this user cannot write, and
destroy() after a failed asynchronous save."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.checkpoint import get_fp32_state_dict, layout
from zerospeed.checkpoint.layout import CheckpointError
from zerospeed.testing import one_process_group, run_distributed
from zerospeed.testing.logs import log_messages

HOLDER = """
import os, socket, sys, time
from zerospeed.checkpoint import layout
save_dir = sys.argv[1]
locks = layout.SaveLocks("holder-engine")
locks.acquire(save_dir)
lease = layout.DirLease(os.path.join(save_dir, ".tmp-global_step7-abcd1234-1"))  # a save in progress
with open(os.path.join(save_dir, f"latest.tmp-{socket.gethostname()}-{os.getpid()}-1"), "wb") as f:
    f.write(b"global_st")  # a `latest` being rewritten
print("holding", flush=True)
time.sleep(120)
"""


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_live_holder_is_named_and_its_temporaries_kept_and_a_killed_one_blocks_nothing(tmp_path: Path) -> None:
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(save_dir)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "TORCHELASTIC_RUN_ID": "job-holder-7", "SLURM_JOB_ID": ""})
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        live = [".tmp-global_step7-abcd1234-1", f"latest.tmp-{socket.gethostname()}-{holder.pid}-1"]
        stale = [f"latest.tmp-{socket.gethostname()}-{_dead_pid()}-1", "latest.tmp-4194999"]  # dead; old name
        for name in stale:
            (save_dir / name).write_bytes(b"x")
        (save_dir / ".tmp-global_step6-abcd1234-1").mkdir()  # a crashed save's directory: nobody leases it

        with pytest.raises(CheckpointError) as refused:
            layout.SaveLocks("second-job").acquire(str(save_dir))
        message = str(refused.value)
        assert message.startswith(f"save_checkpoint: another job is saving into {save_dir}: host "
                                  f"{socket.gethostname()}, pid {holder.pid}, job job-holder-7 (engine holder-e, "
                                  f"saving there since "), message
        assert f"holds {save_dir / layout.SAVE_LOCK}" in message and "Give this run its own save_dir" in message

        layout.remove_stale_temporaries(str(save_dir), keep="")  # another job's sweep
        assert sorted(os.listdir(save_dir)) == sorted([layout.SAVE_LOCK, *live])  # only the stale ones went
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert holder.returncode == -signal.SIGKILL

    locks = layout.SaveLocks("next-job")
    locks.acquire(str(save_dir))  # the kernel dropped the killed holder's lock
    try:
        record = json.loads((save_dir / layout.SAVE_LOCK).read_text())
        assert (record["host"], record["pid"], record["engine"]) == (socket.gethostname(), os.getpid(), "next-job")
        layout.SaveLocks("same-process-engine").acquire(str(save_dir))  # another engine of this process: allowed
        layout.remove_stale_temporaries(str(save_dir), keep="")
        assert os.listdir(save_dir) == [layout.SAVE_LOCK]  # the dead holder's temporaries are swept now
    finally:
        locks.release()
    layout.SaveLocks("after-release").acquire(str(save_dir))  # released: taken at once (and freed by GC)


# -- two jobs, one folder ----------------------------------------------------------------------

def _engine(seed: int) -> Any:
    torch.manual_seed(seed)
    engine, *_ = zerospeed.initialize(model=nn.Linear(4, 3), config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}}})
    return engine


def _train(engine: Any) -> dict[str, list[float]]:
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(engine.global_steps))
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    return {n: p.detach().reshape(-1).tolist() for n, p in engine.module.named_parameters()}


def _wait_for(path: Path, seconds: float = 90.0) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.05)


def _job_a(save_dir: str, signals: str) -> dict[str, Any]:
    """Saves step 1, lets job B try, then saves steps 2 and 3 into the same folder."""
    os.environ.update(TORCHELASTIC_RUN_ID="job-a", SLURM_JOB_ID="")
    engine = _engine(0)
    saved = {}
    saved[1] = _train(engine)
    engine.save_checkpoint(save_dir)
    Path(signals, "a_saved").touch()
    _wait_for(Path(signals, "b_done"))
    for step in (2, 3):
        saved[step] = _train(engine)
        engine.save_checkpoint(save_dir)
    return {"pid": os.getpid(), "saved": saved}


def _job_b(save_dir: str, signals: str) -> dict[str, Any]:
    """Starts (2 ranks) while job A holds the folder and tries to save there."""
    os.environ.update(TORCHELASTIC_RUN_ID="job-b", SLURM_JOB_ID="")
    _wait_for(Path(signals, "a_saved"))
    engine = _engine(1)
    _train(engine)
    try:
        engine.save_checkpoint(save_dir)
        error = "saved"
    except CheckpointError as exc:
        error = str(exc)
    return {"error": error, "listing": sorted(os.listdir(save_dir))}


def test_a_second_job_saving_into_the_same_folder_is_refused_and_the_first_is_intact(tmp_path: Path) -> None:
    save_dir, signals = tmp_path / "ckpt", tmp_path / "signals"
    signals.mkdir()
    results: dict[str, Any] = {}

    def run_a() -> None:
        try:
            results["a"] = run_distributed(_job_a, 1, str(save_dir), str(signals), timeout=150)[0]
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            results["a_error"] = exc
            (signals / "a_saved").touch()  # do not leave job B waiting

    thread = threading.Thread(target=run_a)
    thread.start()
    try:
        b = run_distributed(_job_b, 2, str(save_dir), str(signals), timeout=150)
        after_b = sorted(os.listdir(save_dir))  # both of B's ranks are gone: whatever they made is there
    finally:
        (signals / "b_done").touch()
        thread.join()
    if "a_error" in results:
        raise results["a_error"]
    a = results["a"]
    for rank in (0, 1):  # every rank of B gets rank 0's refusal, and none made or wrote anything there
        assert b[rank]["error"].startswith(f"save_checkpoint: another job is saving into {save_dir}: host "
                                           f"{socket.gethostname()}, pid {a['pid']}, job job-a "), (rank, b[rank])
        assert b[rank]["listing"] == [layout.SAVE_LOCK, "global_step1", "latest"], rank
    assert after_b == [layout.SAVE_LOCK, "global_step1", "latest"]  # no .tmp- directory of B's rank 1 either
    assert layout.list_tags(str(save_dir)) == ["global_step1", "global_step2", "global_step3"]
    assert layout.read_latest(str(save_dir)) == "global_step3"
    for step, params in a["saved"].items():  # every tag holds job A's state, and loads
        state = get_fp32_state_dict(str(save_dir), tag=f"global_step{step}")
        assert {k: v.reshape(-1).tolist() for k, v in state.items()} == params, step


def _locked(save_dir: Path) -> bool:
    """Whether some descriptor holds the folder's lock (flock conflicts between descriptors of one process)."""
    fd = os.open(save_dir / layout.SAVE_LOCK, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def test_one_folder_per_save_holds_a_bounded_number_of_locks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Hugging Face Trainer saves each checkpoint into a folder of its own and deletes old ones: the
    engine lets deleted folders go, keeps the most recent ones locked, and locks a folder made again."""
    import shutil

    monkeypatch.setattr(layout.SaveLocks, "MAX_HELD", 3)
    locks = layout.SaveLocks("trainer")
    try:
        folders = [tmp_path / f"checkpoint-{step}" for step in range(5)]
        for folder in folders:
            locks.acquire(str(folder))
        assert [locks.holds(str(f)) for f in folders] == [False, False, True, True, True]
        assert [_locked(f) for f in folders] == [False, False, True, True, True]
        shutil.rmtree(folders[2])  # rotated away
        locks.acquire(str(folders[0]))  # a new save lets the deleted folder go
        assert [locks.holds(str(f)) for f in folders] == [True, False, False, True, True]
        shutil.rmtree(folders[4])
        locks.acquire(str(folders[4]))  # made again: its new lock file is locked
        assert locks.holds(str(folders[4])) and _locked(folders[4])
    finally:
        locks.release()
    assert not any(_locked(f) for f in folders if f.exists())


# -- in process: the lock's failure paths (monkeypatched, so they run without root) ----------------

def test_a_failed_lock_record_write_keeps_the_lock_and_the_job_is_not_refused_by_itself(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk at the record write (after the flock succeeded): the lock stays held by the engine, a
    warning says the record is missing, and its next save neither is refused nor leaves it unnamed."""
    real_pwrite = os.pwrite
    failures = [OSError(errno.ENOSPC, "No space left on device")]

    def pwrite(fd: int, data: bytes, offset: int) -> int:
        if failures:
            raise failures.pop()
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    locks = layout.SaveLocks("full-disk-engine")
    try:
        with log_messages(logging.WARNING) as logged:
            locks.acquire(str(tmp_path))
        assert logged == [f"save_checkpoint: this job holds the lock of {tmp_path} but could not write its name into "
                          f"{tmp_path / layout.SAVE_LOCK} ([Errno 28] No space left on device); another job refused "
                          f"there is not told who holds it"]
        assert locks.holds(str(tmp_path)) and _locked(tmp_path)
        assert (tmp_path / layout.SAVE_LOCK).read_bytes() == b""
        locks.acquire(str(tmp_path))  # the next save: its own lock, and the record is written now
        record = json.loads((tmp_path / layout.SAVE_LOCK).read_text())
        assert (record["pid"], record["engine"]) == (os.getpid(), "full-disk-engine")
    finally:
        locks.release()
    assert not _locked(tmp_path)


def test_without_flock_support_a_save_completes_with_a_warning_and_deletes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system that refuses flock (ENOLCK): the folder lock, the temporaries' leases and the sweep
    all go on without it, as docs/checkpoints.md says; the sweep then deletes no temporary, since it
    cannot tell a live writer's from a dead one's."""
    save_dir = tmp_path / "ckpt"
    other_save = save_dir / ".tmp-global_step7-abcd1234-1"  # another job's save in progress (or a crashed one)
    other_save.mkdir(parents=True)
    (other_save / "rank00000.safetensors").write_bytes(b"being written")
    other_latest = save_dir / f"latest.tmp-{socket.gethostname()}-{_dead_pid()}-1"
    other_latest.write_bytes(b"global_st")

    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with one_process_group(), log_messages(logging.WARNING) as logged:
        engine = _engine(0)
        for _ in range(2):
            _train(engine)
            engine.save_checkpoint(str(save_dir))
        engine.destroy()
    assert [m for m in logged if "flock" in m] == [  # once per folder
        f"save_checkpoint: the file system of {save_dir} does not support flock, so this job saves there without "
        f"the folder lock: make sure no other job saves into the same folder"]
    assert sorted(os.listdir(save_dir)) == sorted([layout.SAVE_LOCK, other_save.name, other_latest.name,
                                                   "global_step1", "global_step2", "latest"])
    assert os.listdir(other_save) == ["rank00000.safetensors"]
    assert layout.read_latest(str(save_dir)) == "global_step2"


def test_a_sweep_deletes_only_the_directory_it_locked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between the sweep's open of a crashed save's directory and its lock, that directory goes (another
    sweep) and a save makes and leases a new one of the same name: the sweep locked the old one, and must
    not delete the new one by name."""
    crashed = tmp_path / ".tmp-global_step3-abcd1234-1"
    crashed.mkdir()
    real_flock = fcntl.flock
    leases: list[layout.DirLease] = []

    def flock(fd: int, operation: int) -> None:
        if operation == fcntl.LOCK_EX | fcntl.LOCK_NB and not leases:  # the sweep, just after its open
            os.rename(crashed, tmp_path / "taken-away")
            leases.append(layout.DirLease(str(crashed)))  # a live save's directory, same name
            (crashed / "rank00000.safetensors").write_bytes(b"live")
        real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    try:
        layout.remove_stale_temporaries(str(tmp_path), keep="")
        assert leases and (crashed / "rank00000.safetensors").read_bytes() == b"live"
    finally:
        for lease in leases:
            lease.release()


def test_a_lock_file_renamed_away_as_nfs_does_is_let_go_and_the_new_one_locked(tmp_path: Path) -> None:
    """An NFS client keeps a deleted file that is still open as ``.nfsXXXX``, with a link: the lock is
    told current by its inode, not by ``st_nlink``."""
    locks = layout.SaveLocks("nfs-engine")
    try:
        locks.acquire(str(tmp_path))
        os.rename(tmp_path / layout.SAVE_LOCK, tmp_path / ".nfs000000000123abcd00000001")
        locks.acquire(str(tmp_path))
        assert _locked(tmp_path)
        assert json.loads((tmp_path / layout.SAVE_LOCK).read_text())["engine"] == "nfs-engine"
    finally:
        locks.release()


def test_another_process_with_this_host_name_and_pid_is_refused(tmp_path: Path) -> None:
    """Containers sharing a host name have PID namespaces of their own: a holder with this host and PID
    but another process identity (boot id, PID namespace, start time) is another job, not this process."""
    fd = os.open(tmp_path / layout.SAVE_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another open file: conflicts with this process's own flock
        record = {"host": socket.gethostname(), "pid": os.getpid(), "job": "container-job",
                  "engine": "container-engine", "since": "2026-11-27 10:00:00 +0000"}
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()  # the same kernel, another PID namespace, a process started at tick 1
        os.pwrite(fd, json.dumps({**record, "process": f"{boot}:4026531999:1"}).encode(), 0)
        with pytest.raises(CheckpointError) as refused:
            layout.SaveLocks("here").acquire(str(tmp_path))
        assert str(refused.value).startswith(
            f"save_checkpoint: another job is saving into {tmp_path}: host {socket.gethostname()}, pid {os.getpid()}, "
            f"job container-job (engine containe, saving there since 2026-11-27 10:00:00 +0000) holds "), refused.value

        identity = layout.process_identity()
        assert identity is not None and identity == layout.process_identity()
        own_boot, namespace, start = identity.split(":")
        assert (own_boot, int(namespace)) == (boot, os.stat("/proc/self/ns/pid").st_ino) and int(start) > 1
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({**record, "process": identity}).encode(), 0)
        locks = layout.SaveLocks("second-engine-here")
        locks.acquire(str(tmp_path))  # this very process: another engine of it goes on unlocked
        assert not locks.holds(str(tmp_path))
    finally:
        os.close(fd)


def test_a_folder_this_user_cannot_write_is_named_with_the_fix(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """EACCES at the lock file's creation (no lock file there yet to open read-only): a CheckpointError
    naming the folder and the fix, with the PermissionError as its cause (not a FileNotFoundError)."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    real_open = os.open

    def open_(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if str(path).endswith(layout.SAVE_LOCK) and flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", open_)
    with pytest.raises(CheckpointError) as info:
        layout.SaveLocks("no-write").acquire(str(folder))
    assert str(info.value) == (
        f"save_checkpoint cannot save into {folder}: making its lock file {folder / layout.SAVE_LOCK} failed (EACCES: "
        f"this user may not write there: Permission denied); save to another directory this user can write "
        f"(save_checkpoint's save_dir). Nothing was saved")
    assert isinstance(info.value.__cause__, PermissionError)


def test_destroy_releases_the_folder_locks_when_the_asynchronous_save_failed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with one_process_group():
        engine = _engine(0)
        _train(engine)
        engine.save_checkpoint(str(tmp_path))
        assert _locked(tmp_path)

        def failed() -> None:
            raise CheckpointError("the asynchronous save of checkpoint 'global_step2' failed: disk gone")

        monkeypatch.setattr(engine, "wait_for_checkpoint", failed)
        with pytest.raises(CheckpointError, match="disk gone"):
            engine.destroy()
        assert not _locked(tmp_path) and not engine.save_locks.holds(str(tmp_path))
