"""``zerospeed report`` (or ``python -m zerospeed.report``): what this installation runs, and why.

Prints versions, the accelerator and communication backend zerospeed would pick, and which CPU
optimizer and int8 matmul kernels are active (native, built at install time, or the PyTorch fallback) with
the reason.
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Sequence


def lines() -> list[str]:
    import torch

    import zerospeed
    from zerospeed.accelerator import get_accelerator
    from zerospeed.ops.int8 import kernels as int8_kernels
    from zerospeed.ops.native import choose

    accelerator = get_accelerator()
    kernels = choose("auto")
    int8 = int8_kernels("auto")
    int8_how = ""
    if int8.module is not None:
        isa, openmp = int8.module.features()
        int8_how = f" [{isa}, {'OpenMP threads' if openmp else 'one thread'}]"
    return [
        f"zerospeed {zerospeed.__version__}  (torch {torch.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()})",
        f"accelerator: {accelerator.device_type}  communication backend: {accelerator.backend}",
        f"CPU threads: {torch.get_num_threads()}",
        f"CPU optimizer kernels (CPUAdam, CPUAdagrad, CPULion): {kernels.name} - {kernels.reason}",
        f"int8 weight matmul (inference quantization): {int8.name}{int8_how} - {int8.reason}",
    ]


def build_parser() -> argparse.ArgumentParser:
    """The report takes no arguments; the parser gives it ``--help`` and refuses anything else (exit 2)
    before the report imports torch and probes the machine."""
    return argparse.ArgumentParser(
        prog="zerospeed report",
        description="Print what this installation runs: zerospeed's, torch's and Python's versions, the "
        "accelerator and communication backend zerospeed would pick, the CPU threads, and which CPU "
        "optimizer and int8 matmul kernels are active (native or the PyTorch fallback), with the reason.",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``zerospeed report``: parse the (empty) arguments, then print :func:`lines`."""
    build_parser().parse_args(list(argv) if argv is not None else None)
    for line in lines():
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
