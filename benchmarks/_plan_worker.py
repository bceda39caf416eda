"""One training rank for ``bench_plan.py``: started as its own process (RANK/WORLD_SIZE/MASTER_* in
the environment, as the launcher starts ranks), it trains for a few steps and prints its peak RSS.

    python benchmarks/_plan_worker.py FACTORY CONFIG_JSON STEPS   (FACTORY: path.py:function)
    python benchmarks/_plan_worker.py --idle                      (the baseline: import, gloo, nothing else)
"""

from __future__ import annotations

import json
import logging
import sys


def main(argv: list[str]) -> None:
    import torch

    import zerospeed
    from zerospeed.accelerator.host_memory import peak_rss_bytes
    from zerospeed.distributed.env import init_distributed
    from zerospeed.plan.factory import as_example_batch, load_factory

    torch.set_num_threads(1)
    init_distributed(dist_backend="gloo")
    if argv[0] == "--idle":
        from zerospeed.plan.baseline import idle_then_tiny_step

        print("RESULT " + json.dumps(idle_then_tiny_step()), flush=True)
        return
    factory, config, steps = load_factory(argv[0]), json.loads(argv[1]), int(argv[2])
    logging.getLogger("zerospeed").setLevel(logging.WARNING)
    model, example = factory()
    engine, *_ = zerospeed.initialize(model=model, config=config)
    batch = as_example_batch(example, engine.train_micro_batch_size_per_gpu())
    for _ in range(steps * engine.gradient_accumulation_steps()):
        if isinstance(batch, dict):
            loss = engine(**batch)
        else:
            loss = engine(*batch) if isinstance(batch, (tuple, list)) else engine(batch)
        engine.backward(loss)
        engine.step()
    print("RESULT " + json.dumps({"peak": peak_rss_bytes(), "breakdown": engine.memory_breakdown()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
