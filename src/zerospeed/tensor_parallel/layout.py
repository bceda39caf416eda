"""How a model's parameters are split over the tensor-parallel group: a pure record, read once.

The engine reads it to count each parameter once in the global gradient norm (a replicated
parameter's gradient is the same on every tensor-parallel rank), to broadcast replicated
parameters inside the group, and checkpoints read it to store slices in a form any
tensor-parallel size can load. It comes from the layers themselves
(:meth:`TensorParallelLayer.partition_dims`) or, for Megatron models handed in with an ``mpu``,
from Megatron's parameter attributes ``tensor_model_parallel`` / ``partition_dim``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import torch
from torch import nn

from zerospeed.tensor_parallel.layers import TensorParallelLayer


@dataclass(frozen=True)
class ParamSplit:
    """A parameter that is slice ``rank`` of ``degree`` equal slices of a full tensor along ``dim``."""

    dim: int
    rank: int
    degree: int
    parts: int = 1  # equal tensors fused along ``dim``, each split on its own (see ``local_slice``)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.degree:
            raise ValueError(f"ParamSplit rank {self.rank} outside degree {self.degree}")
        if self.parts < 1:
            raise ValueError(f"ParamSplit parts {self.parts} must be >= 1")

    def local_slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full tensor: chunk ``rank`` of ``degree`` along ``dim``, taken from each
        of the ``parts`` fused tensors and concatenated (with one part: a plain chunk)."""
        pieces = [part.chunk(self.degree, dim=self.dim)[self.rank] for part in full.chunk(self.parts, dim=self.dim)]
        return torch.cat(pieces, dim=self.dim)

    def full_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        """The full tensor's shape, from this slice's."""
        return tuple(n * self.degree if d == self.dim else n for d, n in enumerate(local))

    def blocks(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        """``(outer, split, inner)``: the full tensor (of ``shape``) viewed as ``[outer, split, inner]`` so
        that slice ``r`` is chunk ``r`` of ``degree`` equal chunks of the middle axis, and the slice's
        own flattened values are ``[outer, split / degree, inner]`` in order: one contiguous run per
        outer index. ``parts`` fused tensors count as outer rows (each is split on its own)."""
        split = shape[self.dim] // self.parts
        return math.prod(shape[: self.dim]) * self.parts, split, math.prod(shape[self.dim + 1:])


@dataclass(frozen=True)
class TPLayout:
    """The split of every tensor-parallel parameter of a model (by parameter name); any parameter not
    listed is replicated over the group."""

    degree: int
    rank: int
    splits: Mapping[str, ParamSplit] = field(default_factory=dict)

    def is_split(self, name: str) -> bool:
        return name in self.splits

    def counted_elsewhere(self, names: list[str]) -> frozenset[str]:
        """Of ``names``, those another tensor-parallel rank counts: replicated ones, counted on rank 0."""
        if self.rank == 0 or self.degree == 1:
            return frozenset()
        return frozenset(name for name in names if name not in self.splits)

    def to_json(self) -> dict:
        return {"degree": self.degree, "splits": {name: s.dim for name, s in self.splits.items()},
                **({"fused_parts": {name: s.parts for name, s in self.splits.items() if s.parts > 1}}
                   if any(s.parts > 1 for s in self.splits.values()) else {})}


def tp_layout(model: nn.Module, degree: int = 1, rank: int = 0) -> TPLayout:
    """The layout of ``model`` on this rank: from its :class:`TensorParallelLayer` s, and from Megatron's
    ``tensor_model_parallel`` attributes (with ``degree``/``rank`` of the group the ``mpu`` gave).
    Every split layer must use a group of ``degree`` ranks (or of one, when the model is not split)."""
    splits: dict[str, ParamSplit] = {}
    seen: set[int] = set()
    layers = {path: m for path, m in model.named_modules() if isinstance(m, TensorParallelLayer)}
    for path, layer in layers.items():
        if layer.tp_size == 1:
            continue
        if degree not in (1, layer.tp_size):
            raise ValueError(f"{path or 'the model'} is split over {layer.tp_size} tensor-parallel ranks but the "
                             f"job's tensor-parallel size is {degree}; build the layers with the mesh's tp group")
        degree, rank = layer.tp_size, layer.tp_rank
    for name, param in model.named_parameters():  # first name of each parameter, as checkpoints use
        if id(param) in seen:
            continue
        seen.add(id(param))
        owner_path, _, attr = name.rpartition(".")
        owner = layers.get(owner_path)
        if owner is not None and owner.tp_size > 1 and attr in owner.partition_dims():
            splits[name] = ParamSplit(owner.partition_dims()[attr], owner.tp_rank, owner.tp_size, owner.fused_parts)
        elif getattr(param, "tensor_model_parallel", False) and degree > 1:
            splits[name] = ParamSplit(int(getattr(param, "partition_dim", 0)), rank, degree)
    return TPLayout(degree, rank, splits)


__all__ = ["ParamSplit", "TPLayout", "tp_layout"]
