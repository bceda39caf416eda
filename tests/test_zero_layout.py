"""ZeRO unit layout and the stage-3 trace: pure values, no processes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerospeed.zero.external import external_parameters, register_external_parameter, unregister_external_parameter
from zerospeed.zero.layout import PERSISTENT, build_units, module_users
from zerospeed.zero.params import _Trace
from zerospeed.zero.sharded_grads import GradSharding


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(10, 10)  # 100 + 10
        self.norm = nn.LayerNorm(10)  # 10 + 10


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 10)  # 300
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.scale = nn.Parameter(torch.ones(3))
        self.head = nn.Linear(10, 30, bias=False)
        self.head.weight = self.emb.weight  # tied: belongs to emb's unit


def test_units_follow_blocks_and_top_level_children() -> None:
    units = build_units(Model(), bucket_elems=10**9)
    assert [(u.name, u.param_names, u.module_path) for u in units] == [  # named_parameters() order
        ("<root>", ("scale",), ""),
        ("emb", ("emb.weight",), None),  # not a block: the modules holding its parameters gather it
        ("blocks.0", ("blocks.0.fc.weight", "blocks.0.fc.bias", "blocks.0.norm.weight", "blocks.0.norm.bias"),
         "blocks.0"),
        ("blocks.1", ("blocks.1.fc.weight", "blocks.1.fc.bias", "blocks.1.norm.weight", "blocks.1.norm.bias"),
         "blocks.1"),
    ]
    assert [u.numel for u in units] == [3, 300, 130, 130]


def test_a_unit_larger_than_the_bucket_is_cut_at_parameter_boundaries() -> None:
    units = build_units(Model(), bucket_elems=105)
    block0 = [u for u in units if u.name.startswith("blocks.0")]
    assert [(u.name, u.param_names) for u in block0] == [
        ("blocks.0[0]", ("blocks.0.fc.weight", "blocks.0.fc.bias")),
        ("blocks.0[1]", ("blocks.0.norm.weight", "blocks.0.norm.bias")),
    ]
    assert all(u.module_path == "blocks.0" for u in block0)


def test_small_parameters_become_one_persistent_unit() -> None:
    units = build_units(Model(), bucket_elems=10**9, persistence_threshold=11)
    persistent = units[-1]
    assert persistent.name == PERSISTENT and persistent.persistent
    assert persistent.param_names == ("scale", "blocks.0.fc.bias", "blocks.0.norm.weight", "blocks.0.norm.bias",
                                      "blocks.1.fc.bias", "blocks.1.norm.weight", "blocks.1.norm.bias")
    assert [u.name for u in units[:-1]] == ["emb", "blocks.0", "blocks.1"]


class Container(nn.Module):
    """nanoGPT's layout: a ModuleDict whose own forward never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(30, 10), h=nn.ModuleList(Block() for _ in range(2)),
                                              ln_f=nn.LayerNorm(10)))


def test_a_container_that_is_never_called_is_gathered_by_the_modules_holding_its_parameters() -> None:
    model = Container()
    units = build_units(model, bucket_elems=10**9)
    assert [(u.name, u.module_path) for u in units] == [
        ("transformer", None), ("transformer.h.0", "transformer.h.0"), ("transformer.h.1", "transformer.h.1")]
    users = module_users(model, units)
    assert users == {"transformer.h.0": [1], "transformer.h.1": [2], "transformer.wte": [0],
                     "transformer.ln_f": [0]}


def test_tied_and_external_parameters_are_gathered_by_their_users() -> None:
    model = Model()
    units = build_units(model, bucket_elems=10**9)
    users = module_users(model, units)
    assert users["emb"] == [1] and users["head"] == [1]  # head holds emb.weight under its own name
    assert users["blocks.0"] == [2] and users[""] == [0]
    register_external_parameter(model.blocks[1], model.emb.weight)
    register_external_parameter(model.blocks[1], model.emb.weight)  # twice is once
    assert module_users(model, units, external_parameters(model))["blocks.1"] == [3, 1]
    unregister_external_parameter(model.blocks[1], model.emb.weight)
    assert module_users(model, units, external_parameters(model))["blocks.1"] == [3]
    with pytest.raises(ValueError, match="was not registered as external"):
        unregister_external_parameter(model.blocks[1], model.emb.weight)
    with pytest.raises(TypeError, match="expects an nn.Parameter"):
        register_external_parameter(model.blocks[1], torch.ones(2))


def test_trace_runs_forward_then_backward_and_measures_reuse_distance() -> None:
    trace = _Trace([0, 1, 2, 0], numel=[10, 20, 30])
    assert trace.seq == [0, 1, 2, 0, 0, 2, 1, 0]
    # unit 1 at position 1 is next used at position 6: units 2, 0, 0, 2 are gathered in between
    assert trace.reuse_distance(1) == 30 + 10 + 10 + 30
    assert trace.reuse_distance(3) == 0  # the last forward unit is the first backward one
    assert trace.reuse_distance(7) is None
    assert trace.find(0, after=0) == 3 and trace.find(1, after=1) == 6 and trace.find(1, after=6) is None


def test_grad_sharding_is_chosen_by_stage() -> None:
    assert GradSharding.for_stage(1).keep_full and not GradSharding.for_stage(2).keep_full
    assert not GradSharding.for_stage(3).keep_full
    with pytest.raises(ValueError, match="stages 1-3, got stage 0"):
        GradSharding.for_stage(0)


def test_buffer_pool_reuses_same_size_buffers_and_keeps_a_few() -> None:
    from zerospeed.zero.sharded_grads import _BufferPool

    pool = _BufferPool(keep=2)
    a = pool.take(10, torch.float32, torch.device("cpu"))
    pool.give(a)
    assert pool.take(10, torch.float32, torch.device("cpu")) is a  # same size and dtype: reused
    assert pool.take(10, torch.float32, torch.device("cpu")) is not a
    for _ in range(4):
        pool.give(torch.empty(10))
    assert len(pool.free) == 2  # the oldest beyond ``keep`` are dropped
    assert pool.take(10, torch.bfloat16, torch.device("cpu")).dtype == torch.bfloat16
