"""The built mesh on real ranks: every group's members and every ``mpu`` answer, against tables
written out by hand; the engine keeps the mesh; ``zero.Init`` takes its Comm from it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zerospeed.testing import run_distributed

# Per layout: this rank's group along each axis, for ranks 0..3 (hand-written).
GROUPS = {
    "tp2_dp2": {
        "pp": [[0], [1], [2], [3]], "dp": [[0, 2], [1, 3], [0, 2], [1, 3]], "sp": [[0], [1], [2], [3]],
        "tp": [[0, 1], [0, 1], [2, 3], [2, 3]], "ep": [[0], [1], [2], [3]], "edp": [[0, 2], [1, 3], [0, 2], [1, 3]],
    },
    "pp2_dp2": {
        "pp": [[0, 2], [1, 3], [0, 2], [1, 3]], "dp": [[0, 1], [0, 1], [2, 3], [2, 3]], "sp": [[0], [1], [2], [3]],
        "tp": [[0], [1], [2], [3]], "ep": [[0], [1], [2], [3]], "edp": [[0, 1], [0, 1], [2, 3], [2, 3]],
    },
    "ep2_dp4": {
        "pp": [[0], [1], [2], [3]], "dp": [[0, 1, 2, 3]] * 4, "sp": [[0], [1], [2], [3]],
        "tp": [[0], [1], [2], [3]], "ep": [[0, 1], [0, 1], [2, 3], [2, 3]], "edp": [[0, 2], [1, 3], [0, 2], [1, 3]],
    },
}

# Per layout and rank: (rank, world size) answered by each mpu family, and the tp source rank.
MPU = {
    "tp2_dp2": [
        dict(data=(0, 2), model=(0, 2), tensor=(0, 2), pipe=(0, 1), seq=(0, 1), expert=(0, 1), expert_data=(0, 2), src=0),
        dict(data=(0, 2), model=(1, 2), tensor=(1, 2), pipe=(0, 1), seq=(0, 1), expert=(0, 1), expert_data=(0, 2), src=0),
        dict(data=(1, 2), model=(0, 2), tensor=(0, 2), pipe=(0, 1), seq=(0, 1), expert=(0, 1), expert_data=(1, 2), src=2),
        dict(data=(1, 2), model=(1, 2), tensor=(1, 2), pipe=(0, 1), seq=(0, 1), expert=(0, 1), expert_data=(1, 2), src=2),
    ],
    "pp2_dp2": [
        dict(data=(0, 2), model=(0, 1), tensor=(0, 1), pipe=(0, 2), seq=(0, 1), expert=(0, 1), expert_data=(0, 2), src=0),
        dict(data=(1, 2), model=(0, 1), tensor=(0, 1), pipe=(0, 2), seq=(0, 1), expert=(0, 1), expert_data=(1, 2), src=1),
        dict(data=(0, 2), model=(0, 1), tensor=(0, 1), pipe=(1, 2), seq=(0, 1), expert=(0, 1), expert_data=(0, 2), src=2),
        dict(data=(1, 2), model=(0, 1), tensor=(0, 1), pipe=(1, 2), seq=(0, 1), expert=(0, 1), expert_data=(1, 2), src=3),
    ],
    "ep2_dp4": [
        dict(data=(0, 4), model=(0, 1), tensor=(0, 1), pipe=(0, 1), seq=(0, 1), expert=(0, 2), expert_data=(0, 2), src=0),
        dict(data=(1, 4), model=(0, 1), tensor=(0, 1), pipe=(0, 1), seq=(0, 1), expert=(1, 2), expert_data=(0, 2), src=1),
        dict(data=(2, 4), model=(0, 1), tensor=(0, 1), pipe=(0, 1), seq=(0, 1), expert=(0, 2), expert_data=(1, 2), src=2),
        dict(data=(3, 4), model=(0, 1), tensor=(0, 1), pipe=(0, 1), seq=(0, 1), expert=(1, 2), expert_data=(1, 2), src=3),
    ],
}

LAYOUTS = {"tp2_dp2": dict(tp=2, dp=2), "pp2_dp2": dict(pp=2, dp=2), "ep2_dp4": dict(ep=2, dp=4)}
# mpu family -> (group getter, the mesh axis it must be); rank and world size getters follow the names
FAMILIES = {
    "data": ("get_data_parallel", "dp"), "model": ("get_model_parallel", "tp"),
    "tensor": ("get_tensor_model_parallel", "tp"), "pipe": ("get_pipe_parallel", "pp"),
    "seq": ("get_sequence_parallel", "sp"), "expert": ("get_expert_model_parallel", "ep"),
    "expert_data": ("get_expert_data_parallel", "edp"),
}


def _answers() -> dict:
    """Build each layout's mesh and report what this rank sees of it."""
    from zerospeed.distributed.mesh import AXES, ParallelDims

    out = {}
    for name, degrees in LAYOUTS.items():
        mesh = ParallelDims(world_size=4, **degrees).build()
        seen: dict = {"members": {axis: mesh.ranks(axis) for axis in AXES}, "mpu": {}, "torch": {}, "sums": {}}
        for family, (prefix, axis) in FAMILIES.items():
            group = getattr(mesh, prefix + "_group")()
            assert isinstance(group, dist.ProcessGroup)
            seen["mpu"][family] = (getattr(mesh, prefix + "_rank")(), getattr(mesh, prefix + "_world_size")())
            seen["torch"][family] = dist.get_process_group_ranks(group)
            value = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(value, group=group)  # the group works as torch's own
            seen["sums"][family] = value.item()
        seen["mpu"]["src"] = mesh.get_tensor_model_parallel_src_rank()
        pipeline_alias = (mesh.get_pipeline_model_parallel_rank(), mesh.get_pipeline_model_parallel_world_size(),
                          dist.get_process_group_ranks(mesh.get_pipeline_model_parallel_group()))
        seen["alias_ok"] = pipeline_alias == (*seen["mpu"]["pipe"], seen["torch"]["pipe"])
        seen["data_ranks"] = mesh.get_data_parallel_group_ranks()
        out[name] = seen
    return out


