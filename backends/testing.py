"""A conformance kit for backend authors: every rule a `Device` keeps, checked on one device.

Each rule is a function `(device, examples=...) -> None` in `RULES`, by name. It drives the
device through its public methods (and, for a capability's claims, through the claimed hooks
themselves), compares what it computes with the CPU device's results on the same operands,
and raises AssertionError whose message starts with the rule's name in brackets:
"[views] TinyDevice tiny: a (3, 2) float32 view at byte offset 24 ...". The kernels are held to
the CPU's bits where every step of their formula is one IEEE operation (`optable.Op.exact`),
and within the bounds below where a library's exp, log, tanh or erf takes part; products and
reductions, whose order is each backend's own, within the error bound of that order.

Usage (hypothesis and pytest are test dependencies, `pip install blockrt[test]`)::

    from backends import testing

    testing.check_device(MyDevice())       # every rule, in order; the first broken one raises

    # or one test per rule, in a module pytest collects
    @pytest.mark.parametrize("rule", testing.RULES)
    def test_my_device_keeps(rule):
        testing.RULES[rule](MyDevice(), examples=50)

`examples` is how many examples each rule that draws with hypothesis runs; the others sweep a
fixed grid: every pair of the values kernels trip on (-0.0, +0.0, NaN, +-inf, subnormals, the
largest finite value, ...) and seeded random bit patterns, in every dtype the device computes.
The kit imports nothing of blockrt's but `backends` (tests/test_layers.py holds it to that).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends import optable
from backends.base import (
    BINARY_KERNELS,
    HALVES,
    REDUCE_KERNELS,
    TERNARY_KERNELS,
    UNARY_KERNELS,
    Capabilities,
    Device,
    numpy_col2im,
    numpy_im2col,
    numpy_max_pool2d,
    numpy_max_pool2d_backward,
)

__all__ = ["BF16", "CROSS_ENTROPY_ULPS", "F16", "F32", "F64", "FLOATS", "GELU_TANH_ULPS_OF_ONE",
           "GELU_ULPS_OF_ONE", "REDUCTION_ROUNDINGS", "RULES", "SIGMOID_ULPS_OF_HALF", "STORED",
           "TRANSCENDENTAL_ULPS",
           "assert_close", "assert_reduced", "assert_same_bits", "chains", "check_device",
           "check_max_pool", "edges",
           "numbers", "run_on", "storable", "to_device", "unfused", "values"]

BF16 = np.dtype(ml_dtypes.bfloat16)
F16, F32, F64 = np.dtype("float16"), np.dtype("float32"), np.dtype("float64")
#: The float dtypes, in the order the kit walks them.
FLOATS = (F32, F64, F16, BF16)
#: Every dtype a view, a copy and the copy kernel take.
STORED = (np.dtype(np.bool_), *(np.dtype(f"{k}{n}") for k in ("int", "uint")
                                for n in (8, 16, 32, 64)), *FLOATS)

# ---------------------------------------------------------------------- the bounds
#: ULPs (of the result's dtype) between a backend's exp, log or tanh and the CPU's (NumPy's
#: float32 / float64 loops), the largest seen on PoCL 3.0 (LLVM 14, SLEEF; pthread on an AMD
#: EPYC, znver3) against the CPU device: over every float32 value, once, by a sweep of all
#: 2**32 bit patterns (exp 3 at 0.34793907, log 4 at 0.7789028, tanh 2: neither libm rounds
#: correctly, and OpenCL 1.2 allows 3, 3 and 5 ULPs from the exact result); over every float16
#: and bfloat16 value, at every run, by tests/test_bits.py's
#: `test_transcendental_bounds_over_every_half_value` (1: float32 results a few ULPs apart can
#: round to neighbouring halves); over 10**8 random and ordinary float64 values, once (1 each;
#: `test_transcendental_bounds_over_sampled_values`, marked slow, draws 2**21 like them).
#: CUDA's are not measured (no GPU here); its libm is also a few ULPs from the exact result,
#: so a CUDA run may need entries of its own.
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
#: gelu, x * 0.5 * (1 + erf(x / sqrt 2)), and its gradient, g * (0.5 * (1 + erf(x / sqrt 2)) +
#: x * exp(-x * x / 2) / sqrt(2 pi)), add 1 to erf: for x < 0 the sum cancels, and erf's error
#: (a few ULPs of 1) survives as an absolute error, huge in ULPs of a result near 0 (as
#: sigmoid's). So their bound is absolute and reads the operands: this many ULPs of 1 in the
#: compute dtype times what multiplies the sum (0.5 |x|; |g| (0.5 + |x| / sqrt(2 pi)) for the
#: gradient, exp's error on its second term included), plus two ULPs of the result's dtype for
#: the roundings after it.
GELU_ULPS_OF_ONE = 4
#: gelu_tanh, 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x**3), and its gradient
#: cancel as gelu's do, so their bound reads the operands as gelu's: this many ULPs of 1 (tanh's
#: error, and u's five roundings, which move tanh by at most 0.45 of u's relative error:
#: u sech(u)**2 <= 0.45) times 0.5 |x| (|g| (0.5 + sqrt(2 / pi) |x| (1 + 3 * 0.044715 x**2))
#: for the gradient, where t = tanh(u) also enters through 1 - t**2), plus two ULPs of the
#: result's dtype.
GELU_TANH_ULPS_OF_ONE = 8
#: A reduction's order is each backend's own (NumPy sums pairwise, PoCL in double, the naive
#: device one element after another): two sums of n terms differ by at most twice the bound of
#: one, 2 (n - 1) u sum|x| (u the unit roundoff of the compute dtype), plus one ULP of the
#: result's dtype for its final rounding (and mean's division). A product's dot products are
#: such sums of the products a[i, k] * b[k, j].
REDUCTION_ROUNDINGS = 2
#: cross_entropy and its gradient: softmax's exp and log and its sum over a row, each within
#: the bounds above, stack; this many ULPs of the compute dtype, relative to the row's largest
#: magnitude, bound the difference (PoCL: 9 for float32 over rows of 12 classes).
CROSS_ENTROPY_ULPS = 64


# ---------------------------------------------------------------------- values
def _finfo(dtype: np.dtype) -> Any:
    return ml_dtypes.finfo(dtype)


def edges(dtype: np.dtype) -> list[float]:
    """The values every kind of kernel trips on, as Python floats: signed zeros, NaN,
    infinities, subnormals, the smallest normal and largest finite value, and ordinary ones."""
    info = _finfo(dtype)
    tiny, sub, big = float(info.tiny), float(info.smallest_subnormal), float(info.max)
    return [-0.0, 0.0, math.nan, math.inf, -math.inf, sub, -sub, tiny - sub, tiny, -tiny, big,
            -big, 1.0, -1.0, 0.5, 2.0, 20.0, -20.0]


def _bits_of(value: float, dtype: np.dtype) -> int:
    with np.errstate(all="ignore"):
        return int(np.array([value]).astype(dtype).view(f"u{dtype.itemsize}")[0])


def _compute(dtype: np.dtype) -> np.dtype:
    """The dtype a kernel of `dtype` computes in (float32 for the two-byte floats)."""
    return F64 if dtype == F64 else F32


@st.composite
def values(draw: Any, dtype: np.dtype, n: int, finite_below: float | None = None) -> np.ndarray:
    """n values of `dtype`: edge values, ordinary numbers and random bit patterns (NaN with
    payloads, subnormals, huge and tiny magnitudes). `finite_below`: only finite magnitudes
    below it, with zeros, subnormals, NaN and infinities (a reduction's operands)."""
    bits = 8 * dtype.itemsize
    found = edges(dtype)
    moderate = st.floats(-30, 30, width=64)
    if finite_below is not None:
        found = [e for e in found if not math.isfinite(e) or abs(e) < finite_below]
        moderate = st.floats(-finite_below / 2, finite_below / 2, width=64)
        pattern = st.integers(0, 2**bits - 1).filter(
            lambda b: _magnitude_below(b, dtype, finite_below))
    else:
        pattern = st.integers(0, 2**bits - 1)
    element = st.one_of(st.sampled_from(found).map(lambda v: _bits_of(v, dtype)),
                        moderate.map(lambda v: _bits_of(v, dtype)), pattern)
    raw = draw(st.lists(element, min_size=n, max_size=n))
    return np.array(raw, f"u{dtype.itemsize}").view(dtype)


def _magnitude_below(pattern: int, dtype: np.dtype, limit: float) -> bool:
    value = float(np.array([pattern], f"u{dtype.itemsize}").view(dtype)[0])
    return not math.isfinite(value) or abs(value) < limit


def numbers(dtype: np.dtype) -> Any:
    """A number operand as the ops pass it (`ops._scalar`: the compute dtype, float32 for the
    two-byte floats): edge values and ordinary ones."""
    compute = _compute(dtype)
    return st.one_of(st.sampled_from(edges(compute)), st.floats(-30, 30, width=64)).map(
        lambda v: np.array([v]).astype(compute)[0])


def _grid(dtype: np.dtype, seed: str, count: int) -> list[np.ndarray]:
    """`count` operands of `dtype`: one holds every edge value; two or more meet every pair of
    edge values in their last two (any before them cycle through the edges), then 64 seeded
    random bit patterns each."""
    edge = np.array([_bits_of(v, dtype) for v in edges(dtype)], f"u{dtype.itemsize}")
    rng = np.random.default_rng(zlib.crc32(f"{seed} {dtype}".encode()))
    k = len(edge)
    columns = [edge]
    if count > 1:
        columns = [np.resize(np.roll(edge, 5), k * k)] * (count - 2) + [np.repeat(edge, k),
                                                                        np.tile(edge, k)]
    random = [rng.integers(0, 2**(8 * dtype.itemsize), 64, dtype=np.uint64)
              .astype(f"u{dtype.itemsize}") for _ in range(count)]
    return [np.concatenate([c, r]).view(dtype) for c, r in zip(columns, random)]


# ---------------------------------------------------------------------- comparisons
def _wide(x: np.ndarray) -> np.ndarray:
    """x as float64 (exactly), without NumPy's warnings for NaN."""
    with np.errstate(all="ignore"):
        return np.asarray(x).astype(np.float64)


def _nan(x: np.ndarray) -> np.ndarray:
    return np.isnan(_wide(x))


def _ordered(x: np.ndarray) -> np.ndarray:
    """Each value's place on the line of its dtype's values (-0 and +0 both at 0), as int64."""
    k = x.dtype.itemsize
    raw = x.view(f"u{k}").astype(np.uint64)
    sign = (raw >> np.uint64(8 * k - 1)).astype(bool)
    magnitude = (raw & np.uint64(2**(8 * k - 1) - 1)).astype(np.int64)
    return np.where(sign, -magnitude, magnitude)


def _ulp(x: np.ndarray) -> np.ndarray:
    """Each element's ULP in its own dtype (the gap to the next larger magnitude), as float64
    (ml_dtypes' bfloat16 has no np.spacing)."""
    k = x.dtype.itemsize
    unsigned = np.dtype(f"u{k}")
    magnitude = x.view(unsigned) & unsigned.type(2**(8 * k - 1) - 1)
    with np.errstate(all="ignore"):
        up = (magnitude + unsigned.type(1)).view(x.dtype).astype(np.float64)
        return np.abs(up - np.abs(x.astype(np.float64)))


def _where(x: np.ndarray, i: int) -> str:
    """Element i of the flat x as its index in x's shape."""
    return str(np.unravel_index(i, x.shape)) if x.ndim > 1 else str(i)


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Equal bits, but that a NaN need only meet a NaN (its sign and payload are each
    machine's own: x86 makes 0xffc00000 for an invalid operation, CUDA 0x7fffffff)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        raise AssertionError(f"{what}: a {got.dtype} result of shape {got.shape}, not "
                             f"{want.dtype} of shape {want.shape}")
    got, want = got.reshape(-1), want.reshape(-1)
    bits = f"u{want.dtype.itemsize}"
    same = got.view(bits) == want.view(bits)
    if want.dtype.kind == "f" or want.dtype == BF16:
        same |= _nan(want) & _nan(got)
    if not same.all():
        i = int(np.flatnonzero(~same)[0])
        raise AssertionError(f"{what}: element {i} is {got[i]!r} ({int(got.view(bits)[i]):#x}), "
                             f"the CPU's {want[i]!r} ({int(want.view(bits)[i]):#x})")


#: The kernels whose bound is `_gelu_bound`'s.
_GELU_KERNELS = ("gelu", "gelu_backward", "gelu_tanh", "gelu_tanh_backward")


def _gelu_bound(name: str, operands: Sequence[Any], want: np.ndarray) -> np.ndarray:
    """The absolute bound of gelu, gelu_tanh and their gradients on `operands`
    (GELU_ULPS_OF_ONE, GELU_TANH_ULPS_OF_ONE)."""
    if len(operands) != optable.BY_NAME[name].arity:
        raise ValueError(f"assert_close: {name}'s bound reads its operands; pass them")
    one = float(np.spacing(_compute(want.dtype).type(1.0)))
    wide = [np.broadcast_to(_wide(np.asarray(x)), want.shape) for x in operands]
    ulps = GELU_TANH_ULPS_OF_ONE if name.startswith("gelu_tanh") else GELU_ULPS_OF_ONE
    with np.errstate(all="ignore"):
        if name in ("gelu", "gelu_tanh"):
            scale = 0.5 * np.abs(wide[0])
        elif name == "gelu_backward":
            scale = np.abs(wide[0]) * (0.5 + np.abs(wide[1]) / math.sqrt(2 * math.pi))
        else:
            x = np.abs(wide[1])
            scale = np.abs(wide[0]) * (0.5 + math.sqrt(2 / math.pi) * x
                                       * (1 + 3 * 0.044715 * x * x))
        return ulps * one * scale + 2 * _ulp(want)


def _rounding_decides(name: str, operands: Sequence[Any], want: np.ndarray) -> np.ndarray:
    """Where a GELU gradient g * d(x) is decided by rounding: the derivative d(x) (computed
    here in float64) within its own bound of 0 (`_gelu_bound` at g = 1). Far below about -5,
    where tanh and erf round to -1, a device's d(x) may be a tiny number of either sign or a
    zero (PoCL's tanh is within its ulps of -1 where the CPU's gives -1), so g * d(x) may be
    a zero of either sign for a finite g, and NaN or an infinity for an infinite g."""
    with np.errstate(all="ignore"):
        x = np.broadcast_to(np.asarray(operands[1], np.float64), want.shape)
        if name == "gelu_backward":
            erf = np.vectorize(math.erf, otypes=[np.float64])
            d = 0.5 * (1 + erf(x / math.sqrt(2))) + x * np.exp(-0.5 * x * x) / math.sqrt(
                2 * math.pi)
        else:
            beta, kappa = math.sqrt(2 / math.pi), 0.044715
            t = np.tanh(beta * (x + kappa * x ** 3))
            d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * beta * (1 + 3 * kappa * x * x)
        return np.abs(d) <= _gelu_bound(name, [np.ones(want.shape), x], np.zeros_like(want))


def assert_close(name: str, got: np.ndarray, want: np.ndarray, what: str,
                 operands: Sequence[Any] = ()) -> None:
    """Within the stated bound of the transcendental kernel `name`; NaN where the CPU has NaN,
    and a zero where both give one of the CPU's sign. gelu's and gelu_backward's bounds read
    the kernel's `operands` (arrays of the result's shape, or numbers); where rounding decides
    a GELU gradient (`_rounding_decides`), a zero of either sign, and NaN or an infinity for
    an infinite g."""
    result_shape = np.shape(want)
    got, want = got.reshape(-1), want.reshape(-1)
    dtype = want.dtype
    nan = _nan(want)
    loose = np.zeros(want.shape, bool)
    if name in _GELU_KERNELS:
        shape = next((np.shape(x) for x in operands if np.ndim(x)), want.shape)
        flat = [np.asarray(x).reshape(-1) if np.shape(x) == shape and np.ndim(x) else x
                for x in operands]
        if name in ("gelu_backward", "gelu_tanh_backward"):
            loose = _rounding_decides(name, flat, want)
    endless = loose & np.isinf(np.broadcast_to(_wide(np.asarray(flat[0])), want.shape)) \
        if loose.any() else loose
    if not np.array_equal(nan | endless, _nan(got) | endless):
        i = int(np.flatnonzero((nan != _nan(got)) & ~endless)[0])
        raise AssertionError(f"{what}: element {i} is {got[i]!r}, the CPU's {want[i]!r} "
                             f"(NaN in one only)")
    wide_got, wide_want = _wide(got), _wide(want)
    if name in _GELU_KERNELS:
        bound = _gelu_bound(name, flat, want)
        with np.errstate(invalid="ignore"):
            far = ~nan & ~((wide_got == wide_want) | (np.abs(wide_got - wide_want) <= bound))
    elif name == "sigmoid":
        half_ulp = float(np.spacing(_compute(dtype).type(0.5)))
        bound = SIGMOID_ULPS_OF_HALF * half_ulp + _ulp(want)
        with np.errstate(invalid="ignore"):
            far = ~nan & ~(np.abs(wide_got - wide_want) <= bound)
    else:
        far = ~nan & (np.abs(_ordered(got) - _ordered(want)) > TRANSCENDENTAL_ULPS[name, dtype])
        if name == "erf_backward" and len(operands):
            # NOTE: exp(-x * x) is subnormal for |x| above 26.5 (float64) or 9.3 (float32):
            # there exp's ULPs are the subnormal spacing, a larger share of it, and a huge g
            # carries that error into a normal result (g = 1.8e308, x = 26.6: 4 ULPs between
            # PoCL and the CPU). So each of those ULPs is also allowed as g times 2 / sqrt(pi)
            # times that spacing
            g = np.broadcast_to(_wide(np.asarray(operands[0])), result_shape).reshape(-1)
            compute = _compute(dtype)
            # NOTE: a signalling NaN in g (a float16 one widens as one) raises invalid
            with np.errstate(invalid="ignore", over="ignore"):
                slack = np.abs(g) * (2 / math.sqrt(math.pi)
                                     * float(_finfo(compute).smallest_subnormal)
                                     * (TRANSCENDENTAL_ULPS["exp", compute] + 1))
                far &= ~(np.abs(wide_got - wide_want) <= slack)
    zeros = (wide_got == 0) & (wide_want == 0)
    far |= zeros & (np.signbit(wide_got) != np.signbit(wide_want)) & ~loose
    far &= ~endless
    if far.any():
        i = int(np.flatnonzero(far)[0])
        raise AssertionError(f"{what}: element {i} is {got[i]!r}, the CPU's {want[i]!r}, "
                             f"{abs(int(_ordered(got)[i] - _ordered(want)[i]))} ULPs apart")


def _assert_within(got: np.ndarray, want: np.ndarray, bound: np.ndarray, what: str) -> None:
    """NaN and infinities where the CPU has them, the rest within `bound` of the CPU's."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{what}: a {got.dtype} result of shape {got.shape}, not "
                             f"{want.dtype} of shape {want.shape}")
    wide_got, wide_want = _wide(got), _wide(want)
    special = ~np.isfinite(wide_want)
    differ = special & ~((wide_got == wide_want) | (_nan(want) & _nan(got)))
    with np.errstate(invalid="ignore"):
        differ |= ~special & ~(np.abs(wide_got - wide_want) <= bound)
    if differ.any():
        i = int(np.flatnonzero(differ.reshape(-1))[0])
        bounds = np.broadcast_to(bound, want.shape).reshape(-1)
        raise AssertionError(f"{what}: element {_where(want, i)} is {got.reshape(-1)[i]!r}, "
                             f"the CPU's {want.reshape(-1)[i]!r}, more than "
                             f"{float(bounds[i]):.3g} apart")


def assert_reduced(name: str, x: np.ndarray, axis: tuple[int, ...] | None, keepdims: bool,
                   got: np.ndarray, want: np.ndarray, what: str) -> None:
    """A reduction `name` of x over `axis` against the CPU's: NaN and infinities where the CPU
    has them, a sum of zeros (or of nothing) bit for bit (+0.0; a mean of nothing NaN), the
    rest within the bound of its order (REDUCTION_ROUNDINGS); a max exactly (any order gives
    it; a tie of zeros may keep either sign)."""
    if name == "max":
        _assert_within(got, want, np.zeros(np.shape(want)), what)
        return
    wide = _wide(x)
    count = x.size if axis is None else math.prod(x.shape[i] for i in axis)
    with np.errstate(all="ignore"):
        magnitude = np.add.reduce(np.where(np.isfinite(wide), np.abs(wide), 0), axis=axis,
                                  keepdims=keepdims)
        if name == "mean":
            magnitude = magnitude / max(count, 1)
    u = float(np.finfo(_compute(want.dtype)).eps) / 2
    bound = REDUCTION_ROUNDINGS * max(count - 1, 0) * u * magnitude + _ulp(want)
    _assert_within(got, want, bound, what)
    zeros = np.add.reduce(wide != 0, axis=axis, keepdims=keepdims) == 0
    assert_same_bits(np.where(zeros, got, want), want, f"{what} (a sum of zeros)")


# ---------------------------------------------------------------------- on the device
def to_device(device: Device, host: np.ndarray) -> Any:
    """A C-order native view on `device` holding `host` (0-d ones too)."""
    host = np.ascontiguousarray(host).reshape(np.shape(host))
    raw = device.raw_alloc(max(host.nbytes, 1))
    device.copyin(raw, 0, host)
    return device.array_view(raw, 0, host.shape, host.dtype, host.strides)


def run_on(device: Device, call: Callable[..., None], operands: Sequence[Any], shape: tuple,
           dtype: np.dtype) -> np.ndarray:
    """call(device, *operands on the device, out) into a new `dtype` array of `shape` (zeros
    first), read back to the host; arrays among `operands` are copied to the device, numbers
    pass as they are."""
    views = [to_device(device, x) if isinstance(x, np.ndarray) else x for x in operands]
    out = to_device(device, np.zeros(shape, dtype))
    with np.errstate(all="ignore"):
        call(device, *views, out)
    return device.to_host(out)


def storable(device: Device, dtype: np.dtype) -> bool:
    """Whether `device` makes views of `dtype` (CUDA's CuPy before 14 has no bfloat16)."""
    try:
        device.array_view(device.raw_alloc(8), 0, (1,), dtype, (np.dtype(dtype).itemsize,))
    except TypeError:
        return False
    return True


def _cpu() -> Device:
    import backends  # NOTE: the package's registry, below which this module sits

    return backends.get_device("cpu")


class _Placed:
    """A view of `shape` and `dtype` at a byte offset with byte strides over raw memory of its
    own, the rest of which holds random bytes: a kernel's writes outside the view show."""

    #: The layouts a view takes: C order, C order at an offset, Fortran order (a transposed
    #: matrix), every axis reversed (negative strides), every other element of the last axis;
    #: "broadcast" (inputs only) repeats the first row (zero strides).
    LAYOUTS = ("contiguous", "offset", "transposed", "reversed", "strided", "broadcast")

    def __init__(self, device: Device, logical: np.ndarray, layout: str,
                 rng: np.random.Generator) -> None:
        dtype, shape = logical.dtype, logical.shape
        item = dtype.itemsize
        c_order = _c_strides(shape, item)
        size = math.prod(shape)
        offset, strides, span = 0, c_order, size * item
        if layout == "offset":
            offset = 3 * item
            span += 5 * item
        elif layout == "transposed":
            strides = tuple(reversed(_c_strides(tuple(reversed(shape)), item)))
        elif layout == "reversed":
            strides = tuple(-s for s in c_order)
            offset = sum(s * (n - 1) for s, n in zip(c_order, shape)) if size else 0
        elif layout == "strided" and shape:
            strides = _c_strides(shape[:-1] + (2 * shape[-1],), item)[:-1] + (2 * item,)
            span *= 2
        elif layout == "broadcast" and shape:
            logical = np.broadcast_to(logical[(slice(0, 1),) * 1], shape).copy()
            strides = (0,) + c_order[1:]
            span = math.prod(shape[1:]) * item
        self.dtype, self.shape, self.offset, self.strides = dtype, shape, offset, strides
        self.layout = layout
        #: the values the view holds, and the bytes of its raw memory on the host
        self.logical = logical
        self.host = rng.integers(0, 256, max(span, 1), dtype=np.uint8)
        if size:
            self.numpy(self.host)[...] = logical
        self.raw = device.raw_alloc(self.host.nbytes)
        device.copyin(self.raw, 0, self.host)
        self.view = device.array_view(self.raw, offset, shape, dtype, strides)

    def numpy(self, buffer: np.ndarray) -> np.ndarray:
        """The view's elements in `buffer` (its raw memory's bytes on the host)."""
        return np.ndarray(self.shape, self.dtype, buffer, self.offset, self.strides)

    def outside(self) -> np.ndarray:
        """Which bytes of the raw memory lie outside the view's elements."""
        mark = np.zeros(self.host.nbytes, np.uint8)
        if math.prod(self.shape):
            unsigned = np.dtype(f"u{self.dtype.itemsize}")
            np.ndarray(self.shape, unsigned, mark, self.offset,
                       self.strides)[...] = np.iinfo(unsigned).max
        return mark == 0

    def describe(self) -> str:
        return (f"a {self.shape} {self.dtype} view ({self.layout}: byte offset {self.offset}, "
                f"strides {self.strides})")


def _c_strides(shape: tuple, itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _read_back(device: Device, placed: _Placed, rule: str, what: str) -> np.ndarray:
    """The view's elements after a kernel wrote them, once the bytes around them are checked
    to be as they were."""
    now = device.copyout(placed.raw, 0, placed.host.nbytes)
    outside = placed.outside()
    if not np.array_equal(now[outside], placed.host[outside]):
        byte = int(np.flatnonzero(outside & (now != placed.host))[0])
        _fail(rule, device, f"{what} into {placed.describe()} changed byte {byte} of its raw "
                            f"memory, outside the view")
    return placed.numpy(now).copy()


# ---------------------------------------------------------------------- the rules
def _fail(rule: str, device: Device, detail: str) -> None:
    raise AssertionError(f"[{rule}] {type(device).__name__} {device.name}: {detail}")


def _check(ok: Any, rule: str, device: Device, detail: str) -> None:
    if not ok:
        _fail(rule, device, detail)


def _draws(examples: int) -> Callable[[Callable[..., None]], Callable[[], None]]:
    """@given(data) with `examples` examples, no deadline and no example database."""
    def wrap(fn: Callable[..., None]) -> Callable[[], None]:
        return settings(max_examples=examples, deadline=None, database=None,
                        report_multiple_bugs=False,
                        suppress_health_check=list(HealthCheck))(given(data=st.data())(fn))
    return wrap


def _written(device: Device, hook: str) -> bool:
    return getattr(type(device), hook, None) is not getattr(Device, hook, None)


def _floats(device: Device) -> list[np.dtype]:
    """The float dtypes the device computes and stores."""
    return [d for d in FLOATS if d in device.capabilities.compute_dtypes and storable(device, d)]


def check_required_hooks(device: Device, examples: int = 20) -> None:
    """Every hook of `Device.REQUIRED_HOOKS` is the backend's own."""
    missing = [hook for hook in Device.REQUIRED_HOOKS if not _written(device, hook)]
    _check(not missing, "required hooks", device,
           f"{', '.join(missing)} not written (Device.REQUIRED_HOOKS: memory, copies, views, "
           f"elementwise kernels, products, reductions and casts)")


def check_capabilities(device: Device, examples: int = 20) -> None:
    """The record is a `Capabilities`; each claimed capability's hooks are written, and the
    hooks of one not claimed are not (they would never run, or, for read-only memory, hand
    the runtime memory it does not know of); alignment is a power of two; the fast path's
    tables name known kernels."""
    rule = "capabilities"
    record = device.capabilities
    _check(isinstance(record, Capabilities), rule, device,
           f"capabilities is {record!r}, not a backends.Capabilities record")
    alignment = device.alignment
    _check(isinstance(alignment, int) and alignment > 0 and alignment & (alignment - 1) == 0,
           rule, device, f"alignment {alignment!r} is not a power of two")
    for capability, hooks in Device.CAPABILITY_HOOKS.items():
        claimed = bool(getattr(record, capability))
        written = [hook for hook in hooks if _written(device, hook)]
        if claimed:
            missing = [hook for hook in hooks if hook not in written]
            _check(not missing, rule, device, f"claims {capability} but does not write "
                                              f"{', '.join(missing)}")
        elif capability != "gemm_accumulates":  # NOTE: `_gemm` runs either way
            _check(not written, rule, device, f"writes {', '.join(written)} but does not claim "
                                              f"{capability}, so "
                                              + ("the runtime would not know of its read-only "
                                                 "memory" if capability == "read_only_memory"
                                                 else "they never run"))
    _check(not record.chains_lone_steps or record.compiles_fused, rule, device,
           "claims chains_lone_steps without compiles_fused: a graph's lone steps would have no "
           "compiled chain to run as")
    _check(not (record.half_kernels and record.half_elementwise), rule, device,
           "claims half_elementwise with half_kernels, which hands every hook its halves: "
           "_half_elementwise never runs")
    known = {*UNARY_KERNELS, *BINARY_KERNELS, *TERNARY_KERNELS, *REDUCE_KERNELS, "sub_scaled"}
    for field in ("fast_kernels", "fast_half_kernels"):
        table = getattr(record, field)
        if table is None:
            continue
        unknown = sorted(name for name in table if name not in known)
        _check(not unknown, rule, device, f"{field} names no kernel: {', '.join(unknown)}")
        _check(all(callable(k) for k in table.values()), rule, device,
               f"{field} holds something that is not callable")
    _check(record.fast_half_kernels is None or record.fast_kernels is not None, rule, device,
           "has fast_half_kernels without fast_kernels")


def check_raw_memory(device: Device, examples: int = 20) -> None:
    """Raw memory of 0 bytes and up: its size, its alignment, live allocations that never
    overlap, and a pattern written to each that survives the others; read-only memory too."""
    rule = "raw memory"
    live = []
    for read_only in (False, True):
        for nbytes in (0, 1, 3, 64, 100, 4096, 65537):
            raw = device.raw_alloc(nbytes, read_only=read_only)
            kind = "read-only " if read_only else ""
            size, address = device.nbytes_of(raw), device.address(raw)
            _check(size == nbytes, rule, device, f"raw_alloc({nbytes}) gave {kind}memory of "
                                                 f"{size} bytes")
            _check(isinstance(address, (int, np.integer)), rule, device,
                   f"address() gave {address!r}, not an int")
            _check(address % device.alignment == 0, rule, device,
                   f"{kind}raw_alloc({nbytes}) gave address {address:#x}, not a multiple of "
                   f"the alignment {device.alignment} ({address % device.alignment} past one)")
            live.append((int(address), nbytes, raw))
    spans = sorted((a, n) for a, n, _ in live if n)
    for (a, n), (b, _) in zip(spans, spans[1:]):
        _check(a + n <= b, rule, device, f"live allocations overlap: [{a:#x}, {a + n:#x}) and "
                                         f"one at {b:#x}")
    for k, (_, nbytes, raw) in enumerate(live):
        device.copyin(raw, 0, np.full(nbytes, k, np.uint8))
    for k, (address, nbytes, raw) in enumerate(live):
        back = device.copyout(raw, 0, nbytes)
        _check(back.dtype == np.uint8 and back.shape == (nbytes,) and (back == k).all(), rule,
               device, f"the {nbytes} bytes written at {address:#x} read back changed")
    for _, _, raw in live:
        device.raw_free(raw)


def check_read_only_memory(device: Device, examples: int = 20) -> None:
    """Where `read_only_memory` is claimed, `raw_alloc(n, read_only=True)` is read-only and
    ordinary memory is not; else neither is. Copies fill and read both."""
    rule = "read-only memory"
    claimed = device.capabilities.read_only_memory
    ordinary, constant = device.raw_alloc(16), device.raw_alloc(16, read_only=True)
    _check(not device.is_read_only(ordinary), rule, device, "ordinary memory is read-only")
    _check(bool(device.is_read_only(constant)) == claimed, rule, device,
           f"read-only memory {'is not' if claimed else 'is'} read-only, but read_only_memory "
           f"is {claimed}")
    payload = np.arange(16, dtype=np.uint8)
    device.copyin(constant, 0, payload)
    _check(np.array_equal(device.copyout(constant, 0, 16), payload), rule, device,
           "copyin into read-only memory did not read back")
    view = device.array_view(constant, 0, (4,), np.float32, (4,))
    _check(np.array_equal(device.to_host(view), payload.view(np.float32)), rule, device,
           "a view of read-only memory does not hold its bytes")


def check_copies(device: Device, examples: int = 20) -> None:
    """copyin at a byte offset changes exactly those bytes; copyout reads any range."""
    rule = "copies"

    @_draws(examples)
    def run(data: Any) -> None:
        size = data.draw(st.integers(0, 300), label="size")
        offset = data.draw(st.integers(0, size), label="offset")
        payload = np.frombuffer(data.draw(st.binary(max_size=size - offset), label="payload"),
                                np.uint8)
        start = data.draw(st.integers(0, size), label="read from")
        stop = data.draw(st.integers(start, size), label="read to")
        background = np.frombuffer(data.draw(st.binary(min_size=size, max_size=size)), np.uint8)
        raw = device.raw_alloc(size)
        device.copyin(raw, 0, background)
        device.copyin(raw, offset, payload)
        want = background.copy()
        want[offset:offset + payload.size] = payload
        got = device.copyout(raw, start, stop - start)
        _check(np.array_equal(got, want[start:stop]), rule, device,
               f"{payload.size} bytes copied in at byte {offset} of {size} read back from "
               f"[{start}, {stop}) as {got.tobytes()!r}, not {want[start:stop].tobytes()!r}")
        device.raw_free(raw)

    run()


def _layout_views(data: Any, dtype: np.dtype, layouts: Sequence[str], label: str,
                  device: Device, rng: np.random.Generator) -> _Placed:
    shape = tuple(data.draw(st.lists(st.integers(0, 4), max_size=3), label=f"{label} shape"))
    layout = data.draw(st.sampled_from(layouts), label=f"{label} layout")
    return _Placed(device, _random_values(rng, dtype, shape), layout, rng)


def _random_values(rng: np.random.Generator, dtype: np.dtype, shape: tuple) -> np.ndarray:
    """Random bits of `dtype` (0 or 1 for bool)."""
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    bits = rng.integers(0, 2**(8 * dtype.itemsize), shape, dtype=np.uint64)
    return bits.astype(f"u{dtype.itemsize}").view(dtype)


def check_views(device: Device, examples: int = 20) -> None:
    """array_view at a byte offset with byte strides (negative and zero too) shows the bytes
    there, in every dtype, and `to_host` reads them (any layout)."""
    rule = "views"

    def check(placed: _Placed) -> None:
        dtype = placed.dtype
        got = device.to_host(placed.view)
        _check(isinstance(got, np.ndarray) and got.shape == placed.shape
               and got.dtype == dtype, rule, device,
               f"to_host of {placed.describe()} gave {type(got).__name__} "
               f"{getattr(got, 'shape', '')} {getattr(got, 'dtype', '')}")
        bits = f"u{dtype.itemsize}"
        want = placed.numpy(placed.host)
        if not np.array_equal(got.view(bits), want.view(bits)):
            i = int(np.flatnonzero(got.view(bits).reshape(-1) != want.view(bits).reshape(-1))[0])
            _fail(rule, device, f"{placed.describe()}: element {_where(want, i)} is "
                                f"{got.reshape(-1)[i]!r}, the bytes there hold "
                                f"{want.reshape(-1)[i]!r}")

    # NOTE: a fixed grid first (every dtype, every layout), so that no draw of hypothesis's
    # can miss a layout; then drawn shapes and layouts
    rng = np.random.default_rng(0)
    for dtype in (d for d in STORED if storable(device, d)):
        for layout in _Placed.LAYOUTS:
            check(_Placed(device, _random_values(rng, dtype, (2, 3)), layout, rng))

    @_draws(examples)
    def run(data: Any) -> None:
        dtype = data.draw(st.sampled_from([d for d in STORED if storable(device, d)]))
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
        check(_layout_views(data, dtype, _Placed.LAYOUTS, "view", device, rng))

    run()


def check_copy_kernel(device: Device, examples: int = 20) -> None:
    """unary("copy") moves the bits of any dtype from a view of any layout (broadcast too) into
    a view of any layout, and writes nothing else."""
    rule = "copy kernel"

    @_draws(examples)
    def run(data: Any) -> None:
        dtype = data.draw(st.sampled_from([d for d in STORED if storable(device, d)]))
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
        shape = tuple(data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
        source = _Placed(device, _random_values(rng, dtype, shape),
                         data.draw(st.sampled_from(_Placed.LAYOUTS)), rng)
        out = _Placed(device, _random_values(rng, dtype, shape),
                      data.draw(st.sampled_from(_Placed.LAYOUTS[:-1])), rng)
        device.unary("copy", source.view, out.view)
        got = _read_back(device, out, rule, "copy")
        bits = f"u{dtype.itemsize}"
        _check(np.array_equal(got.view(bits), source.logical.view(bits)), rule, device,
               f"copy from {source.describe()} into {out.describe()} gave other bits")

    run()


def _operands(name: str, dtype: np.dtype) -> list[np.ndarray]:
    """The grid of the op's operands: floats of `dtype`, bool conditions alternating."""
    kinds = optable.BY_NAME[name].operand_kinds
    floats = iter(_grid(dtype, name, kinds.count(optable.FLOAT)))
    found = [next(floats) if kind == optable.FLOAT else None for kind in kinds]
    n = next(x.size for x in found if x is not None)
    return [np.arange(n) % 3 == 0 if x is None else x for x in found]


def _compare(name: str, got: np.ndarray, want: np.ndarray, what: str,
             operands: Sequence[Any] = ()) -> None:
    if optable.BY_NAME[name].exact:
        assert_same_bits(got, want, what)
    else:
        assert_close(name, got, want, what, operands)


def _elementwise(device: Device, name: str, operands: Sequence[Any], dtype: np.dtype,
                 rule: str, what: str) -> None:
    """The kernel on `operands` (arrays and numbers) against the CPU's."""
    shape = next(x.shape for x in operands if isinstance(x, np.ndarray))

    def call(d: Device, *views: Any) -> None:
        d.elementwise(name, views[:-1], views[-1])

    want = run_on(_cpu(), call, operands, shape, dtype)
    got = run_on(device, call, operands, shape, dtype)
    _compare(name, got, want, f"[{rule}] {type(device).__name__} {device.name}: {what}",
             operands)


def check_elementwise_kernels(device: Device, examples: int = 20) -> None:
    """Every elementwise kernel of backends/optable.py in every dtype the device computes, on
    every pair of edge values and random bits, and with each edge value as a number operand:
    the CPU's bits for an exact op, within TRANSCENDENTAL_ULPS for the others."""
    rule = "elementwise kernels"
    for dtype in _floats(device):
        for op in optable.OPS:
            operands = _operands(op.name, dtype)
            _elementwise(device, op.name, operands, dtype, rule, f"{op.name}({dtype})")
            floats = [i for i, k in enumerate(op.operand_kinds) if k == optable.FLOAT]
            if len(floats) < 2:
                continue
            for number in edges(_compute(dtype)):
                for i in (floats[0], floats[-1]):
                    mixed = list(operands)
                    mixed[i] = _compute(dtype).type(number)
                    _elementwise(device, op.name, mixed, dtype, rule,
                                 f"{op.name}({dtype}) with operand {i} the number {number!r}")


def check_kernel_layouts(device: Device, examples: int = 20) -> None:
    """Elementwise kernels, casts and reductions read operands of any layout (offset,
    transposed, reversed, strided, broadcast) and write outputs of any layout, and nothing
    outside them: the CPU's results on the same values."""
    rule = "kernel layouts"
    floats = _floats(device)

    @_draws(examples)
    def run(data: Any) -> None:
        dtype = data.draw(st.sampled_from(floats), label="dtype")
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
        shape = (data.draw(st.integers(1, 5), label="rows"),
                 data.draw(st.integers(1, 5), label="cols"))
        name = data.draw(st.sampled_from([op.name for op in optable.OPS]), label="op")
        inputs = []
        for kind in optable.BY_NAME[name].operand_kinds:
            layout = data.draw(st.sampled_from(_Placed.LAYOUTS), label="input layout")
            x = (rng.integers(0, 2, shape).astype(np.bool_) if kind == optable.BOOL
                 else data.draw(values(dtype, shape[0] * shape[1])).reshape(shape))
            inputs.append(_Placed(device, x, layout, rng))
        out = _Placed(device, np.zeros(shape, dtype),
                      data.draw(st.sampled_from(_Placed.LAYOUTS[:-1]), label="out layout"), rng)
        what = (f"{name} of {', '.join(p.describe() for p in inputs)} into {out.describe()}")
        with np.errstate(all="ignore"):
            device.elementwise(name, [p.view for p in inputs], out.view)
        got = _read_back(device, out, rule, what)
        want = run_on(_cpu(), lambda d, *v: d.elementwise(name, v[:-1], v[-1]),
                      [p.logical for p in inputs], shape, dtype)
        _compare(name, got, want, f"[{rule}] {type(device).__name__} {device.name}: {what}",
                 [p.logical for p in inputs])

    run()


def check_sub_scaled(device: Device, examples: int = 20) -> None:
    """sub_scaled(a, b, scale) is the CPU's mul then sub, bit for bit: the product rounded
    before the difference (never one fused multiply-add)."""
    rule = "sub_scaled"
    for dtype in _floats(device):
        a, b = _grid(dtype, "sub_scaled", 2)
        for scale in edges(_compute(dtype))[:6] + [0.1, -3.0]:
            number = _compute(dtype).type(scale)
            product = run_on(_cpu(), lambda d, b, o, s=number: d.binary("mul", b, s, o), [b],
                             b.shape, dtype)
            want = run_on(_cpu(), lambda d, a, p, o: d.binary("sub", a, p, o), [a, product],
                          a.shape, dtype)
            got = run_on(device, lambda d, a, b, o, s=number: d.sub_scaled(a, b, s, o), [a, b],
                         a.shape, dtype)
            assert_same_bits(got, want, f"[{rule}] {type(device).__name__} {device.name}: "
                                        f"sub_scaled({dtype}) by {scale!r}")


def check_casts(device: Device, examples: int = 20) -> None:
    """cast between the float dtypes it computes (IEEE round to nearest even; float64 to
    bfloat16 through float32, as ml_dtypes), and from bool and small integers into them
    exactly: the CPU's bits."""
    rule = "casts"
    floats = _floats(device)
    pairs = [(src, dst) for src in floats for dst in floats]
    pairs += [(np.dtype(src), dst) for src in ("bool", "int8", "uint8", "int16") for dst in floats]
    pairs += [(np.dtype("int32"), dst) for dst in floats if dst == F64]
    for src, dst in pairs:
        if src.kind in "biu":
            x = np.arange(-100, 101).astype(src) if src != np.bool_ else np.arange(8) % 2 == 1
        else:
            x = _grid(src, "cast", 1)[0]
        want = run_on(_cpu(), lambda d, x, o: d.cast(x, o), [x], x.shape, dst)
        got = run_on(device, lambda d, x, o: d.cast(x, o), [x], x.shape, dst)
        assert_same_bits(got, want, f"[{rule}] {type(device).__name__} {device.name}: cast "
                                    f"{src} -> {dst}")


def _product_bound(a: np.ndarray, b: np.ndarray, want: np.ndarray, dtype: np.dtype,
                   alpha: float = 1.0, beta: float = 0.0, c: Any = 0.0) -> np.ndarray:
    k = a.shape[-1]
    u = float(np.finfo(_compute(dtype)).eps) / 2
    with np.errstate(all="ignore"):  # NOTE: inf * 0: a NaN bound, where the CPU's is NaN too
        magnitude = abs(alpha) * (np.abs(_wide(a)) @ np.abs(_wide(b))) + abs(beta) * np.abs(
            _wide(c))
    return (REDUCTION_ROUNDINGS * (k + 2) * u * magnitude + 2 * _ulp(want)
            + float(_finfo(dtype).smallest_subnormal))


def check_products(device: Device, examples: int = 20) -> None:
    """matmul and gemm (alpha, beta) of 2-D operands, transposed ones and empty ones too,
    within the bound of their sums' order of the CPU's; gemm with beta 0 reads nothing of
    out (NaN there stays out of the result)."""
    rule = "products"
    floats = _floats(device)

    @_draws(examples)
    def run(data: Any) -> None:
        dtype = data.draw(st.sampled_from(floats), label="dtype")
        m, k, n = (data.draw(st.integers(0, 6), label=d) for d in "mkn")
        limit = math.sqrt(float(_finfo(dtype).max)) / (4 * max(k, 1))
        a = data.draw(values(dtype, m * k, finite_below=limit), label="a").reshape(m, k)
        b = data.draw(values(dtype, k * n, finite_below=limit), label="b").reshape(k, n)
        c = data.draw(values(dtype, m * n, finite_below=limit), label="out").reshape(m, n)
        alpha = data.draw(st.sampled_from([1.0, 0.5, -2.0]), label="alpha")
        beta = data.draw(st.sampled_from([0.0, 1.0, 0.25]), label="beta")
        transpose = data.draw(st.sampled_from(["none", "a", "b"]), label="transposed")
        rng = np.random.default_rng(m * 64 + k * 8 + n)
        placed = [_Placed(device, x, "transposed" if transpose == name else "contiguous", rng)
                  for name, x in (("a", a), ("b", b))]
        start = c if beta else np.full((m, n), np.nan, dtype)
        out = _Placed(device, start, "contiguous", rng)
        what = (f"gemm({placed[0].describe()}, {placed[1].describe()}, alpha={alpha}, "
                f"beta={beta})")
        with np.errstate(all="ignore"):
            if alpha == 1.0 and beta == 0.0:
                device.matmul(placed[0].view, placed[1].view, out.view)
            else:
                device.gemm(placed[0].view, placed[1].view, out.view, alpha, beta)
        got = _read_back(device, out, rule, what)
        cpu = _cpu()
        views = [to_device(cpu, x) for x in (a, b, start)]
        with np.errstate(all="ignore"):
            cpu.gemm(*views, alpha, beta)
        want = cpu.to_host(views[2])
        bound = _product_bound(a, b, want, dtype, alpha, beta, c if beta else 0.0)
        _assert_within(got, want, bound, f"[{rule}] {type(device).__name__} {device.name}: "
                                         f"{what}")

    run()


def check_reductions(device: Device, examples: int = 20) -> None:
    """sum and mean over any axes (keepdims too) within the bound of their order of the CPU's;
    over nothing, +0 and NaN; max exactly the CPU's (NaN where a NaN is among the elements),
    and over nothing a ValueError with out as it was."""
    rule = "reductions"
    floats = _floats(device)

    def check(name: str, x: np.ndarray, axis: tuple[int, ...] | None, keepdims: bool) -> None:
        shape = np.add.reduce(np.zeros(x.shape), axis=axis, keepdims=keepdims).shape

        def call(d: Device, x: Any, out: Any) -> None:
            d.reduce(name, x, axis, keepdims, out)

        reduced = range(x.ndim) if axis is None else axis
        if name == "max" and any(x.shape[i] == 0 for i in reduced):
            _refuses_empty_max(device, x, axis, keepdims, shape,
                               f"[{rule}] {type(device).__name__} {device.name}: max({x.dtype}) "
                               f"of {x.shape} over {axis}, keepdims={keepdims}")
            return
        want = run_on(_cpu(), call, [x], shape, x.dtype)
        got = run_on(device, call, [x], shape, x.dtype)
        assert_reduced(name, x, axis, keepdims, got, want,
                       f"[{rule}] {type(device).__name__} {device.name}: {name}({x.dtype}) of "
                       f"{x.shape} over {axis}, keepdims={keepdims}")

    # NOTE: every axis and keepdims once on a fixed grid, so no draw can miss one
    rng = np.random.default_rng(7)
    for dtype in floats:
        for rows in (0, 1, 3):
            x = rng.normal(0, 3, (rows, 5)).astype(dtype)
            for name in REDUCE_KERNELS:
                for axis in (None, (0,), (1,), (0, 1)):
                    for keepdims in (False, True):
                        check(name, x, axis, keepdims)

    @_draws(examples)
    def run(data: Any) -> None:
        dtype = data.draw(st.sampled_from(floats), label="dtype")
        name = data.draw(st.sampled_from(REDUCE_KERNELS), label="reduction")
        rows, cols = data.draw(st.integers(0, 6), label="rows"), data.draw(st.integers(1, 30))
        axis = data.draw(st.sampled_from([None, (0,), (1,), (0, 1)]), label="axis")
        keepdims = data.draw(st.booleans(), label="keepdims")
        limit = float(_finfo(dtype).max) / (2 * max(rows * cols, 1))
        x = data.draw(values(dtype, rows * cols, finite_below=limit), label="x")
        check(name, x.reshape(rows, cols), axis, keepdims)

    run()


def _refuses_empty_max(device: Device, x: np.ndarray, axis: tuple[int, ...] | None,
                       keepdims: bool, shape: tuple, what: str) -> None:
    """A max over no element raises ValueError and leaves out as it was."""
    view = to_device(device, x)
    start = np.full(shape, 7, x.dtype)
    out = to_device(device, start)
    try:
        device.reduce("max", view, axis, keepdims, out)
    except ValueError:
        pass
    else:
        raise AssertionError(f"{what}: a max over no element raised nothing")
    assert_same_bits(device.to_host(out), start, f"{what}: out after the refused max")


def check_channel_stats(device: Device, examples: int = 20) -> None:
    """`moments` and `channel_dots` of (N, C, S) operands against the exact values (float64 of
    the float64 ones' own sums aside): each within the bound of a sum of its N * S terms in
    the compute dtype (REDUCTION_ROUNDINGS, with the roundings of the centred x or the product
    that a composed kernel makes), NaN and infinities where the exact ones have them; the same
    bits when run twice; outputs of a wrong shape refused before anything is written."""
    rule = "channel statistics"
    floats = _floats(device)

    def exact(op: str, a: np.ndarray, b: np.ndarray | None) -> tuple:
        wa = _wide(a)
        count = a.shape[0] * a.shape[2]
        with np.errstate(all="ignore"):
            if op == "moments":
                mean = np.add.reduce(wa, axis=(0, 2), keepdims=True) / max(count, 1)
                d = wa - mean
                return ((mean, np.add.reduce(np.abs(wa), axis=(0, 2), keepdims=True) / count),
                        (np.add.reduce(d * d, axis=(0, 2), keepdims=True),
                         np.add.reduce(d * d + 2 * np.abs(d * mean) + mean * mean,
                                       axis=(0, 2), keepdims=True)))
            wb = _wide(b)
            return ((np.add.reduce(wa, axis=(0, 2), keepdims=True),
                     np.add.reduce(np.abs(wa), axis=(0, 2), keepdims=True)),
                    (np.add.reduce(wa * wb, axis=(0, 2), keepdims=True),
                     2 * np.add.reduce(np.abs(wa * wb), axis=(0, 2), keepdims=True)))

    def check(op: str, a: np.ndarray, b: np.ndarray | None) -> None:
        n, c, s = a.shape
        what = (f"[{rule}] {type(device).__name__} {device.name}: {op}({a.dtype}) of "
                f"{a.shape}")
        inputs = [a] if b is None else [a, b]
        results = []
        for _ in range(2):
            views = [to_device(device, x) for x in inputs]
            outs = [to_device(device, np.zeros((1, c, 1), a.dtype)) for _ in range(2)]
            with np.errstate(all="ignore"):
                getattr(device, op)(*views, *outs)
            results.append([device.to_host(o) for o in outs])
        for first, again in zip(*results):
            assert_same_bits(again, first, f"{what}, run twice")
        u = float(np.finfo(_compute(a.dtype)).eps) / 2
        count = n * s
        for got, (want, magnitude) in zip(results[0], exact(op, a, b)):
            with np.errstate(all="ignore"):
                bound = (REDUCTION_ROUNDINGS * (count + 1) * u * magnitude
                         + _ulp(want.astype(a.dtype)))
            _assert_within(got, want.astype(a.dtype), bound, what)

    rng = np.random.default_rng(11)
    for dtype in floats:
        for shape in ((1, 1, 2), (2, 3, 5), (3, 0, 4), (4, 2, 1), (2, 5, 37)):
            x = (rng.normal(2, 3, shape)).astype(dtype)
            check("moments", x, None)
            check("channel_dots", rng.normal(0, 1, shape).astype(dtype), x)
        x = to_device(device, np.ones((2, 3, 4), dtype))
        wrong = to_device(device, np.full((1, 2, 1), 7, dtype))
        right = to_device(device, np.full((1, 3, 1), 7, dtype))
        try:
            device.moments(x, wrong, right)
        except ValueError:
            pass
        else:
            _check(False, rule, device, "moments took a (1, 2, 1) output for (2, 3, 4) x")
        _check(np.all(device.to_host(right) == 7), rule, device,
               "a refused moments wrote its other output")

    @_draws(examples)
    def run(data: Any) -> None:
        dtype = data.draw(st.sampled_from(floats), label="dtype")
        n, c, s = (data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4)),
                   data.draw(st.integers(1, 24)))
        limit = math.sqrt(float(_finfo(dtype).max) / (8 * n * s))
        x = data.draw(values(dtype, n * c * s, finite_below=limit), label="x").reshape(n, c, s)
        if data.draw(st.booleans(), label="moments"):
            check("moments", x, None)
        else:
            g = data.draw(values(dtype, n * c * s, finite_below=limit), label="g")
            check("channel_dots", g.reshape(n, c, s), x)

    run()


def check_conv_columns(device: Device, examples: int = 20) -> None:
    """Where `conv_columns` is claimed: `im2col` gives the reference's bits (a copy, zeros in
    the padding; `numpy_im2col`), `col2im` the reference's sums (`numpy_col2im`) within the
    bound of kh * kw terms each, and columns of the wrong shape are refused before anything is
    written."""
    rule = "convolution columns"
    if not device.capabilities.conv_columns:
        return
    floats = _floats(device)

    def check(x: np.ndarray, kernel: tuple, stride: tuple, padding: tuple, seed: int) -> None:
        (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
        n, c, h, w = x.shape
        ho, wo = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
        shape = (c * kh * kw, n * ho * wo)
        what = (f"[{rule}] {type(device).__name__} {device.name}: {x.dtype} x {x.shape}, "
                f"kernel {kernel}, stride {stride}, padding {padding}")
        want = np.zeros(shape, x.dtype)
        numpy_im2col(x, kernel, stride, padding, want)
        got = run_on(device, lambda d, v, o: d.im2col(v, kernel, stride, padding, o), [x],
                     shape, x.dtype)
        assert_same_bits(got, want, f"{what}: im2col")
        columns = np.random.default_rng(seed).normal(0, 3, shape).astype(x.dtype)
        exact = np.zeros(x.shape)
        numpy_col2im(_wide(columns), kernel, stride, padding, exact)
        magnitude = np.zeros(x.shape)
        numpy_col2im(np.abs(_wide(columns)), kernel, stride, padding, magnitude)
        got = run_on(device, lambda d, v, o: d.col2im(v, kernel, stride, padding, o),
                     [columns], x.shape, x.dtype)
        u = float(np.finfo(_compute(x.dtype)).eps) / 2
        bound = REDUCTION_ROUNDINGS * kh * kw * u * magnitude + _ulp(exact.astype(x.dtype))
        _assert_within(got, exact.astype(x.dtype), bound, f"{what}: col2im")

    rng = np.random.default_rng(17)
    for dtype in floats:
        for shape, kernel, stride, padding in (((2, 3, 7, 9), (3, 3), (1, 1), (1, 1)),
                                               ((1, 2, 9, 8), (3, 2), (2, 3), (1, 0)),
                                               ((2, 2, 5, 5), (1, 1), (2, 2), (0, 0)),
                                               ((1, 1, 3, 3), (4, 4), (1, 1), (2, 2)),
                                               ((1, 3, 11, 11), (7, 7), (2, 2), (3, 3))):
            check(rng.normal(0, 3, shape).astype(dtype), kernel, stride, padding, 1)
    x = to_device(device, np.ones((1, 2, 4, 4), F32))
    wrong = to_device(device, np.full((18, 15), 7.0, F32))
    try:
        device.im2col(x, (3, 3), (1, 1), (1, 1), wrong)
    except ValueError:
        pass
    else:
        _check(False, rule, device, "im2col took (18, 15) columns for a 4x4 x (wants 18 x 16)")
    _check(np.all(device.to_host(wrong) == 7.0), rule, device, "a refused im2col wrote")

    @_draws(examples)
    def run(data: Any) -> None:
        dtype = data.draw(st.sampled_from(floats), label="dtype")
        kernel = (data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4)))
        stride = (data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3)))
        padding = (data.draw(st.integers(0, kernel[0])), data.draw(st.integers(0, kernel[1])))
        h = data.draw(st.integers(max(1, kernel[0] - 2 * padding[0]), 9))
        w = data.draw(st.integers(max(1, kernel[1] - 2 * padding[1]), 9))
        n, c = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3))
        x = data.draw(values(dtype, n * c * h * w), label="x").reshape(n, c, h, w)
        check(x, kernel, stride, padding, data.draw(st.integers(0, 99)))

    run()


