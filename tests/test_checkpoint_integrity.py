"""Checkpoint integrity (issue 32, item 1): every stored tensor, header and file carries a CRC-32 in the
manifest, checked on load and on convert; a mismatch names the file, the tensor and the tag and offers
the previous tag. Checkpoints of releases that recorded no checksums still load.

One 1-rank job saves three steps and does the engine loads (a flipped bit in an Adam moment, in the
RNG/data-position file, an untouched copy); the rest reads copies of those checkpoints in this process
(``get_fp32_state_dict``, ``convert_checkpoint``, ``zerospeed convert``, :class:`CheckpointSet`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.checkpoint import convert_checkpoint, get_fp32_state_dict, layout
from zerospeed.checkpoint.consolidate import convert_main
from zerospeed.checkpoint.layout import CheckpointError
from zerospeed.checkpoint.reader import CheckpointSet
from zerospeed.checkpoint.safetensors_io import SafetensorsReader, StreamingWriter
from zerospeed.testing import run_distributed

MOMENT = "optim.exp_avg:0.weight[0:48]"  # Adam's first moment of the first layer's weight
MASTER = "master:2.weight[0:24]"


def _flip_bit(tag_dir: str | Path, tensor: str, element: int = 5, bit: int = 3) -> None:
    """Flip one bit inside ``tensor``'s bytes of rank 0's file (same size: only a checksum can tell)."""
    path = os.path.join(tag_dir, layout.rank_file(0))
    with SafetensorsReader(path) as reader:
        entry = reader.entries[tensor]
        offset = reader._data_start + entry.begin + element * 4 + 1
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def _copy(root: str | Path, dest: Path) -> Path:
    shutil.copytree(root, dest)
    return dest


def _engine() -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    engine, *_ = zerospeed.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "zero_optimization": {"stage": 1}})
    return engine


def _params(engine: Any) -> dict[str, list[float]]:
    return {n: p.detach().reshape(-1).tolist() for n, p in engine.module.named_parameters()}


def _job(root: str) -> dict[str, Any]:
    """Save steps 1-3; load a copy with one flipped bit in an Adam moment of step 3, one with a flipped
    bit in its RNG/data-position file, and the untouched checkpoint."""
    engine = _engine()
    out: dict[str, Any] = {}
    for step in range(3):
        x = torch.randn(2, 6, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        engine.save_checkpoint(os.path.join(root, "good"))
    out["saved"] = _params(engine)
    moment = _copy(os.path.join(root, "good"), Path(root, "moment"))
    _flip_bit(moment / "global_step3", MOMENT)
    state = _copy(os.path.join(root, "good"), Path(root, "state"))
    with open(state / "global_step3" / layout.rank_state(0), "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0x10
        f.seek(0)
        f.write(data)
    fresh = _engine()
    for name in ("state", "moment"):
        before = _params(fresh)
        try:
            fresh.load_checkpoint(os.path.join(root, name))
            out[name] = "loaded"
        except CheckpointError as exc:
            out[name] = str(exc)
        out[f"unchanged_by_{name}"] = _params(fresh) == before
    path, _ = fresh.load_checkpoint(os.path.join(root, "good"))
    out["good"] = {"path": path, "steps": fresh.global_steps, "params": _params(fresh)}
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("integrity")
    return root, run_distributed(_job, 1, str(root), timeout=120)[0]


def _assert_names_everything(message: str, root: Path, tensor: str | None) -> None:
    path = root / "global_step3" / layout.rank_file(0)
    assert message.startswith("checkpoint 'global_step3' is damaged: "), message
    if tensor is not None:
        assert f"tensor {tensor!r} in {path} does not match its checksum" in message, message
    assert "tag='global_step2'" in message, message  # the previous tag
    assert f"Tags in {root}: global_step1, global_step2" in message, message


def test_a_flipped_bit_in_an_adam_moment_fails_the_load_naming_file_tensor_and_tag(
        saved: tuple[Path, dict[str, Any]]) -> None:
    root, out = saved
    _assert_names_everything(out["moment"], root / "moment", MOMENT)
    assert re.search(r"crc32 [0-9a-f]{8} recorded at save, crc32 [0-9a-f]{8} read", out["moment"]), out["moment"]


def test_a_flipped_bit_in_a_pickled_file_fails_before_anything_changes(saved: tuple[Path, dict[str, Any]]) -> None:
    root, out = saved
    assert out["state"].startswith("checkpoint 'global_step3' is damaged: "
                                   f"{root / 'state' / 'global_step3' / layout.rank_state(0)} does not match "
                                   "its checksum"), out["state"]
    assert "tag='global_step2'" in out["state"]
    assert out["unchanged_by_state"]  # the pickled files are checked before anything is loaded


def test_an_intact_checkpoint_loads_exactly(saved: tuple[Path, dict[str, Any]]) -> None:
    root, out = saved
    assert out["good"]["path"] == str(root / "good" / "global_step3")
    assert out["good"]["steps"] == 3 and out["good"]["params"] == out["saved"]
    state = get_fp32_state_dict(str(root / "good"))
    assert {k: v.reshape(-1).tolist() for k, v in state.items()} == out["saved"]


def test_convert_refuses_a_flipped_bit_with_the_same_message(saved: tuple[Path, dict[str, Any]], tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    root, _ = saved
    bad = _copy(root / "good", tmp_path / "bad")
    _flip_bit(bad / "global_step3", MASTER, element=7, bit=30 % 8)
    with pytest.raises(CheckpointError) as raised:
        convert_checkpoint(str(bad), str(tmp_path / "out"))
    _assert_names_everything(str(raised.value), bad, MASTER)
    assert not (tmp_path / "out" / "model.safetensors").exists()
    assert not [n for n in os.listdir(tmp_path / "out") if n.endswith(".partial")]
    assert convert_main([str(bad), str(tmp_path / "out2")]) == 2
    assert capsys.readouterr().err.strip() == f"zerospeed convert: error: {raised.value}"
    with pytest.raises(CheckpointError, match="tensor 'master:2.weight"):
        get_fp32_state_dict(str(bad))
    # the previous tag, as the message says, converts
    assert convert_checkpoint(str(bad), str(tmp_path / "prev"), tag="global_step2")


def test_a_damaged_header_or_manifest_is_named(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    root, _ = saved
    header = _copy(root / "good", tmp_path / "header")
    path = header / "global_step3" / layout.rank_file(0)
    data = path.read_bytes()
    at = data.index(b'"rank":"0"') + len(b'"rank":"')
    path.write_bytes(data[:at] + b"1" + data[at + 1:])  # still valid JSON, same size
    with pytest.raises(CheckpointError) as raised:
        get_fp32_state_dict(str(header))
    _assert_names_everything(str(raised.value), header, None)
    assert f"the header of {path} does not match its checksum" in str(raised.value)

    manifest = _copy(root / "good", tmp_path / "manifest")
    file = manifest / "global_step3" / layout.MANIFEST
    text = file.read_text()
    assert text.count('"global_steps": 3,') == 1
    file.write_text(text.replace('"global_steps": 3,', '"global_steps": 4,'))  # valid JSON, one digit
    with pytest.raises(CheckpointError) as raised:
        get_fp32_state_dict(str(manifest))
    _assert_names_everything(str(raised.value), manifest, None)
    assert "manifest.json does not match its checksum" in str(raised.value)

    stripped = _copy(root / "good", tmp_path / "stripped")  # checksums named, one of them missing
    file = stripped / "global_step3" / layout.MANIFEST
    content = json.loads(file.read_text())
    del next(f for f in content["fragments"] if f["key"] == MASTER)["crc32"]
    file.write_bytes(layout.encode_manifest(content))
    with pytest.raises(CheckpointError, match=re.escape(f"tensor {MASTER!r} in ") + ".* has no checksum in"):
        get_fp32_state_dict(str(stripped))


def test_a_part_of_a_tensor_is_checked_whole_before_it_is_used(saved: tuple[Path, dict[str, Any]],
                                                               tmp_path: Path) -> None:
    """A load at another topology reads parts of stored tensors: the flipped bit lies outside the part
    read, and the read still refuses."""
    root, _ = saved
    bad = _copy(root / "good", tmp_path / "bad")
    _flip_bit(bad / "global_step3", MOMENT, element=40)
    with CheckpointSet(str(bad / "global_step3")) as ckpt:
        out = torch.empty(8)
        with pytest.raises(CheckpointError, match=re.escape(f"tensor {MOMENT!r}")):
            ckpt.read_range("optim.exp_avg", "0.weight", 0, 8, out)
    with CheckpointSet(str(root / "good" / "global_step3")) as ckpt:
        whole = ckpt.read_param("optim.exp_avg", "0.weight").reshape(-1)
        ckpt.read_range("optim.exp_avg", "0.weight", 8, 16, out)  # checked once, then read in parts
        assert torch.equal(out, whole[8:16])


def test_checkpoints_without_checksums_still_load(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """A manifest as releases before checksums wrote it (no ``checksum``, no CRCs) reads as before:
    unchecked, so even a flipped bit goes through."""
    root, out = saved
    old = _copy(root / "good", tmp_path / "old")
    file = old / "global_step3" / layout.MANIFEST
    manifest = json.loads(file.read_text())
    for key in ("checksum", layout.MANIFEST_CRC):
        manifest.pop(key)
    manifest["files"] = {name: {"bytes": info["bytes"]} for name, info in manifest["files"].items()}
    for frag in manifest["fragments"]:
        frag.pop("crc32")
    file.write_text(json.dumps(manifest, indent=1))
    state = get_fp32_state_dict(str(old))
    assert {k: v.reshape(-1).tolist() for k, v in state.items()} == out["saved"]
    _flip_bit(old / "global_step3", MASTER)
    assert get_fp32_state_dict(str(old))["2.weight"].reshape(-1).tolist() != out["saved"]["2.weight"]


def test_the_previous_tag_is_the_newest_before_it_in_numeric_order(tmp_path: Path) -> None:
    for tag in ("global_step9", "global_step10", "global_step11", "best"):
        (tmp_path / tag).mkdir()
        (tmp_path / tag / layout.MANIFEST).write_text("{}")
    message = str(layout.damaged(str(tmp_path / "global_step11"), "x"))
    assert "tag='global_step10'" in message and "Tags in" in message and "global_step9" in message
    message = str(layout.damaged(str(tmp_path / "best"), "x"))  # nothing sorts before it
    assert "no earlier tag is there; load another one with tag=..." in message


def test_the_writer_records_the_crc32_of_the_bytes_on_disk(tmp_path: Path) -> None:
    tensors = {"a": torch.arange(10, dtype=torch.float32), "empty": torch.zeros(0), "b": torch.ones(3, dtype=torch.int64)}
    path = tmp_path / "x.safetensors"
    with StreamingWriter(path, [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()], checksums=True) as writer:
        writer.write(tensors["a"][:4])
        writer.write(tensors["a"][4:])
        writer.write(tensors["b"])
    sums = writer.checksums
    with SafetensorsReader(path) as reader:
        assert sums.header == reader.header_crc32
        for name, tensor in tensors.items():
            assert sums.tensors[name] == zlib.crc32(tensor.numpy().tobytes()) == reader.checksum(name)


@pytest.mark.parametrize("threaded", [False, True])
def test_checksums_of_pieces_on_the_helper_thread_are_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               threaded: bool) -> None:
    """Many pieces per tensor, each CRC on the helper thread while the next is written or read (or inline,
    on a machine without a core to spare): the same CRC-32 as over the whole bytes, both ways."""
    from zerospeed.checkpoint import safetensors_io

    monkeypatch.setattr(safetensors_io, "WRITE_PIECE", 4096)
    monkeypatch.setattr(safetensors_io, "OVERLAP_BYTES", 1024)
    monkeypatch.setattr(safetensors_io, "CHUNK_BYTES", 8192)
    monkeypatch.setattr(safetensors_io, "CRC_THREAD", threaded)
    values = torch.randn(50_000, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "pieces.safetensors"
    with StreamingWriter(path, [("v", torch.float32, (50_000,)), ("h", torch.float16, (9_000,))],
                         checksums=True) as writer:
        writer.write(values[:30_000])
        writer.write(values[30_000:])
        writer.write(values[:9_000].half())
    sums = writer.checksums.tensors
    assert sums == {"v": zlib.crc32(values.numpy().tobytes()), "h": zlib.crc32(values[:9_000].half().numpy().tobytes())}
    with SafetensorsReader(path) as reader:
        out = torch.empty(50_000)
        assert reader.read_into("v", out, crc=0) == sums["v"] and torch.equal(out, values)
        cast = torch.empty(9_000)  # read through the cast buffer, piece by piece
        assert reader.read_into("h", cast, crc=0) == sums["h"] and torch.equal(cast, values[:9_000].half().float())


# -- each byte read once (convert reads chunk by chunk; a load at the same topology reads whole tensors) ----------
def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Record every ``(file, offset, bytes)`` a :class:`SafetensorsReader` reads from here on (tensor data and
    checksums; the header is read when the file is opened)."""
    reads: list[tuple[str, int, int]] = []
    original = SafetensorsReader._pread_into

    def counting(self: SafetensorsReader, buffer: Any, offset: int) -> None:
        reads.append((self.path, offset, memoryview(buffer).nbytes))
        original(self, buffer, offset)

    monkeypatch.setattr(SafetensorsReader, "_pread_into", counting)
    return reads


