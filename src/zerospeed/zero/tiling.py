"""``TiledLinear``: one linear layer stored as a grid of smaller linear modules.

Why: ZeRO stage 3 gathers parameters one module at a time, so a huge ``nn.Linear`` needs its
whole weight resident at once. Cut into ``out_splits x in_splits`` tiles, each tile is its own
module and only one tile's weight has to be gathered at a time, while the layer computes the
same function: output block ``o`` is the sum over input blocks ``i`` of ``tile[o][i](x_i)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from zerospeed.zero.init import GatheredParameters


def split_sizes(total: int, parts: int) -> list[int]:
    """``total`` features in ``parts`` contiguous blocks, sizes differing by at most one (the
    first ``total % parts`` blocks get the extra feature)."""
    base, extra = divmod(total, parts)
    return [base + 1 if index < extra else base for index in range(parts)]


class TiledLinear(nn.Module):
    """A drop-in for ``nn.Linear(in_features, out_features, bias)`` made of tiles.

    ``linears[o][i]`` is a ``linear_cls(in_size_i, out_size_o, bias=..., **kwargs)``; only the
    tiles of the first input block carry a bias, so it is added once per output block.
    ``init_linear`` copies an existing linear's weight and bias into the tiles.
    ``input_is_already_split=True`` makes ``forward`` take the ``in_splits`` input blocks as a
    list; ``combine_out_splits=False`` makes it return the ``out_splits`` output blocks as one.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 in_splits: int = 1, out_splits: int = 1, input_is_already_split: bool = False,
                 combine_out_splits: bool = True,
                 linear_cls: Callable[..., nn.Module] = nn.Linear,
                 init_linear: nn.Module | None = None, **kwargs: Any) -> None:
        super().__init__()
        _check_features("in_features", in_features)
        _check_features("out_features", out_features)
        _check_splits("in_splits", in_splits, "in_features", in_features)
        _check_splits("out_splits", out_splits, "out_features", out_features)
        if not callable(linear_cls):
            raise TypeError(f"linear_cls: {linear_cls!r} is not callable; pass a module class "
                            "taking (in_features, out_features, bias=...) such as nn.Linear")
        self.in_features = in_features
        self.out_features = out_features
        self.in_splits = in_splits
        self.out_splits = out_splits
        self.input_is_already_split = bool(input_is_already_split)
        self.combine_out_splits = bool(combine_out_splits)
        self.in_sizes = split_sizes(in_features, in_splits)
        self.out_sizes = split_sizes(out_features, out_splits)
        self.linears = nn.ModuleList(
            nn.ModuleList(
                linear_cls(in_size, out_size, bias=bool(bias) and in_id == 0, **kwargs)
                for in_id, in_size in enumerate(self.in_sizes))
            for out_size in self.out_sizes)
        if init_linear is not None:
            self.copy_params_from(init_linear)

    @property
    def has_bias(self) -> bool:
        return getattr(self._rows()[0][0], "bias", None) is not None

    def forward(self, input_: torch.Tensor | Sequence[torch.Tensor]
                ) -> torch.Tensor | list[torch.Tensor]:
        blocks = self._input_blocks(input_)
        outputs = []
        for row in self._rows():
            out = row[0](blocks[0])
            for tile, block in zip(list(row)[1:], blocks[1:]):
                out = out + tile(block)
            outputs.append(out)
        if self.combine_out_splits:
            return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
        return outputs

    def _input_blocks(self, input_: torch.Tensor | Sequence[torch.Tensor]
                      ) -> Sequence[torch.Tensor]:
        if isinstance(input_, torch.Tensor):
            if self.input_is_already_split and self.in_splits > 1:
                raise TypeError(f"input: a tensor was given but input_is_already_split=True; "
                                f"pass a list of {self.in_splits} input blocks of sizes "
                                f"{self.in_sizes}")
            _check_width("input", input_, self.in_features)
            return torch.split(input_, self.in_sizes, dim=-1)
        if not self.input_is_already_split:
            raise TypeError(f"input: a {type(input_).__name__} was given but "
                            "input_is_already_split=False; pass one tensor or build the layer "
                            "with input_is_already_split=True")
        blocks = list(input_)
        if len(blocks) != self.in_splits:
            raise ValueError(f"input: {len(blocks)} input blocks given, expected in_splits="
                             f"{self.in_splits} blocks of sizes {self.in_sizes}")
        for index, (block, size) in enumerate(zip(blocks, self.in_sizes)):
            _check_width(f"input[{index}]", block, size)
        return blocks

    @torch.no_grad()
    def copy_params_from(self, other: nn.Module) -> None:
        """Copy ``other``'s weight (and bias) into the tiles, so this layer computes ``other``.

        Works on ZeRO-3 partitioned parameters too: both sides are gathered for the copy and
        rank 0's copy becomes every rank's shards.
        """
        weight = getattr(other, "weight", None)
        bias = getattr(other, "bias", None)
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"other: {type(other).__name__} has no weight tensor; pass an "
                            "nn.Linear-like module")
        if (bias is not None) != self.has_bias:
            raise ValueError(f"other.bias: {'present' if bias is not None else 'missing'} but "
                             f"this TiledLinear has bias={self.has_bias}; build both with the "
                             "same bias setting")
        sources: list[torch.Tensor] = [p for p in (weight, bias) if p is not None]
        with GatheredParameters(sources), GatheredParameters(list(self.parameters()),
                                                             modifier_rank=0):
            expected = (self.out_features, self.in_features)
            if tuple(weight.shape) != expected:
                raise ValueError(f"other.weight: shape {tuple(weight.shape)} does not fit this "
                                 f"TiledLinear; expected (out_features, in_features) = "
                                 f"{expected}")
            if bias is not None and tuple(bias.shape) != (self.out_features,):
                raise ValueError(f"other.bias: shape {tuple(bias.shape)} does not fit this "
                                 f"TiledLinear; expected ({self.out_features},)")
            self._copy_tiles(weight, bias)

    def _copy_tiles(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        rows = torch.split(weight, self.out_sizes, dim=0)
        biases = torch.split(bias, self.out_sizes) if bias is not None else [None] * len(rows)
        for row, row_weight, row_bias in zip(self._rows(), rows, biases):
            for tile, block in zip(row, torch.split(row_weight, self.in_sizes, dim=1)):
                _tensor_attr(tile, "weight").copy_(block)
            if row_bias is not None:
                _tensor_attr(row[0], "bias").copy_(row_bias)

    def _rows(self) -> list[nn.ModuleList]:
        """The tile grid, one ``nn.ModuleList`` of tiles per output block (``self.linears`` is
        typed as holding plain modules, so each row is checked to be a list)."""
        rows = []
        for row in self.linears:
            if not isinstance(row, nn.ModuleList):
                raise TypeError(f"linears: a row is a {type(row).__name__}, expected an nn.ModuleList of tiles")
            rows.append(row)
        return rows

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.has_bias}, in_splits={self.in_splits}, "
                f"out_splits={self.out_splits}")


def _tensor_attr(module: nn.Module, name: str) -> torch.Tensor:
    """``module.<name>`` checked to be a tensor (``nn.Module`` attributes are typed as tensor or module)."""
    value = getattr(module, name)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{type(module).__name__}.{name}: {type(value).__name__} is not a tensor")
    return value


def _check_features(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: {value!r} is not a positive integer; pass the number of "
                         "features (>= 1)")


def _check_splits(name: str, value: Any, features_name: str, features: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= features:
        raise ValueError(f"{name}: {value!r} is out of range; pass an integer from 1 to "
                         f"{features_name}={features} (every tile needs at least one feature)")


def _check_width(name: str, tensor: Any, width: int) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: {type(tensor).__name__} is not a tensor")
    if tensor.dim() == 0 or tensor.shape[-1] != width:
        raise ValueError(f"{name}: last dimension of shape {tuple(tensor.shape)} is not "
                         f"{width}; pass features along the last dimension")
