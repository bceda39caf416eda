"""What Hugging Face Accelerate needs from DeepSpeed on a machine without an accelerator.

Accelerate 1.15 picks its process-group backend before it asks DeepSpeed to start the group
(``accelerate/state.py``, ``PartialState._prepare_backend``): with ``LOCAL_RANK`` set and ``cpu=False`` it
knows only device backends (nccl, xccl, hccl...), so on a CPU-only machine it returns ``backend=None``;
``PartialState.__init__`` then calls ``deepspeed.comm.init_distributed(dist_backend=None)`` (which starts
gloo) and afterwards reads ``backend is None`` as "no distributed training": every rank believes it is
alone (``num_processes=1``, ``process_index=0``). The other road, ``cpu=True`` (the Trainer's
``use_cpu=True``), silently drops the DeepSpeed plugin (``AcceleratorState.__init__``:
``elif os.environ.get("ACCELERATE_USE_DEEPSPEED", ...) == "true" and not cpu``).

The shim: when the alias is installed, ``PartialState._prepare_backend`` is wrapped so that, only when
DeepSpeed was asked for (``ACCELERATE_USE_DEEPSPEED=true``), ``cpu`` is False, the process was launched
as a rank (``LOCAL_RANK`` set) and Accelerate found no backend, it answers the accelerator's
communication backend (gloo on CPU), as DeepSpeed itself would choose. Everything else in Accelerate is
untouched; on a GPU machine, or without DeepSpeed, the wrapper returns Accelerate's own answer. An
explicit ``Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])`` does the same
without the shim, but the Trainer offers no such setting when ``deepspeed=`` is given.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any, Callable, Sequence

_STATE_MODULE = "accelerate.state"
_MARK = "__zerospeed_cpu_backend__"


def _deepspeed_backend_wanted(cpu: bool, backend: Any) -> bool:
    return (backend is None and not cpu and int(os.environ.get("LOCAL_RANK", -1)) != -1
            and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true")


def patch_accelerate_state(module: ModuleType) -> None:
    """Wrap ``module.PartialState._prepare_backend`` (idempotent; see the module docstring for why)."""
    cls = getattr(module, "PartialState", None)
    original: Callable[..., tuple[Any, Any]] | None = getattr(cls, "_prepare_backend", None)
    if cls is None or original is None or getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def _prepare_backend(self: Any, cpu: bool = False, sagemaker_dp: bool = False,
                         backend: str | None = None) -> tuple[Any, Any]:
        chosen, distributed_type = original(self, cpu, sagemaker_dp, backend)
        if _deepspeed_backend_wanted(cpu, chosen):
            from zerospeed.accelerator import get_accelerator

            chosen = get_accelerator().communication_backend_name()
        return chosen, distributed_type

    setattr(_prepare_backend, _MARK, True)
    cls._prepare_backend = _prepare_backend


class _PatchingLoader(importlib.abc.Loader):
    """Runs ``accelerate.state`` with its own loader, then applies :func:`patch_accelerate_state`."""

    def __init__(self, inner: Any):
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self.inner.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        patch_accelerate_state(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename...: the real loader's
        return getattr(self.inner, name)


class AccelerateStateFinder(importlib.abc.MetaPathFinder):
    """Finds ``accelerate.state`` as the path finder does and hands it to :class:`_PatchingLoader`."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _STATE_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader)
        return spec


def install_accelerate_shim() -> None:
    """Patch ``accelerate.state`` now if it is imported, else when it is (part of ``install_as_deepspeed``)."""
    loaded = sys.modules.get(_STATE_MODULE)
    if loaded is not None:
        patch_accelerate_state(loaded)
    elif not any(isinstance(f, AccelerateStateFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, AccelerateStateFinder())


def uninstall_accelerate_shim() -> None:
    """Stop patching future imports (an already patched class keeps its wrapper: it is inert without
    ``ACCELERATE_USE_DEEPSPEED``)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, AccelerateStateFinder)]


__all__ = ["AccelerateStateFinder", "install_accelerate_shim", "patch_accelerate_state", "uninstall_accelerate_shim"]
