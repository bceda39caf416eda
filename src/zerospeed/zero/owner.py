"""The one attribute zerospeed puts on a parameter, and the typed ways to read and set it.

``param._zerospeed_owner`` holds either a :class:`~zerospeed.zero.contract.ParamOwner` (an engine
trains the parameter) or an ``InitPartition`` (``zero.Init`` partitioned it and no engine has taken it
yet). Everything about a parameter lives in its owner, never on the parameter itself.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Union

import torch

from zerospeed.zero.contract import ParamOwner
from zerospeed.zero.ds_param import OWNER, Partitioned, mark_partitioned, unmark_partitioned


class InitOwner(Partitioned):
    """A parameter ``zero.Init`` partitioned before any engine took it (``zero.init.InitPartition``)."""

    shape: tuple[int, ...]  # the full shape (the parameter's data is empty while partitioned)

    @abstractmethod
    def gather(self) -> None:
        """Make the parameter whole (collective)."""

    @abstractmethod
    def release(self, modifier_rank: int | None) -> None:
        """Partition it again, first taking ``modifier_rank``'s edits when given (collective)."""

    @abstractmethod
    def take_full(self) -> torch.Tensor:
        """The full values, after which the partition is dropped (an engine takes the parameter over)."""

    def file_bytes(self) -> int:
        """Bytes of the swap file holding this partition, freed by :meth:`take_full` (0: in memory)."""
        return 0


AnyOwner = Union[ParamOwner, InitOwner]


def owner_of(param: torch.Tensor) -> AnyOwner | None:
    """The parameter's owner, if zerospeed holds its state."""
    return getattr(param, OWNER, None)


def engine_owner(param: torch.Tensor) -> ParamOwner | None:
    """The owner when an engine trains the parameter (None for plain and ``zero.Init``-only parameters)."""
    owner = getattr(param, OWNER, None)
    return owner if isinstance(owner, ParamOwner) else None


def init_partition(param: torch.Tensor) -> InitOwner | None:
    """The ``zero.Init`` partition of a parameter no engine has taken yet, else None."""
    owner = getattr(param, OWNER, None)
    return owner if isinstance(owner, InitOwner) else None


def set_owner(param: torch.Tensor, owner: AnyOwner) -> None:
    """Record ``owner``; a ZeRO-3 partitioned owner also gives the parameter DeepSpeed's ``ds_*``
    attributes (``zerospeed.zero.ds_param``), any other takes them away."""
    setattr(param, OWNER, owner)
    if isinstance(owner, Partitioned):
        mark_partitioned(param)
    else:
        unmark_partitioned(param)


def clear_owner(param: torch.Tensor) -> None:
    if getattr(param, OWNER, None) is not None:
        delattr(param, OWNER)
    unmark_partitioned(param)


__all__ = ["OWNER", "AnyOwner", "InitOwner", "clear_owner", "engine_owner", "init_partition", "owner_of",
           "set_owner"]
