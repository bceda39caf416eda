"""DeepSpeed's process topologies (``deepspeed.runtime.pipe.topology``), pure: ranks on a named grid.

A :class:`ProcessTopology` lays ranks out row-major over its axes, the last axis varying fastest.
:class:`PipeModelDataParallelTopology` uses the axes ``pipe, data, model``, which is exactly our
mesh's ``(pp, dp, sp, tp)`` grid with ``sp = 1`` (tensor peers adjacent, stages outermost), so
:func:`topology_to_dims` and :func:`dims_to_topology` convert between the two without moving any
rank; both check that claim coordinate by coordinate rather than assume it.
"""

from __future__ import annotations

import itertools
import math
from collections import namedtuple
from typing import Any, Sequence

from zerospeed.distributed.mesh import ParallelDims

# DeepSpeed's axis names and the mesh axes they are
_AXIS_TO_MESH = {"pipe": "pp", "data": "dp", "model": "tp"}


class ProcessTopology:
    """Ranks ``0..prod(dims)-1`` on a grid with named ``axes`` of sizes ``dims``, row-major.

    ``ProcessTopology(axes=['x', 'y'], dims=[2, 3])`` puts ``(x, y)`` and ``(x, y + 1)`` on
    adjacent ranks. Coordinates are ``ProcessCoord`` namedtuples, as in DeepSpeed.
    """

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        axes, dims = list(axes), list(dims)
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology: {len(axes)} axes {axes} but {len(dims)} dims {dims}; "
                             "give one size per axis")
        if len(set(axes)) != len(axes) or not all(isinstance(a, str) and a.isidentifier() for a in axes):
            raise ValueError(f"ProcessTopology axes={axes} must be distinct identifiers")
        for axis, size in zip(axes, dims, strict=True):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"ProcessTopology: axis {axis!r} has size {size!r}; sizes are integers >= 1")
        self.axes = axes
        self.dims = dims
        self.ProcessCoord: Any = namedtuple("ProcessCoord", axes)  # type: ignore[misc]
        # stride of each axis: the product of the sizes after it (row-major)
        self._strides = [math.prod(dims[i + 1:]) for i in range(len(dims))]

    def world_size(self) -> int:
        return math.prod(self.dims)

    def get_axis_names(self) -> list[str]:
        """The axis names, in layout order (the last varies fastest)."""
        return list(self.axes)

    def get_dim(self, axis: str) -> int:
        """The size of ``axis``; 0 when the topology has no such axis (as in DeepSpeed)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_rank(self, **coord_kwargs: int) -> int:
        """The rank at the given coordinates (every axis must be given; use :meth:`filter_match`
        for partial ones)."""
        if set(coord_kwargs) != set(self.axes):
            raise ValueError(f"get_rank({coord_kwargs}) needs exactly the axes {self.axes} (it does not "
                             "support slices); use filter_match() for a partial coordinate")
        rank = 0
        for axis, size, stride in zip(self.axes, self.dims, self._strides, strict=True):
            index = coord_kwargs[axis]
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < size:
                raise ValueError(f"get_rank: {axis}={index!r} is outside 0..{size - 1}")
            rank += index * stride
        return rank

    def get_coord(self, rank: int) -> Any:
        """The ``ProcessCoord`` of ``rank``; its fields are the axes."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size():
            raise ValueError(f"rank {rank!r} not found in topology (ranks are 0..{self.world_size() - 1})")
        return self.ProcessCoord(*[(rank // stride) % size
                                   for size, stride in zip(self.dims, self._strides, strict=True)])

    def get_rank_repr(self, rank: int, omit_axes: Sequence[str] = ("data", "pipe"), inner_sep: str = "_",
                      outer_sep: str = "-") -> str:
        """``rank``'s coordinates as text for checkpoint names, e.g. ``'model_01'``."""
        coord = self.get_coord(rank)
        return outer_sep.join(f"{axis}{inner_sep}{getattr(coord, axis):02d}"
                              for axis in self.axes if axis not in frozenset(omit_axes))

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """One list of ranks per group along ``axis`` (coordinates equal on every other axis), the
        groups ordered row-major over the other axes; ``[]`` when there is no such axis."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for values in itertools.product(*[range(self.get_dim(a)) for a in others]):
            fixed = dict(zip(others, values, strict=True))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """Ranks (ascending) whose coordinates match every given ``axis=index``."""
        unknown = [a for a in filter_kwargs if a not in self.axes]
        if unknown:
            raise ValueError(f"filter_match: unknown axes {unknown}; the axes are {self.axes}")
        return [rank for rank in range(self.world_size())
                if all(getattr(self.get_coord(rank), a) == v for a, v in filter_kwargs.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """Ranks (ascending) whose coordinate along ``axis`` is ``idx``."""
        if axis not in self.axes:
            raise ValueError(f"get_axis_list: unknown axis {axis!r}; the axes are {self.axes}")
        return self.filter_match(**{axis: idx})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessTopology) and (self.axes, self.dims) == (other.axes, other.dims)

    def __hash__(self) -> int:
        return hash((tuple(self.axes), tuple(self.dims)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(axes={self.axes}, dims={self.dims})"

    def __str__(self) -> str:  # DeepSpeed prints its coordinate -> rank mapping
        return str({self.get_coord(rank): rank for rank in range(self.world_size())})


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline and data parallelism: axes ``pipe, data`` (data-parallel peers adjacent)."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline, data and model (tensor) parallelism: axes ``pipe, data, model``, model fastest."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def topology_to_dims(topology: ProcessTopology, world_size: int) -> ParallelDims:
    """The :class:`ParallelDims` placing every rank where ``topology`` does (``pipe`` -> pp,
    ``data`` -> dp, ``model`` -> tp). Refuses axes the mesh has no place for and orders that
    would lay ranks out differently from the mesh's ``(pp, dp, sp, tp)``."""
    if topology.world_size() != world_size:
        raise ValueError(f"{topology!r} has {topology.world_size()} ranks but the world size is {world_size}; "
                         "build the topology with degrees multiplying to the world size")
    unknown = [a for a in topology.axes if a not in _AXIS_TO_MESH and topology.get_dim(a) > 1]
    if unknown:
        raise ValueError(f"{topology!r}: axes {unknown} have no place in the mesh (it knows "
                         f"{sorted(_AXIS_TO_MESH)}); use PipeModelDataParallelTopology or PipeDataParallelTopology")
    sizes = {mesh: max(topology.get_dim(name), 1) for name, mesh in _AXIS_TO_MESH.items()}
    dims = ParallelDims(world_size=world_size, pp=sizes["pp"], dp=sizes["dp"], tp=sizes["tp"])
    for rank in range(world_size):
        coord, mesh_coord = topology.get_coord(rank), dims.coords(rank)
        for name, mesh in _AXIS_TO_MESH.items():
            if name in topology.axes and getattr(coord, name) != mesh_coord[mesh]:  # type: ignore[index]
                raise ValueError(f"{topology!r} places rank {rank} at {coord} but the mesh, row-major over "
                                 f"(pp, dp, sp, tp), at {mesh_coord}; order the axes as pipe, data, model")
    return dims


def dims_to_topology(dims: ParallelDims) -> ProcessTopology:
    """The DeepSpeed topology of ``dims``' grid: ``PipeDataParallelTopology`` without tensor
    parallelism (what DeepSpeed builds by default), else ``PipeModelDataParallelTopology``.
    Expert axes split ``dp`` and are not part of the grid, so ``ep`` does not appear."""
    if dims.sp != 1:
        raise ValueError(f"{dims}: a DeepSpeed topology has no sequence axis; use sp=1")
    if dims.tp == 1:
        return PipeDataParallelTopology(num_pp=dims.pp, num_dp=dims.dp)
    return PipeModelDataParallelTopology(num_pp=dims.pp, num_mp=dims.tp, num_dp=dims.dp)


__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "ProcessTopology",
           "dims_to_topology", "topology_to_dims"]
