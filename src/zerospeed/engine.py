"""The training engine: forward, backward, step over a model state (ZeRO stage 0, or stages 1-3).

It composes values chosen once at start: the precision policy (compute dtype, master weights,
loss scaler), the gradient buckets that accumulate and average gradients during backward, the
optimizer and LR schedule built from the config (or given by the user), and the data loader.
``step()`` is called every micro-batch and acts only at the accumulation boundary.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import sys
import time
import uuid
import weakref
from typing import TYPE_CHECKING, Any, Iterator, Protocol

import torch
from torch import nn

from zerospeed.checkpoint.layout import SaveLocks
from zerospeed.config import Config
from zerospeed.config.policies import TrainingPolicy
from zerospeed.data.loader import DistributedLoader
from zerospeed.distributed.comm import Comm, CommCounts
from zerospeed.distributed.mesh import Mesh
from zerospeed.engine_api import DeepSpeedEngineAPI
from zerospeed.launcher.elastic_env import ElasticRestart, restart_message
from zerospeed.layer_drop import LayerDropSchedule
from zerospeed.monitor.events import NoStepEvents, StepEvents
from zerospeed.precision.nonfinite import NonFiniteStep, NonFiniteSteps, classify
from zerospeed.precision.policy import MixedPrecisionPolicy
from zerospeed.profiling.flops_profiler.engine_profiler import NoFlopsProfiler, StepProfiler
from zerospeed.profiling.timers import NoTimers, PhaseTimers
from zerospeed.zero.contract import ModelState
from zerospeed.zero.grads import GradBuckets
from zerospeed.zero.replicated import ReplicatedState
from zerospeed.zero.step_grads import StepGrads

if TYPE_CHECKING:
    from zerospeed.checkpoint.commit import BackgroundSave

log = logging.getLogger("zerospeed")


class LRScheduler(Protocol):
    """What the engine needs of an LR schedule (torch's schedulers and DeepSpeed's both qualify);
    ``state_dict``/``load_state_dict``, when present, are used by checkpoints."""

    def step(self) -> Any: ...


class Engine(DeepSpeedEngineAPI, nn.Module):
    """Wraps ``module`` for data-parallel training; see :func:`zerospeed.initialize`.

    Gradients live in the engine's flat buffers, not in ``param.grad`` (which backward leaves None):
    at stage 0 read an averaged gradient with ``engine.buckets.grad_of(param)`` after the boundary
    step; at any stage ``zerospeed.utils.safe_get_full_grad(param)``.
    """

    def __init__(self, module: nn.Module, cfg: Config, comm: Comm, policy: MixedPrecisionPolicy,
                 optimizer: torch.optim.Optimizer | None, lr_scheduler: LRScheduler | None = None, *,
                 state: ModelState, mesh: Mesh, timers: PhaseTimers | None = None,
                 settings: TrainingPolicy | None = None, training_dataloader: DistributedLoader | None = None,
                 layer_drop: LayerDropSchedule | None = None, flops_profiler: StepProfiler | None = None,
                 step_events: StepEvents | NoStepEvents | None = None):
        super().__init__()
        if mesh.dp is not comm:
            raise ValueError("Engine(comm=..., mesh=...): comm must be the mesh's data-parallel Comm (mesh.dp)")
        # Every process group of the job (mpu interface included); ``comm`` is its data-parallel one.
        self.mesh = mesh
        # batch sizes, clipping and reporting as plain values (built from ``cfg`` when not given)
        self.settings = settings if settings is not None else TrainingPolicy.from_config(cfg)
        # wall_clock_breakdown: phases timed (and synchronized) only when the config asks
        self.timers: PhaseTimers = timers if timers is not None else NoTimers()
        # flops_profiler: brackets forward, backward and step; profiles the step profile_step
        self.flops_profiler: StepProfiler = flops_profiler if flops_profiler is not None else NoFlopsProfiler()
        # the monitors (DeepSpeed's engine.monitor, a MonitorMaster) and the events written at each step
        self.step_events = step_events if step_events is not None else NoStepEvents()
        self.monitor = self.step_events.master
        self.module = module
        self.config = cfg
        self.comm = comm
        self.policy = policy
        self.lr_scheduler = lr_scheduler
        self.scaler = policy.make_scaler()
        # Steps whose gradient norm is not finite: counted, reported (rate-limited), and the run stopped
        # after skipped_steps.raise_after_consecutive of them in a row.
        self.nonfinite = NonFiniteSteps(policy.nonfinite)
        # The torch optimizer itself (over fp32 masters, or this rank's shards of them under ZeRO),
        # so torch schedulers accept it; ``optimizer.cur_scale`` follows the live loss scale.
        self.optimizer = optimizer
        self._publish_scale()
        # Where parameters, gradients and optimizer states live: ReplicatedState (stage 0) or
        # ShardedState (stages 1-3), driven through the same calls.
        self.state = state
        if optimizer is not None and self.state.optimizer is None:
            self.state.adopt(optimizer)
        self.micro_steps = 0
        self._boundary_override: bool | None = None  # set_gradient_accumulation_boundary's manual window
        # Gradients of the current window are accumulated but not stepped yet (what a checkpoint cannot hold;
        # micro_steps cannot say it: under the manual window step() runs once per window, as in DeepSpeed).
        self._window_open = False
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        # Started by the node agent's elastic restart: the downtime is logged at the first step (then None).
        self._elastic_restart = ElasticRestart.from_environ(os.environ)
        self._skipped_at_print = 0  # skipped_steps at the last progress line
        self._window_loss: torch.Tensor | None = None  # this rank's losses of the window, summed (nan/inf stay)
        self._step_applied = False
        self._global_grad_norm: float | None = None
        self._in_no_sync = False
        self._last_loss: torch.Tensor | None = None
        self._tick = time.perf_counter()
        self.training_dataloader = training_dataloader  # its position is saved in checkpoints
        # progressive_layer_drop: theta(t) as a function of global_steps (None: the forward is left alone)
        self.layer_drop = layer_drop
        # Bytes sent per collective, measured window by window (comm_bytes()).
        self._comm_marks = self._comm_counts()
        self._window_sent: dict[str, int] = {}
        # Names this engine's checkpoint handshakes in the ranks' store (one collective, at start).
        self.checkpoint_id: str = comm.all_gather_object(uuid.uuid4().hex)[0]
        self._checkpoint_calls = 0
        self._pending_save: BackgroundSave | None = None
        # The folders this engine saves into, locked against other jobs from its first save there until
        # destroy() or the process ends (taken by the save's rank 0; see checkpoint/layout.SaveLocks).
        self.save_locks = SaveLocks(self.checkpoint_id)
        atexit.register(_wait_at_exit, weakref.ref(self))

    # -- sizes ----------------------------------------------------------------------------
    def train_batch_size(self) -> int:
        return self.settings.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.settings.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.settings.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        """True while the current micro-batch is the last one of its accumulation window (counted from
        ``gradient_accumulation_steps``, unless :meth:`set_gradient_accumulation_boundary` says)."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's manual window (accelerate drives the engine this way): say before each backward
        whether it ends the window (False for all micro-batches but the last, True for the last),
        then call ``engine.step()`` once for the window. The setting stays until changed."""
        self._boundary_override = bool(is_boundary)

    # -- forward / backward ----------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.layer_drop is not None and self.module.training:  # DeepSpeed: training forwards only
            kwargs = {**kwargs, **self.layer_drop.forward_kwargs(self.global_steps)}
        args, kwargs = self.policy.cast_forward_args(args, kwargs)
        with self.timers.phase("forward"), self.flops_profiler.forward(self.global_steps):
            return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Average ``loss`` over the accumulation window, scale it, and backpropagate.

        ``scale_wrt_gas=False`` skips the division by ``gradient_accumulation_steps`` (as DeepSpeed):
        the HF Trainer passes it because it has already divided its loss."""
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError(f"engine.backward expects a scalar loss tensor, got {type(loss).__name__}"
                             f"{'' if not isinstance(loss, torch.Tensor) else ' of shape ' + str(tuple(loss.shape))}")
        self._last_loss = loss.detach()  # read only when reporting: no device sync per micro-batch
        # read only when a step's gradients are not finite (to tell a NaN loss from a NaN gradient)
        window_loss = self._last_loss.float()
        self._window_loss = window_loss if self._window_loss is None else self._window_loss + window_loss
        self.step_events.add_loss(self._last_loss)
        if self._in_no_sync and not self.state.allows_no_sync():
            raise RuntimeError(f"engine.no_sync() is not supported with ZeRO stage {self.state.stage}: gradients "
                               f"are reduce-scattered into shards every micro-batch, so there is no local "
                               f"accumulation to skip (as in DeepSpeed); drop no_sync() or use stage 0 or 1")
        with self.timers.phase("backward"), self.flops_profiler.backward():
            with self.timers.phase("backward_inner"):
                self.state.begin_backward(self.is_gradient_accumulation_boundary() and not self._in_no_sync)
                window = self.gradient_accumulation_steps() if scale_wrt_gas else 1
                scaled = self.scaler.scale_loss(loss.float() / window)
                scaled.backward(retain_graph=retain_graph)
            with self.timers.phase("backward_allreduce"):
                self.state.end_backward()
        self._window_open = True
        return loss

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally without reducing them (the window's reduce is skipped)."""
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    # -- step -----------------------------------------------------------------------------
    def step(self) -> None:
        """Call after every micro-batch; updates the weights at the end of each accumulation window."""
        steps = self.global_steps
        with self.timers.phase("step"), self.flops_profiler.step(steps):
            self._step()
        if self.global_steps != steps:  # an optimizer step (applied, or skipped: the progress line goes on)
            self.step_events.after_step(self)
            self._report()

    def _step(self) -> bool:
        """The step itself; True when the weights were updated."""
        if self._in_no_sync:
            raise RuntimeError("engine.step() inside no_sync() (as in DeepSpeed, this is not allowed): run "
                               "backward inside no_sync() and call engine.step() outside it")
        if self.optimizer is None:
            raise RuntimeError("engine.step() needs an optimizer: pass optimizer= to zerospeed.initialize "
                               "or add an \"optimizer\" section to the config")
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        self._step_applied = False
        if not boundary:
            return False
        return self._apply_window()

    def _window_grads(self) -> StepGrads:
        """The window's reduced gradients (a pipeline also sums its tied weights' here)."""
        return self.state.step_grads()

    def _apply_window(self) -> bool:
        """End an accumulation window: unscale, measure, clip and apply its gradients (or skip the step
        when its gradient norm is not finite: see :mod:`zerospeed.precision.nonfinite`); True when the
        weights were updated."""
        self._step_applied = False
        with self.timers.phase("backward_allreduce"):  # waiting on the window's gradient reduction
            grads = self._window_grads()
        if self.scaler.loss_scale != 1.0:
            grads.div_(self.scaler.loss_scale)
        # One number answers both questions: the global norm is finite iff no rank has an inf/nan (it is
        # summed over every rank, so every rank takes the same decision without another collective).
        norm = float(self.state.squared_norm(grads).sqrt())
        finite = math.isfinite(norm)
        overflow = self.policy.check_overflow and not finite
        scale = self.scaler.loss_scale
        self.scaler.update(overflow)
        self._publish_scale(overflow)
        event = None if finite else self._nonfinite_step(norm, scale, skipped=overflow)
        if overflow:  # DeepSpeed counts a skipped step as a step (global_steps, global_samples); no LR step
            self.skipped_steps += 1
            self._count_step()
            self._finish_window()
            self._note_nonfinite(event)
            return False
        self._global_grad_norm = norm
        clip = self.settings.gradient_clipping
        factor = clip / (self._global_grad_norm + 1e-6) if clip > 0 else 1.0
        if factor < 1.0:  # torch's and DeepSpeed's clip_grad_norm rule
            grads.mul_(factor)
        self.state.apply()
        self._step_applied = True
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self._count_step()
        self._finish_window()
        self._note_nonfinite(event)  # applied although not finite: the precision's switch is off
        return True

    def _count_step(self) -> None:
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        if self._elastic_restart is not None:
            self._log_elastic_restart(self._elastic_restart)

    def _log_elastic_restart(self, restart: ElasticRestart) -> None:
        """Rank 0 says how long the job stood still (host lost -> this first step); once per process."""
        self._elastic_restart = None
        if self.comm.global_ranks[self.comm.rank] == 0:
            dist = torch.distributed
            world = dist.get_world_size() if dist.is_initialized() else self.comm.world_size
            line = restart_message(restart, world_size=world, now=time.time())
            log.info("%s", line)

    def _window_loss_value(self) -> float:
        """This rank's losses of the window, summed (nan or inf when any was; 0.0 when none was seen).
        Read only for a step whose gradients are not finite: the one device sync is off the hot path."""
        return 0.0 if self._window_loss is None else float(self._window_loss)

    def _nonfinite_step(self, norm: float, scale: float, *, skipped: bool) -> NonFiniteStep:
        """The step about to be counted, whose global gradient norm ``norm`` is not finite."""
        reason = classify(norm, loss=self._window_loss_value(), loss_scaled=self.policy.loss_scaling is not None)
        return NonFiniteStep(step=self.global_steps + 1, reason=reason, norm=norm, loss_scale=scale,
                             next_scale=self.scaler.loss_scale, skipped=skipped)

    def _note_nonfinite(self, event: NonFiniteStep | None, *, ending: bool = False) -> None:
        """Count a finished step in the run of non-finite ones and log its line (rate-limited) on global
        rank 0, and on a rank that saw the non-finite loss itself; raises at
        ``skipped_steps.raise_after_consecutive`` in a row (on every rank: the decision is agreed). A finite
        step (``event`` None) logs the summary of non-finite steps left unreported, when one is due; at the
        end of the run (``ending``, from :meth:`destroy`) whatever is left unreported."""
        if event is None:
            last = self.nonfinite.last_unreported
            line = self.nonfinite.flush() if ending else self.nonfinite.clean_step()
        else:
            last, line = event, self.nonfinite.record(event)
        if line is None or last is None:
            return
        rank = self.comm.global_ranks[self.comm.rank]
        if rank == 0 or last.reason.value.endswith(" loss"):
            log.warning("%s%s", "" if rank == 0 else f"rank {rank}: ", line)

    def _publish_scale(self, overflow: bool = False) -> None:
        """Set ``optimizer.cur_scale`` and ``optimizer.overflow`` (whether the last window's step was
        skipped), as DeepSpeed's ZeRO optimizers carry them: Accelerate's ``step_was_skipped`` reads
        ``overflow``, and the HF Trainer then holds its LR scheduler back."""
        if self.optimizer is not None:
            self.optimizer.cur_scale = float(self.scaler.loss_scale)  # type: ignore[attr-defined]
            self.optimizer.overflow = bool(overflow)  # type: ignore[attr-defined]

    def restore_progress(self, *, global_steps: int, global_samples: int, micro_steps: int,
                         skipped_steps: int) -> None:
        """Set the step counters (a checkpoint load; ``micro_steps`` at the start of a window)."""
        self.global_steps, self.global_samples = global_steps, global_samples
        self.micro_steps, self.skipped_steps = micro_steps, skipped_steps
        self._skipped_at_print = skipped_steps
        self.nonfinite.restart_run()  # the steps before the resume are not in a row with the next ones
        self._window_open = False
        self._window_loss = None

    def load_scaler_state(self, state: dict[str, Any]) -> None:
        """Restore the loss scaler (a checkpoint load) and publish its scale on the optimizer."""
        self.scaler.load_state_dict(state)
        self._publish_scale()

    def _finish_window(self) -> None:
        self.state.zero()
        self._window_open = False
        self._window_loss = None
        now = self._comm_counts()
        self._window_sent = {f"{axis}.{op}": n for axis, counts in now.items()
                             for op, n in (counts - self._comm_marks[axis]).sent.items()}
        self._comm_marks = now

    def _comm_counts(self) -> dict[str, CommCounts]:
        return {axis: comm.stats.snapshot() for axis, comm in self.mesh.comms.items()}

    def comm_bytes(self) -> dict[str, Any]:
        """Bytes this rank sent on the wire (``Comm.stats.sent``), per collective as ``"<axis>.<op>"``:
        ``step`` over the last accumulation window (its backward reductions, its optimizer step and
        anything else since the window before), ``total`` since the mesh's Comms were made (the start-up
        broadcasts included); ``step_total`` and ``total_sent`` sum them. Shows what a compressed
        optimizer or sparse gradients save."""
        total = {f"{axis}.{op}": n for axis, comm in self.mesh.comms.items() for op, n in comm.stats.sent.items() if n}
        return {"step": dict(self._window_sent), "step_total": sum(self._window_sent.values()),
                "total": total, "total_sent": sum(total.values())}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop accumulated gradients (``step`` already does this at each boundary)."""
        self.state.zero()
        self._window_open = False
        self._window_loss = None

    # -- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False, *,
                        async_save: bool | None = None) -> str:
        """Save model, optimizer, scheduler, loss scaler, counters, RNG and data position (every rank calls
        this; each writes only its own shards). ``tag`` defaults to ``global_step<N>``; the directory
        appears atomically and ``latest`` then names it. With ``async_save`` (default: the config's
        ``checkpoint.writer.decoupled``) the state is copied to CPU and written in the background; the
        next save, a load, or the end of the process waits for it. Returns the checkpoint's directory
        (for an asynchronous save, where it will appear once committed). ``exclude_frozen_parameters``
        leaves parameters with ``requires_grad=False`` out; loading keeps their current values."""
        from zerospeed.checkpoint.engine_io import save_checkpoint

        self.wait_for_checkpoint()
        result = save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters,
                                 async_save)
        if isinstance(result, str):
            return result
        self._pending_save = result
        return os.path.join(result.job.save_dir, result.job.tag)

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None, *,
                        allow_unsafe_pickle: bool = False, must_exist: bool | None = None) -> tuple[str | None, Any]:
        """Load a checkpoint written at any world size and ZeRO stage; returns ``(path, client_state)``,
        or ``(None, None)`` with a warning saying what ``load_dir`` holds when there is nothing to load
        (missing, empty, tags but no ``latest``). ``must_exist=True`` (default: the config's
        ``checkpoint.load_must_exist``) raises ``CheckpointError`` then instead, so a resume cannot
        silently start over. ``tag=None`` loads ``latest``.
        Training resumes at the start of an accumulation window of this run's configuration. The
        checkpoint's pickled files are read with ``torch.load(weights_only=True)``, so loading runs no
        code from them; a ``client_state`` holding other objects than containers, numbers, strings and
        tensors needs ``allow_unsafe_pickle=True`` (only for checkpoints you trust)."""
        from zerospeed.checkpoint.engine_io import load_checkpoint

        self.wait_for_checkpoint()
        return load_checkpoint(self, load_dir, tag, load_module_strict, load_optimizer_states,
                               load_lr_scheduler_states, load_module_only, custom_load_fn,
                               allow_unsafe_pickle=allow_unsafe_pickle, must_exist=must_exist)

    def wait_for_checkpoint(self) -> str | None:
        """Block until an asynchronous save has committed; re-raises its error. Returns its directory."""
        pending, self._pending_save = self._pending_save, None
        return pending.wait() if pending is not None else None

    def destroy(self) -> None:
        """Release what the engine holds beyond tensors (as ``DeepSpeedEngine.destroy``): wait for an
        asynchronous save, remove its hooks from the model, stop background threads, delete this
        run's NVMe swap files and close its monitors, and let other jobs save into the folders it saved
        into. The engine cannot train afterwards. A failed asynchronous save is re-raised after the
        rest is released, so the folder locks do not outlive a destroyed engine."""
        try:
            self.wait_for_checkpoint()
        finally:
            self._note_nonfinite(None, ending=True)  # skipped steps no rate-limited line told yet
            self.save_locks.release()
            self.state.remove_hooks()
            self.monitor.close()

    def next_checkpoint_call(self) -> int:
        """Number this save's handshake; every rank counts its saves the same way."""
        self._checkpoint_calls += 1
        return self._checkpoint_calls

    def return_checkpoint_call(self) -> None:
        """Un-count a save that only this rank attempted (its peers never used the number)."""
        self._checkpoint_calls -= 1

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Write the model's weights in their compute dtype as one plain state dict (rank 0 writes;
        every rank calls this, which gathers ZeRO-3 shards). ``.safetensors`` names are written as
        safetensors, anything else with ``torch.save``. Returns True."""
        from zerospeed.checkpoint.consolidate import save_16bit_model

        return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                             ) -> dict[str, torch.Tensor] | None:
        """DeepSpeed's private name, called by Accelerate's ``get_state_dict`` and the HF Trainer's
        ``save_model`` at stage 3: the whole model on CPU in the compute dtype on rank 0, None elsewhere.
        Every rank must call it (shards are gathered). Raises ValueError below stage 3, as DeepSpeed."""
        if self.zero_optimization_stage() != 3:
            raise ValueError("_zero3_consolidated_16bit_state_dict requires ZeRO stage 3 "
                             f"(this engine runs stage {self.zero_optimization_stage()}); use module.state_dict()")
        from zerospeed.checkpoint.consolidate import consolidated_16bit_state_dict

        return consolidated_16bit_state_dict(self, exclude_frozen_parameters)

    # -- memory ---------------------------------------------------------------------------
    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds now, measured from the allocated tensors: ``params``, ``grads`` and
        ``optimizer_states`` (fp32 masters included), their ``total`` (model states), and ``buffers``
        (gathered stage-3 parameters and in-flight gradient buckets, not model state), how many of
        the model-state bytes are ``offloaded`` (held in CPU memory by ``offload_*``), and the bytes
        kept ``on_nvme`` (swap files; in memory only while a unit is updated)."""
        return self.state.memory_breakdown()

    def offload_io(self) -> dict[str, float]:
        """This rank's NVMe traffic since initialize: ``bytes_read``, ``bytes_written``, and the seconds
        the training thread spent blocked on it (``read_wait_s``, ``write_wait_s``); zeros without NVMe."""
        return self.state.offload_io()

    def empty_partition_cache(self) -> None:
        """Release every gathered ZeRO-3 parameter (a no-op at stages 0-2)."""
        self.state.release_all()

    @property
    def buckets(self) -> GradBuckets:
        """Stage 0's gradient buckets (``grad_of(param)``); stages 1-3 keep gradient shards instead."""
        if not isinstance(self.state, ReplicatedState):
            raise AttributeError(f"ZeRO stage {self.state.stage} keeps gradient shards, not buckets; use "
                                 f"zerospeed.utils.safe_get_full_grad(param)")
        return self.state.buckets

    # -- queries --------------------------------------------------------------------------
    def was_step_applied(self) -> bool:
        return self._step_applied

    def get_global_grad_norm(self) -> float | None:
        return self._global_grad_norm

    def get_pld_theta(self) -> float | None:
        """The keep ratio theta(t) the next training forward gets as ``pld_theta`` (DeepSpeed 0.19.6's
        ``get_pld_theta``): 1.0 before the first step, then theta(global_steps - 1); None when
        ``progressive_layer_drop`` is off."""
        return None if self.layer_drop is None else self.layer_drop.theta_during(self.global_steps)

    def get_lr(self) -> list[float]:
        """Each parameter group's learning rate (``[]`` without an optimizer, as in DeepSpeed)."""
        return [group["lr"] for group in self._optimizer_groups()]

    def get_mom(self) -> list[Any]:
        return [group.get("betas", group.get("momentum")) for group in self._optimizer_groups()]

    def _optimizer_groups(self) -> list[dict]:
        return self.optimizer.param_groups if self.optimizer is not None else []

    @property
    def cur_scale(self) -> float:
        return self.scaler.loss_scale

    def _report(self) -> None:
        """The progress line every ``steps_per_print`` optimizer steps, skipped ones included (a run that
        skips every step still shows it is alive): loss, lr, loss scale, the skipped steps in total and
        among the last ``steps_per_print``, samples/s."""
        every = self.settings.steps_per_print
        if not every or self.global_steps % every:
            return
        # on every rank: each starts its next interval
        breakdown = self.timers.report(every, every * self.gradient_accumulation_steps())
        skipped_lately, self._skipped_at_print = self.skipped_steps - self._skipped_at_print, self.skipped_steps
        if self.comm.rank != 0:
            return
        if breakdown is not None:
            for line in breakdown.splitlines():
                log.info("step %d  %s", self.global_steps, line)
        now = time.perf_counter()
        rate = every * self.train_batch_size() / max(now - self._tick, 1e-9)
        self._tick = now
        log.info("step %d  loss %.4f  lr %s  loss scale %g  skipped %d (%d of the last %d)  %.1f samples/s",
                 self.global_steps, float(self._last_loss) if self._last_loss is not None else float("nan"),
                 ", ".join(f"{lr:.3g}" for lr in self.get_lr()), self.scaler.loss_scale, self.skipped_steps,
                 skipped_lately, every, rate)


def _wait_at_exit(ref: "weakref.ref[Engine]") -> None:
    """An asynchronous save still writing at exit is finished; if it failed, the process must not
    exit 0 (an exception in an atexit handler is only printed), so it exits 1."""
    engine = ref()
    if engine is None or engine._pending_save is None:
        return
    try:
        engine.wait_for_checkpoint()
    except Exception as exc:
        log.error("the final asynchronous checkpoint was not saved: %s", exc)
        for handler in log.handlers:
            handler.flush()
        os._exit(1)
