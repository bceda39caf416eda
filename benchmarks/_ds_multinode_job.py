"""The DeepSpeed flavour of ``_multinode_bench.py``'s job, run by the ranks DeepSpeed 0.19.8's runner starts.

Same model, data, batch and loop (imported from ``_multinode_bench``); DeepSpeed's ``init_distributed``
with gloo and its CPU accelerator (``DS_ACCELERATOR=cpu``, which the benchmark puts in the job folder's
``.deepspeed_env`` so DeepSpeed's runner exports it to every host); torch's Adam as the client optimizer
(DeepSpeed's own "Adam" type is FusedAdam, a CUDA op). Writes the same ``start-rank*.json`` and
``losses.jsonl``. Run with ``/tmp/dsvenv/bin/python`` (no zerospeed there).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _multinode_bench as job  # noqa: E402  (records T0 at its import: the first thing this script does)
import torch  # noqa: E402


def main() -> None:
    args = job.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import logging

    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    t_imported = time.time()
    deepspeed.init_distributed(dist_backend="gloo")
    model = job.build_model(args)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                           config={**job.config(args), "zero_allow_untested_optimizer": True})
    rank, world = dist.get_rank(), dist.get_world_size()
    job.record_start(out, rank, t_imported, time.time())
    job.train_loop(engine, rank, world, args, out, dist.all_reduce)
    engine.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
