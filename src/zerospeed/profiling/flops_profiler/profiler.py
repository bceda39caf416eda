"""DeepSpeed's flops profiler: ``FlopsProfiler`` and ``get_model_profile`` (``deepspeed.profiling.
flops_profiler.profiler``), counting the aten operations a model really runs.

Differences from DeepSpeed, on purpose: the backward's operations are counted as they run
(``get_backward_flops``/``get_backward_macs``), not assumed to be twice the forward's; nothing is
patched (a ``TorchDispatchMode`` sees every op, ``a + b`` and ``x @ w`` included), so two profilers never
share counts and a repeated profile gives the same numbers; parameters are counted by identity (a tied
weight once); :meth:`FlopsProfiler.sum_over` adds up the ranks of a tensor- or pipeline-parallel model.
What one op costs is in ``rules.py``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, Sequence, TextIO

import torch
from torch import nn

from zerospeed.profiling.flops_profiler.counter import CountingMode, ModuleHooks, OpTally
from zerospeed.profiling.flops_profiler.report import (RunFacts, Summary, module_duration, module_flops,
                                                       module_macs, module_params, param_numel, print_aggregated,
                                                       print_profile)
from zerospeed.profiling.flops_profiler.units import (bytes_to_string, duration_to_string, flops_to_string,
                                                      macs_to_string, number_to_string, params_to_string)

if TYPE_CHECKING:
    from zerospeed.distributed.comm import Comm

log = logging.getLogger("zerospeed")


class ProfiledEngine(Protocol):
    """What the printed summary reads from an engine (``ds_engine=``), as DeepSpeed does."""

    @property
    def world_size(self) -> int: ...

    @property
    def dp_world_size(self) -> int: ...

    @property
    def mp_world_size(self) -> int: ...

    def train_micro_batch_size_per_gpu(self) -> int: ...


@dataclass(frozen=True)
class ModelTotals:
    """A profile's totals: this rank's, or summed over model-parallel ranks (:meth:`FlopsProfiler.sum_over`).

    ``params`` counts each parameter tensor once over the ranks summed (a tensor-parallel slice on every
    rank, a replicated or tied tensor on one)."""

    fwd_flops: int
    fwd_macs: int
    bwd_flops: int
    bwd_macs: int
    params: int


def device_synchronize() -> Callable[[], None]:
    """The accelerator's synchronize, looked up once before timing starts."""
    from zerospeed.accelerator import get_accelerator

    return get_accelerator().synchronize


