"""``engine.save_checkpoint`` / ``engine.load_checkpoint``: what of an engine a checkpoint holds.

Model and optimizer state go through :mod:`state_io` as topology-free fragments; the rest is small:
counters, loss scaler and optimizer hyperparameters in the manifest (JSON), the LR scheduler and the
user's ``client_state`` in ``engine_state.pt``, and each rank's RNG states and data position in its
own ``rank<N>.state.pt`` so a resumed run draws the same dropout masks and batches.

Every state is saved and loaded the same way: group by group as ``engine.state.checkpoint_groups()``
says, each group resident only while it is used. State in memory is one group (its views are held at
once, and copied for an asynchronous save); swapped state is one unit per group, so a checkpoint needs
no more memory than one unit's master and optimizer state. The files are the same either way.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple, Sequence

import torch

from zerospeed.checkpoint import layout
from zerospeed.checkpoint.commit import BackgroundSave, RankSync, SaveJob, disk_error, serialize
from zerospeed.checkpoint.layout import BUFFER, CheckpointError
from zerospeed.checkpoint.model_record import model_record
from zerospeed.checkpoint.reader import CheckpointSet
from zerospeed.checkpoint.small_state import load_small_state, rng_state, set_rng_state, warn_if_unsafe
from zerospeed.checkpoint.state_io import (RankPayload, StreamedPayload, collect, describe_groups, keep_states_of,
                                           load_masters, load_param_groups, missing_params,
                                           restore_optimizer_states)
from zerospeed.checkpoint.topology import CheckpointTopology, checkpoint_topology
from zerospeed.checkpoint.tp_reshard import slots_to_save, to_parts
from zerospeed.optim.exchange import RankLocalState

if TYPE_CHECKING:
    from zerospeed.checkpoint.contract import CheckpointedEngine

log = logging.getLogger("zerospeed")
# Ranks reach a save within moments of each other (the last step's collectives line them up); one
# that has not arrived after this long is not coming (``if rank == 0:`` before a torch barrier).
HANDSHAKE_TIMEOUT = 300.0


def save_checkpoint(engine: CheckpointedEngine, save_dir: str, tag: Any = None, client_state: dict | None = None,
                    save_latest: bool = True, exclude_frozen_parameters: bool = False,
                    async_save: bool | None = None) -> BackgroundSave | str:
    """Run one save (every rank calls it); see :meth:`zerospeed.engine.Engine.save_checkpoint`."""
    topo = checkpoint_topology(engine)
    comm = topo.comm
    if not save_dir:
        raise ValueError("save_checkpoint: save_dir is empty; pass the directory to save into")
    tag = layout.check_tag(f"global_step{engine.global_steps}" if tag is None else tag)
    save_dir = os.path.abspath(os.fspath(save_dir))
    calls_before = comm.calls
    sync = RankSync(comm.store, f"zerospeed/ckpt/{topo.checkpoint_id}/{engine.next_checkpoint_call()}",
                    comm.rank, comm.world_size, comm.timeout)
    # The committer takes the folder's lock before the handshake, and its outcome rides on its hello:
    # a job refused there (another job holds the folder) fails on every rank before any rank makes or
    # writes anything in it, at no extra store round-trip.
    refused: BaseException | None = None
    if comm.rank == 0:
        try:
            engine.save_locks.acquire(save_dir)
        except Exception as exc:
            refused = exc
    hello = [tag, save_dir] if refused is None else [tag, save_dir, _refusal_text(refused)]
    sync.publish("hello", json.dumps(hello))

    def watch(missing: list[int]) -> None:
        elsewhere = {r: where for r, where in comm.ranks_waiting_beyond(calls_before).items() if r in missing}
        if elsewhere:
            # The other ranks never made this call: take it back so the next save pairs up again.
            sync.withdraw("hello")
            engine.return_checkpoint_call()
            raise CheckpointError(
                f"save_checkpoint({save_dir!r}, tag={tag!r}) was called on rank {comm.rank}, but rank(s) "
                f"{sorted(elsewhere)} went on to a collective instead ({', '.join(elsewhere.values())}). Every "
                f"rank must call save_checkpoint (each writes its own shards); do not guard it with "
                f"`if rank == 0`")

    hint = (f" (a rank that skipped the call, e.g. behind `if rank == 0:`, or that is still busy elsewhere: "
            f"ranks are expected within {HANDSHAKE_TIMEOUT:g} s of each other)")
    said = {r: json.loads(v) for r, v in
            sync.gather("hello", watch=watch, timeout=HANDSHAKE_TIMEOUT, hint=hint).items()}
    if refused is not None or len(said.get(0, ())) > 2:  # rank 0 could not take the folder's lock
        _refuse_everywhere(sync, refused, said[0][-1])
    hellos = {r: (v[0], v[1]) for r, v in said.items()}
    if len(set(hellos.values())) > 1:
        listing = "; ".join(f"rank {r}: tag {t!r} in {d}" for r, (t, d) in sorted(hellos.items()))
        raise CheckpointError(f"save_checkpoint was called with different tags or directories on different ranks "
                              f"({listing}); pass the same tag and save_dir everywhere (tag=None uses "
                              f"global_step<N>, which the ranks agree on)")
    if engine._window_open:
        warnings.warn(f"save_checkpoint in the middle of a gradient accumulation window (micro step "
                      f"{engine.micro_steps}): the partly accumulated gradients are not saved, and a run "
                      f"resumed from it starts a new window", stacklevel=3)

    tmp_dir = os.path.join(save_dir, f"{layout.TMP_PREFIX}{tag}-{topo.checkpoint_id[:8]}-{sync.prefix.rsplit('/', 1)[1]}")
    try:
        job, asynchronous = _prepare(engine, topo, sync, save_dir, tmp_dir, tag, client_state, save_latest,
                                     exclude_frozen_parameters, async_save)
    except BaseException as exc:  # the peers are past the handshake: tell them, so no one waits it out
        # a full or read-only disk (the temporary directory, an NVMe-tier state's file) said as such
        error = disk_error(exc, rank=comm.rank, tag=tag, directory=save_dir, needed=None)
        status = (str(error) if error is not None
                  else f"rank {comm.rank} could not prepare its part: {type(exc).__name__}: {exc}")
        sync.publish("written", status)
        sync.publish("committed" if comm.rank == 0 else "ack", status)
        if error is not None:
            raise error from exc
        raise
    if asynchronous:
        return BackgroundSave(job)
    return job.run()


def _refusal_text(exc: BaseException) -> str:
    """What rank 0 tells the other ranks when it could not take the save folder's lock."""
    if isinstance(exc, CheckpointError):
        return str(exc)
    return f"rank 0 could not lock the save folder: {type(exc).__name__}: {exc}"