def check_cross_entropy(device: Device, examples: int = 20) -> None:
    """cross_entropy and its gradient within CROSS_ENTROPY_ULPS of the CPU's; a label outside
    [0, classes) raises ValueError before either output is written (Note [checked before
    written] in backends/base.py)."""
    rule = "cross entropy"
    floats = _floats(device)

    @_draws(examples)
    def run(data: Any) -> None:
        dtype = data.draw(st.sampled_from(floats), label="dtype")
        rows, classes = data.draw(st.integers(0, 5), label="rows"), data.draw(st.integers(1, 12))
        logits = np.array(data.draw(st.lists(st.floats(-20, 20), min_size=rows * classes,
                                             max_size=rows * classes)), dtype)
        logits = logits.reshape(rows, classes)
        labels = np.array(data.draw(st.lists(st.integers(0, classes - 1), min_size=rows,
                                             max_size=rows)), np.int64)
        grad = np.array(data.draw(st.lists(st.floats(-2, 2), min_size=rows, max_size=rows)),
                        dtype)
        results = {}
        for d in (_cpu(), device):
            views = [to_device(d, x) for x in (logits, labels, grad)]
            losses, probs = to_device(d, np.zeros(rows, dtype)), to_device(
                d, np.zeros((rows, classes), dtype))
            out = to_device(d, np.zeros((rows, classes), dtype))
            d.cross_entropy(views[0], views[1], losses, probs)
            d.cross_entropy_backward(probs, views[1], views[2], out)
            results[d] = [d.to_host(v) for v in (losses, probs, out)]
        eps = float(np.finfo(_compute(dtype)).eps)
        scale = float(np.abs(_wide(logits)).max(initial=1.0))
        for got, want, part in zip(results[device], results[_cpu()],
                                   ("losses", "probs", "gradient")):
            bound = CROSS_ENTROPY_ULPS * eps * scale + 2 * _ulp(want)
            _assert_within(got, want, bound, f"[{rule}] {type(device).__name__} "
                                             f"{device.name}: cross_entropy's {part} "
                                             f"({dtype}, {rows}x{classes})")
        if rows:
            bad = labels.copy()
            bad[data.draw(st.integers(0, rows - 1), label="bad row")] = data.draw(
                st.sampled_from([-1, classes, classes + 7]), label="bad label")
            views = [to_device(device, x) for x in (logits, bad)]
            sentinel = np.full((rows, classes), 7, dtype)
            losses, probs = to_device(device, sentinel[:, 0]), to_device(device, sentinel)
            try:
                device.cross_entropy(views[0], views[1], losses, probs)
            except ValueError:
                pass
            else:
                _fail(rule, device, f"labels {bad.tolist()} for {classes} classes raised no "
                                    f"ValueError")
            _check(np.array_equal(_wide(device.to_host(probs)), _wide(sentinel)), rule, device,
                   "a refused label left probs written (Note [checked before written])")
            _check(np.array_equal(_wide(device.to_host(losses)), _wide(sentinel[:, 0])), rule,
                   device,
                   "a refused label left losses written (Note [checked before written])")

    run()


