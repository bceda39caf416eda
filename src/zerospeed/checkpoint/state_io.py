"""Model and optimizer state <-> checkpoint fragments, for any stage and any world size.

Saving turns a rank's :class:`Slot` list into named 1-D tensors: the master values (kind
``master``) and every per-element optimizer state (kind ``optim.<key>``, e.g. ``optim.exp_avg``),
each covering the slot's element range; per-parameter scalars (Adam's ``step``) go to the
manifest. Loading asks the checkpoint for exactly the ranges the new topology's slots cover.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from zerospeed.checkpoint.layout import BUFFER, MASTER, OPTIM_PREFIX, CheckpointError, tensor_key
from zerospeed.checkpoint.reader import CheckpointSet
from zerospeed.checkpoint.safetensors_io import FileChecksums, StreamingWriter
from zerospeed.sharding.slots import Slot

SCALAR_KEYS = frozenset({"step"})  # per-parameter counters, never per element


@dataclass
class RankPayload:
    """What one rank writes: 1-D tensors by key, their fragments, and optimizer scalars."""

    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    fragments: list[dict[str, Any]] = field(default_factory=list)
    scalars: dict[str, dict[str, Any]] = field(default_factory=dict)
    group_params: list[list[str]] = field(default_factory=list)

    def add(self, kind: str, param: str, start: int, end: int, tensor: torch.Tensor) -> None:
        key = tensor_key(kind, param, start, end)
        self.tensors.append((key, tensor))
        self.fragments.append({"kind": kind, "param": param, "start": start, "end": end, "key": key})

    def snapshot(self) -> "RankPayload":
        """A private CPU copy of every tensor, so training may go on while it is written."""
        copied = [(key, t.detach().to("cpu", copy=True)) for key, t in self.tensors]
        return RankPayload(copied, self.fragments, self.scalars, self.group_params)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)

    @classmethod
    def of_buffers(cls, buffers: Mapping[str, torch.Tensor]) -> "RankPayload":
        """The model's buffers, whole (views)."""
        out = cls()
        for name, buf in buffers.items():
            out.add(BUFFER, name, 0, buf.numel(), buf.detach().reshape(-1))
        return out

    @classmethod
    def joined(cls, parts: Iterable["RankPayload"]) -> "RankPayload":
        """One payload of every part, in order (parts whose views all stay valid together)."""
        out = cls()
        for part in parts:
            out.extend(part)
        return out

    def extend(self, other: "RankPayload") -> None:
        """Append ``other`` (fragments of other parameters: a later group of units, the buffers)."""
        self.tensors += other.tensors
        self.fragments += other.fragments
        self.scalars.update(other.scalars)
        for g, names in enumerate(other.group_params):
            while len(self.group_params) <= g:
                self.group_params.append([])
            self.group_params[g] += names

    def write(self, path: str, metadata: Mapping[str, str]) -> FileChecksums:
        """The tensors as one safetensors file, in order; returns the CRC-32s the manifest records."""
        entries = [(key, t.dtype, (t.numel(),)) for key, t in self.tensors]
        with StreamingWriter(path, entries, metadata, checksums=True) as writer:
            for _, tensor in self.tensors:
                writer.write(tensor)
        return writer.checksums


@contextlib.contextmanager
def _visiting(parts: Callable[[], Iterator[RankPayload]]) -> Iterator[Iterator[RankPayload]]:
    """``contextlib.closing(parts())``: a generator is closed when the visit ends, even early (its
    ``finally`` blocks run now). Typed as any iterator, so ``close`` is called only where it exists."""
    visit = parts()
    try:
        yield visit
    finally:
        close = getattr(visit, "close", None)
        if close is not None:
            close()


class StreamedPayload:
    """A rank's fragments produced in parts, each valid only until the next is asked for (NVMe-tier
    units made resident one group at a time), so a save never holds more than one part in memory.

    A safetensors header lists every tensor before the data, so the parts are visited twice: once
    here for the keys, dtypes and sizes (and the fragments, scalars and group membership, which the
    index needs), once by :meth:`write`. The second visit must produce the same tensors; the state
    must not change in between (a save runs on the training thread between steps).
    """

    def __init__(self, parts: Callable[[], Iterator[RankPayload]]):
        self._parts = parts
        self._entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        summary = RankPayload()
        with _visiting(parts) as visit:
            for part in visit:
                self._entries += [(key, t.dtype, (t.numel(),)) for key, t in part.tensors]
                summary.extend(RankPayload([], part.fragments, part.scalars, part.group_params))
        self.fragments, self.scalars, self.group_params = summary.fragments, summary.scalars, summary.group_params

    @property
    def nbytes(self) -> int:
        return sum(n[0] * torch.empty(0, dtype=dtype).element_size() for _, dtype, n in self._entries)

    def write(self, path: str, metadata: Mapping[str, str]) -> FileChecksums:
        """Write the file, visiting the parts again (one in memory at a time); returns its CRC-32s."""
        position = 0
        with StreamingWriter(path, self._entries, metadata, checksums=True) as writer, \
                _visiting(self._parts) as visit:
            for part in visit:
                for key, tensor in part.tensors:
                    got = (key, tensor.dtype, (tensor.numel(),))
                    expected = self._entries[position] if position < len(self._entries) else None
                    if got != expected:
                        raise CheckpointError(f"{path}: tensor {position} changed while the save visited the "
                                              f"state twice (first {expected}, now {got}); do not change the "
                                              f"model or optimizer while save_checkpoint runs")
                    writer.write(tensor)
                    position += 1
        return writer.checksums