class FlopsProfiler:
    """Counts the FLOPs, MACs, parameters and forward latency of ``model`` (and its backward's FLOPs and
    MACs) between :meth:`start_profile` and :meth:`stop_profile`; see DeepSpeed's class of this name.

    ``recompute_fwd_factor`` is kept for DeepSpeed's signature: the operations a backward recomputes
    (activation checkpointing) are measured as backward operations, so no factor is applied."""

    def __init__(self, model: nn.Module, ds_engine: ProfiledEngine | None = None, recompute_fwd_factor: float = 0.0):
        if not isinstance(model, nn.Module):
            raise TypeError(f"FlopsProfiler(model=...): expected a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self._tally: OpTally | None = None
        self._hooks: ModuleHooks | None = None
        self._mode: CountingMode | None = None
        self.flops = self.macs = self.params = 0  # DeepSpeed sets these when printing

    # -- the profile's lifecycle -------------------------------------------------------------------
    def start_profile(self, ignore_list: Sequence[type] | None = None) -> None:
        """Start counting from zero: hooks on the model's modules (but those of a type in ``ignore_list``,
        whose work goes to their parent) and a dispatch mode over every op of this thread."""
        if self._mode is not None:
            self.stop_profile()
        self.reset_profile()
        assert self._tally is not None
        with CountingMode(lambda cost: None):  # torch's first dispatch through a mode imports torch._dynamo
            torch.zeros(1).add_(1)              # (seconds): not inside the first module's timing
        self._hooks = ModuleHooks(self.model, self._tally, ignore=ignore_list or (), synchronize=device_synchronize())
        self._mode = CountingMode(self._tally.charge)
        self._mode.__enter__()
        self.started = True
        log.info("Flops profiler started")

    def stop_profile(self) -> None:
        """Stop counting; the numbers stay readable until :meth:`end_profile`."""
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None

    def reset_profile(self) -> None:
        """Zero the counts (a running profile goes on counting from zero)."""
        if self._tally is None or self._hooks is None:
            self._tally = OpTally()
        else:  # running: the hooks and the mode hold this tally
            self._tally.reset()

    def end_profile(self) -> None:
        """Stop and forget the counts."""
        if not self.started:
            return
        self.stop_profile()
        self.started = False
        self._tally = None
        log.info("Flops profiler finished")

    @contextlib.contextmanager
    def profiling(self, ignore_list: Sequence[type] | None = None) -> Iterator["FlopsProfiler"]:
        """``start_profile`` ... ``stop_profile`` as a ``with`` block; the numbers stay readable after it."""
        self.start_profile(ignore_list)
        try:
            yield self
        finally:
            self.stop_profile()

    @contextlib.contextmanager
    def charging_the_model(self) -> Iterator[None]:
        """Inside this block forward operations outside every module count as the model's own (the
        engine's forward bracket: a pipeline calls layers and functions, not the model's forward)."""
        tally = self._counts()
        tally.outside = id(self.model)
        try:
            yield
        finally:
            tally.outside = None

    # -- numbers ----------------------------------------------------------------------------------
    def _counts(self) -> OpTally:
        if self._tally is None:
            raise RuntimeError("the flops profiler has no profile: call start_profile(), run the model, then read "
                               "the numbers before end_profile()")
        return self._tally

    def totals(self) -> ModelTotals:
        """This rank's numbers as one value."""
        tally = self._counts()
        return ModelTotals(fwd_flops=module_flops(tally, self.model), fwd_macs=module_macs(tally, self.model),
                           bwd_flops=tally.backward_flops, bwd_macs=tally.backward_macs,
                           params=module_params(self.model))

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """Forward FLOPs of the model (2 per multiply-accumulate; see ``rules.py``)."""
        total = module_flops(self._counts(), self.model)
        return number_to_string(total) if as_string else total

    def get_total_macs(self, as_string: bool = False) -> int | str:
        """Forward multiply-accumulates of the model."""
        total = module_macs(self._counts(), self.model)
        return macs_to_string(total) if as_string else total

    def get_backward_flops(self, as_string: bool = False) -> int | str:
        """FLOPs of the operations backward ran (gradient kernels, recomputed forwards) while profiling."""
        total = self._counts().backward_flops
        return number_to_string(total) if as_string else total

    def get_backward_macs(self, as_string: bool = False) -> int | str:
        total = self._counts().backward_macs
        return macs_to_string(total) if as_string else total

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Seconds in the model's forward (summed over the profiled forwards)."""
        total = module_duration(self._counts(), self.model)
        return duration_to_string(total) if as_string else total

    def get_total_params(self, as_string: bool = False) -> int | str:
        """Parameters this rank holds, each tensor once (a tied weight once)."""
        total = module_params(self.model)
        return params_to_string(total) if as_string else total

    def module_flops(self, module: nn.Module) -> int:
        """Forward FLOPs of one submodule (and its children)."""
        return module_flops(self._counts(), module)

    def module_macs(self, module: nn.Module) -> int:
        return module_macs(self._counts(), module)

    def sum_over(self, across: Sequence["Comm"], counted_elsewhere: frozenset[str] = frozenset()) -> ModelTotals:
        """The model's totals over the ranks of ``across`` (e.g. the tensor- and pipeline-parallel Comms):
        FLOPs and MACs summed; parameters summed leaving out the names in ``counted_elsewhere`` (the
        tensors another rank counts: replicated over tensor parallelism, tied across stages).
        Collective: every rank of every Comm calls it."""
        mine = self.totals()
        named = dict(self.model.named_parameters())
        params = sum(param_numel(p) for name, p in named.items() if name not in counted_elsewhere)
        values = torch.tensor([mine.fwd_flops, mine.fwd_macs, mine.bwd_flops, mine.bwd_macs, params],
                              dtype=torch.float64)
        for comm in across:
            comm.all_reduce(values)
        fwd_flops, fwd_macs, bwd_flops, bwd_macs, total_params = (int(round(v)) for v in values.tolist())
        return ModelTotals(fwd_flops=fwd_flops, fwd_macs=fwd_macs, bwd_flops=bwd_flops, bwd_macs=bwd_macs,
                           params=total_params)

    # -- printing ---------------------------------------------------------------------------------
    def summary(self, model: ModelTotals | None = None, *, fwd_latency: float | None = None,
                bwd_latency: float | None = None, step_latency: float | None = None) -> Summary:
        tally = self._counts()
        mine = self.totals()
        return Summary(params=mine.params, fwd_flops=mine.fwd_flops, fwd_macs=mine.fwd_macs,
                       bwd_flops=mine.bwd_flops, bwd_macs=mine.bwd_macs,
                       fwd_latency=module_duration(tally, self.model) if fwd_latency is None else fwd_latency,
                       model_params=None if model is None else model.params,
                       model_fwd_flops=None if model is None else model.fwd_flops,
                       model_bwd_flops=None if model is None else model.bwd_flops,
                       bwd_latency=bwd_latency, step_latency=step_latency)

    def _facts(self) -> RunFacts | None:
        engine = self.ds_engine
        if engine is None:
            return None
        return RunFacts(world_size=engine.world_size, dp_size=engine.dp_world_size, mp_size=engine.mp_world_size,
                        micro_batch=engine.train_micro_batch_size_per_gpu())

    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: str | None = None, *,
                            summary: Summary | None = None) -> None:
        """Print the summary, the top modules per depth and (``detailed``) the module tree with each
        module's profile, to stdout or ``output_file`` (DeepSpeed's layout, plus the measured backward)."""
        if not self.started:
            return
        summary = summary if summary is not None else self.summary()
        self.flops, self.macs, self.params = summary.fwd_flops, summary.fwd_macs, summary.params
        with _output(output_file) as out:
            print_profile(out, self._counts(), self.model, summary, profile_step=profile_step,
                          module_depth=module_depth, top_modules=top_modules, detailed=detailed, facts=self._facts())

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        print_aggregated(sys.stdout, self._counts(), self.model, module_depth, top_modules)


