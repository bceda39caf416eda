"""``zerospeed report`` (or ``python -m zerospeed.report``): what this installation runs, and why.

Prints versions, the accelerator and communication backend zerospeed would pick, and which CPU
optimizer kernels are active (native, built at install time, or the PyTorch fallback) with the reason.
"""

from __future__ import annotations

import platform
import sys


def lines() -> list[str]:
    import torch

    import zerospeed
    from zerospeed.accelerator import get_accelerator
    from zerospeed.ops.native import choose

    accelerator = get_accelerator()
    kernels = choose("auto")
    return [
        f"zerospeed {zerospeed.__version__}  (torch {torch.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()})",
        f"accelerator: {accelerator.device_type}  communication backend: {accelerator.backend}",
        f"CPU threads: {torch.get_num_threads()}",
        f"CPU optimizer kernels (CPUAdam, CPUAdagrad, CPULion): {kernels.name} - {kernels.reason}",
    ]


def main(argv: list[str] | None = None) -> int:
    for line in lines():
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
