"""The communication logger (issue 22, part 3): DeepSpeed's ``comms_logger`` section and ``log_summary``.

Formulas and the table are checked on fixed numbers in this process; one spawn of 2 gloo ranks then checks
what real collectives record: the collectives of a known ZeRO stage-2 and stage-0 step (counts and message
sizes derived from the model's unit sizes, bytes against ``Comm.stats.sent``), the async timing rule, the
straggler view (one rank late by a sleep) and that a disabled logger records nothing and adds no collective.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import zerospeed
import zerospeed.comm as zcomm
from zerospeed.distributed import Comm
from zerospeed.distributed.comms_logger import CommsLogger, calc_bw_log, convert_size, format_table, trim_mean
from zerospeed.testing import run_distributed
from zerospeed.zero.grads import plan_buckets
from zerospeed.zero.layout import build_units

pytestmark = pytest.mark.spawns

WORLD, MICRO, ACCUM = 2, 3, 2
F32, F64 = 4, 8
ALIGN = 8  # elements: every rank's shard of a unit is rounded up to this (zerospeed.sharding.plan)
LATE_S = 0.3  # how long rank 1 sleeps before the straggler collective


class Tower(nn.Module):
    """An input layer, eight small blocks, an output layer: 753 parameters in 26 tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.Tanh()) for _ in range(8))
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h).squeeze(-1)


# -- formulas, on fixed numbers ------------------------------------------------------------------
def test_bandwidth_formulas_are_deepspeeds() -> None:
    # calc_bw_log: bytes per ms * 8 / 1e6 = Gbps; n = 4 ranks, 1 MB in 2 ms
    size, ms, n = 1_000_000, 2.0, 4
    assert calc_bw_log("all_reduce", size, ms, n) == pytest.approx((2 * size / ms * 8 / 1e6, size / ms * 1.5 * 8 / 1e6))
    assert calc_bw_log("all_reduce", size, ms, n) == pytest.approx((8.0, 6.0))
    # gather-like: the recorded part times n, then busbw (n-1)/n of it
    for kind in ("all_gather", "reduce_scatter", "all_gather_into_tensor", "reduce_scatter_tensor"):
        assert calc_bw_log(kind, size, ms, n) == pytest.approx((16.0, 12.0))
    for kind in ("all_to_all", "all_to_all_single"):
        assert calc_bw_log(kind, size, ms, n) == pytest.approx((4.0, 3.0))
    for kind in ("broadcast", "send", "recv", "barrier"):
        assert calc_bw_log(kind, size, ms, n) == pytest.approx((4.0, 4.0))
    assert calc_bw_log("all_reduce", size, 0.0, n) == (0.0, 0.0)
    with pytest.raises(ValueError, match="unknown collective kind 'gossip'"):
        calc_bw_log("gossip", size, ms, n)


def test_sizes_and_trimmed_means_are_deepspeeds() -> None:
    assert [convert_size(s) for s in (0, 8, 1023, 1024, 1536, 3 * 1024 ** 2, 5 * 1024 ** 3)] == \
        ["0B", "8.0 B", "1023.0 B", "1.0 KB", "1.5 KB", "3.0 MB", "5.0 GB"]
    assert trim_mean([]) == 0.0
    assert trim_mean([5.0]) == 5.0
    assert trim_mean([100.0] + [1.0] * 8 + [-50.0]) == 1.0  # ten values: one cut at each end
    assert trim_mean([1.0, 2.0, 3.0, 4.0, 100.0]) == 22.0  # round(0.5) = 0: nothing cut


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _timed(logger: CommsLogger, clock: _Clock, kind: str, size: int, seconds: float, name: str | None = None) -> None:
    probe = logger.begin(kind, name or kind, size, 2)
    clock.now += seconds
    if probe is not None:
        probe.stop()