def _read_once(reads: list[tuple[str, int, int]]) -> bool:
    """Whether no byte of any file was read twice."""
    by_file: dict[str, list[tuple[int, int]]] = {}
    for path, offset, nbytes in reads:
        by_file.setdefault(path, []).append((offset, offset + nbytes))
    return all(a[1] <= b[0] for ranges in by_file.values() for a, b in zip(sorted(ranges), sorted(ranges)[1:]))


def _stored_bytes(tag_dir: Path, kinds: tuple[str, ...] | None = None) -> int:
    """The bytes of the stored tensors of ``kinds`` (all: None) in rank 0's file."""
    with SafetensorsReader(tag_dir / layout.rank_file(0)) as reader:
        return sum(e.end - e.begin for name, e in reader.entries.items()
                   if kinds is None or name.split(":")[0] in kinds)


def test_convert_in_chunks_reads_each_byte_once(saved: tuple[Path, dict[str, Any]], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """16-element chunks: 0.weight (48 elements) comes in 3 reads, 2.weight (24) in 2; the running CRC-32
    checks them as they go, instead of a whole-tensor check before the first chunk (which read them twice)."""
    root, out = saved
    reads = _count_reads(monkeypatch)
    convert_checkpoint(str(root / "good"), str(tmp_path / "out"), chunk_bytes=64)
    assert sum(n for _, _, n in reads) == _stored_bytes(root / "good" / "global_step3", ("master",))
    assert _read_once(reads)
    with SafetensorsReader(tmp_path / "out" / "model.safetensors") as written:
        assert {k: written.read(k).reshape(-1).tolist() for k in written.entries} == out["saved"]


def test_convert_in_chunks_refuses_a_flipped_bit_in_the_last_chunk(saved: tuple[Path, dict[str, Any]],
                                                                   tmp_path: Path) -> None:
    """The mismatch shows at the last chunk's read, after earlier chunks were written: the same message, and
    the partial output is removed."""
    root, _ = saved
    bad = _copy(root / "good", tmp_path / "bad")
    _flip_bit(bad / "global_step3", MASTER, element=20)  # 2.weight's second chunk holds elements 16-23
    with pytest.raises(CheckpointError) as raised:
        convert_checkpoint(str(bad), str(tmp_path / "out"), chunk_bytes=64)
    _assert_names_everything(str(raised.value), bad, MASTER)
    assert os.listdir(tmp_path / "out") == []


def test_parts_out_of_order_or_left_unfinished_are_still_checked(saved: tuple[Path, dict[str, Any]],
                                                                 tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading in order, a part that does not start where the last read ended checks the whole tensor first,
    and a tensor read only in part is checked (its rest read once) when the block ends; outside that block a
    part read from the first element is checked whole first, as a load at another topology needs."""
    root, _ = saved
    good, bad = root / "good" / "global_step3", _copy(root / "good", tmp_path / "bad") / "global_step3"
    _flip_bit(bad, MOMENT, element=40)
    moment, part = ("optim.exp_avg", "0.weight"), torch.empty(8)
    with CheckpointSet(str(good)) as ckpt:
        whole = ckpt.read_param(*moment).reshape(-1)
    reads = _count_reads(monkeypatch)

    def read(tag_dir: Path, *ranges: tuple[int, int], in_order: bool = True) -> int:
        """Read ``ranges`` of the moment in one CheckpointSet; the bytes that took."""
        reads.clear()
        with CheckpointSet(str(tag_dir)) as ckpt, ckpt.reading_in_order() if in_order else contextlib.nullcontext():
            for start, end in ranges:
                ckpt.read_range(*moment, start, end, part)
                assert torch.equal(part, whole[start:end])
        return sum(n for _, _, n in reads)

    assert read(good, (8, 16)) == 48 * 4 + 8 * 4  # from the middle: the whole tensor first
    assert read(good, (0, 8), (16, 24)) == 48 * 4 + 8 * 4 + 8 * 4  # out of order: the same
    assert read(good, (0, 8), (8, 16)) == 48 * 4 and _read_once(reads)  # in order: the rest at the block's end
    assert read(good, (0, 8), in_order=False) == 48 * 4 + 8 * 4
    message = re.escape(f"tensor {MOMENT!r} in {bad / layout.rank_file(0)} does not match its checksum")
    for ranges, in_order in ([((8, 16),), True], [((0, 8), (16, 24)), True], [((0, 8),), False]):
        with pytest.raises(CheckpointError, match=message):
            read(bad, *ranges, in_order=in_order)
        assert sum(n for _, _, n in reads) == 48 * 4 + (8 * 4 if len(ranges) == 2 else 0)  # nothing after
    reads.clear()
    with CheckpointSet(str(bad)) as ckpt:
        with pytest.raises(CheckpointError, match=message):
            with ckpt.reading_in_order():
                ckpt.read_range(*moment, 0, 8, part)  # the flipped bit is in the rest, read as the block ends
        assert sum(n for _, _, n in reads) == 48 * 4
        with pytest.raises(CheckpointError, match=message):  # not marked checked: refused again
            ckpt.read_range(*moment, 0, 8, part)


def test_a_load_at_the_same_topology_reads_each_byte_once(saved: tuple[Path, dict[str, Any]],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank's slots are its saved fragments: every tensor is read whole, its CRC-32 taken in the same
    pass (no second read for the check)."""
    root, out = saved
    engine = _engine()
    reads = _count_reads(monkeypatch)
    engine.load_checkpoint(str(root / "good"))
    assert _params(engine) == out["saved"]
    assert sum(n for _, _, n in reads) == _stored_bytes(root / "good" / "global_step3") and _read_once(reads)


def test_the_checksum_is_zlibs_crc32_with_or_without_isal() -> None:
    """ISA-L's CRC-32 (when installed) gives zlib's values, so a checkpoint checked by either is the same;
    without isal the standard library's is used."""
    from zerospeed.checkpoint import checksum

    assert checksum.IMPLEMENTATION == "isal"  # a dependency: installed with zerospeed
    data = bytes(range(256)) * 4099
    assert checksum.crc32(data) == zlib.crc32(data)
    assert checksum.crc32(memoryview(data)[7:], 12345) == zlib.crc32(memoryview(data)[7:], 12345)
    script = ("import sys; sys.modules['isal'] = None\n"
              "from zerospeed.checkpoint import checksum\n"
              "print(checksum.IMPLEMENTATION, checksum.crc32(b'zerospeed', 7))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["zlib", str(zlib.crc32(b"zerospeed", 7))]
