"""DeepSpeed's ``PipelineModule``: a model given as a list of layers, of which each stage builds its own.

``layers`` holds :class:`LayerSpec` (built only on the stage owning it), :class:`TiedLayerSpec`
(one module per key on every stage using it; the engine sums its gradients over those stages),
ready ``nn.Module`` instances and plain callables (a lambda reshaping a tensor). The output of
each layer is the input of the next, as in ``nn.Sequential``.

The split is a pure :class:`~zerospeed.pipe.partition.StagePlan` computed from descriptions of
the layers (:func:`describe_layers`: a spec's parameters are counted by building it on the meta
device, so nothing is allocated); the module then builds and runs only its stage's share.

Parameter names do not depend on the pipeline degree: a layer's parameters are named
``<global layer index>.<name>`` (DeepSpeed's per-layer state-dict keys), a tied module's
``tied_modules.<key>.<name>``, so a checkpoint written at one pipeline degree loads at another by name.

Differences from DeepSpeed 0.19.8, on purpose: counting parameters for ``'parameters'`` builds
specs on the meta device (DeepSpeed builds each one for real, drawing from the RNG); a tied
layer with ``forward_fn`` is judged for activation checkpointing by its module's class and
parameters (DeepSpeed sees a ``functools.partial``: no class match, no parameters); with
``seed_layers`` a tied module is built with the seed of its key's first layer on every stage
(DeepSpeed seeds it per stage, then broadcasts stage-min's weights, which are those); the forward
seed uses the true global layer index (DeepSpeed's is off inside checkpoint blocks); DeepSpeed's
``GPTModelPipe`` class-name special case for checkpointing is not reproduced; ``mpu()``,
``tied_comms`` and the checkpoint-file helpers are left to the engine and ``checkpoint/`` (which stores a
tie once, from its lowest stage: :meth:`PipelineModule.tied_copies_below`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from zerospeed import checkpointing
from zerospeed.distributed import groups
from zerospeed.pipe.partition import CheckpointBlock, LayerInfo, PartitionMethod, StagePlan, plan_stages
from zerospeed.pipe.topology import PipeDataParallelTopology, ProcessTopology
from zerospeed.runtime.utils import set_random_seed


class LayerSpec:
    """A layer to build later: ``LayerSpec(nn.Linear, 4, 8, bias=False).build()`` is
    ``nn.Linear(4, 8, bias=False)``. Only the stage owning the layer calls :meth:`build`."""

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec({typename!r}, ...): the first argument must be a torch.nn.Module "
                            "subclass (the class, not an instance); pass a module instance in the layers directly")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        """Construct the module (``log`` is accepted for DeepSpeed compatibility)."""
        del log
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer sharing one module with every other ``TiedLayerSpec`` of the same ``key`` (an
    input embedding reused as output head). With ``forward_fn``, the layer computes
    ``forward_fn(module, x)`` instead of ``module(x)``. ``tied_weight_attr`` names the tied
    tensors (dotted paths inside the module) whose gradients are summed across stages."""

    def __init__(self, key: str, typename: type[nn.Module], *module_args: Any,
                 forward_fn: Callable[[nn.Module, Any], Any] | None = None,
                 tied_weight_attr: str | Sequence[str] = ("weight",), **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        if not isinstance(key, str) or not key or "." in key:
            raise ValueError(f"TiedLayerSpec key={key!r} must be a non-empty string without '.' (it names "
                             "the tied module's parameters: tied_modules.<key>.<name>)")
        if forward_fn is not None and not callable(forward_fn):
            raise TypeError(f"TiedLayerSpec forward_fn={forward_fn!r} is not callable; pass fn(module, x) or None")
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def describe_layer(layer: Any, *, count_params: bool) -> LayerInfo:
    """The plan's view of one entry of ``layers``. Specs are counted by building them on the meta
    device under a forked RNG (nothing allocated, no random draw consumed); a constructor that
    cannot run on meta is built on the CPU instead, its result discarded."""
    if isinstance(layer, PipelineModule):
        raise TypeError("a PipelineModule cannot be a layer of another PipelineModule (nor in DeepSpeed); "
                        "pass its layers instead")
    if isinstance(layer, LayerSpec):
        name = layer.typename.__name__
        key = layer.key if isinstance(layer, TiedLayerSpec) else None
        if not count_params:
            return LayerInfo(class_name=name, type_name=name, tied_key=key)
        trainable, has_params = _count_spec(layer)
        return LayerInfo(name, name, key, trainable, has_params)
    if isinstance(layer, nn.Module):
        name = type(layer).__name__
        params = list(layer.parameters())
        return LayerInfo(name, name, None, sum(p.numel() for p in params if p.requires_grad), bool(params))
    if callable(layer):
        return LayerInfo(type(layer).__name__, getattr(layer, "__name__", None), None, 0, False)
    raise TypeError(f"pipeline layer {layer!r} is not a LayerSpec, an nn.Module nor a callable; "
                    "wrap it in LayerSpec(cls, *args) or a function")


def describe_layers(layers: Sequence[Any], *, count_params: bool) -> tuple[LayerInfo, ...]:
    return tuple(describe_layer(layer, count_params=count_params) for layer in layers)


def _count_spec(spec: LayerSpec) -> tuple[int, bool]:
    with torch.random.fork_rng(devices=[]):
        try:
            with torch.device("meta"):
                module = spec.build()
        except Exception:  # e.g. a constructor reading tensor values, which meta tensors do not have
            module = spec.build()
    params = list(module.parameters())
    return sum(p.numel() for p in params if p.requires_grad), bool(params)


class PipelineModule(nn.Module):
    """One pipeline stage's share of a model given as ``layers`` (DeepSpeed's constructor).

    ``num_stages`` or ``topology`` (a :class:`~zerospeed.pipe.topology.ProcessTopology` with a
    ``pipe`` axis) is required; given both, they must agree. The stage is this process's
    ``pipe`` coordinate when torch.distributed is initialized. ``stage_id`` (keyword-only) is
    zerospeed's: it builds a given stage without any process group, for tests and tools (and
    overrides the coordinate when given). Without a process group and without ``topology``, the
    topology is ``PipeDataParallelTopology(num_stages, 1)``.

    ``partition_method``: ``'parameters'`` (balance trainable parameter counts), ``'uniform'``
    (balance layer counts) or ``'type:<regex>'`` (balance the layers whose class name matches,
    case-insensitive). ``seed_layers``: seed before building layer ``i`` with ``base_seed + i``
    (through ``seed_fn``, default seeding Python, numpy and torch) and, in forward, with
    ``base_seed * (micro_batch + 1) + i``, as DeepSpeed does. ``activation_checkpoint_interval``:
    run each group of that many layers of the stage under ``activation_checkpoint_func``
    (default :func:`zerospeed.checkpointing.checkpoint`) when all of its layers' classes are in
    ``checkpointable_layers`` or, without that list, when any of them has parameters.

    The module is not moved to a device and tied weights are not synchronized here: that is the
    pipeline engine's part (see :meth:`tied_weights`).
    """

    def __init__(self, layers: Iterable[Any], num_stages: int | None = None,
                 topology: ProcessTopology | None = None, loss_fn: Callable[..., Any] | None = None,
                 seed_layers: bool = False, seed_fn: Callable[[int], Any] | None = None, base_seed: int = 1234,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable[..., Any] = checkpointing.checkpoint,
                 checkpointable_layers: Sequence[str] | None = None, dynamic_shape: bool = False, *,
                 stage_id: int | None = None, chunks: int = 1) -> None:
        super().__init__()
        if isinstance(checkpointable_layers, str):
            raise TypeError(f"checkpointable_layers={checkpointable_layers!r} must be a list of class names, "
                            f"not one string; write [{checkpointable_layers!r}]")
        self.loss_fn = loss_fn
        self.seed_layers = seed_layers
        self.seed_fn = seed_fn
        self.base_seed = base_seed
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = None if checkpointable_layers is None else list(checkpointable_layers)
        self.dynamic_shape = dynamic_shape
        self.micro_offset = 0
        self._topo = _resolve_topology(num_stages, topology)
        self.num_stages = self._topo.get_dim("pipe")
        self.stage_id = _resolve_stage(self._topo, stage_id)
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks={chunks!r} must be an integer >= 1 (model chunks per stage; > 1 for the "
                             "interleaved_1f1b schedule)")
        self.chunks = chunks

        self._layer_specs = list(layers)
        self._num_layers = len(self._layer_specs)
        method = PartitionMethod.parse(partition_method)
        count = method.needs_param_counts or (activation_checkpoint_interval > 0 and checkpointable_layers is None)
        self._layer_infos = describe_layers(self._layer_specs, count_params=count)
        self._partition_method = partition_method
        self._plan = plan_stages(self._layer_infos, self.num_stages * chunks, partition_method,
                                 activation_checkpoint_interval=activation_checkpoint_interval,
                                 checkpointable_layers=self.checkpointable_layers)
        self.parts = list(self._plan.parts)
        # chunk c of this stage is virtual stage c * num_stages + stage_id (Megatron's interleaving)
        self._chunk_ranges = [self._plan.stage_layers(self._virtual(c)) for c in range(chunks)]
        self._local_start = self._chunk_ranges[0].start
        self._local_stop = self._chunk_ranges[-1].stop

        self.forward_funcs: list[Callable[..., Any]] = []  # this stage's layers in global order
        self._funcs: dict[int, Callable[..., Any]] = {}
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self._build()

    # -- building ---------------------------------------------------------------------------------
    def _seed(self, seed: int) -> None:
        if self.seed_fn is not None:
            self.seed_fn(seed)
        else:
            set_random_seed(seed)

    def _virtual(self, chunk: int) -> int:
        return chunk * self.num_stages + self.stage_id

    def _build(self) -> None:
        for index in self.local_layers():
            layer = self._layer_specs[index]
            if self.seed_layers:
                self._seed(self.base_seed + index)
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    if self.seed_layers:  # the same initial weights on every stage holding the key
                        self._seed(self.base_seed + self._plan.tied_layers(layer.key)[0])
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                module = self.tied_modules[layer.key]
                func: Callable[..., Any] = (module if layer.forward_fn is None
                                            else functools.partial(layer.forward_fn, module))
            elif isinstance(layer, (LayerSpec, nn.Module)):
                func = layer.build() if isinstance(layer, LayerSpec) else layer
                self.add_module(str(index), func)
            else:
                func = layer
            self._funcs[index] = func
            self.forward_funcs.append(func)

    # -- running ----------------------------------------------------------------------------------
    def forward(self, forward_input: Any, chunk: int = 0) -> Any:
        """Run this stage's layers (of model chunk ``chunk``) in order, each block of the plan under
        activation checkpointing when the plan says so."""
        self.micro_offset += 1
        x = forward_input
        for block in self.chunk_blocks(chunk):
            x = self.run_block(block, x)
        return x

    def chunk_blocks(self, chunk: int = 0) -> tuple[CheckpointBlock, ...]:
        """The blocks (activation checkpointing units) of this stage's model chunk ``chunk``."""
        if not 0 <= chunk < self.chunks:
            raise ValueError(f"chunk={chunk} is outside 0..{self.chunks - 1} ({self.chunks} chunks per stage)")
        return self._plan.blocks[self._virtual(chunk)]

    def run_block(self, block: CheckpointBlock, x: Any) -> Any:
        """Run one block of this stage's layers on ``x`` (under checkpointing when it recomputes)."""
        offset = self.micro_offset + 1  # DeepSpeed's forward seed uses the count plus one
        run = self._run_range(block, offset)
        if block.recompute:
            return self.activation_checkpoint_func(run, *(x if isinstance(x, tuple) else (x,)))
        return run(x)

    def block_funcs(self, block: CheckpointBlock) -> list[Callable[..., Any]]:
        """What runs for each layer of ``block`` (a module, a tied module's bound ``forward_fn``, a callable)."""
        return [self._funcs[index] for index in range(block.start, block.stop)]

    def _run_range(self, block: CheckpointBlock, offset: int) -> Callable[..., Any]:
        funcs = self.block_funcs(block)

        def run(*inputs: Any) -> Any:
            x = inputs[0] if len(inputs) == 1 else inputs
            for index, func in zip(range(block.start, block.stop), funcs, strict=True):
                if self.seed_layers:
                    self._seed(self.base_seed * offset + index)
                x = func(x)
            return x

        return run

    def set_checkpoint_interval(self, interval: int) -> None:
        """Change ``activation_checkpoint_interval`` (the partition stays as it is)."""
        if interval > 0 and self.checkpointable_layers is None and self._layer_infos[0].has_params is None:
            self._layer_infos = describe_layers(self._layer_specs, count_params=True)
        self._plan = plan_stages(self._layer_infos, self.num_stages * self.chunks, self._partition_method,
                                 activation_checkpoint_interval=interval,
                                 checkpointable_layers=self.checkpointable_layers)

    # -- questions --------------------------------------------------------------------------------
    @property
    def activation_checkpoint_interval(self) -> int:
        return self._plan.checkpoint_interval

    @activation_checkpoint_interval.setter
    def activation_checkpoint_interval(self, interval: int) -> None:
        self.set_checkpoint_interval(interval)

    @property
    def plan(self) -> StagePlan:
        """The partition of every stage (the same value on every stage)."""
        return self._plan

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def topology(self) -> ProcessTopology:
        return self._topo

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def partitions(self) -> list[int]:
        """DeepSpeed's boundaries: stage ``s`` owns layers ``parts[s]:parts[s + 1]`` (with ``chunks > 1``,
        virtual stage ``v`` owns ``parts[v]:parts[v + 1]`` and lives on stage ``v % num_stages``)."""
        return list(self.parts)

    def stage_owner(self, layer_idx: int) -> int:
        return self._plan.stage_owner(layer_idx) % self.num_stages

    def local_layers(self) -> list[int]:
        """Global indices of this stage's layers, ascending (``forward_funcs[i]`` is the i-th)."""
        return [index for chunk in self._chunk_ranges for index in chunk]

    def chunk_layers(self, chunk: int) -> range:
        """Global indices of the layers of this stage's model chunk ``chunk``."""
        return self._chunk_ranges[chunk]

    def tied_stages(self, key: str) -> list[int]:
        """Stages holding a copy of tie ``key``: the ranks of those stages (same data and model
        coordinates) sum its gradients and start from the lowest stage's weights."""
        return sorted({v % self.num_stages for v in self._plan.tied_stages(key)})

    def tied_weights(self) -> list[tuple[str, str, torch.Tensor]]:
        """``(key, attribute path, tensor)`` of every tied tensor on this stage, sorted by key
        (the order all stages agree on), for the engine's broadcast and gradient sum."""
        out = []
        for key in sorted(self.tied_modules.keys()):
            for path in self.tied_weight_attrs[key]:
                out.append((key, path, _getattr_path(self.tied_modules[key], path)))
        return out

    def tied_copies_below(self) -> frozenset[str]:
        """Names of this stage's tied-module parameters and buffers (``tied_modules.<key>.<name>``) whose
        key a lower stage holds too. Checkpoints store each tie once, from its lowest stage (the copies
        are kept equal), and every stage holding it loads that one value."""
        out: set[str] = set()
        for key in self.tied_modules:
            if self.tied_stages(key)[0] == self.stage_id:
                continue
            prefix = f"tied_modules.{key}."
            out.update(name for name, _ in self.named_parameters() if name.startswith(prefix))
            out.update(name for name, _ in self.named_buffers() if name.startswith(prefix))
        return frozenset(out)

    def get_additional_losses(self) -> dict[str, torch.Tensor] | None:
        """Extra losses to report (none by default; subclasses may override, as in DeepSpeed)."""
        return None


def _getattr_path(module: nn.Module, path: str) -> torch.Tensor:
    value: Any = module
    for part in path.split("."):
        if not hasattr(value, part):
            raise AttributeError(f"tied_weight_attr {path!r}: {type(value).__name__} has no attribute {part!r}; "
                                 "name tensors of the tied module, e.g. 'weight'")
        value = getattr(value, part)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"tied_weight_attr {path!r} is a {type(value).__name__}, not a tensor")
    return value


