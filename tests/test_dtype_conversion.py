"""What `runtime.tensor` makes of data of every NumPy dtype, in both byte orders, and of Python
numbers: the same values exactly, or a TypeError/ValueError that names the dtype and the value.
Never a wrapped, truncated, made-up infinite or rounded value it was not asked for.

The rules (runtime._tensor.host_array): without a dtype, data keeps a dtype of DTYPES (float16,
bfloat16 and every integer of 8 to 64 bits among them) and otherwise converts only where every
value survives (a non-native byte order, a longdouble holding float64 values, ml_dtypes' float8
e5m2 to float64); ml_dtypes' other small types, complex, strings, objects and dates are refused.
With a dtype, a float dtype rounds to nearest but never overflows to infinity; an integer or
bool dtype takes whole values in range only.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import runtime
from backends.base import ieee
from runtime._tensor import DTYPES
from runtime.dtypes import kind


def _sized(t: Any) -> np.dtype:
    dtype = np.dtype(t)
    if dtype.num >= 256:  # a user dtype (ml_dtypes, which runtime imports): as it is
        return dtype
    sized = {"U": "U3", "S": "S3", "V": "V8", "M": "datetime64[s]", "m": "timedelta64[s]"}
    return np.dtype(sized.get(dtype.kind, t))


def _every_dtype() -> list[np.dtype]:
    """Every scalar type NumPy names (sctypeDict: ml_dtypes' too, once imported), sized where
    NumPy's is empty, plus the C integer types that equal a fixed-width one, in both byte orders
    where that means anything."""
    types = [_sized(t) for t in set(np.sctypeDict.values())]
    types += [np.dtype(c) for c in "bBhHiIlLqQpPefdg?"]
    found: dict[str, np.dtype] = {}
    for dtype in types:
        for order in "<>":
            swapped = dtype.newbyteorder(order)
            found.setdefault(f"{swapped.str}{swapped.char}", swapped)
    return sorted(found.values(), key=lambda d: (d.kind, d.itemsize, d.str, d.char))


EVERY_DTYPE = _every_dtype()


def _edges(native: np.dtype) -> list[Any]:
    """Values at the edges of `native`'s range, and some that other dtypes cannot hold."""
    if native.kind == "b":
        return [False, True]
    if native.kind in "iu":
        info = np.iinfo(native)
        values = [info.min, info.min + 1, 0, 1, info.max - 1, info.max, 2**31, 2**53 + 1,
                  2**63 - 1, 2**63, -(2**31) - 1, -1]
        return [v for v in values if info.min <= v <= info.max]
    if native.num >= 256 and native != np.dtype(ml_dtypes.bfloat16):
        return [np.zeros((), native).item(), np.ones((), native).item()]
    if kind(native) == "f":
        info = ml_dtypes.finfo(native)
        values = [info.max, -info.max, info.tiny, info.smallest_subnormal, 0.0, -0.0, math.nan,
                  math.inf, -math.inf, 0.1, 1.5, -2.5, 2.0**24 + 1, 2.0**60]
        values = [ieee(native.type, v) for v in values]
        if native.itemsize > 8:  # a longdouble: values float64 cannot hold
            values += [native.type(1) / 3, native.type(2**64 + 1), native.type(info.max) / 2]
        return values
    return [np.zeros((), native).item()]


@st.composite
def arrays_of_every_dtype(draw) -> np.ndarray:
    """An array of any NumPy dtype and byte order, 0-d or n-d, with values at its edges."""
    dtype = draw(st.sampled_from(EVERY_DTYPE))
    native = dtype.newbyteorder("=")
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=3))
    elements = st.sampled_from(_edges(native))
    if native.kind in "biuf" and native.itemsize <= 8 and native.num < 256:
        elements |= hnp.from_dtype(native)
    values = draw(st.lists(elements, min_size=math.prod(shape), max_size=math.prod(shape)))
    return np.array(values, native).reshape(shape).astype(dtype)


def exact(v: Any) -> Any:
    """A number's exact value (a Fraction), 'nan', or an infinity: equal exactly when the
    numbers are equal, whatever their types."""
    if isinstance(v, (bool, np.bool_)):
        return Fraction(int(v))
    if isinstance(v, (int, np.integer)):
        return Fraction(int(v))
    if isinstance(v, np.generic) and v.dtype.num >= 256:
        v = float(v)  # ml_dtypes' small floats: exact in a float
    if v != v:
        return "nan"
    if v in (math.inf, -math.inf):
        return float(v)
    return Fraction(*v.as_integer_ratio())


