"""DeepSpeed's accelerator interface: every name exists, and the CPU accelerator behaves for real."""

from __future__ import annotations

import contextlib

import pytest
import torch

import zerospeed.accelerator as accel_module
from zerospeed.accelerator import (
    AcceleratorFeatureUnsupported,
    DeepSpeedAccelerator,
    get_accelerator,
    is_current_accelerator_supported,
    set_accelerator,
)
from zerospeed.accelerator.cpu_accelerator import CPU_Accelerator
from zerospeed.accelerator.cuda_accelerator import CUDA_Accelerator

# dir(deepspeed.accelerator.DeepSpeedAccelerator) in DeepSpeed 0.19.8, dunders left out (85 names).
DS_INTERFACE = """
BFloat16Tensor ByteTensor DoubleTensor Event FloatTensor HalfTensor IntTensor LongTensor Stream
_abc_impl _pin_fresh _require_host_device _shape_numel _torch_empty_pinned _torch_is_pinned
_torch_pin_memory _torch_pins_host_memory available_memory build_extension capture_to_graph
communication_backend_name create_graph create_op_builder current_device current_device_name
current_stream default_generator default_stream device device_count device_name empty_cache
export_envs get_compile_backend get_op_builder get_rng_state handles_memory_backpressure initial_seed
is_available is_bf16_supported is_current_stream_capturing is_fp16_supported is_fp64_supported
is_pinned is_synchronized_device is_triton_supported lazy_call manual_seed manual_seed_all
max_memory_allocated max_memory_cached max_memory_reserved memory_allocated memory_cached
memory_reserved memory_stats on_accelerator op_builder_dir pin_empty pin_empty_like pin_memory
pin_memory_alignment prefer_triton_grouped_mm random range_pop range_push register_host_memory
replay_graph reset_max_memory_allocated reset_max_memory_cached reset_peak_memory_stats
resolves_data_dependency set_compile_backend set_device set_rng_state set_visible_devices_envs
stream supported_dtypes supports_nvtx_domain synchronize total_memory unpin_memory
unregister_host_memory use_host_timers visible_devices_envs
""".split()
# Attributes DeepSpeed's __init__ sets on every accelerator.
DS_INSTANCE_ATTRS = ["_name", "_communication_backend_name", "_compile_backend"]
# The names DeepSpeed's base class leaves abstract: a user subclass implements these and no more.
DS_ABSTRACT = set(DS_INTERFACE) - {
    "_abc_impl", "_pin_fresh", "_require_host_device", "_shape_numel", "_torch_empty_pinned",
    "_torch_is_pinned", "_torch_pin_memory", "_torch_pins_host_memory", "is_current_stream_capturing",
    "is_fp64_supported", "is_pinned", "pin_empty", "pin_empty_like", "pin_memory",
    "pin_memory_alignment", "prefer_triton_grouped_mm", "register_host_memory", "supports_nvtx_domain",
    "unpin_memory", "unregister_host_memory",
}
# deepspeed.accelerator's public names.
DS_PACKAGE_EXPORTS = ["DeepSpeedAccelerator", "get_accelerator", "set_accelerator",
                      "is_current_accelerator_supported", "abstract_accelerator", "real_accelerator"]


@pytest.fixture
def cpu() -> CPU_Accelerator:
    return CPU_Accelerator()


def test_interface_names_exist_on_both_accelerators() -> None:
    assert len(DS_INTERFACE) == 85 and len(DS_ABSTRACT) == 65
    for cls in (DeepSpeedAccelerator, CPU_Accelerator, CUDA_Accelerator):
        missing = [name for name in DS_INTERFACE if not hasattr(cls, name)]
        assert missing == [], f"{cls.__name__} lacks {missing}"
    for acc in (CPU_Accelerator(), CUDA_Accelerator()):  # CUDA builds without a GPU
        assert all(isinstance(getattr(acc, a), str) for a in DS_INSTANCE_ATTRS)
    assert set(DeepSpeedAccelerator.__abstractmethods__) <= DS_ABSTRACT
    assert [n for n in DS_PACKAGE_EXPORTS if not hasattr(accel_module, n)] == []


