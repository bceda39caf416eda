"""Lookup-table gradients exchanged as the rows a window touched (the config's ``sparse_gradients``).

An ``nn.Embedding`` / ``nn.EmbeddingBag`` weight's gradient is exactly zero outside the rows its
inputs looked up, so all-reducing the whole table sends mostly zeros. At ZeRO stage 0:

* :class:`SparseRows` (the declared policy handed to :class:`~zerospeed.zero.replicated.ReplicatedState`)
  names the model's lookup tables, refusing a weight that another module also uses (tied to an
  output head, its gradient has rows no lookup touched);
* :class:`TouchedRows` records, after every lookup's forward, which rows its inputs named (the
  union over the micro-batches of an accumulation window; ``padding_idx`` never gets a gradient);
* :class:`RowExchange` is the collective of a table's own bucket (:mod:`zero.grads`): counts, then
  row indices and row values through the Comm's uneven ``all_gather``; every rank then adds all
  ranks' rows into the zeroed bucket in rank order. The bucket was scaled by the same
  :class:`~zerospeed.zero.reducer.ReductionPolicy` calls and in the same dtype as a dense bucket,
  so the result is the dense all-reduce's (summed in rank order).

Rows are never chosen by testing values: a touched row whose gradient sums to zero is still sent
(DeepSpeed's ``SparseTensor`` dropped rows whose values summed to zero).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zerospeed.config import ConfigError
from zerospeed.distributed.comm import Comm, Handle

LOOKUPS = (nn.Embedding, nn.EmbeddingBag)


def refuse_unsupported(*, stage: int, pipeline: bool, tp: int) -> None:
    """Refuse, by key, the setups where rows are not exchanged (checked at ``initialize``). A model with
    experts is fine: its dense state (over data parallelism) holds the tables, the experts' state none."""
    problems = []
    if stage != 0:
        problems.append(f"sparse_gradients: true needs zero_optimization.stage 0, got zero_optimization.stage="
                        f"{stage} (stages 1-3 reduce-scatter each unit's flat buffer into shards, so rows "
                        f"cannot be exchanged alone); set zero_optimization.stage to 0 or sparse_gradients to false")
    if pipeline:
        problems.append("sparse_gradients: true is not supported with a PipelineModule (pipeline parallelism); "
                        "set sparse_gradients to false")
    if tp > 1:
        problems.append(f"sparse_gradients: true is not supported with tensor parallelism (tp size {tp}); "
                        f"set sparse_gradients to false")
    if problems:
        raise ConfigError(problems)


@dataclass(frozen=True, eq=False)
class SparseRows:
    """The lookup tables whose gradients travel as touched rows (the policy a stage-0 state is given)."""

    tables: tuple[tuple[str, nn.Module, torch.Tensor], ...]  # (module name, module, its weight)

    @classmethod
    def of_model(cls, model: nn.Module) -> SparseRows:
        """Every trainable ``nn.Embedding`` / ``nn.EmbeddingBag`` weight of ``model`` (DeepSpeed's choice).

        A weight registered under a second name (tied to an output head, say) gets gradient rows
        from that other use, which no lookup records: refused, naming both places. A weight used
        by name elsewhere in a ``forward`` (``x @ self.emb.weight.T``) cannot be seen here: with
        ``sparse=True`` its gradient then arrives dense and is refused at backward; with
        ``sparse=False`` it is the user's to avoid (the rows outside the lookups would be lost)."""
        names: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        tables: list[tuple[str, nn.Module, torch.Tensor]] = []
        for module_name, module in model.named_modules():
            if not isinstance(module, LOOKUPS) or not module.weight.requires_grad:
                continue
            where = names.get(id(module.weight), [])
            if len(where) > 1:
                raise ConfigError(f"sparse_gradients: true: the weight of {type(module).__name__} "
                                  f"'{module_name}' is also the parameter {', '.join(repr(n) for n in where[1:])} "
                                  f"(tied weights); its gradient then has rows no lookup touched. Untie the "
                                  f"weights or set sparse_gradients to false")
            tables.append((module_name, module, module.weight))
        return cls(tuple(tables))

    def track(self, params: Sequence[nn.Parameter]) -> TouchedRows:
        """Start recording the rows looked up in the tables among ``params`` (a state's parameters)."""
        mine = {id(p) for p in params}
        return TouchedRows([table for table in self.tables if id(table[2]) in mine])


