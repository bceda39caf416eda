"""Where a checkpoint's files live and how a tag is found: names, ``latest``, the manifest, validation.

A save directory holds one directory per tag and a ``latest`` file naming the newest. A tag
directory appears only by an atomic rename of a fully written, fsynced temporary directory
(``.tmp-<tag>-...``), so any tag directory that exists is complete. Overwriting a tag moves the old
directory to ``.old-<tag>`` for the instant between two renames; a reader finding the tag missing
but ``.old-<tag>`` present (a crash in that instant) uses the old one.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import threading
from typing import Any

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
    if path is None:
        present = list_tags(load_dir)
        raise CheckpointError(f"checkpoint tag {tag!r} not found in {load_dir} (tags there: {present or 'none'}); "
                              f"pass one of them as tag=")
    return tag, path


def list_tags(save_dir: str) -> list[str]:
    """The tags with a complete checkpoint in ``save_dir`` (a crash's ``.tmp-``/``.old-`` directories are
    not tags; a tag whose overwrite was interrupted counts through its ``.old-`` directory)."""
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
    return sorted(names)


def read_manifest(path: str) -> dict[str, Any]:
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
    for name, info in manifest["files"].items():
        actual = os.path.getsize(os.path.join(path, name)) if os.path.isfile(os.path.join(path, name)) else None
        if actual != info["bytes"]:
            raise CheckpointError(f"{os.path.join(path, name)}: expected {info['bytes']} bytes, found "
                                  f"{'no file' if actual is None else actual}; the checkpoint is damaged")
    return manifest


def write_file_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, fsync and rename (readers see old or new)."""
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


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
    tag is complete and otherwise renamed back to the tag (a crash between an overwrite's renames)."""
    for name in os.listdir(save_dir):
        path = os.path.join(save_dir, name)
        if path == keep:
            continue
        if name.startswith(TMP_PREFIX) and os.path.isdir(path):
            if not _in_use(path):  # another engine's (or job's) save may still be writing there
                shutil.rmtree(path, ignore_errors=True)
        elif name.startswith(f"{LATEST}{TMP_PREFIX}") and os.path.isfile(path):
            os.unlink(path)
        elif name.startswith(OLD_PREFIX) and os.path.isdir(path):
            final = os.path.join(save_dir, name[len(OLD_PREFIX):])
            if os.path.isfile(os.path.join(final, MANIFEST)):
                shutil.rmtree(path, ignore_errors=True)
            elif not os.path.exists(final) and os.path.isfile(os.path.join(path, MANIFEST)):
                os.rename(path, final)
                fsync_dir(save_dir)


class DirLease:
    """A shared ``flock`` on a directory a save is writing into, held until :meth:`release`, so a sweep
    of stale temporaries (:func:`remove_stale_temporaries`) leaves it alone. A crashed process's
    lease goes with it, which is what makes its leftovers sweepable."""

    def __init__(self, path: str):
        self._fd: int | None = os.open(path, os.O_RDONLY)
        fcntl.flock(self._fd, fcntl.LOCK_SH)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _in_use(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
