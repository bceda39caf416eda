"""Plain policies built from a resolved config: exact values, "auto" refused by key, no import cycle."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
from types import MappingProxyType
from typing import Any, get_type_hints

import pytest

import zerospeed.config as config_pkg
from zerospeed.config import AUTO, Auto, ConfigError, FrozenDict, OffloadDevice, load_config
from zerospeed.config.policies import (
    LossScalePolicy,
    OptimizerOffload,
    ParamOffload,
    TrainingPolicy,
    ZeroPolicy,
)
from zerospeed.config.specs import OptimizerSpec, SchedulerSpec

BATCH = {"train_micro_batch_size_per_gpu": 2}


def cfg(**sections: Any) -> Any:
    return load_config({**BATCH, **sections}, world_size=2)


def test_zero_policy_carries_every_value_the_components_read() -> None:
    zero = ZeroPolicy.from_config(cfg(zero_optimization={
        "stage": 3, "reduce_bucket_size": 5e7, "allgather_bucket_size": 1234,
        "stage3_prefetch_bucket_size": 99, "stage3_param_persistence_threshold": 7,
        "stage3_max_live_parameters": 11, "stage3_max_reuse_distance": 13, "sub_group_size": 17,
        "offload_optimizer": {"device": "cpu", "ratio": 0.5, "buffer_count": 6, "pin_memory": False},
        "offload_param": {"device": "cpu", "max_in_cpu": 21, "buffer_count": 3}}).zero_optimization)
    assert zero == ZeroPolicy(
        stage=3, reduce_bucket_size=50_000_000, allgather_bucket_size=1234, prefetch_bucket_size=99,
        param_persistence_threshold=7, max_live_parameters=11, max_reuse_distance=13, overlap_comm=True,
        sub_group_size=17,
        offload_optimizer=OptimizerOffload(device=OffloadDevice.CPU, pin_memory=False, buffer_count=6,
                                           ratio=0.5),
        offload_param=ParamOffload(device=OffloadDevice.CPU, buffer_count=3, max_in_cpu=21))
    assert type(zero.reduce_bucket_size) is int and zero.offloads_optimizer
    assert zero.offload_param.enabled


def test_zero_policy_defaults_match_the_section_defaults() -> None:
    """A policy built from an empty section equals the dataclass defaults (one source of truth)."""
    section = cfg(zero_optimization={"stage": 1}).zero_optimization
    policy = ZeroPolicy.from_config(section)
    assert dataclasses.replace(policy, overlap_comm=True) == ZeroPolicy(stage=1)
    assert policy.overlap_comm is False  # DeepSpeed: off below stage 3 unless asked
    assert not policy.offloads_optimizer


@pytest.mark.parametrize("stage, asked, expected", [(1, None, False), (3, None, True), (2, True, True),
                                                    (3, False, False)])
def test_overlap_comm_is_settled(stage: int, asked: bool | None, expected: bool) -> None:
    zero: dict[str, Any] = {"stage": stage}
    if asked is not None:
        zero["overlap_comm"] = asked
    assert ZeroPolicy.from_config(cfg(zero_optimization=zero).zero_optimization).overlap_comm is expected


@pytest.mark.parametrize("zero, key", [
    ({"stage": "auto"}, "zero_optimization.stage"),
    ({"stage": 3, "reduce_bucket_size": "auto"}, "zero_optimization.reduce_bucket_size"),
    ({"stage": 3, "stage3_prefetch_bucket_size": "auto"}, "zero_optimization.stage3_prefetch_bucket_size"),
    ({"stage": 3, "stage3_param_persistence_threshold": "auto"},
     "zero_optimization.stage3_param_persistence_threshold"),
])
def test_zero_policy_refuses_auto_by_key(zero: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        ZeroPolicy.from_config(cfg(zero_optimization=zero).zero_optimization)
    assert err.value.problems == (f'{key}: "auto" is not resolved yet; set it in the config or call '
                                  "resolve_auto first",)


def test_training_policy() -> None:
    c = load_config({"train_batch_size": 16, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
                     "steps_per_print": 10}, world_size=2)
    assert TrainingPolicy.from_config(c) == TrainingPolicy(16, 4, 2, 0.5, 10)
    assert TrainingPolicy.from_config(cfg()) == TrainingPolicy(4, 2, 1, 1.0, None)
    with pytest.raises(ConfigError, match='^gradient_clipping: "auto" is not resolved yet'):
        TrainingPolicy.from_config(cfg(gradient_clipping="auto"))
    with pytest.raises(ConfigError, match='^train_batch_size: "auto" is not resolved yet'):
        TrainingPolicy.from_config(load_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2}))


def test_loss_scale_policy() -> None:
    assert LossScalePolicy.from_fp16(cfg().fp16) is None
    assert LossScalePolicy.from_fp16(cfg(fp16={"enabled": True, "loss_scale": 128}).fp16) == LossScalePolicy(
        dynamic=False, initial_scale=128.0)
    dynamic = LossScalePolicy.from_fp16(cfg(fp16={
        "enabled": True, "initial_scale_power": 12, "loss_scale_window": 50, "hysteresis": 3,
        "consecutive_hysteresis": True, "min_loss_scale": 0.5}).fp16)
    assert dynamic == LossScalePolicy(dynamic=True, initial_scale=4096.0, scale_window=50, min_scale=0.5,
                                      hysteresis=3, consecutive_hysteresis=True)
    with pytest.raises(ConfigError, match=r'^fp16.enabled: "auto" is not resolved yet'):
        LossScalePolicy.from_fp16(cfg(fp16={"enabled": "auto"}).fp16)


def test_optimizer_spec_is_plain() -> None:
    section = cfg(optimizer={"type": "adamw", "params": {"lr": 0.01, "betas": [0.8, 0.9]}}).optimizer
    spec = OptimizerSpec.from_config(section)
    assert spec == OptimizerSpec("AdamW", MappingProxyType({"lr": 0.01, "betas": (0.8, 0.9)}))
    kwargs = spec.kwargs()
    kwargs.pop("lr")
    assert spec.kwargs() == {"lr": 0.01, "betas": (0.8, 0.9)}  # a fresh copy each time
    assert not isinstance(spec.params, FrozenDict)


def test_scheduler_spec_is_plain_with_defaults() -> None:
    section = cfg(scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": [0.0, 0.1],
                                                             "warmup_max_lr": [0.1, 0.2]}}).scheduler
    spec = SchedulerSpec.from_config(section)
    assert spec.type == "WarmupLR"
    assert spec.kwargs() == {"warmup_min_lr": [0.0, 0.1], "warmup_max_lr": [0.1, 0.2],
                             "warmup_num_steps": 1000, "warmup_type": "log", "last_batch_iteration": -1}


def test_no_policy_field_admits_auto() -> None:
    for cls in (ZeroPolicy, OptimizerOffload, ParamOffload, LossScalePolicy, TrainingPolicy, OptimizerSpec,
                SchedulerSpec):
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
        for name, hint in get_type_hints(cls).items():
            assert "Auto" not in repr(hint), f"{cls.__name__}.{name}: {hint!r}"


def test_resolve_auto_returns_a_new_config_and_leaves_the_old_one() -> None:
    before = load_config({**BATCH, "gradient_clipping": "auto", "zero_optimization": {"stage": "auto"}})
    snapshot = before.to_dict()
    after = before.resolve_auto({"gradient_clipping": 0.5, "zero_optimization.stage": 3})
    assert after is not before and before.to_dict() == snapshot
    assert before.gradient_clipping is AUTO and isinstance(before.zero_optimization.stage, Auto)
    assert (after.gradient_clipping, after.zero_optimization.stage, after.world_size) == (0.5, 3, 1)
    assert after.zero_optimization.overlap_comm is True  # the stage-dependent default is filled in anew


def test_config_package_has_no_import_cycle() -> None:
    """Every ``from .x import`` inside ``zerospeed.config`` (type-checking-only imports included)."""
    root = pathlib.Path(config_pkg.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in root.glob("*.py"):
        edges = graph.setdefault(path.stem, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                targets = [node.module] if node.module else [a.name for a in node.names]
                edges.update(t.split(".")[0] for t in targets)
    done: set[str] = set()

    def visit(module: str, stack: tuple[str, ...]) -> None:
        assert module not in stack, "import cycle: " + " -> ".join(stack[stack.index(module):] + (module,))
        if module in done or module not in graph:
            return
        for target in sorted(graph[module]):
            visit(target, stack + (module,))
        done.add(module)

    for module in sorted(graph):
        visit(module, ())
