"""Per-module sums over a profile and the printed profile, in DeepSpeed's layout.

A module's numbers are its own plus its children's; a module reachable twice in the tree (shared) is
counted once in every sum, and parameters are counted by identity (a tied weight once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TextIO

from torch import nn

from zerospeed.profiling.flops_profiler.counter import OpTally
from zerospeed.profiling.flops_profiler.units import (DEFAULT_PRECISION, duration_to_string, flops_to_string,
                                                      macs_to_string, number_to_string, params_to_string)

LINE = "{:<70}  {:<8}"


def _subtree(module: nn.Module) -> list[nn.Module]:
    return list(module.modules())  # each module once, shared ones included once


def module_flops(tally: OpTally, module: nn.Module) -> int:
    """Forward FLOPs of ``module`` and everything below it."""
    return sum(tally.of(m).flops for m in _subtree(module))


def module_macs(tally: OpTally, module: nn.Module) -> int:
    return sum(tally.of(m).macs for m in _subtree(module))


def module_params(module: nn.Module) -> int:
    """Parameters of ``module`` and below, each tensor once (a tied weight once; a ZeRO-3 partitioned
    parameter by its full size, ``ds_numel``)."""
    return sum(param_numel(p) for p in module.parameters())


def param_numel(param: nn.Parameter) -> int:
    return int(getattr(param, "ds_numel", param.numel()))


def module_duration(tally: OpTally, module: nn.Module) -> float:
    """Forward seconds of ``module``; a container never called itself (a ``ModuleList``) takes its
    children's sum, as DeepSpeed."""
    own = tally.of(module).duration
    if own == 0:
        return sum(module_duration(tally, child) for child in module.children())
    return own


@dataclass(frozen=True)
class RunFacts:
    """What the engine tells the printed summary (DeepSpeed reads them from its engine)."""

    world_size: int
    dp_size: int
    mp_size: int
    micro_batch: int


@dataclass(frozen=True)
class Summary:
    """The totals printed at the top; ``model_*`` are summed over the model-parallel ranks."""

    params: int
    fwd_flops: int
    fwd_macs: int
    bwd_flops: int
    bwd_macs: int
    fwd_latency: float
    model_params: int | None = None
    model_fwd_flops: int | None = None
    model_bwd_flops: int | None = None
    bwd_latency: float | None = None
    step_latency: float | None = None


def _rate(flops: float, seconds: float) -> str:
    return flops_to_string(flops / seconds if seconds > 0 else 0.0)


def print_summary(out: TextIO, summary: Summary, profile_step: int, facts: RunFacts | None) -> None:
    def line(label: str, value: object) -> None:
        print(LINE.format(label, value), file=out)

    print("\n-------------------------- DeepSpeed Flops Profiler --------------------------", file=out)
    print(f"Profile Summary at step {profile_step}:", file=out)
    print("Notations:\n"
          "data parallel size (dp_size), model parallel size(mp_size),\n"
          "number of parameters (params), number of multiply-accumulate operations(MACs),\n"
          "number of floating-point operations (flops), floating-point operations per second (FLOPS),\n"
          "fwd latency (forward propagation latency), bwd latency (backward propagation latency),\n"
          "step (weights update latency), iter latency (sum of fwd, bwd and step latency)\n"
          "bwd flops and MACs are measured (the operations backward ran), not assumed 2 * fwd\n", file=out)
    if facts is not None:
        line("world size: ", facts.world_size)
        line("data parallel size: ", facts.dp_size)
        line("model parallel size: ", facts.mp_size)
        line("batch size per GPU: ", facts.micro_batch)
    line("params per GPU: ", params_to_string(summary.params))
    if summary.model_params is not None:
        line("params of model (sum over model-parallel ranks, each tensor once): ",
             params_to_string(summary.model_params))
    line("fwd MACs per GPU: ", macs_to_string(summary.fwd_macs))
    line("fwd flops per GPU: ", number_to_string(summary.fwd_flops))
    if summary.model_fwd_flops is not None:
        line("fwd flops of model (sum over model-parallel ranks): ", number_to_string(summary.model_fwd_flops))
    line("fwd latency: ", duration_to_string(summary.fwd_latency))
    line("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ", _rate(summary.fwd_flops, summary.fwd_latency))
    line("bwd MACs per GPU: ", macs_to_string(summary.bwd_macs))
    line("bwd flops per GPU: ", number_to_string(summary.bwd_flops))
    if summary.model_bwd_flops is not None:
        line("bwd flops of model (sum over model-parallel ranks): ", number_to_string(summary.model_bwd_flops))
    both = summary.fwd_flops + summary.bwd_flops
    if summary.bwd_latency is not None:
        line("bwd latency: ", duration_to_string(summary.bwd_latency))
        line("bwd FLOPS per GPU = bwd flops per GPU / bwd latency: ", _rate(summary.bwd_flops, summary.bwd_latency))
        line("fwd+bwd FLOPS per GPU = (fwd+bwd flops per GPU) / (fwd+bwd latency): ",
             _rate(both, summary.fwd_latency + summary.bwd_latency))
    if summary.bwd_latency is not None and summary.step_latency is not None:
        iteration = summary.fwd_latency + summary.bwd_latency + summary.step_latency
        line("step latency: ", duration_to_string(summary.step_latency))
        line("iter latency: ", duration_to_string(iteration))
        line("FLOPS per GPU = (fwd+bwd flops per GPU) / iter latency: ", _rate(both, iteration))
        if facts is not None and iteration > 0:  # DeepSpeed multiplies by the world size; the batch is split over dp
            line("samples/second: ", round(facts.micro_batch * facts.dp_size / iteration, DEFAULT_PRECISION))


