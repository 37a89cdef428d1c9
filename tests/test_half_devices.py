"""The OpenCL device's two-byte float kernels (float16, bfloat16) against the rule of HALVES in
backends/base.py (compute in float32 from the exactly widened operands, round once): each kernel
loads its half operands straight into float and rounds as it stores, and must give bit for bit
what `Device`'s own widened path gives on the same device (`_in_float32`: each operand copied
into float32 scratch, the float32 kernel, the result rounded by a cast kernel). A fused chain
rounds each two-byte link, in registers, as the link's own kernel would. Every layout: contiguous,
offset, strided, transposed and broadcast views.

Skipped when pyopencl or an OpenCL device (PoCL counts) is missing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import backends
from backends.base import BINARY_KERNELS, UNARY_KERNELS
from runtime import dtypes

cla = pytest.importorskip("pyopencl.array", reason="pyopencl is not installed (pip install "
                          "blockrt[opencl])")
if "opencl" not in backends.available():
    pytest.skip("no OpenCL device on this machine (PoCL from blockrt[opencl] provides a CPU one)",
                allow_module_level=True)

from backends.opencl import OpenCLDevice  # noqa: E402

HALF = [np.dtype("float16"), dtypes.BFLOAT16]
LAYOUTS = ["contiguous", "offset", "strided", "transposed", "broadcast"]
EDGES = [0.0, -0.0, math.inf, -math.inf, math.nan, 65504.0, 65520.0, 6e-8, 1e-40, 3.3e38]


@pytest.fixture(scope="module")
def dev() -> OpenCLDevice:
    return backends.get_device("opencl")


class Widened(OpenCLDevice):
    """The device as it computed the two-byte floats before its half kernels: neither
    `half_kernels` nor `half_elementwise` (each half operand widened into float32 scratch by a
    cast kernel, the float32 kernel, the result narrowed by another)."""

    capabilities = dataclasses.replace(OpenCLDevice.capabilities, half_kernels=False)


def widened(device: OpenCLDevice) -> Widened:
    """A `Widened` device on `device`'s own queue (and context), so it runs on its views."""
    return Widened(0, device.queue)


def _values(rng: np.random.Generator, n: int, dtype: np.dtype, edges: bool) -> np.ndarray:
    """n values of `dtype`: normal(0, 2), some of them edge values when `edges`."""
    wide = rng.normal(0, 2, n)
    if edges:
        picks = rng.integers(0, 4 * len(EDGES), n)
        wide = np.where(picks < len(EDGES), np.array(EDGES)[picks % len(EDGES)], wide)
    with np.errstate(over="ignore"):
        return wide.astype(np.float32).astype(dtype)


def _placed(dev: OpenCLDevice, host: np.ndarray, where: str) -> Any:
    """A native view equal to `host` (2-D) laid out as `where` in a fresh buffer."""
    rows, cols = host.shape
    item = host.dtype.itemsize
    if where == "contiguous":
        base, offset, strides = host, 0, (cols * item, item)
    elif where == "offset":
        base = np.concatenate([np.zeros(3, host.dtype), host.ravel()])
        offset, strides = 3 * item, (cols * item, item)
    elif where == "strided":  # every other column
        base = np.repeat(host, 2, axis=1)
        offset, strides = 0, (2 * cols * item, 2 * item)
    elif where == "transposed":
        base, offset, strides = host.T, 0, (item, rows * item)
    else:  # "broadcast": one row seen again and again
        host[...] = host[0]
        base, offset, strides = host[0], 0, (0, item)
    base = np.ascontiguousarray(base)
    raw = dev.raw_alloc(base.nbytes)
    dev.copyin(raw, 0, base)
    return dev.array_view(raw, offset, host.shape, host.dtype, strides)


