"""backends/_cublas.py's mapping of row-major products onto column-major cuBLAS calls, checked
on the CPU: the calls `prepare` makes go to a stand-in that computes what cuBLAS's
`cublasGemmEx` and `cublasGemmStridedBatchedEx` compute from the same arguments (operation,
sizes, leading dimensions, batch strides, pointers), reading and writing host memory. So every
layout a product meets is checked in CI, where no GPU runs the real library (tests/test_cuda.py
runs it where one does).
"""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest

from backends import _cublas
from helpers import product_layouts

_DTYPES = {0: np.float32, 1: np.float64, 2: np.float16, 14: ml_dtypes.bfloat16}


def _matrix(address: int, dtype, op: int, rows: int, cols: int, ld: int) -> np.ndarray:
    """op(X) of cuBLAS, (rows, cols): X is stored column-major at `address` with leading
    dimension `ld`, as (rows, cols) for op N and (cols, rows) for op T."""
    size = np.dtype(dtype).itemsize
    stored_rows, stored_cols = (rows, cols) if op == 0 else (cols, rows)
    count = ld * (stored_cols - 1) + stored_rows if stored_cols and stored_rows else 0
    flat = np.frombuffer((ctypes.c_char * (count * size)).from_address(address), dtype)
    stored = np.lib.stride_tricks.as_strided(flat, (stored_rows, stored_cols), (size, ld * size))
    return stored if op == 0 else stored.T


class _Cublas:
    """What the two cuBLAS calls compute: C = alpha * op(A) op(B) + beta * C, with alpha and
    beta host scalars passed by reference (cuBLAS's host pointer mode), C not read where beta
    is 0."""

    def __init__(self):
        self.calls = []

    def cublasGemmEx(self, handle, ta, tb, m, n, k, alpha, a, atype, lda, b, btype, ldb,
                     beta, c, ctype, ldc, compute, algo):
        self.calls.append("gemm")
        return self.cublasGemmStridedBatchedEx(handle, ta, tb, m, n, k, alpha, a, atype, lda,
                                               0, b, btype, ldb, 0, beta, c, ctype, ldc, 0, 1,
                                               compute, algo, record=False)

    def cublasGemmStridedBatchedEx(self, handle, ta, tb, m, n, k, alpha, a, atype, lda,
                                   stride_a, b, btype, ldb, stride_b, beta, c, ctype, ldc,
                                   stride_c, count, compute, algo, record=True):
        if record:
            self.calls.append("batched")
        a_type, b_type, c_type = _DTYPES[atype], _DTYPES[btype], _DTYPES[ctype]
        a_size, b_size, c_size = (np.dtype(t).itemsize for t in (a_type, b_type, c_type))
        for i in range(count):
            op_a = _matrix(a.value + i * stride_a * a_size, a_type, ta, m, k, lda)
            op_b = _matrix(b.value + i * stride_b * b_size, b_type, tb, k, n, ldb)
            out = _matrix(c.value + i * stride_c * c_size, c_type, 0, m, n, ldc)
            product = alpha._obj.value * (op_a.astype(np.float64) @ op_b.astype(np.float64))
            out[...] = product if beta._obj.value == 0 else product + beta._obj.value * out
        return 0


class _View:
    """A NumPy array shaped as `prepare` reads a CuPy one (`data.ptr`)."""

    def __init__(self, x: np.ndarray) -> None:
        self.x, self.shape, self.strides, self.dtype, self.ndim = (x, x.shape, x.strides,
                                                                   x.dtype, x.ndim)

    @property
    def data(self):
        return type("Pointer", (), {"ptr": self.x.__array_interface__["data"][0]})()


class _Handles:
    handle = type("Handle", (), {"ptr": None})()


@pytest.fixture
def cublas(monkeypatch):
    stand_in = _Cublas()
    monkeypatch.setattr(_cublas, "_library", [stand_in])
    return stand_in


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_layout_maps_onto_the_column_major_call_that_computes_it(cublas, dtype):
    for a, view_a, b, view_b in product_layouts(np.random.default_rng(0), dtype):
        left, right = view_a(a), view_b(b)
        want = left.astype(np.float64) @ right
        out = np.full(want.shape, np.nan, dtype)
        _cublas.prepare(_Handles(), None, _View(left), _View(right), _View(out))()
        np.testing.assert_allclose(out, want, rtol=1e-6, err_msg=f"{left.shape} @ "
                                   f"{right.strides} {right.shape}")
    assert {"gemm", "batched"} <= set(cublas.calls)


