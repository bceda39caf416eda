"""TiledLinear: the same function and gradients as nn.Linear, for every way of tiling it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerospeed.zero.tiling import TiledLinear, split_sizes

DT = torch.float64  # tiles sum partial products in another order; float64 keeps that invisible


def reference(in_f: int, out_f: int, bias: bool) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(in_f, out_f, bias=bias, dtype=DT)


def assembled_weight_grad(tiled: TiledLinear) -> torch.Tensor:
    return torch.cat([torch.cat([t.weight.grad for t in row], dim=1) for row in tiled.linears])


def check_parity(in_f: int, out_f: int, in_splits: int, out_splits: int, bias: bool) -> None:
    ref = reference(in_f, out_f, bias)
    tiled = TiledLinear(in_f, out_f, bias=bias, in_splits=in_splits, out_splits=out_splits,
                        init_linear=ref, dtype=DT)
    x = torch.randn(2, 3, in_f, dtype=DT, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out = tiled(x)
    want = ref(x_ref)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    g = torch.randn_like(want)
    out.backward(g)
    want.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(assembled_weight_grad(tiled), ref.weight.grad, rtol=0, atol=1e-12)
    if bias:
        bias_grad = torch.cat([row[0].bias.grad for row in tiled.linears])
        torch.testing.assert_close(bias_grad, ref.bias.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("in_splits,out_splits", [(1, 1), (2, 1), (1, 4), (3, 3), (10, 7)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_linear_uneven_splits(in_splits: int, out_splits: int, bias: bool) -> None:
    check_parity(10, 7, in_splits, out_splits, bias)


def test_tiles_are_separate_modules_with_one_bias_per_output_block() -> None:
    tiled = TiledLinear(10, 7, in_splits=3, out_splits=2)
    shapes = [[tuple(t.weight.shape) for t in row] for row in tiled.linears]
    assert shapes == [[(4, 4), (4, 3), (4, 3)], [(3, 4), (3, 3), (3, 3)]]
    has_bias = [[t.bias is not None for t in row] for row in tiled.linears]
    assert has_bias == [[True, False, False]] * 2
    assert sum(p.numel() for p in tiled.parameters()) == 10 * 7 + 7
    assert split_sizes(10, 3) == [4, 3, 3] and split_sizes(6, 6) == [1] * 6


def test_fp32_within_tolerance_and_default_init() -> None:
    torch.manual_seed(1)
    ref = nn.Linear(33, 20)
    tiled = TiledLinear(33, 20, in_splits=4, out_splits=3)
    tiled.copy_params_from(ref)
    x = torch.randn(5, 33)
    torch.testing.assert_close(tiled(x), ref(x), rtol=0, atol=1e-6)


def test_list_input_and_list_output() -> None:
    ref = reference(10, 7, True)
    tiled = TiledLinear(10, 7, in_splits=3, out_splits=2, input_is_already_split=True,
                        combine_out_splits=False, init_linear=ref, dtype=DT)
    x = torch.randn(4, 10, dtype=DT)
    outs = tiled(list(torch.split(x, [4, 3, 3], dim=-1)))
    assert isinstance(outs, list) and [o.shape[-1] for o in outs] == [4, 3]
    torch.testing.assert_close(torch.cat(outs, dim=-1), ref(x), rtol=0, atol=1e-12)
    single = TiledLinear(10, 7, input_is_already_split=True, init_linear=ref, dtype=DT)
    torch.testing.assert_close(single(x), ref(x), rtol=0, atol=0)  # in_splits=1: a bare tensor
    torch.testing.assert_close(single([x]), ref(x), rtol=0, atol=0)


def test_custom_linear_cls_and_kwargs() -> None:
    made: list[tuple[int, int, bool]] = []

    class Recording(nn.Linear):
        def __init__(self, in_f: int, out_f: int, bias: bool = True, **kw: object) -> None:
            made.append((in_f, out_f, bias))
            super().__init__(in_f, out_f, bias=bias, **kw)

    tiled = TiledLinear(5, 4, in_splits=2, out_splits=2, linear_cls=Recording, dtype=DT)
    assert made == [(3, 2, True), (2, 2, False), (3, 2, True), (2, 2, False)]
    assert all(p.dtype == DT for p in tiled.parameters())


@pytest.mark.parametrize("kwargs,pattern", [
    ({"in_splits": 0}, r"in_splits: 0 is out of range; pass an integer from 1 to in_features=10"),
    ({"out_splits": 8}, r"out_splits: 8 is out of range; pass an integer from 1 to out_features=7"),
    ({"in_splits": 2.0}, r"in_splits: 2.0 is out of range"),
    ({"in_features": 0}, r"in_features: 0 is not a positive integer"),
])
def test_bad_arguments(kwargs: dict[str, object], pattern: str) -> None:
    args = {"in_features": 10, "out_features": 7, **kwargs}
    with pytest.raises(ValueError, match=pattern):
        TiledLinear(**args)  # type: ignore[arg-type]


def test_bad_inputs_and_sources() -> None:
    tiled = TiledLinear(10, 7, in_splits=3)
    with pytest.raises(ValueError, match=r"input: last dimension of shape \(2, 9\) is not 10"):
        tiled(torch.randn(2, 9))
    with pytest.raises(TypeError, match=r"input_is_already_split=False"):
        tiled([torch.randn(2, 4)] * 3)
    split = TiledLinear(10, 7, in_splits=3, input_is_already_split=True)
    with pytest.raises(TypeError, match=r"pass a list of 3 input blocks of sizes \[4, 3, 3\]"):
        split(torch.randn(2, 10))
    with pytest.raises(ValueError, match=r"input: 2 input blocks given, expected in_splits=3"):
        split([torch.randn(2, 4), torch.randn(2, 6)])
    with pytest.raises(ValueError, match=r"input\[1\]: last dimension of shape \(2, 4\) is not 3"):
        split([torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 2)])
    with pytest.raises(ValueError, match=r"other.weight: shape \(7, 11\) does not fit"):
        tiled.copy_params_from(nn.Linear(11, 7))
    with pytest.raises(ValueError, match=r"other.bias: missing but this TiledLinear has bias=True"):
        tiled.copy_params_from(nn.Linear(10, 7, bias=False))
    with pytest.raises(TypeError, match=r"other: ReLU has no weight tensor"):
        tiled.copy_params_from(nn.ReLU())


def _init_partitioned() -> dict[str, object]:
    import zerospeed

    zerospeed.init_distributed()
    with zerospeed.zero.Init():
        ref = nn.Linear(10, 7)
        tiled = TiledLinear(10, 7, in_splits=3, out_splits=2, init_linear=ref)
    out: dict[str, object] = {"shapes": sorted({tuple(p.shape) for p in tiled.parameters()})}
    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(5))
    with zerospeed.zero.GatheredParameters(list(ref.parameters()) + list(tiled.parameters())):
        out["equal"] = torch.allclose(tiled(x), ref(x), rtol=0, atol=1e-6)
        out["weight"] = torch.equal(
            torch.cat([torch.cat([t.weight for t in row], dim=1) for row in tiled.linears]),
            ref.weight)
    return out


def test_init_linear_under_zero_init_copies_into_partitioned_tiles() -> None:
    """Under zero.Init the tiles are empty outside a gather: copy_params_from must gather both
    sides (one rank keeps this test cheap; the gather path is the same on more)."""
    from zerospeed.testing import run_distributed

    for rank, out in enumerate(run_distributed(_init_partitioned, 1, timeout=120)):
        assert out == {"shapes": [(0,)], "equal": True, "weight": True}, rank
