"""Ops against NumPy: values, dtypes, broadcasting, out=, in place, matmul shapes, reductions and
the error catalogue."""

from __future__ import annotations

import operator
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import allocators
import runtime
from helpers import BINARY_REFERENCE, UNARY_REFERENCE
from runtime import ops

FLOATS = [np.float32, np.float64]
#: The public elementwise ops (the "*_backward" kernels are autograd's, tested in test_autograd).
UNARY = {name: f for name, f in UNARY_REFERENCE.items() if name in ops.__all__}
BINARY = {name: f for name, f in BINARY_REFERENCE.items() if name in ops.__all__}
shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)


def tolerance(dtype):
    return {"rtol": 2e-6, "atol": 1e-6} if dtype == np.float32 else {"rtol": 1e-12, "atol": 1e-12}


def as_tensor(a, strided, alloc=None):
    """A tensor equal to `a`: contiguous, or (strided) a view of every other element of a bigger
    block, so that kernels also see non-unit strides."""
    if not strided or a.ndim == 0:
        return runtime.tensor(a, allocator=alloc)
    wide = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
    wide[..., ::2] = a
    return runtime.tensor(wide, allocator=alloc)[..., ::2]


def elements(op, dtype):
    """Bounded values; positive ones for log and for divisors (no 0, no warnings)."""
    if op in ("log", "div", "sqrt"):
        return st.floats(0.125, 100, width=32 if dtype == np.float32 else 64)
    return st.floats(-20, 20, width=32 if dtype == np.float32 else 64)


# ---------------------------------------------------------------------- elementwise
@pytest.mark.parametrize("name", sorted(UNARY))
@given(data=st.data(), dtype=st.sampled_from(FLOATS), strided=st.booleans())
@settings(max_examples=25)
def test_unary_ops_match_numpy(name, data, dtype, strided):
    a = data.draw(hnp.arrays(dtype, shapes, elements=elements(name, dtype)), label="a")
    alloc = allocators.create("direct", "cpu")
    x = as_tensor(a, strided, alloc)
    got = getattr(ops, name)(x)
    assert got.dtype == dtype
    assert got.shape == a.shape
    assert got.block is not x.block
    assert got.block.allocator is alloc
    np.testing.assert_allclose(got.numpy(), UNARY[name](a), **tolerance(dtype))
    np.testing.assert_array_equal(x.numpy(), a)  # the input is untouched


@st.composite
def broadcast_pairs(draw, name):
    dtype = draw(st.sampled_from(FLOATS))
    pair = draw(hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=4,
                                                  min_side=0, max_side=4))
    a, b = (draw(hnp.arrays(dtype, shape, elements=elements(name, dtype)))
            for shape in pair.input_shapes)
    return a, b


@pytest.mark.parametrize("name", sorted(BINARY))
@given(data=st.data(), strided=st.booleans())
@settings(max_examples=40)
def test_binary_ops_broadcast_like_numpy(name, data, strided):
    a, b = data.draw(broadcast_pairs(name), label="a, b")
    x, y = as_tensor(a, strided), as_tensor(b, not strided)
    got = getattr(ops, name)(x, y)
    expected = BINARY[name](a, b)
    assert got.shape == expected.shape
    assert got.dtype == a.dtype
    assert got.block is not x.block and got.block is not y.block
    np.testing.assert_allclose(got.numpy(), expected, **tolerance(a.dtype))


@pytest.mark.parametrize("name", sorted(BINARY))
@given(data=st.data(), dtype=st.sampled_from(FLOATS),
       scalar=st.floats(0.5, 8) | st.integers(1, 9) | st.sampled_from([np.float64(2.5),
                                                                      np.float32(0.25)]))
@settings(max_examples=30)
def test_binary_ops_take_a_number_on_either_side(name, data, dtype, scalar):
    a = data.draw(hnp.arrays(dtype, shapes, elements=elements(name, dtype)), label="a")
    x = runtime.tensor(a)
    right = getattr(ops, name)(x, scalar)
    left = getattr(ops, name)(scalar, x)
    assert right.dtype == dtype and left.dtype == dtype
    assert right.shape == a.shape and left.shape == a.shape
    s = dtype(scalar)
    np.testing.assert_allclose(right.numpy(), BINARY[name](a, s), **tolerance(dtype))
    np.testing.assert_allclose(left.numpy(), BINARY[name](s, a), **tolerance(dtype))


