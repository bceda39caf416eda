"""Group-wise int8 weights and the int8 x float matmul (issue 20): the quantization formula on hand
cases, and the native kernel, the PyTorch fallback and a float64 ``F.linear`` over the dequantized
weights agreeing on many shapes (decode and prefill rows, odd sizes, ragged groups, fp32/bf16, bias).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from zerospeed.ops import int8

NATIVE = int8.kernels("auto")
TORCH = int8.kernels("torch")
needs_native = pytest.mark.skipif(NATIVE.module is None, reason=f"native int8 kernels not built: {NATIVE.reason}")


def test_quantize_hand_case_with_a_ragged_group_and_a_zero_row() -> None:
    w = torch.tensor([[1.0, -4.0, 0.5, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    q, s = int8.quantize_groupwise(w, 2)  # groups [1, -4], [0.5, 2], [3] (the last one shorter)
    expected_s = torch.tensor([[4.0, 2.0, 3.0], [0.0, 0.0, 0.0]]) / 127
    assert s.dtype == torch.float32 and torch.equal(s, expected_s)
    # 1 / (4/127) = 31.75 -> 32; 0.5 / (2/127) = 31.75 -> 32; each group's max -> +-127; zeros stay 0
    assert q.dtype == torch.int8 and q.tolist() == [[32, -127, 32, 127, 127], [0, 0, 0, 0, 0]]
    deq = int8.dequantize_groupwise(q, s, 2)
    assert torch.equal(deq[0], torch.tensor([32.0, -127.0, 32.0, 127.0, 127.0]) * expected_s[0].repeat_interleave(2)[:5])
    assert torch.equal(deq[1], torch.zeros(5))


def test_rounding_error_is_at_most_half_a_step_and_ties_go_to_even() -> None:
    torch.manual_seed(0)
    w = torch.randn(37, 301) * torch.logspace(-3, 2, 301)  # spread magnitudes
    q, s = int8.quantize_groupwise(w, 32)
    step = s.repeat_interleave(32, dim=1)[:, :301]
    err = (int8.dequantize_groupwise(q, s, 32) - w).abs()
    assert bool((err <= step / 2 * (1 + 1e-5) + 1e-30).all())
    assert q.abs().max().item() == 127
    # exact ties: 2.5 and 3.5 steps round to even (2 and 4), as torch.round does
    q2, s2 = int8.quantize_groupwise(torch.tensor([[127.0, 2.5, 3.5, -2.5]]), 4)
    assert s2.item() == 1.0 and q2.tolist() == [[127, 2, 4, -2]]


def _cases() -> list[tuple[int, int, int, int, torch.dtype, bool]]:
    shapes = [(1, 1, 1, 1), (1, 64, 48, 16), (2, 7, 5, 3), (3, 77, 33, 16), (4, 128, 31, 32), (5, 130, 17, 32),
              (8, 256, 64, 128), (13, 33, 9, 1000), (16, 200, 40, 64), (17, 96, 40, 32), (64, 100, 23, 50),
              (300, 200, 70, 64), (129, 48, 257, 16)]
    return [(m, k, n, g, dtype, bias) for i, (m, k, n, g) in enumerate(shapes)
            for dtype, bias in ((torch.float32, i % 2 == 0), (torch.bfloat16, i % 2 == 1))]


def _reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, g: int, b: torch.Tensor | None) -> torch.Tensor:
    w = int8.dequantize_groupwise(q, s, g).double()
    return F.linear(x.double(), w, b.double() if b is not None else None)


def test_torch_path_is_dequantized_linear_on_many_shapes() -> None:
    torch.manual_seed(0)
    for m, k, n, g, dtype, has_bias in _cases():
        x = torch.randn(m, k).to(dtype)
        q, s = int8.quantize_groupwise(torch.randn(n, k), g)
        b = torch.randn(n).to(dtype) if has_bias else None
        got = int8.int8_linear(x, q, s, g, b, kernels=TORCH)
        want = _reference(x, q, s, g, b)
        assert got.dtype == dtype and got.shape == (m, n)
        tol = 1e-5 * (x.double().abs() @ int8.dequantize_groupwise(q, s, g).double().abs().t() + 1)
        if dtype == torch.bfloat16:  # fp32 result rounded once to bf16: half a bf16 step of error
            tol = tol + want.abs() * 2.0 ** -8
        assert bool(((got.double() - want).abs() <= tol).all()), (m, k, n, g, dtype)


@needs_native
def test_native_kernel_equals_fallback_and_reference_on_many_shapes() -> None:
    torch.manual_seed(1)
    for m, k, n, g, dtype, has_bias in _cases():
        x = torch.randn(m, k).to(dtype)
        q, s = int8.quantize_groupwise(torch.randn(n, k), g)
        b = torch.randn(n).to(dtype) if has_bias else None
        native = int8.int8_linear(x, q, s, g, b, kernels=NATIVE)
        fallback = int8.int8_linear(x, q, s, g, b, kernels=TORCH)
        want = _reference(x, q, s, g, b)
        assert native.dtype == dtype and native.shape == (m, n)
        scale = x.double().abs() @ int8.dequantize_groupwise(q, s, g).double().abs().t() + 1
        if dtype == torch.float32:
            assert bool(((native.double() - want).abs() <= 1e-5 * scale).all()), (m, k, n, g)
        else:  # both round the same fp32 value to bf16, except at a rounding boundary: one bf16 step
            assert bool(((native.double() - fallback.double()).abs() <= want.abs() * 2.0 ** -7 + 1e-5 * scale).all())
        if m > int8.DIRECT_MAX_ROWS:  # prefill: the same dequantized tiles through the same sgemm
            assert torch.equal(native, fallback), (m, k, n, g, dtype)


@needs_native
def test_leading_dims_threads_and_tiles_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(2)
    monkeypatch.setattr(int8, "PARALLEL_MIN_WEIGHTS", 1 << 16)  # 358k weights below: threaded
    q, s = int8.quantize_groupwise(torch.randn(700, 512), 128)
    x = torch.randn(2, 3, 512)
    full = int8.int8_linear(x, q, s, 128, kernels=NATIVE)
    assert full.shape == (2, 3, 700)
    assert torch.allclose(full, int8.int8_linear(x.reshape(6, 512), q, s, 128, kernels=NATIVE).reshape(2, 3, 700))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = int8.int8_linear(x, q, s, 128, kernels=NATIVE)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, full)  # each output is one thread's dot product: no order change
    rows = torch.randn(40, 512)
    whole = int8.int8_linear(rows, q, s, 128, kernels=NATIVE)
    monkeypatch.setattr(int8, "TILE_ELEMS", 512 * 64)  # 11 tiles of 64 rows (the last one 60)
    tiled = int8.int8_linear(rows, q, s, 128, kernels=NATIVE)
    assert torch.allclose(tiled, whole, atol=1e-5) and torch.allclose(tiled, _reference(rows, q, s, 128, None).float(),
                                                                      atol=1e-4)


def test_bad_arguments_are_refused_naming_the_value() -> None:
    q, s = int8.quantize_groupwise(torch.randn(4, 8), 4)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=f"group_size={bad!r}: pass a positive number"):
            int8.quantize_groupwise(torch.randn(4, 8), bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"last dimension in_features=8; got torch.float32 \(3, 7\)"):
        int8.int8_linear(torch.randn(3, 7), q, s, 4)
    with pytest.raises(ValueError, match=r"scales must be fp32 \[4, 2\]"):
        int8.int8_linear(torch.randn(3, 8), q, s.bfloat16(), 4)
    with pytest.raises(ValueError, match=r"bias must have shape \(4,\)"):
        int8.int8_linear(torch.randn(3, 8), q, s, 4, torch.zeros(5))
    with pytest.raises(ValueError, match="2-d floating weight"):
        int8.quantize_groupwise(torch.ones(4, 8, dtype=torch.long), 4)


def test_report_names_the_int8_path() -> None:
    from zerospeed.report import lines

    assert any(line.startswith(f"int8 weight matmul (inference quantization): {NATIVE.name}") for line in lines())


@needs_native
def test_int8_kernels_need_no_compiler_at_run_time(tmp_path: Path) -> None:
    code = ("import torch; from zerospeed.ops import int8\n"
            "q, s = int8.quantize_groupwise(torch.ones(8, 32), 16)\n"
            "y = int8.int8_linear(torch.ones(1, 32), q, s, 16, kernels=int8.kernels('native'))\n"
            "print(int8.kernels('native').name, float(y[0, 0]))\n")
    src = str(Path(int8.__file__).resolve().parents[2])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={"PATH": str(tmp_path / "no-compilers-here"), "HOME": str(tmp_path), "PYTHONPATH": src})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["native", "32.0"]
