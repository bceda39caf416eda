"""Parallel degrees validated into named process groups: one mesh per job, kept by the engine.

:class:`ParallelDims` is a pure value: it checks that the degrees multiply to the world size and
says which ranks share each axis. :meth:`ParallelDims.build` turns it into a :class:`Mesh` (one
:class:`~zerospeed.distributed.comm.Comm` per axis) that is passed to whoever needs groups;
nothing is stored in module globals.

Grid: ranks are laid out row-major over ``(pp, dp, sp, tp)``: tensor-parallel peers are adjacent
ranks (they talk most), pipeline stages are farthest apart, and the sequence axis sits between
data and tensor parallelism (Megatron's ``tp-cp-dp-pp`` order). ``sp`` is a slot for now: only
degree 1 is accepted.

Expert axes split ``dp`` (DeepSpeed's default "E + D" layout, ``deepspeed.utils.groups``, which
Megatron's expert groups also follow): inside each data-parallel group, taken in rank order,
every ``ep`` consecutive members form an expert-parallel group (``ep``: the ranks holding
different experts, which exchange tokens), and the members at the same position of those groups
form an expert-data-parallel group (``edp``: the ranks holding the same experts, which reduce
their gradients). Example, 8 ranks with ``tp=2, ep=2``: ``dp`` groups ``[0,2,4,6] [1,3,5,7]``,
``ep`` groups ``[0,2] [4,6] [1,3] [5,7]``, ``edp`` groups ``[0,4] [2,6] [1,5] [3,7]``.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Literal, Mapping

from zerospeed.distributed import groups
from zerospeed.distributed.comm import DEFAULT_COMM_TIMEOUT, Comm
from zerospeed.distributed.groups import ProcessGroup

GridAxis = Literal["pp", "dp", "sp", "tp"]
Axis = Literal["pp", "dp", "sp", "tp", "ep", "edp"]
GRID_AXES: tuple[GridAxis, ...] = ("pp", "dp", "sp", "tp")  # row-major: the last varies fastest
AXES: tuple[Axis, ...] = ("pp", "dp", "sp", "tp", "ep", "edp")  # the order groups are created in


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallel axis. ``dp=-1`` means "whatever the world size leaves"."""

    world_size: int
    dp: int = -1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    sp: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "ep", "sp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelDims.{name}={value!r} must be an integer >= 1")
        if not isinstance(self.dp, int) or isinstance(self.dp, bool):
            raise ValueError(f"ParallelDims.dp={self.dp!r} must be an integer >= 1, or -1 to infer it")
        if self.sp != 1:
            raise NotImplementedError(f"ParallelDims.sp={self.sp}: sequence parallelism is not implemented yet "
                                      f"(the mesh keeps its axis at degree 1); set sp=1")
        fixed = self.tp * self.pp
        if self.dp == -1:
            if self.world_size % fixed:
                raise ValueError(
                    f"world size {self.world_size} is not divisible by tp*pp = {self.tp}*{self.pp} = {fixed}; "
                    f"choose tp and pp whose product divides {self.world_size}"
                )
            object.__setattr__(self, "dp", self.world_size // fixed)
        elif self.dp < 1 or self.dp * fixed != self.world_size:
            raise ValueError(
                f"dp*tp*pp = {self.dp}*{self.tp}*{self.pp} = {self.dp * fixed} but the world size is "
                f"{self.world_size}; set dp=-1 to infer it (would be {self.world_size / fixed:g})"
            )
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp={self.dp}: expert groups split the data-parallel axis")

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Degrees along :data:`GRID_AXES` ``(pp, dp, sp, tp)``."""
        return (self.pp, self.dp, self.sp, self.tp)

    def coords(self, rank: int) -> dict[GridAxis, int]:
        """This rank's index along each grid axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        out: dict[GridAxis, int] = {}
        rest = rank
        for axis, size in reversed(list(zip(GRID_AXES, self.shape, strict=True))):
            out[axis] = rest % size
            rest //= size
        return {axis: out[axis] for axis in GRID_AXES}

    def rank_groups(self, axis: Axis) -> list[list[int]]:
        """Every group of ranks along ``axis``, in a fixed order (the same on every rank)."""
        if axis in ("ep", "edp"):
            return self._expert_groups(axis)
        if axis not in GRID_AXES:
            raise ValueError(f"unknown axis {axis!r}; expected one of {AXES}")
        found: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            key = tuple(c[a] for a in GRID_AXES if a != axis)
            found.setdefault(key, []).append(rank)
        return list(found.values())

    def _expert_groups(self, axis: Axis) -> list[list[int]]:
        """``ep``: chunks of ``ep`` consecutive members of each dp group; ``edp``: the members at the
        same position of the chunks of one dp group (see the module docstring)."""
        out: list[list[int]] = []
        for dp_group in self.rank_groups("dp"):
            chunks = [dp_group[i: i + self.ep] for i in range(0, len(dp_group), self.ep)]
            if axis == "ep":
                out.extend(chunks)
            else:
                out.extend([list(column) for column in zip(*chunks, strict=True)])
        return out

    def build(self, timeout: datetime.timedelta = DEFAULT_COMM_TIMEOUT) -> "Mesh":
        """Create the process groups of every axis (collective: every rank must call it).

        Axes whose groups are the same rank sets (every size-1 axis, ``edp`` when ``ep=1``) share
        one process group, so a plain data-parallel job creates few groups; each axis still has a
        :class:`Comm` of its own (its own counters and name in timeout reports).
        """
        if not groups.is_initialized():
            raise RuntimeError("ParallelDims.build() needs a process group; call zerospeed.init_distributed() first")
        if groups.group_size() != self.world_size:
            raise ValueError(
                f"ParallelDims.world_size={self.world_size} but the process group has {groups.group_size()} ranks"
            )
        # Plain new_group rather than a torch DeviceMesh: a DeviceMesh is cached by torch and keeps its
        # groups alive past destroy_process_group, and gloo groups destroyed at interpreter teardown
        # abort the process ("terminate called without an active exception").
        made: dict[tuple[tuple[int, ...], ...], ProcessGroup] = {}
        comms: dict[Axis, Comm] = {}
        for axis in AXES:
            partition = tuple(sorted(tuple(g) for g in self.rank_groups(axis)))  # same sets, same groups
            if partition not in made:
                made[partition] = groups.new_partition(partition)
            comms[axis] = Comm(made[partition], name=axis, timeout=timeout)
        return Mesh(self, comms)


@dataclass(frozen=True)
class Mesh:
    """The built groups of one job, answering Megatron's ``mpu`` interface.

    ``mesh.comm('dp')`` is this rank's data-parallel :class:`Comm`; the ``get_*_group()`` methods
    return the torch process groups themselves (what ``mpu`` users hand to ``torch.distributed``).
    Model parallel means tensor parallel here, as DeepSpeed reads an ``mpu``. Groups are held
    weakly (through the Comms): a mesh outliving ``destroy_process_group`` keeps nothing alive.
    """

    dims: ParallelDims
    comms: Mapping[Axis, Comm]

    def __post_init__(self) -> None:
        missing = [axis for axis in AXES if axis not in self.comms]
        if missing:
            raise ValueError(f"Mesh needs a Comm for every axis; missing {missing}")

    def comm(self, axis: Axis) -> Comm:
        if axis not in self.comms:
            raise ValueError(f"unknown axis {axis!r}; expected one of {AXES}")
        return self.comms[axis]

    @property
    def dp(self) -> Comm:
        return self.comms["dp"]

    def ranks(self, axis: Axis) -> list[int]:
        """The global ranks of this rank's group along ``axis``."""
        return list(self.comm(axis).global_ranks)

    def _group(self, axis: Axis) -> ProcessGroup:
        return self.comm(axis).group

    # -- mpu: data parallel ----------------------------------------------------------------------
    def get_data_parallel_group(self) -> ProcessGroup:
        return self._group("dp")

    def get_data_parallel_rank(self) -> int:
        return self.comms["dp"].rank

    def get_data_parallel_world_size(self) -> int:
        return self.comms["dp"].world_size

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.ranks("dp")

    # -- mpu: tensor parallel (DeepSpeed's "model parallel") ------------------------------------
    def get_tensor_model_parallel_group(self) -> ProcessGroup:
        return self._group("tp")

    def get_tensor_model_parallel_rank(self) -> int:
        return self.comms["tp"].rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.comms["tp"].world_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        """The global rank of tensor-parallel rank 0 in this rank's group."""
        return self.comms["tp"].global_ranks[0]

    get_model_parallel_group = get_tensor_model_parallel_group
    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size

    # -- mpu: pipeline parallel ------------------------------------------------------------------
    def get_pipe_parallel_group(self) -> ProcessGroup:
        return self._group("pp")

    def get_pipe_parallel_rank(self) -> int:
        return self.comms["pp"].rank

    def get_pipe_parallel_world_size(self) -> int:
        return self.comms["pp"].world_size

    get_pipeline_model_parallel_group = get_pipe_parallel_group  # Megatron's names
    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    # -- mpu: sequence parallel (degree 1 for now) -----------------------------------------------
    def get_sequence_parallel_group(self) -> ProcessGroup:
        return self._group("sp")

    def get_sequence_parallel_rank(self) -> int:
        return self.comms["sp"].rank

    def get_sequence_parallel_world_size(self) -> int:
        return self.comms["sp"].world_size

    # -- mpu: experts ----------------------------------------------------------------------------
    def get_expert_model_parallel_group(self) -> ProcessGroup:
        return self._group("ep")

    def get_expert_model_parallel_rank(self) -> int:
        return self.comms["ep"].rank

    def get_expert_model_parallel_world_size(self) -> int:
        return self.comms["ep"].world_size

    def get_expert_data_parallel_group(self) -> ProcessGroup:
        return self._group("edp")

    def get_expert_data_parallel_rank(self) -> int:
        return self.comms["edp"].rank

    def get_expert_data_parallel_world_size(self) -> int:
        return self.comms["edp"].world_size