def test_records_group_by_op_then_size_with_the_table_and_dict_of_deepspeed(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock()
    logger = CommsLogger(enabled=True, clock=clock)
    for seconds in (0.001, 0.003):
        _timed(logger, clock, "all_reduce", 4096, seconds)
    _timed(logger, clock, "all_reduce", 8, 0.0005)
    _timed(logger, clock, "all_gather", 1024, 0.002)
    summary = logger.summary()
    assert list(summary) == ["all_reduce", "all_gather"] and list(summary["all_reduce"]) == [8, 4096]
    big = summary["all_reduce"][4096]
    assert big["count"] == 2 and big["total_latency_ms"] == pytest.approx(4.0) and big["avg_latency_ms"] == pytest.approx(2.0)
    # all_reduce algbw 2S/t: 8192 B / 1 ms and / 3 ms, averaged
    assert big["tput_avg_gbps"] == pytest.approx((8192 / 1 + 8192 / 3) / 2 * 8 / 1e6)
    assert big["busbw_avg_gbps"] == pytest.approx((4096 / 1 + 4096 / 3) / 2 * 8 / 1e6)
    assert big["msg_size_str"] == "4.0 KB" and big["msg_size_bytes"] == 4096
    assert logger.get_total_operations() == 4 and logger.get_operation_names() == ["all_reduce", "all_gather"]
    assert logger.get_raw_data()["all_gather"][1024][0] == 1
    table = format_table(summary, None).splitlines()
    assert table[0] == ("Comm. Op            Message Size        Count               Total Latency(ms)   "
                        "Avg Latency(ms)     tput_avg (Gbps)     busbw_avg (Gbps)")
    assert table[1:4] == ["all_reduce",
                          f"{'':20}{'8.0 B':20}{'1':20}{'0.50':20}{'0.50':20}{'0.00':20}{'0.00'}",
                          f"{'':20}{'4.0 KB':20}{'2':20}{'4.00':20}{'2.00':20}{'0.04':20}{'0.02'}"]
    assert table[4] == "all_gather"
    # verbose: one log line per call, DeepSpeed's wording
    logger.configure(verbose=True)
    with caplog.at_level(logging.INFO, logger="zerospeed"):
        _timed(logger, clock, "broadcast", 2048, 0.004)
    assert "comm op: broadcast | time (ms): 4.00 | msg size: 2.0 KB | algbw (Gbps): 0.00 | busbw (Gbps): 0.00" \
        in caplog.text
    logger.reset_data()
    assert not logger.has_data()


def test_filters_select_ops_by_comm_or_deepspeed_name() -> None:
    clock = _Clock()
    logger = CommsLogger(enabled=True, prof_all=False, prof_ops=["all_gather_into_tensor", "barrier"], clock=clock)
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "barrier"):
        _timed(logger, clock, kind, 16, 0.001)
    assert logger.get_operation_names() == ["all_gather", "barrier"]
    logger.start_profiling_op(["reduce_scatter_tensor"])
    logger.stop_profiling_op(["barrier"])
    assert logger.profiles("reduce_scatter") and not logger.profiles("barrier") and not logger.profiles("all_reduce")
    logger.start_profiling_comms()
    assert logger.profiles("all_reduce")
    logger.configure(enabled=False)
    assert logger.begin("all_reduce", "all_reduce", 16, 2) is None
    with pytest.raises(TypeError, match=r"prof_ops='all_reduce' must be a list of op names"):
        logger.configure(prof_ops="all_reduce")
    with pytest.raises(TypeError, match="verbose=1 must be True or False"):
        logger.configure(verbose=1)  # type: ignore[arg-type]


def test_debug_names_the_calling_function() -> None:
    logger = CommsLogger(enabled=True, debug=True)
    probe = logger.begin("all_reduce", "all_reduce", 4, 2)
    assert probe is not None
    probe.stop()
    assert logger.get_operation_names() == ["all_reduce | [Caller Func: test_debug_names_the_calling_function]"]