def collect(slots: Sequence[Slot], optimizer: torch.optim.Optimizer | None, *, with_optimizer: bool) -> RankPayload:
    """This rank's fragments (views of the live state, not copies)."""
    out = RankPayload()
    for slot in slots:
        if slot.numel:
            out.add(MASTER, slot.param, slot.start, slot.end, slot.master.detach().reshape(-1))
    if optimizer is None or not with_optimizer:
        return out
    name_of = {id(slot.opt_key): slot.param for slot in slots if slot.opt_key is not None}
    for slot in slots:
        if slot.opt_key is None:
            continue
        for key, value in optimizer.state.get(slot.opt_key, {}).items():
            if _per_element(key, value, slot.opt_key):
                if slot.numel:
                    part = value.detach().reshape(-1)[slot.key_offset: slot.key_offset + slot.numel]
                    out.add(OPTIM_PREFIX + key, slot.param, slot.start, slot.end, part)
            else:
                out.scalars.setdefault(slot.param, {})[key] = _encode_scalar(slot.param, key, value, slot.opt_key)
    out.group_params = [[name_of[id(p)] for p in group["params"] if id(p) in name_of]
                        for group in optimizer.param_groups]
    return out


def _per_element(key: str, value: Any, like: torch.Tensor) -> bool:
    """Whether optimizer state ``key`` holds one value per element of the tensor ``like`` (resharded
    as fragments) rather than one per parameter (kept in the manifest). A 0-dim parameter's moments
    are 0-dim like its ``step``: only the name tells them apart (every torch optimizer and Lamb name
    their counter ``step``), and stages 1-3 hold that parameter as a 1-element piece, so its moments
    must be fragments or they would not fit there."""
    if not isinstance(value, torch.Tensor) or value.numel() != like.numel():
        return False
    return value.dim() > 0 or (like.dim() == 0 and key not in SCALAR_KEYS)


def _encode_scalar(param: str, key: str, value: Any, like: torch.Tensor) -> dict[str, Any]:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return {"value": value.item(), "dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape),
                "on_param_device": value.device == like.device}
    if isinstance(value, (bool, int, float)) or value is None:
        return {"value": value}
    raise CheckpointError(f"optimizer state {key!r} of parameter {param} is a {type(value).__name__}"
                          f"{' of shape ' + str(tuple(value.shape)) if isinstance(value, torch.Tensor) else ''}: "
                          f"neither one value per element nor a scalar, so it cannot be resharded")


def _decode_scalar(entry: dict[str, Any], like: torch.Tensor) -> Any:
    if "dtype" not in entry:
        return entry["value"]
    device = like.device if entry.get("on_param_device") else torch.device("cpu")
    return torch.tensor(entry["value"], dtype=getattr(torch, entry["dtype"]), device=device).reshape(entry["shape"])


