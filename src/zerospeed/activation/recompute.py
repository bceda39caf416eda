"""Activation checkpointing: recompute a function in backward instead of storing its activations.

The recompute itself is PyTorch's non-reentrant ``torch.utils.checkpoint`` (non-tensor
arguments and outputs, keyword arguments, RNG replay for dropout); a :class:`Recomputer`
adds what DeepSpeed's options ask for on top: host-resident checkpoint inputs
(``cpu_checkpointing``), device synchronization at the boundary and per-call timings.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from zerospeed.accelerator import Accelerator, get_accelerator
from zerospeed.activation.settings import RecomputeSettings

_HOST = torch.device("cpu")


@dataclass
class RecomputeTimings:
    """Totals of ``profile``: seconds spent in checkpointed forwards and in their recomputes.

    A recompute that stops early (PyTorch stops once every needed tensor is rebuilt) counts the
    time until it stopped.
    """

    forward_calls: int = 0
    forward_seconds: float = 0.0
    recompute_calls: int = 0
    recompute_seconds: float = 0.0

    def record(self, recompute: bool, seconds: float) -> None:
        if recompute:
            self.recompute_calls += 1
            self.recompute_seconds += seconds
        else:
            self.forward_calls += 1
            self.forward_seconds += seconds

    def clear(self) -> None:
        self.forward_calls = self.recompute_calls = 0
        self.forward_seconds = self.recompute_seconds = 0.0


@dataclass
class HostOffloadStats:
    """What ``cpu_checkpointing`` packed: tensors, their bytes, and the bytes actually copied
    to the host (zero when the inputs already live there)."""

    tensors: int = 0
    bytes: int = 0
    copied_bytes: int = 0


class HostOffloadHooks:
    """A pack/unpack pair that keeps saved tensors in host memory until backward unpacks them.

    Installed around PyTorch's checkpoint, it sees exactly the tensors checkpointing keeps for
    the recompute (the function's inputs); the function's own activations are not saved at all.
    A tensor already on the host is kept as is (no copy); a device tensor is copied into
    (pinned, when the accelerator pins) host memory and copied back to its device on unpack.
    """

    def __init__(self, accelerator: Accelerator, stats: HostOffloadStats) -> None:
        self._pin = not accelerator.is_cpu
        self.stats = stats

    def pack(self, tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
        nbytes = tensor.numel() * tensor.element_size()
        self.stats.tensors += 1
        self.stats.bytes += nbytes
        if tensor.device == _HOST:
            return tensor.device, tensor
        host = torch.empty_like(tensor, device=_HOST, pin_memory=self._pin)
        host.copy_(tensor, non_blocking=self._pin)
        self.stats.copied_bytes += nbytes
        return tensor.device, host

    def unpack(self, packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
        device, tensor = packed
        if tensor.device == device:
            return tensor
        return tensor.to(device, non_blocking=self._pin)

    def context(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class Recomputer:
    """Runs functions under activation checkpointing with one :class:`RecomputeSettings`.

    ``Recomputer(settings).checkpoint(fn, *args, **kwargs)`` returns ``fn(*args, **kwargs)``;
    the activations inside ``fn`` are not kept but recomputed during backward, with the CPU and
    device RNG states of the forward restored so dropout draws the same masks. ``timings``
    (with ``profile``) and ``offload_stats`` (with ``cpu_checkpointing``) accumulate over calls.
    """

    def __init__(self, settings: RecomputeSettings | None = None, *,
                 accelerator: Accelerator | None = None) -> None:
        if settings is not None and not isinstance(settings, RecomputeSettings):
            raise TypeError(f"settings: {type(settings).__name__} is not RecomputeSettings; "
                            "build one with RecomputeSettings(...) or "
                            "RecomputeSettings.from_config(config)")
        self.settings = settings if settings is not None else RecomputeSettings()
        self.accelerator = accelerator if accelerator is not None else get_accelerator()
        self.timings = RecomputeTimings()
        self.offload_stats = HostOffloadStats()

    def checkpoint(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``function(*args, **kwargs)``, its activations recomputed in backward."""
        if not callable(function):
            raise TypeError(f"function: {function!r} is not callable; pass the function or "
                            "module to checkpoint first, then its arguments")
        run, flat = _flatten_kwargs(function, args, kwargs)
        if self.settings.profile:
            run = self._timed(run)
        sync = self.settings.synchronize_checkpoint_boundary
        if sync:
            self.accelerator.synchronize()
        if self.settings.cpu_checkpointing:
            with HostOffloadHooks(self.accelerator, self.offload_stats).context():
                out = _torch_checkpoint(run, flat)
        else:
            out = _torch_checkpoint(run, flat)
        if sync:
            self.accelerator.synchronize()
        return out

    __call__ = checkpoint

    def _timed(self, run: Callable[..., Any]) -> Callable[..., Any]:
        """``run`` timing itself: its first call is the forward, later ones are recomputes."""
        calls = [0]

        def timed(*flat: Any) -> Any:
            recompute = calls[0] > 0
            calls[0] += 1
            self.accelerator.synchronize()  # device work queued earlier is not ours to time
            start = time.perf_counter()
            try:
                return run(*flat)
            finally:
                self.accelerator.synchronize()
                self.timings.record(recompute, time.perf_counter() - start)

        return timed


def _flatten_kwargs(function: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """Pass keyword arguments positionally through PyTorch's checkpoint.

    Why: torch keeps positional tensors as saved tensors (so the host-offload hooks see them)
    but keyword ones only by reference, and its own keywords (``debug``, ``context_fn``...)
    would swallow a user keyword of the same name.
    """
    names = tuple(kwargs)
    count = len(args)

    def run(*flat: Any) -> Any:
        return function(*flat[:count], **dict(zip(names, flat[count:])))

    return run, (*args, *kwargs.values())


def _torch_checkpoint(run: Callable[..., Any], flat: tuple[Any, ...]) -> Any:
    return torch_checkpoint.checkpoint(run, *flat, use_reentrant=False, preserve_rng_state=True)
