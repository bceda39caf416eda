"""``InferenceEngine``: a model prepared for serving, with DeepSpeed's public surface.

Construction resolves the config once (:func:`~zerospeed.inference.settings.resolve_settings`), starts
the process group and takes the tensor-parallel ``Comm`` when the degree is above one (as ``initialize``
does), applies the transforms the factory builds (checkpoint, dtype, tensor-parallel split, device,
then kernel injection, int8 and ZeRO-Inference), and puts the model in ``eval()`` mode. Calls run
under ``torch.no_grad()`` (not inference mode: tensors made during a call stay usable by the caller
and by caches the transforms keep). With tp > 1 every rank runs the same calls; the ranks start from
rank 0's random state (as DeepSpeed does), so sampling draws the same tokens everywhere.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from zerospeed.distributed.comm import Comm
from zerospeed.inference.config import DeepSpeedInferenceConfig, parse_inference_config
from zerospeed.inference.settings import InferenceSettings, resolve_settings
from zerospeed.inference.transforms import ModelTransform, ZeroInferencePlacement, build_transforms


class InferenceEngine(nn.Module):
    """DeepSpeed's ``InferenceEngine``: ``engine(*inputs)``, ``engine.generate(...)``, ``engine.module``."""

    def __init__(self, model: nn.Module, config: DeepSpeedInferenceConfig | Mapping[str, Any] | None = None) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"init_inference: model is a {type(model).__name__}; expected a torch.nn.Module")
        if not isinstance(config, DeepSpeedInferenceConfig):
            config = parse_inference_config(config or {})
        from zerospeed.accelerator import get_accelerator

        accel = get_accelerator()
        self._config = config
        self.settings: InferenceSettings = resolve_settings(
            config, device_type=accel.device_type, supported_dtypes=tuple(accel.supported_dtypes()))
        self.tp_comm: Comm | None = _tp_comm(self.settings)
        device = torch.device(accel.current_device_name())
        self.transforms: tuple[ModelTransform, ...] = build_transforms(self.settings, comm=self.tp_comm,
                                                                       device=device)
        for transform in self.transforms:
            model = transform.apply(model)
        model.eval()
        self.module = model
        self.injection_dict = None if config.injection_policy is None else dict(config.injection_policy)
        self.mp_group = None if self.tp_comm is None else self.tp_comm.group
        self.mpu = self.settings.mpu
        self._model_times: list[float] = []
        self.model_profile_enabled = False
        self._start = 0.0
        if self.tp_comm is not None and self.tp_comm.world_size > 1:
            _share_rng_state(self.tp_comm)

    # -- DeepSpeed's attributes ------------------------------------------------------------------
    @property
    def config(self) -> Any:
        """The model's config (``config``/``args`` in the inference config overrides it), as DeepSpeed."""
        given = self._config.config
        return given if given is not None else getattr(self.module, "config", None)

    @property
    def tp_size(self) -> int:
        return 1 if self.tp_comm is None else self.tp_comm.world_size

    @property
    def tp_rank(self) -> int:
        return 0 if self.tp_comm is None else self.tp_comm.rank

    @property
    def mp_world_size(self) -> int:
        """The tensor-parallel degree (DeepSpeed's older name)."""
        return self.tp_size

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype the engine cast the model to (None: the model's own was kept)."""
        return self.settings.compute_dtype

    # -- calls -------------------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return self.module(*inputs, **kwargs)

    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """The module's ``generate`` (Hugging Face's), after DeepSpeed's input-length check."""
        generate = getattr(self.module, "generate", None)
        if not callable(generate):
            raise AttributeError(f"{type(self.module).__name__} has no generate(); call the engine itself for a "
                                 f"forward pass")
        ids = kwargs.get("input_ids", inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None)
        limit = self.settings.max_out_tokens
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[-1] > limit:
            raise RuntimeError(f"input of {ids.shape[-1]} tokens exceeds max_out_tokens={limit}; raise max_out_tokens "
                               f"(alias max_tokens) in the inference config")
        try:
            with torch.no_grad():
                return generate(*inputs, **kwargs)
        finally:
            placed = self._zero_inference()
            if placed is not None:  # the units its last forward fetched for a next one that is not coming
                placed.release()

    def _zero_inference(self) -> Any:
        """The ZeRO-Inference placement's stage-3 streaming, when the config asked for it."""
        for transform in self.transforms:
            if isinstance(transform, ZeroInferencePlacement):
                return transform.placed
        return None

    # -- profiling (DeepSpeed's profile_model_time / model_times) ---------------------------------
    def profile_model_time(self, use_cuda_events: bool = True) -> None:
        """Record the wall time of every forward of the module (milliseconds, read by :meth:`model_times`)."""
        if not self.model_profile_enabled:
            self.module.register_forward_pre_hook(self._pre_forward_hook)
            self.module.register_forward_hook(self._post_forward_hook)
        self.model_profile_enabled = True

    def _pre_forward_hook(self, module: nn.Module, *args: Any) -> None:
        from zerospeed.accelerator import get_accelerator

        get_accelerator().synchronize()
        self._start = time.perf_counter()

    def _post_forward_hook(self, module: nn.Module, *args: Any) -> None:
        from zerospeed.accelerator import get_accelerator

        get_accelerator().synchronize()
        self._model_times.append((time.perf_counter() - self._start) * 1e3)

    def model_times(self) -> list[float]:
        if not self.model_profile_enabled:
            raise RuntimeError("model_times: profiling is off; call engine.profile_model_time() first")
        times, self._model_times = self._model_times, []
        return times

    # -- refused by name -----------------------------------------------------------------------------
    def compile(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("InferenceEngine.compile: zerospeed compiles nothing at run time (torch.compile "
                                  "builds C++/Triton code); call torch.compile(engine.module) yourself if you want it")

    @property
    def is_compiled(self) -> bool:
        return False

    def destroy(self) -> None:
        """DeepSpeed frees its kernels' workspace here; zerospeed has none, but ZeRO-Inference's hooks and
        swap files go (the module cannot run afterwards)."""
        placed = self._zero_inference()
        if placed is not None:
            placed.close()


def _tp_comm(settings: InferenceSettings) -> Comm | None:
    """The tensor-parallel group: the given ``tp_group``/``mpu``'s, or the mesh's ``tp`` axis of the world."""
    if settings.tp_size == 1:
        return None
    from zerospeed.distributed.env import init_distributed
    from zerospeed.tensor_parallel.group import tp_comm

    if settings.tp_group is not None:
        return tp_comm(settings.tp_group)
    if settings.mpu is not None:
        getter = getattr(settings.mpu, "get_model_parallel_group", None) or getattr(
            settings.mpu, "get_tensor_model_parallel_group")
        return Comm(getter(), name="tp")
    info = init_distributed()
    if info.world_size % settings.tp_size:
        raise ValueError(f"tensor_parallel.tp_size: {settings.tp_size} does not divide the {info.world_size} ranks "
                         f"of this job; launch a multiple of {settings.tp_size} ranks or change tp_size")
    from zerospeed.distributed.mesh import ParallelDims

    return ParallelDims(world_size=info.world_size, tp=settings.tp_size).build().comm("tp")


def _share_rng_state(comm: Comm) -> None:
    """Every tensor-parallel rank draws what rank 0 draws (sampling in ``generate``)."""
    state = torch.get_rng_state()
    comm.broadcast(state, src=0)
    torch.set_rng_state(state)


def init_inference(model: nn.Module, config: Mapping[str, Any] | str | None = None,
                   **kwargs: Any) -> InferenceEngine:
    """DeepSpeed's ``init_inference``: ``config`` (a dict or a JSON file path) and keyword arguments merged
    (a key in both with different values is an error), validated, and the model wrapped for serving."""
    from zerospeed.inference.config import merge_arguments

    return InferenceEngine(model, parse_inference_config(merge_arguments(config, kwargs)))


__all__ = ["InferenceEngine", "init_inference"]
