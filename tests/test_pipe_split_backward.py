"""The zero-bubble split of a block's backward: input part then weight part equals one fused backward,
and the weight part redoes none of the input part."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zerospeed.pipe.split_backward import backward_input
from zerospeed.testing import device_time
from zerospeed.testing.device_time import DeviceTime, DeviceWeightTime


class _Counted(torch.autograd.Function):
    """Identity whose backward counts its calls (in ``calls``)."""

    calls = 0

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        _Counted.calls += 1
        return grad


class MLPBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(_Counted.apply(self.fc1(self.ln(x)))))


class SharedInBlock(nn.Module):
    """One weight used on the input path twice and beside it: the split cannot separate it."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.fc(x))) + self.fc.weight.sum()


def _split_equals_fused(block: nn.Module, shape: tuple[int, ...], extra_out: bool = False) -> None:
    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=True)
    grad = torch.randn(*shape)
    params = list(block.parameters())

    def outputs() -> list[torch.Tensor]:
        y = block(x)
        return [y, block.fc2.bias.square().sum()] if extra_out else [y]

    seeds = [grad, torch.tensor(3.0)] if extra_out else [grad]
    torch.autograd.backward(outputs(), seeds)
    want = [p.grad.clone() for p in params]
    want_x = x.grad.clone()
    for p in params:
        p.grad = None
    x.grad = None
    (found,), deferred = backward_input(outputs(), seeds, [x], params)
    assert all(p.grad is None for p in params), "the input part computed weight gradients"
    deferred.run()
    torch.testing.assert_close(found, want_x, rtol=0, atol=1e-6)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w, rtol=0, atol=1e-5)


def test_input_then_weight_part_equals_the_fused_backward() -> None:
    _split_equals_fused(MLPBlock(16), (2, 5, 16))


def test_an_output_of_weights_alone_is_all_weight_part() -> None:
    _split_equals_fused(MLPBlock(8), (3, 8), extra_out=True)


def test_a_weight_shared_across_the_input_path_falls_back_to_one_backward() -> None:
    block = SharedInBlock(6)
    torch.manual_seed(1)
    x = torch.randn(4, 6, requires_grad=True)
    grad = torch.randn(4, 6)
    block(x).backward(grad)
    want = [p.grad.clone() for p in block.parameters()]
    want_x = x.grad.clone()
    for p in block.parameters():
        p.grad = None
    (found,), deferred = backward_input([block(x)], [grad], [x], list(block.parameters()))
    assert len(deferred.starts) == 1  # the whole backward, from the output
    deferred.run()
    torch.testing.assert_close(found, want_x, rtol=0, atol=1e-6)
    for p, w in zip(block.parameters(), want):
        torch.testing.assert_close(p.grad, w, rtol=0, atol=1e-6)


def test_the_weight_part_redoes_nothing_of_the_input_part() -> None:
    block = MLPBlock(8)
    x = torch.randn(3, 8, requires_grad=True)
    _Counted.calls = 0
    (found,), deferred = backward_input([block(x)], [torch.ones(3, 8)], [x], list(block.parameters()))
    assert _Counted.calls == 1
    assert len(deferred.starts) == 3  # ln, fc1 and fc2: one start per node that feeds a weight
    deferred.run()
    assert _Counted.calls == 1, "the weight part ran the input path's backward again"
    assert all(p.grad is not None for p in block.parameters())


class _DeviceTimedBlock(nn.Module):
    """The shape of ``benchmarks/_pipe_bench.MLPBlock`` with simulated device time: real layers, then an
    identity costing forward/input time and a zero through a weight costing the weight time."""

    def __init__(self, own_weight: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.device_weight = nn.Parameter(torch.zeros(1)) if own_weight else self.fc.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + self.fc(x)
        return DeviceTime.apply(y, 1.0, 2.0) + DeviceWeightTime.apply(self.device_weight, 3.0)


def _device_time_calls(own_weight: bool, monkeypatch) -> tuple[list[float], list[float]]:
    """The simulated times the input part and then the weight part of a split backward spend."""
    spent: list[float] = []
    monkeypatch.setattr(device_time.time, "sleep", spent.append)
    block = _DeviceTimedBlock(own_weight)
    x = torch.randn(2, 4, requires_grad=True)
    out = block(x)
    spent.clear()  # forward's
    _, deferred = backward_input([out], [torch.ones_like(out)], [x], list(block.parameters()))
    input_part = list(spent)
    spent.clear()
    deferred.run()
    return input_part, spent


def test_simulated_device_time_splits_into_input_and_weight_parts(monkeypatch) -> None:
    """With a weight of its own, the weight time is deferred to the weight part and the input time is
    spent once (what bench_pipe --device-ms relies on for ZB-H1)."""
    assert _device_time_calls(True, monkeypatch) == ([2.0], [3.0])


def test_simulated_device_time_through_a_shared_weight_is_not_split(monkeypatch) -> None:
    """Through a weight the block also uses on its input path (fc.bias) there is no exact split: the
    weight part is the whole backward, so the input time is spent twice."""
    input_part, weight_part = _device_time_calls(False, monkeypatch)
    assert input_part == [2.0] and sorted(weight_part) == [2.0, 3.0]