def check_gather_scatter(device: Device, examples: int = 20) -> None:
    """gather moves the CPU's bits (any stored dtype); scatter_add gives the CPU's bits,
    repeated indices added one at a time in index order (np.add.at), the two-byte floats
    accumulated in float32 and rounded once; an index outside [0, rows) raises ValueError
    before either writes (Note [checked before written] in backends/base.py)."""
    rule = "gather and scatter"
    floats = _floats(device)
    stored = [d for d in STORED if storable(device, d)]

    @_draws(examples)
    def run(data: Any) -> None:
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
        rows, cols = data.draw(st.integers(1, 6), label="rows"), data.draw(st.integers(1, 5))
        n = data.draw(st.integers(0, 12), label="indices")
        index_dtype = data.draw(st.sampled_from([np.dtype("int32"), np.dtype("int64")]))
        # NOTE: few rows, many indices: repeats are the case that orders additions
        indices = rng.integers(0, rows, n).astype(index_dtype)
        dtype = data.draw(st.sampled_from(stored), label="gather dtype")
        table = _random_values(rng, dtype, (rows, cols))
        got = run_on(device, lambda d, t, i, o: d.gather(t, i, o), [table, indices],
                     (n, cols), dtype)
        assert_same_bits(got, table[indices], f"[{rule}] {type(device).__name__} "
                                              f"{device.name}: gather ({dtype})")
        dtype = data.draw(st.sampled_from(floats), label="scatter dtype")
        # NOTE: magnitudes far apart, so that another order of additions rounds otherwise
        # (within float16's range)
        span = 8 if dtype in HALVES else 20
        src = (rng.standard_normal((n, cols)) * 2.0 ** rng.integers(-span, span, (n, cols)))
        src = src.astype(dtype)
        start = rng.standard_normal((rows, cols)).astype(dtype)
        results = [run_on(d, lambda d, s, i, o0, o: (d.unary("copy", o0, o),
                                                     d.scatter_add(s, i, o)),
                          [src, indices, start], (rows, cols), dtype)
                   for d in (_cpu(), device)]
        assert_same_bits(results[1], results[0], f"[{rule}] {type(device).__name__} "
                                                 f"{device.name}: scatter_add ({dtype})")
        if n:
            bad = indices.copy()
            bad[data.draw(st.integers(0, n - 1), label="bad position")] = data.draw(
                st.sampled_from([-1, rows, rows + 5]), label="bad index")
            sentinel = np.full((rows, cols), 7, dtype)
            for name in ("gather", "scatter_add"):
                target = to_device(device, sentinel if name == "scatter_add" else
                                   np.full((n, cols), 7, dtype))
                operands = ([to_device(device, start[:, :]), to_device(device, bad)]
                            if name == "gather" else [to_device(device, src),
                                                      to_device(device, bad)])
                try:
                    getattr(device, name)(*operands, target)
                except ValueError:
                    pass
                else:
                    _fail(rule, device, f"{name} took indices {bad.tolist()} for {rows} rows "
                                        f"and raised no ValueError")
                _check(np.all(_wide(device.to_host(target)) == 7), rule, device,
                       f"a refused index left {name}'s out written "
                       f"(Note [checked before written])")

    run()


