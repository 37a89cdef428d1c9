"""Tensors and views against NumPy: indexing, transposes, reshape, runtime.view, setitem, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import allocators
import runtime
from runtime import ops

DTYPES = ["float32", "float64"]
shapes = hnp.array_shapes(min_dims=1, max_dims=4, min_side=0, max_side=6)


def arange(shape, dtype="float64"):
    """0, 1, 2, ... in `shape`: every element distinct, so a wrong offset or stride shows."""
    return np.arange(math.prod(shape), dtype=dtype).reshape(shape)


# ---------------------------------------------------------------------- strategies
@st.composite
def slices(draw, n):
    """A slice for an axis of length n, bounds past either end and negative steps included."""
    bound = st.none() | st.integers(-n - 3, n + 3)
    step = st.none() | st.integers(-3, 3).filter(bool)
    return slice(draw(bound), draw(bound), draw(step))


@st.composite
def basic_indices(draw, shape):
    """An index for `shape`: ints (negative too), slices, None and at most one Ellipsis, which
    stands for a random run of axes. A one-item index may come bare instead of in a tuple."""
    ndim = len(shape)
    first = draw(st.integers(0, ndim))
    if draw(st.booleans()):
        parts = [shape[:first], shape[draw(st.integers(first, ndim)):]]
    else:
        parts = [shape[:first]]
    key = []
    for i, part in enumerate(parts):
        if i:
            key.append(Ellipsis)
        for n in part:
            key.extend([None] * draw(st.sampled_from([0, 0, 0, 1, 2])))
            if n > 0 and draw(st.integers(0, 3)) == 0:
                key.append(draw(st.integers(-n, n - 1)))
            else:
                key.append(draw(slices(n)))
    key.extend([None] * draw(st.sampled_from([0, 0, 1])))
    if len(key) == 1 and draw(st.booleans()):
        return key[0]
    return tuple(key)


@st.composite
def view_chains(draw, max_steps=3):
    """(shape, steps): a chain of views to apply to an array of `shape`, each step an index, a .T
    or a transpose. Plain data, so that hypothesis can print it without reading any tensor."""
    shape = draw(shapes)
    probe = np.empty(shape)  # NOTE: tracks the shape each step sees; never read
    steps = []
    for _ in range(draw(st.integers(0, max_steps))):
        kind = draw(st.sampled_from(["index", "T", "transpose"]))
        if kind == "index":
            step = ("index", draw(basic_indices(probe.shape)))
        elif kind == "T":
            step = ("T",)
        else:
            step = ("transpose", tuple(draw(st.permutations(range(probe.ndim)))))
        probe = apply_step(probe, step)
        steps.append(step)
    return shape, steps


def np_index(a, key):
    """a[key] as a NumPy view even when ints consume every axis (NumPy would give a scalar)."""
    key = key if isinstance(key, tuple) else (key,)
    return a[key if any(k is Ellipsis for k in key) else key + (Ellipsis,)]


def apply_step(x, step):
    """One view step on a NumPy array or a Tensor alike."""
    if step[0] == "index":
        return np_index(x, step[1]) if isinstance(x, np.ndarray) else x[step[1]]
    if step[0] == "T":
        return x.T
    return x.transpose(*step[1])


def build_chain(chain, dtype="float64"):
    """The base array `a`, its tensor `t`, and the views `v` (NumPy) and `tv` (tensor) of it."""
    shape, steps = chain
    a = arange(shape, dtype)
    t = runtime.tensor(a)
    v, tv = a, t
    for step in steps:
        v, tv = apply_step(v, step), apply_step(tv, step)
    return a, t, v, tv


@st.composite
def reshapes(draw, size):
    """A shape of `size` elements (0 to 5 dims), maybe with one -1 to infer."""
    ndim = draw(st.integers(0 if size == 1 else 1, 5))
    dims = []
    left = size
    for _ in range(ndim - 1):
        if left == 0:
            dims.append(draw(st.integers(0, 4)))
        else:
            dims.append(draw(st.sampled_from([d for d in range(1, left + 1) if left % d == 0])))
            left //= dims[-1]
    if ndim:
        dims.append(left)
    dims = draw(st.permutations(dims))
    if dims and draw(st.booleans()):
        i = draw(st.integers(0, len(dims) - 1))
        if math.prod(dims[:i] + dims[i + 1:]) != 0:
            dims[i] = -1
    return tuple(dims)


# ---------------------------------------------------------------------- indexing
@given(data=st.data(), dtype=st.sampled_from(DTYPES))
@settings(max_examples=200)
def test_basic_indexing_matches_numpy_and_shares_the_block(data, dtype):
    shape = data.draw(shapes, label="shape")
    a = arange(shape, dtype)
    t = runtime.tensor(a)
    key = data.draw(basic_indices(shape), label="key")
    view = t[key]
    expected = a[key]
    assert view.block is t.block
    assert view.shape == expected.shape
    assert view.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(view.numpy(), expected)


@given(chain=view_chains())
@settings(max_examples=150)
def test_chains_of_views_match_numpy(chain):
    a, t, v, tv = build_chain(chain)
    assert tv.block is t.block
    assert tv.shape == v.shape
    np.testing.assert_array_equal(tv.numpy(), v)


@pytest.mark.parametrize("shape, key", [
    ((3,), np.s_[-10::-1]),      # a negative step that selects nothing starts before the block
    ((2, 0), np.s_[:, ::-1]),
    ((2, 3), np.s_[2:, 1:]),     # an empty slice, then a start past the end of the block
    ((0, 2), np.s_[..., 1]),     # an int index into an empty tensor's zero-byte block
    ((3, 4, 5), np.s_[5:, ::-1]),
])
def test_empty_views_read_write_and_print_as_empty(shape, key):
    a = arange(shape)
    t = runtime.tensor(a)
    view = t[key]
    assert view.shape == a[key].shape
    np.testing.assert_array_equal(view.numpy(), a[key])
    assert "shape=" in repr(view)
    ops.neg(view, out=view)
    view[...] = 1.0
    np.testing.assert_array_equal(t.numpy(), a)


def test_indexing_examples():
    a = arange((3, 4, 5))
    t = runtime.tensor(a)
    for key in [1, -1, (1, 2), (..., 0), (None, 1, ..., None), np.s_[::-2, 1:3, ::3],
                (np.int64(2), slice(None), -5), np.s_[..., None], np.s_[1:, ::-1, 4:]]:
        np.testing.assert_array_equal(t[key].numpy(), a[key], err_msg=repr(key))


@given(chain=view_chains(), data=st.data())
@settings(max_examples=150)
def test_transpose_with_axes_matches_numpy(chain, data):
    _, _, v, tv = build_chain(chain)
    axes = data.draw(st.permutations(range(v.ndim)), label="axes")
    negative = [a - v.ndim if data.draw(st.booleans()) else a for a in axes]
    np.testing.assert_array_equal(tv.transpose(*negative).numpy(), v.transpose(axes))
    np.testing.assert_array_equal(tv.transpose(negative).numpy(), v.transpose(axes))
    np.testing.assert_array_equal(tv.transpose().numpy(), v.transpose())


# ---------------------------------------------------------------------- reshape
@given(chain=view_chains(max_steps=2), data=st.data())
@settings(max_examples=200)
def test_reshape_matches_numpy_and_is_a_view_exactly_when_numpy_gives_one(chain, data):
    a, t, v, tv = build_chain(chain)
    new_shape = data.draw(reshapes(v.size), label="new_shape")
    expected = v.reshape(new_shape)
    got = tv.reshape(new_shape)
    assert got.shape == expected.shape
    np.testing.assert_array_equal(got.numpy(), expected)
    np.testing.assert_array_equal(tv.reshape(*new_shape).numpy(), expected)
    if v.size:
        # NOTE: an empty result shares no memory in NumPy's sense, so only sizes > 0 tell.
        assert (got.block is t.block) == np.shares_memory(expected, a)
    if got.block is not t.block:
        got[...] = -1.0
        np.testing.assert_array_equal(tv.numpy(), v)  # a copy: the source is untouched


def test_reshape_of_a_transpose_copies_and_of_contiguous_views_does_not():
    t = runtime.tensor(arange((2, 3)))
    assert t.reshape(3, 2).block is t.block
    assert t[1:].reshape(-1).block is t.block
    assert t[:, ::-1].reshape(2, 3, 1).block is t.block
    copied = t.T.reshape(6)
    assert copied.block is not t.block
    np.testing.assert_array_equal(copied.numpy(), [0, 3, 1, 4, 2, 5])


@pytest.mark.parametrize("shape, new", [((2, 3), (4, 2)), ((2, 3), (-1, 4)), ((6,), (-1, -1)),
                                        ((0, 3), (-1, 0)), ((2, 3), (7,))])
def test_reshape_size_mismatch_raises_value_error(shape, new):
    t = runtime.tensor(arange(shape))
    with pytest.raises(ValueError, match="reshape|infer"):
        t.reshape(*new)


def test_reshape_rejects_non_integer_dimensions():
    t = runtime.tensor(arange((2, 3)))
    with pytest.raises(TypeError):
        t.reshape(2.0, 3)


# ---------------------------------------------------------------------- runtime.view
@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_view_at_offset_matches_the_flat_buffer(data, dtype):
    n = data.draw(st.integers(0, 40), label="n")
    flat = np.arange(n, dtype=dtype)
    source = runtime.tensor(flat)
    shape = data.draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)
                      .filter(lambda s: math.prod(s) <= n), label="shape")
    need = math.prod(shape)
    offset = data.draw(st.integers(0, n - need), label="offset")
    view = runtime.view(source, shape, offset=offset)
    assert view.block is source.block
    assert view.is_contiguous()
    np.testing.assert_array_equal(view.numpy(), flat[offset:offset + need].reshape(shape))


def test_view_of_a_contiguous_view_starts_at_its_offset():
    a = arange((4, 3))
    rows = runtime.tensor(a)[1:3]
    v = runtime.view(rows, (3, 2), offset=0)
    np.testing.assert_array_equal(v.numpy(), a[1:3].reshape(3, 2))
    np.testing.assert_array_equal(runtime.view(rows, (2,), offset=4).numpy(), [7.0, 8.0])


def test_writes_through_a_view_show_in_the_source():
    source = runtime.zeros(8, "float64")
    v = runtime.view(source, (2, 2), offset=3)
    v[1] = 5.0
    np.testing.assert_array_equal(source.numpy(), [0, 0, 0, 0, 0, 5, 5, 0])


@pytest.mark.parametrize("shape, offset", [((3, 3), 0), ((4,), 5), ((1,), 8), ((2,), -1)])
def test_view_out_of_range_raises_value_error_with_the_numbers(shape, offset):
    source = runtime.zeros(8, "float64")
    with pytest.raises(ValueError) as info:
        runtime.view(source, shape, offset=offset)
    message = str(info.value)
    assert str(offset) in message
    assert str(math.prod(shape)) in message
    assert "8" in message


@pytest.mark.parametrize("key", [np.s_[:, ::2], np.s_[::-1], np.s_[:, 1:]])
def test_view_of_a_non_contiguous_source_raises(key):
    source = runtime.tensor(arange((3, 4)))
    with pytest.raises(ValueError, match="contiguous"):
        runtime.view(source[key], (2,))


def test_view_rejects_bad_arguments():
    source = runtime.zeros(8, "float64")
    with pytest.raises(TypeError):
        runtime.view(np.zeros(8), (2,))
    with pytest.raises(TypeError):
        runtime.view(source, (2,), offset=1.0)
    with pytest.raises(ValueError):
        runtime.view(source, (-1, 2))


# ---------------------------------------------------------------------- setitem
@st.composite
def broadcastable_to(draw, shape):
    """A shape that broadcasts to `shape`: a suffix of it with some dims set to 1."""
    suffix = shape[len(shape) - draw(st.integers(0, len(shape))):]
    return tuple(1 if draw(st.booleans()) else n for n in suffix)


@given(data=st.data(), dtype=st.sampled_from(DTYPES),
       kind=st.sampled_from(["number", "array", "tensor", "tensor view"]))
@settings(max_examples=200)
def test_setitem_matches_numpy(data, dtype, kind):
    shape = data.draw(shapes, label="shape")
    a = arange(shape, dtype)
    t = runtime.tensor(a)
    key = data.draw(basic_indices(shape), label="key")
    target_shape = a[key].shape
    if kind == "number":
        value = data.draw(st.floats(-1e3, 1e3, width=32), label="value")
    else:
        value_shape = data.draw(broadcastable_to(target_shape), label="value_shape")
        value = -1 - arange(value_shape, dtype)
        if kind == "tensor":
            value = runtime.tensor(value)
        elif kind == "tensor view":
            value = runtime.tensor(np.stack([value, value]))[1]
    t[key] = value
    a[key] = value.numpy() if isinstance(value, runtime.Tensor) else value
    assert t.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(t.numpy(), a)


@pytest.mark.parametrize("target, source", [
    (np.s_[1:], np.s_[:-1]), (np.s_[:-1], np.s_[1:]), (np.s_[::-1], np.s_[:]),
    (np.s_[::2], np.s_[3:]),
])
def test_setitem_from_an_overlapping_view_of_itself_matches_numpy(target, source):
    a = np.arange(6.0)
    t = runtime.tensor(a)
    t[target] = t[source]
    a[target] = a[source]
    np.testing.assert_array_equal(t.numpy(), a)


def test_setitem_with_a_shape_that_does_not_broadcast_raises():
    t = runtime.zeros((2, 3), "float64")
    with pytest.raises(ValueError):
        t[0] = np.ones(2)
    with pytest.raises(ValueError):
        t[...] = np.ones((3, 2))


# ---------------------------------------------------------------------- errors
def test_too_many_indices_raise_index_error():
    t = runtime.zeros((2, 3))
    with pytest.raises(IndexError, match="too many indices"):
        t[0, 0, 0]
    with pytest.raises(IndexError):
        t[None, 0, ..., 0, 1]
    with pytest.raises(IndexError):
        runtime.zeros(())[0]


def test_two_ellipses_raise_index_error():
    with pytest.raises(IndexError):
        runtime.zeros((2, 3))[..., ...]


@pytest.mark.parametrize("key", [2, -3, (0, 3), (1, -4), (..., 5)])
def test_out_of_bounds_ints_raise_index_error(key):
    t = runtime.zeros((2, 3))
    with pytest.raises(IndexError, match="out of bounds"):
        t[key]


@pytest.mark.parametrize("key", [[0, 1], np.array([0, 1]), np.array([True, False]), True, 1.0,
                                 "a", (0, [1, 2])])
def test_advanced_indexing_raises_type_error(key):
    t = runtime.zeros((2, 3))
    with pytest.raises(TypeError):
        t[key]


def test_zero_slice_step_raises_value_error():
    with pytest.raises(ValueError):
        runtime.zeros(3)[::0]


@pytest.mark.parametrize("make", [runtime.empty, runtime.zeros, runtime.ones])
def test_bad_shapes_are_refused(make):
    with pytest.raises(ValueError, match="negative"):
        make((2, -1))
    with pytest.raises(TypeError):
        make((2.0, 3))
    with pytest.raises(TypeError):
        make((True, 3))
    with pytest.raises(TypeError):
        make("abc")


@pytest.mark.parametrize("dtype", ["complex64", "object", "U3", "float128", "float8_e4m3fn",
                                   "int4", ">V2"])
def test_unsupported_dtypes_raise_type_error(dtype):
    with pytest.raises(TypeError, match="dtype"):
        runtime.empty((2,), dtype)
    with pytest.raises(TypeError, match="dtype"):
        runtime.tensor([1, 2], dtype=dtype)


@pytest.mark.parametrize("dtype", ["complex64", "object", "U3", "int4", "float8_e4m3fn"])
def test_tensor_refuses_data_it_cannot_hold(dtype):
    with pytest.raises(TypeError, match="dtype"):
        runtime.tensor(np.zeros(2, dtype=dtype))


def test_bad_transpose_axes_raise_value_error():
    t = runtime.zeros((2, 3, 4))
    for axes in [(0, 1), (0, 0, 1), (0, 1, 3), (0, 1, -4)]:
        with pytest.raises(ValueError, match="permutation"):
            t.transpose(*axes)


# ---------------------------------------------------------------------- host access & repr
def test_item_len_and_repr():
    t = runtime.tensor(np.array([[1.5, 2.0], [3.0, 4.0]]))
    assert t[1, 0].item() == 3.0
    assert isinstance(t[1, 0].item(), float)
    assert runtime.tensor(np.array([[7.0]], np.float32)).item() == 7.0
    with pytest.raises(ValueError, match="one element"):
        t.item()
    assert len(t) == 2
    assert len(t.T[1:]) == 1
    with pytest.raises(TypeError):
        len(t[0, 0])
    text = repr(t)
    assert "1.5" in text and "shape=(2, 2)" in text and "float64" in text


def test_repr_of_unwritten_freed_and_large_tensors():
    unwritten = runtime.empty((2, 3), "float32")
    assert "<unwritten>" in repr(unwritten)
    assert "shape=(2, 3)" in repr(unwritten)
    big = runtime.zeros((10, 10))
    assert f"#{big.block.id}" in repr(big)
    view = big[1:]
    big.block.free()
    assert "<freed>" in repr(view)
    assert "<freed>" in repr(big)


@given(a=hnp.arrays(st.sampled_from([np.float32, np.float64]), shapes,
                    elements=st.floats(-1e6, 1e6, width=32)))
def test_float_dtypes_are_kept_and_data_round_trips(a):
    t = runtime.tensor(a)
    assert t.dtype == a.dtype
    assert t.shape == a.shape
    out = t.numpy()
    assert out.dtype == a.dtype
    np.testing.assert_array_equal(out, a)
    assert t.T.dtype == a.dtype and t[..., None].dtype == a.dtype


def test_empty_and_factories_keep_the_requested_dtype():
    for dtype in DTYPES:
        assert runtime.empty((2,), dtype).dtype == np.dtype(dtype)
        assert runtime.zeros((2,), dtype).numpy().dtype == np.dtype(dtype)
        assert runtime.ones((2,), dtype).numpy().dtype == np.dtype(dtype)
        assert runtime.tensor([1, 2], dtype=dtype).numpy().dtype == np.dtype(dtype)
    assert runtime.empty(3).dtype == np.float32
    assert runtime.tensor([1.0, 2.0]).dtype == np.float64


def test_numpy_returns_a_copy():
    a = arange((2, 3))
    t = runtime.tensor(a)
    out = t.numpy()
    out[...] = -1.0
    np.testing.assert_array_equal(t.numpy(), a)
    view_out = t[:, 1].numpy()
    view_out[0] = 99.0
    np.testing.assert_array_equal(t.numpy(), a)
    a[0, 0] = 42.0  # runtime.tensor copied its input too
    assert t[0, 0].item() == 0.0


def test_strides_and_offset_count_elements():
    t = runtime.tensor(arange((3, 4), "float32"))
    assert t.strides == (4, 1) and t.offset == 0
    v = t[1:, ::-2]
    assert v.strides == (4, -2)
    assert v.offset == 4 + 3
    assert t.T.strides == (1, 4)


def test_tensor_factory_uses_the_given_allocator():
    alloc = allocators.create("direct", "cpu")
    t = runtime.tensor(np.ones(4), allocator=alloc)
    assert t.block.allocator is alloc
    assert ops.add(t, t).block.allocator is alloc
    with pytest.raises(TypeError):
        runtime.tensor(np.ones(4), allocator="direct")


@pytest.mark.parametrize("view", ["whole", "transposed", "strided", "offset"])
def test_detach_sets_every_field_and_its_caches_hold(view):
    """detach() copies the layout and its caches instead of checking the bounds again: every
    slot is set, and each cache equals what the handle would compute for itself."""
    base = runtime.tensor(np.arange(24.0).reshape(4, 6))
    t = {"whole": base, "transposed": base.T, "strided": base[::2, 1::2],
         "offset": base[1:, 2:]}[view]
    t.layout(), t.byte_span(), t.has_internal_overlap(), t.numpy()  # warm every cache
    handle = t.detach()
    for name in runtime.Tensor.__slots__:
        if name != "__weakref__":
            assert hasattr(handle, name), name
    assert (handle.shape, handle.strides, handle.offset, handle.dtype) == (
        t.shape, t.strides, t.offset, t.dtype)
    assert handle.block is t.block and not handle.requires_grad and handle.grad_fn is None
    fresh = runtime.Tensor(t.block, t.shape, t.dtype, t.strides, t.offset)
    assert handle.layout() == fresh.layout()
    assert handle.byte_span() == fresh.byte_span()
    assert handle.has_internal_overlap() == fresh.has_internal_overlap()
    np.testing.assert_array_equal(handle.numpy(), t.numpy())
    refs = t.block.refcount
    handle.release()
    assert t.block.refcount == refs - 1
