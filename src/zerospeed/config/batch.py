"""Batch arithmetic: ``train_batch_size == micro_batch * grad_accum * world_size``.

A pure function of four numbers, so every rule is unit-testable and every error can show
the values, the world size and a consistent choice to use instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError

TRAIN = "train_batch_size"
MICRO = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"


@dataclass(frozen=True)
class BatchSizes:
    """A consistent triple for one data-parallel world size."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    world_size: int


def _multiples_around(value: int, step: int) -> list[int]:
    below = (value // step) * step
    return [m for m in (below, below + step) if m >= step]


def resolve_batch(train: int | None, micro: int | None, gas: int | None,
                  world_size: int) -> BatchSizes:
    """Derive the missing batch value(s) or check the full triple.

    Any two values determine the third; ``train_batch_size`` or the micro batch alone
    means one accumulation step. Raises :class:`ConfigError` otherwise.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size: {world_size!r} is out of range; expected an integer >= 1")
    for name, value in ((TRAIN, train), (MICRO, micro), (GAS, gas)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ConfigError(f"{name}: {value!r} is out of range; expected an integer >= 1")

    if train is not None and micro is not None and gas is not None:
        if train == micro * gas * world_size:
            return BatchSizes(train, micro, gas, world_size)
        raise ConfigError(_inconsistent(train, micro, gas, world_size))
    if train is not None and micro is not None:
        return BatchSizes(train, micro, _divide(train, micro, MICRO, GAS,
                                                world_size=world_size), world_size)
    if train is not None and gas is not None:
        return BatchSizes(train, _divide(train, gas, GAS, MICRO,
                                         world_size=world_size), gas, world_size)
    if micro is not None and gas is not None:
        return BatchSizes(micro * gas * world_size, micro, gas, world_size)
    if train is not None:
        return BatchSizes(train, _divide(train, 1, GAS, MICRO,
                                         world_size=world_size, implied_gas=True), 1, world_size)
    if micro is not None:
        return BatchSizes(micro * world_size, micro, 1, world_size)
    if gas is not None:
        raise ConfigError(f"{GAS}: {gas} alone does not determine the batch size; also give "
                          f"{TRAIN} or {MICRO}")
    raise ConfigError(f"{TRAIN}: the batch size is not set; give {TRAIN} and/or {MICRO} "
                      f"(or \"auto\" for a caller to fill in)")


def _divide(train: int, known: int, known_name: str, derived_name: str, *, world_size: int,
            implied_gas: bool = False) -> int:
    """``train / (known * world_size)`` when exact, else an error with nearby valid totals."""
    step = known * world_size
    if train % step == 0:
        return train // step
    suggestions = ", ".join(f"{TRAIN} = {m} ({derived_name} = {m // step})"
                            for m in _multiples_around(train, step))
    given = f"{known_name} ({known})" if not implied_gas else f"{GAS} (1, implied)"
    raise ConfigError(
        f"{TRAIN}: {train} is not divisible by {given} * world_size ({world_size}) = {step}, "
        f"so {derived_name} cannot be derived; consistent choices: {suggestions}")


def _inconsistent(train: int, micro: int, gas: int, world_size: int) -> str:
    product = micro * gas * world_size
    choices = [f"{TRAIN} = {product}"]
    if train % (gas * world_size) == 0:
        choices.append(f"{MICRO} = {train // (gas * world_size)}")
    if train % (micro * world_size) == 0:
        choices.append(f"{GAS} = {train // (micro * world_size)}")
    return (f"{TRAIN}: {train} != {MICRO} ({micro}) * {GAS} ({gas}) * world_size "
            f"({world_size}) = {product}; consistent choices: " + " or ".join(choices)
            + "; or give only two of the three and let the third be derived")
