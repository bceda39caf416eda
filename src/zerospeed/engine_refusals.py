"""The DeepSpeed engine methods zerospeed refuses, as data: name -> why, and what to use instead.

A DeepSpeed script that calls one of these gets a :class:`NotImplementedError` naming
``engine.<name>`` and the replacement, instead of an ``AttributeError`` or a silent no-op.
:func:`install_refusals` turns the table into methods of the engine's API mixin
(:class:`zerospeed.engine_api.DeepSpeedEngineAPI`); ``docs/deepspeed_engine_api.md`` lists it.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Mapping, NoReturn

_REDUCES_ITSELF = ("the engine reduces gradients itself during engine.backward(loss) (bucketed, overlapped "
                   "with backward); use engine.backward(loss) and engine.step()")
_SPARSE = ("with \"sparse_gradients\": true (ZeRO stage 0) the engine itself exchanges Embedding/EmbeddingBag "
           "gradients as the rows each accumulation window touched, during engine.backward(loss); set that "
           "config key and use engine.backward(loss) and engine.step()")
_DEEPCOMPILE = ("DeepCompile is not part of zerospeed; use torch.compile on your own submodules "
                "(e.g. model.layer = torch.compile(model.layer) before zerospeed.initialize)")
_AUTOTUNING = ("autotuning is not part of zerospeed (engine.autotuning_enabled() is always False); use "
               "explicit batch sizes and zero_optimization keys in the config")
_CURRICULUM = ("curriculum learning / data efficiency is not part of zerospeed; use a dataset you order or "
               "filter yourself, passed as training_data (or to engine.deepspeed_io)")
_MOE = ("zerospeed checkpoints hold every expert by its global index in the model state (they reload at any "
        "ep_size); use engine.load_checkpoint(dir), or zerospeed convert for a plain state dict")

#: Every refused name of DeepSpeed 0.19.8's ``DeepSpeedEngine``, with the reason and the replacement.
REFUSED: Mapping[str, str] = MappingProxyType({
    # gradient reduction internals
    "all_gather_scalar": _REDUCES_ITSELF,
    "allreduce_and_copy": _REDUCES_ITSELF,
    "allreduce_bucket": _REDUCES_ITSELF,
    "allreduce_gradients": _REDUCES_ITSELF,
    "allreduce_no_retain": _REDUCES_ITSELF,
    "buffered_allreduce_fallback": _REDUCES_ITSELF,
    "sparse_all_gather": _SPARSE,
    "sparse_allreduce": _SPARSE,
    "sparse_allreduce_bucket": _SPARSE,
    "sparse_allreduce_no_retain": _SPARSE,
    "coalesce_grad_reduction": ("zerospeed already reduces once per accumulation window at stages 0-1 (at its "
                                "last micro-batch) and reduce-scatters each micro-batch into shards at stages "
                                "2-3; use engine.backward(loss) per micro-batch and engine.step()"),
    "clip_fp32_gradients": ("gradients live in the engine's buffers, not param.grad; engine.step() clips "
                            "them to the config's gradient_clipping (use that key)"),
    "scale": ("a manual loss.backward() bypasses the engine's gradient hooks; use engine.backward(loss), "
              "which scales the loss by the live loss scale (engine.cur_scale)"),
    "get_optimizer_configuration": ("DeepSpeed's internal optimizer-class choice; use the config's "
                                    "\"optimizer\" section, from which zerospeed builds engine.optimizer"),
    # state placement
    "offload_states": ("states stay where zero_optimization.offload_optimizer / offload_param put them; "
                       "use those config keys (engine.empty_partition_cache() frees gathered ZeRO-3 parameters)"),
    "reload_states": ("states are never moved off by engine.offload_states (refused); use "
                      "zero_optimization.offload_optimizer / offload_param in the config"),
    # compilation
    "compile": ("compiling the whole engine would trace through its gradient hooks; use torch.compile on your "
                "own submodules (e.g. model.block = torch.compile(model.block)) before zerospeed.initialize"),
    "get_autosp_backend": _DEEPCOMPILE,
    "get_autotp_backend": _DEEPCOMPILE,
    "get_deepcompile_backend": _DEEPCOMPILE,
    "get_deepspeed_compile_backend": _DEEPCOMPILE,
    "get_compile_time": _DEEPCOMPILE,
    "register_compile_pass": _DEEPCOMPILE,
    # autotuning
    "autotuning_end_profile_step": _AUTOTUNING,
    "autotuning_metric": _AUTOTUNING,
    "autotuning_metric_path": _AUTOTUNING,
    "autotuning_model_info_path": _AUTOTUNING,
    "autotuning_profile_model_info": _AUTOTUNING,
    "autotuning_start_profile_step": _AUTOTUNING,
    # data efficiency
    "random_ltd_initialize": _CURRICULUM,
    "set_custom_curriculum_learning_schedule": _CURRICULUM,
    "set_data_post_process_func": ("zerospeed's DistributedLoader has no post-process hook; use a collate_fn "
                                   "(zerospeed.initialize(collate_fn=...) or engine.deepspeed_io(collate_fn=...))"),
    # expert parallelism
    "load_moe_state_dict": _MOE,
    # reporting
    "get_wall_clock_timers": ("with wall_clock_breakdown: true the engine logs per-phase times every "
                              "steps_per_print steps; use that config key and read the log"),
    "print_forward_breakdown": ("with wall_clock_breakdown: true the engine logs per-phase times (forward "
                                "included) every steps_per_print steps; use that config key"),
    "swap_tensor_config": ("DeepSpeed 0.19.8's own config no longer has it (the call fails there too); use "
                           "engine.aio_config() and engine.zero_offload_optimizer() / zero_offload_param()"),
})

#: Refused DeepSpeed names that are static methods there (callable on the class).
REFUSED_STATIC: frozenset[str] = frozenset({"load_moe_state_dict"})

REFUSED_MARK = "__zerospeed_refused__"


def refusal_message(name: str, why: str) -> str:
    """The error text for a refused call: the name, then why and what to use instead."""
    return f"engine.{name} is not supported by zerospeed: {why}"


def _refused(name: str, why: str) -> Callable[..., NoReturn]:
    def refused(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(refusal_message(name, why))

    refused.__name__ = refused.__qualname__ = name
    refused.__doc__ = f"Not supported by zerospeed: {why}."
    setattr(refused, REFUSED_MARK, why)
    return refused


def install_refusals(cls: type) -> type:
    """Give ``cls`` a refusing method for every name of :data:`REFUSED` it does not define itself."""
    for name, why in REFUSED.items():
        if any(name in vars(klass) for klass in cls.__mro__ if klass is not object):
            raise TypeError(f"{cls.__name__}.{name} is both implemented and refused; drop it from REFUSED")
        function = _refused(name, why)
        setattr(cls, name, staticmethod(function) if name in REFUSED_STATIC else function)
    return cls


def is_refused(attribute: Any) -> bool:
    """Whether an attribute looked up on the engine class is one of the refusals."""
    return hasattr(attribute, REFUSED_MARK)


__all__ = ["REFUSED", "REFUSED_STATIC", "install_refusals", "is_refused", "refusal_message"]
