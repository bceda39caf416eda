"""Checkpoints: sharded, atomic, reshardable across world size and ZeRO stage; streaming consolidation.

``engine.save_checkpoint`` / ``engine.load_checkpoint`` write and read them; this package also reads
them without an engine: :func:`get_fp32_state_dict`, :func:`load_state_dict_from_checkpoint`, and
``zerospeed convert`` (:func:`convert_checkpoint`). Names resolve lazily so that importing the
package stays cheap and free of import cycles.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "CheckpointError": "zerospeed.checkpoint.layout",
    "get_fp32_state_dict": "zerospeed.checkpoint.consolidate",
    "load_state_dict_from_checkpoint": "zerospeed.checkpoint.consolidate",
    "convert_checkpoint": "zerospeed.checkpoint.consolidate",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    import importlib

    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zerospeed.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
