"""A user script written for ``deepspeed.comm``, with only the import changed.

Run by ``python -m zerospeed --num_procs 2``; writes what each call gave to $ZS_TEST_OUT/rank<RANK>.json.
"""

import json
import os
import sys

import torch

import zerospeed.comm as dist


def main() -> None:
    dist.init_distributed(dist_backend=None, verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {"initialized": dist.is_initialized(), "rank": rank, "world": world,
                 "local_rank": dist.get_local_rank()}

    summed = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
    dist.all_reduce(summed)
    out["all_reduce"] = summed.tolist()
    biggest = torch.tensor([float(rank)])
    dist.all_reduce(biggest, op=dist.ReduceOp.MAX)
    out["all_reduce_max"] = biggest.item()
    averaged = torch.tensor([float(rank)])
    handle = dist.all_reduce(averaged, op=dist.ReduceOp.AVG, async_op=True)
    handle.wait()
    out["all_reduce_avg_async"] = averaged.item()

    dist.barrier()

    shared = torch.full((3,), float(rank + 5))
    dist.broadcast(shared, src=1)
    out["broadcast"] = shared.tolist()

    gathered = torch.empty(world * 2)
    dist.all_gather_into_tensor(gathered, torch.tensor([float(rank), rank + 0.5]))
    out["all_gather_into_tensor"] = gathered.tolist()

    part = torch.empty(2)
    dist.reduce_scatter_tensor(part, torch.arange(4, dtype=torch.float32) * (rank + 1))
    out["reduce_scatter_tensor"] = part.tolist()

    pair = dist.new_group([0, 1])
    only_zero = dist.new_group([0])
    mine = torch.tensor([float(rank + 1)])
    dist.all_reduce(mine, group=pair)
    out["new_group_sum"] = mine.item()
    out["new_group_size"] = dist.get_world_size(group=pair)
    lone = torch.tensor([float(rank + 1)])
    result = dist.all_reduce(lone, group=only_zero)  # rank 1 is outside: nothing happens, as in torch
    out["outside_group"] = [lone.item(), result is None, dist.get_rank(group=only_zero)]
    dist.barrier(group=pair)

    dist.destroy_process_group()
    out["after_destroy"] = dist.is_initialized()
    with open(os.path.join(os.environ["ZS_TEST_OUT"], f"rank{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see tests/launcher_scripts/gloo_allreduce.py: skip gloo's teardown abort
