"""The same bits on every backend: each elementwise kernel, reduction, cast and fused chain of
every device here (the CPU, OpenCL on PoCL, the naive test device, CUDA where present) against
the CPU device's, in float32, float64, float16 and bfloat16, on drawn values that include
-0.0, +0.0, NaN, +-inf, subnormals and the largest finite value.

- Exact kernels (one IEEE operation per step of their formula, Note [one formula on every
  backend] in backends/base.py: every op of backends/optable.py whose `Op.exact` holds, such
  as add, neg, relu, sqrt, abs, maximum, where, where_finite, copy and the derivative kernels
  of autograd but erf's; sub_scaled, casts between floats): the CPU's bits exactly. A NaN
  need only meet a NaN: its sign and payload are each machine's own (x86 makes 0xffc00000 for
  an invalid operation, CUDA 0x7fffffff), and no op promises them.
- Transcendental kernels (the others: exp, log, tanh, sigmoid, erf, erf_backward): within the
  ULP bounds of the device kit (`backends.testing.TRANSCENDENTAL_ULPS`, measured on PoCL, each
  constant says how, and the sweeps below hold them); NaN, infinities and the sign of zero
  exactly. The lists are read off the table, so a new op is held to the CPU's bits here
  with no new test.
- Reductions (sum, mean): their order is each backend's own, so within the error bound of a
  sum of n terms; a sum of nothing but zeros is +0.0 everywhere, NaN and infinities exactly.
- Fused chains: a chain's bits are its links' run one by one on the same device (and so the
  CPU's, where every link is exact).

The values, the comparisons and the bounds are the device kit's (backends/testing.py), which
holds any backend's device to these rules on a fixed grid of edge values (tests/
test_device_kit.py); here hypothesis draws. The examples run per test are the `max_examples` of
each (times BLOCKRT_SOAK in soak mode); `--hypothesis-show-statistics` prints them per op.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import backends
import runtime
from backends import optable
from backends.base import BINARY_KERNELS, TERNARY_KERNELS, UNARY_KERNELS, Device
from backends.testing import (
    BF16,
    F16,
    F32,
    F64,
    FLOATS,
    assert_close,
    assert_reduced,
    assert_same_bits,
    chains,
    numbers,
    run_on,
    storable,
    unfused,
    values,
)
from naive_device import NaiveDevice
from runtime import ops

CPU = backends.get_device("cpu")
#: The devices held to the CPU's bits, by name.
OTHERS: dict[str, Device] = {kind: backends.get_device(kind) for kind in backends.available()
                             if kind != "cpu"}
OTHERS["naive"] = NaiveDevice()

#: The kernels of backends/optable.py whose every step is one IEEE operation (Op.exact), and the
#: others, whose exp, log, tanh or erf is each library's own
EXACT_UNARY = [name for name in UNARY_KERNELS if optable.BY_NAME[name].exact]
EXACT_BINARY = [name for name in BINARY_KERNELS if optable.BY_NAME[name].exact]
TRANSCENDENTAL = [name for name in UNARY_KERNELS if not optable.BY_NAME[name].exact]
INEXACT_BINARY = [name for name in BINARY_KERNELS if not optable.BY_NAME[name].exact]
# NOTE: the bounds (TRANSCENDENTAL_ULPS, SIGMOID_ULPS_OF_HALF, REDUCTION_ROUNDINGS), the values
# drawn and the comparisons are the device kit's (backends/testing.py), which holds a backend's
# device to the same rules


def _run(device: Device, call: Any, operands: list[Any], shape: tuple, dtype: np.dtype,
         ) -> np.ndarray:
    return run_on(device, call, operands, shape, dtype)


def _each_device(call: Any, operands: list[Any], shape: tuple, dtype: np.dtype,
                 skip: tuple[str, ...] = ()) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The CPU's result and every other device's (but those named in `skip`, and those that
    store no operand's dtype: CUDA's bfloat16 before CuPy 14)."""
    want = _run(CPU, call, operands, shape, dtype)
    used = [dtype, *(x.dtype for x in operands if isinstance(x, np.ndarray))]
    return want, {name: _run(dev, call, operands, shape, dtype) for name, dev in OTHERS.items()
                  if name not in skip and all(storable(dev, d) for d in used)}