def test_configure_takes_a_config_a_dict_or_a_path(tmp_path: Path) -> None:
    logger = zcomm.summary.process_logger()
    try:
        zcomm.configure({"comms_logger": {"enabled": True, "prof_all": False, "prof_ops": ["all_reduce"]}}, verbose=True)
        assert (logger.enabled, logger.prof_all, logger.prof_ops, logger.verbose) == (True, False, ("all_reduce",), True)
        zcomm.configure({"comms_logger": {"enabled": False, "prof_all": True}})  # a disabled section changes nothing
        assert logger.prof_all is False
        with pytest.raises(TypeError, match="deepspeed_config=int: expected a zerospeed Config"):
            zcomm.configure(3)
        path = tmp_path / "ds.json"
        path.write_text(json.dumps({"comms_logger": {"enabled": True, "prof_ops": ["barrier"], "debug": True}}))
        zcomm.configure(str(path))
        assert (logger.prof_ops, logger.debug) == (("barrier",), True)
        from zerospeed.config import load_config

        cfg = load_config({"train_batch_size": 1, "comms_logger": {"enabled": True, "prof_all": True, "prof_ops": []}})
        zcomm.configure(cfg)
        assert (logger.prof_all, logger.prof_ops) == (True, ())
    finally:
        logger.configure(enabled=False, prof_all=True, prof_ops=(), verbose=False, debug=False)


# -- real collectives on 2 gloo ranks ---------------------------------------------------------------
def _step_records(stage: int, zero: dict, logged: bool) -> dict:
    """Initialize an engine and train two optimizer steps; what the second issued (the first also agrees on
    the order units complete in), as the logger's summary and as the Comm's counters."""
    torch.manual_seed(0)
    config: dict = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM,
                    "optimizer": {"type": "AdamW", "params": {"lr": 0.05}}, "zero_optimization": {"stage": stage, **zero}}
    if logged:
        config["comms_logger"] = {"enabled": True}
    engine, *_ = zerospeed.initialize(model=Tower(), config=config)
    x = torch.randn(MICRO * ACCUM, 4)
    for step in range(2):
        zcomm.reset_log()
        before = engine.comm.stats.snapshot()
        for m in range(ACCUM):
            rows = x[m * MICRO: (m + 1) * MICRO]
            engine.backward(engine(rows).pow(2).mean())
            engine.step()
        delta = engine.comm.stats.since(before)
    sizes = {name: {size: e["count"] for size, e in per_size.items()}
             for name, per_size in zcomm.log_summary(return_dict=True)["summary"].items()}
    return {"sizes": sizes, "calls": dict(delta.calls), "sent": dict(delta.sent), "has_data": zcomm.has_comm_data(),
            "comm_calls": engine.comm.calls}


def _async_rule() -> dict:
    """An async handle is timed until its wait; a sync call around the call; filters apply to real Comms."""
    logger = CommsLogger(enabled=True, prof_all=False, prof_ops=["all_reduce", "all_gather_into_tensor"])
    comm = Comm(comms_logger=logger)
    handle = comm.all_reduce(torch.ones(5), async_op=True)
    time.sleep(0.2)
    recorded_before_wait = logger.has_data()
    assert handle is not None
    handle.wait()
    handle.wait()  # a second wait records nothing more
    comm.all_gather(torch.empty(2 * 3), torch.ones(3))
    comm.reduce_scatter(torch.empty(3), torch.ones(6))  # not in prof_ops
    comm.all_reduce(torch.ones(2, dtype=torch.float64))
    raw = logger.get_raw_data()
    # uneven parts: every rank records the widest part (what each puts in the padded collective)
    uneven = CommsLogger(enabled=True, debug=True)
    sizes = [3, 1]
    Comm(comms_logger=uneven).all_gather([torch.empty(n) for n in sizes], torch.ones(sizes[comm.rank]))
    return {"before_wait": recorded_before_wait, "names": sorted(raw),
            "all_reduce": {size: entry[1] for size, entry in raw["all_reduce"].items()},
            "all_gather": {size: entry[0] for size, entry in raw["all_gather"].items()},
            "uneven": {name: sorted(per_size) for name, per_size in uneven.get_raw_data().items()}}


