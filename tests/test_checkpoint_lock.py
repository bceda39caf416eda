"""One writer per checkpoint folder (issue 32, item 2): a job's first save into a folder takes
``<folder>/.zerospeed-save.lock`` (an exclusive ``flock`` naming host, PID and job) for the engine's
lifetime; a second live job is refused by name and changes nothing; a lock whose holder was killed
does not block the next job; a sweep never deletes a temporary that a live process owns.

Real processes throughout: two concurrent 1-rank jobs saving into one folder, and a plain subprocess
holding the lock and two temporaries, killed with SIGKILL."""

from __future__ import annotations

import json
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
from zerospeed.testing import run_distributed

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
    """Starts while job A holds the folder and tries to save there."""
    os.environ.update(TORCHELASTIC_RUN_ID="job-b", SLURM_JOB_ID="")
    _wait_for(Path(signals, "a_saved"))
    engine = _engine(1)
    _train(engine)
    try:
        engine.save_checkpoint(save_dir)
        error = "saved"
    except CheckpointError as exc:
        error = str(exc)
    listing = sorted(os.listdir(save_dir))
    Path(signals, "b_done").touch()
    return {"error": error, "listing": listing}


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
        b = run_distributed(_job_b, 1, str(save_dir), str(signals), timeout=150)[0]
    finally:
        thread.join()
    if "a_error" in results:
        raise results["a_error"]
    a = results["a"]
    assert b["error"].startswith(f"save_checkpoint: another job is saving into {save_dir}: host "
                                 f"{socket.gethostname()}, pid {a['pid']}, job job-a "), b["error"]
    assert b["listing"] == [layout.SAVE_LOCK, "global_step1", "latest"]  # B wrote nothing there
    assert layout.list_tags(str(save_dir)) == ["global_step1", "global_step2", "global_step3"]
    assert layout.read_latest(str(save_dir)) == "global_step3"
    for step, params in a["saved"].items():  # every tag holds job A's state, and loads
        state = get_fp32_state_dict(str(save_dir), tag=f"global_step{step}")
        assert {k: v.reshape(-1).tolist() for k, v in state.items()} == params, step


def _locked(save_dir: Path) -> bool:
    """Whether some descriptor holds the folder's lock (flock conflicts between descriptors of one process)."""
    import fcntl

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