def _resolve_topology(num_stages: int | None, topology: ProcessTopology | None) -> ProcessTopology:
    if topology is None and num_stages is None:
        raise ValueError("PipelineModule needs num_stages or topology; pass num_stages=<pipeline degree>")
    if num_stages is not None and (isinstance(num_stages, bool) or not isinstance(num_stages, int)
                                   or num_stages < 1):
        raise ValueError(f"num_stages={num_stages!r} must be an integer >= 1")
    if topology is not None:
        if not isinstance(topology, ProcessTopology):
            raise TypeError(f"topology={topology!r} is not a ProcessTopology; build one with "
                            "PipeDataParallelTopology(num_pp, num_dp) or PipeModelDataParallelTopology")
        if "pipe" not in topology.get_axis_names():
            raise ValueError(f"{topology!r} has no 'pipe' axis; PipelineModule reads its stages from it")
        if num_stages is not None and topology.get_dim("pipe") != num_stages:
            raise ValueError(f"num_stages={num_stages} but {topology!r} has {topology.get_dim('pipe')} pipe "
                             "stages; pass only one of them, or make them agree")
        if groups.is_initialized() and topology.world_size() != groups.group_size():
            raise ValueError(f"{topology!r} has {topology.world_size()} ranks but the process group has "
                             f"{groups.group_size()}; build the topology for the job's world size")
        return topology
    assert num_stages is not None
    world = groups.group_size() if groups.is_initialized() else num_stages
    if world % num_stages:
        raise ValueError(f"num_stages={num_stages} must divide the world size {world}; choose a divisor of {world}")
    return PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages)


def _resolve_stage(topology: ProcessTopology, stage_id: int | None) -> int:
    num_stages = topology.get_dim("pipe")
    if stage_id is not None:
        if isinstance(stage_id, bool) or not isinstance(stage_id, int) or not 0 <= stage_id < num_stages:
            raise ValueError(f"stage_id={stage_id!r} is outside 0..{num_stages - 1} ({num_stages} stages)")
        return stage_id
    if groups.is_initialized():
        return int(topology.get_coord(groups.group_rank()).pipe)
    if num_stages == 1:
        return 0
    raise ValueError(f"PipelineModule with {num_stages} stages needs to know its stage: initialize "
                     "torch.distributed first (zerospeed.init_distributed()), or pass stage_id=<stage> to build "
                     "one stage without processes")


__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec", "describe_layer", "describe_layers"]