OPERATORS = [
    (operator.add, np.add), (operator.sub, np.subtract), (operator.mul, np.multiply),
    (operator.truediv, np.divide),
]


@pytest.mark.parametrize("op, reference", OPERATORS)
@given(data=st.data(), dtype=st.sampled_from(FLOATS))
@settings(max_examples=20)
def test_operators_match_numpy(op, reference, data, dtype):
    a = data.draw(hnp.arrays(dtype, (2, 3), elements=elements("div", dtype)), label="a")
    b = data.draw(hnp.arrays(dtype, (3,), elements=elements("div", dtype)), label="b")
    x, y = runtime.tensor(a), runtime.tensor(b)
    for got, expected in [(op(x, y), reference(a, b)), (op(x, 2.0), reference(a, dtype(2))),
                          (op(3.0, x), reference(dtype(3), a))]:
        assert isinstance(got, runtime.Tensor)
        assert got.dtype == dtype
        np.testing.assert_allclose(got.numpy(), expected, **tolerance(dtype))
    np.testing.assert_array_equal((-x).numpy(), -a)


def test_matmul_operator():
    a = np.arange(6.0).reshape(2, 3)
    b = np.arange(12.0).reshape(3, 4)
    got = runtime.tensor(a) @ runtime.tensor(b)
    np.testing.assert_allclose(got.numpy(), a @ b)


# ---------------------------------------------------------------------- out=
@pytest.mark.parametrize("name", sorted(UNARY))
@given(data=st.data(), dtype=st.sampled_from(FLOATS))
@settings(max_examples=15)
def test_unary_out_is_written_and_returned(name, data, dtype):
    a = data.draw(hnp.arrays(dtype, shapes, elements=elements(name, dtype)), label="a")
    x = runtime.tensor(a)
    out = runtime.empty(a.shape, dtype)
    version = out.version
    result = getattr(ops, name)(x, out=out)
    assert result is out
    assert out.version > version
    np.testing.assert_allclose(out.numpy(), UNARY[name](a), **tolerance(dtype))


@pytest.mark.parametrize("name", sorted(BINARY))
@given(data=st.data())
@settings(max_examples=15)
def test_binary_out_is_written_and_returned(name, data):
    a, b = data.draw(broadcast_pairs(name), label="a, b")
    expected = BINARY[name](a, b)
    base = runtime.zeros((2,) + expected.shape, a.dtype)
    out = base[1]  # a view: the result lands inside a bigger block
    result = getattr(ops, name)(runtime.tensor(a), runtime.tensor(b), out=out)
    assert result is out
    np.testing.assert_allclose(out.numpy(), expected, **tolerance(a.dtype))
    np.testing.assert_array_equal(base[0].numpy(), np.zeros(expected.shape, a.dtype))


def test_inputs_broadcast_to_the_shape_of_out():
    out = runtime.zeros((2, 3), "float64")
    ops.add(runtime.tensor(np.arange(3.0)), 1.0, out=out)
    np.testing.assert_array_equal(out.numpy(), np.tile(np.arange(3.0) + 1, (2, 1)))
    ops.copy(runtime.tensor(np.array([[5.0], [6.0]])), out=out)
    np.testing.assert_array_equal(out.numpy(), [[5.0] * 3, [6.0] * 3])


@pytest.mark.parametrize("name", sorted(UNARY))
@given(data=st.data(), dtype=st.sampled_from(FLOATS), strided=st.booleans())
@settings(max_examples=15)
def test_unary_in_place(name, data, dtype, strided):
    a = data.draw(hnp.arrays(dtype, shapes, elements=elements(name, dtype)), label="a")
    x = as_tensor(a, strided)
    result = getattr(ops, name)(x, out=x)
    assert result is x
    np.testing.assert_allclose(x.numpy(), UNARY[name](a), **tolerance(dtype))


@pytest.mark.parametrize("name", sorted(BINARY))
@given(data=st.data(), which=st.sampled_from(["a", "b", "both"]))
@settings(max_examples=15)
def test_binary_in_place(name, data, which):
    dtype = data.draw(st.sampled_from(FLOATS), label="dtype")
    a = data.draw(hnp.arrays(dtype, shapes, elements=elements(name, dtype)), label="a")
    b = data.draw(hnp.arrays(dtype, a.shape, elements=elements(name, dtype)), label="b")
    x, y = runtime.tensor(a), runtime.tensor(b)
    if which == "a":
        result, expected = getattr(ops, name)(x, y, out=x), BINARY[name](a, b)
    elif which == "b":
        result, expected = getattr(ops, name)(y, x, out=x), BINARY[name](b, a)
    else:
        result, expected = getattr(ops, name)(x, x, out=x), BINARY[name](a, a)
    assert result is x
    np.testing.assert_allclose(x.numpy(), expected, **tolerance(dtype))


