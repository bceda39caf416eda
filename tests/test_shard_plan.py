"""ShardPlan: flat, padded, aligned per-unit layouts with exact expected values (no processes)."""

from __future__ import annotations

import pytest

from zerospeed.sharding import Piece, ShardPlan


def test_layout_padding_and_shard_ranges() -> None:
    plan = ShardPlan.build([("layer0", [("w", (5, 10)), ("b", (3,))])], world_size=3, align=4)
    unit = plan.units[0]
    assert [(s.name, s.offset, s.numel) for s in unit.params] == [("w", 0, 50), ("b", 50, 3)]
    assert unit.numel == 53
    assert unit.shard_numel == 20  # ceil(53 / 3) = 18, rounded up to a multiple of 4
    assert (unit.padded_numel, unit.padding) == (60, 7)
    assert [unit.shard_range(r) for r in range(3)] == [(0, 20), (20, 40), (40, 60)]


def test_pieces_cover_every_element_exactly_once() -> None:
    plan = ShardPlan.build([("u", [("a", (7,)), ("b", (2, 3)), ("c", (1,)), ("d", (11,))])], world_size=4, align=2)
    unit = plan.units[0]
    assert unit.shard_numel == 8  # 25 elements -> 7 per rank -> 8 aligned
    assert unit.pieces(0) == [Piece("a", 0, 7, 0), Piece("b", 0, 1, 7)]
    assert unit.pieces(1) == [Piece("b", 1, 6, 0), Piece("c", 0, 1, 5), Piece("d", 0, 2, 6)]
    assert unit.pieces(2) == [Piece("d", 2, 10, 0)]
    assert unit.pieces(3) == [Piece("d", 10, 11, 0)]  # the rest of rank 3's shard is padding
    covered = {name: 0 for name in "abcd"}
    for rank in range(4):
        for piece in unit.pieces(rank):
            covered[piece.param] += piece.numel
    assert covered == {"a": 7, "b": 6, "c": 1, "d": 11}
    assert unit.owners("b") == [0, 1] and unit.owners("d") == [1, 2, 3] and unit.owners("c") == [1]


def test_parameter_smaller_than_the_world_and_empty_units() -> None:
    plan = ShardPlan.build([("tiny", [("t", (2,))]), ("empty", [])], world_size=4, align=1)
    tiny, empty = plan.units
    assert (tiny.shard_numel, tiny.padded_numel) == (1, 4)
    assert [tiny.pieces(r) for r in range(4)] == [[Piece("t", 0, 1, 0)], [Piece("t", 1, 2, 0)], [], []]
    assert (empty.numel, empty.shard_numel, empty.pieces(0)) == (0, 0, [])
    assert plan.shard_numel(0) == 1 and plan.numel == 2


def test_world_size_one_owns_everything() -> None:
    plan = ShardPlan.build([("u", [("x", (3, 3))])], world_size=1)
    assert plan.units[0].pieces(0) == [Piece("x", 0, 9, 0)]
    assert plan.units[0].padding == 7  # aligned to the default 8 elements


def test_lookups_and_errors() -> None:
    plan = ShardPlan.build([("a", [("p", (2,))]), ("b", [("q", (3,))])], world_size=2)
    assert plan.unit_of("q").name == "b"
    with pytest.raises(KeyError, match="'r' is in no unit"):
        plan.unit_of("r")
    with pytest.raises(ValueError, match="rank 2 is outside world size 2"):
        plan.units[0].shard_range(2)
    with pytest.raises(ValueError, match=r"parameter 'p' is in unit 'a' and again in 'b'; a shared \(tied\)"):
        ShardPlan.build([("a", [("p", (2,))]), ("b", [("p", (2,))])], world_size=2)
    with pytest.raises(ValueError, match="world_size=0 must be >= 1"):
        ShardPlan.build([], world_size=0)
    with pytest.raises(ValueError, match="align=0 must be >= 1 element"):
        ShardPlan.build([], world_size=2, align=0)


def test_units_from_a_gpt_like_module_tree() -> None:
    from torch import nn

    from zerospeed.sharding.units import module_units, repeated_block_classes

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(4)
            self.mlp = nn.Linear(4, 4)

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.blocks = nn.ModuleList([Block(), Block()])
            self.final_norm = nn.LayerNorm(4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight  # tied
            self.scale = nn.Parameter(nn.init.ones_(nn.Linear(1, 1).weight.new_empty(1)))

    model = Tiny()
    assert repeated_block_classes(model) == (Block,)
    units = module_units(model)
    # a module's own parameters come first in registration order, then its children's
    assert [name for name, _ in units] == ["<root>", "embed", "blocks.0", "blocks.1", "final_norm"]
    assert dict(units)["blocks.1"] == [("blocks.1.norm.weight", (4,)), ("blocks.1.norm.bias", (4,)),
                                       ("blocks.1.mlp.weight", (4, 4)), ("blocks.1.mlp.bias", (4,))]
    assert dict(units)["embed"] == [("embed.weight", (10, 4))]  # the tied head weight is not repeated
    assert dict(units)["<root>"] == [("scale", (1,))]
    plan = ShardPlan.build(units, world_size=2)
    assert plan.numel == sum(p.numel() for p in model.parameters())
    # an explicit policy: every LayerNorm is its own unit, the rest follows the top-level children
    by_norm = module_units(model, unit_classes=[nn.LayerNorm])
    assert [name for name, _ in by_norm] == ["<root>", "embed", "blocks.0.norm", "blocks", "blocks.1.norm",
                                             "final_norm"]


def test_flat_unit_views_shards_and_round_trip() -> None:
    import torch

    from zerospeed.sharding import FlatUnit

    plan = ShardPlan.build([("u", [("w", (2, 3)), ("b", (5,))])], world_size=3, align=2)
    unit = plan.units[0]
    tensors = {"w": torch.arange(6.0).view(2, 3), "b": torch.arange(10.0, 15.0)}
    flat = FlatUnit.from_tensors(unit, tensors, dtype=torch.float64)
    assert flat.buffer.dtype == torch.float64 and flat.buffer.numel() == unit.padded_numel == 12
    assert flat.buffer.tolist() == [0, 1, 2, 3, 4, 5, 10, 11, 12, 13, 14, 0]  # padding is zero
    assert torch.equal(torch.cat([flat.shard(r) for r in range(3)]), flat.buffer)
    for rank in range(3):  # each piece of the plan is where the plan says it is
        for piece in unit.pieces(rank):
            expected = tensors[piece.param].reshape(-1)[piece.start:piece.end].double()
            assert torch.equal(flat.shard(rank)[piece.shard_offset: piece.shard_offset + piece.numel], expected)
    flat.views["b"][0] = -1.0  # views alias the buffer
    assert flat.buffer[6] == -1.0
    with pytest.raises(ValueError, match=r"w: shape \(3, 2\) does not match the plan's \(2, 3\)"):
        FlatUnit.from_tensors(unit, {"w": torch.zeros(3, 2), "b": torch.zeros(5)})
    with pytest.raises(KeyError, match=r"unit 'u' needs tensors for \['b'\]"):
        FlatUnit.from_tensors(unit, {"w": torch.zeros(2, 3)})