class TouchedRows:
    """Which rows of each table this rank's lookups used since the table's last exchange.

    A forward hook marks the looked-up rows in a boolean mask per table (bounded memory, however
    many micro-batches); :meth:`take` returns them and clears the mask, so a forward after the
    exchange counts for the next window. Lookups run without autograd are not recorded (no
    gradient follows); recording more rows than needed only costs bytes, never exactness. Made
    before the reducer registers its gradient hooks, so a ``sparse=True`` table's gradient is
    checked to be sparse (used only by its lookups) before the reducer takes it."""

    def __init__(self, tables: Sequence[tuple[str, nn.Module, torch.Tensor]]):
        self._tables = {id(w): (m, torch.zeros(w.shape[0], dtype=torch.bool, device=w.device))
                        for _, m, w in tables}
        self._hooks: list[RemovableHandle] = [
            m.register_forward_hook(self._recorder(mask), with_kwargs=True) for m, mask in self._tables.values()]
        self._hooks += [w.register_post_accumulate_grad_hook(_sparse_or_refuse(name, m))
                        for name, m, w in tables if getattr(m, "sparse", False)]

    @staticmethod
    def _recorder(mask: torch.Tensor) -> Any:
        def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if torch.is_grad_enabled():  # EmbeddingBag: every entry of ``input`` lies in some bag
                ids = args[0] if args else kwargs["input"]
                mask[ids.reshape(-1).to(mask.device)] = True
        return record

    def covers(self, param: torch.Tensor) -> bool:
        return id(param) in self._tables

    def take(self, param: torch.Tensor) -> torch.Tensor:
        """The sorted rows of ``param`` looked up since the last call (``padding_idx`` left out)."""
        module, mask = self._tables[id(param)]
        padding = getattr(module, "padding_idx", None)
        if padding is not None:
            mask[padding] = False
        rows = mask.nonzero().reshape(-1)
        mask.zero_()
        return rows

    def exchange(self, comm: Comm, param: torch.Tensor) -> RowExchange:
        """The collective of ``param``'s own bucket."""
        return RowExchange(comm, self, param)

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def _sparse_or_refuse(name: str, module: nn.Module) -> Any:
    def check(weight: torch.Tensor) -> None:
        if weight.grad is not None and not weight.grad.is_sparse:
            raise RuntimeError(f"sparse_gradients: true: the weight of {type(module).__name__} '{name}' "
                               f"(sparse=True) received a dense gradient, so it is used outside its lookups "
                               f"and has gradient rows no lookup touched; use the weight only through the "
                               f"module or set sparse_gradients to false")
    return check


@dataclass(frozen=True, eq=False)
class RowExchange:
    """A table's bucket reduced as rows: every rank ends with the rank-ordered sum of all ranks' rows."""

    comm: Comm
    touched: TouchedRows
    param: torch.Tensor

    def launch(self, wire: torch.Tensor) -> RowsInFlight:
        """Send this rank's touched rows of ``wire`` (the bucket, already scaled by the reduction policy)."""
        num_rows = self.param.shape[0]
        assert wire.numel() == self.param.numel(), "a table's bucket holds the table alone"
        table = wire.view(num_rows, -1)
        rows = self.touched.take(self.param).to(torch.int32 if num_rows < 2 ** 31 else torch.int64)
        counts = torch.zeros(self.comm.world_size, dtype=torch.int64, device=wire.device)
        self.comm.all_gather(counts, torch.tensor([rows.numel()], dtype=torch.int64, device=wire.device))
        sizes = [int(n) for n in counts.tolist()]
        index_parts = [torch.empty(n, dtype=rows.dtype, device=wire.device) for n in sizes]
        value_parts = [torch.empty(n * table.shape[1], dtype=wire.dtype, device=wire.device) for n in sizes]
        handles: list[Handle] = []
        if sum(sizes):  # every rank sees the same counts, so every rank skips together
            values = table.index_select(0, rows).reshape(-1)
            for parts, mine in ((index_parts, rows), (value_parts, values)):
                handle = self.comm.all_gather(parts, mine, async_op=True)
                assert handle is not None
                handles.append(handle)
        return RowsInFlight(handles, table, index_parts, value_parts)

    def result(self, wire: torch.Tensor) -> torch.Tensor:
        return wire


class RowsInFlight:
    """The gathers of one table's rows; once both are in, all ranks' rows are added in rank order."""

    def __init__(self, handles: list[Handle], table: torch.Tensor, indices: list[torch.Tensor],
                 values: list[torch.Tensor]):
        self._handles, self._table, self._indices, self._values = handles, table, indices, values
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        for handle in self._handles:
            handle.wait()
        self._table.zero_()
        for rows, values in zip(self._indices, self._values, strict=True):  # rows are unique per rank
            self._table.index_add_(0, rows.long(), values.view(rows.numel(), self._table.shape[1]))
        self._done = True

    def is_completed(self) -> bool:
        if not self._done and all(handle.is_completed() for handle in self._handles):
            self.wait()
        return self._done
