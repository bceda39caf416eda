"""ParallelDims as a pure value: the rank layout of every axis (expert axes included) and its errors."""

from __future__ import annotations

import pytest

from zerospeed.distributed.mesh import AXES, ParallelDims

SINGLETONS_4 = [[0], [1], [2], [3]]


@pytest.mark.parametrize("kwargs, tables", [
    (dict(world_size=4, tp=2), {
        "pp": SINGLETONS_4, "dp": [[0, 2], [1, 3]], "sp": SINGLETONS_4, "tp": [[0, 1], [2, 3]],
        "ep": [[0], [2], [1], [3]], "edp": [[0, 2], [1, 3]],  # ep: chunks of each dp group in turn
    }),
    (dict(world_size=4, pp=2), {
        "pp": [[0, 2], [1, 3]], "dp": [[0, 1], [2, 3]], "sp": SINGLETONS_4, "tp": SINGLETONS_4,
        "ep": SINGLETONS_4, "edp": [[0, 1], [2, 3]],
    }),
    (dict(world_size=4, ep=2), {
        "pp": SINGLETONS_4, "dp": [[0, 1, 2, 3]], "sp": SINGLETONS_4, "tp": SINGLETONS_4,
        "ep": [[0, 1], [2, 3]], "edp": [[0, 2], [1, 3]],
    }),
    # DeepSpeed's "E + M + D" example (deepspeed/utils/groups.py), cut to 8 ranks: tp=2, ep=2
    (dict(world_size=8, tp=2, ep=2), {
        "pp": [[r] for r in range(8)], "dp": [[0, 2, 4, 6], [1, 3, 5, 7]], "sp": [[r] for r in range(8)],
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "ep": [[0, 2], [4, 6], [1, 3], [5, 7]], "edp": [[0, 4], [2, 6], [1, 5], [3, 7]],
    }),
    (dict(world_size=8, pp=2, ep=4), {
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]], "dp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "sp": [[r] for r in range(8)], "tp": [[r] for r in range(8)],
        "ep": [[0, 1, 2, 3], [4, 5, 6, 7]], "edp": [[0], [1], [2], [3], [4], [5], [6], [7]],
    }),
])
def test_every_axis_groups_as_written(kwargs: dict, tables: dict) -> None:
    dims = ParallelDims(**kwargs)
    assert {axis: dims.rank_groups(axis) for axis in AXES} == tables


def test_coords_are_row_major_over_pp_dp_sp_tp() -> None:
    dims = ParallelDims(world_size=8, tp=2, pp=2)
    assert dims.shape == (2, 2, 1, 2)
    assert [tuple(dims.coords(r).values()) for r in range(8)] == [
        (0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 0, 0), (0, 1, 0, 1),
        (1, 0, 0, 0), (1, 0, 0, 1), (1, 1, 0, 0), (1, 1, 0, 1),
    ]
    assert list(dims.coords(0)) == ["pp", "dp", "sp", "tp"]


def test_every_axis_partitions_the_ranks() -> None:
    dims = ParallelDims(world_size=16, tp=2, pp=2, ep=2)
    for axis in AXES:
        groups = dims.rank_groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(16)), axis
        assert len({len(g) for g in groups}) == 1, axis
    assert [len(dims.rank_groups(a)[0]) for a in AXES] == [2, 4, 1, 2, 2, 2]


def test_sequence_parallel_above_one_is_refused_by_name() -> None:
    with pytest.raises(NotImplementedError, match=r"ParallelDims.sp=2: sequence parallelism is not implemented yet.*set sp=1"):
        ParallelDims(world_size=4, sp=2)
    with pytest.raises(ValueError, match=r"ParallelDims.sp=0 must be an integer >= 1"):
        ParallelDims(world_size=4, sp=0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=8, tp=2, ep=3), "ep=3 must divide dp=4"),
    (dict(world_size=4, ep=8), "ep=8 must divide dp=4"),
    (dict(world_size=4, ep=0), r"ParallelDims.ep=0 must be an integer >= 1"),
])
def test_expert_degree_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


def test_unknown_axis_is_named() -> None:
    with pytest.raises(ValueError, match=r"unknown axis 'cp'"):
        ParallelDims(world_size=2).rank_groups("cp")  # type: ignore[arg-type]