@contextlib.contextmanager
def _output(output_file: str | None) -> Iterator[TextIO]:
    if not output_file:
        yield sys.stdout
        return
    directory = os.path.dirname(os.path.abspath(output_file))
    os.makedirs(directory, exist_ok=True)
    with open(output_file, "w") as out:
        yield out


def get_model_profile(model: nn.Module, input_shape: tuple[int, ...] | None = None, args: Sequence[Any] = [],
                      kwargs: dict[str, Any] = {}, print_profile: bool = True, detailed: bool = True,
                      module_depth: int = -1, top_modules: int = 1, warm_up: int = 1, as_string: bool = True,
                      output_file: str | None = None, ignore_modules: Sequence[type] | None = None,
                      mode: str = "forward") -> tuple[Any, Any, Any]:
    """(FLOPs, MACs, params) of one forward (``mode="forward"``) or ``generate`` call of ``model`` in
    evaluation mode, after ``warm_up`` unprofiled calls; as strings unless ``as_string=False``. The input is
    ``args``/``kwargs``, or an uninitialized tensor of ``input_shape`` in the model's dtype and device."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_model_profile(model=...): expected a torch.nn.Module, got {type(model).__name__}")
    if mode not in ("forward", "generate"):
        raise ValueError(f"get_model_profile(mode={mode!r}): mode is 'forward' or 'generate'")
    if mode == "generate" and not callable(getattr(model, "generate", None)):
        raise ValueError(f"get_model_profile(mode='generate'): {type(model).__name__} has no generate() method")
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise ValueError(f"get_model_profile(input_shape={input_shape!r}): give a non-empty tuple of sizes")
        first = next(model.parameters(), None)
        dtype = first.dtype if first is not None else torch.get_default_dtype()
        device = first.device if first is not None else torch.device("cpu")
        args = [torch.empty(input_shape, dtype=dtype, device=device)]
    if not args and not kwargs:
        raise ValueError("get_model_profile: give input_shape=, or args= and/or kwargs= for the model's call")
    call: Callable[..., Any] = getattr(model, "generate") if mode == "generate" else model
    model.eval()
    for _ in range(warm_up):
        call(*args, **kwargs)
    prof = FlopsProfiler(model)
    with prof.profiling(ignore_modules):
        call(*args, **kwargs)
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    if print_profile:
        prof.print_model_profile(profile_step=warm_up, module_depth=module_depth, top_modules=top_modules,
                                 detailed=detailed, output_file=output_file)
    prof.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)  # type: ignore[arg-type]
    return flops, macs, params


__all__ = ["FlopsProfiler", "ModelTotals", "ProfiledEngine", "get_model_profile", "number_to_string",
           "macs_to_string", "flops_to_string", "params_to_string", "duration_to_string", "bytes_to_string"]