@st.composite
def chains(draw: Any, n: int, dtypes: Sequence[np.dtype] = FLOATS,
           ) -> tuple[list, list[np.ndarray], np.dtype]:
    """A fused program over 1-3 inputs of length n, with its inputs: every link an elementwise
    kernel whose arrays have its dtype (or float32 under a two-byte link, as the ops pass
    them), numbers in the compute dtype. All float64, or float32 and the halves mixed (those
    of `dtypes`)."""
    wide = F64 in dtypes and (F32 not in dtypes or draw(st.booleans()))
    kinds = [F64] if wide else [d for d in (F32, F16, BF16) if d in dtypes]
    inputs = [draw(values(d, n)) for d in draw(st.lists(st.sampled_from(kinds), min_size=1,
                                                        max_size=3))]
    program: list = []
    fusible = [op.name for op in optable.OPS if op.fusible]
    for _ in range(draw(st.integers(1, 6))):
        dtype = draw(st.sampled_from(kinds))
        takes = {dtype, F32} if dtype in (F16, BF16) else {dtype}
        arrays = [("input", k) for k, x in enumerate(inputs) if x.dtype in takes]
        arrays += [("link", j) for j, (_, _, d) in enumerate(program) if d in takes]
        if not arrays:
            continue
        name = draw(st.sampled_from([f for f in fusible if optable.BY_NAME[f].arity <= 2]))
        first = draw(st.sampled_from(arrays))
        if name in UNARY_KERNELS:
            if name == "copy" and (first[0] == "input" and inputs[first[1]].dtype != dtype
                                   or first[0] == "link" and program[first[1]][2] != dtype):
                continue  # NOTE: copy moves bits: its operand has its dtype
            args: tuple = (first,)
        else:
            other = draw(st.one_of(st.sampled_from(arrays),
                                   numbers(dtype).map(lambda v: ("number", float(v)))))
            args = (first, other) if draw(st.booleans()) else (other, first)
        program.append((name, args, dtype))
    if not program:
        program = [("neg", (("input", 0),), inputs[0].dtype)]
    return program, inputs, program[-1][2]