def _refuse_everywhere(sync: RankSync, refused: BaseException | None, text: str) -> None:
    """End a save that rank 0 could not lock the folder for, on every rank: the others raise rank 0's
    message once they have said they read it, and rank 0 waits for that (under the launcher it hosts
    the store, and a script that dies at once would take it away from ranks still reading)."""
    if sync.rank != 0:
        sync.publish("ack", "refused")
        raise CheckpointError(text)
    others = list(range(1, sync.world_size))
    if others:
        try:
            sync.gather("ack", ranks=others, timeout=HANDSHAKE_TIMEOUT)
        except CheckpointError:  # a rank that died meanwhile: the refusal stands
            pass
    assert refused is not None  # rank 0 published the refusal
    raise refused


def _prepare(engine: CheckpointedEngine, topo: CheckpointTopology, sync: RankSync, save_dir: str, tmp_dir: str, tag: str, client_state: dict | None,
             save_latest: bool, exclude_frozen_parameters: bool, async_save: bool | None) -> tuple[SaveJob, bool]:
    """This rank's part of a save, ready to run: its temporary directory (leased), the fragments
    (snapshotted for an asynchronous save), and its serialized small state."""
    comm = topo.comm
    os.makedirs(tmp_dir, exist_ok=True)  # the folder's lock is rank 0's already (see save_checkpoint)
    lease = layout.DirLease(tmp_dir)
    try:
        if comm.rank == 0:
            layout.remove_stale_temporaries(save_dir, keep=tmp_dir)
        writer = engine.config.checkpoint.writer
        asynchronous = (writer is not None and writer.decoupled) if async_save is None else bool(async_save)
        frozen = ({p.name for p in engine.state.checkpoint_params() if not p.trainable}
                  if exclude_frozen_parameters else set())
        buffers = ({n: b for n, b in _persistent_buffers(engine.module).items() if n not in topo.held_elsewhere}
                   if topo.writes_buffers else {})
        plan = engine.state.checkpoint_groups()
        parts = _stream_parts(engine, topo, plan.groups, frozen, buffers)
        payload: RankPayload | StreamedPayload
        if plan.in_memory:  # every part's views stay valid together (copied for an async save)
            payload = RankPayload.joined(parts())
            if asynchronous:
                payload = payload.snapshot()
        else:  # one group resident at a time, written from there
            payload = StreamedPayload(parts)
        rank_state = serialize({"rng": rng_state(), "loader": _loader_state(engine),
                                "optimizer": _optimizer_rank_state(engine)})
        engine_state = manifest = None
        if comm.rank == 0:
            scheduler = engine.lr_scheduler
            engine_state = serialize({"lr_scheduler": scheduler.state_dict() if hasattr(scheduler, "state_dict")
                                      else None, "client_state": client_state or {}})
            warn_if_unsafe(engine_state, "client_state (or the LR scheduler's state_dict)")
            manifest = _manifest(engine, topo, tag)
            manifest["excluded_frozen_parameters"] = bool(exclude_frozen_parameters)
        job = SaveJob(sync, save_dir, tmp_dir, tag, payload, rank_state, engine_state, manifest,
                      model_record(engine, topo, buffers), save_latest, lease)
        if asynchronous and not plan.in_memory:
            # swapped state cannot be snapshotted in memory, and only this thread may make it resident:
            # its file is written before returning; the small files and the commit go on in the background
            try:
                with sync.heartbeat():
                    job.write_tensors()
            except OSError as exc:
                error = job.disk_error(exc)
                if error is None:
                    raise
                raise error from exc
            log.info("save_checkpoint(async_save=True): rank %d wrote its NVMe-tier state (%d unit group(s), "
                     "%.3g MB) before returning; the rest of checkpoint %r is saved in the background",
                     comm.rank, len(plan.groups), payload.nbytes / 2**20, tag)
    except BaseException:
        lease.release()
        raise
    return job, asynchronous


