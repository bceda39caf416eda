"""``checkpoint=`` for inference: full weights into the unsplit model, before any transform.

Accepted: a zerospeed checkpoint (the ``save_checkpoint`` directory holding ``latest``, or a tag
directory), read through :func:`zerospeed.checkpoint.consolidate.load_state_dict_from_checkpoint` (any
world size, ZeRO stage or tensor-parallel degree); or a plain state-dict file: ``.safetensors``, or a
``torch.save`` file (``.pt``/``.bin``/``.pth``, read with ``weights_only=True``; a ``{"module": ...}`` or
``{"model": ...}`` wrapper, as DeepSpeed writes, is unwrapped). Keys must match the model exactly.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import nn

from zerospeed.checkpoint.layout import CheckpointError

_TORCH_FILES = (".pt", ".bin", ".pth")


def load_weights(model: nn.Module, path: str) -> nn.Module:
    """Fill ``model`` (unsplit) from ``path``; returns ``model``."""
    if os.path.isdir(path):
        from zerospeed.checkpoint.consolidate import load_state_dict_from_checkpoint

        return load_state_dict_from_checkpoint(model, path)
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint: {path} does not exist; pass a zerospeed checkpoint directory or a "
                              f"state-dict file (.pt, .bin, .pth or .safetensors)")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        state: Mapping[str, torch.Tensor] = load_file(path)
    elif path.endswith(_TORCH_FILES):
        loaded = torch.load(path, map_location="cpu", weights_only=True)
        state = _unwrap(loaded, path)
    else:
        raise CheckpointError(f"checkpoint: {path} is neither a directory nor a .safetensors/.pt/.bin/.pth file; "
                              f"pass a zerospeed checkpoint directory or a state-dict file")
    result = model.load_state_dict(dict(state), strict=False)
    missing = [k for k in result.missing_keys if not _tied_alias(model, k, state)]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"checkpoint: {path} does not match the model: missing {missing[:8] or 'none'}, "
                              f"unexpected {list(result.unexpected_keys)[:8] or 'none'}; save the model's own "
                              f"state_dict()")
    return model


def _unwrap(loaded: object, path: str) -> Mapping[str, torch.Tensor]:
    if isinstance(loaded, Mapping):
        for key in ("module", "model"):
            inner = loaded.get(key)
            if isinstance(inner, Mapping) and len(loaded) >= 1 and not isinstance(loaded.get(key), torch.Tensor):
                return inner
        if all(isinstance(v, torch.Tensor) for v in loaded.values()):
            return loaded
    raise CheckpointError(f"checkpoint: {path} does not hold a state dict (a mapping of names to tensors, or one "
                          f"under 'module'/'model')")


def _tied_alias(model: nn.Module, key: str, state: Mapping[str, torch.Tensor]) -> bool:
    """A missing key whose tensor is the same parameter as a loaded one (tied weights saved once)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if key not in params:
        return False
    return any(name in state and params[name] is params[key] for name in params if name != key)


__all__ = ["load_weights"]
