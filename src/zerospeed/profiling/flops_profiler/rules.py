"""What one aten operation costs: FLOPs and multiply-accumulates (MACs) from its shapes alone.

The profiler counts the operations torch actually dispatches (after autograd has decomposed
``F.linear`` into ``addmm``, and during backward the gradient kernels autograd really runs), so the
rules are keyed by aten overload packet. The conventions are DeepSpeed's (``deepspeed/profiling/
flops_profiler/profiler.py``), stated per op at the aten level:

- matrix products (``mm``, ``bmm``, ``addmm``, ``baddbmm``): MACs = the product of the output's and the
  contracted dimension's sizes, FLOPs = 2 * MACs; the added term of ``addmm``/``baddbmm`` (a linear's
  bias) costs one FLOP per output element, as DeepSpeed's convolution bias does.
- convolution: MACs = output elements * (input channels / groups) * kernel elements (transposed: input
  elements * (output channels / groups) * kernel elements), FLOPs = 2 * MACs + one per output element
  for the bias. Its backward: the input gradient and the weight gradient each cost the forward's MACs
  (only those autograd asks for), the bias gradient one FLOP per element of the output gradient.
- scaled-dot-product attention (the fused kernels, which torch's own ``FlopCounterMode`` misses on CPU):
  MACs = Q K^T + A V = B*H*Lq*Lk*E + B*H*Lq*Lk*Ev, over every query/key pair (a causal mask is not
  discounted, as DeepSpeed); FLOPs = 2 * MACs. Its backward: four products (dV = A^T dO, dA = dO V^T,
  dQ = dS K, dK = dS^T Q), twice the forward's MACs.
- elementwise arithmetic and activations (add, mul, relu, gelu, silu, tanh, softmax... and their
  gradient kernels): one FLOP per output element, no MACs (DeepSpeed's rule for ``relu``, ``gelu``,
  ``add``, ``mul``, ``softmax``, extended to every pointwise math op).
- normalization: layer/group norm 5 FLOPs per element with an affine weight, 4 without; batch norm the
  same in training, 2 (1) in evaluation; a norm's backward kernel counts as its training forward.
- pooling: one FLOP per input element (DeepSpeed), its backward one per input-gradient element.
- reductions (``sum``, ``mean``, e.g. a bias gradient): one FLOP per input element.
- embedding lookup, dropout, copies, views, indexing, random fills, collectives: 0 (DeepSpeed counts
  embedding and dropout as 0). The embedding's backward adds gradient rows: one FLOP per element of the
  output gradient.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Sequence

import torch

aten = torch.ops.aten


class OpCost(NamedTuple):
    """One operation's cost."""

    flops: int
    macs: int


FREE = OpCost(0, 0)

Rule = Callable[[Sequence[Any], dict[str, Any], Any], OpCost]


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _out_numel(out: Any) -> int:
    tensor = _first_tensor(out)
    return 0 if tensor is None else tensor.numel()


def _matmul(a: torch.Tensor, b: torch.Tensor) -> int:
    """MACs of ``a @ b`` (2-D or batched 3-D)."""
    return _numel(a.shape) * int(b.shape[-1])