def _collect_part(engine: CheckpointedEngine, topo: CheckpointTopology, units: Sequence[int] | None,
                  frozen: set[str]) -> RankPayload:
    """Fragments of ``units``' slots (default: all), frozen parameters excluded (views, not copies);
    tensor-parallel slices as their parts, replicated parameters from tensor-parallel rank 0 only, tied
    pipeline modules from their lowest stage only."""
    slots = slots_to_save(engine.state.checkpoint_slots(for_save=True, units=units), topo.layout)
    skip = frozen | topo.held_elsewhere
    out = collect([slot for slot in slots if slot.param not in skip], engine.optimizer, with_optimizer=True)
    to_parts(out.tensors, out.fragments, topo.layout)
    return out


def _stream_parts(engine: CheckpointedEngine, topo: CheckpointTopology, groups: Sequence[Sequence[int] | None],
                  frozen: set[str],
                  buffers: dict[str, torch.Tensor]) -> Callable[[], Iterator[RankPayload]]:
    """The parts of a streamed save: each group's fragments while that group alone is resident (read
    only: nothing is written back), then the buffers."""
    def parts() -> Iterator[RankPayload]:
        for group in groups:
            with engine.state.resident_state(group, write_back=False):
                yield _collect_part(engine, topo, group, frozen)
        if buffers:
            yield RankPayload.of_buffers(buffers)
    return parts


