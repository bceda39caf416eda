"""The manifest's description of the model, merged from what every rank holds.

No rank need hold the whole model: a pipeline stage builds only its layers, a tensor-parallel rank
holds slices. So each rank describes what it holds (:func:`model_record`: parameters by global name
with their full shapes, its tensor-parallel splits, aliases, the buffers it stores) in its index
file, and the commit merges the records (:func:`merge_records`). The manifest then lists the whole
model at any topology, and a name several ranks hold (replicas, tied copies) appears once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from zerospeed.checkpoint import layout
from zerospeed.checkpoint.layout import CheckpointError
from zerospeed.checkpoint.tp_reshard import full_shape

if TYPE_CHECKING:
    from zerospeed.checkpoint.contract import CheckpointedEngine
    from zerospeed.checkpoint.topology import CheckpointTopology


def model_record(engine: CheckpointedEngine, topo: CheckpointTopology,
                 buffers: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """What this rank holds, as JSON: its parameters (full shapes), splits, aliases, and ``buffers``
    (the ones it stores)."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    aliases = {n: names[id(p)] for n, p in engine.module.named_parameters(remove_duplicate=False)
               if names[id(p)] != n}
    return {
        "params": [{"name": p.name, "shape": list(full_shape(p.name, p.shape, topo.layout)),
                    "dtype": _dtype(p.dtype), "trainable": p.trainable}
                   for p in engine.state.checkpoint_params()],
        "tensor_parallel": topo.layout.to_json(),
        "aliases": aliases,
        "buffers": [{"name": n, "shape": list(b.shape), "dtype": _dtype(b.dtype)} for n, b in buffers.items()],
    }


def merge_records(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The manifest's model keys from every rank's record (in rank order, so a pipeline's parameters
    are listed stage by stage): ``version``, ``params``, ``aliases``, ``buffers`` and, when anything
    is split, ``tensor_parallel``. Two ranks describing one name differently is an error."""
    params: dict[str, dict[str, Any]] = {}
    buffers: dict[str, dict[str, Any]] = {}
    aliases: dict[str, str] = {}
    splits: dict[str, int] = {}
    fused: dict[str, int] = {}
    degrees = set()
    for rank, record in enumerate(records):
        for entry in record["params"]:
            _add(params, entry, rank, "parameter")
        for entry in record["buffers"]:
            _add(buffers, entry, rank, "buffer")
        for alias, name in record["aliases"].items():
            _agree(aliases, alias, name, rank, "alias")
        tp = record["tensor_parallel"]
        degrees.add(int(tp["degree"]))
        for name, dim in tp.get("splits", {}).items():
            _agree(splits, name, int(dim), rank, "split dimension")
        for name, parts in tp.get("fused_parts", {}).items():
            _agree(fused, name, int(parts), rank, "fused parts")
    if len(degrees) > 1:
        raise CheckpointError(f"the ranks' tensor-parallel degrees differ ({sorted(degrees)}); build every "
                              f"stage's layers with the mesh's tp group")
    degree = degrees.pop() if degrees else 1
    split = degree > 1  # parts and full shapes: version 2 (an older zerospeed refuses, naming the upgrade)
    tensor_parallel = {"degree": degree, "splits": splits, **({"fused_parts": fused} if fused else {})}
    return {"version": layout.VERSION if split else 1, "params": list(params.values()),
            **({"tensor_parallel": tensor_parallel} if split else {}),
            "aliases": aliases, "buffers": list(buffers.values())}


def _add(seen: dict[str, dict[str, Any]], entry: Mapping[str, Any], rank: int, what: str) -> None:
    name = entry["name"]
    first = seen.setdefault(name, dict(entry))
    if (first["shape"], first["dtype"]) != (entry["shape"], entry["dtype"]):
        raise CheckpointError(f"rank {rank} holds {what} {name} as {entry['dtype']} {entry['shape']} but an earlier "
                              f"rank as {first['dtype']} {first['shape']}; every copy of a name (replicas, tied "
                              f"modules on several pipeline stages) must be built alike")


def _agree(seen: dict[str, Any], key: str, value: Any, rank: int, what: str) -> None:
    first = seen.setdefault(key, value)
    if first != value:
        raise CheckpointError(f"rank {rank} records {what} {value!r} for {key} but an earlier rank {first!r}; "
                              f"build every rank's model alike")


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


__all__ = ["merge_records", "model_record"]