def _straggler() -> dict:
    zcomm.configure(enabled=True, prof_all=True)
    zcomm.barrier()
    zcomm.reset_log()
    if torch.distributed.get_rank() == 1:
        time.sleep(LATE_S)
    zcomm.all_reduce(torch.ones(16))
    extra_before = zcomm.get_comm_operation_count()
    out = zcomm.log_summary(show_straggler=True, return_dict=True)
    assert out is not None
    return {"summary": out["summary"]["all_reduce"][64], "straggler": out["straggler_analysis"]["all_reduce"][64],
            "metadata": {k: out["metadata"][k] for k in ("world_size", "rank")},
            "own_collectives_recorded": zcomm.get_comm_operation_count() - extra_before}


def _outside_the_mesh() -> dict:
    """A Comm built outside any engine's mesh (as a pipeline tied group, zero.Init or a checkpoint build
    theirs) records into the process logger an engine's config turned on."""
    zcomm.reset_log()
    comm = Comm(torch.distributed.new_group([0, 1]), name="tied[0, 1]")
    comm.all_reduce(torch.ones(7))
    comm.broadcast(torch.ones(3, dtype=torch.float64), src=0)
    summary = zcomm.log_summary(return_dict=True)["summary"]
    return {name: {size: e["count"] for size, e in per_size.items()} for name, per_size in summary.items()}


def _all_cases() -> dict:
    logging.getLogger("zerospeed").addHandler(logging.NullHandler())  # keep the config dump out of the output
    logging.getLogger("zerospeed").setLevel(logging.WARNING)
    # disabled first: the process logger stays on once an engine's config turned it on (as in DeepSpeed)
    out = {"s2 off": _step_records(2, {"reduce_bucket_size": 300}, logged=False)}
    out["s2"] = _step_records(2, {"reduce_bucket_size": 300}, logged=True)
    out["s0"] = _step_records(0, {}, logged=True)
    out["s0 buckets"] = _step_records(0, {"reduce_bucket_size": 300}, logged=True)
    out["outside"] = _outside_the_mesh()
    out["async"] = _async_rule()
    out["straggler"] = _straggler()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_all_cases, WORLD, timeout=240.0)


def _shard_bytes(numel: int) -> int:
    """One rank's part of a unit of ``numel`` fp32 elements: split over the ranks, rounded up to ALIGN."""
    return math.ceil(math.ceil(numel / WORLD) / ALIGN) * ALIGN * F32


def test_stage2_summary_counts_each_units_reduce_scatter_and_all_gather(ranks: list[dict]) -> None:
    # one unit per block, then neighbours coalesced while they fit in a bucket of 300 elements
    units: list[int] = []
    for unit in build_units(Tower(), bucket_elems=300):
        if units and units[-1] + unit.numel <= 300:
            units[-1] += unit.numel
        else:
            units.append(unit.numel)
    assert units == [216, 264, 273]  # [inp, blocks 0-1], [blocks 2-4], [blocks 5-7, out]
    parts = [_shard_bytes(n) for n in units]
    assert parts == [448, 544, 576]
    expected = {
        "reduce_scatter": {size: ACCUM for size in parts},  # stage 2 reduces each unit every micro-batch
        "all_gather": {size: 1 for size in parts},  # the updated shards, once per optimizer step
        "all_reduce": {F64: 1},  # the squared gradient norm, one float64
    }
    for rank, got in enumerate(ranks):
        assert got["s2"]["sizes"] == expected, f"rank {rank}"
        assert got["s2"]["calls"] == {op: sum(sizes.values()) for op, sizes in expected.items()}
        # bytes on the wire follow from the recorded parts: (W-1) parts each for reduce_scatter and all_gather,
        # 2(W-1)/W of the tensor for all_reduce
        for op in ("reduce_scatter", "all_gather"):
            assert got["s2"]["sent"][op] == sum(n * size * (WORLD - 1) for size, n in expected[op].items())
        assert got["s2"]["sent"]["all_reduce"] == 2 * (WORLD - 1) * F64 // WORLD