def _manifest(engine: CheckpointedEngine, topo: CheckpointTopology, tag: str) -> dict[str, Any]:
    """Rank 0's part of the manifest: all but the model's description (``version``, ``params``,
    ``tensor_parallel``, ``aliases``, ``buffers``), which the commit merges from every rank's."""
    import zerospeed

    optimizer = engine.optimizer
    group_params: list[list[str]] = [[] for _ in optimizer.param_groups] if optimizer is not None else []
    return {
        "format": layout.FORMAT, "tag": tag,
        "zerospeed_version": zerospeed.__version__, "torch_version": torch.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world_size": engine.comm.world_size, "zero_stage": engine.state.stage,
        "micro_batch_size": engine.train_micro_batch_size_per_gpu(),
        "counters": {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                     "micro_steps": engine.micro_steps, "skipped_steps": engine.skipped_steps,
                     "gradient_accumulation_steps": engine.gradient_accumulation_steps()},
        "loss_scaler": {"class": type(engine.scaler).__name__, **engine.scaler.state_dict()},
        # the data position at any world size (the ranks' own positions only apply at the same layout)
        "data": engine.training_dataloader.position() if engine.training_dataloader is not None else None,
        **({"pipeline": {"degree": topo.pipeline_degree}} if topo.pipeline_degree > 1 else {}),
        "optimizer": None if optimizer is None else {
            "class": type(optimizer).__name__, "param_groups": describe_groups(optimizer, group_params)},
        "config": json.loads(engine.config.to_json()),
    }


class SmallState(NamedTuple):
    """A checkpoint's pickled files as this rank reads them (see :mod:`small_state`)."""

    engine: dict[str, Any]  # engine_state.pt: LR scheduler and client_state
    rank: dict[str, Any] | None  # this rank's RNG and data position; None across a topology change


def load_checkpoint(engine: CheckpointedEngine, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, custom_load_fn: Any = None, *,
                    allow_unsafe_pickle: bool = False, must_exist: bool | None = None) -> tuple[str | None, Any]:
    """Load (and reshard) a checkpoint; every rank calls it. See ``Engine.load_checkpoint``.

    Finding nothing to load returns ``(None, None)`` as DeepSpeed does, with a warning saying what
    was found (see :func:`layout.why_no_checkpoint`); under ``must_exist`` (default: the config's
    ``checkpoint.load_must_exist``) it raises instead, so a resume cannot silently start over."""
    if custom_load_fn is not None:
        raise NotImplementedError("load_checkpoint(custom_load_fn=...): zerospeed checkpoints are read by "
                                  "parameter range; load with load_module_only=True, or read weights with "
                                  "zerospeed.checkpoint.load_state_dict_from_checkpoint(model, dir)")
    topo = checkpoint_topology(engine)
    comm = topo.comm
    load_dir = os.fspath(load_dir)
    tag, path = layout.resolve(load_dir, None if tag is None else str(tag))
    seen = comm.all_gather_object((tag, path and os.path.abspath(path)))
    if len(set(seen)) > 1:
        raise CheckpointError(f"the ranks resolved different checkpoints: "
                              f"{'; '.join(f'rank {r}: {t!r} at {p}' for r, (t, p) in enumerate(seen))}; "
                              f"pass the same load_dir and tag everywhere")
    if path is None:
        found = layout.why_no_checkpoint(load_dir)
        if engine.config.checkpoint.load_must_exist if must_exist is None else must_exist:
            how = "must_exist=True" if must_exist else "checkpoint.load_must_exist is true"
            raise CheckpointError(f"load_checkpoint: {found}; nothing was loaded and, as {how}, the run stops "
                                  f"here rather than training from scratch")
        warnings.warn(f"load_checkpoint: {found}; nothing was loaded, so training starts from scratch (pass "
                      f"must_exist=True or set checkpoint.load_must_exist to raise instead)", stacklevel=3)
        return None, None
    with_optimizer = load_optimizer_states and not load_module_only
    names = _model_names(engine, topo)
    with CheckpointSet(path, topo.layout) as ckpt:
        manifest = ckpt.manifest
        small = _load_groups(engine, topo, ckpt, names, load_module_strict, with_optimizer, allow_unsafe_pickle)
        if with_optimizer and isinstance(engine.optimizer, RankLocalState):
            error: BaseException | None = None
            try:
                _restore_rank_local(engine.optimizer, topo, ckpt, allow_unsafe_pickle)
            except _LOAD_ERRORS as exc:
                error = exc
            # the refresh after it is collective (a hand-over gathers): no rank may go on alone
            comm.fail_together(error, "load_checkpoint", error_type=CheckpointError)
            _refresh_after_rank_local(engine)
    if load_module_only:
        return path, small.engine.get("client_state")
    _load_scaler(engine, manifest["loss_scaler"])
    counters = manifest["counters"]
    engine.restore_progress(
        global_steps=int(counters["global_steps"]), global_samples=int(counters["global_samples"]),
        micro_steps=resumed_micro_steps(counters, manifest["config"], engine.gradient_accumulation_steps()),
        skipped_steps=int(counters["skipped_steps"]))
    change = batch_change(manifest, engine.comm.world_size, engine.train_micro_batch_size_per_gpu(),
                          engine.gradient_accumulation_steps())
    if change is not None and topo.comm.rank == 0:
        kept, message = change
        log.log(logging.INFO if kept else logging.WARNING, "load_checkpoint: %s: %s", path, message)
    scheduler_state = small.engine.get("lr_scheduler")
    if load_lr_scheduler_states and scheduler_state is not None and hasattr(engine.lr_scheduler, "load_state_dict"):
        engine.lr_scheduler.load_state_dict(scheduler_state)
    if small.rank is not None:
        set_rng_state(small.rank["rng"])
    _restore_loader(engine, manifest, small.rank)
    return path, small.engine.get("client_state")


