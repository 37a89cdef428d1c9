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
  ULP bounds below, measured on PoCL (each constant says how); NaN, infinities and the sign of
  zero exactly. The lists are read off the table, so a new op is held to the CPU's bits here
  with no new test.
- Reductions (sum, mean): their order is each backend's own, so within the error bound of a
  sum of n terms; a sum of nothing but zeros is +0.0 everywhere, NaN and infinities exactly.
- Fused chains: a chain's bits are its links' run one by one on the same device (and so the
  CPU's, where every link is exact).

The examples run per test are the `max_examples` of each (times BLOCKRT_SOAK in soak mode);
`--hypothesis-show-statistics` prints them per op.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import backends
import runtime
from backends import optable
from backends.base import BINARY_KERNELS, TERNARY_KERNELS, UNARY_KERNELS, Device
from naive_device import NaiveDevice
from runtime import dtypes, ops

BF16 = dtypes.BFLOAT16
F16, F32, F64 = np.dtype("float16"), np.dtype("float32"), np.dtype("float64")
FLOATS = [F32, F64, F16, BF16]

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

#: ULPs (of the result's dtype) between a backend's exp, log or tanh and the CPU's (NumPy's
#: float32 / float64 loops), the largest seen on PoCL 3.0 (LLVM 14, SLEEF; pthread on an AMD
#: EPYC, znver3) against the CPU device: over every float32 value, once, by a sweep of all
#: 2**32 bit patterns (exp 3 at 0.34793907, log 4 at 0.7789028, tanh 2: neither libm rounds
#: correctly, and OpenCL 1.2 allows 3, 3 and 5 ULPs from the exact result); over every float16
#: and bfloat16 value, at every run, by `test_transcendental_bounds_over_every_half_value` (1:
#: float32 results a few ULPs apart can round to neighbouring halves); over 10**8 random and
#: ordinary float64 values, once (1 each; `test_transcendental_bounds_over_sampled_values`,
#: marked slow, draws 2**21 like them). CUDA's are not measured (no GPU here); its libm is
#: also a few ULPs from the exact result, so a CUDA run may need entries of its own.
#: erf (the CPU's is C's erf in float64, rounded once: backends/_erf.py): against PoCL's over
#: 2**23 random float32 bit patterns, as many ordinary values and a ramp over [-6, 6], 2 (at a
#: subnormal); over 2**21 of each in float64, 1; every half value, 1 (float16) and 0.
#: erf_backward, g * (exp(-x*x) * 2 / sqrt(pi)): exp's bound and one ULP for each of the two
#: products that round after it.
TRANSCENDENTAL_ULPS = {
    ("exp", F32): 3, ("log", F32): 4, ("tanh", F32): 2, ("erf", F32): 2,
    ("exp", F64): 1, ("log", F64): 1, ("tanh", F64): 1, ("erf", F64): 1,
    **{(name, half): 1 for name in ("exp", "log", "tanh", "erf") for half in (F16, BF16)},
}
TRANSCENDENTAL_ULPS.update({("erf_backward", dtype): TRANSCENDENTAL_ULPS["exp", dtype] + 2
                            for dtype in FLOATS})
#: sigmoid is 0.5 * tanh(0.5 x) + 0.5: tanh's error near +-1 (a few ULPs of 1) survives as an
#: absolute error, huge in ULPs of a result near 0 (the CPU's sigmoid(-20) is 0.0 where NumPy's
#: tanh is -1, PoCL's 2.98e-8). So its bound is absolute: this many ULPs of 0.5 in the compute
#: dtype (float32 for the halves), plus one ULP of the result's dtype for the final rounding;
#: the largest seen on PoCL over the same sweeps: 2 (float32, 1.19e-7), 1 (float64).
SIGMOID_ULPS_OF_HALF = 2
#: A reduction's order is each backend's own (NumPy sums pairwise, PoCL in double, the naive
#: device one element after another): two sums of n terms differ by at most twice the bound of
#: one, 2 (n - 1) u sum|x| (u the unit roundoff of the compute dtype), plus one ULP of the
#: result's dtype for its final rounding (and mean's division).
REDUCTION_ROUNDINGS = 2


# ---------------------------------------------------------------------- values
def _finfo(dtype: np.dtype) -> Any:
    return dtypes.finfo(dtype)


def _edges(dtype: np.dtype) -> list[float]:
    """The values every kind of kernel trips on, as Python floats."""
    info = _finfo(dtype)
    tiny, sub, big = float(info.tiny), float(info.smallest_subnormal), float(info.max)
    return [-0.0, 0.0, math.nan, math.inf, -math.inf, sub, -sub, tiny - sub, tiny, -tiny, big,
            -big, 1.0, -1.0, 0.5, 2.0, 20.0, -20.0]


def _bits_of(value: float, dtype: np.dtype) -> int:
    with np.errstate(all="ignore"):
        return int(np.array([value]).astype(dtype).view(f"u{dtype.itemsize}")[0])


@st.composite
def values(draw: Any, dtype: np.dtype, n: int, finite_below: float | None = None) -> np.ndarray:
    """n values of `dtype`: edge values, ordinary numbers and random bit patterns (NaN with
    payloads, subnormals, huge and tiny magnitudes). `finite_below`: only finite magnitudes
    below it, with zeros, subnormals, NaN and infinities (a reduction's operands)."""
    bits = 8 * dtype.itemsize
    edges = _edges(dtype)
    moderate = st.floats(-30, 30, width=64)
    if finite_below is not None:
        edges = [e for e in edges if not math.isfinite(e) or abs(e) < finite_below]
        moderate = st.floats(-finite_below / 2, finite_below / 2, width=64)
        pattern = st.integers(0, 2**bits - 1).filter(
            lambda b: _magnitude_below(b, dtype, finite_below))
    else:
        pattern = st.integers(0, 2**bits - 1)
    element = st.one_of(st.sampled_from(edges).map(lambda v: _bits_of(v, dtype)),
                        moderate.map(lambda v: _bits_of(v, dtype)), pattern)
    raw = draw(st.lists(element, min_size=n, max_size=n))
    return np.array(raw, f"u{dtype.itemsize}").view(dtype)


def _magnitude_below(pattern: int, dtype: np.dtype, limit: float) -> bool:
    value = float(np.array([pattern], f"u{dtype.itemsize}").view(dtype)[0])
    return not math.isfinite(value) or abs(value) < limit


def _numbers(dtype: np.dtype) -> Any:
    """A number operand as the ops pass it (`ops._scalar`: the compute dtype, float32 for the
    two-byte floats): edge values and ordinary ones."""
    compute = F64 if dtype == F64 else F32
    return st.one_of(st.sampled_from(_edges(compute)), st.floats(-30, 30, width=64)).map(
        lambda v: np.array([v]).astype(compute)[0])


# ---------------------------------------------------------------------- comparisons
def _nan(x: np.ndarray) -> np.ndarray:
    return np.isnan(_wide(x))


def _wide(x: np.ndarray) -> np.ndarray:
    """x as float64 (exactly), without NumPy's warnings for NaN."""
    with np.errstate(all="ignore"):
        return x.astype(np.float64)


def _ordered(x: np.ndarray) -> np.ndarray:
    """Each value's place on the line of its dtype's values (-0 and +0 both at 0), as int64."""
    k = x.dtype.itemsize
    raw = x.view(f"u{k}").astype(np.uint64)
    sign = (raw >> np.uint64(8 * k - 1)).astype(bool)
    magnitude = (raw & np.uint64(2**(8 * k - 1) - 1)).astype(np.int64)
    return np.where(sign, -magnitude, magnitude)


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Equal bits, but that a NaN need only meet a NaN."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    nan = _nan(want)
    bits = f"u{want.dtype.itemsize}"
    same = (got.view(bits) == want.view(bits)) | (nan & _nan(got))
    if not same.all():
        i = int(np.flatnonzero(~same)[0])
        raise AssertionError(f"{what}: element {i} is {got[i]!r} ({int(got.view(bits)[i]):#x}), "
                             f"the CPU's {want[i]!r} ({int(want.view(bits)[i]):#x})")


def _compute(dtype: np.dtype) -> np.dtype:
    return F64 if dtype == F64 else F32


def _ulp(x: np.ndarray) -> np.ndarray:
    """Each element's ULP in its own dtype (the gap to the next larger magnitude), as float64
    (ml_dtypes' bfloat16 has no np.spacing)."""
    k = x.dtype.itemsize
    unsigned = np.dtype(f"u{k}")
    magnitude = x.view(unsigned) & unsigned.type(2**(8 * k - 1) - 1)
    with np.errstate(all="ignore"):
        up = (magnitude + unsigned.type(1)).view(x.dtype).astype(np.float64)
        return np.abs(up - np.abs(x.astype(np.float64)))


def assert_close(name: str, got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Within the stated bound of a transcendental kernel; NaN where the CPU has NaN, and a
    zero where both give one of the CPU's sign."""
    dtype = want.dtype
    nan = _nan(want)
    assert np.array_equal(nan, _nan(got)), f"{what}: NaN at {np.flatnonzero(nan != _nan(got))}"
    wide_got, wide_want = _wide(got), _wide(want)
    if name == "sigmoid":
        half_ulp = float(np.spacing(_compute(dtype).type(0.5)))
        bound = SIGMOID_ULPS_OF_HALF * half_ulp + _ulp(want)
        with np.errstate(invalid="ignore"):
            far = ~nan & ~(np.abs(wide_got - wide_want) <= bound)
    else:
        far = ~nan & (np.abs(_ordered(got) - _ordered(want)) > TRANSCENDENTAL_ULPS[name, dtype])
    zeros = (wide_got == 0) & (wide_want == 0)
    far |= zeros & (np.signbit(wide_got) != np.signbit(wide_want))
    if far.any():
        i = int(np.flatnonzero(far)[0])
        raise AssertionError(f"{what}: element {i} is {got[i]!r}, the CPU's {want[i]!r}, "
                             f"{abs(int(_ordered(got)[i] - _ordered(want)[i]))} ULPs apart")


# ---------------------------------------------------------------------- running kernels
def _to(device: Device, host: np.ndarray) -> Any:
    """A C-order native view on `device` holding `host`, 0-d ones too (helpers.to_device makes
    those 1-d)."""
    host = np.ascontiguousarray(host).reshape(host.shape)
    raw = device.raw_alloc(max(host.nbytes, 1))
    device.copyin(raw, 0, host)
    return device.array_view(raw, 0, host.shape, host.dtype, host.strides)


def _run(device: Device, call: Any, operands: list[Any], shape: tuple, dtype: np.dtype,
         ) -> np.ndarray:
    """call(device, *operands on the device, out) into a new `dtype` array of `shape`; arrays
    among `operands` are copied to the device, numbers pass as they are."""
    views = [_to(device, x) if isinstance(x, np.ndarray) else x for x in operands]
    out = _to(device, np.zeros(shape, dtype))
    with np.errstate(all="ignore"):
        call(device, *views, out)
    return device.to_host(out)


def _each_device(call: Any, operands: list[Any], shape: tuple, dtype: np.dtype,
                 skip: tuple[str, ...] = ()) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The CPU's result and every other device's (but those named in `skip`)."""
    want = _run(CPU, call, operands, shape, dtype)
    used = [dtype, *(x.dtype for x in operands if isinstance(x, np.ndarray))]
    return want, {name: _run(dev, call, operands, shape, dtype) for name, dev in OTHERS.items()
                  if name not in skip and _stores(dev, used)}


def _stores(device: Device, used: list[np.dtype]) -> bool:
    """False for bfloat16 on a CUDA device whose CuPy has none (older than 14)."""
    if BF16 not in used or not device.name.startswith("cuda"):
        return True
    from backends.cuda import has_bfloat16

    return has_bfloat16()


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
            assert_close(name, result, want, what)
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
        a = data.draw(_numbers(dtype), label="a")
    elif number == "b":
        b = data.draw(_numbers(dtype), label="b")
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
        assert_close(name, result, want, f"{name}({dtype}) on {device}")


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
        operands[number] = data.draw(_numbers(dtype), label="number")
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
    scale = data.draw(_numbers(dtype), label="scale")
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
    limit = float(_finfo(dtype).max) / (2 * max(n_all, 1))
    x = data.draw(values(dtype, n_all, finite_below=limit), label="x").reshape(rows, cols)
    shape = np.add.reduce(np.zeros((rows, cols)), axis=axis).shape
    want, got = _each_device(lambda d, x, out: d.reduce(name, x, axis, False, out), [x], shape,
                             dtype)
    wide = _wide(x)
    with np.errstate(all="ignore"):
        count = x.size if axis is None else x.shape[axis[0]]
        magnitude = np.add.reduce(np.where(np.isfinite(wide), np.abs(wide), 0), axis=axis)
        if name == "mean":
            magnitude = magnitude / max(count, 1)
    u = float(np.finfo(_compute(dtype)).eps) / 2
    bound = REDUCTION_ROUNDINGS * max(count - 1, 0) * u * magnitude + _ulp(want)
    zeros = np.add.reduce(wide != 0, axis=axis) == 0  # NOTE: every term +-0 (or none)
    for device, result in got.items():
        what = f"{name}({dtype}, axis={axis}) of {x.shape} on {device}"
        nan = _nan(want)
        assert np.array_equal(nan, _nan(result)), what
        assert np.array_equal(np.isinf(_wide(want)), np.isinf(_wide(result))), what
        exact = zeros | np.isinf(_wide(want))
        assert_same_bits(np.where(exact, result, want), want, f"{what} (zeros, infinities)")
        with np.errstate(all="ignore"):
            error = np.abs(_wide(result) - _wide(want))
        far = ~nan & ~exact & (error > bound)
        assert not far.any(), f"{what}: {result[far]} against {want[far]}, bound {bound[far]}"


# ---------------------------------------------------------------------- fused chains
@st.composite
def chains(draw: Any, n: int) -> tuple[list, list[np.ndarray], np.dtype]:
    """A fused program over 1-3 inputs of length n, with its inputs: every link an elementwise
    kernel whose arrays have its dtype (or float32 under a two-byte link, as the ops pass
    them), numbers in the compute dtype. All float64, or float32 and the halves mixed."""
    wide = draw(st.booleans())
    kinds = [F64] if wide else [F32, F16, BF16]
    inputs = [draw(values(d, n)) for d in draw(st.lists(st.sampled_from(kinds), min_size=1,
                                                        max_size=3))]
    program: list = []
    for _ in range(draw(st.integers(1, 6))):
        dtype = draw(st.sampled_from(kinds))
        takes = {dtype, F32} if dtype in (F16, BF16) else {dtype}
        arrays = [("input", k) for k, x in enumerate(inputs) if x.dtype in takes]
        arrays += [("link", j) for j, (_, _, d) in enumerate(program) if d in takes]
        if not arrays:
            continue
        name = draw(st.sampled_from(UNARY_KERNELS + BINARY_KERNELS))
        first = draw(st.sampled_from(arrays))
        if name in UNARY_KERNELS:
            if name == "copy" and (first[0] == "input" and inputs[first[1]].dtype != dtype
                                   or first[0] == "link" and program[first[1]][2] != dtype):
                continue  # NOTE: copy moves bits: its operand has its dtype
            args: tuple = (first,)
        else:
            other = draw(st.one_of(st.sampled_from(arrays),
                                   _numbers(dtype).map(lambda v: ("number", float(v)))))
            args = (first, other) if draw(st.booleans()) else (other, first)
        program.append((name, args, dtype))
    if not program:
        program = [("neg", (("input", 0),), inputs[0].dtype)]
    return program, inputs, program[-1][2]


def _unfused(device: Device, program: list, inputs: list, out: Any) -> None:
    """The chain's links one by one through the device's own kernels, each into a scratch
    array of its dtype (the last into out)."""
    results: list[Any] = []
    for i, (name, args, dtype) in enumerate(program):
        operands = [inputs[ref] if kind == "input" else results[ref] if kind == "link" else ref
                    for kind, ref in args]
        target = out if i == len(program) - 1 else device.scratch(tuple(out.shape), dtype)
        if len(operands) == 1:
            device.unary(name, operands[0], target)
        else:
            device.binary(name, operands[0], operands[1], target)
        results.append(target)


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
    for device in [CPU, *(d for d in OTHERS.values() if _stores(d, used))]:
        fused = _run(device, lambda d, *views: d.fused(program, list(views[:-1]), views[-1]),
                     list(inputs), (n,), dtype)
        unfused = _run(device, lambda d, *views: _unfused(d, program, list(views[:-1]),
                                                          views[-1]), list(inputs), (n,), dtype)
        assert_same_bits(fused, unfused, f"fused chain {program} on {device.name}")
        if want is None:
            want = unfused
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
    within the bounds above (which these sweeps measured on PoCL)."""
    x = _every(dtype)
    want, got = _each_device(lambda d, x, out: d.unary(name, x, out), [x], x.shape, dtype)
    for device, result in got.items():
        assert_close(name, result, want, f"{name}({dtype}) on {device}, every value")


@pytest.mark.slow
@pytest.mark.parametrize("name", TRANSCENDENTAL)
@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
def test_transcendental_bounds_over_sampled_values(name, dtype):
    """2**20 random bit patterns and 2**20 ordinary numbers through each device: within the
    bounds above."""
    rng = np.random.default_rng(27)
    k = dtype.itemsize
    patterns = rng.integers(0, 2**(8 * k), 2**20, dtype=np.uint64).astype(f"u{k}").view(dtype)
    x = np.concatenate([patterns, (rng.standard_normal(2**20) * 10).astype(dtype)])
    # NOTE: not the naive device: element by element in Python, minutes, and NumPy's bits
    want, got = _each_device(lambda d, x, out: d.unary(name, x, out), [x], x.shape, dtype,
                             skip=("naive",))
    for device, result in got.items():
        assert_close(name, result, want, f"{name}({dtype}) on {device}, sampled")


# ---------------------------------------------------------------------- the CPU's fast path
PUBLIC = [name for name in UNARY_KERNELS + BINARY_KERNELS + TERNARY_KERNELS
          if name in ops.__all__]


@pytest.mark.parametrize("name", PUBLIC)
@settings(max_examples=30, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(FLOATS), number=st.booleans())
def test_the_cpus_eager_ops_give_its_device_kernels_bits(name, data, dtype, number):
    """runtime.ops on the CPU run the device's `_fast_kernels` through the C dispatch
    (runtime/fastpath.py), not `Device.unary` / `binary` / `ternary`: the same bits, numbers
    included."""
    n = data.draw(LENGTHS)
    kinds = optable.BY_NAME[name].operand_kinds
    host: list[Any] = [
        np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), np.bool_)
        if kind == optable.BOOL else data.draw(values(dtype, n)) for kind in kinds]
    if number and len(kinds) > 1:
        host[-1] = data.draw(_numbers(dtype), label="number")
    want = _run(CPU, lambda d, *v: d.elementwise(name, v[:-1], v[-1]), host, (n,), dtype)
    got = getattr(ops, name)(*(runtime.tensor(x) if isinstance(x, np.ndarray) else float(x)
                               for x in host))
    assert_same_bits(got.numpy(), want, f"ops.{name}({dtype}) on the CPU")
