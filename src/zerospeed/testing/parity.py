"""Parity helpers: the same seed and data through a reference and through zerospeed."""

from __future__ import annotations

import random
from typing import Any, Mapping, Sequence

import numpy as np
import torch


def seed_all(seed: int) -> None:
    """Seed python, numpy and torch so a reference and a distributed run draw the same numbers."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def assert_close_tree(actual: Any, expected: Any, *, rtol: float = 0.0, atol: float = 0.0, path: str = "") -> None:
    """Compare nested dicts / sequences of tensors and numbers, naming the first path that differs.

    The default tolerances are zero (bitwise); pass ``rtol``/``atol`` for mixed-precision parity.
    """
    where = path or "<root>"
    if isinstance(expected, Mapping):
        if not isinstance(actual, Mapping) or set(actual) != set(expected):
            raise AssertionError(f"{where}: keys differ: {sorted(map(str, actual))} vs {sorted(map(str, expected))}")
        for key in expected:
            assert_close_tree(actual[key], expected[key], rtol=rtol, atol=atol, path=f"{path}.{key}" if path else str(key))
    elif isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise AssertionError(f"{where}: expected a tensor, got {type(actual).__name__}")
        try:
            torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
        except AssertionError as exc:
            raise AssertionError(f"{where}: {exc}") from None
    elif isinstance(expected, Sequence) and not isinstance(expected, (str, bytes)):
        if not isinstance(actual, Sequence) or len(actual) != len(expected):
            raise AssertionError(f"{where}: length differs: {len(actual)} vs {len(expected)}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_close_tree(a, e, rtol=rtol, atol=atol, path=f"{where}[{i}]")
    elif isinstance(expected, float):
        if abs(actual - expected) > atol + rtol * abs(expected):
            raise AssertionError(f"{where}: {actual!r} != {expected!r} (rtol={rtol}, atol={atol})")
    elif actual != expected:
        raise AssertionError(f"{where}: {actual!r} != {expected!r}")


def as_numpy_tree(value: Any) -> Any:
    """Tensors (in dicts, lists and tuples) as numpy copies: a rank's result crosses a pipe after the rank
    has exited, which tensors shared through file descriptors cannot do. 16-bit floats are widened to
    fp32 (exactly; numpy has no bfloat16)."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.is_floating_point() and value.element_size() < 4:
            value = value.float()
        return value.numpy().copy()
    if isinstance(value, dict):
        return {k: as_numpy_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_numpy_tree(v) for v in value]
    return value
