"""``import zerospeed.comm as dist``: a script written for DeepSpeed's comm calls runs on 2 real ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import zerospeed
from zerospeed.testing import free_port
from zerospeed.comm import api

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve().parent / "comm_scripts" / "deepspeed_calls.py"


@pytest.mark.timeout(150)
def test_a_deepspeed_comm_script_runs_on_two_ranks(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    env["ZS_TEST_OUT"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-m", "zerospeed", "--num_procs", "2", "--master_port", str(free_port()),
                           str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    got = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, out in enumerate(got):
        assert out == {
            "initialized": True, "rank": rank, "world": 2, "local_rank": rank,
            "all_reduce": [3.0, 30.0], "all_reduce_max": 1.0, "all_reduce_avg_async": 0.5,
            "broadcast": [6.0, 6.0, 6.0],
            "all_gather_into_tensor": [0.0, 0.5, 1.0, 1.5],
            # ranks' inputs [0,1,2,3]*1 and [0,1,2,3]*2 sum to [0,3,6,9]; rank r keeps part r
            "reduce_scatter_tensor": [[0.0, 3.0], [6.0, 9.0]][rank],
            "new_group_sum": 3.0, "new_group_size": 2,
            "outside_group": [[1.0, True, 0], [2.0, True, -1]][rank],
            "after_destroy": False,
        }, rank


def test_signatures_follow_deepspeed() -> None:
    import inspect

    params = inspect.signature(api.init_distributed).parameters
    assert list(params) == ["dist_backend", "auto_mpi_discovery", "distributed_port", "verbose", "timeout",
                            "init_method", "dist_init_required", "config", "rank", "world_size"]
    assert (params["distributed_port"].default, params["verbose"].default, params["rank"].default,
            params["world_size"].default) == (29500, True, -1, -1)
    assert list(inspect.signature(api.reduce_scatter_tensor).parameters)[:5] == [
        "output_tensor", "tensor", "op", "group", "async_op"]
    assert list(inspect.signature(api.broadcast).parameters) == ["tensor", "src", "group", "async_op"]
    assert zerospeed.comm is sys.modules["zerospeed.comm"]
    assert set(api.__all__) <= set(dir(zerospeed.comm))
