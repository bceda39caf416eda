"""The save protocol: agree, write in parallel, commit atomically, all through the ranks' store.

Every step of a save talks through the process group's key-value store rather than through
collectives, so (a) the same code runs on the training thread or on a background thread for an
asynchronous save without racing the training's collectives, and (b) a rank that never arrives is
noticed: the handshake watches where the other ranks are, and fails at once with a clear error when
one has gone on to a collective instead of saving (``if rank == 0: save_checkpoint(...)``).

Order of a save: rank 0 takes the folder's lock (:class:`~zerospeed.checkpoint.layout.SaveLocks`) ->
handshake (same tag and directory everywhere; rank 0's hello carries a refused lock, so a refused job
stops on every rank before any rank touches the folder) -> each rank writes and fsyncs its
files into ``<dir>/.tmp-<tag>-<id>`` and reports -> rank 0 writes the manifest, fsyncs, renames the
directory to ``<dir>/<tag>`` and rewrites ``latest`` -> every rank learns the outcome. Each rank's
index describes the part of the model it holds; rank 0 merges those into the manifest
(:mod:`~zerospeed.checkpoint.model_record`), so the manifest lists the whole model even when no
rank holds all of it (pipeline stages).

While a rank writes and commits it also beats a heartbeat key, so a rank that died mid-save
(SIGKILL, the OOM killer, a lost node) is told from one still writing: the others stop waiting
after :data:`PEER_SILENCE_LIMIT` seconds of silence instead of the whole process group timeout.
"""

from __future__ import annotations

import datetime
import io
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from zerospeed.checkpoint import checksum, layout
from zerospeed.checkpoint.layout import CheckpointError
from zerospeed.checkpoint.model_record import merge_records
from zerospeed.checkpoint.safetensors_io import FileChecksums
from zerospeed.checkpoint.state_io import RankPayload, StreamedPayload
from zerospeed.disk_errors import free_bytes
from zerospeed.tensor_bytes import format_bytes

_POLL = 0.02  # seconds between store polls; store.wait would hold the store client's lock
_BEAT = 1.0  # seconds between a saving rank's heartbeats
_LIVENESS_POLL = 0.5  # seconds between looks at the missing ranks' heartbeats
# A rank that started writing and has not beaten for this long is taken for dead. Generous, since a
# heartbeat only needs the GIL for a moment (large writes release it); tests lower it.
PEER_SILENCE_LIMIT = 60.0


