"""Form a gloo process group from the launcher's env vars and all-reduce each rank's rank+1.

Writes {"rank", "world_size", "sum"} to $ZS_TEST_OUT/rank<RANK>.json.
"""

import json
import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    dist.barrier()
    dist.destroy_process_group()
    out = os.path.join(os.environ["ZS_TEST_OUT"], f"rank{rank}.json")
    with open(out, "w", encoding="utf-8") as fh:
        json.dump({"rank": rank, "world_size": world, "sum": value.item()}, fh)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    # torch 2.13 + gloo can abort in C++ static destructors at interpreter exit ("terminate called
    # without an active exception") after all work is done; skipping them keeps this test
    # deterministic. The launcher itself must and does report such an abort as a failure.
    os._exit(0)
