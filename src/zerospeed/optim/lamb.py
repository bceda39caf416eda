"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning") with DeepSpeed's semantics.

Behaves like ``deepspeed.ops.lamb.FusedLamb`` (its CUDA kernel, ``fused_lamb_cuda_kernel.cu``), so a
config that names ``"Lamb"`` trains the same way here, on any device, in pure PyTorch:

* Adam moments from the (unscaled) gradient: ``m = b1*m + (1-b1)*g``, ``v = b2*v + (1-b2)*g*g``.
* ``update = m / (sqrt(v) + eps) + weight_decay * p`` (``eps_inside_sqrt``: ``sqrt(v + eps)``),
  from the *uncorrected* moments.
* Trust ratio ``||p|| / ||update||`` per parameter tensor, clamped to ``[min_coeff, max_coeff]``;
  it is exactly 1.0 (unclamped) when either norm is zero.
* Bias correction is folded into the step size, as in the kernel:
  ``p -= lr * sqrt(1 - b2**t) / (1 - b1**t) * trust * update``. This differs from the paper's
  Algorithm 2 (which corrects ``m`` and ``v`` before the trust ratio, making the correction cancel
  when ``weight_decay == 0`` and nothing clamps); we follow DeepSpeed so results match it.
* ``max_grad_norm > 0`` divides the gradients of a group by ``(norm + 1e-6) / max_grad_norm`` when
  that exceeds 1, ``norm`` being the group's gradient norm (passed as ``grad_norms`` like DeepSpeed's
  fp16 optimizer does, or computed here; DeepSpeed itself fails without ``grad_norms``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["Lamb"]


def _check_range(name: str, value: float, low: float, high: float = math.inf,
                 high_open: bool = False) -> None:
    """Reject a hyper-parameter outside ``[low, high]`` (``[low, high)`` if ``high_open``)."""
    bad = value < low or value > high or (high_open and value >= high)
    if bad or math.isnan(value):
        upper = f"{high})" if high_open else f"{high}]"
        raise ValueError(f"Lamb: {name}={value!r} is outside [{low}, {upper}")


class Lamb(torch.optim.Optimizer):
    """LAMB with DeepSpeed FusedLamb's parameters, defaults and update rule (see module docstring).

    ``get_lamb_coeffs()`` returns the trust ratios of the last step, one per updated parameter in
    group order, as DeepSpeed's FusedLamb does (useful to monitor how often clamping triggers).
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 amsgrad: bool = False) -> None:
        if amsgrad:
            raise ValueError("Lamb does not support the AMSGrad variant (amsgrad=True), "
                             "as DeepSpeed's FusedLamb does not")
        if len(betas) != 2:
            raise ValueError(f"Lamb: betas={betas!r} must be a pair (beta1, beta2)")
        _check_range("lr", lr, 0.0)
        _check_range("eps", eps, 0.0)
        _check_range("betas[0]", betas[0], 0.0, 1.0, high_open=True)
        _check_range("betas[1]", betas[1], 0.0, 1.0, high_open=True)
        _check_range("weight_decay", weight_decay, 0.0)
        _check_range("max_grad_norm", max_grad_norm, 0.0)
        _check_range("min_coeff", min_coeff, 0.0)
        _check_range("max_coeff", max_coeff, min_coeff)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay,
                        max_grad_norm=max_grad_norm, max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults)
        self.lamb_coeffs: list[Tensor] = []
        # maps shards' squared norms to their whole parameters' (see reduce_norms_with)
        self.norm_reducer: Callable[[list[Tensor], Tensor], Tensor] | None = None

    def reduce_norms_with(self, reducer: Callable[[list[Tensor], Tensor], Tensor]) -> None:
        """The parameters are shards (ZeRO): ``reducer`` maps their squared norms to the whole
        parameters' (a collective, so it is called for every group on every rank, even empty ones)."""
        self.norm_reducer = reducer

    def get_lamb_coeffs(self) -> list[float]:
        """Trust ratios applied in the last step (DeepSpeed's FusedLamb API)."""
        return [coeff.item() for coeff in self.lamb_coeffs]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, scale: float = 1.0,
             grad_norms: Sequence[float | Tensor | None] | None = None) -> Any:
        """One LAMB step; gradients are divided by ``scale`` (a loss scale) before use.

        ``grad_norms`` (one per group, of the still-scaled gradients) is only read when a
        group's ``max_grad_norm > 0``; missing norms are computed from the gradients.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        norms = list(grad_norms) if grad_norms is not None else [None] * len(self.param_groups)
        if len(norms) != len(self.param_groups):
            raise ValueError(f"Lamb.step: got {len(norms)} grad_norms for "
                             f"{len(self.param_groups)} parameter groups")
        self.lamb_coeffs = []
        for group, norm in zip(self.param_groups, norms):
            self.lamb_coeffs.extend(self._step_group(group, scale, norm))
        return loss

    def _step_group(self, group: dict[str, Any], scale: float,
                    grad_norm: float | Tensor | None) -> list[Tensor]:
        """Update one group; returns its trust ratios in parameter order."""
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            if self.norm_reducer is not None:  # the other ranks' shards of this group still need our turn
                for _ in range(2):
                    self.norm_reducer([], torch.zeros(0))
            return []
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError("Lamb does not support sparse gradients")
        grads = [p.grad if p.grad.dtype == p.dtype else p.grad.to(p.dtype) for p in params]
        combined_scale = self._combined_scale(group, grads, scale, grad_norm)
        beta1, beta2 = group["betas"]
        states = [self._state(p) for p in params]
        step_sizes = []
        for state in states:
            state["step"] += 1
            step_sizes.append(_step_size(group["lr"], beta1, beta2, state["step"],
                                         group["bias_correction"]))
        coeffs: list[Tensor | None] = [None] * len(params)
        buckets = _by_device_and_dtype(params)
        if self.norm_reducer is not None and len(buckets) > 1:
            raise ValueError("Lamb over shards needs every parameter of a group on one device and dtype")
        for index in buckets:
            bucket_coeffs = _lamb_update(
                [params[i] for i in index], [grads[i] for i in index],
                [states[i]["exp_avg"] for i in index], [states[i]["exp_avg_sq"] for i in index],
                [step_sizes[i] for i in index], beta1=beta1, beta2=beta2, eps=group["eps"],
                eps_inside_sqrt=group["eps_inside_sqrt"], weight_decay=group["weight_decay"],
                max_coeff=group["max_coeff"], min_coeff=group["min_coeff"],
                grad_scale=combined_scale, norm_reducer=self.norm_reducer)
            for i, coeff in zip(index, bucket_coeffs.unbind()):
                coeffs[i] = coeff
        return [c for c in coeffs if c is not None]

    def _state(self, p: Tensor) -> dict[str, Any]:
        """The parameter's state, created on first use (an int step, as DeepSpeed keeps it)."""
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @staticmethod
    def _combined_scale(group: dict[str, Any], grads: list[Tensor], scale: float,
                        grad_norm: float | Tensor | None) -> float:
        """Loss scale times DeepSpeed's per-group clip factor (when ``max_grad_norm > 0``)."""
        max_norm = group["max_grad_norm"]
        if max_norm <= 0:
            return float(scale)
        if grad_norm is None:
            grad_norm = torch.linalg.vector_norm(
                torch.stack([n.double() for n in torch._foreach_norm(grads)]))
        clip = (float(grad_norm) / scale + 1e-6) / max_norm
        return float(clip * scale) if clip > 1 else float(scale)


