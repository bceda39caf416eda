"""DeepSpeed 0.19.8's ``DeepSpeedEngine`` surface for :class:`zerospeed.engine.Engine`, in one mixin.

DeepSpeed scripts read many small getters (``engine.zero_optimization_stage()``,
``engine.fp16_enabled()``, ``engine.local_rank``...). They live here so the engine itself stays
about training. Every getter answers from what the engine was built with: the resolved config
(``self.config``), the policies derived from it, and the process groups (``self.mesh``). Names
whose feature zerospeed does not have are refused in :mod:`zerospeed.engine_refusals` (a
``NotImplementedError`` naming the replacement). ``docs/deepspeed_engine_api.md`` lists both.

Where zerospeed's answer differs from DeepSpeed's on purpose, the method says so (e.g.
:meth:`get_data_types` reports the accumulation dtype zerospeed really uses).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import os
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
from torch import nn

from zerospeed.distributed import groups

from zerospeed.engine_config_api import DeepSpeedConfigGetters
from zerospeed.engine_refusals import install_refusals

if TYPE_CHECKING:
    from zerospeed.config import Config
    from zerospeed.config.policies import TrainingPolicy
    from zerospeed.data.loader import DistributedLoader
    from zerospeed.distributed.comm import Comm
    from zerospeed.distributed.groups import ProcessGroup
    from zerospeed.distributed.mesh import Mesh
    from zerospeed.precision.policy import MixedPrecisionPolicy
    from zerospeed.zero.contract import ModelState

_ROUTES = ("train", "eval", "predict")


class DeepSpeedEngineAPI(DeepSpeedConfigGetters):
    """Config getters, rank/size attributes and DeepSpeed conveniences, read from the engine's state.

    Mixed into :class:`~zerospeed.engine.Engine` (before ``nn.Module``); it holds no state of its own.
    """

    if TYPE_CHECKING:  # provided by Engine
        config: Config
        settings: TrainingPolicy
        policy: MixedPrecisionPolicy
        mesh: Mesh
        comm: Comm
        state: ModelState
        module: nn.Module
        optimizer: torch.optim.Optimizer | None
        training_dataloader: DistributedLoader | None
        micro_steps: int

        def save_16bit_model(self, save_dir: str, save_filename: str = ...,
                             exclude_frozen_parameters: bool = ...) -> bool: ...

    # -- ranks, sizes, device (DeepSpeed sets these as attributes) -------------------------------
    @property
    def local_rank(self) -> int:
        """This process's rank on its node, from ``LOCAL_RANK`` as DeepSpeed reads it (0 when unset)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def global_rank(self) -> int:
        """This process's rank in the whole job."""
        return groups.group_rank() if groups.is_initialized() else 0

    @property
    def world_size(self) -> int:
        """Processes in the whole job (every parallel axis together)."""
        return groups.group_size() if groups.is_initialized() else 1

    @property
    def dp_world_size(self) -> int:
        """Data-parallel degree: the ranks the batch is split over."""
        return self.mesh.get_data_parallel_world_size()

    @property
    def mp_world_size(self) -> int:
        """Model-parallel degree (tensor parallel, as DeepSpeed reads an ``mpu``)."""
        return self.mesh.get_tensor_model_parallel_world_size()

    @property
    def sequence_parallel_size(self) -> int:
        return self.mesh.get_sequence_parallel_world_size()

    @property
    def seq_dp_world_size(self) -> int:
        """Data times sequence parallel degree (DeepSpeed's sequence-data-parallel group)."""
        return self.dp_world_size * self.sequence_parallel_size

    @property
    def device(self) -> torch.device:
        """The device the model computes on (where ``initialize`` placed it)."""
        first = next(itertools.chain(self.module.parameters(), self.module.buffers()), None)
        return first.device if first is not None else torch.device("cpu")

    @property
    def mpu(self) -> Mesh | None:
        """The ``mpu`` (Megatron model-parallel interface): the mesh when there is model parallelism,
        else None, as in DeepSpeed without ``mpu=``."""
        dims = self.mesh.dims
        return self.mesh if dims.tp * dims.pp > 1 else None

    @property
    def has_moe_layers(self) -> bool:
        """Whether the model has mixture-of-experts layers (DeepSpeed's ``engine.has_moe_layers``)."""
        from zerospeed.moe.setup import expert_layers

        return bool(expert_layers(self.module))

    @property
    def pipeline_parallelism(self) -> bool:
        """False: this engine is not a pipeline engine."""
        return False

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in: the config's ``communication_data_type`` when set, else
        the gradient accumulation dtype (fp32 unless ``data_types.grad_accum_dtype`` says otherwise;
        DeepSpeed names the model dtype there)."""
        return self.policy.reduce_dtype

    @communication_data_type.setter
    def communication_data_type(self, value: Any) -> None:
        raise NotImplementedError(
            f"engine.communication_data_type = {value!r}: the reduce dtype is fixed when the gradient buckets are "
            f"built; set \"communication_data_type\" in the config instead")

    @property
    def is_compiled(self) -> bool:
        """False: ``engine.compile`` is refused (compile submodules yourself)."""
        return False

    def get_data_parallel_rank(self) -> int:
        """This rank's index in its data-parallel group."""
        return self.mesh.get_data_parallel_rank()

    def get_tensor_parallel_rank(self) -> int:
        """This rank's index in its tensor-parallel group (0 without tensor parallelism)."""
        return self.mesh.get_tensor_model_parallel_rank()

    def get_model_parallel_rank(self) -> int:
        """The tensor-parallel rank (model parallel means tensor parallel, as with DeepSpeed's groups)."""
        return self.mesh.get_tensor_model_parallel_rank()

    def get_sequence_parallel_group(self) -> ProcessGroup:
        """The torch process group of this rank's sequence-parallel peers."""
        return self.mesh.get_sequence_parallel_group()

    # -- batch -----------------------------------------------------------------------------------
    def get_batch_info(self) -> tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``
        (DeepSpeed 0.19.8 returns the three bound methods by mistake; these are their values)."""
        s = self.settings
        return s.train_batch_size, s.train_micro_batch_size_per_gpu, s.gradient_accumulation_steps

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch by changing gradient accumulation steps; the micro batch stays.
        Call it between accumulation windows (as in DeepSpeed)."""
        self._check_window_start("set_train_batch_size")
        per_step = self.settings.train_micro_batch_size_per_gpu * self.dp_world_size
        if isinstance(train_batch_size, bool) or not isinstance(train_batch_size, int) or train_batch_size < 1 \
                or train_batch_size % per_step:
            raise ValueError(f"engine.set_train_batch_size({train_batch_size!r}): the batch must be a positive "
                             f"multiple of train_micro_batch_size_per_gpu * data-parallel size = {per_step}")
        self._set_batch(train_batch_size, self.settings.train_micro_batch_size_per_gpu,
                        train_batch_size // per_step)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the micro batch keeping the accumulation steps (the global batch follows). The data
        loader ``initialize`` built keeps its batch size; build a new one with :meth:`deepspeed_io`."""
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(f"engine.set_train_micro_batch_size({micro_batch_size!r}): expected an integer >= 1")
        self._check_window_start("set_train_micro_batch_size")
        gas = self.settings.gradient_accumulation_steps
        self._set_batch(micro_batch_size * gas * self.dp_world_size, micro_batch_size, gas)

    def _check_window_start(self, caller: str) -> None:
        """Batch sizes change between accumulation windows: mid-window, the micro-batches already run
        would be averaged with the wrong count."""
        done = self.micro_steps % self.settings.gradient_accumulation_steps
        if done:
            raise RuntimeError(f"engine.{caller}() in the middle of an accumulation window ({done} of "
                               f"{self.settings.gradient_accumulation_steps} micro-batches done); call it after "
                               f"the engine.step() that ends the window")

    def _set_batch(self, train: int, micro: int, gas: int) -> None:
        # The engine reads the batch from its TrainingPolicy; the config is kept in agreement.
        self.settings = dataclasses.replace(self.settings, train_batch_size=train,
                                            train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=gas)
        self.config = self.config.model_copy(update={"train_batch_size": train,
                                                     "train_micro_batch_size_per_gpu": micro,
                                                     "gradient_accumulation_steps": gas})

    def gradient_clipping(self) -> float:
        """The global gradient-norm clip ``engine.step()`` applies (config ``gradient_clipping``; 0: off)."""
        return self.settings.gradient_clipping

    def steps_per_print(self) -> int | None:
        return self.config.steps_per_print

    def dataloader_drop_last(self) -> bool:
        return self.config.dataloader_drop_last

    def managed_gradient_accumulation(self) -> bool:
        return self.config.managed_gradient_accumulation

    # -- data ------------------------------------------------------------------------------------
    @staticmethod
    def is_map_style_dataset(obj: Any) -> bool:
        """Whether ``obj`` has ``__getitem__`` and ``__len__`` (what :meth:`deepspeed_io` loads)."""
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj: Any) -> bool:
        """Whether ``obj`` is a ``torch.utils.data.IterableDataset``."""
        return isinstance(obj, torch.utils.data.IterableDataset)

    def deepspeed_io(self, dataset: Any, batch_size: int | None = None, route: str = "train",
                     pin_memory: bool = True, data_sampler: Any = None,
                     collate_fn: Callable[[list[Any]], Any] | None = None,
                     num_local_io_workers: int | None = None) -> DistributedLoader:
        """A loader giving this data-parallel rank its share of ``dataset``: micro batches of
        ``batch_size`` (default ``train_micro_batch_size_per_gpu``), shuffled for ``route="train"``,
        in order for ``"eval"``/``"predict"``."""
        from zerospeed.accelerator import get_accelerator
        from zerospeed.data.loader import DistributedLoader

        if self.is_iterable_style_dataset(dataset) or not self.is_map_style_dataset(dataset):
            raise ValueError(f"engine.deepspeed_io(dataset={type(dataset).__name__}): expected a map-style "
                             f"torch Dataset (with __getitem__ and __len__)")
        if route not in _ROUTES:
            raise ValueError(f"engine.deepspeed_io(route={route!r}): expected one of {', '.join(_ROUTES)}")
        if data_sampler is not None:
            raise NotImplementedError("engine.deepspeed_io(data_sampler=...): zerospeed's loader shards with its "
                                      "own resumable sampler; pass data_sampler=None (or build a torch DataLoader)")
        return DistributedLoader(dataset, micro_batch_size=batch_size or self.settings.train_micro_batch_size_per_gpu,
                                 rank=self.mesh.get_data_parallel_rank(),
                                 world_size=self.mesh.get_data_parallel_world_size(), collate_fn=collate_fn,
                                 drop_last=self.config.dataloader_drop_last, shuffle=route == "train",
                                 num_workers=num_local_io_workers or 0,
                                 pin_memory=pin_memory and not get_accelerator().is_cpu,
                                 gradient_accumulation_steps=self.settings.gradient_accumulation_steps,
                                 warn=self.global_rank == 0)

    # -- model weights ---------------------------------------------------------------------------
    def module_state_dict(self, destination: dict[str, Any] | None = None, prefix: str = "",
                          keep_vars: bool = False, exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        """The model's full state dict, as ``module.state_dict`` at stages 0-2 (parameters are whole
        there). At stage 3 every rank must call it: parameters are gathered, and come back as CPU copies
        in the compute dtype."""
        frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
        out: dict[str, Any] = destination if destination is not None else {}
        if not self.zero_optimization_partition_weights():
            state = self.module.state_dict(prefix=prefix, keep_vars=keep_vars)
            dropped = {prefix + n for n in frozen} if exclude_frozen_parameters else set()
            out.update((key, value) for key, value in state.items() if key not in dropped)
            return out
        full = dict(self.state.full_param_values())
        names = {id(p): n for n, p in self.module.named_parameters()}
        for key, value in self.module.state_dict(keep_vars=True).items():
            owner = names.get(id(value)) if isinstance(value, nn.Parameter) else None
            if owner is None:
                out[prefix + key] = value if keep_vars else value.detach()
            elif not (exclude_frozen_parameters and owner in frozen):
                out[prefix + key] = full[owner].detach().to("cpu", copy=True)
        return out

    def load_module_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True,
                               custom_load_fn: Callable[..., Any] | None = None, fetch_z3_params: bool = False,
                               z3_params_to_fetch: Any = None, allowed_missing_keys: Any = None) -> None:
        """Load ``checkpoint["module"]`` (a full state dict) into the model and its fp32 masters / ZeRO
        shards, on every rank. ``strict`` checks the keys as ``nn.Module.load_state_dict`` does;
        ``allowed_missing_keys`` may be missing under ``strict``. ``custom_load_fn(src=, dst=)`` gets
        the state dict and the module instead (its changes reach the optimizer at stages 0-2 only when
        it also updates the masters: prefer the default load). The ``fetch_z3_params`` arguments are
        accepted: zerospeed always writes every parameter whole."""
        from zerospeed.utils import safe_set_full_fp32_param

        if "module" not in checkpoint:
            raise KeyError(f"engine.load_module_state_dict: the checkpoint has no \"module\" entry (keys: "
                           f"{sorted(checkpoint)[:8]}); pass {{'module': state_dict}}")
        state = checkpoint["module"]
        if custom_load_fn is not None:
            custom_load_fn(src=state, dst=self.module)
            return
        expected = self.module.state_dict(keep_vars=True)
        if strict:
            missing = set(expected) - set(state) - set(allowed_missing_keys or ())
            unexpected = set(state) - set(expected)
            if missing or unexpected:
                raise RuntimeError(f"engine.load_module_state_dict: keys do not match the model: "
                                   f"missing={sorted(missing)}, unexpected={sorted(unexpected)}; pass strict=False "
                                   f"to load the matching ones")
        done: set[int] = set()
        with torch.no_grad():
            for key, target in expected.items():
                if key not in state or id(target) in done:
                    continue
                done.add(id(target))
                value = torch.as_tensor(state[key])
                if isinstance(target, nn.Parameter):
                    safe_set_full_fp32_param(target, value.float())
                else:
                    target.copy_(value)

    def save_fp16_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """The old name of :meth:`save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)

    # -- misc ------------------------------------------------------------------------------------
    def collect_python_gc(self) -> int:
        """Run Python's cyclic garbage collector now (at a boundary the script chooses)."""
        return gc.collect()


install_refusals(DeepSpeedEngineAPI)

__all__ = ["DeepSpeedEngineAPI"]