def _implicit(dtype: np.dtype) -> np.dtype | None:
    """What runtime.tensor(data of `dtype`) should hold: None where it must refuse the dtype."""
    native = dtype.newbyteorder("=")
    if native in DTYPES:
        return native
    if native.kind not in "biuf":
        return None
    return {"b": np.dtype(bool), "i": np.dtype("int64"), "u": np.dtype("int64"),
            "f": np.dtype("float64")}[native.kind]


def _holds(target: np.dtype, v: Any) -> bool:
    """True when `target` holds the number `v` exactly."""
    if kind(target) == "f":
        return exact(ieee(target.type, v)) == exact(v)
    value = exact(v)
    if not isinstance(value, Fraction) or value.denominator != 1:
        return False
    low, high = (0, 1) if target.kind == "b" else (np.iinfo(target).min, np.iinfo(target).max)
    return low <= value <= high


def _overflows(target: np.dtype, v: Any) -> bool:
    """True when rounding the finite `v` to the float dtype `target` gives an infinity."""
    return exact(v) not in ("nan", math.inf, -math.inf) and not math.isfinite(
        ieee(target.type, v))


def _shown(v: np.generic) -> str:
    """How a message shows the number `v`."""
    return str(v) if v.dtype.itemsize > 8 else repr(v.item())


def _assert_same_values(arr: np.ndarray, out: np.ndarray) -> None:
    assert out.shape == arr.shape and out.dtype in DTYPES
    assert [exact(v) for v in out.ravel()] == [exact(v) for v in arr.ravel()]
    # the same, said as NumPy says it: arr in out's dtype is out, and out back is arr
    wide = (lambda a: a.astype(np.float64)) if max(arr.dtype.num, out.dtype.num) >= 256 else (
        lambda a: a)  # NOTE: NumPy's testing sees no NaN in ml_dtypes' arrays
    np.testing.assert_array_equal(wide(ieee(arr.astype, out.dtype)), wide(out))
    np.testing.assert_array_equal(wide(ieee(out.astype, arr.dtype)), wide(arr))


@settings(max_examples=300)
@given(arr=arrays_of_every_dtype())
def test_a_tensor_of_any_array_holds_its_values_exactly_or_refuses_clearly(arr):
    target = _implicit(arr.dtype)
    if target is None:  # complex, strings, objects, dates, ml_dtypes' int4, float8 e4m3...
        with pytest.raises(TypeError, match=re.escape(f"cannot make a tensor from data of "
                                                      f"dtype {arr.dtype}")):
            runtime.tensor(arr)
        return
    misfits = [v for v in arr.ravel() if not _holds(target, v)]
    if misfits:  # a uint64 above int64, a longdouble float64 cannot hold
        with pytest.raises(ValueError) as info:
            runtime.tensor(arr)
        message = str(info.value)
        assert f"cannot make a tensor of {target} from {arr.dtype} data: " in message
        assert any(_shown(v) in message for v in misfits), message  # the value
        assert "pass dtype=" in message, message  # the way out
        return
    _assert_same_values(arr, runtime.tensor(arr).numpy())


@settings(max_examples=300)
@given(arr=arrays_of_every_dtype(), target=st.sampled_from(DTYPES))
def test_a_tensor_of_any_array_in_a_dtype_never_wraps_truncates_or_overflows(arr, target):
    if kind(arr.dtype) not in "biuf":
        with pytest.raises(TypeError, match=re.escape(f"cannot make a tensor of {target} from "
                                                      f"data of dtype {arr.dtype}")):
            runtime.tensor(arr, dtype=target)
        return
    if kind(target) == "f":  # rounds to nearest, as its meaning; never to an infinity
        bad = next((v for v in arr.ravel() if _overflows(target, v)), None)
    else:  # whole values in range, nothing else
        bad = next((v for v in arr.ravel() if not _holds(target, v)), None)
    if bad is not None:
        with pytest.raises(ValueError, match=re.escape(f"cannot make a tensor of {target} "
                                                       f"from {arr.dtype} data: ")) as info:
            runtime.tensor(arr, dtype=target)
        refused = [v for v in arr.ravel() if (_overflows(target, v) if kind(target) == "f"
                                              else not _holds(target, v))]
        assert any(_shown(v) in str(info.value) for v in refused), str(info.value)
        return
    out = runtime.tensor(arr, dtype=target).numpy()
    assert out.dtype == target and out.shape == arr.shape
    expected = ieee(arr.astype, target)
    assert [exact(v) for v in out.ravel()] == [exact(v) for v in expected.ravel()]
    if all(_holds(target, v) for v in arr.ravel()):
        _assert_same_values(arr, out)


