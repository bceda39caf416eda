"""DeepSpeed entry points whose capability zerospeed has not built yet: they refuse by name, with
the way forward, instead of being missing attributes (scripts probe for them with ``hasattr``...)."""

from __future__ import annotations

from typing import Any, NoReturn


def init_inference(model: Any = None, config: Any = None, **kwargs: Any) -> NoReturn:
    """DeepSpeed's inference engine (kernel injection, tensor-parallel inference)."""
    raise NotImplementedError("deepspeed.init_inference / zerospeed.init_inference: accelerated inference is not "
                              "built yet; run the model directly (model.eval(); with torch.no_grad(): model(x)), or "
                              "through zerospeed.initialize at ZeRO stage 3 for models larger than one device")


__all__ = ["init_inference"]
