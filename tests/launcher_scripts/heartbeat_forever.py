"""Write this rank's PID to $ZS_TEST_OUT/pid<RANK>, then beat $ZS_TEST_OUT/beat<RANK> "forever".

Stands for a training loop that never learns its launcher died. Deliberately does not import torch
(or zerospeed), so the orphan test stays fast and shows that the guard needs no import. "Forever" is
:data:`LIFETIME_S`: long past any test's deadline, but a failed test never leaves it running for good.
"""

import os
import time

LIFETIME_S = 120.0

if __name__ == "__main__":
    out, rank = os.environ["ZS_TEST_OUT"], os.environ["RANK"]
    with open(os.path.join(out, f"pid{rank}"), "w", encoding="utf-8") as fh:
        fh.write(str(os.getpid()))
    beats = 0
    end = time.monotonic() + LIFETIME_S
    while time.monotonic() < end:
        beats += 1
        with open(os.path.join(out, f"beat{rank}"), "w", encoding="utf-8") as fh:
            fh.write(str(beats))
        time.sleep(0.05)
