"""Where a checkpoint's files live and how a tag is found: names, ``latest``, the manifest, validation.

A save directory holds one directory per tag and a ``latest`` file naming the newest. A tag
directory appears only by an atomic rename of a fully written, fsynced temporary directory
(``.tmp-<tag>-...``), so any tag directory that exists is complete. Overwriting a tag moves the old
directory to ``.old-<tag>`` for the instant between two renames; a reader finding the tag missing
but ``.old-<tag>`` present (a crash in that instant) uses the old one.

Integrity: the manifest records a CRC-32 of every stored tensor, of each safetensors header, of the
other files and of itself (``checksum: "crc32"``); :func:`read_manifest` checks the manifest and the
file sizes, :class:`~zerospeed.checkpoint.reader.CheckpointSet` the rest as it reads. A mismatch is a
:class:`CheckpointError` naming the file, the tensor and the tag and offering the previous tag
(:func:`damaged`). Manifests without ``checksum`` (older releases) are read without these checks.

One writer per folder: a job's committing rank holds :data:`SAVE_LOCK` (an exclusive ``flock``,
with host, PID and job id inside for the message) from its first save into a folder until the
engine is destroyed or the process ends (:class:`SaveLocks`); a second job is refused by name. The
kernel drops a ``flock`` when its holder dies, so a lock is stale exactly when its owner is gone.
Temporaries are ``flock``ed by their writer while in use, and a sweep deletes only those it can
lock itself (:func:`remove_stale_temporaries`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
from typing import Any, Iterator

from zerospeed.checkpoint import checksum
from zerospeed.disk_errors import Refusal, refusal

FORMAT = "zerospeed-checkpoint"
# 2: tensor-parallel parts (``tensor_parallel`` record, ``name#tp<r>of<n>`` fragments); written only by
# tensor-parallel saves, so every other checkpoint stays version 1 and readable by older releases
VERSION = 2
MANIFEST = "manifest.json"
LATEST = "latest"
ENGINE_STATE = "engine_state.pt"
TMP_PREFIX = ".tmp-"
# What a stored fragment holds: full-precision parameter values, an optimizer state, or a buffer.
MASTER = "master"
OPTIM_PREFIX = "optim."
BUFFER = "buffer"
OLD_PREFIX = ".old-"
# Integrity (see the module docstring): the algorithm named by the manifest's ``checksum`` key, and the key
# holding the CRC-32 of the manifest's own JSON. Additive fields: an older release ignores them and reads
# the checkpoint as before, so they need no new format version.
CHECKSUM = "crc32"
MANIFEST_CRC = "manifest_crc32"
SAVE_LOCK = ".zerospeed-save.lock"  # in the save folder; never deleted (deleting a lock file races its users)
_LOCK_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
log = logging.getLogger("zerospeed")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file or key and the fix."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint's tensors do not match the model's (missing or unexpected keys)."""


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def rank_index(rank: int) -> str:
    return f"rank{rank:05d}.index.json"


def rank_state(rank: int) -> str:
    return f"rank{rank:05d}.state.pt"


def tensor_key(kind: str, param: str, start: int, end: int) -> str:
    """A stored tensor's name: what it is, whose, and which elements of the flattened parameter."""
    return f"{kind}:{param}[{start}:{end}]"


def check_tag(tag: str) -> str:
    tag = str(tag)
    if not tag or tag in (".", "..") or "/" in tag or os.sep in tag or tag.startswith(".") or tag == LATEST:
        raise CheckpointError(f"checkpoint tag {tag!r} cannot be a directory name here: use a plain name such as "
                              f"'global_step100' (no '/', not starting with '.', not {LATEST!r})")
    return tag