def unfused(device: Device, program: Sequence, inputs: Sequence[Any], out: Any) -> None:
    """A fused program's links one by one through the device's own kernels, each into a
    scratch array of its dtype (the last into out)."""
    results: list[Any] = []
    for i, (name, args, dtype) in enumerate(program):
        operands = [inputs[ref] if kind == "input" else results[ref] if kind == "link" else ref
                    for kind, ref in args]
        target = out if i == len(program) - 1 else device.scratch(tuple(out.shape), dtype)
        device.elementwise(name, operands, target)
        results.append(target)


def check_fused_chains(device: Device, examples: int = 20) -> None:
    """A fused chain (`fused`, and `prepare_fused` run twice) gives the bits of its links run
    one by one on the same device; where `compiles_fused` is claimed, `_compile_fused` makes
    a kernel for a chain of one dtype."""
    rule = "fused chains"
    floats = _floats(device)

    @_draws(examples)
    def run(data: Any) -> None:
        n = data.draw(st.integers(1, 24), label="n")
        program, inputs, dtype = data.draw(chains(n, floats), label="chain")
        what = f"[{rule}] {type(device).__name__} {device.name}: chain {program}"
        links = run_on(device, lambda d, *v: unfused(d, program, v[:-1], v[-1]), inputs, (n,),
                       dtype)
        fused = run_on(device, lambda d, *v: d.fused(program, list(v[:-1]), v[-1]), inputs,
                       (n,), dtype)
        assert_same_bits(fused, links, what)

        def prepared(d: Device, *v: Any) -> None:
            run = d.prepare_fused(program, list(v[:-1]), v[-1])
            run()
            run()

        again = run_on(device, prepared, inputs, (n,), dtype)
        assert_same_bits(again, links, f"{what}, prepared and run twice")

    run()
    rng = np.random.default_rng(3)
    for dtype in floats:  # NOTE: ordinary values, where a chain that rounds once shows
        inputs = [(rng.normal(0, 3, 64)).astype(dtype) for _ in range(2)]
        program = [("mul", (("input", 0), ("number", 3.1)), dtype),
                   ("add", (("link", 0), ("input", 1)), dtype),
                   ("mul", (("link", 1), ("link", 0)), dtype),
                   ("sub", (("link", 2), ("number", 0.3)), dtype)]
        links = run_on(device, lambda d, *v, p=program: unfused(d, p, v[:-1], v[-1]), inputs,
                       (64,), dtype)
        fused = run_on(device, lambda d, *v, p=program: d.fused(p, list(v[:-1]), v[-1]),
                       inputs, (64,), dtype)
        assert_same_bits(fused, links, f"[{rule}] {type(device).__name__} {device.name}: "
                                       f"chain {program}")
    if device.capabilities.compiles_fused:
        x = to_device(device, np.arange(6, dtype=np.float32))
        out = to_device(device, np.zeros(6, np.float32))
        program = [("mul", (("input", 0), ("number", 2.0)), F32),
                   ("add", (("link", 0), ("input", 0)), F32)]
        _check(callable(device._compile_fused(program, [x], out)), rule, device,
               "claims compiles_fused, but _compile_fused made no kernel for a float32 chain")