def load_masters(slots: Sequence[Slot], ckpt: CheckpointSet, *, strict: bool,
                 optional: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Fill every slot's master values; returns the parameters the checkpoint lacks (an error when
    ``strict``, unless they are ``optional``: frozen parameters a save excluded keep their values)."""
    missing = missing_params([slot.param for slot in slots], ckpt, strict=strict)
    keep = set(missing) | {slot.param for slot in slots if slot.param in optional and not ckpt.has(MASTER, slot.param)}
    with torch.no_grad():
        for slot in slots:
            if slot.numel and slot.param not in keep:
                ckpt.read_range(MASTER, slot.param, slot.start, slot.end, slot.master)
    return missing


def missing_params(names: Iterable[str], ckpt: CheckpointSet, *, strict: bool) -> list[str]:
    """The parameters of ``names`` the checkpoint has no values for (an error when ``strict``)."""
    missing = sorted({name for name in names if ckpt.canonical(name) is None})
    if missing and strict:
        raise CheckpointError(f"{ckpt.path} has no values for {len(missing)} parameter(s) of this model: "
                              f"{_names(missing)}; load with load_module_strict=False to keep their current values")
    return missing


def restore_optimizer_states(slots: Sequence[Slot], optimizer: torch.optim.Optimizer, ckpt: CheckpointSet,
                             *, replace: bool = True) -> None:
    """Rebuild the optimizer's per-parameter state for the tensors this rank now holds: all of it
    (``replace``: states of tensors not among ``slots`` are dropped), or only that of ``slots``' tensors
    (a load visiting groups of units; :func:`keep_states_of` drops the rest at the end)."""
    saved = ckpt.manifest.get("optimizer") or {}
    scalars = saved.get("scalars", {})
    by_key: dict[int, list[Slot]] = defaultdict(list)
    for slot in slots:
        if slot.opt_key is not None:
            by_key[id(slot.opt_key)].append(slot)
    state: dict[torch.Tensor, dict[str, Any]] = {}
    for group in by_key.values():
        key_tensor = group[0].opt_key
        assert key_tensor is not None
        param = group[0].param
        entry: dict[str, Any] = {}
        for kind in ckpt.kinds(param):
            if not kind.startswith(OPTIM_PREFIX):
                continue
            dtype = ckpt.stored_dtype(kind, param)
            current = optimizer.state.get(key_tensor, {}).get(kind.removeprefix(OPTIM_PREFIX))
            if (isinstance(current, torch.Tensor) and current.dtype == dtype and current.is_contiguous()
                    and current.numel() == key_tensor.numel() and current.device == key_tensor.device):
                values = current.detach().view(-1)  # refilled in place: no allocation, pages already mapped
            else:
                covered = sum(slot.numel for slot in group) == key_tensor.numel()  # always, for our states
                make = torch.empty if covered else torch.zeros  # zero-filling 1 GB costs ~0.5 s of a load
                values = make(key_tensor.numel(), dtype=dtype, device=key_tensor.device)
            for slot in group:
                ckpt.read_range(kind, param, slot.start, slot.end,
                                values[slot.key_offset: slot.key_offset + slot.numel])
            # a refilled tensor stays the same object (an NVMe slab keeps its attached views)
            refilled = values.data_ptr() == getattr(current, "data_ptr", lambda: -1)() and current.shape == key_tensor.shape
            entry[kind.removeprefix(OPTIM_PREFIX)] = current if refilled else values.view(key_tensor.shape)
        for key, value in scalars.get(param, {}).items():
            entry[key] = _decode_scalar(value, key_tensor)
        if entry:
            state[key_tensor] = entry
    if replace:
        optimizer.state.clear()
    else:
        for group in by_key.values():
            opt_key = group[0].opt_key  # never None: by_key holds only slots with a key
            if opt_key is not None:
                optimizer.state.pop(opt_key, None)
    optimizer.state.update(state)


def keep_states_of(optimizer: torch.optim.Optimizer, keys: Iterable[torch.Tensor]) -> None:
    """Drop the optimizer state of every tensor but ``keys`` (after loading group by group, what a
    single :func:`restore_optimizer_states` with ``replace`` would have dropped)."""
    wanted = {id(key) for key in keys}
    for key in [key for key in optimizer.state if id(key) not in wanted]:
        del optimizer.state[key]


def load_param_groups(optimizer: torch.optim.Optimizer, ckpt: CheckpointSet) -> None:
    """Restore each group's hyperparameters (lr, betas, weight decay, ...) by position, as torch does."""
    saved = (ckpt.manifest.get("optimizer") or {}).get("param_groups", [])
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(f"{ckpt.path}: the saved optimizer has {len(saved)} param group(s), this one "
                              f"{len(optimizer.param_groups)}; build the optimizer with the same groups, or load "
                              f"with load_optimizer_states=False")
    for group, values in zip(optimizer.param_groups, saved):
        for key, value in values.items():
            if key == "params":
                continue
            current = group.get(key)
            group[key] = tuple(value) if isinstance(current, tuple) and isinstance(value, list) else value


def describe_groups(optimizer: torch.optim.Optimizer, group_params: list[list[str]]) -> list[dict[str, Any]]:
    """The optimizer's groups as JSON: hyperparameters plus the names of their parameters."""
    out = []
    for g, group in enumerate(optimizer.param_groups):
        values = {k: _jsonable(v) for k, v in group.items() if k != "params"}
        values["params"] = group_params[g] if g < len(group_params) else []
        out.append(values)
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return repr(value)


def _names(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