def batch_change(manifest: dict[str, Any], dp: int, micro: int, accumulation: int) -> tuple[bool, str] | None:
    """``(kept, line)`` when the checkpoint was saved at another data-parallel size than ``dp``: the
    saved and current micro batch, accumulation and global batch, and whether the global batch (the
    samples per optimizer step) was kept; None at the same size. A resume at another world size may
    change the batch the optimizer steps on, which nothing else would tell."""
    saved_dp = int(manifest["world_size"])
    if saved_dp == dp:
        return None
    config = manifest.get("config") or {}
    saved_micro = int(manifest.get("micro_batch_size") or config.get("train_micro_batch_size_per_gpu") or 1)
    saved_acc = int(manifest["counters"].get("gradient_accumulation_steps")
                    or config.get("gradient_accumulation_steps") or 1)
    before, now = saved_micro * saved_acc * saved_dp, micro * accumulation * dp
    line = (f"saved at data-parallel size {saved_dp} (global batch {before} = micro batch {saved_micro} x "
            f"accumulation {saved_acc} x {saved_dp} rank(s)), resumed at data-parallel size {dp} (global batch "
            f"{now} = micro batch {micro} x accumulation {accumulation} x {dp} rank(s)): ")
    if before == now:
        return True, line + (f"the global batch is kept (gradient accumulation {saved_acc} -> {accumulation}"
                             + (f", micro batch {saved_micro} -> {micro}" if saved_micro != micro else "") + ")")
    if before % (micro * dp) == 0:
        keep = (f"to keep it, set gradient_accumulation_steps to {before // (micro * dp)} (or train_batch_size to "
                f"{before})")
    else:
        keep = (f"it cannot be kept at micro batch {micro} x {dp} rank(s) ({before} is not a multiple of "
                f"{micro * dp}); change train_micro_batch_size_per_gpu to keep it")
    return False, line + (f"the global batch changed from {before} to {now} samples per optimizer step (the step "
                          f"count and learning-rate schedule go on from the checkpoint's); {keep}")


def resumed_micro_steps(counters: dict[str, Any], saved_config: dict[str, Any], accumulation: int) -> int:
    """The micro-step count to resume at: the start of the window after the saved run's last full one,
    counted in this run's accumulation. A world-size change usually changes the accumulation (the same
    global batch from fewer ranks), and restoring the count verbatim would put the first optimizer step
    after the wrong number of micro-batches. A save in mid-window (warned about) resumes at a new window."""
    saved_accumulation = int(counters.get("gradient_accumulation_steps")
                             or saved_config.get("gradient_accumulation_steps") or 1)
    return int(counters["micro_steps"]) // saved_accumulation * accumulation