@pytest.mark.timeout(300)
def test_meshes_on_four_ranks_match_the_hand_written_tables() -> None:
    results = run_distributed(_answers, 4, timeout=240)
    for rank, seen_by_layout in enumerate(results):
        for name, seen in seen_by_layout.items():
            where = f"{name}, rank {rank}"
            assert seen["members"] == {axis: GROUPS[name][axis][rank] for axis in GROUPS[name]}, where
            expected_mpu = MPU[name][rank]
            assert seen["mpu"] == expected_mpu, where
            for family, (_, axis) in FAMILIES.items():
                assert seen["torch"][family] == GROUPS[name][axis][rank], (where, family)
                assert seen["sums"][family] == sum(GROUPS[name][axis][rank]), (where, family)
            assert seen["alias_ok"], where
            assert seen["data_ranks"] == GROUPS[name]["dp"][rank], where


def _engine_keeps_the_mesh() -> dict:
    import zerospeed
    from zerospeed.distributed.mesh import Mesh, ParallelDims
    from zerospeed.zero.owner import init_partition

    torch.manual_seed(0)
    init_mesh = ParallelDims(world_size=2).build()
    with zerospeed.zero.Init(mesh=init_mesh):
        model = nn.Linear(4, 4)
    init_comm_is_mesh_dp = init_partition(model.weight).comm is init_mesh.dp
    try:
        zerospeed.zero.Init(mesh=init_mesh, comm=init_mesh.comm("tp"))
        mismatch = ""
    except ValueError as err:
        mismatch = str(err)
    engine, *_ = zerospeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                            "zero_optimization": {"stage": 3}})
    return {
        "is_mesh": isinstance(engine.mesh, Mesh),
        "comm_is_dp": engine.comm is engine.mesh.dp and engine.comm is engine.mesh.comm("dp"),
        "dp": (engine.mesh.get_data_parallel_rank(), engine.mesh.get_data_parallel_world_size()),
        "tp": engine.mesh.get_model_parallel_world_size(),
        "init_comm_is_mesh_dp": init_comm_is_mesh_dp,
        "mismatch": mismatch,
    }


@pytest.mark.timeout(200)
def test_engine_keeps_the_mesh_and_its_dp_comm_is_the_engines() -> None:
    results = run_distributed(_engine_keeps_the_mesh, 2, timeout=150)
    for rank, got in enumerate(results):
        assert got == {"is_mesh": True, "comm_is_dp": True, "dp": (rank, 2), "tp": 1, "init_comm_is_mesh_dp": True,
                       "mismatch": "zero.Init(comm=..., mesh=...): comm must be the mesh's data-parallel Comm "
                                   "(mesh.dp); pass one of them"}
