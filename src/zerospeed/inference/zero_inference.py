"""ZeRO-Inference: generate with a model larger than memory, its weights in CPU memory or on NVMe.

This is DeepSpeed's recipe (ZeRO stage 3 with ``offload_param``, no optimizer) packaged as one call.
Nothing here is a second parameter-streaming engine: :func:`zero_inference` builds the ordinary
stage-3 engine through :func:`zerospeed.initialize` without an optimizer, so

* no fp32 master, gradient shard or optimizer state exists: each unit's shard (in the model's dtype)
  is all there is, in CPU memory (``offload_param.device: cpu``) or in its own file (``nvme``);
* under ``torch.no_grad()`` / ``torch.inference_mode()`` the stage-3 coordinator reads its recorded
  unit order as a cycle (:mod:`zerospeed.zero.params`): while one layer computes, the next is being
  read, and at the end of a forward the first units of the next one (a decode step follows a decode
  step) are already on their way; a gathered unit is released right after its module ran, so memory
  holds a few layers, never the model.

What each forward read and waited for is in :meth:`ZeroInference.io_stats` and
:attr:`ZeroInference.prefetch_stats`; ``examples/zero_inference/`` runs a model ~1.5x larger than
this machine's free RAM from NVMe.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Iterator

import torch
from torch import nn

from zerospeed.config import ConfigError
from zerospeed.distributed.comm import Comm
from zerospeed.zero.params import PrefetchStats

__all__ = ["ZeroInference", "zero_inference"]

_DTYPE_SECTIONS = {torch.bfloat16: "bf16", torch.float16: "fp16"}


class ZeroInference:
    """A model whose weights stream through memory unit by unit (see the module docstring).

    Call it like the model (the forward runs without grad), or ``generate(...)`` for a Hugging Face
    model; ``module`` is the model itself (hooked), ``engine`` the stage-3 engine holding its shards.
    :meth:`close` (or leaving a ``with`` block) removes the hooks and deletes the NVMe files."""

    def __init__(self, engine: Any):
        from zerospeed.zero.sharded import ShardedState

        state = engine.state
        if not isinstance(state, ShardedState) or state.coordinator is None:
            raise AssertionError("internal error: ZeRO-Inference needs a stage-3 ShardedState")
        self.engine = engine
        self._state = state
        self._closed = False

    @property
    def module(self) -> nn.Module:
        return self.engine.module

    @property
    def prefetch_stats(self) -> PrefetchStats:
        """Gathers on demand vs. prefetched, peak gathered elements, the last forward's unit order."""
        coordinator = self._state.coordinator
        assert coordinator is not None
        return coordinator.stats

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this ZeroInference was closed (its hooks and swap files are gone); call "
                               "zero_inference(model, zero=...) again on a freshly built model")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward, without grad (nothing is kept for a backward)."""
        self._check_open()
        with _no_grad():
            return self.engine(*args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``module.generate(...)`` (Hugging Face models); every forward it makes streams the weights."""
        self._check_open()
        generate = getattr(self.module, "generate", None)
        if generate is None:
            raise AttributeError(f"{type(self.module).__name__} has no generate(); call the ZeroInference object "
                                 f"for a forward, or pass a Hugging Face *ForCausalLM model")
        try:
            with _no_grad():
                return generate(*args, **kwargs)
        finally:
            self.release()  # the first units its last forward fetched for a next one that is not coming

    def release(self) -> None:
        """Free every gathered unit now, also those fetched ahead for a next forward (after a loop of
        forwards; :meth:`generate` does it on return)."""
        self.engine.empty_partition_cache()

    def io_stats(self) -> dict[str, float]:
        """NVMe traffic since construction: ``bytes_read``, ``bytes_written`` and the seconds the calling
        thread was blocked on it (``read_wait_s``, ``write_wait_s``); zeros for ``device: cpu``."""
        return dict(self.engine.offload_io())

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held now (``params``: the shards in memory; ``grads`` and ``optimizer_states``: 0)."""
        return dict(self.engine.memory_breakdown())

    def close(self) -> None:
        """Remove the hooks, stop the I/O threads and delete this run's swap files."""
        if not self._closed:
            self._closed = True
            self.engine.destroy()

    def __enter__(self) -> "ZeroInference":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@contextlib.contextmanager
