"""zerospeed.pipe's partition, topology and PipelineModule: pure plans and single-process stage builds.

Expected partitions were computed once with DeepSpeed 0.19.8 (``deepspeed.runtime.utils``) and are
pinned here, so the tests need no DeepSpeed.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch import nn

from zerospeed.distributed.mesh import ParallelDims
from zerospeed.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec, describe_layers
from zerospeed.pipe.partition import (CheckpointBlock, LayerInfo, PartitionMethod, partition_balanced,
                                      partition_uniform, plan_stages)
from zerospeed.pipe.topology import (PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology,
                                     dims_to_topology, topology_to_dims)

# -- partition arithmetic (DeepSpeed 0.19.8's outputs) ------------------------------------------------
UNIFORM = [(0, 1, [0, 0]), (3, 4, [0, 1, 2, 3, 3]), (4, 4, [0, 1, 2, 3, 4]), (5, 2, [0, 3, 5]),
           (7, 3, [0, 3, 5, 7]), (10, 4, [0, 3, 6, 8, 10]), (11, 4, [0, 3, 6, 9, 11]),
           (13, 5, [0, 3, 6, 9, 11, 13]), (1, 1, [0, 1]), (100, 7, [0, 15, 30, 44, 58, 72, 86, 100])]

BALANCED = [
    ([1, 1, 1, 1], 2, [0, 2, 4]), ([5, 1, 1, 1, 1, 5], 3, [0, 1, 5, 6]), ([0, 10, 10, 10, 10, 0], 2, [0, 3, 6]),
    ([0, 10, 10, 10, 10, 0], 4, [0, 2, 3, 4, 6]), ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], 3, [0, 5, 8, 11]),
    ([1], 3, [0, 1, 1, 1]), ([2, 2], 2, [0, 1, 2]), ([0, 0, 0, 0], 2, [0, 3, 4]),
    ([100, 1, 1, 1, 1, 1, 1, 100], 3, [0, 1, 7, 8]), ([0, 1, 1, 1, 1, 1, 1, 0], 4, [0, 3, 5, 6, 8]),
    ([1, 0, 1, 0, 1, 0, 1], 2, [0, 4, 7]),
    ([48, 26, 2, 16, 32, 31, 25, 50, 19, 30, 22, 37, 13, 32], 4, [0, 4, 7, 10, 14]), ([8, 48, 6], 3, [0, 1, 2, 3]),
    ([34, 45, 38, 9, 19, 6, 46, 4, 43, 21], 3, [0, 2, 6, 10]), ([6, 22, 27, 20, 39, 40, 13, 35], 5, [0, 2, 4, 5, 6, 8]),
    ([33, 16, 3, 35, 0, 5, 46, 25], 4, [0, 2, 6, 7, 8]),
    ([40, 0, 39, 31, 21, 15, 46, 20, 45, 4, 12, 36], 6, [0, 2, 3, 5, 7, 9, 12]), ([9, 34, 28, 5], 2, [0, 2, 4]),
    ([32, 31], 3, [0, 1, 2, 2]), ([35, 18], 3, [0, 1, 2, 2]),
    ([35, 21, 34, 13, 38, 35, 37, 18, 28, 5, 38, 24], 1, [0, 12]), ([15, 18, 11, 12, 11, 2], 5, [0, 1, 2, 3, 4, 6]),
    ([16, 30, 4, 5, 43, 48, 8, 9, 2, 5], 6, [0, 1, 2, 4, 5, 6, 10]),
]


@pytest.mark.parametrize(("items", "parts", "expected"), UNIFORM)
def test_partition_uniform_matches_deepspeed(items: int, parts: int, expected: list[int]) -> None:
    assert partition_uniform(items, parts) == expected


@pytest.mark.parametrize(("weights", "parts", "expected"), BALANCED)
def test_partition_balanced_matches_deepspeed(weights: list[int], parts: int, expected: list[int]) -> None:
    assert partition_balanced(weights, parts) == expected


def test_partition_method_parsing_and_refusals() -> None:
    assert PartitionMethod.parse("Parameters") == PartitionMethod("parameters")
    assert PartitionMethod.parse("uniform") == PartitionMethod("uniform")
    assert PartitionMethod.parse("type:Block|Embed") == PartitionMethod("type", "block|embed")
    with pytest.raises(ValueError, match="did you mean 'parameters'"):
        PartitionMethod.parse("paramters")
    with pytest.raises(ValueError, match="no regex after 'type:'"):
        PartitionMethod.parse("type:")
    with pytest.raises(ValueError, match="not a valid regex"):
        PartitionMethod.parse("type:(")
    with pytest.raises(NotImplementedError, match="'profile' is not implemented"):
        PartitionMethod.parse("profile")


# -- a small GPT-like model -----------------------------------------------------------------------
V, H, N_BLOCKS, BASE_SEED = 16, 8, 4, 1234


class Embed(nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids)


class Block(nn.Module):
    def __init__(self, hidden: int, log: list[tuple[int, str]] | None = None, index: int = -1) -> None:
        super().__init__()
        if log is not None:  # where this constructor ran: "meta" for counting, "cpu" for real
            log.append((index, torch.empty(0).device.type))
        self.ln = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.fc(self.ln(x))))


class Norm(nn.LayerNorm):
    pass


def head(embed: nn.Module, x: torch.Tensor) -> torch.Tensor:
    assert isinstance(embed, Embed)
    return x @ embed.emb.weight.t()


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def gpt_layers(log: list[tuple[int, str]] | None = None) -> list[Any]:
    """embed(128 params), 4 blocks (88 each), norm (16), a function (0), tied head (128)."""
    return ([TiedLayerSpec("embed", Embed, V, H, tied_weight_attr="emb.weight")]
            + [LayerSpec(Block, H, log, 1 + i) for i in range(N_BLOCKS)]
            + [LayerSpec(Norm, H), identity,
               TiedLayerSpec("embed", Embed, V, H, forward_fn=head, tied_weight_attr=["emb.weight"])])


def reference_model() -> tuple[list[nn.Module], Embed]:
    """The same layers built in one process with DeepSpeed's per-layer seeds."""
    torch.manual_seed(BASE_SEED + 0)
    embed = Embed(V, H)
    modules: list[nn.Module] = []
    for i in range(N_BLOCKS):
        torch.manual_seed(BASE_SEED + 1 + i)
        modules.append(Block(H))
    torch.manual_seed(BASE_SEED + 5)
    modules.append(Norm(H))
    return modules, embed