def _mm(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> OpCost:
    macs = _matmul(args[0], args[1])
    return OpCost(2 * macs, macs)


def _addmm(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> OpCost:
    macs = _matmul(args[1], args[2])
    return OpCost(2 * macs + _out_numel(out), macs)


def _conv_macs(x_shape: Sequence[int], w_shape: Sequence[int], out_shape: Sequence[int], transposed: bool) -> int:
    kernel = _numel(w_shape[2:])
    if transposed:  # weight [C_in, C_out / groups, k...]: every input position scatters into the output
        return _numel(x_shape) * int(w_shape[1]) * kernel
    return _numel(out_shape) * int(w_shape[1]) * kernel  # weight [C_out, C_in / groups, k...]


def _convolution(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> OpCost:
    x, w, bias = args[0], args[1], args[2]
    transposed = bool(args[6]) if len(args) > 6 else bool(kwargs.get("transposed", False))
    macs = _conv_macs(x.shape, w.shape, out.shape, transposed)
    return OpCost(2 * macs + (out.numel() if bias is not None else 0), macs)


def _convolution_backward(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> OpCost:
    grad_out, x, w = args[0], args[1], args[2]
    transposed, mask = bool(args[7]), args[10]
    forward = _conv_macs(x.shape, w.shape, grad_out.shape, transposed)
    macs = forward * (int(bool(mask[0])) + int(bool(mask[1])))
    return OpCost(2 * macs + (grad_out.numel() if mask[2] else 0), macs)


def _attention_macs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Q K^T plus A V, on [..., L, E] query/key/value tensors."""
    lk = int(k.shape[-2])
    return _numel(q.shape) * lk + _numel(q.shape[:-1]) * lk * int(v.shape[-1])


def _attention(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> OpCost:
    macs = _attention_macs(args[0], args[1], args[2])
    return OpCost(2 * macs, macs)


def _attention_backward(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> OpCost:
    # (grad_out, query, key, value, ...): four products, each the size of one forward product
    macs = 2 * _attention_macs(args[1], args[2], args[3])
    return OpCost(2 * macs, macs)


def _per_output(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> OpCost:
    return OpCost(_out_numel(out), 0)


def _per_input(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> OpCost:
    tensor = _first_tensor(args[0] if args else None)
    return OpCost(0 if tensor is None else tensor.numel(), 0)


def _affine_norm(weight_index: int) -> Rule:
    def rule(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> OpCost:
        weight = args[weight_index] if len(args) > weight_index else None
        return OpCost(args[0].numel() * (5 if weight is not None else 4), 0)

    return rule


def _batch_norm(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> OpCost:
    # native_batch_norm(input, weight, bias, running_mean, running_var, training, ...)
    has_affine, training = args[1] is not None, bool(args[5])
    per = (5 if has_affine else 4) if training else (2 if has_affine else 1)
    return OpCost(args[0].numel() * per, 0)


def _batch_norm_legit(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> OpCost:
    # _native_batch_norm_legit(input, weight, bias, running_mean, running_var, training, ...), or its
    # .no_stats overload (input, weight, bias, training, ...)
    training = args[3] if isinstance(args[3], bool) else args[5]
    per = (5 if args[1] is not None else 4) if training else (2 if args[1] is not None else 1)
    return OpCost(args[0].numel() * per, 0)


def _batch_norm_eval(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> OpCost:
    return OpCost(args[0].numel() * (2 if args[1] is not None else 1), 0)


def _packets(*names: str) -> list[Any]:
    """The aten overload packets that exist in this torch (a name missing in a build is skipped)."""
    return [getattr(aten, name) for name in names if hasattr(aten, name)]


_POINTWISE = (
    "add", "add_", "sub", "sub_", "rsub", "mul", "mul_", "div", "div_", "neg", "reciprocal", "pow", "exp",
    "log", "sqrt", "rsqrt", "abs", "addcmul", "addcdiv", "lerp", "maximum", "minimum",
    "relu", "relu_", "gelu", "gelu_", "silu", "silu_", "sigmoid", "tanh", "elu", "leaky_relu", "hardtanh",
    "hardtanh_", "prelu", "_prelu_kernel", "softplus", "mish", "hardswish", "hardsigmoid", "erf",
    "threshold_backward", "gelu_backward", "silu_backward", "sigmoid_backward", "tanh_backward",
    "elu_backward", "leaky_relu_backward", "hardtanh_backward", "softplus_backward", "mish_backward",
    "hardswish_backward", "hardsigmoid_backward", "_prelu_kernel_backward",
    "_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d",
    "upsample_bilinear2d", "upsample_bicubic2d", "upsample_trilinear3d", "_upsample_nearest_exact2d",
    "embedding_dense_backward",
)
_POOLING = (
    "max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices", "max_pool3d_with_indices",
    "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "_adaptive_avg_pool2d",
    "_adaptive_avg_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d",
    "mean", "sum",
)
_POOLING_BACKWARD = (
    "max_pool2d_with_indices_backward", "max_pool3d_with_indices_backward", "avg_pool2d_backward",
    "avg_pool3d_backward", "_adaptive_avg_pool2d_backward", "_adaptive_avg_pool3d_backward",
    "adaptive_max_pool2d_backward", "adaptive_max_pool3d_backward",
)
_ATTENTION = (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
)


def _table() -> dict[Any, Rule]:
    table: dict[Any, Rule] = {aten.mm: _mm, aten.bmm: _mm, aten.addmm: _addmm, aten.baddbmm: _addmm,
                              aten.convolution: _convolution, aten.convolution_backward: _convolution_backward,
                              aten.native_layer_norm: _affine_norm(2), aten.native_group_norm: _affine_norm(1),
                              aten.native_layer_norm_backward: _affine_norm(5),
                              aten.native_group_norm_backward: _affine_norm(4),
                              aten.native_batch_norm: _batch_norm, aten._native_batch_norm_legit: _batch_norm_legit,
                              aten._native_batch_norm_legit_no_training: _batch_norm_eval,
                              aten.native_batch_norm_backward: _affine_norm(2)}
    table.update({packet: _per_output for packet in _packets(*_POINTWISE)})
    table.update({packet: _per_input for packet in _packets(*_POOLING)})
    table.update({packet: _per_output for packet in _packets(*_POOLING_BACKWARD)})
    table.update({packet: _attention for packet in _packets(*_ATTENTION)})
    table.update({packet: _attention_backward for packet in _packets(*(f"{name}_backward" for name in _ATTENTION))})
    return table


RULES: dict[Any, Rule] = _table()


def op_cost(func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> OpCost:
    """The cost of one dispatched op (``func`` an aten overload); 0 for ops without a rule."""
    rule = RULES.get(getattr(func, "overloadpacket", func))
    return FREE if rule is None else rule(args, kwargs, out)


__all__ = ["OpCost", "FREE", "RULES", "op_cost"]