def read_latest(save_dir: str) -> str | None:
    path = os.path.join(save_dir, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        tag = f.read().strip()
    return tag or None


def tag_dir(save_dir: str, tag: str) -> str | None:
    """The complete directory of ``tag``, recovering from a crash between the two renames of an
    overwrite; None if there is none."""
    path = os.path.join(save_dir, tag)
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    old = os.path.join(save_dir, OLD_PREFIX + tag)
    if os.path.isfile(os.path.join(old, MANIFEST)):
        return old
    return None


def resolve(load_dir: str, tag: str | None) -> tuple[str | None, str | None]:
    """``(tag, directory)`` to load, ``tag=None`` meaning the one ``latest`` names; ``(None, None)``
    when ``load_dir`` holds no checkpoint at all. A tag that was asked for but is absent raises."""
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            if os.path.isfile(os.path.join(load_dir, MANIFEST)):  # the tag directory itself was given
                return os.path.basename(os.path.normpath(load_dir)), load_dir
            return None, None
        try:
            check_tag(tag)
        except CheckpointError:
            raise CheckpointError(f"{os.path.join(load_dir, LATEST)} names {tag!r}, which is not a checkpoint tag; "
                                  f"pass tag= explicitly (tags there: {list_tags(load_dir) or 'none'})") from None
    check_tag(tag)  # refuses '../elsewhere' and a crash's '.tmp-...' directory
    path = tag_dir(load_dir, tag)
    if path is None and not os.path.isdir(load_dir):  # a mistyped folder is not an empty one
        raise CheckpointError(f"checkpoint tag {tag!r} not found: {why_no_checkpoint(load_dir)}")
    if path is None:
        present = list_tags(load_dir)
        raise CheckpointError(f"checkpoint tag {tag!r} not found in {load_dir} (tags there: {present or 'none'}); "
                              f"pass one of them as tag=")
    return tag, path


def list_tags(save_dir: str) -> list[str]:
    """The tags with a complete checkpoint in ``save_dir`` (a crash's ``.tmp-``/``.old-`` directories are
    not tags; a tag whose overwrite was interrupted counts through its ``.old-`` directory), in step order
    (``global_step9`` before ``global_step10``)."""
    if not os.path.isdir(save_dir):
        return []
    names = set()
    for name in os.listdir(save_dir):
        if name.startswith(OLD_PREFIX):
            name = name[len(OLD_PREFIX):]
        elif name.startswith(".") or name == LATEST:
            continue
        if name and tag_dir(save_dir, name):
            names.add(name)
    return sorted(names, key=_natural)


def why_no_checkpoint(load_dir: str, *, pick: str = "tag={!r}") -> str:
    """What ``load_dir`` holds when :func:`resolve` finds nothing to load there without a tag: it is
    missing, a file, empty, has tags but no ``latest`` (which to pick, and how), or other files only.
    ``pick`` renders the option choosing a tag (``tag='x'`` for ``load_checkpoint``, ``--tag x`` for
    ``zerospeed convert``). Every reader says it the same way, so a mistyped path is never reported
    as an empty folder and a folder of tags never as holding nothing."""
    where = os.path.abspath(load_dir)
    if not os.path.exists(where):
        parent = os.path.dirname(where)
        nor = "" if os.path.isdir(parent) else f", nor does its parent {parent}"
        return f"{where} is missing (no such directory{nor}): check the path for a typo or a missing mount"
    if not os.path.isdir(where):
        return f"{where} is a file, not a checkpoint directory: pass the directory given to save_checkpoint"
    tags = list_tags(where)
    if tags:
        return (f"{where} holds checkpoint tag(s) {', '.join(tags)} but no '{LATEST}' file naming the one to "
                f"load: pick one with {pick.format(tags[-1])}, or write a tag into {os.path.join(where, LATEST)}")
    entries = sorted(os.listdir(where))
    if not entries:
        return f"{where} is empty: it holds no checkpoint"
    shown = ", ".join(entries[:8]) + (f" and {len(entries) - 8} more" if len(entries) > 8 else "")
    return (f"{where} holds no checkpoint: no '{LATEST}' file and no tag directory with a {MANIFEST} "
            f"(it holds: {shown})")


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of the tag directory ``path``, checked: format, version, its own CRC-32 and every
    file's size (the files' contents are checked as they are read, see :mod:`reader`)."""
    file = os.path.join(path, MANIFEST)
    try:
        with open(file) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file} cannot be read ({exc}); the checkpoint is damaged, load another tag") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a zerospeed checkpoint manifest (format={manifest.get('format')!r})")
    if int(manifest.get("version", 0)) > VERSION:
        raise CheckpointError(f"{file} has format version {manifest['version']}, newer than this zerospeed reads "
                              f"({VERSION}); upgrade zerospeed")
    if "checksum" in manifest or MANIFEST_CRC in manifest:
        if manifest.get("checksum") != CHECKSUM:
            raise CheckpointError(f"{file} names checksum {manifest.get('checksum')!r}; this zerospeed checks "
                                  f"{CHECKSUM!r} only: upgrade zerospeed")
        stored = manifest.pop(MANIFEST_CRC, None)
        computed = checksum.crc32(_manifest_json(manifest))
        if stored != computed:
            raise damaged(path, f"{MANIFEST} does not match its checksum ({_crc_text(stored)} recorded, "
                                f"{_crc_text(computed)} computed)")
    for name, info in manifest["files"].items():
        actual = os.path.getsize(os.path.join(path, name)) if os.path.isfile(os.path.join(path, name)) else None
        if actual != info["bytes"]:
            raise damaged(path, f"{os.path.join(path, name)}: expected {info['bytes']} bytes, found "
                                f"{'no file' if actual is None else actual}")
    return manifest


def encode_manifest(manifest: dict[str, Any]) -> bytes:
    """``manifest`` as written: JSON, ``checksum`` naming the algorithm and, last, :data:`MANIFEST_CRC`
    holding the CRC-32 of the same JSON without it (what :func:`read_manifest` recomputes)."""
    body = {key: value for key, value in manifest.items() if key != MANIFEST_CRC}
    body["checksum"] = CHECKSUM
    text = _manifest_json(body)
    # == json.dumps({**body, MANIFEST_CRC: crc}, indent=1) without serializing a large manifest twice
    return text[: -len(b"\n}")] + f',\n "{MANIFEST_CRC}": {checksum.crc32(text)}\n}}'.encode()


def _manifest_json(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, indent=1).encode()


def _crc_text(crc: Any) -> str:
    return f"crc32 {crc:08x}" if isinstance(crc, int) else "none"


def check_crc(path: str, what: str, recorded: Any, actual: int) -> None:
    """Raise :func:`damaged` unless ``actual`` is the CRC-32 the manifest ``recorded`` for ``what``."""
    if recorded != actual:
        raise damaged(path, f"{what} does not match its checksum ({_crc_text(recorded)} recorded at save, "
                            f"{_crc_text(actual)} read)")


def damaged(path: str, what: str) -> CheckpointError:
    """The error for a tag directory ``path`` whose data fails a check: names the tag, what failed,
    and the tag to load instead (the newest one before it), with every other tag of the folder."""
    save_dir = os.path.dirname(os.path.normpath(path))
    name = os.path.basename(os.path.normpath(path))
    tag = name[len(OLD_PREFIX):] if name.startswith(OLD_PREFIX) else name
    others = [t for t in list_tags(save_dir) if t != tag]  # in step order
    earlier = [t for t in others if _natural(t) < _natural(tag)]
    if earlier:
        advice = (f"load the previous checkpoint instead: tag={earlier[-1]!r} "
                  f"(load_checkpoint(dir, tag=...) or `zerospeed convert --tag ...`)")
    elif others:
        advice = "no earlier tag is there; load another one with tag=..."
    else:
        advice = "no other tag is there to load instead"
    return CheckpointError(f"checkpoint {tag!r} is damaged: {what}. Its files changed after the save (a disk, "
                           f"copy or transfer error) and must not be trained from; {advice}. Tags in "
                           f"{save_dir}: {', '.join(others) or 'none besides this one'}")


def _natural(tag: str) -> list[Any]:
    """Sort key reading digit runs as numbers (``global_step9`` before ``global_step10``)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", tag)]


