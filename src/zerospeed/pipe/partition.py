"""How a pipeline's layers split into stages: pure arithmetic on layer descriptions, no tensors.

Boundaries follow DeepSpeed's convention (``deepspeed.runtime.utils``): ``num_parts + 1``
indices, stage ``s`` owning layers ``parts[s]:parts[s + 1]``. :func:`partition_uniform` and
:func:`partition_balanced` return exactly DeepSpeed's results (the tests pin them against
outputs of DeepSpeed 0.19.8), so a model partitions the same way under either library.

A :class:`LayerInfo` describes one layer without its weights (class name, parameter counts,
tied key); :func:`plan_stages` turns those, a stage count and a ``partition_method`` into a
:class:`StagePlan`: who owns which layer, where tied modules live, which blocks of layers are
recomputed in backward. ``zerospeed.pipe.module`` builds the descriptions and executes the plan.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from typing import Literal, Sequence

PARTITION_METHODS = ("parameters", "uniform", "type:<regex>")


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries splitting ``num_items`` into ``num_parts`` runs whose lengths differ by at most
    one, the longer runs first; with fewer items than parts, one item per part then empty parts."""
    _check_count("num_items", num_items, minimum=0)
    _check_count("num_parts", num_parts, minimum=1)
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, extra = divmod(num_items, num_parts)
    return [p * chunk + min(p, extra) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries splitting ``weights`` into ``num_parts`` contiguous non-empty runs with close sums.

    DeepSpeed's dynamic program, reproduced for identical results: for every prefix and part
    count it keeps one split, the one whose parts' (largest sum - smallest sum) is smallest given
    the split kept for the shorter prefix, later split points winning ties. With no more weights
    than parts it falls back to :func:`partition_uniform` (empty trailing parts).
    """
    _check_count("num_parts", num_parts, minimum=1)
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = math.inf
    # best[i][j]: (cost, largest part, smallest part, split) for the first i items in j parts
    hi = [[inf] * (m + 1) for _ in range(n + 1)]
    lo = [[inf] * (m + 1) for _ in range(n + 1)]
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    split = [[0] * (m + 1) for _ in range(n + 1)]
    hi[0][0] = 0.0
    cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                last = prefix[i] - prefix[k]
                top, bottom = max(hi[k][j - 1], last), min(lo[k][j - 1], last)
                spread = top - bottom
                if cost[i][j] >= spread:
                    cost[i][j], hi[i][j], lo[i][j], split[i][j] = spread, top, bottom, k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(split[parts[-1]][j])
    return parts[::-1]


@dataclass(frozen=True)
class PartitionMethod:
    """A parsed ``partition_method``: ``parameters``, ``uniform`` or ``type`` with its regex."""

    kind: Literal["parameters", "uniform", "type"]
    pattern: str = ""

    @classmethod
    def parse(cls, method: str) -> "PartitionMethod":
        """Read DeepSpeed's spelling (case-insensitive, as DeepSpeed lowercases it)."""
        if not isinstance(method, str):
            raise TypeError(f"partition_method={method!r} is not a string; use one of {PARTITION_METHODS}")
        lowered = method.lower()
        if lowered in ("parameters", "uniform"):
            return cls(lowered)  # type: ignore[arg-type]
        if lowered.startswith("type:"):
            pattern = lowered.split(":", 1)[1]
            if not pattern:
                raise ValueError(f"partition_method={method!r} has no regex after 'type:'; "
                                 "write e.g. 'type:transformer' to balance the layers whose class matches")
            try:
                re.compile(pattern, re.IGNORECASE)
            except re.error as exc:
                raise ValueError(f"partition_method={method!r}: {pattern!r} is not a valid regex ({exc})") from None
            return cls("type", pattern)
        if lowered == "profile":
            raise NotImplementedError("partition_method='profile' is not implemented (nor in DeepSpeed); "
                                      "use 'parameters', 'uniform' or 'type:<regex>'")
        close = difflib.get_close_matches(lowered, ["parameters", "uniform", "type:"], n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"unknown partition_method={method!r}; {hint}expected one of {PARTITION_METHODS}")

    @property
    def needs_param_counts(self) -> bool:
        return self.kind == "parameters"


@dataclass(frozen=True)
class LayerInfo:
    """One layer as the plan sees it, as DeepSpeed names it. ``class_name``: the class of what
    runs (a spec's ``typename``, a module's class, ``"function"`` for a lambda), matched by
    ``checkpointable_layers``; ``type_name``: what ``type:<regex>`` matches (the class name, or a
    function's ``__name__``, ``None`` for a callable without one). ``trainable_params`` and
    ``has_params`` are ``None`` when they were not counted."""

    class_name: str
    type_name: str | None
    tied_key: str | None = None
    trainable_params: int | None = None
    has_params: bool | None = None


@dataclass(frozen=True)
class CheckpointBlock:
    """Layers ``start:stop`` (global indices) run as one unit; ``recompute``: under activation
    checkpointing (their activations are recomputed in backward)."""

    start: int
    stop: int
    recompute: bool


@dataclass(frozen=True)
class StagePlan:
    """Who owns which layer: ``parts`` are DeepSpeed's boundaries, stage ``s`` owning layers
    ``parts[s]:parts[s + 1]``; ``tied`` maps each tie key to the global indices of its layers;
    ``blocks[s]`` are stage ``s``'s layers grouped for activation checkpointing (one block, not
    recomputed, when the interval is 0)."""

    parts: tuple[int, ...]
    tied: tuple[tuple[str, tuple[int, ...]], ...]
    blocks: tuple[tuple[CheckpointBlock, ...], ...]
    checkpoint_interval: int

    @property
    def num_stages(self) -> int:
        return len(self.parts) - 1

    @property
    def num_layers(self) -> int:
        return self.parts[-1]

    def stage_layers(self, stage: int) -> range:
        """Global indices of the layers stage ``stage`` owns."""
        self._check_stage(stage)
        return range(self.parts[stage], self.parts[stage + 1])

    def stage_owner(self, layer: int) -> int:
        """The stage owning global layer ``layer``."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is outside 0..{self.num_layers - 1}")
        return next(s for s in range(self.num_stages) if self.parts[s] <= layer < self.parts[s + 1])

    @property
    def tied_keys(self) -> tuple[str, ...]:
        return tuple(key for key, _ in self.tied)

    def tied_layers(self, key: str) -> tuple[int, ...]:
        """Global indices of the layers sharing tie ``key``, ascending."""
        for known, layers in self.tied:
            if known == key:
                return layers
        raise KeyError(f"no TiedLayerSpec has key {key!r}; known keys: {list(self.tied_keys)}")

    def tied_stages(self, key: str) -> list[int]:
        """The stages holding a copy of tie ``key`` (their gradients are summed), ascending."""
        return sorted({self.stage_owner(i) for i in self.tied_layers(key)})

    def stage_tied_keys(self, stage: int) -> list[str]:
        """Tie keys with a copy on ``stage``, sorted (the order every stage agrees on)."""
        return [key for key in sorted(self.tied_keys) if stage in self.tied_stages(key)]

    def _check_stage(self, stage: int) -> None:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is outside 0..{self.num_stages - 1} ({self.num_stages} stages)")


def layer_weights(layers: Sequence[LayerInfo], method: PartitionMethod) -> list[int] | None:
    """Weights :func:`partition_balanced` splits (``None`` for ``uniform``): trainable parameter
    counts, or 1 for layers whose class name matches the ``type:`` regex (case-insensitive)."""
    if method.kind == "uniform":
        return None
    if method.kind == "parameters":
        counts = [info.trainable_params for info in layers]
        if any(c is None for c in counts):
            raise ValueError("partition_method='parameters' needs every layer's parameter count")
        return [int(c or 0) for c in counts]
    regex = re.compile(method.pattern, re.IGNORECASE)
    weights = [1 if info.type_name is not None and regex.search(info.type_name) else 0 for info in layers]
    if not any(weights):
        names = sorted({info.type_name for info in layers if info.type_name is not None})
        raise ValueError(f"partition_method='type:{method.pattern}' matches no layer class; "
                         f"the classes are {names}")
    return weights


def plan_stages(layers: Sequence[LayerInfo], num_stages: int, partition_method: str = "parameters", *,
                activation_checkpoint_interval: int = 0,
                checkpointable_layers: Sequence[str] | None = None) -> StagePlan:
    """Partition ``layers`` into ``num_stages`` stages and group each stage's layers for
    activation checkpointing, with DeepSpeed's rules (see :class:`StagePlan`)."""
    _check_count("num_stages", num_stages, minimum=1)
    _check_count("activation_checkpoint_interval", activation_checkpoint_interval, minimum=0)
    method = PartitionMethod.parse(partition_method)
    if len(layers) < num_stages:
        raise ValueError(f"{len(layers)} layers cannot fill {num_stages} pipeline stages (a stage would be "
                         f"empty); use num_stages <= {len(layers)} or split the model into more layers")
    weights = layer_weights(layers, method)
    if weights is None:
        parts = partition_uniform(len(layers), num_stages)
    else:
        parts = partition_balanced(weights, num_stages)
    empty = [s for s in range(num_stages) if parts[s] == parts[s + 1]]
    if empty:  # only reachable with fewer layers than stages, refused above; kept as a guard
        raise ValueError(f"partition {parts} leaves stages {empty} empty; use fewer stages")
    tied: dict[str, list[int]] = {}
    for index, info in enumerate(layers):
        if info.tied_key is not None:
            tied.setdefault(info.tied_key, []).append(index)
    blocks = tuple(
        _stage_blocks(layers, parts[s], parts[s + 1], activation_checkpoint_interval, checkpointable_layers)
        for s in range(num_stages)
    )
    return StagePlan(parts=tuple(parts), tied=tuple((k, tuple(v)) for k, v in sorted(tied.items())),
                     blocks=blocks, checkpoint_interval=activation_checkpoint_interval)


def _stage_blocks(layers: Sequence[LayerInfo], start: int, stop: int, interval: int,
                  checkpointable: Sequence[str] | None) -> tuple[CheckpointBlock, ...]:
    """DeepSpeed's blocks: ``interval`` consecutive layers counted from the stage's first layer.
    A block is recomputed when every layer's class is in ``checkpointable`` or, without that
    list, when any of its layers has parameters."""
    if interval == 0:
        return (CheckpointBlock(start, stop, recompute=False),)
    out = []
    for first in range(start, stop, interval):
        last = min(first + interval, stop)
        members = layers[first:last]
        if checkpointable is not None:
            recompute = all(info.class_name in checkpointable for info in members)
        else:
            if any(info.has_params is None for info in members):
                raise ValueError("activation checkpointing without checkpointable_layers needs the layers' "
                                 "parameter counts")
            recompute = any(bool(info.has_params) for info in members)
        out.append(CheckpointBlock(first, last, recompute))
    return tuple(out)


def _check_count(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")


__all__ = ["CheckpointBlock", "LayerInfo", "PARTITION_METHODS", "PartitionMethod", "StagePlan",
           "layer_weights", "partition_balanced", "partition_uniform", "plan_stages"]