def test_relu_in_place_on_a_view_leaves_the_rest_alone():
    a = np.array([[-1.0, 2.0, -3.0], [4.0, -5.0, 6.0]])
    t = runtime.tensor(a)
    row = t[1]
    ops.relu(row, out=row)
    np.testing.assert_array_equal(t.numpy(), [[-1.0, 2.0, -3.0], [4.0, 0.0, 6.0]])


# ---------------------------------------------------------------------- matmul
@st.composite
def matmul_operands(draw):
    dtype = draw(st.sampled_from(FLOATS))
    n, k, m = (draw(st.integers(0, 5)) for _ in range(3))
    kind = draw(st.sampled_from(["2d", "1d@2d", "2d@1d", "1d@1d", "batched", "batched@2d",
                                 "2d@batched", "broadcast batch"]))
    batch = draw(st.integers(1, 3))
    a_shape, b_shape = {
        "2d": ((n, k), (k, m)),
        "1d@2d": ((k,), (k, m)),
        "2d@1d": ((n, k), (k,)),
        "1d@1d": ((k,), (k,)),
        "batched": ((batch, n, k), (batch, k, m)),
        "batched@2d": ((batch, n, k), (k, m)),
        "2d@batched": ((n, k), (batch, k, m)),
        "broadcast batch": ((batch, 1, n, k), (2, k, m)),
    }[kind]
    values = st.floats(-10, 10, width=32 if dtype == np.float32 else 64)
    return (draw(hnp.arrays(dtype, a_shape, elements=values)),
            draw(hnp.arrays(dtype, b_shape, elements=values)))


@given(operands=matmul_operands(), transposed=st.booleans())
@settings(max_examples=120)
def test_matmul_matches_numpy(operands, transposed):
    a, b = operands
    x = runtime.tensor(a)
    if transposed and b.ndim >= 2:
        # b as the transpose of a contiguous tensor: matmul must read strides right
        y = runtime.tensor(np.ascontiguousarray(np.swapaxes(b, -1, -2))).transpose(
            *range(b.ndim - 2), b.ndim - 1, b.ndim - 2)
    else:
        y = runtime.tensor(b)
    expected = np.matmul(a, b)
    got = ops.matmul(x, y)
    assert got.shape == expected.shape
    assert got.dtype == a.dtype
    assert got.block is not x.block and got.block is not y.block
    scale = 1 + np.abs(a).max(initial=0) * np.abs(b).max(initial=0) * max(a.shape[-1], 1)
    np.testing.assert_allclose(got.numpy(), expected, rtol=tolerance(a.dtype)["rtol"] * 10,
                               atol=tolerance(a.dtype)["atol"] * scale)
    out = runtime.empty(expected.shape, a.dtype)
    assert ops.matmul(x, y, out=out) is out
    np.testing.assert_array_equal(out.numpy(), got.numpy())


# ---------------------------------------------------------------------- reductions
@st.composite
def reductions(draw, min_side=0):
    dtype = draw(st.sampled_from(FLOATS))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=min_side, max_side=5))
    a = draw(hnp.arrays(dtype, shape, elements=st.floats(-10, 10, width=32)))
    ndim = len(shape)
    if ndim == 0:
        return a, draw(st.sampled_from([None, ()])), draw(st.booleans())
    # None, one axis, or a tuple of distinct axes (odd ones counted from the end)
    axis = draw(st.none()
                | st.integers(-ndim, ndim - 1)
                | st.lists(st.integers(0, ndim - 1), unique=True, max_size=ndim).map(
                    lambda axes: tuple(a - ndim if a % 2 else a for a in axes)))
    return a, axis, draw(st.booleans())


