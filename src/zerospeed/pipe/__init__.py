"""Pipeline parallelism (DeepSpeed's ``deepspeed.pipe``): ``PipelineModule`` with ``LayerSpec`` /
``TiedLayerSpec``, the topologies and partition methods, the pure schedules (instructions as data: GPipe,
1F1B, interleaved 1F1B, ZB-H1) with a simulator that checks them, ``StageLink`` (point-to-point
activations and gradients with a shape handshake), the one interpreter (``StageRun``) and the
``PipelineEngine`` that ``zerospeed.initialize`` returns for a ``PipelineModule``. See ``docs/pipeline.md``."""

from .instructions import (Backward, BackwardInput, BackwardWeight, Forward, Instruction, LoadMicroBatch,
                           OptimizerStep, RecvActivation, RecvGrad, ReduceGrads, ReduceTiedGrads,
                           SendActivation, SendGrad)
from .engine import PipelineEngine, PipelineError
from .interpreter import StageFailed, StageHooks, StageRun
from .module import LayerSpec, PipelineModule, TiedLayerSpec
from .p2p import HeaderMismatch, PendingSend, StageLink
from .partition import PartitionMethod, StagePlan, partition_balanced, partition_uniform, plan_stages
from .schedules import (DEFAULT_SCHEDULE, SCHEDULES, Schedule, ScheduleError, gpipe, inference,
                        interleaved_1f1b, one_f_one_b, schedule_for, zero_bubble_h1)
from .simulate import Costs, Deadlock, ScheduleViolation, SimResult, simulate
from .topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = [
    "PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology", "PipeDataParallelTopology",
    "PipeModelDataParallelTopology", "PartitionMethod", "StagePlan", "partition_balanced", "partition_uniform",
    "plan_stages",
    "Backward", "BackwardInput", "BackwardWeight", "Forward", "Instruction", "LoadMicroBatch",
    "OptimizerStep", "RecvActivation", "RecvGrad", "ReduceGrads", "ReduceTiedGrads", "SendActivation",
    "SendGrad", "DEFAULT_SCHEDULE", "SCHEDULES", "Schedule", "ScheduleError", "gpipe", "inference",
    "interleaved_1f1b", "one_f_one_b", "schedule_for", "zero_bubble_h1", "Costs", "Deadlock",
    "ScheduleViolation", "SimResult", "simulate", "StageLink", "PendingSend", "HeaderMismatch",
    "PipelineEngine", "PipelineError", "StageFailed", "StageHooks", "StageRun",
]