def _output(dev: OpenCLDevice, shape: tuple, dtype: np.dtype, where: str) -> Any:
    """A writable view of `shape` (no broadcast), filled with a pattern."""
    host = np.full(shape, 7.0, np.float32).astype(dtype)
    return _placed(dev, host, "strided" if where == "broadcast" else where)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bits, every NaN equal to every NaN (signalling ones too)."""
    with np.errstate(invalid="ignore"):
        nan, nan_b = np.isnan(a.astype(np.float64)), np.isnan(b.astype(np.float64))
    bits = f"u{a.dtype.itemsize}"
    return bool(a.dtype == b.dtype and np.array_equal(nan, nan_b)
                and np.array_equal(np.where(nan, 0, a.view(bits)), np.where(nan, 0, b.view(bits))))


layouts = st.sampled_from(LAYOUTS)
#: The elementwise kernels that compute (copy moves bits)
COMPUTING = [name for name in UNARY_KERNELS + BINARY_KERNELS if name != "copy"]


@settings(max_examples=80, deadline=None)
@given(half=st.sampled_from(HALF), name=st.sampled_from(COMPUTING),
       where=st.tuples(layouts, layouts, layouts), shape=st.tuples(st.integers(1, 9),
                                                                   st.integers(1, 40)),
       seed=st.integers(0, 2**32 - 1), edges=st.booleans(), number=st.booleans())
def test_elementwise_half_kernels_equal_the_widened_path(dev, half, name, where, shape, seed,
                                                         edges, number):
    rng = np.random.default_rng(seed)
    inputs = [_placed(dev, _values(rng, math.prod(shape), half, edges).reshape(shape), w)
              for w in where[:2]]
    if number:  # a number meets a half as float32
        inputs[1] = np.float32(rng.normal(0, 2))
    got, wide = (_output(dev, shape, half, where[2]) for _ in range(2))
    if name in UNARY_KERNELS:
        dev.unary(name, inputs[0], got)
        widened(dev).unary(name, inputs[0], wide)
    else:
        dev.binary(name, *inputs, got)
        widened(dev).binary(name, *inputs, wide)
    assert _same(dev.to_host(got), dev.to_host(wide))


@st.composite
def chains(draw: Any, half: np.dtype) -> list[tuple[str, tuple, np.dtype]]:
    """A fused program over inputs 0 and 1: 1-5 links, each reading inputs, earlier links or a
    number; inner links half or float32, the last one half."""
    program: list[tuple[str, tuple, np.dtype]] = []
    length = draw(st.integers(1, 5))
    for i in range(length):
        name = draw(st.sampled_from(COMPUTING))
        sources = [("input", 0), ("input", 1)] + [("link", j) for j in range(i)]
        if i:
            sources += [("link", i - 1)] * 2  # mostly a chain
        args = []
        for _ in range(1 if name in UNARY_KERNELS else 2):
            if args and draw(st.booleans()) and args[0][0] != "number":
                args.append(("number", np.float32(draw(st.floats(-3, 3, width=32)))))
            else:
                args.append(draw(st.sampled_from(sources)))
        dtype = half if i == length - 1 else draw(st.sampled_from([half, half, np.float32]))
        program.append((name, tuple(args), np.dtype(dtype)))
    return program


def _one_by_one(dev: OpenCLDevice, program: list, inputs: list, out: Any) -> None:
    """The program's links run one at a time by the widening kernels (`Widened`), each into a
    full-size array of its dtype."""
    wide = widened(dev)
    results: list[Any] = []
    for i, (name, args, dtype) in enumerate(program):
        operands = [inputs[ref] if kind == "input" else results[ref] if kind == "link" else ref
                    for kind, ref in args]
        target = out if i == len(program) - 1 else dev.scratch(out.shape, dtype)
        kernel = wide.unary if len(operands) == 1 else wide.binary
        kernel(name, *operands, target)
        results.append(target)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), half=st.sampled_from(HALF), where=st.tuples(layouts, layouts, layouts),
       shape=st.tuples(st.integers(1, 9), st.integers(1, 40)), seed=st.integers(0, 2**32 - 1),
       edges=st.booleans())
def test_fused_half_chains_round_each_link_as_its_own_kernel(dev, data, half, where, shape,
                                                             seed, edges):
    program = data.draw(chains(half))
    rng = np.random.default_rng(seed)
    inputs = [_placed(dev, _values(rng, math.prod(shape), half, edges).reshape(shape), w)
              for w in where[:2]]
    got, expected = (_output(dev, shape, half, where[2]) for _ in range(2))
    before = dev.kernel_cache_stats()["kernels"] + dev.kernel_cache_stats()["hits"]
    dev.fused(program, inputs, got)
    after = dev.kernel_cache_stats()["kernels"] + dev.kernel_cache_stats()["hits"]
    assert after - before == 1  # one generated kernel, not the blocked default's several
    _one_by_one(dev, program, inputs, expected)
    assert _same(dev.to_host(got), dev.to_host(expected)), program


@settings(max_examples=60, deadline=None)
@given(half=st.sampled_from(HALF), name=st.sampled_from(["sum", "mean"]),
       axis=st.sampled_from([None, (0,), (1,), (0, 1), ()]), keepdims=st.booleans(),
       where=layouts, shape=st.tuples(st.integers(1, 9), st.integers(1, 300)),
       seed=st.integers(0, 2**32 - 1), edges=st.booleans())
def test_half_reductions_equal_the_widened_path(dev, half, name, axis, keepdims, where, shape,
                                                seed, edges):
    rng = np.random.default_rng(seed)
    x = _placed(dev, _values(rng, math.prod(shape), half, edges).reshape(shape), where)
    out_shape = np.sum(np.zeros(shape), axis=axis, keepdims=keepdims).shape
    got, wide = (dev.scratch(out_shape, half) for _ in range(2))
    dev.reduce(name, x, axis, keepdims, got)
    widened(dev).reduce(name, x, axis, keepdims, wide)
    assert _same(dev.to_host(got), dev.to_host(wide))


@pytest.mark.parametrize("half", HALF, ids=str)
def test_a_half_sum_accumulates_as_the_float32_kernel_does(dev, half):
    """8192, then 300 times 2**-12, then -8192: a float accumulator loses every small term
    (each is below half a float ulp of 8192) and gives 0, a double one gives 300 * 2**-12;
    a half sum must accumulate as the float32 kernel of the widened path does."""
    host = np.array([[8192.0] + [2.0**-12] * 300 + [-8192.0]], half)
    x = _placed(dev, host, "contiguous")
    got, wide = (dev.scratch((1,), half) for _ in range(2))
    dev.reduce("sum", x, (1,), False, got)
    widened(dev).reduce("sum", x, (1,), False, wide)
    assert _same(dev.to_host(got), dev.to_host(wide))
    assert dev.to_host(got)[0] == (np.float32(300 * 2.0**-12).astype(half) if dev.fp64 else 0)


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "tiled"])
def gemm_dev(request) -> OpenCLDevice:
    """A device running the plain GEMM kernel, and one running the local-memory tiles."""
    fresh = OpenCLDevice(0)
    fresh.tiled_gemm = request.param
    return fresh


@pytest.mark.parametrize("half", HALF, ids=str)
@pytest.mark.parametrize(("alpha", "beta"), [(1.0, 0.0), (-0.1, 1.0), (2.0, 0.5)])
@pytest.mark.parametrize(("m", "k", "n", "where"), [(3, 4, 5, "contiguous"),
                                                    (33, 17, 20, "transposed"),
                                                    (16, 70, 9, "strided"),
                                                    (5, 6, 40, "broadcast")])
def test_half_products_equal_the_widened_path(gemm_dev, half, alpha, beta, m, k, n, where):
    rng = np.random.default_rng(m * k * n)
    a = _placed(gemm_dev, rng.normal(0, 1, (m, k)).astype(half), where)
    b = _placed(gemm_dev, rng.normal(0, 1, (k, n)).astype(half), "transposed")
    old = rng.normal(0, 1, (m, n)).astype(half)
    got, wide = (_placed(gemm_dev, old.copy(), "offset") for _ in range(2))
    gemm_dev.gemm(a, b, got, alpha, beta)
    widened(gemm_dev).gemm(a, b, wide, alpha, beta)  # out read when beta != 0
    assert _same(gemm_dev.to_host(got), gemm_dev.to_host(wide))
    gemm_dev.matmul(a, b, got)
    widened(gemm_dev).matmul(a, b, wide)
    assert _same(gemm_dev.to_host(got), gemm_dev.to_host(wide))


@pytest.mark.parametrize("tiled", [False, True], ids=["plain", "tiled"])
@pytest.mark.parametrize("half", HALF, ids=str)
def test_half_kernels_widen_nothing_into_scratch(half, tiled, monkeypatch):
    """No raw memory is allocated by a half kernel: its operands are loaded as they are; only
    the plain product kernel widens a float16 operand, once (it reads each element n times)."""
    fresh = OpenCLDevice(0)
    fresh.tiled_gemm = tiled
    rng = np.random.default_rng(0)
    x, y = (_placed(fresh, rng.normal(0, 1, (6, 8)).astype(half), w)
            for w in ("contiguous", "transposed"))
    out = _placed(fresh, np.zeros((6, 8), half), "strided")
    square = _placed(fresh, np.ones((8, 8), half), "contiguous")
    product = _placed(fresh, np.zeros((6, 6), half), "offset")
    allocated: list[int] = []
    original = fresh._raw_alloc
    monkeypatch.setattr(fresh, "_raw_alloc", lambda n: allocated.append(n) or original(n))
    program = [("mul", (("input", 0), ("number", np.float32(0.5))), half),
               ("add", (("link", 0), ("input", 1)), half), ("tanh", (("link", 1),), half)]
    fresh.unary("exp", x, out)
    fresh.binary("mul", x, y, out)
    fresh.fused(program, [x, y], out)
    fresh.reduce("sum", x, (1,), True, out[:, :1])
    fresh.reduce("mean", x, None, False, out[0, 0])
    assert allocated == []
    fresh.matmul(x, square, out)
    fresh.gemm(x, y.T, product, 0.5, 1.0)
    once = [] if tiled or half == dtypes.BFLOAT16 else [x.size * 4, square.size * 4,
                                                        x.size * 4, y.size * 4]
    assert allocated == once
    allocated.clear()
    fresh._in_float32(lambda x, o: fresh.unary("exp", x, o), (x,), (out,))
    assert allocated == [out.size * 4]  # `_in_float32` (linear, cross_entropy): out's only


def _ties(half: np.dtype) -> np.ndarray:
    """float32 values where rounding to `half` is hardest: every finite half, the midpoints
    between neighbours (ties, which go to the even one), the floats just either side of each
    midpoint, the overflow threshold and NaN."""
    values = np.arange(65536, dtype=np.uint16).view(half)
    finite = np.sort(values[np.isfinite(values.astype(np.float32))].astype(np.float32))
    mids = (finite[:-1].astype(np.float64) + finite[1:]) / 2  # exact in float32
    mids = mids.astype(np.float32)
    near = [np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))]
    top = float(dtypes.finfo(half).max)
    edge = (top + (top - float(np.nextafter(values.dtype.type(top), 0)))) / 2  # max + ulp/2
    extra = np.array([edge, -edge, np.nextafter(np.float32(edge), 0), np.inf, np.nan, 1e-45],
                     np.float32)
    return np.concatenate([finite, mids, *near, extra])


@pytest.mark.parametrize("half", HALF, ids=str)
def test_every_half_widens_exactly_and_every_tie_rounds_to_even(dev, half):
    """The kernels' float16 and bfloat16 loads and stores (bit arithmetic, `_HALF_IO`) on every
    bit pattern and every tie, against NumPy and ml_dtypes: a cast's store, and a fused chain's
    link rounded in registers and stored as float32."""
    every = np.arange(65536, dtype=np.uint16).view(half).reshape(256, 256)
    x = _placed(dev, every, "contiguous")
    wide = dev.scratch(every.shape, np.float32)
    dev.cast(x, wide)
    assert _same(dev.to_host(wide), every.astype(np.float32))
    ties = _ties(half)
    t = _placed(dev, ties.reshape(1, -1), "contiguous")
    rounded, linked = dev.scratch(t.shape, half), dev.scratch(t.shape, np.float32)
    dev.cast(t, rounded)
    with np.errstate(over="ignore"):
        expected = ties.reshape(1, -1).astype(half)
    assert _same(dev.to_host(rounded), expected)
    program = [("copy", (("input", 0),), half), ("copy", (("link", 0),), np.float32)]
    dev.fused(program, [t], linked)
    assert _same(dev.to_host(linked), expected.astype(np.float32))


@pytest.mark.parametrize("half", HALF, ids=str)
@pytest.mark.parametrize("where", ["contiguous", "transposed", "strided"])
def test_half_cross_entropy_reads_its_operands_as_they_are(dev, half, where):
    """cross_entropy and its backward load half logits, probabilities and gradients in the
    kernel (only their outputs go through float32 scratch): the float32 kernels' results on
    the widened values, rounded once."""
    rng = np.random.default_rng(11)
    host = rng.normal(0, 3, (7, 5)).astype(half)
    labels = _placed(dev, rng.integers(0, 5, (1, 7)), "contiguous")[0]
    grad_host = rng.normal(0, 1, (1, 7)).astype(half)
    losses, probs, dlogits = (dev.scratch(shape, half) for shape in ((7,), (7, 5), (7, 5)))
    dev.cross_entropy(_placed(dev, host.copy(), where), labels, losses, probs)
    dev.cross_entropy_backward(probs, labels, _placed(dev, grad_host, "offset")[0], dlogits)
    wide = [dev.scratch(shape, np.float32) for shape in ((7,), (7, 5), (7, 5))]
    dev.cross_entropy(_placed(dev, host.astype(np.float32), where), labels, *wide[:2])
    probs_wide = _placed(dev, dev.to_host(probs).astype(np.float32), "contiguous")
    grad_wide = _placed(dev, grad_host.astype(np.float32), "offset")[0]
    dev.cross_entropy_backward(probs_wide, labels, grad_wide, wide[2])
    for got, expected in zip((losses, probs, dlogits), wide):
        assert _same(dev.to_host(got), dev.to_host(expected).astype(half))


def test_the_widened_reference_really_widens(dev, monkeypatch):
    """`Widened`, the reference of these tests, copies each half operand and output into float32
    scratch (were it to reach a half kernel, the tests above would compare it with itself)."""
    wide = widened(dev)
    allocated: list[int] = []
    original = wide._raw_alloc
    monkeypatch.setattr(wide, "_raw_alloc", lambda n: allocated.append(n) or original(n))
    x = _placed(dev, np.ones((3, 4), np.float16), "contiguous")
    out = dev.scratch((3, 4), np.float16)
    wide.unary("exp", x, out)  # x, out
    wide.binary("add", x, x, out)  # x, x, out
    wide.reduce("sum", x, None, False, out[0, 0])  # x, the sum
    wide.matmul(x, x.T, dev.scratch((3, 3), np.float16))  # x, x.T, out
    assert allocated == [48] * 6 + [4] + [48, 48, 36]
