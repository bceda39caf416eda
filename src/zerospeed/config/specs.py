"""Optimizer and LR-schedule specs: a type name and plain keyword arguments, no ``"auto"`` left.

``optim/`` builds torch objects from these; it never sees a config section, a frozen mapping or
an :data:`~zerospeed.config.values.AUTO`. A section still holding ``"auto"`` in its params is refused
here, one line per key, with the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from .errors import ConfigError
from .schema_optim import OptimizerConfig, SchedulerConfig
from .values import Auto, thaw


def _has_auto(value: Any) -> bool:
    if isinstance(value, Auto) or (isinstance(value, str) and value == "auto"):
        return True
    if isinstance(value, Mapping):
        return any(_has_auto(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_auto(v) for v in value)
    return False


def _plain(value: Any) -> Any:
    """Frozen mappings -> dicts; tuples (JSON arrays such as ``betas``) stay tuples, as torch's."""
    if isinstance(value, Mapping):
        return {key: _plain(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    return value


def _without_auto(params: Mapping[str, Any], line: Callable[[str], str]) -> None:
    """Refuse ``params`` holding ``"auto"`` anywhere: one ``line(key)`` per such key."""
    unresolved = [key for key, value in params.items() if _has_auto(value)]
    if unresolved:
        raise ConfigError([line(key) for key in unresolved])


@dataclass(frozen=True)
class OptimizerSpec:
    """``optimizer``: the canonical type name and the params as given (plain values)."""

    type: str
    params: Mapping[str, Any]

    def kwargs(self) -> dict[str, Any]:
        """A fresh copy of the params (builders pop keys from it)."""
        return {key: _plain(value) for key, value in self.params.items()}

    @classmethod
    def from_config(cls, section: OptimizerConfig) -> OptimizerSpec:
        _without_auto(section.params, lambda key: f'optimizer.params.{key}: still "auto" when building '
                      "the optimizer; resolve it from the training arguments first or give a value in the config")
        return cls(section.type, MappingProxyType({key: _plain(v) for key, v in section.params.items()}))


@dataclass(frozen=True)
class SchedulerSpec:
    """``scheduler``: the schedule name and its params (DeepSpeed's defaults filled in), arrays as lists."""

    type: str
    params: Mapping[str, Any]

    def kwargs(self) -> dict[str, Any]:
        """A fresh copy of the params, as DeepSpeed passes them (JSON values)."""
        return {key: thaw(value) for key, value in self.params.items()}

    @classmethod
    def from_config(cls, section: SchedulerConfig) -> SchedulerSpec:
        _without_auto(section.params, lambda key: f'scheduler.params.{key}: still "auto" when building the '
                      f"{section.type} schedule; resolve it from the training arguments first or give a "
                      "value in the config")
        return cls(section.type, MappingProxyType({key: thaw(v) for key, v in section.params.items()}))


__all__ = ["OptimizerSpec", "SchedulerSpec"]
