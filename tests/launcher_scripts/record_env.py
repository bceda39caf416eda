"""Each rank writes its launcher-provided environment and argv to $ZS_TEST_OUT/rank<RANK>.json.

Deliberately does not import torch, so launcher tests stay fast.
"""

import json
import os
import sys

KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "OMP_NUM_THREADS")

if __name__ == "__main__":
    record = {"env": {key: os.environ.get(key) for key in KEYS}, "argv": sys.argv[1:],
              "name": __name__, "file": os.path.basename(__file__)}
    out = os.path.join(os.environ["ZS_TEST_OUT"], f"rank{os.environ['RANK']}.json")
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(record, fh)
