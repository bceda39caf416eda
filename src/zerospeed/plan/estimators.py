"""DeepSpeed's model-state memory estimators, same names, arguments, formulas and printed tables.

``estimate_zero2_model_states_mem_needs_all_live(model, ...)`` / ``..._all_cold(total_params, ...)`` and
the stage-3 pair (which also take the largest layer's parameters) print the per-CPU and per-GPU bytes of
DeepSpeed 0.19.6's ``deepspeed/runtime/zero/stage_1_and_2.py`` and ``stage3.py`` for each offload choice;
the ``..._mem_needs`` functions return them. They are rules of thumb about DeepSpeed's GPU engine (a
``additional_buffer_factor`` of slack on the CPU side); ``zerospeed plan`` is this project's own,
measured-against figure. Importable at DeepSpeed's paths (``deepspeed.runtime.zero.stage_1_and_2`` and
``deepspeed.runtime.zero.stage3``) through the alias package.
"""

from __future__ import annotations

from torch import nn

__all__ = ["estimate_zero2_model_states_mem_needs", "estimate_zero2_model_states_mem_needs_all_cold",
           "estimate_zero2_model_states_mem_needs_all_live", "estimate_zero3_model_states_mem_needs",
           "estimate_zero3_model_states_mem_needs_all_cold", "estimate_zero3_model_states_mem_needs_all_live",
           "model_to_params", "model_to_params_and_largest_layer"]

_CPU = "cpu "  # DeepSpeed prints f"{OffloadDeviceEnum.cpu:4}"


def estimate_zero2_model_states_mem_needs(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                          cpu_offload: bool = True,
                                          additional_buffer_factor: float = 1.5) -> tuple[int, int]:
    """(cpu bytes, gpu bytes) per process at ZeRO-2: 2 bytes of 16-bit parameters on the GPU, plus
    18 bytes per parameter sharded (16-bit and fp32 gradients, fp32 master, two Adam moments) unless
    offloaded; the CPU side holds fp32 copies times ``additional_buffer_factor``."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def model_to_params(model: nn.Module) -> int:
    """Parameters of ``model``, shared ones once (DeepSpeed's stage-2 ``model_to_params``)."""
    return sum({id(p): p.numel() for p in model.parameters()}.values())


def model_to_params_and_largest_layer(model: nn.Module) -> tuple[int, int]:
    """(total parameters, the most any one module holds directly): stage 3's ``model_to_params``."""
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return model_to_params(model), largest


def _header(total_params: int, num_gpus_per_node: int, num_nodes: int, extra: str = "") -> None:
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    print("Estimated memory needed for params, optim states and gradients for a:\n"
          f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.\n"
          f"SW: Model with {int(total_params / 1e6)}M total params{extra}.")
    print("  per CPU  |  per GPU |   Options")


def estimate_zero2_model_states_mem_needs_all_cold(total_params: int, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> None:
    """Print the ZeRO-2 table for a model of ``total_params`` parameters (offload to CPU, then none)."""
    _header(total_params, num_gpus_per_node, num_nodes)
    for cpu_offload in (True, False):
        cpu_mem, gpu_mem = estimate_zero2_model_states_mem_needs(
            total_params, num_gpus_per_node, num_nodes, cpu_offload, additional_buffer_factor)
        print(f" {cpu_mem / 2**30:7.2f}GB | {gpu_mem / 2**30:6.2f}GB | "
              f"offload_optimizer={_CPU if cpu_offload else 'none'}")


def estimate_zero2_model_states_mem_needs_all_live(model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Print the ZeRO-2 table for ``model`` (its parameters counted, shared ones once)."""
    estimate_zero2_model_states_mem_needs_all_cold(model_to_params(model), num_gpus_per_node, num_nodes,
                                                   additional_buffer_factor)


def estimate_zero3_model_states_mem_needs(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                                          num_nodes: int = 1, cpu_offload: bool = True, cpu_offload_params: bool = True,
                                          zero_init: bool = True,
                                          additional_buffer_factor: float = 1.5) -> tuple[int, int, int]:
    """(cpu bytes, gpu bytes, largest layer bytes) per process at ZeRO-3: the GPU holds the largest layer
    gathered in fp32 (4 bytes a parameter) plus what is not offloaded (2 bytes of 16-bit parameters, 18
    of optimizer state and gradients, sharded); ``zero_init`` lets the CPU side be sharded per node."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            per = 18 * gpus_factor if zero_init else max(4 * num_gpus_per_node, 18 * gpus_factor)
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            per = 16 * gpus_factor if zero_init else max(4 * num_gpus_per_node, 16 * gpus_factor)
        cpu_mem = total_params * per * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        held = largest_layer_params if zero_init else total_params
        cpu_mem = held * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory


def estimate_zero3_model_states_mem_needs_all_cold(total_params: int, largest_layer_params: int,
                                                   num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Print the ZeRO-3 table (offload of optimizer and parameters, zero_init on/off)."""
    _header(total_params, num_gpus_per_node, num_nodes, f", {int(largest_layer_params / 1e6)}M largest layer params")
    for cpu_offload in (True, False):
        for cpu_offload_params in (True, False):
            if not cpu_offload and cpu_offload_params:
                continue
            for zero_init in (True, False):
                cpu_mem, gpu_mem, _ = estimate_zero3_model_states_mem_needs(
                    total_params, largest_layer_params, num_gpus_per_node, num_nodes, cpu_offload,
                    cpu_offload_params, zero_init, additional_buffer_factor)
                options = (f"offload_param={_CPU if cpu_offload_params else 'none'}, "
                           f"offload_optimizer={_CPU if cpu_offload else 'none'}, zero_init={1 if zero_init else 0}")
                print(f" {cpu_mem / 2**30:7.2f}GB | {gpu_mem / 2**30:6.2f}GB | {options}")


def estimate_zero3_model_states_mem_needs_all_live(model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Print the ZeRO-3 table for ``model`` (total and largest layer counted from it)."""
    total, largest = model_to_params_and_largest_layer(model)
    estimate_zero3_model_states_mem_needs_all_cold(total, largest, num_gpus_per_node, num_nodes,
                                                   additional_buffer_factor)
