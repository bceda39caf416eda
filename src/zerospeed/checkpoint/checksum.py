"""The CRC-32 every checkpoint checksum is: zlib's polynomial and values, computed by ISA-L when it is there.

``isal.isal_zlib.crc32`` (python-isal, a dependency) gives the same values as ``zlib.crc32`` at about 3x
its speed on x86-64 (12.5 against 3.7 GB/s in memory here), which matters on a load from the page cache,
where the check's CPU time is not hidden behind a disk. Both release the GIL on large buffers, so the
checkpoint writer and reader can run it on a helper thread. A platform without an isal wheel falls back
to ``zlib``; checkpoints are the same either way, so either reads what the other wrote.

Callers use ``checksum.crc32(...)`` through this module (never ``from ... import crc32``), so
``benchmarks/bench_checkpoint.py`` can stub the one function to measure the cost of the checks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

try:
    from isal.isal_zlib import crc32 as _crc32

    IMPLEMENTATION = "isal"
except ImportError:  # no wheel for this platform: the standard library's, same values
    from zlib import crc32 as _crc32

    IMPLEMENTATION = "zlib"

__all__ = ["IMPLEMENTATION", "crc32"]


def crc32(data: ReadableBuffer, value: int = 0) -> int:
    """The CRC-32 of ``data`` continued from ``value`` (``zlib.crc32``'s semantics and results)."""
    return _crc32(data, value)
