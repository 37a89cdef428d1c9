"""`Device.gemm`: out = alpha * a @ b + beta * out on every backend, and the CPU device's CBLAS
path (MKL where installed, NumPy's own OpenBLAS) against NumPy, for every layout it accepts, and
how BLOCKRT_BLAS picks between them (the measured choice of "auto": tests/test_blas_choice.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import backends
from backends import Device, _blas, _blas_choice
from helpers import to_device


@pytest.fixture(scope="module", params=backends.available())
def device(request) -> Device:
    return backends.get_device(request.param)


@given(m=st.integers(1, 40), n=st.integers(1, 40), k=st.integers(1, 40),
       alpha=st.sampled_from([1.0, -0.01, 2.5]), beta=st.sampled_from([0.0, 1.0, 0.9, -1.0]),
       dtype=st.sampled_from([np.float32, np.float64]), seed=st.integers(0, 10_000))
@settings(max_examples=40)
def test_gemm_equals_numpy_on_every_backend(device, m, n, k, alpha, beta, dtype, seed):
    if dtype == np.float64 and not getattr(device, "fp64", True):
        dtype = np.float32  # an OpenCL device without cl_khr_fp64
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(m, k)).astype(dtype)
    b = rng.normal(size=(k, n)).astype(dtype)
    c = rng.normal(size=(m, n)).astype(dtype)
    out = to_device(device, c)
    device.gemm(to_device(device, a), to_device(device, b), out, alpha, beta)
    want = alpha * (a.astype(np.float64) @ b) + beta * c
    tolerance = 2e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(device.to_host(out), want, rtol=tolerance,
                               atol=tolerance * (k + 2) * 4)


def test_gemm_with_beta_zero_never_reads_the_old_output(device):
    a = np.ones((3, 2), np.float32)
    out = to_device(device, np.full((3, 3), np.nan, np.float32))
    device.gemm(to_device(device, a), to_device(device, a.T.copy()), out, 0.5, 0.0)
    np.testing.assert_array_equal(device.to_host(out), np.ones((3, 3), np.float32))


# ---------------------------------------------------------------------- the CPU's BLAS
cpu = backends.get_device("cpu")
blas = _blas.find()
needs_blas = pytest.mark.skipif(blas is None, reason="no CBLAS blockrt can call here (NumPy on "
                                "Accelerate or a stripped build, no mkl wheel, or "
                                "BLOCKRT_BLAS=none): gemm is emulated")


@pytest.fixture(scope="module", params=["openblas", "mkl"])
def vendor(request) -> _blas.Gemm:
    """Each CBLAS this machine has, so both are tested wherever both are installed."""
    gemm = _blas.load(request.param)
    if gemm is None:
        pytest.skip(_blas._MISSING[request.param])
    return gemm


@pytest.fixture
def fresh_choice(monkeypatch):
    """find() forgets its choice for the test and the environment variable is the test's."""
    monkeypatch.setattr(_blas, "_found", [])
    monkeypatch.delenv(_blas.ENV, raising=False)
    return monkeypatch


@needs_blas
def test_a_cblas_is_found_and_the_cpu_device_accumulates():
    assert cpu.capabilities.gemm_accumulates
    for gemm in _blas.present():
        assert gemm.name.split()[0] in ("MKL", "OpenBLAS")
        assert ("mkl" if gemm.name.startswith("MKL") else "openblas") in gemm.path.lower()
        assert gemm.threads() >= 1