def reference_forward(modules: list[nn.Module], embed: Embed, ids: torch.Tensor) -> torch.Tensor:
    x = embed(ids)
    for m in modules:
        x = m(x)
    return head(embed, x)


def test_layer_descriptions_count_on_meta_without_touching_the_rng() -> None:
    log: list[tuple[int, str]] = []
    state = torch.random.get_rng_state()
    infos = describe_layers(gpt_layers(log), count_params=True)
    assert torch.equal(state, torch.random.get_rng_state())
    assert [i.trainable_params for i in infos] == [128, 88, 88, 88, 88, 16, 0, 128]
    assert [i.class_name for i in infos] == ["Embed"] + ["Block"] * 4 + ["Norm", "function", "Embed"]
    assert infos[6] == LayerInfo("function", "identity", None, 0, False)
    assert [i.tied_key for i in infos] == ["embed"] + [None] * 6 + ["embed"]
    assert log == [(1, "meta"), (2, "meta"), (3, "meta"), (4, "meta")]


@pytest.mark.parametrize(("method", "stages", "parts"), [
    ("parameters", 2, (0, 3, 8)), ("parameters", 3, (0, 2, 4, 8)), ("parameters", 4, (0, 1, 3, 5, 8)),
    ("uniform", 2, (0, 4, 8)), ("uniform", 4, (0, 2, 4, 6, 8)),
    ("type:block", 2, (0, 3, 8)), ("type:BLOCK", 4, (0, 2, 3, 4, 8)),
])
def test_stage_plan_boundaries(method: str, stages: int, parts: tuple[int, ...]) -> None:
    plan = plan_stages(describe_layers(gpt_layers(), count_params=True), stages, method)
    assert plan.parts == parts
    assert plan.tied == (("embed", (0, 7)),)
    assert plan.tied_stages("embed") == sorted({0, stages - 1})
    assert [list(plan.stage_layers(s)) for s in range(stages)] == [list(range(parts[s], parts[s + 1]))
                                                                    for s in range(stages)]
    assert plan.stage_owner(7) == stages - 1
    assert plan.stage_tied_keys(0) == ["embed"]