@pytest.mark.parametrize("name", ["sum", "mean"])
@given(case=st.data(), strided=st.booleans())
@settings(max_examples=80)
def test_reductions_match_numpy(name, case, strided):
    a, axis, keepdims = case.draw(reductions(min_side=0), label="case")
    x = as_tensor(a, strided)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")  # NOTE: np.mean of nothing warns; ops.mean must not
        expected = getattr(np, name)(a, axis=axis, keepdims=keepdims)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = getattr(ops, name)(x, axis=axis, keepdims=keepdims)
    assert got.shape == np.shape(expected)
    assert got.dtype == a.dtype
    assert got.block is not x.block
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5 if a.dtype == np.float32
                               else 1e-12, atol=1e-4 if a.dtype == np.float32 else 1e-12)
    out = runtime.empty(np.shape(expected), a.dtype)
    assert getattr(ops, name)(x, axis=axis, keepdims=keepdims, out=out) is out
    np.testing.assert_array_equal(out.numpy(), got.numpy())


@pytest.mark.parametrize("axis, keepdims, expected", [
    (None, False, 15.0), (0, False, [3.0, 5.0, 7.0]), (1, True, [[3.0], [12.0]]),
    ((0, 1), True, [[15.0]]), (-1, False, [3.0, 12.0]), ((), False, [[0, 1, 2], [3, 4, 5]]),
])
def test_sum_examples(axis, keepdims, expected):
    x = runtime.tensor(np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(ops.sum(x, axis=axis, keepdims=keepdims).numpy(), expected)


def test_mean_keeps_float32():
    x = runtime.tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    got = ops.mean(x, axis=0)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.numpy(), [1.5, 2.5, 3.5])