python_numbers = st.one_of(st.integers(-(2**70), 2**70), st.integers(-(2**64), 2**65),
                           st.integers(-(2**60), 2**60), st.floats(), st.booleans(),
                           st.sampled_from([2**53 + 1, -(2**53) - 1, 2**53, 2**63 - 1, 2**63,
                                            -(2**63), 2**64 - 1, 2**64]))


@settings(max_examples=300)
@given(values=st.lists(python_numbers, min_size=1, max_size=4))
def test_a_tensor_of_python_numbers_holds_them_exactly_or_refuses_clearly(values):
    ints = [v for v in values if type(v) is int]
    in_int64 = all(-(2**63) <= v < 2**63 for v in ints)
    try:
        out = runtime.tensor(values).numpy()
    except ValueError as exc:  # an integer that the dtype NumPy infers cannot hold
        message = str(exc)
        assert message.startswith("cannot make a tensor"), message
        assert not in_int64 or any(type(v) is float for v in values), message  # NOTE: int64
        # it names an integer that no dtype NumPy may infer holds (so the refusal was due)...
        assert any(repr(v) in message for v in ints
                   if not -(2**63) <= v < 2**63 or int(float(v)) != v), message
        assert "dtype='float64'" in message, message  # ...and the way out
        return
    assert [exact(v) for v in out.tolist()] == [exact(v) for v in values]


@pytest.mark.parametrize(("data", "dtype", "expected"), [
    pytest.param(np.array([-128, 127], np.int8), None, np.array([-128, 127], np.int8),
                 id="int8-stays-int8"),
    pytest.param(np.array([0, 2**16 - 1], np.uint16), None, np.array([0, 65535], np.uint16),
                 id="uint16"),
    pytest.param(np.array([0, 2**64 - 1], np.uint64), None,
                 np.array([0, 2**64 - 1], np.uint64), id="uint64-whole-range"),
    pytest.param(np.float16([0.5, 65504]), None, np.float16([0.5, 65504]), id="float16-kept"),
    pytest.param([0.1, 65520.0 - 1], "float16", np.float16([0.1, 65504]),
                 id="float16-rounds-to-nearest"),
    pytest.param([1 / 3, 3.0e38], "bfloat16", np.array([1 / 3, 3.0e38], ml_dtypes.bfloat16),
                 id="bfloat16-rounds-to-nearest"),
    pytest.param([300, -2], "int16", np.array([300, -2], np.int16), id="int16"),
    pytest.param(np.array([1.5, -0.0], ">f8"), None, np.array([1.5, -0.0]), id="big-endian"),
    pytest.param(np.array([7, -7], ">i4"), None, np.array([7, -7], np.int32),
                 id="big-endian-int32-stays-int32"),
    pytest.param(np.float16([0.5, 65504]), "float32", np.float32([0.5, 65504]),
                 id="float16-widened-on-request"),
    pytest.param(np.array([0.5, -3], ml_dtypes.bfloat16), "float64", np.array([0.5, -3.0]),
                 id="bfloat16-widened-on-request"),
    pytest.param([0.1], "float32", np.float32([0.1]), id="float32-rounds-to-nearest"),
    pytest.param([2**53 + 1], "float64", np.array([2.0**53]), id="float64-rounds-an-int"),
    pytest.param([2**70], "float64", np.array([2.0**70]), id="big-int-as-float"),
    pytest.param([3.0, -2.0], "int32", np.array([3, -2], np.int32), id="whole-floats-to-int"),
    pytest.param([math.inf, math.nan], "float32", np.float32([math.inf, math.nan]),
                 id="float32-keeps-inf-and-nan"),
    pytest.param([1.0, 0.0], "bool", np.array([True, False]), id="zero-and-one-to-bool"),
])
def test_lossless_and_requested_conversions_keep_working(data, dtype, expected):
    out = runtime.tensor(data, dtype=dtype).numpy()
    assert out.dtype == expected.dtype
    np.testing.assert_array_equal(out, expected)


def test_an_array_of_a_held_dtype_is_used_as_it_is():
    """host_array is on a graph's replay path: a C-contiguous array of a dtype of DTYPES is
    returned as it is, neither copied nor converted."""
    from runtime._tensor import host_array

    for dtype in DTYPES:
        arr = np.zeros((2, 3), dtype)
        assert host_array(arr) is arr
        assert host_array(arr, arr.dtype) is arr
