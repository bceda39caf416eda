"""``PipelineEngine``: DeepSpeed's pipeline API (``train_batch``, ``eval_batch``) over zerospeed's schedules.

One batch is one run of the stage's program (``interpreter.StageRun``) of the configured schedule.
Everything else is the data-parallel engine's, unchanged: the model state of this stage's parameters
(ZeRO 0-2 over the stage's data-parallel ranks) reduces gradients while backward runs, and the step
(unscale, global norm, clip, apply; a non-finite norm skips it, reported as the engine reports it:
``zerospeed.precision.nonfinite``) is :meth:`Engine._apply_window`. The pipeline adds only what is
its own, as collaborators: the point-to-point link, the tied-weight sums (taken on the reduced
gradients, before the norm), and a norm scope summing over the pipeline (and tensor) ranks, so
clipping and the fp16 overflow decision are global and agreed by every stage.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from zerospeed.engine import Engine
from zerospeed.pipe.interpreter import StageHooks, StageRun, tensors_of
from zerospeed.pipe.module import PipelineModule
from zerospeed.pipe.p2p import StageLink
from zerospeed.pipe.schedules import Schedule, inference, schedule_for
from zerospeed.pipe.tied import TiedWeights
from zerospeed.zero.step_grads import StepGrads


class PipelineError(RuntimeError):
    """A call the pipeline engine does not take (``forward``/``backward``/``step``), or a misuse."""


@dataclass(frozen=True)
class PipeParts:
    """The pipeline's collaborators, made by ``initialize``: the link to the neighbour stages (None with
    one stage), the tied-weight sums, the schedule's name and the model chunks per stage."""

    link: StageLink | None
    tied: TiedWeights
    schedule: str
    chunks: int