def test_stage_plan_checkpoint_blocks() -> None:
    infos = describe_layers(gpt_layers(), count_params=True)
    plan = plan_stages(infos, 2, "uniform", activation_checkpoint_interval=3)
    assert plan.blocks == ((CheckpointBlock(0, 3, True), CheckpointBlock(3, 4, True)),
                           (CheckpointBlock(4, 7, True), CheckpointBlock(7, 8, True)))
    plan = plan_stages(infos, 1, "uniform", activation_checkpoint_interval=2, checkpointable_layers=["Block"])
    assert [(b.start, b.stop, b.recompute) for b in plan.blocks[0]] == [
        (0, 2, False), (2, 4, True), (4, 6, False), (6, 8, False)]
    functions = [LayerInfo("function", "f", None, 0, False)] * 3
    assert plan_stages(functions, 1, "uniform", activation_checkpoint_interval=2).blocks == (
        (CheckpointBlock(0, 2, False), CheckpointBlock(2, 3, False)),)
    assert plan_stages(infos, 2, "uniform").blocks == ((CheckpointBlock(0, 4, False),),
                                                       (CheckpointBlock(4, 8, False),))


def test_stage_plan_refusals() -> None:
    infos = describe_layers(gpt_layers(), count_params=True)
    with pytest.raises(ValueError, match="8 layers cannot fill 9 pipeline stages.*num_stages <= 8"):
        plan_stages(infos, 9, "uniform")
    with pytest.raises(ValueError, match="matches no layer class; the classes are"):
        plan_stages(infos, 2, "type:attention")
    with pytest.raises(ValueError, match="unknown partition_method"):
        plan_stages(infos, 2, "balanced")
    with pytest.raises(KeyError, match="known keys: \\['embed'\\]"):
        plan_stages(infos, 2).tied_stages("lm_head")


# -- PipelineModule built stage by stage, no processes --------------------------------------------
def build_stages(stages: int, **kwargs: Any) -> list[PipelineModule]:
    return [PipelineModule(gpt_layers(), num_stages=stages, seed_layers=True, base_seed=BASE_SEED,
                           stage_id=s, **kwargs) for s in range(stages)]


def test_only_owned_layers_are_built() -> None:
    log: list[tuple[int, str]] = []
    module = PipelineModule(gpt_layers(log), num_stages=2, partition_method="parameters", stage_id=1)
    assert [(i, d) for i, d in log if d != "meta"] == [(3, "cpu"), (4, "cpu")]
    assert module.local_layers() == list(range(3, 8))
    log.clear()
    PipelineModule(gpt_layers(log), num_stages=4, partition_method="uniform", stage_id=0)
    assert log == [(1, "cpu")]  # uniform needs no counting: stage 0 of 4 builds layers 0-1 only


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_parameter_names_are_global(stages: int) -> None:
    names: list[str] = []
    for module in build_stages(stages):
        names += [n for n, _ in module.named_parameters()]
    blocks = [f"{i}.{p}" for i in range(1, 5) for p in ("ln.weight", "ln.bias", "fc.weight", "fc.bias")]
    expected = ["tied_modules.embed.emb.weight"] * (2 if stages > 1 else 1) + blocks + ["5.weight", "5.bias"]
    assert sorted(names) == sorted(expected)


@pytest.mark.parametrize("stages", [2, 4])
def test_stages_chained_equal_the_plain_model(stages: int) -> None:
    modules, embed = reference_model()
    ids = torch.randint(0, V, (3, 5))
    torch.manual_seed(0)
    for m in modules:
        m.eval()
    expected = reference_forward(modules, embed, ids)
    expected.square().mean().backward()

    pipe = build_stages(stages)
    x: Any = ids
    inputs, outputs = [], []
    for module in pipe:  # forward stage by stage, each stage's input a leaf as if received
        module.eval()
        if x.is_floating_point():
            x = x.detach().requires_grad_(True)
        inputs.append(x)
        x = module(x)
        outputs.append(x)
    assert torch.equal(x, expected)
    grad = torch.autograd.grad(x.square().mean(), x)[0]
    for inp, out in reversed(list(zip(inputs, outputs, strict=True))):  # backward stage by stage
        out.backward(grad)
        grad = inp.grad

    ref_grads = {f"{1 + i}.{n}": p.grad for i, m in enumerate(modules) for n, p in m.named_parameters()}
    for module in pipe:
        for name, p in module.named_parameters():
            if not name.startswith("tied_modules"):
                assert torch.equal(p.grad, ref_grads[name]), name
    # tied: each stage holds a partial gradient; their sum over tied_stages is the model's gradient
    holders = [pipe[s] for s in pipe[0].tied_stages("embed")]
    assert [m.stage_id for m in holders] == [0, stages - 1]
    summed = sum(m.tied_weights()[0][2].grad for m in holders)
    assert torch.allclose(summed, embed.emb.weight.grad, atol=1e-6)
    assert all(torch.equal(m.tied_modules["embed"].emb.weight, embed.emb.weight) for m in holders)