def check_half_kernels(device: Device, examples: int = 20) -> None:
    """The two-byte floats' claims. `half_kernels`: the hooks themselves take float16 and
    bfloat16 views (elementwise kernels with the CPU's bits or bounds, products and reductions
    within their bounds). `half_elementwise`: `_half_elementwise` either takes a kernel, with
    the CPU's bits or bounds, or returns False having written nothing."""
    rule = "half kernels"
    record = device.capabilities
    halves = [d for d in HALVES if d in _floats(device)]
    if not (record.half_kernels or record.half_elementwise) or not halves:
        return
    cpu = _cpu()
    for dtype in halves:
        for op in optable.OPS:
            if op.name == "copy":
                continue
            operands = _operands(op.name, dtype)
            shape = operands[0].shape
            want = run_on(cpu, lambda d, *v, name=op.name: d.elementwise(name, v[:-1], v[-1]),
                          operands, shape, dtype)
            views = [to_device(device, x) for x in operands]
            sentinel = np.full(shape, 3.0, dtype)
            out = to_device(device, sentinel)
            what = f"[{rule}] {type(device).__name__} {device.name}: {op.name}({dtype})"
            with np.errstate(all="ignore"):
                if record.half_kernels:
                    hook = (device._unary, device._binary, device._ternary)[op.arity - 1]
                    hook(op.name, *views, out)
                    took = True
                else:
                    took = device._half_elementwise(op.name, views, out)
            got = device.to_host(out)
            if took:
                _compare(op.name, got, want, f"{what}, its hook on the halves", operands)
            else:
                assert_same_bits(got, sentinel, f"{what}: _half_elementwise returned False "
                                                f"but wrote out")
        if not record.half_kernels:
            continue
        rng = np.random.default_rng(5)
        a = rng.normal(0, 2, (5, 7)).astype(dtype)
        b = rng.normal(0, 2, (7, 3)).astype(dtype)
        want = run_on(cpu, lambda d, a, b, o: d.matmul(a, b, o), [a, b], (5, 3), dtype)
        got = run_on(device, lambda d, a, b, o: d._matmul(a, b, o), [a, b], (5, 3), dtype)
        _assert_within(got, want, _product_bound(a, b, want, dtype), f"[{rule}] "
                       f"{type(device).__name__} {device.name}: _matmul on {dtype} views")
        want = run_on(cpu, lambda d, a, o: d.reduce("sum", a, (0,), False, o), [a], (7,), dtype)
        got = run_on(device, lambda d, a, o: d._reduce("sum", a, (0,), False, o), [a], (7,),
                     dtype)
        bound = 2 * 5 * float(np.finfo(F32).eps) * np.abs(_wide(a)).sum(0) + _ulp(want)
        _assert_within(got, want, bound, f"[{rule}] {type(device).__name__} {device.name}: "
                                         f"_reduce on {dtype} views")
        want = run_on(cpu, lambda d, a, o: d.reduce("max", a, (0,), False, o), [a], (7,), dtype)
        got = run_on(device, lambda d, a, o: d._reduce_max(a, (0,), False, o), [a], (7,),
                     dtype)
        assert_same_bits(got, want, f"[{rule}] {type(device).__name__} {device.name}: "
                                    f"_reduce_max on {dtype} views")


