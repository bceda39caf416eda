"""Pipeline parallelism. So far: the pure part -- instructions, schedules as data, and a simulator that
checks them (no torch, no processes); the interpreter and engine that execute them come later."""

from .instructions import (Backward, BackwardInput, BackwardWeight, Forward, Instruction, LoadMicroBatch,
                           OptimizerStep, RecvActivation, RecvGrad, ReduceGrads, ReduceTiedGrads,
                           SendActivation, SendGrad)
from .schedules import (DEFAULT_SCHEDULE, SCHEDULES, Schedule, ScheduleError, gpipe, inference,
                        interleaved_1f1b, one_f_one_b, schedule_for, zero_bubble_h1)
from .simulate import Costs, Deadlock, ScheduleViolation, SimResult, simulate

__all__ = [
    "Backward", "BackwardInput", "BackwardWeight", "Forward", "Instruction", "LoadMicroBatch",
    "OptimizerStep", "RecvActivation", "RecvGrad", "ReduceGrads", "ReduceTiedGrads", "SendActivation",
    "SendGrad", "DEFAULT_SCHEDULE", "SCHEDULES", "Schedule", "ScheduleError", "gpipe", "inference",
    "interleaved_1f1b", "one_f_one_b", "schedule_for", "zero_bubble_h1", "Costs", "Deadlock",
    "ScheduleViolation", "SimResult", "simulate",
]
