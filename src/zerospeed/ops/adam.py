"""``CPUAdam``: Adam/AdamW on the CPU in one pass over memory, with the low-precision copy-out.

The same signature as DeepSpeed's ``DeepSpeedCPUAdam``; the arithmetic is torch.optim's
(``Adam`` with L2 weight decay, or ``AdamW``'s decoupled decay when ``adamw_mode``), so the two
agree to rounding, and its state (``step``, ``exp_avg``, ``exp_avg_sq``) is torch's.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from zerospeed.ops.cpu_optimizer import CPUOptimizer, address, out_kind, torch_chunks


class CPUAdam(CPUOptimizer):
    """Adam (``adamw_mode=False``) or AdamW over fp32 CPU parameters; see the module docstring."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True,
                 implementation: str = "auto", threads: int | None = None):
        if amsgrad:
            raise ValueError("CPUAdam does not implement amsgrad (nor does DeepSpeedCPUAdam); use "
                             "torch.optim.Adam(amsgrad=True), or amsgrad=False")
        if not fp32_optimizer_states:
            raise ValueError("CPUAdam keeps fp32 optimizer states; fp32_optimizer_states=False is not supported")
        if not 0.0 <= lr:
            raise ValueError(f"lr={lr} must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas={betas} must each be in [0, 1)")
        if not 0.0 <= eps:
            raise ValueError(f"eps={eps} must be >= 0")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "bias_correction": bias_correction, "adamw_mode": adamw_mode}
        super().__init__(params, defaults, implementation, threads)

    def _init_state(self, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def _update(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any],
                out: torch.Tensor | None) -> None:
        step = float(state["step"])
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        if group.get("bias_correction", True):
            step_size = lr / (1 - beta1 ** step)
            bc2_sqrt = math.sqrt(1 - beta2 ** step)
        else:
            step_size, bc2_sqrt = lr, 1.0
        adamw = bool(group.get("adamw_mode", True))
        decay = 1 - lr * wd if adamw else 1.0
        m, v = state["exp_avg"], state["exp_avg_sq"]
        native = self._native(param)
        if native is not None:
            kind = out_kind(out)

            def kernel(a: int, b: int) -> None:
                native.adam(address(param, a), address(grad, a), address(m, a), address(v, a), address(out, a),
                            kind, b - a, 1 - beta1, beta2, 1 - beta2, eps, wd, decay, int(adamw), step_size,
                            bc2_sqrt)
            self._run(param.numel(), kernel)
            return
        p_flat, g_flat, m_flat, v_flat = (t.view(-1) for t in (param, grad, m, v))
        o_flat = out.view(-1) if out is not None else None
        for part in torch_chunks(param.numel()):  # torch.optim's single-tensor Adam/AdamW, op for op
            p, g, mc, vc = p_flat[part], g_flat[part], m_flat[part], v_flat[part]
            if adamw:
                if wd != 0:
                    p.mul_(decay)
            elif wd != 0:
                g = g.add(p, alpha=wd)
            mc.lerp_(g, 1 - beta1)
            vc.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (vc.sqrt() / bc2_sqrt).add_(eps)
            p.addcdiv_(mc, denom, value=-step_size)
            if o_flat is not None:
                o_flat[part].copy_(p)


DeepSpeedCPUAdam = CPUAdam  # the name DeepSpeed scripts import

__all__ = ["CPUAdam", "DeepSpeedCPUAdam"]