class RankSync:
    """Keys ``<prefix>/<step>/<rank>`` in the store: publish this rank's value, gather everyone's."""

    def __init__(self, store: Any, prefix: str, rank: int, world_size: int, timeout: datetime.timedelta):
        self.store, self.prefix, self.rank, self.world_size = store, prefix, rank, world_size
        self.timeout = timeout.total_seconds()

    def publish(self, step: str, value: str) -> None:
        if self.store is not None:
            self.store.set(f"{self.prefix}/{step}/{self.rank}", value)

    def withdraw(self, step: str) -> None:
        """Take back this rank's value for ``step`` (a handshake this rank abandoned), so a later
        save under the same prefix cannot read it."""
        if self.store is not None:
            self.store.delete_key(f"{self.prefix}/{step}/{self.rank}")

    def heartbeat(self) -> "Heartbeat":
        return Heartbeat(self)

    def gather(self, step: str, ranks: list[int] | None = None,
               watch: Callable[[list[int]], None] | None = None, timeout: float | None = None,
               hint: str = "") -> dict[int, str]:
        """Every rank's value for ``step`` (or only ``ranks``'), polling; ``watch(missing)`` may raise
        to stop waiting early; ``timeout`` (seconds) shortens the wait, ``hint`` ends its error."""
        ranks = list(range(self.world_size)) if ranks is None else ranks
        if self.store is None:  # a single process without a store: only this rank exists
            return {self.rank: ""}
        keys = {r: f"{self.prefix}/{step}/{r}" for r in ranks}
        limit = self.timeout if timeout is None else min(timeout, self.timeout)
        deadline = time.monotonic() + limit
        beats: dict[int, tuple[bytes, float]] = {}  # rank -> (last heartbeat seen, when it was first seen)
        next_look = time.monotonic() + _LIVENESS_POLL
        while True:
            missing = [r for r, key in keys.items() if not self.store.check([key])]
            if not missing:
                return {r: self.store.get(key).decode() for r, key in keys.items()}
            if watch is not None:
                watch(missing)
            if time.monotonic() >= next_look:
                self._check_alive(step, missing, beats)
                next_look = time.monotonic() + _LIVENESS_POLL
            if time.monotonic() > deadline:
                raise CheckpointError(f"checkpoint {step}: rank(s) {missing} did not report within "
                                      f"{limit:g} s; every rank must call save_checkpoint with the same "
                                      f"tag and directory{hint}")
            time.sleep(_POLL)

    def _check_alive(self, step: str, missing: list[int], beats: dict[int, tuple[bytes, float]]) -> None:
        """Raise if a missing rank joined the save (it has a heartbeat) but has gone silent."""
        now = time.monotonic()
        for rank in missing:
            key = f"{self.prefix}/beat/{rank}"
            if not self.store.check([key]):
                continue  # not writing yet (or a save without heartbeats): only the timeout applies
            beat = self.store.get(key)
            if rank not in beats or beats[rank][0] != beat:
                beats[rank] = (beat, now)
            elif now - beats[rank][1] > PEER_SILENCE_LIMIT:
                raise CheckpointError(
                    f"checkpoint {step}: rank {rank} stopped in the middle of the save (no heartbeat for "
                    f"{now - beats[rank][1]:.0f} s: killed, out of memory, or hung); this checkpoint was not "
                    f"committed and `latest` still names the previous one")