@pytest.mark.parametrize("stages", [2, 4])
def test_checkpoint_written_at_one_degree_loads_at_another(stages: int) -> None:
    merged: dict[str, torch.Tensor] = {}
    for module in build_stages(stages):
        merged.update(module.state_dict())
    torch.manual_seed(99)
    whole = PipelineModule(gpt_layers(), num_stages=1)  # unseeded: different weights
    assert not torch.equal(whole.state_dict()["1.fc.weight"], merged["1.fc.weight"])
    whole.load_state_dict(merged, strict=True)
    reference = build_stages(1)[0]
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in whole.state_dict().items())


def test_seed_layers_seeds_construction_and_forward() -> None:
    seeds: list[int] = []

    def seed_fn(seed: int) -> None:
        seeds.append(seed)
        torch.manual_seed(seed)

    module = PipelineModule(gpt_layers(), num_stages=2, seed_layers=True, seed_fn=seed_fn, base_seed=10,
                            stage_id=1, partition_method="uniform")
    assert seeds == [14, 15, 16, 17, 10]  # layers 4-7, then the tied head seeded like layer 0
    seeds.clear()
    x = torch.randn(2, H)
    module(x)
    module(x)
    assert seeds == [10 * 2 + i for i in range(4, 8)] + [10 * 3 + i for i in range(4, 8)]
    assert not PipelineModule(gpt_layers(), num_stages=2, stage_id=0, seed_fn=seed_fn).seed_layers


def test_activation_checkpointing_matches_plain_forward_and_gradients() -> None:
    ids = torch.randint(0, V, (2, 6))

    def run(module: PipelineModule) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out = module(ids)
        out.square().mean().backward()
        return out, {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}

    plain_out, plain_grads = run(build_stages(1)[0])
    calls: list[int] = []

    def counting_checkpoint(fn: Any, *args: Any) -> Any:
        calls.append(len(args))
        from zerospeed.checkpointing import checkpoint
        return checkpoint(fn, *args)

    for kwargs, expected_calls in [({}, None), ({"activation_checkpoint_func": counting_checkpoint}, 4),
                                   ({"activation_checkpoint_func": counting_checkpoint,
                                     "checkpointable_layers": ["Block"]}, 1)]:
        calls.clear()
        module = build_stages(1, activation_checkpoint_interval=2, **kwargs)[0]
        out, grads = run(module)  # dropout is on: seed_layers reseeds it identically in the recompute
        assert torch.equal(out, plain_out)
        assert grads.keys() == plain_grads.keys()
        for name, g in grads.items():
            assert torch.allclose(g, plain_grads[name], atol=1e-6), name
        if expected_calls is not None:
            assert len(calls) == expected_calls


def test_set_checkpoint_interval_replans() -> None:
    module = build_stages(2, partition_method="uniform")[1]
    module.set_checkpoint_interval(3)
    assert module.activation_checkpoint_interval == 3
    assert module.plan.blocks[1] == (CheckpointBlock(4, 7, True), CheckpointBlock(7, 8, True))
    assert module.partitions() == [0, 4, 8]


def test_plain_modules_and_callables_as_layers() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), lambda x: x * 2, nn.ReLU(), nn.Linear(4, 2)]
    first = PipelineModule(layers, num_stages=2, stage_id=0, partition_method="uniform")
    second = PipelineModule(layers, num_stages=2, stage_id=1, partition_method="uniform")
    x = torch.randn(3, 4)
    assert torch.equal(second(first(x)), layers[3](layers[2](layers[0](x) * 2)))
    assert [n for n, _ in first.named_parameters()] == ["0.weight", "0.bias"]
    assert [n for n, _ in second.named_parameters()] == ["3.weight", "3.bias"]
    assert second.is_last_stage and not second.is_first_stage