# ---------------------------------------------------------------------- numerics
@pytest.mark.parametrize("dtype", FLOATS)
def test_sigmoid_of_large_magnitudes_is_exact_and_silent(dtype):
    x = runtime.tensor(np.array([-1000.0, -100.0, 0.0, 100.0, 1000.0], dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = ops.sigmoid(x).numpy()
    assert got.dtype == dtype
    np.testing.assert_array_equal(got[[0, -1]], [0.0, 1.0])
    assert got[2] == 0.5
    assert 0 <= got[1] < 1e-40 and got[3] == 1.0


@given(a=hnp.arrays(np.float64, shapes, elements=st.floats(-700, 700)))
def test_sigmoid_stays_in_the_unit_interval_and_is_symmetric(a):
    x = runtime.tensor(a)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = ops.sigmoid(x).numpy()
        flipped = ops.sigmoid(-x).numpy()
    assert np.all((s >= 0) & (s <= 1))
    np.testing.assert_allclose(s + flipped, 1.0, atol=1e-15)


# ---------------------------------------------------------------------- errors
def f64(*shape):
    return runtime.tensor(np.ones(shape))


def test_shapes_that_do_not_broadcast_name_both_shapes():
    for name in BINARY:
        with pytest.raises(ValueError) as info:
            getattr(ops, name)(f64(2, 3), f64(4))
        message = str(info.value)
        assert name in message and "(2, 3)" in message and "(4,)" in message


def test_out_that_does_not_broadcast_is_named():
    with pytest.raises(ValueError, match=r"\(3,\).*\(2,\)"):
        ops.neg(f64(3), out=f64(2))


def test_matmul_misaligned_shapes_name_both_shapes():
    for a, b in [((2, 3), (4, 2)), ((3,), (4,)), ((2, 3), (2,)), ((5, 2, 3), (4, 3, 2))]:
        with pytest.raises(ValueError) as info:
            ops.matmul(f64(*a), f64(*b))
        message = str(info.value)
        assert "matmul" in message
        assert str(a) in message or str(a[:-2]) in message
        assert str(b) in message or str(b[:-2]) in message


def test_matmul_of_a_0d_operand_raises():
    with pytest.raises(ValueError, match="matmul"):
        ops.matmul(f64(), f64(2))


def test_mixed_dtypes_name_both_dtypes():
    a32 = runtime.tensor(np.ones(3, np.float32))
    a64 = f64(3)
    for call in [lambda: ops.add(a32, a64), lambda: ops.matmul(a32, a64),
                 lambda: ops.copy(a32, out=runtime.empty(3, "float64")), lambda: a64 * a32]:
        with pytest.raises(TypeError) as info:
            call()
        assert "float32" in str(info.value) and "float64" in str(info.value)


@pytest.mark.parametrize("dtype", ["int32", "int64", "uint8", "bool"])
def test_non_float_tensors_are_rejected_naming_the_op(dtype):
    x = runtime.tensor(np.ones(3, dtype))
    m = runtime.tensor(np.ones((3, 3), dtype))
    calls = {"add": lambda: ops.add(x, x), "exp": lambda: ops.exp(x), "relu": lambda: ops.relu(x),
             "matmul": lambda: ops.matmul(m, m), "sum": lambda: ops.sum(x),
             "mean": lambda: ops.mean(x), "mul": lambda: ops.mul(x, 2.0)}
    for name, call in calls.items():
        with pytest.raises(TypeError) as info:
            call()
        assert name in str(info.value) and dtype in str(info.value)


@pytest.mark.parametrize("dtype", ["int32", "int64", "uint8", "bool"])
def test_copy_works_for_every_dtype(dtype):
    a = np.arange(6).reshape(2, 3).astype(dtype)
    x = runtime.tensor(a)
    got = ops.copy(x.T)
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got.numpy(), a.T)


def test_out_of_the_wrong_shape_or_dtype():
    x = f64(2, 3)
    with pytest.raises(ValueError, match="out has shape"):
        ops.matmul(x, f64(3, 2), out=f64(3, 3))
    with pytest.raises(ValueError, match="out"):
        ops.sum(x, axis=0, out=f64(2))
    with pytest.raises(TypeError, match="dtype"):
        ops.exp(x, out=runtime.empty((2, 3), "float32"))
    with pytest.raises(TypeError, match="dtype"):
        ops.mean(x, out=runtime.empty((), "float32"))
    with pytest.raises(TypeError):
        ops.exp(x, out=np.empty((2, 3)))


def test_out_that_overlaps_itself_is_refused():
    base = runtime.zeros(3, "float64")
    stretched = runtime.Tensor(base.block, (3,), "float64", strides=(0,))  # one element, 3 times
    with pytest.raises(ValueError, match="overlap"):
        ops.neg(f64(3), out=stretched)


@pytest.mark.parametrize("axis", [2, -3, (0, 2), (5,)])
def test_axis_out_of_range(axis):
    for name in ("sum", "mean"):
        with pytest.raises(ValueError) as info:
            getattr(ops, name)(f64(2, 3), axis=axis)
        assert "out of range" in str(info.value) and name in str(info.value)


@pytest.mark.parametrize("axis", [(0, 0), (1, -1), [0, 1, 0]])
def test_repeated_axis(axis):
    with pytest.raises(ValueError, match="repeat"):
        ops.sum(f64(2, 3), axis=axis)


@pytest.mark.parametrize("axis", [1.0, "0", (0, None), True])
def test_axis_of_the_wrong_type(axis):
    with pytest.raises(TypeError, match="axis"):
        ops.mean(f64(2, 3), axis=axis)


def test_non_tensor_operands_are_refused():
    x = f64(3)
    with pytest.raises(TypeError):
        ops.add(x, np.ones(3))
    with pytest.raises(TypeError):
        ops.add(x, "1")
    with pytest.raises(TypeError):
        ops.add(1.0, 2.0)
    with pytest.raises(TypeError):
        ops.add(x, True)
    with pytest.raises(TypeError):
        ops.exp(np.ones(3))
    with pytest.raises(TypeError):
        ops.matmul(x, [1.0, 2.0, 3.0])


OPS_READING_X = {
    "add": lambda x, y: ops.add(y, x), "sub": lambda x, y: ops.sub(x, 1.0),
    "mul": lambda x, y: x * y, "div": lambda x, y: ops.div(2.0, x),
    "neg": lambda x, y: ops.neg(x), "exp": lambda x, y: ops.exp(x),
    "log": lambda x, y: ops.log(x), "tanh": lambda x, y: ops.tanh(x),
    "sigmoid": lambda x, y: ops.sigmoid(x), "relu": lambda x, y: ops.relu(x, out=y),
    "matmul": lambda x, y: ops.matmul(y, x), "sum": lambda x, y: ops.sum(x, axis=0),
    "mean": lambda x, y: ops.mean(x), "copy": lambda x, y: ops.copy(x),
}


@pytest.mark.parametrize("name", sorted(OPS_READING_X))
def test_reading_an_unwritten_input_raises_naming_the_op(name):
    x = runtime.empty((3, 3), "float64")
    y = f64(3, 3)
    version = y.version
    with pytest.raises(runtime.UninitializedMemoryError) as info:
        OPS_READING_X[name](x, y)
    assert name in str(info.value)
    assert f"block #{x.block.id}" in str(info.value)
    assert y.version == version  # nothing was written
    np.testing.assert_array_equal(y.numpy(), np.ones((3, 3)))


@given(a=hnp.arrays(np.float32, hnp.array_shapes(min_dims=0, max_dims=3, min_side=1),
                    elements=st.floats(-5, 5, width=32)))
@settings(max_examples=30)
def test_float32_stays_float32_through_a_chain(a):
    x = runtime.tensor(a)
    y = ops.relu(ops.tanh(x) * 2.0 - 0.5) / 3.0 + ops.exp(ops.neg(x))
    total = ops.mean(ops.sum(y, axis=0, keepdims=True) if a.ndim else y)
    assert y.dtype == np.float32 and total.dtype == np.float32
    assert total.numpy().dtype == np.float32
    expected = np.maximum(np.tanh(a) * 2 - 0.5, 0) / 3 + np.exp(-a)
    np.testing.assert_allclose(y.numpy(), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(total.item(), expected.sum(axis=0).mean() if a.ndim else
                               expected.mean(), rtol=1e-5)


# ---------------------------------------------------------------------- empty reductions
def _reduction_devices() -> dict[str, tuple]:
    """(device, allocator) of every backend here and of the naive test device."""
    import backends
    from naive_device import NaiveDevice

    found = {kind: backends.get_device(kind) for kind in backends.available()}
    found["naive"] = NaiveDevice()
    return {name: (dev, allocators.create("direct", dev)) for name, dev in found.items()}


REDUCTION_DEVICES = _reduction_devices()


@pytest.mark.parametrize("where", sorted(REDUCTION_DEVICES))
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("shape, axis", [((0,), None), ((0, 3), 0), ((3, 0), 1),
                                         ((2, 0, 3), (1,)), ((0, 3), None), ((3, 0), 0)])
def test_a_reduction_over_nothing_is_silent(where, dtype, shape, axis):
    """The mean of no element is NaN and the sum +0, with no warning (Note [IEEE results, no
    floating-point signals] in backends/base.py: NumPy's np.mean warns "Mean of empty slice"),
    on every backend and dtype."""
    device, alloc = REDUCTION_DEVICES[where]
    x = runtime.tensor(np.zeros(shape, np.float32), dtype=dtype, device=device, allocator=alloc)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mean = ops.mean(x, axis=axis).numpy().astype(np.float32)
        total = ops.sum(x, axis=axis).numpy().astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = np.mean(np.zeros(shape, np.float32), axis=axis)
    assert mean.shape == total.shape == np.shape(want)
    assert np.array_equal(np.isnan(mean), np.isnan(want))
    assert np.array_equal(mean[~np.isnan(mean)], want[~np.isnan(want)])
    assert not np.signbit(total).any() and not total.any()


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint8", "int16", "uint16", "int32",
                                   "uint32", "int64", "uint64", "float16", "bfloat16",
                                   "float32", "float64"])