def test_stage0_summary_counts_one_all_reduce_per_bucket(ranks: list[dict]) -> None:
    numels = [p.numel() for p in Tower().parameters()]
    assert sum(numels) == 753
    for rank, got in enumerate(ranks):
        assert got["s0"]["sizes"] == {"all_reduce": {753 * F32: 1}}, f"rank {rank}"  # one bucket holds all
        assert got["s0"]["sent"] == {"all_reduce": 2 * (WORLD - 1) * 753 * F32 // WORLD}
        # buckets of 300 elements, laid out in the order gradients arrive: the parameters reversed
        buckets = [sum(numels[::-1][i] for i in bucket) * F32 for bucket in plan_buckets(numels[::-1], 300)]
        counts: dict[int, int] = {}
        for size in buckets:
            counts[size] = counts.get(size, 0) + 1
        assert got["s0 buckets"]["sizes"] == {"all_reduce": counts}, f"rank {rank}: planned {buckets}"
        assert got["s0 buckets"]["calls"] == {"all_reduce": len(buckets)}


def test_disabled_logger_records_nothing_and_adds_no_collective(ranks: list[dict]) -> None:
    for got in ranks:
        assert got["s2 off"]["has_data"] is False and got["s2 off"]["sizes"] == {}
        assert got["s2 off"]["calls"] == got["s2"]["calls"] and got["s2 off"]["sent"] == got["s2"]["sent"]
        assert got["s2 off"]["comm_calls"] == got["s2"]["comm_calls"]  # initialize and both steps, every call


def test_comms_outside_the_engines_mesh_are_logged(ranks: list[dict]) -> None:
    for got in ranks:
        assert got["outside"] == {"all_reduce": {28: 1}, "broadcast": {24: 1}}


def test_async_latency_runs_until_the_wait(ranks: list[dict]) -> None:
    for got in ranks:
        case = got["async"]
        assert case["before_wait"] is False
        assert case["names"] == ["all_gather", "all_reduce"]  # reduce_scatter filtered out
        assert len(case["all_reduce"][5 * F32]) == 1 and case["all_reduce"][5 * F32][0] >= 200.0
        assert case["all_reduce"][2 * F64][0] < 200.0
        assert case["all_gather"] == {3 * F32: 1}
        # debug names the function that called Comm, past the communication layer's own frames
        assert case["uneven"] == {"all_gather | [Caller Func: _async_rule]": [3 * F32]}


def test_straggler_view_shows_the_early_ranks_wait(ranks: list[dict]) -> None:
    early, late = (got["straggler"] for got in ranks)
    mine = [early["summary"]["total_latency_ms"], late["summary"]["total_latency_ms"]]
    assert mine[0] >= 0.8 * LATE_S * 1e3 > mine[1]  # rank 0 waited in the all_reduce for the late rank 1
    for rank, got in enumerate((early, late)):
        s = got["straggler"]
        assert s["count"] == 1 and s["msg_size_bytes"] == 64
        assert s["total_comm_lat_ms"] == pytest.approx(min(mine))  # the min over ranks, the same everywhere
        assert s["total_straggler_ms"] == pytest.approx(mine[rank] - min(mine))
        assert got["metadata"] == {"world_size": WORLD, "rank": rank}
        assert got["own_collectives_recorded"] == 0  # the straggler view's gather and all_reduce are not logged
    assert early["straggler"]["total_straggler_ms"] >= 0.8 * LATE_S * 1e3 - late["summary"]["total_latency_ms"]
    assert late["straggler"]["total_straggler_ms"] == 0.0