LENGTHS = st.integers(1, 24)


# ---------------------------------------------------------------------- elementwise kernels
@pytest.mark.parametrize("name", EXACT_UNARY + TRANSCENDENTAL)
@settings(max_examples=100, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(FLOATS))
def test_unary_kernels_give_the_cpus_bits(name, data, dtype):
    x = data.draw(values(dtype, data.draw(LENGTHS)), label="x")
    want, got = _each_device(lambda d, x, out: d.unary(name, x, out), [x], x.shape, dtype)
    for device, result in got.items():
        what = f"{name}({dtype}) on {device}"
        if name in TRANSCENDENTAL:
            assert_close(name, result, want, what, [x])
        else:
            assert_same_bits(result, want, what)


@pytest.mark.parametrize("name", EXACT_BINARY)
@settings(max_examples=100, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(FLOATS),
       number=st.sampled_from([None, "a", "b"]))
def test_binary_kernels_give_the_cpus_bits(name, data, dtype, number):
    """Two arrays, or an array and a number (as the ops pass it, in the compute dtype)."""
    n = data.draw(LENGTHS)
    a = data.draw(values(dtype, n), label="a")
    b = data.draw(values(dtype, n), label="b")
    if number == "a":
        a = data.draw(numbers(dtype), label="a")
    elif number == "b":
        b = data.draw(numbers(dtype), label="b")
    want, got = _each_device(lambda d, a, b, out: d.binary(name, a, b, out), [a, b], (n,), dtype)
    for device, result in got.items():
        assert_same_bits(result, want, f"{name}({dtype}) on {device}")


@pytest.mark.parametrize("name", INEXACT_BINARY)
@settings(max_examples=100, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(FLOATS))
def test_inexact_binary_kernels_agree_within_their_bounds(name, data, dtype):
    n = data.draw(LENGTHS)
    a = data.draw(values(dtype, n), label="a")
    b = data.draw(values(dtype, n), label="b")
    want, got = _each_device(lambda d, a, b, out: d.binary(name, a, b, out), [a, b], (n,), dtype)
    for device, result in got.items():
        assert_close(name, result, want, f"{name}({dtype}) on {device}", [a, b])


@pytest.mark.parametrize("dtype", [np.dtype("float32"), np.dtype("float64")], ids=str)
def test_erf_backward_of_a_huge_g_where_exp_is_subnormal(dtype):
    """exp(-x * x) subnormal times a g near the largest float: the result is normal, exp's
    error is a share of the subnormal spacing (hypothesis found g = 1.8e308, x = 26.6 4 ULPs
    apart on PoCL); within the bound, on every device, and the same without the huge g."""
    big, x = (3.0e38, 9.4) if dtype == np.float32 else (1.79769313e308, 26.63671875)
    a = np.array([big, 1.0, -big], dtype)
    b = np.array([x, 1.0, x], dtype)
    want, got = _each_device(lambda d, a, b, out: d.binary("erf_backward", a, b, out), [a, b],
                             (3,), dtype)
    assert np.isfinite(want).all() and want[0] > 0 and want[2] < 0
    for device, result in got.items():
        assert_close("erf_backward", result, want, f"erf_backward({dtype}) on {device}", [a, b])