def test_pipeline_module_refusals() -> None:
    with pytest.raises(ValueError, match="needs num_stages or topology"):
        PipelineModule(gpt_layers())
    with pytest.raises(ValueError, match="num_stages=2 but .* has 4 pipe stages"):
        PipelineModule(gpt_layers(), num_stages=2, topology=PipeDataParallelTopology(4, 1), stage_id=0)
    with pytest.raises(ValueError, match="pass stage_id=<stage>"):
        PipelineModule(gpt_layers(), num_stages=2)
    with pytest.raises(ValueError, match="stage_id=2 is outside 0..1"):
        PipelineModule(gpt_layers(), num_stages=2, stage_id=2)
    with pytest.raises(ValueError, match="has no 'pipe' axis"):
        PipelineModule(gpt_layers(), topology=ProcessTopology(["data"], [2]), stage_id=0)
    with pytest.raises(TypeError, match="not one string; write \\['Block'\\]"):
        PipelineModule(gpt_layers(), num_stages=1, checkpointable_layers="Block")
    with pytest.raises(TypeError, match="must be a torch.nn.Module subclass"):
        LayerSpec(nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cannot be a layer of another PipelineModule"):
        PipelineModule([PipelineModule([nn.ReLU()], num_stages=1)], num_stages=1)
    with pytest.raises(ValueError, match="did you mean 'uniform'"):
        PipelineModule(gpt_layers(), num_stages=1, partition_method="unifrom")
    assert repr(LayerSpec(nn.Linear, 4, 8, bias=False)) == "Linear(4, 8, bias=False)"


def test_topology_accepted_and_defaulted() -> None:
    module = PipelineModule(gpt_layers(), topology=PipeModelDataParallelTopology(2, 1, 1), stage_id=1)
    assert module.num_stages == 2 and module.topology().get_axis_names() == ["pipe", "data", "model"]
    assert PipelineModule(gpt_layers(), num_stages=4, stage_id=3).topology() == PipeDataParallelTopology(4, 1)
    assert PipelineModule(gpt_layers(), num_stages=1).stage_id == 0


# -- topology ---------------------------------------------------------------------------------------
def test_topology_matches_deepspeed() -> None:
    t = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=3)
    assert t.get_axis_comm_lists("pipe") == [[0, 6], [1, 7], [2, 8], [3, 9], [4, 10], [5, 11]]
    assert t.get_axis_comm_lists("data") == [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]]
    assert t.get_axis_comm_lists("model") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert t.filter_match(pipe=1, data=2) == [10, 11]
    assert t.get_axis_list("data", 1) == [2, 3, 8, 9]
    assert repr(t.get_coord(7)) == "ProcessCoord(pipe=1, data=0, model=1)"
    assert t.get_rank(pipe=1, data=0, model=1) == 7
    assert t.get_rank_repr(5) == "model_01"
    assert t.get_rank_repr(5, omit_axes=[]) == "pipe_00-data_02-model_01"
    assert t.get_dim("x") == 0 and t.world_size() == 12
    u = PipeDataParallelTopology(num_pp=4, num_dp=2)
    assert u.get_axis_comm_lists("pipe") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert u.get_axis_comm_lists("data") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert u.get_rank_repr(3) == "" and u.get_axis_comm_lists("model") == []
    assert str(ProcessTopology(["x", "y"], [2, 2])) == (
        "{ProcessCoord(x=0, y=0): 0, ProcessCoord(x=0, y=1): 1, ProcessCoord(x=1, y=0): 2, ProcessCoord(x=1, y=1): 3}")
    with pytest.raises(ValueError, match="does not support slices"):
        t.get_rank(pipe=0)
    with pytest.raises(ValueError, match="model=2 is outside 0..1"):
        t.get_rank(pipe=0, data=0, model=2)
    with pytest.raises(ValueError, match="rank 12 not found"):
        t.get_coord(12)
    with pytest.raises(ValueError, match="one size per axis"):
        ProcessTopology(["a", "b"], [2])


