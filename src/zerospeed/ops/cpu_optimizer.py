"""The machinery the CPU optimizers share: one pass per parameter, threads over chunks, copy-out.

A CPU optimizer's step is bound by memory bandwidth, so what matters is touching each byte once: the
kernel reads the gradient, master and states and writes the master, the states and — when the caller
passes ``fp16_param_groups`` (DeepSpeed's name; bf16 works too) — the low-precision copy of the
parameter, all in the same pass. Native kernels release the GIL, so a thread pool runs them on
disjoint chunks of a large parameter on every core; small parameters run on the calling thread.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Sequence

import torch

from zerospeed.ops.native import KernelChoice, choose

OUT_KINDS = {None: 0, torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
PARALLEL_MIN = 1 << 16  # elements: below this a thread hand-off costs more than it saves
CHUNK_ALIGN = 64  # elements: chunk starts stay cache-line and vector aligned
TORCH_CHUNK = 1 << 20  # elements per slice on the PyTorch path (bounds its temporaries)


class CPUOptimizer(torch.optim.Optimizer):
    """Base of :class:`CPUAdam`, :class:`CPUAdagrad` and :class:`CPULion`; subclasses give the update."""

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], implementation: str = "auto",
                 threads: int | None = None):
        super().__init__(params, defaults)
        self._requested = implementation
        self.kernels: KernelChoice = choose(implementation)
        self.threads = max(int(threads or torch.get_num_threads()), 1)
        self._pool: ThreadPoolExecutor | None = None

    @property
    def implementation(self) -> str:
        """``native`` or ``torch``: the path this optimizer runs (``zerospeed report`` says why)."""
        return self.kernels.name

    def __getstate__(self) -> dict[str, Any]:
        """torch's state plus how to rebuild the kernels (a module and a thread pool do not copy)."""
        state = super().__getstate__()
        state.update(_requested=self._requested, threads=self.threads)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        requested, threads = state.pop("_requested", "auto"), state.pop("threads", None)
        super().__setstate__(state)
        self._requested = requested
        self.kernels = choose(requested)
        self.threads = max(int(threads or torch.get_num_threads()), 1)
        self._pool = None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None,
             fp16_param_groups: Sequence[Any] | None = None) -> Any:
        """Update every parameter that has a gradient; with ``fp16_param_groups`` (one entry per param
        group: a list of tensors, or one tensor for a one-parameter group) the updated values are also
        written, in the same pass, into those bf16/fp16/fp32 tensors."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        targets = self._targets(fp16_param_groups)
        for g, group in enumerate(self.param_groups):
            for i, param in enumerate(group["params"]):
                if param.grad is None:
                    continue
                out = targets[g][i] if targets is not None else None
                self._check(param, out)
                state = self.state[param]
                if not state:
                    self._init_state(param, state, group)
                state["step"] += 1
                self._update(param, param.grad, state, group, out)
        return loss

    # -- subclasses -----------------------------------------------------------------------------
    def _init_state(self, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _update(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any],
                out: torch.Tensor | None) -> None:
        raise NotImplementedError

    # -- helpers ----------------------------------------------------------------------------------
    def _targets(self, groups: Sequence[Any] | None) -> list[list[torch.Tensor]] | None:
        if groups is None:
            return None
        if len(groups) != len(self.param_groups):
            raise ValueError(f"fp16_param_groups has {len(groups)} entries for {len(self.param_groups)} param "
                             f"groups; pass one list of tensors per group")
        out = []
        for g, (entry, group) in enumerate(zip(groups, self.param_groups)):
            tensors = [entry] if isinstance(entry, torch.Tensor) else list(entry)
            if len(tensors) != len(group["params"]):
                raise ValueError(f"fp16_param_groups[{g}] has {len(tensors)} tensors for {len(group['params'])} "
                                 f"parameters")
            out.append(tensors)
        return out

    def _native(self, param: torch.Tensor) -> Any:
        """The native kernels for a CPU tensor; None (the PyTorch path) for one on an accelerator
        (with ``offload_optimizer.ratio < 1`` some masters stay on the compute device)."""
        return self.kernels.module if param.device.type == "cpu" else None

    @staticmethod
    def _check(param: torch.Tensor, out: torch.Tensor | None) -> None:
        grad = param.grad
        assert grad is not None
        for what, tensor in (("parameter", param), ("gradient", grad)):
            if tensor.dtype != torch.float32 or tensor.device != param.device or not tensor.is_contiguous():
                raise TypeError(f"CPU optimizers update contiguous fp32 tensors; this {what} is "
                                f"{tensor.dtype} on {tensor.device}{'' if tensor.is_contiguous() else ', not contiguous'}"
                                f" (keep fp32 masters on the CPU; pass low-precision copies as fp16_param_groups)")
        if out is not None:
            if out.dtype not in OUT_KINDS or out.device != param.device or not out.is_contiguous() \
                    or out.numel() != param.numel():
                raise TypeError(f"fp16_param_groups: a copy-out target must be a contiguous bf16/fp16/fp32 tensor "
                                f"of {param.numel()} elements on the parameter's device ({param.device}), got "
                                f"{out.dtype} on {out.device} with {out.numel()}")

    def _run(self, numel: int, kernel: Callable[[int, int], None]) -> None:
        """Call ``kernel(start, end)`` over ``[0, numel)``: in chunks on the pool when large enough."""
        if numel < PARALLEL_MIN or self.threads == 1:
            kernel(0, numel)
            return
        per = -(-numel // self.threads)
        per = -(-per // CHUNK_ALIGN) * CHUNK_ALIGN
        bounds = [(start, min(start + per, numel)) for start in range(0, numel, per)]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="zerospeed-cpu-optim")
        futures = [self._pool.submit(kernel, a, b) for a, b in bounds[1:]]
        kernel(*bounds[0])
        for future in futures:
            future.result()


def address(tensor: torch.Tensor | None, start: int) -> int:
    """The address of element ``start`` of a contiguous tensor (0 for no tensor)."""
    if tensor is None:
        return 0
    return tensor.data_ptr() + start * tensor.element_size()


def out_kind(out: torch.Tensor | None) -> int:
    return OUT_KINDS[None if out is None else out.dtype]


def torch_chunks(numel: int) -> Iterable[slice]:
    for start in range(0, numel, TORCH_CHUNK):
        yield slice(start, min(start + TORCH_CHUNK, numel))
