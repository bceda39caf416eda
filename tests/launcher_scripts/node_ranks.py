"""A rank of the node-agent tests (tests/test_launcher_node.py).

Prints ``ranks RANK WORLD_SIZE LOCAL_RANK pid=PID lost_at=... restarts=...``, then LINES long lines
(``long RANK i`` + LINE_BYTES copies of a letter per rank, each written in two pieces: the text, then
the newline, as ``print`` under ``python -u`` does), all-reduces rank+1 over gloo and prints the sum.
``ZS_NO_DIST=1`` skips torch (and the all-reduce): the rank only prints and sleeps ZS_HOLD_S.
``ZS_FAIL_RANK=r`` makes rank r raise after the all-reduce (its traceback is the last it prints);
``ZS_HOLD_S=s`` keeps every rank in a sleep loop for s seconds after the all-reduce (so a test can
stop the job while it runs; not after an elastic restart), all-reducing every 50 ms with ``ZS_HOLD_COLLECTIVE=1`` (as training
would: that is how the ranks notice a lost peer); ``ZS_TEST_OUT`` gets ``pid<RANK>-<restart>`` files.
"""

import os
import sys
import time


def main() -> None:
    rank, world, local = os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]
    out = os.environ.get("ZS_TEST_OUT")
    if out:
        with open(os.path.join(out, f"pid{rank}-{os.environ.get('ZEROSPEED_ELASTIC_RESTART_COUNT', '0')}"),
                  "w") as fh:
            fh.write(str(os.getpid()))
    print(f"ranks {rank} {world} {local} pid={os.getpid()} "
          f"lost_at={os.environ.get('ZEROSPEED_ELASTIC_LOST_AT', '-')} "
          f"restarts={os.environ.get('ZEROSPEED_ELASTIC_RESTART_COUNT', '-')}")
    letter = "abcdefgh"[int(rank) % 8]
    for i in range(int(os.environ.get("LINES", "0"))):
        sys.stdout.write(f"long {rank} {i} " + letter * int(os.environ.get("LINE_BYTES", "10000")))
        sys.stdout.write("\n")
    if os.environ.get("ZS_NO_DIST"):  # no torch at all: a light rank for the stop tests
        time.sleep(float(os.environ.get("ZS_HOLD_S", "0")))
        return
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    print(f"sum {rank} {value.item():g}")
    if os.environ.get("ZS_FAIL_RANK") == rank:
        raise RuntimeError(f"rank {rank} fails on purpose")
    hold = 0.0 if os.environ.get("ZEROSPEED_ELASTIC_RESTART_COUNT") else float(os.environ.get("ZS_HOLD_S", "0"))
    end = time.monotonic() + hold
    while time.monotonic() < end:
        time.sleep(0.05)
        if os.environ.get("ZS_HOLD_COLLECTIVE"):
            dist.all_reduce(value)  # fails once a peer is gone: how training notices a lost rank or host


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        # Reported as an uncaught exception would be (torch's excepthook prefixes "[rankN]:"), then exit 1
        # without gloo's destructors: with a peer's all-reduce pending they abort the process (exit 134).
        sys.excepthook(*sys.exc_info())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see gloo_allreduce.py: skip gloo's static destructors at exit
