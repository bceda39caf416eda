"""``CPUAdagrad``: torch.optim.Adagrad's update on the CPU in one pass, with the low-precision copy-out
(DeepSpeed's ``DeepSpeedCPUAdagrad`` signature, plus torch's ``lr_decay`` and
``initial_accumulator_value``). State: ``step`` and ``sum``, as torch keeps them."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from zerospeed.ops.cpu_optimizer import CPUOptimizer, address, out_kind, torch_chunks


class CPUAdagrad(CPUOptimizer):
    """Adagrad over fp32 CPU parameters."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True, lr_decay: float = 0,
                 initial_accumulator_value: float = 0, implementation: str = "auto", threads: int | None = None):
        if amsgrad:
            raise ValueError("Adagrad has no amsgrad variant; pass amsgrad=False")
        if not fp32_optimizer_states:
            raise ValueError("CPUAdagrad keeps fp32 optimizer states; fp32_optimizer_states=False is not supported")
        if not 0.0 <= lr:
            raise ValueError(f"lr={lr} must be >= 0")
        defaults = {"lr": lr, "eps": eps, "weight_decay": weight_decay, "lr_decay": lr_decay,
                    "initial_accumulator_value": initial_accumulator_value}
        super().__init__(params, defaults, implementation, threads)

    def _init_state(self, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        state["step"] = torch.tensor(0.0)
        state["sum"] = torch.full_like(param, float(group["initial_accumulator_value"]),
                                       memory_format=torch.preserve_format)

    def _update(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any],
                out: torch.Tensor | None) -> None:
        step = float(state["step"])
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        clr = lr / (1 + (step - 1) * group["lr_decay"])
        total = state["sum"]
        native = self._native(param)
        if native is not None:
            kind = out_kind(out)

            def kernel(a: int, b: int) -> None:
                native.adagrad(address(param, a), address(grad, a), address(total, a), address(out, a), kind,
                               b - a, clr, eps, wd)
            self._run(param.numel(), kernel)
            return
        p_flat, g_flat, s_flat = param.view(-1), grad.view(-1), total.view(-1)
        o_flat = out.view(-1) if out is not None else None
        for part in torch_chunks(param.numel()):  # torch.optim's single-tensor Adagrad, op for op
            p, g, s = p_flat[part], g_flat[part], s_flat[part]
            if wd != 0:
                g = g.add(p, alpha=wd)
            s.addcmul_(g, g, value=1)
            std = s.sqrt().add_(eps)
            p.addcdiv_(g, std, value=-clr)
            if o_flat is not None:
                o_flat[part].copy_(p)


DeepSpeedCPUAdagrad = CPUAdagrad

__all__ = ["CPUAdagrad", "DeepSpeedCPUAdagrad"]