def _same_data_layout(engine: CheckpointedEngine, topo: CheckpointTopology, manifest: dict[str, Any]) -> bool:
    """Whether this rank's saved RNG states and data position apply as they are: the same ranks, each
    reading the same micro-batches."""
    return (int(manifest["world_size"]) == engine.comm.world_size
            and int((manifest.get("tensor_parallel") or {}).get("degree", 1)) == topo.tp_degree
            and int((manifest.get("pipeline") or {}).get("degree", 1)) == topo.pipeline_degree
            and int(manifest.get("micro_batch_size", -1)) == engine.train_micro_batch_size_per_gpu())


# What a rank may fail with while reading its part of a checkpoint (agreed on before any collective).
_LOAD_ERRORS = (CheckpointError, OSError, ValueError, KeyError, RuntimeError)


class ModelNames(NamedTuple):
    """The parameter (aliases included) and persistent buffer names of the whole model, over every
    pipeline stage: what a strict load compares the checkpoint's names with."""

    params: frozenset[str]
    buffers: frozenset[str]


def _model_names(engine: CheckpointedEngine, topo: CheckpointTopology) -> ModelNames:
    """This model's names (as checkpoints store them: experts by global index, tied aliases too); with
    pipeline stages or expert parallelism, where ranks hold different layers or experts, their union
    over the job (collective)."""
    stored = [p.name for p in engine.state.checkpoint_params()]
    names = {id(p): n for n, p in engine.module.named_parameters()}
    aliases = [n for n, p in engine.module.named_parameters(remove_duplicate=False) if names[id(p)] != n]
    params = stored + aliases
    buffers = list(_persistent_buffers(engine.module))
    if topo.pipeline_degree == 1 and engine.mesh.dims.ep == 1:
        return ModelNames(frozenset(params), frozenset(buffers))
    held = topo.comm.all_gather_object((params, buffers))
    return ModelNames(frozenset(n for p, _ in held for n in p), frozenset(n for _, b in held for n in b))


def _load_groups(engine: CheckpointedEngine, topo: CheckpointTopology, ckpt: CheckpointSet, model: ModelNames,
                 strict: bool, with_optimizer: bool, allow_unsafe_pickle: bool) -> SmallState:
    """Check everything first, then load one group of units at a time as the state's
    ``checkpoint_groups()`` says (one group when it is all in memory), each resident while it is
    loaded, refreshed and written back. Each rank reads different ranges, so the ranks agree on the
    outcome before every collective refresh."""
    comm, state = topo.comm, engine.state  # every rank: a refusal on one tensor-parallel rank stops all
    error: BaseException | None = None
    small = SmallState({}, None)
    try:
        names = [p.name for p in state.checkpoint_params()]  # the slots' names need their units resident
        small = _load_common(engine, topo, ckpt, model, names, strict, with_optimizer, allow_unsafe_pickle)
    except _LOAD_ERRORS as exc:
        error = exc
    comm.fail_together(error, "load_checkpoint", error_type=CheckpointError)
    optional, optimizer = _optional(engine, ckpt), _loads_optimizer(engine, ckpt, with_optimizer)
    keys: list[torch.Tensor] = []
    for group in state.checkpoint_groups().groups:
        with state.resident_state(group, write_back=True):
            try:
                slots = state.checkpoint_slots(for_save=False, units=group)
                load_masters(slots, ckpt, strict=False, optional=optional)  # strict: checked above
                if optimizer is not None:
                    restore_optimizer_states(slots, optimizer, ckpt, replace=False)
                    keys += [slot.opt_key for slot in slots if slot.opt_key is not None]
            except _LOAD_ERRORS as exc:
                error = exc
            comm.fail_together(error, "load_checkpoint", error_type=CheckpointError)
            state.after_checkpoint_load(units=group)  # while the group's masters are resident
    if optimizer is not None:
        keep_states_of(optimizer, keys)  # what no group holds any more (e.g. another stage's layout)
    return small


