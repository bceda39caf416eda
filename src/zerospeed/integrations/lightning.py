"""PyTorch Lightning on zerospeed: ``Trainer(strategy=ZeroSpeedStrategy(config=...))``.

A subclass of Lightning's public ``DDPStrategy`` (its launcher, process group, rank bookkeeping and
collectives are reused) where the zerospeed :class:`~zerospeed.engine.Engine` replaces the DDP wrapper:
the LightningModule's ``configure_optimizers`` result (or the config's ``optimizer`` section) goes to
:func:`zerospeed.initialize`, backward and step go to the engine, checkpoints are the engine's sharded
directories with Lightning's own state as ``client_state``. Unlike Lightning's ``DeepSpeedStrategy``
(whose ``setup_environment`` raises unless the accelerator is ``CUDAAccelerator``), this runs with
``accelerator="cpu"``.

Importing this module registers the strategy in Lightning's registry, so ``Trainer(strategy="zerospeed")``
(ZeRO stage 2), ``"zerospeed_stage_{0,1,2,3}"`` and ``"zerospeed_stage_{2,3}_offload"`` work afterwards.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from zerospeed.engine import Engine
from zerospeed.integrations.lightning_config import (CHECKPOINT_TAG, ConfigSource, check_device,
                                                         export_rank_environment, lightning_config,
                                                         register_strategy_names)
from zerospeed.integrations.lightning_precision import ZeroSpeedPrecision, accumulates, precision_flag

__all__ = ["ZeroSpeedStrategy", "ZeroSpeedPrecision"]



class ZeroSpeedStrategy(DDPStrategy):
    """Lightning strategy training through a zerospeed engine (ZeRO stages 0-3, offload, bf16/fp16).

    ``config`` is a DeepSpeed config (dict, JSON/hjson path or base64; None: ZeRO stage 2). The Trainer's
    ``precision``, ``accumulate_grad_batches`` and ``gradient_clip_val`` are written into it; a config key
    that says otherwise is refused. ``allow_unsafe_pickle`` lets a resume load Lightning state holding
    arbitrary objects (only for checkpoints you trust).
    """

    strategy_name = "zerospeed"

    def __init__(self, config: ConfigSource = None, *, accelerator: Accelerator | None = None,
                 parallel_devices: list[Any] | None = None, cluster_environment: ClusterEnvironment | None = None,
                 precision_plugin: Precision | None = None, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, start_method: str = "popen",
                 allow_unsafe_pickle: bool = False, exclude_frozen_parameters: bool = False) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, timeout=timeout,
                         start_method=start_method)  # type: ignore[arg-type]
        self.config_source = config
        self.config: dict[str, Any] | None = None  # the resolved config, set when the engine is built
        self.allow_unsafe_pickle = allow_unsafe_pickle
        self.exclude_frozen_parameters = exclude_frozen_parameters

    # -- precision: whatever the Trainer's flag built becomes our plugin --------------------------------
    @property
    def precision_plugin(self) -> ZeroSpeedPrecision:
        plugin = self._precision_plugin
        return plugin if isinstance(plugin, ZeroSpeedPrecision) else ZeroSpeedPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, ZeroSpeedPrecision):
            plugin = ZeroSpeedPrecision(precision_flag(plugin, owner="ZeroSpeedStrategy"))
        self._precision_plugin = plugin

    def setup_distributed(self) -> None:
        """DDP's process group, plus the rank variables ``zerospeed.initialize`` reads."""
        super().setup_distributed()
        assert self.cluster_environment is not None
        check_device(self.root_device.type, owner="ZeroSpeedStrategy")
        export_rank_environment(rank=self.global_rank, world_size=self.world_size, local_rank=self.local_rank,
                                main_address=self.cluster_environment.main_address,
                                main_port=self.cluster_environment.main_port)

    @property
    def engine(self) -> Engine:
        """The zerospeed engine (after ``Trainer.fit`` set it up)."""
        if not isinstance(self.model, Engine):
            raise RuntimeError("ZeroSpeedStrategy has no engine yet: it is built when Trainer.fit (or validate/"
                               "test/predict) sets the strategy up")
        return self.model

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints are the engine's: it must exist before ``fit(ckpt_path=...)`` restores."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine restored its optimizer (shards) with the checkpoint

    # -- setup -----------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        optimizer, scheduler_config = self._user_optimizer(trainer) if fitting else (None, None)
        self.config = lightning_config(
            self.config_source, precision=self.precision_plugin.precision,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            gradient_clip_val=trainer.gradient_clip_val,
            gradient_clip_algorithm=None if trainer.gradient_clip_algorithm is None
            else str(trainer.gradient_clip_algorithm.value))
        if not fitting:  # evaluation only: the engine needs no optimizer section
            self.config.pop("optimizer", None)
            self.config.pop("scheduler", None)
        self._build_engine(optimizer, scheduler_config)
        self.setup_precision_plugin()
        self.barrier()

    def _user_optimizer(self, trainer: pl.Trainer) -> tuple[Optimizer | None, LRSchedulerConfig | None]:
        """The LightningModule's single optimizer and scheduler, or (None, None) for the config's."""
        module = self.lightning_module
        assert module is not None
        if not is_overridden("configure_optimizers", module, pl.LightningModule):
            self.optimizers, self.lr_scheduler_configs = [], []
            return None, None
        self.setup_optimizers(trainer)  # Lightning's own parsing of configure_optimizers' return value
        if len(self.optimizers) > 1 or len(self.lr_scheduler_configs) > 1:
            raise ValueError(f"ZeroSpeedStrategy trains one optimizer with at most one scheduler; "
                             f"configure_optimizers returned {len(self.optimizers)} optimizers and "
                             f"{len(self.lr_scheduler_configs)} schedulers: combine them into one optimizer "
                             f"with parameter groups")
        # configure_optimizers returning None gives Lightning's placeholder: the config's section then applies
        optimizer = self.optimizers[0] if self.optimizers and not isinstance(self.optimizers[0], _MockOptimizer) \
            else None
        return optimizer, self.lr_scheduler_configs[0] if self.lr_scheduler_configs else None

    def _build_engine(self, optimizer: Optimizer | None, scheduler_config: LRSchedulerConfig | None) -> None:
        import zerospeed

        assert self.config is not None
        if optimizer is not None and "optimizer" in self.config:
            raise ValueError("ZeroSpeedStrategy got an optimizer from configure_optimizers and an \"optimizer\" "
                             "section in the config; keep one (drop the section, or return None from "
                             "configure_optimizers)")
        module = self.model
        assert isinstance(module, Module)
        engine, engine_optimizer, _, engine_scheduler = zerospeed.initialize(
            model=module, config=self.config, optimizer=optimizer,
            lr_scheduler=scheduler_config.scheduler if scheduler_config is not None else None,
            dist_init_required=False)
        # Lightning steps the scheduler at its own interval (as with DeepSpeed); the engine must not as well.
        engine.lr_scheduler = None
        if engine_scheduler is not None and scheduler_config is None:  # the config's scheduler section
            scheduler_config = LRSchedulerConfig(engine_scheduler, interval="step")
        self.optimizers = [engine_optimizer] if engine_optimizer is not None else []
        self.lr_scheduler_configs = [scheduler_config] if scheduler_config is not None else []
        # Lightning decides where an accumulation window ends (a last, shorter window at an epoch's end
        # included, as with DDP) and calls optimizer_step only there; the precision plugin marks that
        # micro-batch as the engine's boundary. Without accumulation every micro-batch is one.
        engine.set_gradient_accumulation_boundary(not accumulates(self.lightning_module))
        self.model = engine

    def configure_ddp(self) -> None:  # never wrapped in DistributedDataParallel: the engine reduces
        raise NotImplementedError("ZeroSpeedStrategy does not use DistributedDataParallel")

    # -- backward / step (the precision plugin routes them to the engine) --------------------------------
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Nothing to block: the engine already skips the reduce inside a window where its stage allows
        (Lightning would call ``engine.no_sync()``, which stages 2-3 refuse, as DeepSpeed does)."""
        yield None

    def pre_backward(self, closure_loss: Tensor) -> None:
        """Nothing: DDP's bookkeeping does not apply (the engine's hooks reduce gradients)."""

    def post_backward(self, closure_loss: Tensor) -> None:
        """Nothing, as :meth:`pre_backward`."""

    # -- checkpoints -------------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the engine writes the model (whole or sharded); a second copy would only cost time

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        return {}  # written by the engine, shard by shard

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH,
                        storage_options: Any | None = None) -> None:
        """``engine.save_checkpoint(filepath, tag="checkpoint")`` with Lightning's state as ``client_state``.

        ``filepath`` becomes a directory (every rank writes its shards there); it loads at any world size
        and ZeRO stage through ``Trainer.fit(ckpt_path=filepath)``.
        """
        if storage_options is not None:
            raise TypeError("ZeroSpeedStrategy.save_checkpoint(storage_options=...) is not supported: the "
                            "engine writes the checkpoint itself, not through a CheckpointIO plugin")
        path = self.broadcast(str(filepath))
        client_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        self.engine.save_checkpoint(path, tag=CHECKPOINT_TAG, client_state=client_state,
                                    exclude_frozen_parameters=self.exclude_frozen_parameters)
        self.engine.wait_for_checkpoint()

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the engine's checkpoint; returns Lightning's state (the ``client_state``) to restore."""
        module = self.lightning_module
        assert module is not None
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        path = self.broadcast(str(checkpoint_path))
        _, client_state = self.engine.load_checkpoint(
            path, tag=CHECKPOINT_TAG, load_module_strict=module.strict_loading,
            load_optimizer_states=fitting, load_lr_scheduler_states=False,
            allow_unsafe_pickle=self.allow_unsafe_pickle)
        if client_state is None:
            raise FileNotFoundError(f"ZeroSpeedStrategy found no zerospeed checkpoint in {path!r} (expected the "
                                    f"directory trainer.save_checkpoint wrote, with a {CHECKPOINT_TAG!r} tag inside)")
        return dict(client_state)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # the engine loaded the weights in load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # the engine loaded the optimizer in load_checkpoint

    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            import shutil

            shutil.rmtree(str(filepath), ignore_errors=True)

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """``"zerospeed"`` (ZeRO stage 2 unless ``config=``), one name per stage, and the offload variants."""
        register_strategy_names(cls, strategy_registry)


ZeroSpeedStrategy.register_strategies(StrategyRegistry)