@pytest.mark.parametrize("name", TERNARY_KERNELS)
@settings(max_examples=100, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(FLOATS), number=st.sampled_from([None, 1, 2]))
def test_ternary_kernels_give_the_cpus_bits(name, data, dtype, number):
    """Three arrays (a bool condition first where the op takes one), or a number among the
    float operands."""
    n = data.draw(LENGTHS)
    kinds = optable.BY_NAME[name].operand_kinds
    operands: list[Any] = [
        np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), np.bool_)
        if kind == optable.BOOL else data.draw(values(dtype, n)) for kind in kinds]
    if number is not None and kinds[number] == optable.FLOAT:
        operands[number] = data.draw(numbers(dtype), label="number")
    assert optable.BY_NAME[name].exact
    want, got = _each_device(lambda d, *v: d.ternary(name, *v), operands, (n,), dtype)
    for device, result in got.items():
        assert_same_bits(result, want, f"{name}({dtype}) on {device}")


@settings(max_examples=100, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(FLOATS))
def test_sub_scaled_gives_the_cpus_bits_and_its_two_kernels(data, dtype):
    """a - scale * b with the product rounded first (Device.sub_scaled): on every device the
    bits of mul then sub on the CPU."""
    n = data.draw(LENGTHS)
    a, b = data.draw(values(dtype, n), label="a"), data.draw(values(dtype, n), label="b")
    scale = data.draw(numbers(dtype), label="scale")
    product = _run(CPU, lambda d, b, out: d.binary("mul", b, scale, out), [b], (n,), dtype)
    two = _run(CPU, lambda d, a, p, out: d.binary("sub", a, p, out), [a, product], (n,), dtype)
    want, got = _each_device(lambda d, a, b, out: d.sub_scaled(a, b, scale, out), [a, b],
                             (n,), dtype)
    assert_same_bits(want, two, f"sub_scaled({dtype}) on cpu against mul and sub")
    for device, result in got.items():
        assert_same_bits(result, want, f"sub_scaled({dtype}) on {device}")


@settings(max_examples=100, deadline=None)
@given(data=st.data(), src=st.sampled_from(FLOATS), dst=st.sampled_from(FLOATS))
def test_casts_between_floats_give_the_cpus_bits(data, src, dst):
    """IEEE round to nearest even (float64 to bfloat16 through float32, as ml_dtypes)."""
    x = data.draw(values(src, data.draw(LENGTHS)), label="x")
    want, got = _each_device(lambda d, x, out: d.cast(x, out), [x], x.shape, dst)
    with np.errstate(all="ignore"):
        assert_same_bits(want, x.astype(dst), f"cast {src} -> {dst} on cpu against NumPy")
    for device, result in got.items():
        assert_same_bits(result, want, f"cast {src} -> {dst} on {device}")


# ---------------------------------------------------------------------- reductions
@pytest.mark.parametrize("name", ["sum", "mean"])
@settings(max_examples=100, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(FLOATS), rows=st.integers(0, 6),
       cols=st.integers(1, 40), axis=st.sampled_from([None, (0,), (1,)]))
def test_reductions_agree_within_the_bound_of_their_order(name, data, dtype, rows, cols, axis):
    """Finite magnitudes stay below max / (2 n), so no order overflows; zeros, subnormals, NaN
    and infinities are drawn too. An empty reduction is +0 (sum) or NaN (mean)."""
    n_all = rows * cols
    limit = float(ml_dtypes.finfo(dtype).max) / (2 * max(n_all, 1))
    x = data.draw(values(dtype, n_all, finite_below=limit), label="x").reshape(rows, cols)
    shape = np.add.reduce(np.zeros((rows, cols)), axis=axis).shape
    want, got = _each_device(lambda d, x, out: d.reduce(name, x, axis, False, out), [x], shape,
                             dtype)
    for device, result in got.items():
        assert_reduced(name, x, axis, False, result, want,
                       f"{name}({dtype}, axis={axis}) of {x.shape} on {device}")


