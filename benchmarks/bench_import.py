"""Interpreter start and ``import deepspeed``: zerospeed standing in (``ZEROSPEED_AS_DEEPSPEED=1``) vs the
real DeepSpeed, each in a fresh interpreter, interleaved run by run so machine noise hits both alike.

    python benchmarks/bench_import.py [--runs 5] [--deepspeed-python /tmp/dsvenv/bin/python]

``--deepspeed-python`` is an interpreter with DeepSpeed installed (a separate venv: zerospeed refuses to
stand in where the real one is installed); without it only zerospeed's rows are measured. Prints the
median wall time of each command and the ratio real / zerospeed for ``import deepspeed``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

CASES = {
    "start, switch off (python -c pass)": ("zerospeed", "pass", {}),
    "import deepspeed": ("zerospeed", "import deepspeed", {"ZEROSPEED_AS_DEEPSPEED": "1"}),
    "import deepspeed + reach the engine": ("zerospeed", "import deepspeed; deepspeed.initialize; "
                                            "deepspeed.runtime.engine.DeepSpeedEngine",
                                            {"ZEROSPEED_AS_DEEPSPEED": "1"}),
    "real: import deepspeed": ("deepspeed", "import deepspeed", {}),
}


def _time(python: str, code: str, env_extra: dict[str, str]) -> float:
    env = {k: v for k, v in os.environ.items() if k != "ZEROSPEED_AS_DEEPSPEED"}
    env.update(env_extra)
    start = time.perf_counter()
    subprocess.run([python, "-c", code], check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--deepspeed-python", default=None, help="an interpreter with the real DeepSpeed")
    args = parser.parse_args()
    pythons = {"zerospeed": sys.executable, "deepspeed": args.deepspeed_python}
    cases = {name: case for name, case in CASES.items() if pythons[case[0]] is not None}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.runs):
        for name, (side, code, env) in cases.items():
            times[name].append(_time(pythons[side] or "", code, env))
    for name, runs in times.items():
        print(f"{name:40s} median {statistics.median(runs):6.3f} s   runs {' '.join(f'{t:.3f}' for t in runs)}")
    if "real: import deepspeed" in times:
        ratio = statistics.median(times["real: import deepspeed"]) / statistics.median(times["import deepspeed"])
        print(f"import deepspeed: real / zerospeed = {ratio:.1f}x")


if __name__ == "__main__":
    main()
