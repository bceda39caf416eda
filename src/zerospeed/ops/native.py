"""Which implementation of the native CPU kernels is active, and why.

The native kernels (``_cpu_optim`` for the optimizers, ``_int8_gemm`` for int8 weight matmuls; C,
vectorised for the installing machine's CPU) are compiled when the package is installed and never at
run time; where they could not be built, or when asked (``implementation="torch"``), the callers run a
pure-PyTorch path with the same arithmetic.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from types import ModuleType

IMPLEMENTATIONS = ("auto", "native", "torch")


@dataclass(frozen=True)
class KernelChoice:
    """The kernels an optimizer will run: ``module`` is None for the PyTorch path."""

    module: ModuleType | None
    reason: str

    @property
    def name(self) -> str:
        return "native" if self.module is not None else "torch"


OPTIMIZER_KERNELS = "zerospeed.ops._cpu_optim"
INT8_KERNELS = "zerospeed.ops._int8_gemm"


@functools.lru_cache(maxsize=None)
def _native(name: str) -> tuple[ModuleType | None, str]:
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        return None, (f"the native kernels were not built when zerospeed was installed ({exc}); reinstall with a C "
                      f"compiler available (pip install -e . builds them; nothing is compiled at run time)")
    return module, f"native kernels built at install time ({module.__file__})"


def choose(implementation: str = "auto", kernels: str = OPTIMIZER_KERNELS) -> KernelChoice:
    """``auto``: native when built, else PyTorch; ``native``: native or an error saying why not; ``torch``.
    ``kernels`` names the extension module (the optimizers' by default, or :data:`INT8_KERNELS`)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: choose one of {', '.join(IMPLEMENTATIONS)}")
    if implementation == "torch":
        return KernelChoice(None, "implementation='torch' was asked for")
    module, reason = _native(kernels)
    if module is None and implementation == "native":
        raise RuntimeError(f"implementation='native': {reason}")
    return KernelChoice(module, reason)
