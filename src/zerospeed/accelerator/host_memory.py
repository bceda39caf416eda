"""Host memory figures for the CPU accelerator without a psutil dependency.

DeepSpeed's CPU accelerator reads psutil; zerospeed does not depend on it, so these read what Linux
publishes in ``/proc`` and ``/sys`` and fall back to ``os.sysconf``/``resource`` elsewhere.
"""

from __future__ import annotations

import glob
import os
import resource
import sys


def _page_size() -> int:
    return int(os.sysconf("SC_PAGE_SIZE"))


def _proc_kib_line(path: str, key: str) -> int | None:
    """Bytes of the ``key: N kB`` line of a ``/proc`` file, None where it cannot be read."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return None


def _ru_maxrss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # macOS reports bytes


def rss_bytes() -> int:
    """Resident set size of this process now (the peak, if only that is readable)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * _page_size()
    except (OSError, IndexError, ValueError):
        return _ru_maxrss_bytes()


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (``VmHWM``; ``ru_maxrss`` where ``/proc`` is not readable)."""
    peak = _proc_kib_line("/proc/self/status", "VmHWM:")
    return peak if peak is not None else _ru_maxrss_bytes()


def total_bytes() -> int:
    """Physical memory of the machine."""
    return int(os.sysconf("SC_PHYS_PAGES")) * _page_size()


def available_bytes() -> int:
    """Memory a new allocation can get without swapping (``MemAvailable``), free pages otherwise."""
    available = _proc_kib_line("/proc/meminfo", "MemAvailable:")
    return available if available is not None else int(os.sysconf("SC_AVPHYS_PAGES")) * _page_size()


def numa_node_count() -> int:
    """NUMA nodes that own CPU cores (memory-only nodes, e.g. HBM in flat mode, are not counted)."""
    core_lists: set[str] = set()
    for path in glob.glob("/sys/devices/system/node/node[0-9]*/cpulist"):
        try:
            with open(path, encoding="ascii") as f:
                cores = f.read().strip()
        except OSError:
            continue
        if cores:
            core_lists.add(cores)
    return max(1, len(core_lists))