def write_file_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, fsync and rename (readers see old or new).
    The temporary's name carries its owner (``<path>.tmp-<host>-<pid>-<thread>``) and the owner holds a
    ``flock`` on it until the rename, so another job's sweep leaves it alone (:func:`remove_stale_temporaries`)."""
    tmp = f"{path}{TMP_PREFIX}{_owner_tag()}-{threading.get_ident()}"
    while True:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _try_flock(fd, fcntl.LOCK_EX)  # waits out a sweep that claimed it in the instant after its creation
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, tmp):
            break
        os.close(fd)  # that sweep deleted it: write a new one
    with open(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        os.replace(tmp, path)  # under the lock: the name is never seen unlocked while it is in use
    fsync_dir(os.path.dirname(path) or ".")


def _owner_tag() -> str:
    """``<host>-<pid>``: who owns a temporary file (read back by :func:`_owner_is_alive`)."""
    return f"{socket.gethostname()}-{os.getpid()}"


def _owner_is_alive(suffix: str) -> bool:
    """Whether a temporary whose name ends in ``<host>-<pid>-<thread>`` belongs to a live process of this
    host (older releases' ``<pid>-<thread>`` names, and other hosts' names, are left to the lock)."""
    parts = suffix.rsplit("-", 2)
    if len(parts) != 3 or parts[0] != socket.gethostname() or not parts[1].isdigit():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_dir(tmp: str, save_dir: str, tag: str) -> str:
    """Make the written ``tmp`` directory the tag's directory (replacing an older one) atomically."""
    final = os.path.join(save_dir, tag)
    old = os.path.join(save_dir, OLD_PREFIX + tag)
    if os.path.exists(old):  # from a crash during an earlier overwrite; the tag itself is complete
        if os.path.isdir(final):
            shutil.rmtree(old)
        else:
            os.rename(old, final)
    if os.path.exists(final):
        os.rename(final, old)
        fsync_dir(save_dir)
    os.rename(tmp, final)
    fsync_dir(save_dir)
    fsync_dir(os.path.dirname(save_dir) or ".")  # a save_dir created by this save survives a power loss too
    if os.path.exists(old):
        shutil.rmtree(old, ignore_errors=True)
    return final


def remove_stale_temporaries(save_dir: str, keep: str) -> None:
    """Sweep what crashed saves left (never ``keep``, the save in progress): ``.tmp-*`` directories,
    half-written ``latest.tmp-*`` files, and ``.old-<tag>`` directories, which are deleted when the
    tag is complete and otherwise renamed back to the tag (a crash between an overwrite's renames).
    A temporary is deleted only while this sweep holds its ``flock`` (its writer holds one as long as it
    writes, and the kernel drops that when the writer dies) and, for a file, only when the process its
    name names is not alive on this host: a live process's temporary is never deleted."""
    for name in os.listdir(save_dir):
        path = os.path.join(save_dir, name)
        if path == keep:
            continue
        if name.startswith(TMP_PREFIX) and os.path.isdir(path):
            with _claim(path) as stale:  # another engine's (or job's) save may still be writing there
                if stale:
                    shutil.rmtree(path, ignore_errors=True)
        elif name.startswith(f"{LATEST}{TMP_PREFIX}") and not _owner_is_alive(name[len(LATEST + TMP_PREFIX):]):
            with _claim(path) as stale:
                if stale:
                    with contextlib.suppress(FileNotFoundError):  # renamed into place meanwhile
                        os.unlink(path)
        elif name.startswith(OLD_PREFIX) and os.path.isdir(path):
            final = os.path.join(save_dir, name[len(OLD_PREFIX):])
            if os.path.isfile(os.path.join(final, MANIFEST)):
                shutil.rmtree(path, ignore_errors=True)
            elif not os.path.exists(final) and os.path.isfile(os.path.join(path, MANIFEST)):
                os.rename(path, final)
                fsync_dir(save_dir)


class DirLease:
    """A shared ``flock`` on a directory a save is writing into (created if missing), held until
    :meth:`release`, so a sweep of stale temporaries (:func:`remove_stale_temporaries`) leaves it alone.
    A crashed process's lease goes with it, which is what makes its leftovers sweepable. A sweep that
    claimed the new directory in the instant before the lease is waited out and the directory made again."""

    def __init__(self, path: str):
        while True:
            os.makedirs(path, exist_ok=True)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # swept in the instant after it was made
                continue
            try:
                _try_flock(fd, fcntl.LOCK_SH)  # without flock support no sweep deletes it (see _claim)
            except BaseException:
                os.close(fd)
                raise
            if _same_file(fd, path):  # not removed (or removed and made again) by a sweep meanwhile
                break
            os.close(fd)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@contextlib.contextmanager
def _claim(path: str) -> Iterator[bool]:
    """Yield whether ``path`` (a temporary file or directory) is stale: no process holds a ``flock`` on
    it. While the block runs this sweep holds the exclusive lock, so a writer taking its lock at that
    moment waits and then sees the path deleted (:class:`DirLease`, :func:`write_file_atomic`).

    Stale only when the lock taken is on the file ``path`` names when the lock is held (it may have been
    renamed into place and the name reused in between: deleting by name would then delete a live
    file), and never where the file system does not support ``flock`` (nothing tells a live writer's
    temporary from a dead one's there)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # gone already (renamed into place, or swept by another)
        yield False
        return
    try:
        try:
            locked = _try_flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # its writer holds it
            locked = False
        yield locked and _same_file(fd, path)
    finally:
        os.close(fd)


def _try_flock(fd: int, operation: int) -> bool:
    """``flock(fd, operation)``; False where the file system does not support ``flock`` (some NFS,
    Lustre and FUSE mounts: ``ENOLCK``, ``EOPNOTSUPP``...), so every caller goes on without the lock
    rather than failing the save, as docs/checkpoints.md promises. ``BlockingIOError`` (``LOCK_NB``, held
    elsewhere) and other errors propagate."""
    try:
        fcntl.flock(fd, operation)
    except OSError as exc:
        if exc.errno in _LOCK_UNSUPPORTED:
            return False
        raise
    return True


def _same_file(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file or directory open as ``fd``: not deleted, and not deleted
    and made again under the same name. By device and inode rather than ``st_nlink == 0``: an NFS client
    keeps a deleted file that is still open as ``.nfsXXXX``, with a link. ``stat``, not ``lstat``: the
    ``open`` that made ``fd`` followed a symbolic link too (with ``lstat`` a linked lock file would never
    match, and its lock would be retaken forever)."""
    try:
        named = os.stat(path)
    except OSError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


class SaveLocks:
    """The save folders one engine writes into, each locked against other jobs from the engine's first
    save into it until :meth:`release` (``engine.destroy()``) or the end of the process.

    Why for the engine's lifetime and not per save: two jobs whose saves merely take turns still
    overwrite each other's ``global_step<N>`` tags and ``latest``, and each would report success. The
    job's committing rank (rank 0 of the save) calls :meth:`acquire` before it touches the folder. The
    lock is an exclusive ``flock`` on ``<folder>/.zerospeed-save.lock``, whose content (host, PID, job
    id, engine, time) names the holder in the refusal. The kernel drops a ``flock`` when its holder's
    process ends, even by SIGKILL, so a lock is never stale while its owner lives and never outlives
    it. Another engine of the same process may save into a folder this process holds (a script that
    builds a second engine to resume): its saves go on unlocked, as they are ordered by the script.
    "This process" is told by :func:`process_identity` in the record, not by host and PID alone, which
    two containers with one host name and PID namespaces of their own can share.
    A run that saves each checkpoint into a folder of its own (the Hugging Face Trainer's
    ``checkpoint-<step>``) would hold a descriptor per folder: a folder deleted since (checkpoint
    rotation) is let go, and at most :attr:`MAX_HELD` of the most recently used folders stay locked.
    """

    MAX_HELD = 64

    def __init__(self, engine_id: str):
        self.engine_id = engine_id
        self._held: dict[str, int] = {}  # folder (real path) -> descriptor holding its lock
        self._unlocked: set[str] = set()  # folders whose file system refused flock (warned once)
        self._unnamed: set[str] = set()  # held folders whose lock file lacks this job's record (write failed)

    def acquire(self, save_dir: str) -> None:
        """Hold ``save_dir``'s lock (a no-op once held); raise :class:`CheckpointError` naming the holder
        when another live job holds it, or naming the folder and the fix when the lock file cannot be
        made there (a folder this user may not write, a read-only or full disk)."""
        key = os.path.realpath(save_dir)
        if key in self._held:
            fd = self._held.pop(key)
            if _same_file(fd, os.path.join(key, SAVE_LOCK)):  # still the folder's lock file
                self._held[key] = fd  # the most recently used last
                if key in self._unnamed:  # its record could not be written last time: try again
                    self._write_record(fd, key, save_dir)
                return
            os.close(fd)  # the folder was deleted (and made again): lock its new file
            self._unnamed.discard(key)
        if key in self._unlocked:
            return
        path = os.path.join(save_dir, SAVE_LOCK)
        while True:
            fd, writable = _open_lock_file(save_dir, path)
            try:
                locked = _try_flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                if _is_this_process(holder):
                    return  # another engine of this process (see the class docstring)
                raise CheckpointError(_held_elsewhere(save_dir, path, holder)) from None
            except BaseException:
                os.close(fd)
                raise
            if not locked:
                os.close(fd)
                self._unlocked.add(key)
                log.warning("save_checkpoint: the file system of %s does not support flock, so this job saves there "
                            "without the folder lock: make sure no other job saves into the same folder", save_dir)
                return
            if _same_file(fd, path):
                break
            os.close(fd)  # the folder was deleted between the open and the lock: lock the new one
        # Held from here on, before anything can fail: a job whose record write fails (a full disk) must
        # not find its own lock held by "a process that has not written its name" at its next save.
        self._held[key] = fd
        if writable:
            self._write_record(fd, key, save_dir)
        for old in [k for k, held in self._held.items() if not _same_file(held, os.path.join(k, SAVE_LOCK))]:
            os.close(self._held.pop(old))  # the folder was deleted
            self._unnamed.discard(old)
        while len(self._held) > self.MAX_HELD:
            oldest = next(iter(self._held))
            os.close(self._held.pop(oldest))
            self._unnamed.discard(oldest)

    def _write_record(self, fd: int, key: str, save_dir: str) -> None:
        """Write who holds the lock into its file (for another job's refusal). A failure (a full disk)
        leaves the lock held and is retried at the next save: the save itself then says what failed."""
        record = {"host": socket.gethostname(), "pid": os.getpid(), "process": process_identity(),
                  "job": job_id(), "engine": self.engine_id, "since": time.strftime("%Y-%m-%d %H:%M:%S %z")}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
        except OSError as exc:
            self._unnamed.add(key)
            log.warning("save_checkpoint: this job holds the lock of %s but could not write its name into %s (%s); "
                        "another job refused there is not told who holds it", save_dir,
                        os.path.join(save_dir, SAVE_LOCK), exc)
        else:
            self._unnamed.discard(key)

    def holds(self, save_dir: str) -> bool:
        """Whether this engine holds ``save_dir``'s lock."""
        return os.path.realpath(save_dir) in self._held

    def release(self) -> None:
        """Let other jobs save into the folders again (the lock file stays: deleting it would race)."""
        held, self._held = self._held, {}
        self._unnamed = set()
        for fd in held.values():
            os.close(fd)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.release()


def job_id() -> str | None:
    """The launcher's name for this job: torch elastic's run id (zerospeed's launcher, torchrun), else
    SLURM's job id; None outside both."""
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = os.environ.get(name)
        if value and value != "none":
            return value
    return None


def process_identity() -> str | None:
    """This process told apart from every other one on the machine, whatever the host name and PID say:
    the kernel's boot id, the inode of this process's PID namespace (containers sharing a host name
    have PID namespaces of their own, and their PIDs collide) and the process's start time in clock
    ticks after boot (a later process reusing the PID started later). None without Linux's ``/proc``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
        start = fields[19].decode()  # field 22 of proc(5), counted from field 3 (state)
    except (OSError, IndexError, UnicodeDecodeError):
        return None
    return f"{boot}:{namespace}:{start}"


def _is_this_process(holder: dict[str, Any]) -> bool:
    """Whether the lock record ``holder`` was written by this very process (another engine of it): the
    same host and PID, and where both sides know it the same :func:`process_identity` (a record of an
    older release has none, and is judged by host and PID as it was then)."""
    if holder.get("host") != socket.gethostname() or holder.get("pid") != os.getpid():
        return False
    theirs, mine = holder.get("process"), process_identity()
    return theirs is None or mine is None or theirs == mine


def _open_lock_file(save_dir: str, path: str) -> tuple[int, bool]:
    """``(descriptor, writable)`` of ``save_dir``'s lock file, made (with the folder) if missing. A lock
    file another user made is opened read-only (it can be locked, not rewritten). A folder where it
    cannot be made is a :class:`CheckpointError` naming the folder, the cause and the fix."""
    try:
        os.makedirs(save_dir, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644), True
    except PermissionError as exc:
        try:
            return os.open(path, os.O_RDONLY), False
        except OSError:
            raise _unusable_folder(save_dir, path, exc) from exc
    except OSError as exc:
        if save_refusal(exc) is None:
            raise
        raise _unusable_folder(save_dir, path, exc) from exc


def save_refusal(exc: BaseException) -> Refusal | None:
    """``exc`` in words (:mod:`zerospeed.disk_errors`) when the file system refused a save's write, with
    the fix pointing at ``save_checkpoint``'s ``save_dir``; None for other errors."""
    return refusal(exc, to="save to", note=" (save_checkpoint's save_dir)")


def _unusable_folder(save_dir: str, path: str, exc: OSError) -> CheckpointError:
    said = save_refusal(exc) or Refusal(errno.errorcode.get(exc.errno or 0, str(exc.errno)), "",
                                        "save to another directory (save_checkpoint's save_dir)")
    cause = f"{said.cause}: " if said.cause else ""
    return CheckpointError(f"save_checkpoint cannot save into {save_dir}: making its lock file {path} failed "
                           f"({said.name}: {cause}{exc.strerror or exc}); {said.fix}. Nothing was saved")


def _read_holder(fd: int) -> dict[str, Any]:
    """The holder's record in a lock file (it writes it just after locking: retried briefly)."""
    for _ in range(10):
        try:
            record = json.loads(os.pread(fd, 4096, 0) or b"null")
        except (ValueError, OSError):
            record = None
        if isinstance(record, dict):
            return record
        time.sleep(0.02)
    return {}


def _held_elsewhere(save_dir: str, path: str, holder: dict[str, Any]) -> str:
    if holder:
        who = (f"host {holder.get('host')}, pid {holder.get('pid')}, job {holder.get('job') or 'unnamed'} "
               f"(engine {str(holder.get('engine'))[:8]}, saving there since {holder.get('since')})")
    else:
        who = "a process that has not written its name into the lock file"
    return (f"save_checkpoint: another job is saving into {save_dir}: {who} holds {path}. Two jobs saving into "
            f"one folder overwrite each other's tags and 'latest'. Give this run its own save_dir, or stop that "
            f"job first (engine.destroy() or its exit releases the lock; the kernel drops it even when the job is "
            f"killed, so it is never stale; processes the holder forked hold it with it; shared file systems: "
            f"docs/checkpoints.md)")