@pytest.mark.parametrize(("pp", "dp", "tp"), [(1, 1, 1), (2, 3, 2), (4, 2, 1), (2, 1, 4), (3, 2, 2)])
def test_topology_and_mesh_place_every_rank_alike(pp: int, dp: int, tp: int) -> None:
    world = pp * dp * tp
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    dims = topology_to_dims(topo, world)
    assert (dims.pp, dims.dp, dims.tp) == (pp, dp, tp)
    for rank in range(world):
        c, m = topo.get_coord(rank), dims.coords(rank)
        assert (c.pipe, c.data, c.model) == (m["pp"], m["dp"], m["tp"])
    assert sorted(map(sorted, topo.get_axis_comm_lists("pipe"))) == sorted(dims.rank_groups("pp"))
    assert sorted(topo.get_axis_comm_lists("model")) == sorted(dims.rank_groups("tp"))
    back = dims_to_topology(dims)
    assert [back.get_coord(r).pipe for r in range(world)] == [topo.get_coord(r).pipe for r in range(world)]
    assert type(back) is (PipeDataParallelTopology if tp == 1 else PipeModelDataParallelTopology)
    assert topology_to_dims(PipeDataParallelTopology(pp, dp * tp), world) == ParallelDims(world, pp=pp, dp=dp * tp)


def test_topology_to_dims_refusals() -> None:
    with pytest.raises(ValueError, match="order the axes as pipe, data, model"):
        topology_to_dims(ProcessTopology(["data", "pipe"], [2, 2]), 4)
    with pytest.raises(ValueError, match="has 4 ranks but the world size is 8"):
        topology_to_dims(PipeDataParallelTopology(2, 2), 8)
    with pytest.raises(ValueError, match="axes \\['expert'\\] have no place in the mesh"):
        topology_to_dims(ProcessTopology(["pipe", "expert"], [2, 2]), 4)
    assert topology_to_dims(ProcessTopology(["data", "pipe"], [1, 4]), 4).pp == 4  # a size-1 axis moves nothing


def test_random_topologies_agree_with_get_rank() -> None:
    rng = random.Random(0)
    for _ in range(20):
        dims = [rng.randint(1, 3) for _ in range(3)]
        t = ProcessTopology(["a", "b", "c"], dims)
        for rank in range(t.world_size()):
            assert t.get_rank(**t.get_coord(rank)._asdict()) == rank


def _stage_from_rank() -> dict[str, Any]:
    by_stages = PipelineModule(gpt_layers(), num_stages=2, partition_method="uniform")
    by_topo = PipelineModule(gpt_layers(), topology=PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1),
                             partition_method="uniform")
    return {"stages": by_stages.stage_id, "layers": list(by_stages.local_layers()),
            "dims": by_stages.topology().dims, "topo": by_topo.stage_id}


@pytest.mark.spawns
def test_stage_comes_from_the_rank_when_a_group_is_up() -> None:
    from zerospeed.testing import run_distributed

    results = run_distributed(_stage_from_rank, 4)
    assert [r["stages"] for r in results] == [0, 0, 1, 1]  # PipeDataParallelTopology(2, 2): data fastest
    assert [r["layers"] for r in results] == [[0, 1, 2, 3]] * 2 + [[4, 5, 6, 7]] * 2
    assert all(r["dims"] == [2, 2] for r in results)
    assert [r["topo"] for r in results] == [0, 0, 1, 1]


def test_initialize_returns_a_pipeline_engine_that_refuses_the_data_parallel_calls() -> None:
    import zerospeed
    from zerospeed.pipe.engine import PipelineEngine, PipelineError

    module = PipelineModule([LayerSpec(torch.nn.Linear, 4, 4)], num_stages=1)
    engine, *_ = zerospeed.initialize(model=module, config={"train_batch_size": 1})
    assert isinstance(engine, PipelineEngine) and engine.is_first_stage() and engine.is_last_stage()
    with pytest.raises(PipelineError, match=r"call engine.train_batch\(data_iter\)"):
        engine(torch.zeros(1, 4))
    with pytest.raises(PipelineError, match="inside engine.train_batch"):
        engine.backward(torch.zeros(()))
    with pytest.raises(PipelineError, match="inside engine.train_batch"):
        engine.step()
