"""Lightning Fabric on zerospeed: ``Fabric(strategy=ZeroSpeedFabricStrategy(config=...))``.

A subclass of Fabric's public ``DDPStrategy`` (launcher, process group, collectives reused) where
``fabric.setup(model, optimizer[, scheduler=])`` builds a zerospeed engine: ``fabric.backward(loss)`` is
``engine.backward``, ``optimizer.step()`` is ``engine.step()`` (call it every micro-batch: the engine
counts the config's ``gradient_accumulation_steps``), and ``fabric.save``/``fabric.load`` write and read
the engine's sharded checkpoint directory with the rest of the state as ``client_state``. A scheduler
passed to ``fabric.setup`` is stepped by the engine at each optimizer step (as with DeepSpeed): do not
step it yourself. Lightning's own Fabric ``DeepSpeedStrategy`` refuses any accelerator but CUDA in its
``setup_environment``; this one runs on CPU.

Importing this module registers ``"zerospeed"`` (and ``"zerospeed_stage_{0,1,2,3}"``,
``"zerospeed_stage_{2,3}_offload"``) in Fabric's strategy registry.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.types import _PATH
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from zerospeed.engine import Engine
from zerospeed.integrations.lightning_config import (CHECKPOINT_TAG, ConfigSource, check_device,
                                                         export_rank_environment, lightning_config,
                                                         register_strategy_names)
from zerospeed.integrations.lightning_precision import ZeroSpeedFabricPrecision, precision_flag

__all__ = ["ZeroSpeedFabricStrategy", "ZeroSpeedFabricPrecision"]


class ZeroSpeedFabricStrategy(DDPStrategy):
    """Fabric strategy training through a zerospeed engine (ZeRO stages 0-3, offload, bf16/fp16).

    ``config`` is a DeepSpeed config (dict, path or base64; None: ZeRO stage 2); Fabric's ``precision``
    is written into it (a config that enables another precision is refused). Clip with the config's
    ``gradient_clipping``: ``fabric.clip_gradients`` is refused.
    """

    def __init__(self, config: ConfigSource = None, *, accelerator: Accelerator | None = None,
                 parallel_devices: list[Any] | None = None, cluster_environment: ClusterEnvironment | None = None,
                 precision: Precision | None = None, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, start_method: str = "popen",
                 allow_unsafe_pickle: bool = False, exclude_frozen_parameters: bool = False) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision=precision,
                         process_group_backend=process_group_backend, timeout=timeout,
                         start_method=start_method)  # type: ignore[arg-type]
        self.config_source = config
        self.config: dict[str, Any] | None = None
        self.allow_unsafe_pickle = allow_unsafe_pickle
        self.exclude_frozen_parameters = exclude_frozen_parameters
        self._engine: Engine | None = None

    @property
    def precision(self) -> ZeroSpeedFabricPrecision:
        plugin = self._precision
        return plugin if isinstance(plugin, ZeroSpeedFabricPrecision) else ZeroSpeedFabricPrecision()

    @precision.setter
    def precision(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, ZeroSpeedFabricPrecision):
            plugin = ZeroSpeedFabricPrecision(precision_flag(plugin, owner="ZeroSpeedFabricStrategy"))
        self._precision = plugin

    def setup_environment(self) -> None:
        """DDP's process group, plus the rank variables ``zerospeed.initialize`` reads."""
        super().setup_environment()
        assert self.cluster_environment is not None
        check_device(self.root_device.type, owner="ZeroSpeedFabricStrategy")
        export_rank_environment(rank=self.global_rank, world_size=self.world_size, local_rank=self.local_rank,
                                main_address=self.cluster_environment.main_address,
                                main_port=self.cluster_environment.main_port)

    @property
    def engine(self) -> Engine:
        """The engine ``fabric.setup`` built (the last one, when several models were set up)."""
        if self._engine is None:
            raise RuntimeError("ZeroSpeedFabricStrategy has no engine yet: call fabric.setup(model, optimizer)")
        return self._engine

    # -- setup -------------------------------------------------------------------------------------------
    def _initialize(self, module: Module, optimizer: Optimizer | None, scheduler: Any) -> tuple[Engine, Any, Any]:
        import zerospeed

        self.config = lightning_config(self.config_source, precision=self.precision.precision)
        engine, engine_optimizer, _, engine_scheduler = zerospeed.initialize(
            model=module, config=self.config, optimizer=optimizer, lr_scheduler=scheduler, dist_init_required=False)
        self._engine = engine
        return engine, engine_optimizer, engine_scheduler

    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer],
                                    scheduler: Any = None) -> tuple[Module, list[Optimizer], Any]:
        """One engine for the module and its single optimizer (and scheduler, which the engine steps)."""
        if len(optimizers) != 1:
            raise ValueError(f"ZeroSpeedFabricStrategy trains one optimizer per model; fabric.setup got "
                             f"{len(optimizers)}: combine them into one optimizer with parameter groups")
        engine, optimizer, engine_scheduler = self._initialize(module, optimizers[0], scheduler)
        return engine, [optimizer], engine_scheduler

    def setup_module(self, module: Module) -> Module:  # type: ignore[override]
        """An engine without optimizer (evaluation, or an optimizer from the config's section)."""
        engine, _, _ = self._initialize(module, None, None)
        return engine

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        raise NotImplementedError("ZeroSpeedFabricStrategy sets up model and optimizer together: call "
                                  "fabric.setup(model, optimizer) instead of fabric.setup_optimizers")

    def module_to_device(self, module: Module) -> None:
        module.to(self.root_device)

    # -- backward / step ---------------------------------------------------------------------------------
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        """``engine.backward(loss)`` (the engine of ``model=`` when given, else the one set up)."""
        engine = module if isinstance(module, Engine) else self.engine
        self.precision.pre_backward(tensor, engine)
        self.precision.backward(tensor, engine, *args, **kwargs)
        self.precision.post_backward(tensor, engine)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """``engine.step()``: updates the weights at the end of each accumulation window."""
        if kwargs:
            raise TypeError(f"ZeroSpeedFabricStrategy: optimizer.step() arguments {sorted(kwargs)} cannot be "
                            "passed on: engine.step() takes none")
        return self.precision.optimizer_step(self.engine)

    def clip_gradients_norm(self, module: Module, optimizer: Optimizer, max_norm: float | int,
                            norm_type: float | int = 2.0, error_if_nonfinite: bool = True) -> Tensor:
        raise NotImplementedError("ZeroSpeedFabricStrategy clips inside engine.step(): set \"gradient_clipping\": "
                                  f"{max_norm} in the config instead of calling fabric.clip_gradients")

    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        raise NotImplementedError("ZeroSpeedFabricStrategy clips by global norm only: set \"gradient_clipping\" "
                                  "in the config instead of clipping by value")

    # -- checkpoints -------------------------------------------------------------------------------------
    @staticmethod
    def _engine_in(state: dict[str, Any], verb: str) -> Engine:
        engines = [v for v in state.values() if isinstance(v, Engine)]
        if len(engines) != 1:
            raise ValueError(f"ZeroSpeedFabricStrategy {verb}s one model set up by fabric.setup per checkpoint; "
                             f"the state holds {len(engines)}: pass state={{'model': model, ...}} with one model")
        return engines[0]

    def save_checkpoint(self, path: _PATH, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """``engine.save_checkpoint(path, tag="checkpoint")``; the rest of ``state`` is its ``client_state``."""
        if storage_options is not None or filter is not None:
            raise TypeError("ZeroSpeedFabricStrategy.save_checkpoint does not take storage_options or filter: the "
                            "engine writes its own sharded files")
        engine = self._engine_in(state, "save")
        skip = (engine, engine.optimizer)
        client_state = {k: (v.state_dict() if hasattr(v, "state_dict") else v)
                        for k, v in state.items() if not any(v is s for s in skip)}
        engine.save_checkpoint(self.broadcast(str(path)), tag=CHECKPOINT_TAG, client_state=client_state,
                               exclude_frozen_parameters=self.exclude_frozen_parameters)
        engine.wait_for_checkpoint()

    def load_checkpoint(self, path: _PATH, state: Module | Optimizer | dict[str, Any] | None = None,
                        strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
        """Restore ``state`` in place from the engine's checkpoint; returns the client keys not in ``state``."""
        if not isinstance(state, dict) or not state:
            raise ValueError("ZeroSpeedFabricStrategy.load_checkpoint needs state={'model': model, ...} with the "
                             f"model set up by fabric.setup; got {type(state).__name__}")
        engine = self._engine_in(state, "load")
        with_optimizer = any(v is engine.optimizer for v in state.values()) and engine.optimizer is not None
        _, client_state = engine.load_checkpoint(
            self.broadcast(str(path)), tag=CHECKPOINT_TAG, load_module_strict=strict,
            load_optimizer_states=with_optimizer, load_lr_scheduler_states=with_optimizer,
            allow_unsafe_pickle=self.allow_unsafe_pickle)
        if client_state is None:
            raise FileNotFoundError(f"ZeroSpeedFabricStrategy found no zerospeed checkpoint in {str(path)!r} "
                                    f"(expected the directory fabric.save wrote, with a {CHECKPOINT_TAG!r} tag)")
        client_state = dict(client_state)
        for key, target in state.items():
            if target is engine or target is engine.optimizer:
                continue
            if key not in client_state:
                if strict:
                    raise KeyError(f"ZeroSpeedFabricStrategy: {key!r} is not in the checkpoint at {str(path)!r} "
                                   f"(it holds {sorted(client_state)}); pass strict=False to skip it")
                continue
            value = client_state.pop(key)
            if hasattr(target, "load_state_dict"):
                target.load_state_dict(value)
            else:
                state[key] = value
        return client_state

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """``"zerospeed"`` (ZeRO stage 2 unless ``config=``), one name per stage, and the offload variants."""
        register_strategy_names(cls, strategy_registry)


ZeroSpeedFabricStrategy.register_strategies(STRATEGY_REGISTRY)