def _no_grad() -> Iterator[None]:
    """``torch.no_grad()`` unless grad is already off (``inference_mode`` stays as the caller set it)."""
    if torch.is_grad_enabled():
        with torch.no_grad():
            yield
    else:
        yield


def zero_inference(model: nn.Module, zero: Mapping[str, Any], *, comm: Comm | None = None,
                   dtype: torch.dtype | None = None, aio: Mapping[str, Any] | None = None) -> ZeroInference:
    """Stream ``model``'s weights from CPU memory or NVMe during forward/generate (ZeRO-Inference).

    ``zero``: DeepSpeed's ``zero_optimization`` section (``stage`` 3, which is also the default here,
    and usually ``offload_param: {"device": "cpu" | "nvme", "nvme_path": ...}``; the stage-3 knobs
    ``stage3_prefetch_bucket_size``, ``stage3_max_live_parameters``, ``offload_param.max_in_cpu``
    and ``buffer_count`` mean what they mean for training). ``dtype``: the weights' dtype (default:
    the model's own; bf16/fp16 select the matching config section). ``aio``: DeepSpeed's ``aio``
    section for NVMe. ``comm``: the ranks to shard over; it must span the whole job (ZeRO-Inference
    shards over every rank, each rank generating its own batch), or None. A model built under
    ``zerospeed.zero.Init`` (its partitions on NVMe) is moved into the engine's files unit by unit,
    so it never exists whole in memory.
    """
    from zerospeed.distributed.groups import group_size, is_initialized
    from zerospeed.entry import initialize

    if not isinstance(model, nn.Module):
        raise TypeError(f"zero_inference(model=...) needs an nn.Module, got {type(model).__name__}")
    if not isinstance(zero, Mapping):
        raise TypeError(f"zero_inference(zero={zero!r}): expected DeepSpeed's zero_optimization section as a dict, "
                        f"e.g. {{'stage': 3, 'offload_param': {{'device': 'nvme', 'nvme_path': '/local_nvme'}}}}")
    section = dict(zero)
    stage = section.setdefault("stage", 3)
    if stage != 3:
        raise ConfigError(f"zero.stage={stage!r}: ZeRO-Inference streams parameters, which is ZeRO stage 3; "
                          f"set zero={{'stage': 3, ...}} or leave 'stage' out")
    if comm is not None and is_initialized() and comm.world_size != group_size():
        raise ValueError(f"zero_inference(comm=...): a Comm of {comm.world_size} ranks in a job of {group_size()}; "
                         f"ZeRO-Inference shards over every rank of the job: pass comm=None")
    dtype = dtype if dtype is not None else _model_dtype(model)
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10 ** 9,
                              "zero_optimization": section}
    if dtype in _DTYPE_SECTIONS:
        config[_DTYPE_SECTIONS[dtype]] = {"enabled": True}
    elif dtype != torch.float32:
        raise ValueError(f"zero_inference(dtype={dtype}): ZeRO-Inference streams float32, bfloat16 or float16 "
                         f"weights; cast the model or pass one of those")
    if aio is not None:
        config["aio"] = dict(aio)
    model.eval()
    engine, *_ = initialize(model=model, config=config)
    return ZeroInference(engine)


def _model_dtype(model: nn.Module) -> torch.dtype:
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(dtypes) > 1:
        raise ValueError(f"zero_inference: the model's parameters mix dtypes {sorted(str(d) for d in dtypes)}; "
                         f"pass dtype=... (they are cast to it) or cast the model first")
    return next(iter(dtypes), torch.float32)