def _load_common(engine: CheckpointedEngine, topo: CheckpointTopology, ckpt: CheckpointSet, model: ModelNames,
                 names: list[str], strict: bool, with_optimizer: bool, allow_unsafe_pickle: bool) -> SmallState:
    """Check everything first (names, shapes, ``names``' values present, the optimizer's class, the
    pickled files), then read all but masters and optimizer states: buffers, param groups."""
    manifest = ckpt.manifest
    ckpt.check_layout()
    _check_names(engine, ckpt, model, strict=strict)
    missing_params(names, ckpt, strict=strict)
    optimizer = _loads_optimizer(engine, ckpt, with_optimizer)
    saved_class: str = manifest["optimizer"]["class"] if optimizer is not None else ""
    if optimizer is not None and _state_family(saved_class) != _state_family(type(optimizer).__name__):
        raise CheckpointError(f"{ckpt.path} holds {saved_class} states but this engine's optimizer is "
                              f"{type(optimizer).__name__}; load with load_optimizer_states=False")
    # before anything changes: a refused file leaves the engine as it was
    rank_path = os.path.join(ckpt.path, layout.rank_state(topo.comm.rank))
    small = SmallState(
        load_small_state(ckpt.checked_file(layout.ENGINE_STATE), allow_unsafe_pickle=allow_unsafe_pickle) or {},
        load_small_state(ckpt.checked_file(os.path.basename(rank_path)), allow_unsafe_pickle=allow_unsafe_pickle)
        if _same_data_layout(engine, topo, manifest) else None)
    saved_buffers = {b["name"] for b in manifest.get("buffers", [])}
    with torch.no_grad():
        for name, buf in _persistent_buffers(engine.module).items():
            if name in saved_buffers:
                ckpt.read_range(BUFFER, name, 0, buf.numel(), buf)
    if optimizer is not None:
        load_param_groups(optimizer, ckpt)
    return small


def _loads_optimizer(engine: CheckpointedEngine, ckpt: CheckpointSet,
                     with_optimizer: bool) -> torch.optim.Optimizer | None:
    """The optimizer to restore states into, or None when they are not loaded."""
    if with_optimizer and ckpt.manifest.get("optimizer") is not None:
        return engine.optimizer
    return None


def _optional(engine: CheckpointedEngine, ckpt: CheckpointSet) -> set[str]:
    """Frozen parameters a save excluded: they keep their current values."""
    if not ckpt.manifest.get("excluded_frozen_parameters"):
        return set()
    return {p.name for p in engine.state.checkpoint_params() if not p.trainable}


# Optimizers whose per-parameter state has the same keys and meaning (a run that turns CPU offload on
# or off between save and load switches between torch's class and zerospeed's CPU one).
_STATE_FAMILIES = {"Adam": "adam", "AdamW": "adam", "CPUAdam": "adam", "Adagrad": "adagrad", "CPUAdagrad": "adagrad"}


def _state_family(name: str) -> str:
    return _STATE_FAMILIES.get(name, name)


def _check_names(engine: CheckpointedEngine, ckpt: CheckpointSet, model: ModelNames, *, strict: bool) -> None:
    """Shapes must agree; under ``strict`` the names must too (tied aliases count, either way round):
    every name the checkpoint holds must be somewhere in the model (``model``: on any stage), and each
    of this rank's parameters in the checkpoint (checked by the caller)."""
    wrong = []
    for p in engine.state.checkpoint_params():
        stored = ckpt.canonical(p.name)
        if stored is not None and tuple(ckpt.params[stored]["shape"]) != p.shape:
            wrong.append(f"{p.name}: checkpoint {tuple(ckpt.params[stored]['shape'])}, model {p.shape}")
    if wrong:
        raise CheckpointError(f"{ckpt.path}: parameter shapes differ from this model's: {'; '.join(wrong[:8])}")
    if not strict:
        return
    saved_names = set(ckpt.params) | set(ckpt.manifest.get("aliases", {}))
    unexpected = sorted(saved_names - model.params)
    if unexpected:
        raise CheckpointError(f"{ckpt.path} holds {len(unexpected)} parameter(s) this model does not have: "
                              f"{', '.join(unexpected[:8])}; load with load_module_strict=False to ignore them")
    model_buffers = set(model.buffers)
    saved_buffers = {b["name"] for b in ckpt.manifest.get("buffers", [])}
    if model_buffers != saved_buffers:
        raise CheckpointError(f"{ckpt.path}: buffers differ from this model's (missing from the checkpoint: "
                              f"{sorted(model_buffers - saved_buffers)[:8] or 'none'}; not in the model: "
                              f"{sorted(saved_buffers - model_buffers)[:8] or 'none'}); load with "
                              f"load_module_strict=False to load what matches")