class PipelineEngine(Engine):
    """The engine ``zerospeed.initialize`` returns for a :class:`PipelineModule` (see ``docs/pipeline.md``).

    ``train_batch()`` runs one whole batch (``gradient_accumulation_steps`` micro-batches) through the
    pipeline with the configured schedule and steps the optimizer; it returns the batch's mean loss
    (averaged over the data-parallel replicas) on every stage. ``eval_batch()`` runs forwards only."""

    def __init__(self, *args: Any, pipe: PipeParts, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.module, PipelineModule):
            raise TypeError(f"PipelineEngine needs a PipelineModule, got {type(self.module).__name__}")
        self.pipe = pipe
        self.pipeline: PipelineModule = self.module  # the same object, typed
        self.num_stages = self.module.num_stages
        self.stage_id = self.module.stage_id
        self.micro_batches = self.gradient_accumulation_steps()
        self.data_iterator: Iterator[Any] | None = None
        self.batch_fn: Callable[[Any], Any] | None = None
        self.agg_train_loss: torch.Tensor | None = None
        self.last_run: StageRun | None = None  # the last batch's interpreter (peak activations, losses)
        self._schedule = self._train_schedule()  # built now: a bad schedule / batch fails at initialize

    # -- DeepSpeed's questions -------------------------------------------------------------------
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """The iterator ``train_batch()`` reads micro-batches from (first and last stages)."""
        self.data_iterator = iterator

    def set_batch_fn(self, fn: Callable[[Any], Any]) -> None:
        """Apply ``fn`` to every micro-batch read from the data iterator (DeepSpeed's hook)."""
        self.batch_fn = fn

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch by changing the micro-batches per batch (the micro size stays)."""
        super().set_train_batch_size(train_batch_size)
        self.micro_batches = self.gradient_accumulation_steps()
        self._schedule = self._train_schedule()

    def _train_schedule(self) -> Schedule:
        return schedule_for(self.pipe.schedule, stages=self.num_stages, micro_batches=self.micro_batches,
                            chunks=self.pipe.chunks)

    @property
    def schedule(self) -> Schedule:
        """The training schedule of one batch (every stage's program)."""
        return self._schedule

    # -- the calls a pipeline does not take ---------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("a PipelineEngine runs whole batches: call engine.train_batch(data_iter) to train "
                            "or engine.eval_batch(data_iter) to evaluate, not engine(batch)")

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("a PipelineEngine runs backward inside engine.train_batch(data_iter); "
                            "do not call engine.backward()")

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise PipelineError("a PipelineEngine steps the optimizer inside engine.train_batch(data_iter); "
                            "do not call engine.step()")

    # -- training ---------------------------------------------------------------------------------
    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Train on one batch: ``gradient_accumulation_steps`` micro-batches from ``data_iter`` (or the
        iterator set before, or the ``training_data`` given to ``initialize``), then one optimizer step.
        Returns the mean loss of the batch, averaged over data-parallel replicas, on every rank."""
        if not torch.is_grad_enabled():
            raise PipelineError("train_batch() was called under torch.no_grad(); use eval_batch() to evaluate")
        if self.optimizer is None:
            raise PipelineError("train_batch() needs an optimizer: pass optimizer= to zerospeed.initialize or add "
                                "an \"optimizer\" section to the config")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()

        def step() -> None:
            with self.timers.phase("step"):
                self._apply_window()

        hooks = StageHooks(next_batch=self._next_micro_batch, loss=self._loss, prepare_inputs=self._prepare,
                           scale=self._scale, weight_backward=self._weight_backward, step=step)
        run = StageRun(self._schedule, module=self.pipeline, link=self.pipe.link, hooks=hooks, stage=self.stage_id)
        steps = self.global_steps  # flops_profiler: the whole batch is one profile (counted as forward + backward)
        with self.flops_profiler.step(steps), self.flops_profiler.forward(steps):
            self._run(run)
        self.micro_steps += self.micro_batches
        self.agg_train_loss = self._aggregate(run.losses, self.micro_batches)
        self._last_loss = self.agg_train_loss
        if self.global_steps != steps:  # the monitors' events (the batch's loss is already averaged over dp)
            self.step_events.add_loss(self.agg_train_loss)
            self.step_events.after_step(self)
            self._report()  # applied or skipped: the progress line goes on (with the skipped count)
        return self.agg_train_loss

    def eval_batch(self, data_iter: Iterator[Any], return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None) -> Any:
        """Evaluate ``num_micro_batches`` (default ``gradient_accumulation_steps``) micro-batches from
        ``data_iter`` under ``torch.no_grad()``. Returns the mean loss (``reduce_output='avg'``, averaged
        over data-parallel replicas; on every stage with ``bcast_loss``, else only on the last stage) or,
        with ``reduce_output=None``, the last stage's per-micro-batch outputs; with ``return_logits``
        also the last stage's model outputs (before the loss) of every micro-batch, as a list."""
        if reduce_output not in ("avg", None):
            raise ValueError(f"eval_batch(reduce_output={reduce_output!r}): expected 'avg' or None")
        micro = self.micro_batches if num_micro_batches is None else num_micro_batches
        if isinstance(micro, bool) or not isinstance(micro, int) or micro < 1:
            raise ValueError(f"eval_batch(num_micro_batches={num_micro_batches!r}): expected an integer >= 1")
        saved_iterator, was_training = self.data_iterator, self.module.training
        self.set_dataiterator(data_iter)
        self.module.eval()
        logits: list[Any] = []

        def loss(outputs: Any, labels: Any) -> Any:
            if return_logits:
                logits.append(outputs)
            return self._loss(outputs, labels) if compute_loss else outputs

        hooks = StageHooks(next_batch=self._next_micro_batch, loss=loss, prepare_inputs=self._prepare)
        schedule = inference(self.num_stages, micro, self.pipe.chunks)
        run = StageRun(schedule, module=self.pipeline, link=self.pipe.link, hooks=hooks, stage=self.stage_id)
        try:
            with torch.no_grad():
                self._run(run)
        finally:
            self.data_iterator = saved_iterator
            self.module.train(was_training)
        if reduce_output is None:
            output: Any = run.losses if self.is_last_stage() else None
        elif compute_loss and bcast_loss:
            output = self._aggregate(run.losses, micro)
        else:
            output = self._mean_over_dp(run.losses, micro) if self.is_last_stage() else None
        return (output, logits if self.is_last_stage() else None) if return_logits else output

    def _run(self, run: StageRun) -> None:
        self.last_run = run
        run.run()

    # -- hooks the interpreter calls ----------------------------------------------------------------
    def _next_micro_batch(self) -> tuple[Any, Any]:
        if self.data_iterator is None:
            if self.training_dataloader is None:
                raise PipelineError(f"pipeline stage {self.stage_id} has no data: pass data_iter to train_batch() / "
                                    "eval_batch(), call set_dataiterator(), or give training_data to initialize")
            from zerospeed.data.loader import RepeatingLoader

            self.data_iterator = iter(RepeatingLoader(self.training_dataloader))
        batch = next(self.data_iterator)
        if self.batch_fn is not None:
            batch = self.batch_fn(batch)
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise PipelineError(f"pipeline stage {self.stage_id}: a micro-batch must be a pair (inputs, labels), "
                                f"got {type(batch).__name__}{'' if not isinstance(batch, (tuple, list)) else ' of ' + str(len(batch))}; "
                                "use set_batch_fn() to turn yours into one")
        return batch[0], batch[1]

    def _prepare(self, inputs: Any) -> Any:
        args, _ = self.policy.cast_forward_args((inputs,), {})
        return args[0]

    def _loss(self, outputs: Any, labels: Any) -> Any:
        loss_fn = self.pipeline.loss_fn
        return outputs if loss_fn is None else loss_fn(outputs, labels)

    def _scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale_loss(loss.float() / self.micro_batches)

    @contextlib.contextmanager
    def _weight_backward(self, final: bool) -> Iterator[None]:
        with self.timers.phase("backward"):
            with self.timers.phase("backward_inner"):
                self.state.begin_backward(final)
                yield
            with self.timers.phase("backward_allreduce"):
                self.state.end_backward()

    def _window_grads(self) -> StepGrads:
        grads = self.state.step_grads()
        self.pipe.tied.sum_grads(self.state)
        return grads

    def _window_loss_value(self) -> float:
        """This stage's losses of the batch, summed (only the last stage computes losses: 0.0 elsewhere,
        so other stages name a non-finite step by its gradient norm). Detached: only the value is wanted, so
        the sums build no autograd graph, which would keep the losses' own graphs alive with it."""
        run = self.last_run
        values = [t.detach().float().sum() for loss in (run.losses if run is not None else []) for t in tensors_of(loss)
                  if t.is_floating_point()]
        return float(torch.stack(values).sum()) if values else 0.0

    # -- losses -----------------------------------------------------------------------------------
    def _mean_over_dp(self, losses: list[Any], micro: int) -> torch.Tensor:
        """The last stage's mean over micro-batches, averaged over the data-parallel replicas."""
        values = [t.float() for loss in losses for t in tensors_of(loss)]
        if len(values) != micro or any(v.numel() != 1 for v in values):
            raise PipelineError("the pipeline's last stage must produce one scalar loss per micro-batch to average; "
                                "pass reduce_output=None to get its outputs as they are")
        mean = torch.stack([v.reshape(()) for v in values]).mean().reshape(1)
        self.comm.all_reduce(mean, op="avg")
        return mean[0]

    def _aggregate(self, losses: list[Any], micro: int) -> torch.Tensor:
        """The batch's mean loss on every stage: computed on the last, broadcast over the pipeline."""
        device = next(iter(self.module.parameters()), torch.zeros(0)).device
        value = self._mean_over_dp(losses, micro).reshape(1) if self.is_last_stage() else torch.zeros(1, device=device)
        if self.num_stages > 1:
            self.mesh.comm("pp").broadcast(value, src=self.num_stages - 1)
        return value[0]


__all__ = ["PipelineEngine", "PipelineError", "PipeParts"]
