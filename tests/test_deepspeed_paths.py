"""The DeepSpeed-only helpers zerospeed provides at DeepSpeed's paths: ``moe.utils`` parameter groups,
``utils.zero_to_fp32``, ``utils.logging.log_dist``, ``runtime.utils``, ``checkpoint.utils``."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.checkpoint.utils import clone_tensors_for_torch_save
from zerospeed.moe.utils import (
    has_moe_layers,
    is_moe_param,
    split_params_grads_into_shared_and_expert_params,
    split_params_into_different_moe_groups_for_optimizer,
    split_params_into_shared_and_expert_params,
)
from zerospeed.runtime.utils import move_to_device, see_memory_usage, set_random_seed
from zerospeed.testing import run_distributed
from zerospeed.testing.logs import log_messages
from zerospeed.utils import zero_to_fp32
from zerospeed.utils.logging import log_dist, set_log_level_from_string


def _expert(shape: tuple[int, ...], group: str) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(shape))
    p.allreduce = False  # type: ignore[attr-defined]  # DeepSpeed's mark of an expert parameter
    p.group_name = group  # type: ignore[attr-defined]
    return p


# -- moe.utils ------------------------------------------------------------------------------------------
def test_moe_params_are_marked_as_in_deepspeed() -> None:
    shared, e1 = nn.Parameter(torch.zeros(2)), _expert((3,), "ep_size_2")
    plain_true = nn.Parameter(torch.zeros(1))
    plain_true.allreduce = True  # type: ignore[attr-defined]
    assert [is_moe_param(p) for p in (shared, e1, plain_true)] == [False, True, False]
    assert split_params_into_shared_and_expert_params([e1, shared, plain_true]) == ([shared, plain_true], [e1])
    shared.grad, e1.grad = torch.ones(2), torch.full((3,), 2.0)
    grads_shared, grads_expert = split_params_grads_into_shared_and_expert_params([shared, e1, plain_true])
    assert [g.tolist() for g in grads_shared] == [[1.0, 1.0]]  # plain_true has no gradient: left out
    assert [g.tolist() for g in grads_expert] == [[2.0, 2.0, 2.0]]


def test_split_groups_moves_experts_into_named_groups_keeping_options() -> None:
    shared1, shared2 = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4))
    a1, a2, b1 = _expert((5,), "ep_a"), _expert((6,), "ep_a"), _expert((7,), "ep_b")
    groups = [{"params": iter([shared1, a1, b1]), "name": "decay", "weight_decay": 0.1},
              {"params": [a2, shared2], "name": "no_decay", "weight_decay": 0.0}]
    out = split_params_into_different_moe_groups_for_optimizer(groups, max_group_size=None)
    summary = [(g["name"], g.get("moe", False), g["weight_decay"], [id(p) for p in g["params"]]) for g in out]
    assert summary == [
        ("decay", False, 0.1, [id(shared1)]), ("no_decay", False, 0.0, [id(shared2)]),
        ("ep_a", True, 0.1, [id(a1)]), ("ep_b", True, 0.1, [id(b1)]),
        ("ep_a", True, 0.0, [id(a2)]), ("ep_b", True, 0.0, []),  # DeepSpeed keeps every pair without a size limit
    ]
    assert groups[0]["params"] == [shared1]  # updated in place, as DeepSpeed does
    # a dict alone, split into runs of at most max_group_size elements (an empty expert run adds no group)
    experts = [_expert((4,), "ep_a") for _ in range(5)]
    single = split_params_into_different_moe_groups_for_optimizer({"params": experts, "name": "all"}, max_group_size=8)
    assert [len(g["params"]) for g in single] == [0, 2, 2, 1] and all(g["moe"] for g in single[1:])
    # without experts the groups pass through (a name is then not needed); a bad type is refused
    plain = split_params_into_different_moe_groups_for_optimizer({"params": [shared1]})
    assert plain == [{"params": [shared1]}]
    with pytest.raises(ValueError, match="have no \"name\""):
        split_params_into_different_moe_groups_for_optimizer({"params": [a1]})
    with pytest.raises(ValueError, match="must be a dict or a list/tuple"):
        split_params_into_different_moe_groups_for_optimizer("params")  # type: ignore[arg-type]


def test_has_moe_layers() -> None:
    class Experts(nn.Module):
        num_experts = 4

        def __init__(self) -> None:
            super().__init__()
            self.w = _expert((2,), "ep")

    assert has_moe_layers(nn.Sequential(nn.Linear(2, 2), Experts())) == (True, 4)
    assert has_moe_layers(nn.Linear(2, 2)) == (False, 0)


# -- utils.logging, runtime.utils, checkpoint.utils --------------------------------------------------------
def test_log_dist_before_init_logs_everywhere() -> None:
    with log_messages() as messages:
        log_dist("hello", ranks=[0])
        log_dist("also", ranks=None)
    assert messages == ["[Rank -1] hello", "[Rank -1] also"]


def _log_dist_on_ranks() -> list[str]:
    with log_messages() as messages:
        log_dist("only zero", ranks=[0])
        log_dist("everyone", ranks=[-1])
        log_dist("nobody", ranks=None)
    return messages


def test_log_dist_filters_by_rank() -> None:
    assert run_distributed(_log_dist_on_ranks, 2) == [["[Rank 0] only zero", "[Rank 0] everyone"],
                                                      ["[Rank 1] everyone"]]


def test_set_log_level_from_string() -> None:
    logger = logging.getLogger("zerospeed-test-level")
    set_log_level_from_string("warning", custom_logger=logger)
    assert logger.level == logging.WARNING
    with pytest.raises(ValueError, match="'loud' is not one of"):
        set_log_level_from_string("loud")


def test_runtime_utils() -> None:
    batch = {"x": torch.ones(2), "pair": (torch.zeros(1), 3), "list": [torch.ones(1, dtype=torch.int64)]}
    moved = move_to_device(batch, "meta", criterion_func=lambda t: t.is_floating_point())
    assert moved["x"].is_meta and moved["pair"][0].is_meta and moved["pair"][1] == 3
    assert not moved["list"][0].is_meta  # the criterion refused it
    set_random_seed(7)
    first = (torch.rand(3), __import__("random").random(), __import__("numpy").random.rand())
    set_random_seed(7)
    assert torch.equal(first[0], torch.rand(3)) and first[1] == __import__("random").random()
    with log_messages() as messages:
        see_memory_usage("quiet")
        see_memory_usage("after init", force=True)
    assert len(messages) == 1 and messages[0].startswith("after init | host used ")


def test_clone_tensors_for_torch_save_drops_the_shared_storage() -> None:
    big = torch.arange(1000.0)
    state = {"view": big[:3], "nested": [big[5:7], "text"], "n": 1}
    cloned = clone_tensors_for_torch_save(state)
    assert torch.equal(cloned["view"], big[:3]) and cloned["nested"][1] == "text" and cloned["n"] == 1
    assert cloned["view"].untyped_storage().nbytes() == 12  # 3 floats, not the 1000 of the view's base
    assert cloned["view"].data_ptr() != big.data_ptr()


# -- utils.zero_to_fp32 ----------------------------------------------------------------------------------
def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _train_and_save(ckpt_dir: str) -> dict[str, list[float]]:
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.05}}, "zero_optimization": {"stage": 3}}
    engine, *_ = zerospeed.initialize(model=_net(), config=config)
    for step in range(2):
        x = torch.randn(2, 6, generator=torch.Generator().manual_seed(step + 10 * engine.comm.rank))
        engine.backward(engine(x.bfloat16()).float().square().mean())
        engine.step()
    engine.save_checkpoint(ckpt_dir)
    return {name: zerospeed.utils.safe_get_full_fp32_param(p).reshape(-1).tolist()
            for name, p in engine.module.named_parameters()}


@pytest.fixture(scope="module")
def stage3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("z2f")
    masters = run_distributed(_train_and_save, 2, str(root / "ckpt"))[0]
    return root / "ckpt", {name: torch.tensor(values) for name, values in masters.items()}


def test_get_fp32_state_dict_from_zero_checkpoint(stage3_checkpoint: tuple[Path, dict[str, torch.Tensor]]) -> None:
    ckpt, masters = stage3_checkpoint
    state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(ckpt), lazy_mode=True)
    assert sorted(state) == sorted(masters)
    for name, value in masters.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name].contiguous().reshape(-1), value)
    with pytest.raises(NotImplementedError, match="exclude_frozen_parameters=True"):
        zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(ckpt), exclude_frozen_parameters=True)


def test_load_state_dict_from_zero_checkpoint(stage3_checkpoint: tuple[Path, dict[str, torch.Tensor]]) -> None:
    ckpt, masters = stage3_checkpoint
    model = zero_to_fp32.load_state_dict_from_zero_checkpoint(nn.Sequential(nn.Linear(6, 8), nn.Tanh(),
                                                                            nn.Linear(8, 3)), str(ckpt))
    for name, p in model.named_parameters():
        assert torch.equal(p.detach().reshape(-1), masters[name])
    bigger = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3), nn.Linear(3, 1))
    with log_messages(logging.WARNING) as messages:
        zero_to_fp32.load_state_dict_from_zero_checkpoint(bigger, str(ckpt))
    assert torch.equal(bigger[0].weight.detach().reshape(-1), masters["0.weight"])
    assert len(messages) == 1 and "missing ['3.bias', '3.weight']" in messages[0]


@pytest.mark.parametrize("shard", ["5GB", "200B"])
def test_convert_zero_checkpoint_to_pytorch_model_bin(stage3_checkpoint: tuple[Path, dict[str, torch.Tensor]],
                                                      tmp_path: Path, shard: str) -> None:
    ckpt, masters = stage3_checkpoint
    assert zero_to_fp32.main([str(ckpt), str(tmp_path / "out"), "--max_shard_size", shard]) == 0
    out = tmp_path / "out"
    if shard == "5GB":
        assert sorted(os.listdir(out)) == ["pytorch_model.bin"]
        state = torch.load(out / "pytorch_model.bin", weights_only=True)
    else:
        index = json.loads((out / "pytorch_model.bin.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) > 1 and files[0] == f"pytorch_model-00001-of-{len(files):05d}.bin"
        assert index["metadata"]["total_size"] == sum(4 * v.numel() for v in masters.values())
        state = {}
        for name in files:
            state.update(torch.load(out / name, weights_only=True))
    assert {k: v.reshape(-1).tolist() for k, v in state.items()} == {k: v.tolist() for k, v in masters.items()}


def test_convert_zero_checkpoint_to_safetensors(stage3_checkpoint: tuple[Path, dict[str, torch.Tensor]],
                                                tmp_path: Path) -> None:
    from safetensors.torch import load_file

    ckpt, masters = stage3_checkpoint
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(str(ckpt), str(tmp_path), safe_serialization=True)
    state = load_file(str(tmp_path / "model.safetensors"))
    assert {k: v.reshape(-1).tolist() for k, v in state.items()} == {k: v.tolist() for k, v in masters.items()}
    assert zero_to_fp32.main([str(tmp_path / "missing"), str(tmp_path / "o")]) == 2
