"""Precision plugins for :mod:`zerospeed.integrations.lightning` and ``lightning_fabric``.

The engine owns every dtype decision (it casts the module, keeps fp32 masters, scales the loss), so
these plugins do no autocast and no loss scaling of their own: they carry the precision flag to the
strategy's config and route backward/step to the engine. Lightning's own ``DeepSpeedPrecision`` is
not reused because the accelerator connector only pairs it with its ``DeepSpeedStrategy``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor

from zerospeed.integrations.lightning_config import check_precision

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from zerospeed.engine import Engine

# Plugins whose only meaning is a precision flag, so they can be replaced by ours (class names, so the
# check needs no import of every Lightning plugin).
_PLAIN_PLUGINS = ("Precision", "MixedPrecision", "HalfPrecision", "DeepSpeedPrecision")


def precision_flag(plugin: Any, *, owner: str) -> str:
    """The precision flag of a plain Lightning plugin (what the Trainer/Fabric ``precision=`` built)."""
    if type(plugin).__name__ not in _PLAIN_PLUGINS:
        raise ValueError(f"{owner} cannot run with the precision plugin {type(plugin).__name__}: the engine "
                         f"handles precision itself; pass precision='32-true', 'bf16-mixed' or '16-mixed' instead")
    return str(getattr(plugin, "precision", "32-true"))


def accumulates(module: pl.LightningModule | None) -> bool:
    """Whether Lightning accumulates micro-batches for ``module`` (automatic optimization, window > 1)."""
    return (module is not None and module.automatic_optimization
            and module.trainer.accumulate_grad_batches > 1)


def _engine_of(model: pl.LightningModule) -> Engine:
    from zerospeed.engine import Engine

    engine = model.trainer.strategy.model
    if not isinstance(engine, Engine):
        raise RuntimeError("ZeroSpeedPrecision needs ZeroSpeedStrategy (trainer.strategy.model is "
                           f"{type(engine).__name__}, not a zerospeed Engine); pass strategy=ZeroSpeedStrategy(...)")
    return engine


class ZeroSpeedPrecision(Precision):
    """Trainer-side plugin: ``"32-true"``, ``"bf16-mixed"`` or ``"16-mixed"``, applied by the engine."""

    def __init__(self, precision: str = "32-true") -> None:
        self.precision = check_precision(precision, owner="ZeroSpeedPrecision")  # type: ignore[assignment]

    def backward(self, tensor: Tensor, model: pl.LightningModule, optimizer: Any,  # type: ignore[override]
                 *args: Any, **kwargs: Any) -> None:
        """``engine.backward``, undoing Lightning's own division by ``accumulate_grad_batches``.

        The automatic loop already divides the loss by the window length and the engine divides again
        (as DeepSpeed's does); multiplying back keeps one division, so gradients equal DDP's.
        """
        accumulate = model.trainer.accumulate_grad_batches if model.automatic_optimization else 1
        _engine_of(model).backward(tensor * accumulate if accumulate != 1 else tensor, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, model: pl.LightningModule,  # type: ignore[override]
                       closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Run the closure (hooks, forward, backward) then ``engine.step()``, which steps at the window's end."""
        engine = _engine_of(model)
        # Lightning calls this only for the micro-batch that ends its window (the other micro-batches run
        # the closure alone): tell the engine before that backward, so it reduces and then steps.
        window = accumulates(model)
        if window:
            engine.set_gradient_accumulation_boundary(True)
        try:
            # Lightning's closure wrapper: training step, backward, on_before_optimizer_step hooks (with the
            # real optimizer), clipping hook; then the engine's step (which also zeroes its window).
            result = self._wrap_closure(model, optimizer, closure)
            self._engine_step(engine, model, result, kwargs)
        finally:
            if window:
                engine.set_gradient_accumulation_boundary(False)
        return result

    @staticmethod
    def _engine_step(engine: Engine, model: pl.LightningModule, result: Any, kwargs: dict[str, Any]) -> None:
        if model.automatic_optimization and result is None:
            raise RuntimeError("training_step returned None (skipping backward) with ZeroSpeedStrategy: every "
                               "rank must run backward and step together; return a loss on every step")
        if kwargs:
            raise TypeError(f"ZeroSpeedStrategy: optimizer.step() keyword arguments {sorted(kwargs)} cannot be "
                            "passed on: engine.step() takes none")
        engine.step()

    def clip_gradients(self, optimizer: Any, clip_val: int | float = 0.0,
                       gradient_clip_algorithm: Any = None) -> None:
        """Nothing: the engine clips at its step with the config's ``gradient_clipping`` (set from the Trainer)."""


class ZeroSpeedFabricPrecision(FabricPrecision):
    """Fabric-side plugin: as :class:`ZeroSpeedPrecision`; outputs come back in the default dtype."""

    def __init__(self, precision: str = "32-true") -> None:
        self.precision = check_precision(precision, owner="ZeroSpeedFabricPrecision")  # type: ignore[assignment]

    def convert_output(self, data: Any) -> Any:
        dtype = torch.get_default_dtype()
        return apply_to_collection(data, Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)

    def backward(self, tensor: Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        model.backward(tensor, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        return optimizer.step(**kwargs)