def test_blockrt_blas_picks_the_library(fresh_choice):
    mkl = _blas.load("mkl")
    openblas = _blas.load("openblas")
    fresh_choice.setenv(_blas.ENV, "none")
    assert _blas.find() is None and not cpu.capabilities.gemm_accumulates
    for value, want in (("openblas", openblas), ("mkl", mkl)):
        fresh_choice.setattr(_blas, "_found", [])
        fresh_choice.setenv(_blas.ENV, value)
        if want is None:  # named but not here: an error that says so, and nothing remembered
            with pytest.raises(RuntimeError, match=f"BLOCKRT_BLAS={value}, but no "):
                _blas.find()
            assert _blas._found == []
            continue
        found = _blas.find()
        assert found.path == want.path, value
        assert _blas.report().summary == f"{want.name} (BLOCKRT_BLAS={value})"
    for value in ("auto", ""):  # measured where both are here, else the one that is
        fresh_choice.setattr(_blas, "_found", [])
        fresh_choice.setenv(_blas.ENV, value)
        found = _blas.find()
        if mkl and openblas:
            assert isinstance(found, _blas_choice.Chooser), value
            assert [lib.path for lib in found.libraries] == [openblas.path, mkl.path]
        else:
            assert found is (mkl or openblas), value
    fresh_choice.setattr(_blas, "_found", [])
    fresh_choice.setenv(_blas.ENV, "openblas")
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = np.empty((3, 3), np.float32)
    cpu.matmul(a, a.T, out)  # the device's products follow the choice too
    np.testing.assert_array_equal(out, a @ a.T)


@pytest.mark.parametrize("vendor_name", ["mkl", "openblas"])
def test_the_devices_products_go_to_mkl_and_stay_with_numpy_on_openblas(fresh_choice,
                                                                          vendor_name):
    real = _blas.load(vendor_name)
    if real is None:
        pytest.skip(_blas._MISSING[vendor_name])
    calls = []

    class Counting:  # the real library, counting the calls that reach it
        products = real.products

        def __call__(self, a, b, c, alpha, beta):
            calls.append(c.shape)
            return real(a, b, c, alpha, beta)

    fresh_choice.setattr(_blas, "_found", [Counting()])
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = np.empty((3, 3), np.float32)
    cpu.matmul(a, a.T, out)
    np.testing.assert_array_equal(out, a @ a.T)
    assert calls == ([(3, 3)] if vendor_name == "mkl" else [])  # NumPy's matmul is OpenBLAS


def test_an_unknown_blockrt_blas_is_refused_by_name(fresh_choice):
    fresh_choice.setenv(_blas.ENV, "atlas")
    with pytest.raises(ValueError, match=r"BLOCKRT_BLAS='atlas' is not one of auto, mkl, "
                                         r"openblas, none"):
        _blas.find()
    assert _blas._found == []  # nothing was chosen: fixing the variable is enough


@pytest.mark.parametrize("vendor_name", ["mkl", "openblas"])
def test_asking_for_a_blas_that_is_not_here_is_an_error(fresh_choice, vendor_name):
    fresh_choice.setitem(_blas._loads, vendor_name, None)  # as where it is not installed
    fresh_choice.setenv(_blas.ENV, vendor_name)
    with pytest.raises(RuntimeError, match=f"BLOCKRT_BLAS={vendor_name}, but .*self-test"):
        _blas.find()
    assert _blas._found == []
    fresh_choice.setenv(_blas.ENV, "auto")  # auto takes the other, unmeasured, or matmul
    other = _blas.load("openblas" if vendor_name == "mkl" else "mkl")
    assert _blas.find() is other
    assert _blas.report().summary == (f"{other.name} (the only CBLAS here)" if other else
                                      "none (np.matmul and an elementwise pass)")


def test_sizes_a_32_bit_blas_cannot_take_are_left_to_numpy(vendor, monkeypatch):
    a = np.ones((6, 5), np.float32)
    out = np.zeros((6, 6), np.float32)
    assert vendor._largest is None  # both libraries here take 64-bit integers: no limit
    monkeypatch.setattr(vendor, "_largest", 5)  # as if 5 were the largest int it can take
    assert not vendor.supports(a, a.T, out)
    assert not vendor(a, a.T, out, 1.0, 0.0)
    np.testing.assert_array_equal(out, 0.0)
    monkeypatch.setattr(vendor, "_largest", 6)
    assert vendor(a, a.T, out, 1.0, 0.0)
    np.testing.assert_array_equal(out, 5.0)