@pytest.mark.parametrize("half", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_two_byte_operands_go_into_a_float32_product_in_every_layout(cublas, half):
    """Half operands, a float32 output: one call with A and B of the half type and C float32
    (the product unrounded, as a linear layer's bias is added before its one rounding)."""
    for a, view_a, b, view_b in product_layouts(np.random.default_rng(1), np.float32):
        left, right = view_a(a.astype(half)), view_b(b.astype(half))
        want = left.astype(np.float64) @ right.astype(np.float64)
        out = np.full(want.shape, np.nan, np.float32)
        _cublas.prepare(_Handles(), None, _View(left), _View(right), _View(out))()
        np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(_cublas.Unsupported, match="float16 and float16 into float64"):
        _cublas.prepare(_Handles(), None, *(_View(np.ones((2, 2), t))
                                            for t in (np.float16, np.float16, np.float64)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_an_accumulating_product_scales_and_adds_in_every_layout(cublas, dtype):
    """gemm's alpha and beta (`CudaDevice.gemm`, a graph's folded SGD update): out = alpha *
    a @ b + beta * out in one call; with beta 0 a NaN in out is not read."""
    rng = np.random.default_rng(3)
    for a, view_a, b, view_b in product_layouts(rng, dtype):
        left, right = view_a(a), view_b(b)
        product = left.astype(np.float64) @ right
        before = rng.standard_normal(product.shape).astype(dtype)
        out = before.copy()
        _cublas.prepare(_Handles(), None, _View(left), _View(right), _View(out), -0.25,
                        0.5)()
        np.testing.assert_allclose(out, -0.25 * product + 0.5 * before, rtol=1e-5, atol=1e-6)
        out = np.full(product.shape, np.nan, dtype)
        _cublas.prepare(_Handles(), None, _View(left), _View(right), _View(out), 2.0, 0.0)()
        np.testing.assert_allclose(out, 2.0 * product, rtol=1e-6)


def test_an_output_with_padded_rows_is_written_in_place_and_nowhere_else(cublas):
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((5, 4)), rng.standard_normal((4, 3))
    whole = np.zeros((5, 8))
    _cublas.prepare(_Handles(), None, _View(a), _View(b), _View(whole[:, 1:4]))()
    np.testing.assert_allclose(whole[:, 1:4], a @ b)
    assert not whole[:, 0].any() and not whole[:, 4:].any()


def test_layouts_it_cannot_run_are_refused_before_any_call(cublas):
    rng = np.random.default_rng(2)
    a = rng.standard_normal((6, 6))
    checks = [
        (a[::2, ::2], rng.standard_normal((3, 2)), np.zeros((3, 2)), "neither its rows"),
        (rng.standard_normal((3, 4)), rng.standard_normal((4, 2)), np.zeros((2, 3)).T,
         "rows must be contiguous"),
        (rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal((4, 2)),
         np.zeros((3, 2)), "float32 and float64"),
        (rng.standard_normal((3, 0)), rng.standard_normal((0, 2)), np.zeros((3, 2)),
         "length 0"),
    ]
    for left, right, out, why in checks:
        with pytest.raises(_cublas.Unsupported, match=why):
            _cublas.prepare(_Handles(), None, _View(left), _View(right), _View(out))
    assert cublas.calls == []


def test_an_empty_output_makes_no_call(cublas):
    out = np.zeros((0, 3))
    _cublas.prepare(_Handles(), None, _View(np.zeros((0, 4))), _View(np.ones((4, 3))),
                    _View(out))()
    assert cublas.calls == []


def test_the_float32_precision_setting_is_checked_and_restored():
    assert _cublas.get_float32_matmul_precision() == "highest"
    _cublas.set_float32_matmul_precision("high")
    try:
        assert _cublas.get_float32_matmul_precision() == "high"
    finally:
        _cublas.set_float32_matmul_precision("highest")
    with pytest.raises(ValueError, match="'low'"):
        _cublas.set_float32_matmul_precision("low")
