"""Why a file system refused a write, and what to do about it: one table for checkpoints and NVMe offload.

A full, read-only or forbidden disk surfaces as an ``OSError`` whose errno is the only hint; the user
needs the cause in words, the path and the setting that moves the files. Checkpoint saves
(:mod:`zerospeed.checkpoint.commit`, the folder lock in :mod:`zerospeed.checkpoint.layout`) and NVMe
offload (:mod:`zerospeed.offload.nvme`) say it from this one table, so the same errno reads the same
everywhere; each caller says only how its files are moved (``save to`` / ``point <key> at``).

Imports nothing of zerospeed (it sits beside :mod:`zerospeed.tensor_bytes`), so both ``checkpoint`` and
``offload`` may import it.
"""

from __future__ import annotations

import errno
import os
import shutil
from types import MappingProxyType
from typing import Mapping, NamedTuple


class Refusal(NamedTuple):
    """One refusal in words: the errno's name (``ENOSPC``), its cause and the fix for this caller."""

    name: str
    cause: str
    fix: str


# errno -> (cause, fix). The fix is a template: ``{to}`` moves the files ("save to", "point <key> at"),
# ``{where}`` is the kind of directory ("directory", "NVMe directory"), ``{note}`` names the setting
# after the place (" (save_checkpoint's save_dir)", or nothing when ``{to}`` names it already).
_CAUSES: Mapping[int, tuple[str, str]] = MappingProxyType({
    errno.ENOSPC: ("the disk is full", "free space there or {to} a larger disk{note}"),
    errno.EDQUOT: ("this user's disk quota is used up", "free space there or {to} another disk{note}"),
    errno.EFBIG: ("the file is larger than the file system allows", "{to} another file system{note}"),
    errno.EROFS: ("the file system is mounted read-only", "{to} a writable {where}{note} (or remount it read-write)"),
    errno.EACCES: ("this user may not write there", "{to} another {where} this user can write{note}"),
    errno.EPERM: ("this user may not write there", "{to} another {where} this user can write{note}"),
})


def refusal(exc: BaseException | int, *, to: str, where: str = "directory", note: str = "") -> Refusal | None:
    """``exc`` (an error, or an errno) in words when it is the file system refusing a write (full, over
    quota, too large, read-only, not permitted); None for any other error, which the caller raises as
    it is."""
    code = exc if isinstance(exc, int) else exc.errno if isinstance(exc, OSError) else None
    if code is None or code not in _CAUSES:
        return None
    cause, fix = _CAUSES[code]
    return Refusal(errno.errorcode[code], cause, fix.format(to=to, where=where, note=note))


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Bytes free on the file system of ``path``, or of its nearest existing parent (the directory a
    failed write was meant for may be gone, or never made); None when that cannot be asked."""
    probe = os.fspath(path)
    while probe and not os.path.isdir(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        return shutil.disk_usage(probe or ".").free
    except OSError:
        return None
