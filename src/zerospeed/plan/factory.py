"""``--model MODULE:FACTORY``: find the factory, build the model (on the meta device) and its example batch.

A factory is a zero-argument callable returning the model, or ``(model, example_inputs)`` where
``example_inputs`` is one forward's input: a tensor, a tuple of positional inputs or a dict of keyword
inputs, batch dimension first (any batch size: the plan resizes it to the micro-batch). ``MODULE`` is
an importable module name (``mypkg.models``) or a path to a ``.py`` file.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["ModelSpecError", "as_example_batch", "build_on_meta", "load_factory"]


class ModelSpecError(ValueError):
    """``--model`` does not name a usable factory; the message says what to pass instead."""


def load_factory(spec: str) -> Callable[[], Any]:
    """The callable ``spec`` (``MODULE:FACTORY`` or ``path/to/file.py:FACTORY``) names."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ModelSpecError(f"--model {spec!r}: expected MODULE:FACTORY (e.g. mypkg.models:build or "
                             f"examples/plan_models.py:demo_gpt), a zero-argument callable returning the model "
                             f"or (model, example_inputs)")
    if module_name.endswith(".py") or "/" in module_name:
        path = Path(module_name)
        if not path.is_file():
            raise ModelSpecError(f"--model {spec!r}: no file {path}; give an existing .py file or an importable "
                                 f"module name before the ':'")
        unique = f"_zerospeed_plan_{abs(hash(str(path.resolve())))}"
        loader_spec = importlib.util.spec_from_file_location(unique, path)
        assert loader_spec is not None and loader_spec.loader is not None
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[unique] = module
        loader_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ModelSpecError(f"--model {spec!r}: cannot import {module_name!r} ({err}); put it on PYTHONPATH "
                                 f"or give a path to the .py file") from err
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise ModelSpecError(f"--model {spec!r}: {module_name} has no callable {attr!r}; name a zero-argument "
                             f"function returning the model or (model, example_inputs)")
    return factory


def split_result(spec: str, result: Any) -> tuple[nn.Module, Any]:
    """(model, example inputs or None) from what a factory returned."""
    if isinstance(result, nn.Module):
        return result, None
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module):
        return result[0], result[1]
    raise ModelSpecError(f"--model {spec!r}: the factory returned {type(result).__name__}; return an nn.Module "
                         f"or (nn.Module, example_inputs)")


def build_on_meta(spec: str) -> tuple[nn.Module, Any]:
    """Call the factory under ``torch.device("meta")``: the model's shapes, no memory."""
    factory = load_factory(spec)
    with torch.device("meta"):
        return split_result(spec, factory())


def as_example_batch(example: Any, micro_batch: int) -> Any:
    """Real zero-filled tensors shaped like ``example`` with ``micro_batch`` rows (a measuring run)."""
    if isinstance(example, torch.Tensor):
        shape = (micro_batch, *example.shape[1:]) if example.dim() else ()
        return torch.zeros(shape, dtype=example.dtype)
    if isinstance(example, dict):
        return {k: as_example_batch(v, micro_batch) for k, v in example.items()}
    if isinstance(example, (tuple, list)):
        return type(example)(as_example_batch(v, micro_batch) for v in example)
    return example