def check_fast_kernels(device: Device, examples: int = 20) -> None:
    """Each kernel of the eager fast path's tables gives the bits of the device's own public
    kernel on the same operands: an elementwise one on a matrix and a row it broadcasts
    itself, "sum" and "mean" over an axis, "sub_scaled"."""
    rule = "fast kernels"
    record = device.capabilities
    for table, dtypes in ((record.fast_kernels, (F32, F64)),
                          (record.fast_half_kernels, HALVES)):
        if table is None:
            continue
        for dtype in (d for d in dtypes if d in _floats(device)):
            rng = np.random.default_rng(11)
            matrix = rng.normal(0, 3, (4, 6)).astype(dtype)
            row = rng.normal(0, 3, 6).astype(dtype)
            for name, kernel in table.items():
                what = f"[{rule}] {type(device).__name__} {device.name}: {name}({dtype})"
                _fast_against_public(device, name, kernel, matrix, row, dtype, what)


def _fast_against_public(device: Device, name: str, kernel: Callable[..., None],
                         matrix: np.ndarray, row: np.ndarray, dtype: np.dtype,
                         what: str) -> None:
    shape = matrix.shape
    number = _compute(dtype).type(0.75)
    if name in REDUCE_KERNELS:
        def fast(d: Device, x: Any, o: Any) -> None:
            kernel(x, o, (0,), False)
        want = run_on(device, lambda d, x, o: d.reduce(name, x, (0,), False, o), [matrix],
                      (shape[1],), dtype)
        assert_same_bits(run_on(device, fast, [matrix], (shape[1],), dtype), want, what)
        return
    if name == "sub_scaled":
        want = run_on(device, lambda d, a, b, o: d.sub_scaled(a, b, number, o),
                      [matrix, matrix[::-1].copy()], shape, dtype)
        got = run_on(device, lambda d, a, b, o: kernel(a, b, number, o),
                     [matrix, matrix[::-1].copy()], shape, dtype)
        assert_same_bits(got, want, what)
        return
    op = optable.BY_NAME[name]
    if optable.BOOL in op.operand_kinds:
        return  # NOTE: the fast path holds every operand to one float dtype
    inputs = [matrix, row, np.abs(row)][:op.arity]
    broadcast = [np.broadcast_to(x, shape).copy() for x in inputs]

    def public(d: Device, *v: Any) -> None:
        d.elementwise(name, v[:-1], v[-1])

    def fast(d: Device, *v: Any) -> None:
        kernel(*v)

    with np.errstate(all="ignore"):
        want = run_on(device, public, broadcast, shape, dtype)
        _compare(name, run_on(device, fast, inputs, shape, dtype), want,
                 f"{what}, the row broadcast by the kernel", broadcast)
        if op.arity > 1:
            mixed = [matrix, number, number][:op.arity]
            want = run_on(device, public, mixed, shape, dtype)
            _compare(name, run_on(device, fast, mixed, shape, dtype), want,
                     f"{what} with a number", mixed)