class Heartbeat:
    """While a rank takes part in a save, bump ``<prefix>/beat/<rank>`` every :data:`_BEAT` seconds
    from a daemon thread, so the other ranks can tell it is alive (see :meth:`RankSync.gather`)."""

    def __init__(self, sync: RankSync):
        self.sync = sync
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Heartbeat":
        if self.sync.store is not None and self.sync.world_size > 1:
            self._beat(0)
            self._thread = threading.Thread(target=self._run, name="zerospeed-save-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _beat(self, count: int) -> None:
        self.sync.store.set(f"{self.sync.prefix}/beat/{self.sync.rank}", str(count))

    def _run(self) -> None:
        count = 0
        while not self._stop.wait(_BEAT):
            count += 1
            try:
                self._beat(count)
            except Exception:  # a store that went away: the gathers will time out on their own
                return


@dataclass
class SaveJob:
    """One rank's part of a save after the handshake: write, report, (rank 0) commit."""

    sync: RankSync
    save_dir: str
    tmp_dir: str
    tag: str
    payload: RankPayload | StreamedPayload
    rank_state: bytes  # serialized on the calling thread: later changes by the caller cannot leak in
    engine_state: bytes | None  # rank 0: scheduler, client state
    manifest: dict[str, Any] | None  # rank 0: everything but the per-rank parts
    model: dict[str, Any]  # the part of the model this rank holds (model_record), merged by rank 0
    save_latest: bool
    lease: layout.DirLease | None = None  # keeps other saves' sweeps out of tmp_dir until done
    tensors_written: bool = field(default=False, init=False)
    checksums: FileChecksums | None = field(default=None, init=False)  # of the rank file, once written

    def run(self) -> str:
        try:
            with self.sync.heartbeat():
                return self._run()
        finally:
            if self.lease is not None:
                self.lease.release()

    def _run(self) -> str:
        try:
            return self._write_and_commit()
        finally:
            if self.sync.rank != 0:  # done with the store for this save (rank 0, which may host it, waits)
                self.sync.publish("ack", "done")

    def _write_and_commit(self) -> str:
        try:
            self._write_own()
        except BaseException as exc:
            # a full or read-only disk: this rank raises the same clear error its peers are told
            error = self.disk_error(exc)
            status = str(error) if error is not None else (f"rank {self.sync.rank} could not write its files: "
                                                           f"{type(exc).__name__}: {exc}")
            self.sync.publish("written", status)
            if self.sync.rank == 0:
                self.sync.publish("committed", status)
            if error is not None:
                raise error from exc
            raise
        self.sync.publish("written", "ok")
        if self.sync.rank == 0:
            return self._commit()
        outcome = self.sync.gather("committed", ranks=[0])[0]
        if outcome != "ok":
            raise CheckpointError(f"checkpoint {self.tag!r} was not committed: {outcome}")
        return os.path.join(self.save_dir, self.tag)

    def disk_error(self, exc: BaseException) -> CheckpointError | None:
        """The :class:`CheckpointError` for ``exc`` when it is the file system refusing this rank's
        files (full, read-only, not permitted), naming the tag, the directory and the bytes this
        rank writes; None for any other error."""
        needed = self.payload.nbytes + len(self.rank_state) + len(self.engine_state or b"")
        return disk_error(exc, rank=self.sync.rank, tag=self.tag, directory=self.tmp_dir, needed=needed)

    def write_tensors(self) -> None:
        """This rank's safetensors file, once: :meth:`run` writes it unless the caller already did (an
        asynchronous save of NVMe-tier state writes it on the training thread, which owns that state)."""
        if not self.tensors_written:
            rank = self.sync.rank
            path = os.path.join(self.tmp_dir, layout.rank_file(rank))
            self.checksums = self.payload.write(path, {"format": layout.FORMAT, "rank": str(rank)})
            self.tensors_written = True

    def _write_own(self) -> None:
        rank = self.sync.rank
        name = layout.rank_file(rank)
        path = os.path.join(self.tmp_dir, name)
        self.write_tensors()
        assert self.checksums is not None  # set by write_tensors
        crcs = self.checksums.tensors
        files: dict[str, dict[str, int]] = {name: {"bytes": os.path.getsize(path),
                                                   "header_crc32": self.checksums.header}}
        files.update(_write_bytes(os.path.join(self.tmp_dir, layout.rank_state(rank)), self.rank_state))
        if self.engine_state is not None:
            files.update(_write_bytes(os.path.join(self.tmp_dir, layout.ENGINE_STATE), self.engine_state))
        fragments = [dict(f, file=name, crc32=crcs[f["key"]]) for f in self.payload.fragments]
        index = {"files": files, "fragments": fragments, "scalars": self.payload.scalars,
                 "group_params": self.payload.group_params, "model": self.model}
        with open(os.path.join(self.tmp_dir, layout.rank_index(rank)), "w") as f:
            json.dump(index, f)
            f.flush()
            os.fsync(f.fileno())

    def _commit(self) -> str:
        manifest_bytes: int | None = None  # known once the manifest is encoded (a disk error's message)
        try:
            statuses = self.sync.gather("written")
            failed = [s for s in statuses.values() if not s.startswith("ok")]
            if failed:
                shutil.rmtree(self.tmp_dir, ignore_errors=True)
                raise CheckpointError("; ".join(failed))
            manifest = dict(self.manifest or {})
            manifest["files"], manifest["fragments"] = {}, []
            scalars: dict[str, Any] = {}
            groups: list[set[str]] = []
            records = []
            for rank in range(self.sync.world_size):
                with open(os.path.join(self.tmp_dir, layout.rank_index(rank))) as f:
                    index = json.load(f)
                records.append(index["model"])
                manifest["files"].update(index["files"])
                manifest["fragments"] += index["fragments"]
                for param, values in index["scalars"].items():
                    scalars.setdefault(param, values)
                for g, names in enumerate(index["group_params"]):
                    while len(groups) <= g:
                        groups.append(set())
                    groups[g].update(names)
            manifest.update(merge_records(records))
            if manifest.get("optimizer") is not None:
                manifest["optimizer"]["scalars"] = scalars
                for g, group in enumerate(manifest["optimizer"]["param_groups"]):
                    group["params"] = sorted(groups[g]) if g < len(groups) else []
            encoded = layout.encode_manifest(manifest)
            manifest_bytes = len(encoded)
            layout.write_file_atomic(os.path.join(self.tmp_dir, layout.MANIFEST), encoded)
            layout.fsync_dir(self.tmp_dir)
            final = layout.commit_dir(self.tmp_dir, self.save_dir, self.tag)
            if self.save_latest:
                layout.write_file_atomic(os.path.join(self.save_dir, layout.LATEST), self.tag.encode())
        except BaseException as exc:
            # a full or read-only disk at the commit: the same clear error here and on every peer
            error = disk_error(exc, rank=0, tag=self.tag, directory=self.save_dir, needed=manifest_bytes,
                               committing=True)
            self.sync.publish("committed", str(error) if error is not None else f"{type(exc).__name__}: {exc}")
            self._collect_acks()
            if error is not None:
                raise error from exc
            raise
        self.sync.publish("committed", "ok")
        self._collect_acks()
        return final

    def _collect_acks(self) -> None:
        """Wait until every rank has read the outcome: under the launcher rank 0 hosts the store, and a
        script that ends right after a save must not take the store away from ranks still polling it."""
        others = list(range(1, self.sync.world_size))
        if others:
            try:
                self.sync.gather("ack", ranks=others)
            except CheckpointError:  # a rank that died after the commit: the checkpoint stands
                pass


def disk_error(exc: BaseException, *, rank: int, tag: str, directory: str, needed: int | None,
               committing: bool = False) -> CheckpointError | None:
    """``exc`` as a save's :class:`CheckpointError` when it is a file system refusal (the table of
    :mod:`zerospeed.disk_errors`): the rank, the tag, the directory, the bytes the rank writes
    (``needed``, when known) and those free there; None for any other error (raised as it is).
    ``committing``: rank 0's commit failed (the manifest, the rename into place, ``latest``), so the
    message says that and ``needed`` counts the manifest's bytes."""
    said = layout.save_refusal(exc)
    if said is None:
        return None
    room = ""
    if needed is not None:
        whose = "the manifest needs" if committing else "this rank's files need"
        room = f"; {whose} {format_bytes(needed)} ({needed} bytes)"
        free = free_bytes(directory)  # the temporary directory may be gone: its file system then
        if free is not None:
            room += f", {format_bytes(free)} ({free} bytes) are free there now"
    if committing:
        what = (f"rank {rank} could not commit checkpoint {tag!r} in {directory} (writing its manifest, renaming "
                 f"it into place or rewriting '{layout.LATEST}')")
        outcome = f"'{layout.LATEST}' was not changed to name it"
    else:
        what = f"rank {rank} could not write its files of checkpoint {tag!r} into {directory}"
        outcome = f"The checkpoint was not committed ('{layout.LATEST}' is unchanged)"
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
    return CheckpointError(f"{what} ({said.name}: {said.cause}: {reason}){room}; {said.fix}. {outcome}")


def serialize(obj: Any) -> bytes:
    """``torch.save`` into memory (on the calling thread, so the bytes are a snapshot)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _write_bytes(path: str, data: bytes) -> dict[str, dict[str, int]]:
    """Write and fsync ``path``; its manifest entry (size and CRC-32 of the bytes in memory)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {os.path.basename(path): {"bytes": len(data), "crc32": checksum.crc32(data)}}


class BackgroundSave:
    """A :class:`SaveJob` running on its own thread; :meth:`wait` re-raises what it raised."""

    def __init__(self, job: SaveJob):
        self.job = job
        self.error: BaseException | None = None
        self.path: str | None = None
        self.thread = threading.Thread(target=self._run, name=f"zerospeed-save-{job.tag}", daemon=False)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.path = self.job.run()
        except BaseException as exc:
            self.error = exc

    def done(self) -> bool:
        return not self.thread.is_alive()

    def wait(self) -> str | None:
        self.thread.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise CheckpointError(f"the asynchronous save of checkpoint {self.job.tag!r} failed: {error}") from error
        return self.path