# ---------------------------------------------------------------------- fused chains
@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_a_fused_chain_gives_its_links_bits_on_every_device(data):
    """Device.fused (one generated kernel on OpenCL and CUDA, row blocks elsewhere) against
    the same links unfused on the same device; and, where every link is exact, against the
    CPU's."""
    n = data.draw(LENGTHS)
    program, inputs, dtype = data.draw(chains(n), label="chain")
    exact = all(optable.BY_NAME[name].exact for name, _, _ in program)
    want = None
    used = [x.dtype for x in inputs] + [d for _, _, d in program]
    for device in [CPU, *(d for d in OTHERS.values() if all(storable(d, u) for u in used))]:
        fused = _run(device, lambda d, *views: d.fused(program, list(views[:-1]), views[-1]),
                     list(inputs), (n,), dtype)
        links = _run(device, lambda d, *views: unfused(d, program, list(views[:-1]),
                                                       views[-1]), list(inputs), (n,), dtype)
        assert_same_bits(fused, links, f"fused chain {program} on {device.name}")
        if want is None:
            want = links
        elif exact:
            assert_same_bits(fused, want, f"fused chain {program} on {device.name} against "
                                          f"the CPU")


# ---------------------------------------------------------------------- the bounds themselves
def _every(dtype: np.dtype) -> np.ndarray:
    return np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(dtype)


@pytest.mark.parametrize("name", TRANSCENDENTAL)
@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_transcendental_bounds_over_every_half_value(name, dtype):
    """Every float16 and bfloat16 value through each device's exp, log, tanh and sigmoid:
    within the kit's bounds (which these sweeps measured on PoCL)."""
    x = _every(dtype)
    want, got = _each_device(lambda d, x, out: d.unary(name, x, out), [x], x.shape, dtype)
    for device, result in got.items():
        assert_close(name, result, want, f"{name}({dtype}) on {device}, every value", [x])


@pytest.mark.slow
@pytest.mark.parametrize("name", TRANSCENDENTAL)
@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
def test_transcendental_bounds_over_sampled_values(name, dtype):
    """2**20 random bit patterns and 2**20 ordinary numbers through each device: within the
    kit's bounds."""
    rng = np.random.default_rng(27)
    k = dtype.itemsize
    patterns = rng.integers(0, 2**(8 * k), 2**20, dtype=np.uint64).astype(f"u{k}").view(dtype)
    x = np.concatenate([patterns, (rng.standard_normal(2**20) * 10).astype(dtype)])
    # NOTE: not the naive device: element by element in Python, minutes, and NumPy's bits
    want, got = _each_device(lambda d, x, out: d.unary(name, x, out), [x], x.shape, dtype,
                             skip=("naive",))
    for device, result in got.items():
        assert_close(name, result, want, f"{name}({dtype}) on {device}, sampled", [x])


# ---------------------------------------------------------------------- the CPU's fast path
PUBLIC = [name for name in UNARY_KERNELS + BINARY_KERNELS + TERNARY_KERNELS
          if name in ops.__all__]


@pytest.mark.parametrize("name", PUBLIC)
@settings(max_examples=30, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(FLOATS), number=st.booleans())
def test_the_cpus_eager_ops_give_its_device_kernels_bits(name, data, dtype, number):
    """runtime.ops on the CPU run the device's `fast_kernels` through the C dispatch
    (runtime/fastpath.py), not `Device.unary` / `binary` / `ternary`: the same bits, numbers
    included."""
    n = data.draw(LENGTHS)
    kinds = optable.BY_NAME[name].operand_kinds
    host: list[Any] = [
        np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), np.bool_)
        if kind == optable.BOOL else data.draw(values(dtype, n)) for kind in kinds]
    if number and len(kinds) > 1:
        host[-1] = data.draw(numbers(dtype), label="number")
    want = _run(CPU, lambda d, *v: d.elementwise(name, v[:-1], v[-1]), host, (n,), dtype)
    got = getattr(ops, name)(*(runtime.tensor(x) if isinstance(x, np.ndarray) else float(x)
                               for x in host))
    assert_same_bits(got.numpy(), want, f"ops.{name}({dtype}) on the CPU")
