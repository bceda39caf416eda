"""The small, pickled part of a checkpoint, loaded without running code from the file.

``engine_state.pt`` (LR scheduler state, the user's ``client_state``) and ``rank<N>.state.pt`` (RNG
states, data position) are ``torch.save`` files. Unpickling can call any function the file names,
so a checkpoint from someone else could run code on every rank at ``load_checkpoint``. What the
engine itself writes there is kept to types ``torch.load(weights_only=True)`` accepts (containers,
numbers, strings, tensors), and that is how they are read; a file that needs more is refused unless
the caller opts in with ``allow_unsafe_pickle=True``. Tensors and the manifest are safetensors and
JSON already.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import random
from typing import Any

import numpy as np
import torch

from zerospeed.checkpoint.layout import CheckpointError

log = logging.getLogger("zerospeed")

#: The keyword of ``load_checkpoint`` that allows full unpickling (named in every refusal).
UNSAFE_OPT_IN = "allow_unsafe_pickle"


def unsafe_globals(data: bytes) -> list[str]:
    """The functions and classes a ``torch.save`` payload needs beyond what ``weights_only`` allows."""
    return list(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data)))


def _numpy_array_globals() -> list[Any]:
    """What unpickling a plain numpy array needs: the RNG files of checkpoints written before the
    RNG state was stored as tensors held ``np.random.get_state()``'s uint32 array. These only
    rebuild arrays of a dtype; none of them runs other code."""
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_small_state(path: str, *, allow_unsafe_pickle: bool = False) -> Any:
    """Read one small state file (None if absent) with ``weights_only=True``; with
    ``allow_unsafe_pickle`` a file that needs more is unpickled in full (trusted checkpoints only)."""
    if not os.path.isfile(path):
        return None
    try:
        with torch.serialization.safe_globals(_numpy_array_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        with open(path, "rb") as f:
            needs = unsafe_globals(f.read())
        what = ", ".join(needs) if needs else f"what torch.load(weights_only=True) refused ({err})"
        if not allow_unsafe_pickle:
            raise CheckpointError(
                f"{path} needs {what} to unpickle, which could run code from the file, so it was not loaded. "
                f"Load it only if you trust where the checkpoint came from: "
                f"engine.load_checkpoint(..., {UNSAFE_OPT_IN}=True)") from None
        log.warning("load_checkpoint(%s=True): unpickling %s in full (it needs %s)", UNSAFE_OPT_IN, path, what)
        return torch.load(path, map_location="cpu", weights_only=False)


def warn_if_unsafe(data: bytes, what: str) -> None:
    """Tell the saver now, not the loader later, that ``what`` will need the opt-in to load."""
    needs = unsafe_globals(data)
    if needs:
        log.warning("save_checkpoint: %s holds %s, which torch.load(weights_only=True) refuses; loading this "
                    "checkpoint will need load_checkpoint(..., %s=True). Keep it to dicts, lists, strings, "
                    "numbers and tensors to load it safely", what, ", ".join(needs), UNSAFE_OPT_IN)


def rng_state() -> dict[str, Any]:
    """This process's RNG states in types ``weights_only`` loads (numpy's key array as a tensor)."""
    from zerospeed.accelerator import get_accelerator

    # legacy=True is numpy's default; said explicitly because the stub's no-argument overload is
    # the legacy=False one (a dict). The global RandomState is MT19937, so this is the tuple.
    legacy = np.random.get_state(legacy=True)
    if not isinstance(legacy, tuple):
        raise TypeError(f"numpy's global RNG state is not MT19937's legacy tuple: {type(legacy).__name__}")
    kind, keys, pos, has_gauss, cached = legacy
    state: dict[str, Any] = {"python": random.getstate(),
                             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                                       float(cached)),
                             "torch": torch.get_rng_state()}
    accelerator = get_accelerator()
    if accelerator.device_type != "cpu":
        state["device"] = torch.get_device_module(accelerator.device_type).get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` saved (numpy's state as a tensor, or as an array in older files)."""
    from zerospeed.accelerator import get_accelerator

    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state((kind, keys.astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "device" in state and get_accelerator().device_type != "cpu":
        torch.get_device_module(get_accelerator().device_type).set_rng_state(state["device"])
