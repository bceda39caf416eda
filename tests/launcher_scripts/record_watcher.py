"""Record which processes hold this launch's ``ranks.lock`` open: the rank's watcher (found by its open
file, not by its name), as ``<pid> <start time>`` lines in $ZS_TEST_OUT/watchers-<this rank's PID>.

$TMPDIR is the test's own folder and the launches run one after another, so it holds exactly one
launch folder while this rank runs. Imports only the standard library and the guard (no torch).
"""

import glob
import os
import time

from zerospeed.launcher.worker_guard import LOCK_NAME, RUN_DIR_PREFIX, ProcessIdentity

# Seconds to look for the watcher before recording what was found (nothing: the test then fails).
SEARCH_S = 10.0


def holders(path: str) -> list[int]:
    """PIDs of the other processes with ``path`` open."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry}/fd/{fd}") == path:
                    found.append(int(entry))
                    break
            except OSError:
                continue
    return found


if __name__ == "__main__":
    (run_dir,) = glob.glob(os.path.join(os.environ["TMPDIR"], RUN_DIR_PREFIX + "*"))
    lock = os.path.realpath(os.path.join(run_dir, LOCK_NAME))
    end = time.monotonic() + SEARCH_S
    pids = holders(lock)
    while not pids and time.monotonic() < end:
        time.sleep(0.05)
        pids = holders(lock)
    lines = [f"{pid} {ProcessIdentity.of(pid).start}\n" for pid in pids]
    target = os.path.join(os.environ["ZS_TEST_OUT"], f"watchers-{os.getpid()}")
    with open(target + ".tmp", "w", encoding="utf-8") as fh:
        fh.writelines(lines)
    os.replace(target + ".tmp", target)
