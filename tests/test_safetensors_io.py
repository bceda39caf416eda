"""The checkpoint's own safetensors reader and writer against the reference ``safetensors`` library.

Checkpoints and ``zerospeed convert`` write through :class:`StreamingWriter` and read through
:class:`SafetensorsReader`, never through the library, so their files must be plain safetensors
both ways, and damaged files or misuse must fail loudly rather than yield wrong tensors.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from zerospeed.checkpoint import safetensors_io
from zerospeed.checkpoint.safetensors_io import SafetensorsReader, StreamingWriter


def _sample() -> dict[str, torch.Tensor]:
    """One tensor per stored dtype, odd shapes, empties, from a seeded generator."""
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 5, 7, generator=g),
        "bf16": torch.randn(13, 3, generator=g).to(torch.bfloat16),
        "f16": torch.randn(11, generator=g).to(torch.float16),
        "i64": torch.randint(-2**40, 2**40, (4, 9), generator=g),
        "bool": torch.rand(17, generator=g) > 0.5,
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5),
        "f64": torch.randn(3, generator=g, dtype=torch.float64),
        "u8": torch.randint(0, 255, (5,), generator=g, dtype=torch.uint8),
    }


def _write(path, tensors: dict[str, torch.Tensor], chunk: int | None = None, metadata=None) -> StreamingWriter:
    """Write ``tensors`` in order, each in pieces of ``chunk`` elements (whole when None)."""
    with StreamingWriter(path, [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()], metadata) as writer:
        for value in tensors.values():
            flat = value.reshape(-1)
            step = chunk or max(flat.numel(), 1)
            for lo in range(0, flat.numel(), step):
                writer.write(flat[lo: lo + step])
    return writer


@pytest.mark.parametrize("chunk", [None, 1, 4, 7])
def test_writer_output_loads_with_the_safetensors_library(tmp_path, chunk):
    tensors = _sample()
    path = tmp_path / "out.safetensors"
    writer = _write(path, tensors, chunk, metadata={"format": "pt", "note": "x"})
    assert writer.bytes_written == os.path.getsize(path)
    loaded = load_file(str(path))
    assert set(loaded) == set(tensors)
    for name, value in tensors.items():
        assert loaded[name].dtype == value.dtype, name
        assert loaded[name].shape == value.shape, name
        assert torch.equal(loaded[name], value), name
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "note": "x"}
        assert torch.equal(f.get_slice("f32")[1:3], tensors["f32"][1:3])
    with open(path, "rb") as f:  # the data section starts 8-byte aligned, like the reference writer's
        assert (8 + int.from_bytes(f.read(8), "little")) % 8 == 0


def test_writer_accepts_chunks_of_any_shape_and_noncontiguous_views(tmp_path):
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    path = tmp_path / "t.safetensors"
    with StreamingWriter(path, [("t", torch.float32, (6, 4))]) as writer:
        transposed = full.t()  # non-contiguous: must be written in its logical order
        writer.write(transposed[:2])
        writer.write(transposed[2:].reshape(2, 2, 4))
    assert torch.equal(load_file(str(path))["t"], full.t().contiguous())


@pytest.mark.parametrize("with_sync_file_range", [True, False])
def test_write_behind_in_small_pieces(tmp_path, monkeypatch, with_sync_file_range):
    """Pieces smaller than the chunks and than the header, write-back windows in flight, and the
    fallback where the platform has no sync_file_range: the file is the same."""
    monkeypatch.setattr(safetensors_io, "WRITE_PIECE", 24)
    monkeypatch.setattr(safetensors_io, "WRITE_WINDOW", 2)
    if not with_sync_file_range:
        monkeypatch.setattr(safetensors_io, "_sync_file_range", lambda: None)
    tensors = _sample()
    path = tmp_path / "pieces.safetensors"
    writer = _write(path, tensors, chunk=5)
    assert writer.bytes_written == os.path.getsize(path)
    assert bool(writer._in_flight) == with_sync_file_range
    loaded = load_file(str(path))
    for name, value in tensors.items():
        assert torch.equal(loaded[name], value), name


def test_empty_file_and_only_empty_tensors(tmp_path):
    with StreamingWriter(tmp_path / "none.safetensors", []):
        pass
    assert load_file(str(tmp_path / "none.safetensors")) == {}
    with StreamingWriter(tmp_path / "e.safetensors", [("a", torch.float32, (0,)), ("b", torch.int64, (2, 0))]) as w:
        w.write(torch.empty(0))
    loaded = load_file(str(tmp_path / "e.safetensors"))
    assert loaded["a"].shape == (0,) and loaded["b"].shape == (2, 0) and loaded["b"].dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_reader_reads_any_range_of_reference_files(tmp_path, dtype):
    g = torch.Generator().manual_seed(1)
    values = torch.randn(37, 11, generator=g)
    value = (values > 0) if dtype == torch.bool else (values * 1000).to(dtype)
    other = torch.arange(5, dtype=torch.int32)
    path = tmp_path / "ref.safetensors"
    save_file({"other": other, "value": value, "empty": torch.empty(0)}, str(path))
    flat = value.reshape(-1)
    with SafetensorsReader(path) as reader:
        assert reader.entries["value"].shape == (37, 11) and reader.entries["value"].dtype == dtype
        assert torch.equal(reader.read("value"), value)
        assert torch.equal(reader.read("other"), other)
        assert reader.read("empty").numel() == 0
        for start, count in [(0, 1), (5, 100), (406, 1), (0, 407), (200, 0), (13, 37)]:
            out = torch.empty(count, dtype=dtype)
            reader.read_into("value", out, start=start)
            assert torch.equal(out, flat[start: start + count]), (start, count)
        if dtype != torch.bool:  # cast on read: stored dtype -> the out buffer's dtype
            out64 = torch.empty(5, 7, dtype=torch.float64)  # any shape, filled in flat order
            reader.read_into("value", out64, start=90)
            assert torch.equal(out64.reshape(-1), flat[90:125].to(torch.float64))


def test_cast_reads_go_through_bounded_chunks(tmp_path, monkeypatch):
    """A casting read spans several internal buffers and still lands every element in place."""
    value = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    path = tmp_path / "c.safetensors"
    save_file({"v": value}, str(path))
    monkeypatch.setattr(safetensors_io, "CHUNK_BYTES", 40)  # 10 fp32 elements per chunk
    with SafetensorsReader(path) as reader:
        out = torch.empty(333, dtype=torch.float64)
        reader.read_into("v", out, start=501)
    assert torch.equal(out, value[501:834].double())


def test_reader_rejects_out_of_range_reads(tmp_path):
    save_file({"v": torch.zeros(10)}, str(tmp_path / "r.safetensors"))
    with SafetensorsReader(tmp_path / "r.safetensors") as reader:
        with pytest.raises(IndexError, match="outside"):
            reader.read_into("v", torch.empty(3), start=8)
        with pytest.raises(IndexError):
            reader.read_into("v", torch.empty(1), start=-1)
        with pytest.raises(KeyError):
            reader.read_into("missing", torch.empty(1))


def test_writer_rejects_wrong_dtype_overflow_and_incomplete_files(tmp_path):
    entries = [("a", torch.float32, (4,)), ("b", torch.int64, (2,))]
    with pytest.raises(TypeError, match="'a' is torch.float32, got a torch.float16 chunk"):
        with StreamingWriter(tmp_path / "dtype.safetensors", entries) as writer:
            writer.write(torch.zeros(4, dtype=torch.float16))
    with StreamingWriter(tmp_path / "over.safetensors", entries) as writer:
        writer.write(torch.zeros(3))
        with pytest.raises(ValueError, match="overflows"):
            writer.write(torch.zeros(2))  # crosses from 'a' into 'b': one chunk belongs to one tensor
        writer.write(torch.zeros(1))
        writer.write(torch.ones(2, dtype=torch.int64))
        with pytest.raises(ValueError, match="already written"):
            writer.write(torch.zeros(1, dtype=torch.int64))
    assert torch.equal(load_file(str(tmp_path / "over.safetensors"))["b"], torch.ones(2, dtype=torch.int64))
    writer = StreamingWriter(tmp_path / "short.safetensors", entries)
    writer.write(torch.zeros(4))
    with pytest.raises(ValueError, match="16 of 32 data bytes written"):
        writer.close()
    with pytest.raises(ValueError, match="appears twice"):
        StreamingWriter(tmp_path / "dup.safetensors", [("a", torch.float32, (1,)), ("a", torch.float32, (1,))])
    with pytest.raises(TypeError, match="cannot store"):
        StreamingWriter(tmp_path / "complex.safetensors", [("a", torch.complex64, (1,))])


def test_reader_rejects_truncated_and_garbage_files(tmp_path):
    path = tmp_path / "good.safetensors"
    save_file({"a": torch.arange(100, dtype=torch.float32)}, str(path))
    data = path.read_bytes()
    cases = {
        "truncated": data[:-4],
        "tiny": data[:5],
        "huge_header_length": (10**12).to_bytes(8, "little") + data[8:],
        "garbage_header": len(b"{not json").to_bytes(8, "little") + b"{not json" + b"\0" * 16,
        "empty": b"",
    }
    for name, blob in cases.items():
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(blob)
        with pytest.raises(ValueError, match="truncated|not a readable safetensors file") as info:
            SafetensorsReader(bad)
        assert str(bad) in str(info.value), name
    # a header whose offsets point past the end of the file is truncated too
    header = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    header += b" " * (-(8 + len(header)) % 8)
    (tmp_path / "short.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    with pytest.raises(ValueError, match="truncated"):
        SafetensorsReader(tmp_path / "short.safetensors")


def test_reader_detects_a_file_shrinking_under_it(tmp_path):
    path = tmp_path / "s.safetensors"
    save_file({"a": torch.arange(1000, dtype=torch.float32)}, str(path))
    with SafetensorsReader(path) as reader:
        os.truncate(path, os.path.getsize(path) - 400)
        with pytest.raises(OSError, match="short read"):
            reader.read("a")
