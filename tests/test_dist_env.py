"""Rank discovery from launcher variables, the accelerator choice, and ParallelDims layouts."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zerospeed.accelerator import get_accelerator
from zerospeed.accelerator.cpu_accelerator import CPU_Accelerator
from zerospeed.accelerator.cuda_accelerator import CUDA_Accelerator
from zerospeed.distributed import Comm, DistEnv, ParallelDims, discover
from zerospeed.distributed.env import first_host
from zerospeed.testing import run_distributed


def test_torchrun_variables() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29600"}
    assert discover(env) == DistEnv(3, 4, 1, 2, "10.0.0.5", 29600, "torchrun")


def test_slurm_variables() -> None:
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]"}
    assert discover(env) == DistEnv(5, 8, 1, 4, "gpu07", 29500, "slurm")


def test_slurm_uneven_tasks_per_node() -> None:
    env = {"SLURM_PROCID": "8", "SLURM_NTASKS": "10", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
           "SLURM_TASKS_PER_NODE": "4(x2),2", "SLURM_JOB_NODELIST": "n[1-3]"}
    assert discover(env).local_world_size == 2
    with pytest.raises(ValueError, match=r"SLURM_TASKS_PER_NODE='4,x' is not in SLURM's format"):
        discover({**env, "SLURM_TASKS_PER_NODE": "4,x"})


def test_mpirun_inside_an_sbatch_job_uses_mpi_ranks() -> None:
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "OMPI_COMM_WORLD_RANK": "2",
           "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    info = discover(env)
    assert (info.rank, info.world_size, info.source) == (2, 4, "openmpi")


def test_openmpi_variables_single_node() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}
    assert discover(env, default_port=1234) == DistEnv(2, 3, 2, 3, "127.0.0.1", 1234, "openmpi")


def test_openmpi_across_nodes_needs_master_addr() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(ValueError, match="needs MASTER_ADDR set to rank 0's host"):
        discover(env)


def test_pmi_and_torchrun_precedence() -> None:
    assert discover({"PMI_RANK": "1", "PMI_SIZE": "2"}).source == "pmi"
    both = {"RANK": "0", "WORLD_SIZE": "1", "SLURM_PROCID": "3", "SLURM_NTASKS": "4"}
    assert discover(both).source == "torchrun"


def test_single_process_default() -> None:
    assert discover({}) == DistEnv(0, 1, 0, 1, "127.0.0.1", 29500, "single")


@pytest.mark.parametrize("env, message", [
    ({"RANK": "4", "WORLD_SIZE": "4"}, "rank 4 from torchrun variables is outside world size 4"),
    ({"RANK": "x", "WORLD_SIZE": "4"}, "environment variable RANK='x' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "world size 0 from torchrun variables must be >= 1"),
    ({"RANK": "1"}, "environment variable WORLD_SIZE is not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}, "environment variable MASTER_PORT='http' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": ""}, "environment variable LOCAL_RANK='' is not an integer"),
])
def test_bad_variables(env: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        discover(env)


def test_slurm_first_host() -> None:
    assert first_host("node[03-05,9],gpu1") == "node03"
    assert first_host("login1") == "login1"
    assert first_host("a1,b2") == "a1"
    assert first_host("rack[1-2]-node[01-04]") == "rack1-node01"
    with pytest.raises(ValueError, match="cannot read a host"):
        first_host("node[01")


def test_accelerator_choice() -> None:
    assert isinstance(get_accelerator({"ZEROSPEED_ACCELERATOR": "cpu"}), CPU_Accelerator)
    cpu = CPU_Accelerator()
    assert (cpu.backend, cpu.torch_device(3), cpu.is_cpu) == ("gloo", torch.device("cpu"), True)
    assert CUDA_Accelerator().backend == "nccl"
    assert CUDA_Accelerator().torch_device(1) == torch.device("cuda", 1)
    t = torch.ones(2)
    assert cpu.pin_memory(t) is t
    with pytest.raises(ValueError, match="ZEROSPEED_ACCELERATOR='tpu' is not a known accelerator"):
        get_accelerator({"ZEROSPEED_ACCELERATOR": "tpu"})
    if not torch.cuda.is_available():
        assert isinstance(get_accelerator({}), CPU_Accelerator)
        with pytest.raises(RuntimeError, match="unset it to run on the CPU"):
            get_accelerator({"ZEROSPEED_ACCELERATOR": "cuda"})


def test_parallel_dims_layout() -> None:
    dims = ParallelDims(world_size=8, tp=2, pp=2)
    assert dims.dp == 2 and dims.shape == (2, 2, 1, 2)  # (pp, dp, sp, tp)
    assert dims.rank_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.rank_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.rank_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.coords(6) == {"pp": 1, "dp": 1, "sp": 0, "tp": 0}
    assert ParallelDims(world_size=3).rank_groups("dp") == [[0, 1, 2]]


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=6, tp=4), r"world size 6 is not divisible by tp\*pp = 4\*1 = 4"),
    (dict(world_size=8, dp=3, tp=2), r"dp\*tp\*pp = 3\*2\*1 = 6 but the world size is 8; set dp=-1 to infer it \(would be 4\)"),
    (dict(world_size=4, ep=3), "ep=3 must divide dp=4"),
    (dict(world_size=0), r"ParallelDims.world_size=0 must be an integer >= 1"),
])
def test_parallel_dims_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


def _mesh_groups() -> dict:
    dims = ParallelDims(world_size=4, tp=2)
    mesh = dims.build()
    dp, tp = mesh.dp, mesh.comm("tp")
    value = torch.tensor([float(dist.get_rank())])
    dp.all_reduce(value)
    tp_value = torch.tensor([float(dist.get_rank())])
    tp.all_reduce(tp_value)
    return {"dp_ranks": list(dp.global_ranks), "tp_ranks": list(tp.global_ranks),
            "dp_sum": value.item(), "tp_sum": tp_value.item(), "pp_size": mesh.comm("pp").world_size}


def test_mesh_groups_match_the_pure_layout() -> None:
    results = run_distributed(_mesh_groups, 4)
    dims = ParallelDims(world_size=4, tp=2)
    for rank, got in enumerate(results):
        dp_group = next(g for g in dims.rank_groups("dp") if rank in g)
        tp_group = next(g for g in dims.rank_groups("tp") if rank in g)
        assert got["dp_ranks"] == dp_group and got["tp_ranks"] == tp_group
        assert got["dp_sum"] == sum(dp_group) and got["tp_sum"] == sum(tp_group)
        assert got["pp_size"] == 1


def _init_twice() -> tuple:
    import zerospeed

    group = dist.group.WORLD
    info = zerospeed.init_distributed()  # already up (the harness started it): a no-op
    return info.rank, info.world_size, dist.group.WORLD is group, Comm().name


def test_init_distributed_is_idempotent_and_comm_defaults_to_world() -> None:
    assert run_distributed(_init_twice, 2) == [(0, 2, True, "world"), (1, 2, True, "world")]


def _init_with_misleading_environment() -> tuple:
    import os

    import zerospeed

    os.environ.update(RANK="0", WORLD_SIZE="1")  # a framework's launcher may not set them (Lightning's does not)
    info = zerospeed.init_distributed()
    return info.rank, info.world_size


def test_a_running_group_is_the_truth_for_rank_and_size() -> None:
    assert run_distributed(_init_with_misleading_environment, 2) == [(0, 2), (1, 2)]


def test_init_distributed_single_process_without_launcher(tmp_path) -> None:
    import os
    import subprocess
    import sys

    code = (
        "import zerospeed, torch, torch.distributed as dist\n"
        "info = zerospeed.init_distributed()\n"
        "t = torch.ones(3); zerospeed.Comm().all_reduce(t)\n"
        "print(info.source, info.world_size, dist.get_backend(), t.tolist())\n"
    )
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "single 1 gloo [1.0, 1.0, 1.0]"


@pytest.mark.parametrize("kwargs", [dict(world_size=2, dp=2.0), dict(world_size=2, tp=True)])
def test_parallel_dims_rejects_non_integers(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=r"must be an integer >= 1"):
        ParallelDims(**kwargs)


def _groups_released_while_mesh_lives() -> list[bool]:
    import gc
    import weakref

    from zerospeed.distributed import shutdown_distributed

    mesh = ParallelDims(world_size=2).build()
    refs = [weakref.ref(comm.group) for comm in mesh.comms.values()] + [weakref.ref(dist.group.WORLD)]
    shutdown_distributed()
    gc.collect()
    alive = [ref() is not None for ref in refs]
    del mesh
    return alive


def test_a_lingering_mesh_does_not_keep_destroyed_groups_alive() -> None:
    # Groups kept alive until interpreter teardown abort gloo processes at exit.
    from zerospeed.distributed.mesh import AXES

    assert run_distributed(_groups_released_while_mesh_lives, 2) == [[False] * (len(AXES) + 1)] * 2
