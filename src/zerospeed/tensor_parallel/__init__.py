"""Tensor parallelism (Megatron's tensor slicing): parallel layers, their autograd regions, the
vocabulary-parallel loss, sequence parallelism, and the layout record the engine and checkpoints read.

Build layers with the mesh's tensor-parallel group (``tp_group=mesh``), or let AutoTP split an
existing model (``tensor_parallel.autotp_size`` in the config, or :func:`zerospeed.tp_model_init`).
"""

from zerospeed.tensor_parallel.autotp import apply_autotp, tp_model_init
from zerospeed.tensor_parallel.autotp_plan import AutoTPError, AutoTPPlan, describe_model, plan_autotp
from zerospeed.tensor_parallel.conv1d import ColumnParallelConv1D, RowParallelConv1D
from zerospeed.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from zerospeed.tensor_parallel.group import TPGroup, tp_comm
from zerospeed.tensor_parallel.layers import (ColumnParallelLinear, LayerNorm, RMSNorm, RowParallelLinear,
                                              TensorParallelLayer, VocabParallelEmbedding)
from zerospeed.tensor_parallel.layout import ParamSplit, TPLayout, tp_layout
from zerospeed.tensor_parallel.regions import (copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
                                               gather_from_tensor_parallel_region, gather_sequence,
                                               reduce_from_tensor_parallel_region,
                                               reduce_scatter_to_sequence_parallel_region,
                                               scatter_to_sequence_parallel_region,
                                               scatter_to_tensor_parallel_region, sum_grads_over_group)

__all__ = [
    "apply_autotp", "tp_model_init", "AutoTPError", "AutoTPPlan", "describe_model", "plan_autotp",
    "ColumnParallelConv1D", "RowParallelConv1D",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "LayerNorm", "RMSNorm",
    "TensorParallelLayer", "vocab_parallel_cross_entropy", "ParamSplit", "TPLayout", "tp_layout", "TPGroup",
    "tp_comm", "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "gather_sequence", "sum_grads_over_group",
]
