"""DeepSpeed's ZeRO-3 parameter attributes (``ds_numel``, ``ds_shape``, ``ds_id``, ``ds_status``, ...).

Frameworks written for DeepSpeed read these off a partitioned parameter: transformers counts
parameters with ``p.ds_numel`` (a partitioned parameter's own ``numel()`` is 0), Lightning's model
summary calls ``p.partition_numel()``, user code checks ``p.ds_status``. DeepSpeed sets them as plain
attributes when ``zero.Init`` or its ZeRO-3 engine partitions a parameter and keeps them current by
hand. Here a partitioned parameter's class becomes :class:`ZeroParameter` (an ``nn.Parameter``
subclass, so ``isinstance`` checks and autograd are unchanged), whose attributes are computed from
the parameter's owner (:class:`Partitioned`) on every read, so they cannot go stale: the owner stays
the only holder of a parameter's ZeRO state. A parameter that is not partitioned (stages 0-2, or a
copy made by ``copy.deepcopy``) has none of them, as in DeepSpeed, so ``hasattr(p, "ds_numel")`` is
the test frameworks use for "partitioned by ZeRO-3".
"""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from typing import Any, Iterable

import torch
from torch import nn

OWNER = "_zerospeed_owner"  # the attribute holding a parameter's owner (see zerospeed.zero.owner)


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's ``ZeroParamStatus``: whether a partitioned parameter is whole right now."""

    AVAILABLE = 1  # whole on every rank (gathered, or a persistent parameter)
    NOT_AVAILABLE = 2  # only this rank's partition is held
    INFLIGHT = 3  # a gather is under way


class Partitioned(ABC):
    """What the owner of a ZeRO-3 partitioned parameter answers (``zero.Init``'s partition, or a
    stage-3 engine's unit): the facts behind DeepSpeed's parameter attributes."""

    ds_id: int  # unique among the parameters partitioned together (construction order)
    shape: tuple[int, ...]  # the full shape

    @property
    @abstractmethod
    def status(self) -> ZeroParamStatus:
        """Whether the parameter is whole right now."""

    @property
    @abstractmethod
    def persistent(self) -> bool:
        """True when the parameter stays whole between uses (ZeRO-3's persistence threshold)."""

    @abstractmethod
    def partition_numel(self) -> int:
        """Elements of this parameter that this rank holds (DeepSpeed: ``param.ds_tensor.ds_numel``)."""

    @abstractmethod
    def padding_size(self) -> int:
        """Elements of padding added to this parameter so it splits evenly over the ranks."""

    @abstractmethod
    def partition_tensor(self) -> torch.Tensor:
        """This rank's part of the parameter, flat (DeepSpeed's ``ds_tensor``)."""

    @abstractmethod
    def make_available(self) -> None:
        """Gather the parameter whole (collective)."""

    @abstractmethod
    def repartition(self) -> None:
        """Drop the whole copy again, keeping only this rank's partition (collective)."""


def partitioned_owner(param: torch.Tensor) -> Partitioned | None:
    """The parameter's owner when ZeRO-3 partitions it, else None."""
    owner = param.__dict__.get(OWNER)
    return owner if isinstance(owner, Partitioned) else None


class ZeroParameter(nn.Parameter):
    """The class of a ZeRO-3 partitioned parameter: an ``nn.Parameter`` with DeepSpeed's ``ds_*``
    attributes and methods, computed from its owner. Never constructed directly: a parameter's class
    is switched by :func:`mark_partitioned` and back by :func:`unmark_partitioned`."""

    def _ds_owner(self, name: str) -> Partitioned:
        owner = partitioned_owner(self)
        if owner is None:  # e.g. a deepcopy: the copy is a plain parameter without ZeRO state
            raise AttributeError(f"{name}: this parameter is not partitioned by ZeRO-3")
        return owner

    @property
    def ds_numel(self) -> int:
        return math.prod(self._ds_owner("ds_numel").shape)

    @property
    def ds_shape(self) -> torch.Size:
        return torch.Size(self._ds_owner("ds_shape").shape)

    @property
    def ds_id(self) -> int:
        return self._ds_owner("ds_id").ds_id

    @property
    def ds_status(self) -> ZeroParamStatus:
        return self._ds_owner("ds_status").status

    @property
    def ds_persist(self) -> bool:
        return self._ds_owner("ds_persist").persistent

    @property
    def ds_tensor(self) -> torch.Tensor:
        part = self._ds_owner("ds_tensor").partition_tensor()
        part.ds_numel = part.numel()  # type: ignore[attr-defined]  # DeepSpeed's partition_numel() reads it
        return part

    def partition_numel(self) -> int:
        return self._ds_owner("partition_numel").partition_numel()

    def padding_size(self) -> int:
        return self._ds_owner("padding_size").padding_size()

    def aligned_size(self) -> int:
        owner = self._ds_owner("aligned_size")
        return math.prod(owner.shape) + owner.padding_size()

    def all_gather(self, param_list: Iterable[torch.Tensor] | None = None, async_op: bool = False,
                   hierarchy: int = 0) -> None:
        """Make ``param_list`` (default: this parameter) whole; as DeepSpeed's ``param.all_gather()``."""
        for p in (param_list if param_list is not None else [self]):
            owner = partitioned_owner(p)
            if owner is not None:
                owner.make_available()

    def partition(self, param_list: Iterable[torch.Tensor] | None = None, has_been_updated: bool = False,
                  **ignored: Any) -> None:
        """Release ``param_list`` (default: this parameter) back to partitions; DeepSpeed's
        ``param.partition()``. Edits made while whole are not kept (use ``GatheredParameters(modifier_rank=)``)."""
        for p in (param_list if param_list is not None else [self]):
            owner = partitioned_owner(p)
            if owner is not None:
                owner.repartition()

    def ds_summary(self, use_debug_name: bool = False) -> dict[str, Any]:
        owner = self._ds_owner("ds_summary")
        return {"id": owner.ds_id, "status": owner.status.name, "numel": self.numel(),
                "ds_numel": math.prod(owner.shape), "shape": tuple(self.shape), "ds_shape": owner.shape,
                "requires_grad": self.requires_grad,
                "grad_shape": tuple(self.grad.shape) if self.grad is not None else None,
                "persist": owner.persistent, "active_sub_modules": set(),
                "ds_tensor.shape": tuple(owner.partition_tensor().shape)}


def mark_partitioned(param: torch.Tensor) -> None:
    """Give ``param`` DeepSpeed's ZeRO-3 attributes (its owner must be :class:`Partitioned`). A
    parameter of another ``nn.Parameter`` subclass keeps its class (and has no ``ds_*`` attributes)."""
    if type(param) is nn.Parameter:
        param.__class__ = ZeroParameter


def unmark_partitioned(param: torch.Tensor) -> None:
    """Undo :func:`mark_partitioned` (the parameter is no longer partitioned)."""
    if type(param) is ZeroParameter:
        param.__class__ = nn.Parameter  # type: ignore[assignment]  # back to the plain class


__all__ = ["OWNER", "Partitioned", "ZeroParamStatus", "ZeroParameter", "mark_partitioned", "partitioned_owner",
           "unmark_partitioned"]