@given(m=st.integers(1, 30), n=st.integers(1, 30), k=st.integers(1, 30),
       layout=st.tuples(st.booleans(), st.booleans()), pad=st.integers(0, 3),
       dtype=st.sampled_from([np.float32, np.float64]), seed=st.integers(0, 10_000))
@settings(max_examples=60)
def test_blas_gemm_reads_transposed_and_padded_views(vendor, m, n, k, layout, pad, dtype, seed):
    """Operands stored transposed or with a row pitch wider than their width (a slice of a
    bigger matrix), and an output with a wide pitch: the same as NumPy's matmul, to rounding."""
    rng = np.random.default_rng(seed)

    def stored(rows, cols, transposed):
        if transposed:
            return rng.normal(size=(cols, rows + pad)).astype(dtype)[:, :rows].T
        return rng.normal(size=(rows, cols + pad)).astype(dtype)[:, :cols]

    a, b = stored(m, k, layout[0]), stored(k, n, layout[1])
    out_store = rng.normal(size=(m, n + pad)).astype(dtype)
    out = out_store[:, :n]
    before = out_store.copy()
    assert vendor.supports(a, b, out)
    assert vendor(a, b, out, -0.5, 1.0)
    want = before[:, :n] - 0.5 * (a.astype(np.float64) @ b)
    tolerance = 2e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out, want, rtol=tolerance, atol=tolerance * (k + 2) * 4)
    np.testing.assert_array_equal(out_store[:, n:], before[:, n:])  # the padding is untouched


def test_shapes_that_do_not_agree_are_left_to_numpy_which_refuses_them(vendor):
    a = np.ones((2, 3), np.float32)
    for b, out in ((np.ones((3, 4), np.float32), np.zeros((1, 4), np.float32)),
                   (np.ones((3, 4), np.float32), np.zeros((2, 5), np.float32)),
                   (np.ones((2, 4), np.float32), np.zeros((2, 4), np.float32))):
        assert not vendor.supports(a, b, out)
        assert not vendor(a, b, out, 1.0, 0.0)  # refuses, and writes nothing
        np.testing.assert_array_equal(out, 0.0)
        with pytest.raises(ValueError, match="matmul"):
            cpu.matmul(a, b, out)


def test_layouts_blas_cannot_read_fall_back_to_the_emulation(vendor):
    rng = np.random.default_rng(3)
    a = rng.normal(size=(8, 12)).astype(np.float32)[:, ::2]  # every other column: no unit stride
    b = rng.normal(size=(6, 5)).astype(np.float32)
    mixed = b.astype(np.float64)
    out_t = np.zeros((5, 8), np.float32).T  # a transposed output
    assert not vendor.supports(a, b, np.zeros((8, 5), np.float32))
    assert not vendor.supports(a[:, :6].copy(), mixed, np.zeros((8, 5), np.float64))
    assert not vendor.supports(np.ascontiguousarray(a), b, out_t)
    untouched = np.ones((8, 5), np.float32)
    assert not vendor(a, b, untouched, 2.0, 1.0)  # refuses, and writes nothing
    np.testing.assert_array_equal(untouched, 1.0)
    out = np.ones((8, 5), np.float32)
    cpu.gemm(a, b, out, 2.0, 1.0)  # emulated: product into scratch, then one fused pass
    np.testing.assert_allclose(out, 1.0 + 2.0 * (a @ b), rtol=1e-5, atol=1e-5)
    cpu.gemm(np.ascontiguousarray(a), b, out_t, 1.0, 0.0)
    np.testing.assert_allclose(out_t, a @ b, rtol=1e-5, atol=1e-5)


def test_a_blas_that_gets_the_self_test_wrong_is_not_used():
    class IgnoresBeta:
        def __call__(self, a, b, c, alpha, beta):
            np.copyto(c, alpha * (a @ b))
            return True

    assert not _blas._passes(IgnoresBeta())
    for vendor in ("openblas", "mkl"):
        found = _blas.load(vendor)
        assert found is None or _blas._passes(found)