def _persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``state_dict`` would hold (non-persistent ones excluded), by name."""
    keys = set(module.state_dict(keep_vars=True))
    return {name: buf for name, buf in module.named_buffers() if name in keys}


def _loader_state(engine: CheckpointedEngine) -> dict[str, int] | None:
    loader = engine.training_dataloader
    return loader.state_dict() if loader is not None else None


def _restore_loader(engine: CheckpointedEngine, manifest: dict[str, Any], rank_state: dict[str, Any] | None) -> None:
    """Continue the data where the saved run was; across a world-size change, at the next sample of
    the saved epoch's order, resharded over this run's ranks (checkpoints from before the manifest held
    the position: at the same number of samples consumed, rounded down to whole micro-batches)."""
    loader = engine.training_dataloader
    if loader is None:
        return
    if rank_state is not None and rank_state.get("loader") is not None:
        loader.load_state_dict(rank_state["loader"])
        return
    position = manifest.get("data")
    if position is not None:
        size = len(loader.sampler.dataset)  # type: ignore[arg-type]  # a map-style (Sized) dataset
        if int(position.get("dataset_size", size)) != size and engine.comm.rank == 0:
            log.warning("load_checkpoint: the checkpoint's data position is sample %s of epoch %s of a data set of %s "
                        "samples, but this run's has %d; it continues at that sample of this data set's order",
                        position["samples"], position["epoch"], position.get("dataset_size"), size)
        loader.resume_at(int(position["epoch"]), int(position["samples"]))
        return
    samples = int(manifest["counters"]["global_samples"])
    per_step = engine.train_micro_batch_size_per_gpu() * engine.comm.world_size
    epoch_batches = max(len(loader), 1)
    batches = samples // per_step
    loader.load_state_dict({"epoch": batches // epoch_batches, "batches_in_epoch": batches % epoch_batches})


def _optimizer_rank_state(engine: CheckpointedEngine) -> dict[str, Any] | None:
    """State of the optimizer that differs from rank to rank (1-bit compression errors)."""
    optimizer = engine.optimizer
    return optimizer.rank_state() if isinstance(optimizer, RankLocalState) else None


def _restore_rank_local(optimizer: RankLocalState, topo: CheckpointTopology, ckpt: CheckpointSet,
                        allow_unsafe_pickle: bool) -> None:
    """Hand the optimizer the saved ranks' own states: it reads only this rank's at the same world size
    and every saved rank's (to reshape them) at another."""
    def read(rank: int) -> dict[str, Any]:
        state = load_small_state(ckpt.checked_file(layout.rank_state(rank)),
                                 allow_unsafe_pickle=allow_unsafe_pickle) or {}
        return state.get("optimizer") or {}

    optimizer.load_rank_states(read, int(ckpt.manifest["world_size"]), topo.comm.rank, topo.comm.world_size)


def _refresh_after_rank_local(engine: CheckpointedEngine) -> None:
    """A rank-local restore may have given this rank its own masters (0/1 Adam's local steps leave
    each rank's parameters its own): copy them into the model again."""
    state = engine.state
    for group in state.checkpoint_groups().groups:
        with state.resident_state(group, write_back=True):
            state.after_checkpoint_load(units=group)


def _load_scaler(engine: CheckpointedEngine, saved: dict[str, Any]) -> None:
    saved = dict(saved)
    kind = saved.pop("class", None)
    if kind is not None and kind != type(engine.scaler).__name__:
        log.warning("load_checkpoint: the checkpoint's loss scaler is %s, this run's %s (precision changed); "
                    "keeping this run's scale", kind, type(engine.scaler).__name__)
        return
    engine.load_scaler_state(saved)