@pytest.mark.parametrize("shape", [(70, 90), (3, 5000), (257, 33)])
def test_a_copy_of_a_transposed_matrix_is_numpys_in_every_dtype(dtype, shape):
    """The CPU's copy of a 2-D transpose of contiguous memory (at 4,096 items and more, in C
    tiles where the item is 2, 4 or 8 bytes: backends/numpy.py's `_copy`), bit for bit, into
    a new tensor and into a strided out (which NumPy's copy takes), in every dtype a tensor
    holds (NaN payloads too: a copy moves bits)."""
    dt = np.dtype(dtype)  # NOTE: bfloat16 by name, as runtime (ml_dtypes) registers it
    bits = np.random.default_rng(shape[0]).integers(0, 256, shape[0] * shape[1] * dt.itemsize,
                                                    dtype=np.uint8)
    values = bits.view(np.uint8 if dt == np.bool_ else dt).reshape(shape)
    values = values.astype(bool) if dt == np.bool_ else values
    x = runtime.tensor(values)
    got = ops.copy(x.T)
    assert got.shape == shape[::-1] and got.numpy().tobytes() == values.T.tobytes()
    wide = runtime.tensor(np.zeros((shape[1], 2 * shape[0]), dt))
    ops.copy(x.T, out=wide[:, ::2])
    assert wide.numpy()[:, ::2].tobytes() == values.T.tobytes()
    assert not wide.numpy()[:, 1::2].any()