def check_host_memory(device: Device, examples: int = 20) -> None:
    """Where `host_memory` is claimed, a native view is host memory: NumPy reads it in place,
    and a later copyin shows through it."""
    rule = "host memory"
    if not device.capabilities.host_memory:
        return
    raw = device.raw_alloc(32)
    device.copyin(raw, 0, np.zeros(8, np.float32))
    view = device.array_view(raw, 0, (8,), np.float32, (4,))
    try:
        seen = np.asarray(view)
    except Exception as exc:
        _fail(rule, device, f"claims host_memory, but NumPy cannot read its view ({exc})")
    device.copyin(raw, 0, np.arange(8, dtype=np.float32))
    _check(np.array_equal(seen, np.arange(8)), rule, device,
           "claims host_memory, but a copyin does not show through a view NumPy holds")


def check_queues(device: Device, examples: int = 20) -> None:
    """Where `queues` is claimed: a home queue with a stable int key, events that complete,
    joins of queues; a foreign object is refused by queue_key with TypeError. Where not: no
    home queue, and queue_key, record_event, event_done, wait_event and join raise
    TypeError."""
    rule = "queues"
    if not device.capabilities.queues:
        _check(device.home_queue is None, rule, device, "has no queues but a home queue")
        for call in (lambda: device.queue_key(object()), lambda: device.record_event(object()),
                     lambda: device.event_done(object()), lambda: device.wait_event(object()),
                     lambda: device.join(object(), object())):
            try:
                call()
            except TypeError:
                continue
            _fail(rule, device, "a queue method of a device without queues raised no TypeError")
        device.synchronize()
        return
    home = device.home_queue
    _check(home is not None, rule, device, "claims queues but has no home queue")
    key = device.queue_key(home)
    _check(isinstance(key, (int, np.integer)) and device.queue_key(device.home_queue) == key,
           rule, device, f"the home queue's key {key!r} is not one stable int")
    x = to_device(device, np.arange(1000, dtype=np.float32))
    device.unary("exp", x, x)
    event = device.record_event(home)
    device.wait_event(event)
    _check(device.event_done(event), rule, device, "an event waited for is not done")
    device.join(home, home)
    device.synchronize()
    try:
        device.queue_key(object())
    except TypeError:
        pass
    else:
        _fail(rule, device, "queue_key took an object that is no queue")


def check_max_pool(device: Device, examples: int = 20) -> None:
    """max_pool2d gives the bits and the indices of PyTorch's CPU scan (`numpy_max_pool2d`):
    the first maximum of each window in row-major order, the last NaN, a window of -inf at
    its first element of x, the padding never taken; its backward gives the bits of
    `numpy_max_pool2d_backward` (the additions in its order; the two-byte floats accumulated
    in float32 and rounded once). Values drawn from a few, with NaN and -inf, so that windows
    tie."""
    rule = "max pooling"
    floats = _floats(device)

    @_draws(examples)
    def run(data: Any) -> None:
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
        kernel = (data.draw(st.integers(1, 3), label="kh"), data.draw(st.integers(1, 3)))
        stride = (data.draw(st.integers(1, 3), label="sh"), data.draw(st.integers(1, 3)))
        padding = (data.draw(st.integers(0, kernel[0] // 2), label="ph"),
                   data.draw(st.integers(0, kernel[1] // 2)))
        shape = (data.draw(st.integers(1, 2), label="n"), data.draw(st.integers(1, 3)),
                 data.draw(st.integers(kernel[0], 7), label="h"),
                 data.draw(st.integers(kernel[1], 7), label="w"))
        size = tuple((n + 2 * p - k) // s + 1
                     for n, k, s, p in zip(shape[2:], kernel, stride, padding))
        out_shape = (*shape[:2], *size)
        dtype = data.draw(st.sampled_from(floats), label="dtype")
        x = rng.choice(np.float32([0.0, 1.0, 2.0, -np.inf, np.nan]), size=shape).astype(dtype)
        want = np.empty(out_shape, dtype)
        want_at = np.empty(out_shape, np.int64)
        numpy_max_pool2d(x, kernel, stride, padding, want, want_at)
        views = [to_device(device, a) for a in (x, np.zeros(out_shape, dtype),
                                                np.full(out_shape, -7, np.int64))]
        device.max_pool2d(views[0], kernel, stride, padding, views[1], views[2])
        what = (f"[{rule}] {type(device).__name__} {device.name}: max_pool2d {shape} kernel "
                f"{kernel} stride {stride} padding {padding} ({dtype})")
        assert_same_bits(device.to_host(views[1]), want, what)
        assert_same_bits(device.to_host(views[2]), want_at, f"{what}, its indices")
        g = rng.standard_normal(out_shape).astype(dtype)
        wide = g.astype(np.float32) if dtype in HALVES else g
        expected = np.empty(shape, wide.dtype)
        numpy_max_pool2d_backward(wide, want_at, expected)
        got = run_on(device, lambda d, g, i, o: d.max_pool2d_backward(g, i, o), [g, want_at],
                     shape, dtype)
        assert_same_bits(got, expected.astype(dtype), f"{what}, its backward")

    run()


#: The rules, by name, in the order `check_device` runs them.
RULES: dict[str, Callable[..., None]] = {
    "required hooks": check_required_hooks,
    "capabilities": check_capabilities,
    "raw memory": check_raw_memory,
    "read-only memory": check_read_only_memory,
    "copies": check_copies,
    "views": check_views,
    "copy kernel": check_copy_kernel,
    "elementwise kernels": check_elementwise_kernels,
    "kernel layouts": check_kernel_layouts,
    "sub_scaled": check_sub_scaled,
    "casts": check_casts,
    "products": check_products,
    "reductions": check_reductions,
    "channel statistics": check_channel_stats,
    "convolution columns": check_conv_columns,
    "cross entropy": check_cross_entropy,
    "gather and scatter": check_gather_scatter,
    "max pooling": check_max_pool,
    "fused chains": check_fused_chains,
    "half kernels": check_half_kernels,
    "fast kernels": check_fast_kernels,
    "host memory": check_host_memory,
    "queues": check_queues,
}


def check_device(device: Device, examples: int = 20,
                 rules: Sequence[str] | None = None) -> list[str]:
    """Check every rule of `RULES` (or those named in `rules`) on `device`, in order; return
    the names of the rules it checked.

    Raises:
        AssertionError: the first rule the device breaks, named in brackets, with what was
            expected and what the device did.
        ValueError: `rules` names a rule the kit does not have.

    Example:
        >>> import backends
        >>> from backends import testing
        >>> testing.check_device(backends.get_device("cpu"), examples=2, rules=["views"])
        ['views']
    """
    names = list(RULES) if rules is None else list(rules)
    unknown = [name for name in names if name not in RULES]
    if unknown:
        raise ValueError(f"no rule {', '.join(map(repr, unknown))}; the rules are "
                         f"{', '.join(RULES)}")
    for name in names:
        RULES[name](device, examples=examples)
    return names
