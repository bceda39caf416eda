"""``zerospeed report`` (or ``python -m zerospeed.report``): what this installation runs, and why.

Prints versions, the accelerator and communication backend zerospeed would pick, and which CPU
optimizer and int8 matmul kernels are active (native, built at install time, or the PyTorch fallback) with
the reason.
"""

from __future__ import annotations

import platform
import sys


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


def main(argv: list[str] | None = None) -> int:
    for line in lines():
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