def test_user_accelerator_written_for_deepspeed_subclasses_ours() -> None:
    body = {name: (lambda self, *a, **k: None) for name in DS_ABSTRACT}
    Custom = type("Custom", (DeepSpeedAccelerator,), body)
    custom = Custom()  # instantiable: we demand nothing beyond DeepSpeed's abstract methods
    assert custom._name is None and custom.pin_memory_alignment() == 1


def test_device_answers(cpu: CPU_Accelerator, monkeypatch: pytest.MonkeyPatch) -> None:
    assert (cpu.device_name(), cpu.device_name(3), cpu.current_device_name()) == ("cpu", "cpu", "cpu")
    assert cpu.device(1) == torch.device("cpu") and cpu.torch_device(1) == torch.device("cpu")
    assert (cpu.communication_backend_name(), cpu.backend, cpu._name) == ("gloo", "gloo", "cpu")
    assert cpu.is_available() and cpu.is_synchronized_device() and cpu.use_host_timers()
    cpu.set_device(0)
    cpu.synchronize()
    monkeypatch.setenv("LOCAL_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert (cpu.device_count(), cpu.current_device()) == (3, 2)
    monkeypatch.delenv("LOCAL_SIZE")
    assert cpu.device_count() >= 1
    cuda = CUDA_Accelerator()
    assert (cuda.device_name(), cuda.device_name(2), cuda.device(2)) == ("cuda", "cuda:2", torch.device("cuda", 2))
    assert (cuda.backend, cuda.torch_device(1), cuda.export_envs()) == ("nccl", torch.device("cuda", 1), ["NCCL"])


def test_pinning_round_trip(cpu: CPU_Accelerator) -> None:
    t = torch.arange(6.0).reshape(2, 3)
    pinned = cpu.pin_memory(t)
    assert torch.equal(pinned, t) and cpu.is_pinned(pinned) == pinned.is_pinned()
    fresh = cpu.pin_memory(t, make_copy=False, match_shape=False)
    assert fresh.shape == (6,) and fresh.dtype == t.dtype
    assert cpu.pin_empty(2, 3, dtype=torch.bfloat16).shape == (2, 3)
    assert cpu.pin_empty((4,), dtype=torch.int32).dtype == torch.int32
    like = cpu.pin_empty_like(t, dtype=torch.float16)
    assert (like.shape, like.dtype) == (t.shape, torch.float16)
    assert cpu.unpin_memory(pinned) is None and cpu.register_host_memory(0, 0) is False
    with pytest.raises(ValueError, match="pass device='cpu'"):
        cpu.pin_empty(2, dtype=torch.float32, device="cuda")
    assert cpu.on_accelerator(t) and not CUDA_Accelerator().on_accelerator(t)


def test_rng(cpu: CPU_Accelerator) -> None:
    cpu.manual_seed(7)
    first = torch.rand(4)
    cpu.manual_seed_all(7)
    assert torch.equal(torch.rand(4), first) and cpu.initial_seed() == 7
    state = cpu.get_rng_state()
    after = torch.rand(4)
    cpu.set_rng_state(state)
    assert torch.equal(torch.rand(4), after)
    assert cpu.default_generator(0) is torch.default_generator and cpu.random() is torch.random


def test_memory_queries_are_ints(cpu: CPU_Accelerator) -> None:
    for query in ("memory_allocated", "max_memory_allocated", "memory_cached", "max_memory_cached",
                  "memory_reserved", "max_memory_reserved", "total_memory", "available_memory"):
        value = getattr(cpu, query)()
        assert isinstance(value, int) and value > 0, query
    now = cpu.memory_allocated()
    assert cpu.max_memory_allocated() >= now  # the peak mark never trails a reading
    assert cpu.total_memory() >= cpu.available_memory()
    stats = cpu.memory_stats()
    assert stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"]
    cpu.reset_peak_memory_stats()
    cpu.reset_max_memory_allocated()
    cpu.reset_max_memory_cached()
    cpu.empty_cache()


def test_streams_and_events_run_cuda_style_code(cpu: CPU_Accelerator) -> None:
    side = cpu.Stream()
    start, end = cpu.Event(enable_timing=True), cpu.Event(enable_timing=True)
    start.record()
    with cpu.stream(side):
        y = torch.ones(3) * 2
    side.record_event(end)
    cpu.current_stream().wait_stream(side)
    cpu.default_stream().wait_event(end)
    side.synchronize()
    end.synchronize()
    assert torch.equal(y, torch.full((3,), 2.0)) and side.query() and end.query()
    assert start.elapsed_time(end) >= 0.0
    with pytest.raises(RuntimeError, match="record"):
        cpu.Event().elapsed_time(cpu.Event())
    assert cpu.new_stream() is None  # zerospeed's internal ask: nothing to overlap on a CPU
    with cpu.stream(None):
        pass
    graph = cpu.create_graph()
    with cpu.capture_to_graph(graph):
        pass
    cpu.replay_graph(graph)
    assert not cpu.is_current_stream_capturing()
    assert cpu.range_push("x") is None and cpu.range_pop() is None
    assert cpu.lazy_call(lambda: 5) == 5


@pytest.mark.parametrize("name,dtype", [
    ("BFloat16Tensor", torch.bfloat16), ("ByteTensor", torch.uint8), ("DoubleTensor", torch.float64),
    ("FloatTensor", torch.float32), ("HalfTensor", torch.float16), ("IntTensor", torch.int32),
    ("LongTensor", torch.int64),
])
def test_tensor_types(cpu: CPU_Accelerator, name: str, dtype: torch.dtype) -> None:
    t = getattr(cpu, name)([1, 2])
    assert (t.dtype, t.device.type, t.tolist()) == (dtype, "cpu", [1, 2])


def test_dtypes(cpu: CPU_Accelerator) -> None:
    dtypes = cpu.supported_dtypes()
    assert torch.float32 in dtypes and torch.bfloat16 in dtypes and cpu.is_bf16_supported()
    assert (torch.float16 in dtypes) == cpu.is_fp16_supported()
    assert cpu.is_fp64_supported() and not cpu.is_triton_supported()


def test_refusals_and_environment(cpu: CPU_Accelerator) -> None:
    assert cpu.get_op_builder("CPUAdamBuilder") is None and cpu.create_op_builder("FusedAdamBuilder") is None
    with pytest.raises(AcceleratorFeatureUnsupported, match="zerospeed.ops"):
        cpu.op_builder_dir()
    with pytest.raises(NotImplementedError, match="BuildExtension"):
        cpu.build_extension()
    env: dict[str, str] = {}
    cpu.set_visible_devices_envs(env, [0, 2])
    assert env == {"CUDA_VISIBLE_DEVICES": "0,2"} and cpu.visible_devices_envs() == ["CUDA_VISIBLE_DEVICES"]
    assert cpu.export_envs() == [] and cpu.get_compile_backend() == "inductor"
    with pytest.raises(ValueError, match="not available on cpu"):
        cpu.set_compile_backend("no-such-backend")


def test_process_accelerator_get_set() -> None:
    before = get_accelerator()
    assert get_accelerator() is before and is_current_accelerator_supported()
    mine = CPU_Accelerator()
    try:
        set_accelerator(mine)
        assert get_accelerator() is mine
        with pytest.raises(TypeError, match="DeepSpeedAccelerator"):
            set_accelerator("cpu")  # type: ignore[arg-type]
    finally:
        set_accelerator(before)
    assert get_accelerator() is before
    assert isinstance(get_accelerator({"DS_ACCELERATOR": "cpu"}), CPU_Accelerator)
    with pytest.raises(ValueError, match="DS_ACCELERATOR='xpu'"):
        get_accelerator({"DS_ACCELERATOR": "xpu"})
    with contextlib.suppress(RuntimeError):  # no GPU here: refused with a clear message instead
        assert isinstance(get_accelerator({"ZEROSPEED_ACCELERATOR": "cuda", "DS_ACCELERATOR": "cpu"}),
                          CUDA_Accelerator)