def print_aggregated(out: TextIO, tally: OpTally, model: nn.Module, module_depth: int = -1,
                     top_modules: int = 1) -> None:
    """The ``top_modules`` module classes by params, MACs and fwd latency at each depth (DeepSpeed's
    ``print_model_aggregated_profile``)."""
    info: list[dict[str, list[float]]] = []

    def walk(module: nn.Module, depth: int) -> None:
        if depth == len(info):
            info.append({})
        row = info[depth].setdefault(type(module).__name__, [0, 0, 0.0])
        row[0] += module_macs(tally, module)
        row[1] += module_params(module)
        row[2] += module_duration(tally, module)
        for child in module.children():
            walk(child, depth + 1)

    walk(model, 0)
    depth = len(info) - 1 if module_depth == -1 else module_depth
    print(f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:", file=out)
    for d in range(min(depth, len(info))):
        n = min(top_modules, len(info[d]))

        def top(index: int, fmt: Callable[[float], str]) -> dict[str, str]:
            ranked = sorted(info[d].items(), key=lambda item: item[1][index], reverse=True)[:n]
            return {name: fmt(row[index]) for name, row in ranked}

        print(f"depth {d}:", file=out)
        print(f"    params      - {top(1, params_to_string)}", file=out)
        print(f"    MACs        - {top(0, macs_to_string)}", file=out)
        print(f"    fwd latency - {top(2, duration_to_string)}", file=out)


def describe_module(tally: OpTally, module: nn.Module, totals: Summary) -> str:
    """One module's profile items, then its own ``extra_repr`` (DeepSpeed's detailed line)."""
    params, macs = module_params(module), module_macs(tally, module)
    duration, flops = module_duration(tally, module), module_flops(tally, module)
    total_duration = totals.fwd_latency

    def share(part: float, whole: float) -> float:
        return round(100 * part / whole, DEFAULT_PRECISION) if whole else 0

    items = [f"{params_to_string(params)} = {share(params, totals.params):g}% Params",
             f"{macs_to_string(macs)} = {share(macs, totals.fwd_macs):g}% MACs",
             f"{duration_to_string(duration)} = {share(duration, total_duration):g}% latency",
             flops_to_string(round(flops / duration, DEFAULT_PRECISION) if duration else 0)]
    own = module.extra_repr()
    if own:
        items.append(own)
    return ", ".join(items)


def module_tree(tally: OpTally, module: nn.Module, totals: Summary) -> str:
    """``repr(module)`` with each module's profile in place of its ``extra_repr`` (the module is not
    changed)."""
    extra = describe_module(tally, module, totals)
    children = [f"({name}): " + _indent(module_tree(tally, child, totals)) for name, child in module.named_children()]
    name = type(module).__name__
    if not children:
        return f"{name}({extra})"
    body = "\n  ".join([extra, *children])
    return f"{name}(\n  {body}\n)"


def _indent(text: str) -> str:
    return text.replace("\n", "\n  ")


DETAILED_NOTE = (
    "Each module profile is listed after its name in the following order: \nparams, percentage of total params, "
    "MACs, percentage of total MACs, fwd latency, percentage of total fwd latency, fwd FLOPS\n\n"
    "Note: 1. A module can have torch.nn.module or torch.nn.functional to compute logits (e.g. CrossEntropyLoss). "
    "They are not counted as submodules, thus not to be printed out. However they make up the difference between "
    "a parent's MACs (or latency) and the sum of its submodules'.\n2. Number of floating-point operations is a "
    "theoretical estimation, thus FLOPS computed using that could be larger than the maximum system throughput.\n"
    "3. The fwd latency listed in the top module's profile is directly captured at the module forward function "
    "in PyTorch, thus it's less than the fwd latency shown above which is captured in zerospeed.\n")


def print_profile(out: TextIO, tally: OpTally, model: nn.Module, summary: Summary, *, profile_step: int,
                  module_depth: int, top_modules: int, detailed: bool, facts: RunFacts | None) -> None:
    """The whole printed profile: summary, aggregated profile, and (``detailed``) the module tree."""
    print_summary(out, summary, profile_step, facts)
    print("\n----------------------------- Aggregated Profile per GPU -----------------------------", file=out)
    print_aggregated(out, tally, model, module_depth, top_modules)
    if detailed:
        print("\n------------------------------ Detailed Profile per GPU ------------------------------", file=out)
        print(DETAILED_NOTE, file=out)
        print(module_tree(tally, model, summary), file=out)
    print("------------------------------------------------------------------------------", file=out)


__all__ = ["RunFacts", "Summary", "module_flops", "module_macs", "module_params", "param_numel", "module_duration",
           "print_summary", "print_aggregated", "module_tree", "print_profile"]