def _step_size(lr: float, beta1: float, beta2: float, step: int, bias_correction: bool) -> float:
    """``lr`` with both bias corrections folded in, as DeepSpeed's kernel does."""
    if not bias_correction:
        return lr
    return lr * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)


def _by_device_and_dtype(tensors: list[Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` bucketed by (device, dtype), so norms can be stacked per bucket."""
    buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        buckets.setdefault((t.device, t.dtype), []).append(i)
    return list(buckets.values())


def _lamb_update(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                 exp_avg_sqs: list[Tensor], step_sizes: list[float], *, beta1: float,
                 beta2: float, eps: float, eps_inside_sqrt: bool, weight_decay: float,
                 max_coeff: float, min_coeff: float, grad_scale: float,
                 norm_reducer: Callable[[list[Tensor], Tensor], Tensor] | None = None) -> Tensor:
    """Update same-device, same-dtype tensors in place; returns their trust ratios."""
    if grad_scale != 1.0:
        grads = list(torch._foreach_div(grads, grad_scale))
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    if eps_inside_sqrt:
        denoms = torch._foreach_add(exp_avg_sqs, eps)
        torch._foreach_sqrt_(denoms)
    else:
        denoms = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_add_(denoms, eps)
    updates = torch._foreach_div(exp_avgs, denoms)
    if weight_decay != 0:
        torch._foreach_add_(updates, params, alpha=weight_decay)
    w_norm = torch.stack(torch._foreach_norm(params))
    u_norm = torch.stack(torch._foreach_norm(updates))
    if norm_reducer is not None:  # shards: whole-parameter norms from every rank's parts
        w_norm = norm_reducer(params, w_norm.square()).sqrt()
        u_norm = norm_reducer(params, u_norm.square()).sqrt()
    ratio = (w_norm / u_norm).clamp(min_coeff, max_coeff)
    coeffs = torch.where((w_norm != 0) & (u_norm != 0), ratio, torch.ones_like(ratio))
    neg_steps = coeffs * torch.tensor(step_sizes, dtype=coeffs.dtype, device=coeffs.device).neg()
    torch._foreach_mul_(updates, list(neg_steps.unbind()))
    torch._foreach_add_(params, updates)
    return coeffs
