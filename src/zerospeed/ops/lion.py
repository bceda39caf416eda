"""``CPULion``: the Lion optimizer (Chen et al., 2023, "Symbolic Discovery of Optimization
Algorithms", Algorithm 2) on the CPU in one pass, with the low-precision copy-out (DeepSpeed's
``DeepSpeedCPULion`` signature). Per step: ``c = b1*m + (1-b1)*g``; ``p = p*(1 - lr*wd) - lr*sign(c)``;
``m = b2*m + (1-b2)*g``. State: ``step`` and ``exp_avg``."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from zerospeed.ops.cpu_optimizer import CPUOptimizer, address, out_kind, torch_chunks


class CPULion(CPUOptimizer):
    """Lion over fp32 CPU parameters."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0, fp32_optimizer_states: bool = True, implementation: str = "auto",
                 threads: int | None = None):
        if not fp32_optimizer_states:
            raise ValueError("CPULion keeps fp32 optimizer states; fp32_optimizer_states=False is not supported")
        if not 0.0 <= lr:
            raise ValueError(f"lr={lr} must be >= 0")
        if not (0.0 <= betas[0] <= 1.0 and 0.0 <= betas[1] <= 1.0):
            raise ValueError(f"betas={betas} must each be in [0, 1]")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay}, implementation,
                         threads)

    def _init_state(self, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def _update(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any],
                out: torch.Tensor | None) -> None:
        lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
        decay = 1 - lr * wd
        m = state["exp_avg"]
        native = self._native(param)
        if native is not None:
            kind = out_kind(out)

            def kernel(a: int, b: int) -> None:
                native.lion(address(param, a), address(grad, a), address(m, a), address(out, a), kind, b - a,
                            lr, beta1, 1 - beta1, beta2, 1 - beta2, decay)
            self._run(param.numel(), kernel)
            return
        p_flat, g_flat, m_flat = param.view(-1), grad.view(-1), m.view(-1)
        o_flat = out.view(-1) if out is not None else None
        for part in torch_chunks(param.numel()):
            p, g, mc = p_flat[part], g_flat[part], m_flat[part]
            update = (mc * beta1 + g * (1 - beta1)).sign_()
            p.mul_(decay).add_(update, alpha=-lr)
            mc.mul_(beta2).add_(g, alpha=1 - beta2)
            if o_flat is not None:
                o_flat[part].copy_(p)


DeepSpeedCPULion = CPULion

__all__ = ["CPULion", "DeepSpeedCPULion"]
