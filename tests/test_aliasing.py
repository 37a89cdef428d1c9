"""Aliasing: the exact overlap test, and ops whose `out=` shares memory with their inputs.

The oracle for an op on overlapping views is NumPy's `assert_copy_equivalent` idea: compute the op
on *copies* of the inputs and write the result into the output view of a copy of the buffer. The
runtime must match that for the whole buffer, on the NumPy device and on `NaiveDevice`, whose
kernels corrupt overlapping operands the way a BLAS or GPU kernel would (see naive_device.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from op_references import REFERENCES

import allocators
import backends
import runtime
from backends import optable
from naive_device import NaiveDevice
from runtime import aliasing, ops

NAIVE = NaiveDevice()
DEVICES = {"cpu": backends.get_device("cpu"), "naive": NAIVE}
# NOTE: explicit allocators, so tensors land on exactly these device objects.
ALLOCATORS = {name: allocators.create("direct", dev) for name, dev in DEVICES.items()}

RTOL = {np.dtype("float32"): 1e-5, np.dtype("float64"): 1e-12}

ROW_STEPS = (1, 2, -1, -2)
COL_STEPS = (1, 2, 3, -1, -2)
MAX_DIM = 6

# NOTE: every public elementwise op of backends/optable.py whose operands are floats
UNARY_OPS = tuple(op.name for op in optable.OPS if op.public and op.arity == 1)
BINARY_OPS = tuple(op.name for op in optable.OPS if op.public and op.arity == 2)
REDUCE_OPS = ("sum", "mean")

# Independent NumPy formulas for every op (tests/op_references.py: sigmoid as the textbook
# formula, not the runtime's).
NUMPY_OPS: dict[str, Any] = {
    **{name: REFERENCES[name].numpy for name in UNARY_OPS + BINARY_OPS},
    "matmul": np.matmul, "sum": np.sum, "mean": np.mean,
}


@contextlib.contextmanager
def aliasing_mode(mode: str) -> Iterator[None]:
    old = runtime.set_aliasing(mode)
    try:
        yield
    finally:
        runtime.set_aliasing(old)


def on_device(data: Any, device_name: str) -> runtime.Tensor:
    return runtime.tensor(data, device=DEVICES[device_name], allocator=ALLOCATORS[device_name])


def numpy_layout(view: np.ndarray, base: np.ndarray) -> tuple:
    """(byte offset into base, shape, byte strides, itemsize), as Tensor.layout() gives it."""
    offset = view.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    return offset, view.shape, view.strides, view.itemsize


# ---------------------------------------------------------------------- 1. the seed example
# Neanderthal, "Deep Learning from Scratch to GPU - 5 - Sharing Memory": two layers write views
# of one 8-element buffer. Column-major as in the article: a1[i, j] is temp[i + 4j] and a2[0, j]
# is temp[j], so layer 2 reads a1 while writing over a1's first column.
SEED_X = np.array([[0.3, 0.3], [0.9, 0.9]])
SEED_W1 = np.array([0.3, 0.1, 0.9, 0.0, 0.6, 2.0, 3.7, 1.0]).reshape(2, 4).T
SEED_B1 = np.array([[0.7], [0.2], [1.1], [2.0]])
SEED_W2 = np.array([[0.75, 0.15, 0.22, 0.33]])
SEED_B2 = np.array([[0.3]])
SEED_RESULT = 0.4352126  # both columns: the two inputs of the batch are the same


def seed_reference() -> np.ndarray:
    hidden = np.tanh(SEED_W1 @ SEED_X - SEED_B1)
    return 1 / (1 + np.exp(-(SEED_W2 @ hidden - SEED_B2)))


def seed_views(device_name: str) -> tuple[runtime.Tensor, runtime.Tensor, runtime.Tensor]:
    temp = on_device(np.zeros(8), device_name)
    a1 = runtime.view(temp, (2, 4)).T
    a2 = runtime.view(temp, (2, 1)).T
    return temp, a1, a2


def seed_layer(w: runtime.Tensor, b: runtime.Tensor, activation: Any, inp: runtime.Tensor,
               out: runtime.Tensor) -> runtime.Tensor:
    ops.matmul(w, inp, out=out)
    ops.sub(out, b, out=out)
    return activation(out, out=out)


def seed_network(device_name: str) -> dict[str, runtime.Tensor]:
    params = {name: on_device(value, device_name) for name, value in
              [("x", SEED_X), ("w1", SEED_W1), ("b1", SEED_B1), ("w2", SEED_W2), ("b2", SEED_B2)]}
    temp, a1, a2 = seed_views(device_name)
    return dict(params, temp=temp, a1=a1, a2=a2)


def test_seed_reference_is_the_articles_answer():
    np.testing.assert_allclose(seed_reference(), [[SEED_RESULT, SEED_RESULT]], rtol=1e-6)


@pytest.mark.parametrize("device_name", DEVICES)
def test_seed_views_are_column_major_over_one_buffer(device_name):
    temp, a1, a2 = seed_views(device_name)
    assert a1.block is temp.block and a2.block is temp.block
    positions = np.arange(8.0)
    ops.copy(on_device(positions, device_name), out=temp)
    np.testing.assert_array_equal(a1.numpy(), [[0, 4], [1, 5], [2, 6], [3, 7]])
    np.testing.assert_array_equal(a2.numpy(), [[0, 1]])
    # The layer-2 output shares memory with its input: without this the test proves nothing.
    assert runtime.overlaps(a1.layout(), a2.layout())
    host = np.arange(8.0)
    assert np.shares_memory(host.reshape(2, 4).T, host[:2].reshape(2, 1).T)


@pytest.mark.parametrize("device_name", DEVICES)
def test_seed_example_is_right_in_copy_mode(device_name):
    net = seed_network(device_name)
    seed_layer(net["w1"], net["b1"], ops.tanh, net["x"], net["a1"])
    result = seed_layer(net["w2"], net["b2"], ops.sigmoid, net["a1"], net["a2"])
    assert result is net["a2"]
    np.testing.assert_array_equal(np.round(result.numpy(), 2), [[0.44, 0.44]])
    np.testing.assert_allclose(result.numpy(), seed_reference(), rtol=1e-12)


@pytest.mark.parametrize("device_name", DEVICES)
def test_seed_example_raises_in_raise_mode_and_keeps_layer_one(device_name):
    net = seed_network(device_name)
    with aliasing_mode("raise"):
        # Layer 1 only writes a1 in place (identical views): allowed.
        seed_layer(net["w1"], net["b1"], ops.tanh, net["x"], net["a1"])
        before = net["temp"].numpy()
        with pytest.raises(runtime.AliasingError) as info:
            ops.matmul(net["w2"], net["a1"], out=net["a2"])
    message = str(info.value)
    assert message.startswith("matmul")
    assert f"out (block #{net['temp'].block.id}" in message
    assert f"input b (block #{net['temp'].block.id}" in message
    assert "input a" not in message  # w2 lives in its own block
    np.testing.assert_array_equal(net["temp"].numpy(), before)
    np.testing.assert_allclose(net["a1"].numpy(), np.tanh(SEED_W1 @ SEED_X - SEED_B1),
                               rtol=1e-12)


# ---------------------------------------------------------------------- 2. the naive device
def test_naive_device_passes_through_get_device_and_allocators():
    assert NAIVE.name == "naive"
    assert backends.get_device(NAIVE) is NAIVE
    assert ALLOCATORS["naive"].device is NAIVE
    x = on_device([1.0, 2.0], "naive")
    y = ops.mul(x, x)
    assert x.device is NAIVE and y.device is NAIVE
    np.testing.assert_array_equal(y.numpy(), [1.0, 4.0])


def test_tensor_lands_on_the_naive_device_it_names():
    first, second = NaiveDevice(), NaiveDevice()
    on_first = runtime.tensor(np.ones(2), device=first)
    on_second = runtime.tensor(np.ones(2), device=second)
    assert on_first.device is first
    assert on_second.device is second, "a tensor asked for on one device landed on another"


def test_naive_matmul_corrupts_the_seed_example_when_called_directly():
    temp = np.zeros(8)
    a1 = temp.reshape(2, 4).T
    a2 = temp[:2].reshape(2, 1).T
    NAIVE.matmul(SEED_W1, SEED_X, a1)
    NAIVE.binary("sub", a1, np.broadcast_to(SEED_B1, a1.shape), a1)
    NAIVE.unary("tanh", a1, a1)
    NAIVE.matmul(SEED_W2, a1, a2)
    NAIVE.binary("sub", a2, np.float64(0.3), a2)
    NAIVE.unary("sigmoid", a2, a2)
    # The article's wrong answer: column 0 of a2 overwrote a1's first column while it was read.
    np.testing.assert_array_equal(np.round(a2, 2), [[0.41, 0.44]])


def _shifted(buffer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(input, output) views of one buffer where the output is the input moved one ahead."""
    return buffer[:-1], buffer[1:]


def _naive_copy(buffer: np.ndarray) -> None:
    x, out = _shifted(buffer)
    NAIVE.unary("copy", x, out)


def _naive_mul(buffer: np.ndarray) -> None:
    x, out = _shifted(buffer)
    NAIVE.binary("mul", x, np.float64(2.0), out)


def _naive_sum_rows(buffer: np.ndarray) -> None:
    NAIVE.reduce("sum", buffer.reshape(2, 3), (1,), False, buffer[:2])


def _naive_square_in_place(buffer: np.ndarray) -> None:
    square = buffer[:4].reshape(2, 2)
    NAIVE.matmul(square, square, square)


@pytest.mark.parametrize("kernel, correct", [
    (_naive_copy, [1, 1, 2, 3, 4, 5]),
    (_naive_mul, [1, 2, 4, 6, 8, 10]),
    (_naive_sum_rows, [6, 15, 3, 4, 5, 6]),
    (_naive_square_in_place, [7, 10, 15, 22, 5, 6]),
], ids=["copy", "mul", "sum", "matmul"])
def test_naive_kernels_corrupt_overlapping_operands(kernel, correct):
    buffer = np.arange(1.0, 7.0)
    kernel(buffer)
    assert not np.allclose(buffer, correct), f"the naive kernel got {buffer} right"


@pytest.mark.parametrize("device_name", DEVICES)
@pytest.mark.parametrize("kernel, correct", [
    (lambda x: ops.copy(x[:-1], out=x[1:]), [1, 1, 2, 3, 4, 5]),
    (lambda x: ops.mul(x[:-1], 2.0, out=x[1:]), [1, 2, 4, 6, 8, 10]),
    (lambda x: ops.sum(x.reshape(2, 3), axis=1, out=x[:2]), [6, 15, 3, 4, 5, 6]),
    (lambda x: ops.matmul(x[:4].reshape(2, 2), x[:4].reshape(2, 2), out=x[:4].reshape(2, 2)),
     [7, 10, 15, 22, 5, 6]),
], ids=["copy", "mul", "sum", "matmul"])
def test_ops_get_the_naive_counterexamples_right(device_name, kernel, correct):
    buffer = on_device(np.arange(1.0, 7.0), device_name)
    kernel(buffer)
    np.testing.assert_array_equal(buffer.numpy(), correct)


# ---------------------------------------------------------------------- views of one buffer
@dataclasses.dataclass(frozen=True)
class ViewSpec:
    """A strided view of a 1-D buffer: a C-order `window` at `offset`, sliced by `key`, maybe .T.

    The same spec builds the runtime view (runtime.view + slicing) and the NumPy view (a reshaped
    slice of the host buffer + the same slicing), so both address the same elements.
    """

    window: tuple[int, ...]
    key: tuple[slice, ...]
    transposed: bool
    offset: int = 0

    @property
    def size(self) -> int:
        return math.prod(self.window)

    def numpy(self, buffer: np.ndarray) -> np.ndarray:
        view = buffer[self.offset:self.offset + self.size].reshape(self.window)
        if self.key:
            view = view[self.key]
        return view.T if self.transposed else view

    def tensor(self, buffer: runtime.Tensor) -> runtime.Tensor:
        view = runtime.view(buffer, self.window, self.offset)
        if self.key:
            view = view[self.key]
        return view.T if self.transposed else view


def _axis_slice(draw: Any, count: int, steps: tuple[int, ...]) -> tuple[int, slice]:
    """A window length and a slice of it with `count` elements and a step from `steps`."""
    step = draw(st.sampled_from(steps))
    span = (count - 1) * abs(step) + 1
    length = span + draw(st.integers(0, 1))
    if step > 0:
        start = draw(st.integers(0, length - span))
    else:
        start = draw(st.integers(span - 1, length - 1))
    stop = start + step * (count - 1) + (1 if step > 0 else -1)
    return length, slice(start, stop if stop >= 0 else None, step)


@st.composite
def view_specs(draw: Any, shape: tuple[int, ...]) -> ViewSpec:
    """An unplaced (offset 0) spec whose view has `shape`: 0-, 1- or 2-D, steps of either sign."""
    transposed = len(shape) == 2 and draw(st.booleans())
    base = shape[::-1] if transposed else shape
    step_choices = (ROW_STEPS, COL_STEPS)[-len(base):] if base else ()
    window, key = [], []
    for count, steps in zip(base, step_choices):
        length, index = _axis_slice(draw, count, steps)
        window.append(length)
        key.append(index)
    return ViewSpec(tuple(window), tuple(key), transposed)


@dataclasses.dataclass(frozen=True)
class Case:
    """One op call on views of one buffer: `op(*operands, out=out, **kwargs)`.

    Operands are ViewSpecs or Python floats (scalar operands of binary ops).
    """

    op: str
    policy: str
    data: np.ndarray
    operands: tuple
    out: ViewSpec
    kwargs: tuple = ()

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    def views(self) -> list[ViewSpec]:
        return [spec for spec in self.operands if isinstance(spec, ViewSpec)]


def _place(draw: Any, specs: list[Any]) -> tuple[int, list[Any]]:
    """A buffer size barely larger than the largest window, and every spec at a random offset."""
    windows = [s for s in specs if isinstance(s, ViewSpec)]
    size = max(s.size for s in windows) + draw(st.integers(0, 8))
    placed = [dataclasses.replace(s, offset=draw(st.integers(0, size - s.size)))
              if isinstance(s, ViewSpec) else s for s in specs]
    return size, placed


def _buffer_data(draw: Any, size: int, low: float, high: float) -> np.ndarray:
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    seed = draw(st.integers(0, 2**32 - 1))
    return np.random.default_rng(seed).uniform(low, high, size).astype(dtype)


# Scalar operands stay away from 0 so that div by a scalar stays finite.
SCALARS = st.floats(0.25, 2.0) | st.floats(-2.0, -0.25)


def _dims(count: int) -> st.SearchStrategy:
    return st.tuples(*[st.integers(1, MAX_DIM)] * count)


@st.composite
def elementwise_cases(draw: Any, names: tuple[str, ...], arity: int) -> Case:
    """op(x, out=) or op(a, b, out=) with out (m, n); inputs (m, n), broadcast, or scalars."""
    name = draw(st.sampled_from(names))
    m, n = draw(_dims(2))
    shapes = [(m, n), (n,), (m, 1), (1, n)] + (["scalar"] if arity == 2 else [])
    operand_shapes = [draw(st.sampled_from(shapes)) for _ in range(arity)]
    if all(shape == "scalar" for shape in operand_shapes):
        operand_shapes[0] = (m, n)
    operands = [draw(SCALARS) if shape == "scalar" else draw(view_specs(shape))
                for shape in operand_shapes]
    out = draw(view_specs((m, n)))
    size, placed = _place(draw, operands + [out])
    operands, out = placed[:-1], placed[-1]
    full = [spec for spec, shape in zip(operands, operand_shapes) if shape == (m, n)]
    if full and draw(st.booleans()):
        out = draw(st.sampled_from(full))  # out is the identical view of an input: allowed
    low = 0.5 if name in ("log", "sqrt") else -2.0
    return Case(name, ops.ELEMENTWISE, _buffer_data(draw, size, low, 2.0), tuple(operands), out)


@st.composite
def matmul_cases(draw: Any) -> Case:
    m, k, n = draw(_dims(3))
    specs = [draw(view_specs((m, k))), draw(view_specs((k, n))), draw(view_specs((m, n)))]
    size, (a, b, out) = _place(draw, specs)
    return Case("matmul", ops.NEVER, _buffer_data(draw, size, 0.5, 2.0), (a, b), out)


@st.composite
def reduce_cases(draw: Any) -> Case:
    name = draw(st.sampled_from(REDUCE_OPS))
    m, n = draw(_dims(2))
    axis = draw(st.sampled_from([0, 1, None]))
    keepdims = draw(st.booleans())
    reduced = (0, 1) if axis is None else (axis,)
    shape = tuple(1 if d in reduced else dim for d, dim in enumerate((m, n))
                  if keepdims or d not in reduced)
    specs = [draw(view_specs((m, n))), draw(view_specs(shape))]
    size, (x, out) = _place(draw, specs)
    data = _buffer_data(draw, size, 0.5, 2.0)
    return Case(name, ops.NEVER, data, (x,), out, (("axis", axis), ("keepdims", keepdims)))


ALL_CASES = st.one_of(elementwise_cases(UNARY_OPS, 1), elementwise_cases(BINARY_OPS, 2),
                      matmul_cases(), reduce_cases())


def prepare(case: Case, device_name: str) -> tuple[runtime.Tensor, list, runtime.Tensor]:
    """The buffer tensor, the operands (views of it, or scalars) and the out view."""
    buffer = on_device(case.data, device_name)
    host = case.data.copy()
    views = []
    for spec in case.operands + (case.out,):
        if isinstance(spec, ViewSpec):
            view = spec.tensor(buffer)
            assert view.layout() == numpy_layout(spec.numpy(host), host), "views disagree"
            views.append(view)
        else:
            views.append(spec)
    return buffer, views[:-1], views[-1]


def call(case: Case, operands: list, out: runtime.Tensor) -> Any:
    return getattr(ops, case.op)(*operands, out=out, **dict(case.kwargs))


def oracle(case: Case) -> np.ndarray:
    """The whole buffer after the op, computed by NumPy from copies of the inputs."""
    expected = case.data.copy()
    inputs = [np.array(spec.numpy(expected)) if isinstance(spec, ViewSpec)
              else case.dtype.type(spec) for spec in case.operands]
    case.out.numpy(expected)[...] = NUMPY_OPS[case.op](*inputs, **dict(case.kwargs))
    return expected


def assert_matches_oracle(case: Case, got: np.ndarray) -> None:
    inside = np.zeros(case.data.shape, bool)
    case.out.numpy(inside)[...] = True
    np.testing.assert_array_equal(got[~inside], case.data[~inside],
                                  err_msg="an element outside out changed")
    np.testing.assert_allclose(got, oracle(case), rtol=RTOL[case.dtype], atol=0)


def broadcast_layout(layout: tuple, shape: tuple[int, ...]) -> tuple:
    """The layout as an elementwise kernel reads it at `shape`: broadcast dims get stride 0."""
    offset, own_shape, strides, itemsize = layout
    lead = len(shape) - len(own_shape)
    kept = (s if n == target else 0 for n, s, target in zip(own_shape, strides, shape[lead:]))
    return offset, tuple(shape), (0,) * lead + tuple(kept), itemsize


def same_elements_by_hand(a: tuple, b: tuple) -> bool:
    """Every index of a and b on the same first byte, by enumerating the indices (an oracle)."""
    (off_a, shape_a, strides_a, item_a), (off_b, shape_b, strides_b, item_b) = a, b
    if shape_a != shape_b or item_a != item_b:
        return False
    return all(off_a + np.dot(index, strides_a) == off_b + np.dot(index, strides_b)
               for index in np.ndindex(*shape_a))


def forbidden_overlap(case: Case) -> bool:
    """Does out share memory with an input in a way the op's policy forbids? (NumPy's answer)

    Elementwise ops may write the identical view of an input (same byte offset, shape and byte
    strides once the input is broadcast to out's shape; the stride of a dimension of size 1 names
    no second element, so it may differ); nothing else may share memory.
    """
    host = case.data.copy()
    out = case.out.numpy(host)
    out_layout = numpy_layout(out, host)
    for spec in case.views():
        view = spec.numpy(host)
        if not np.shares_memory(view, out, max_work=None):
            continue
        seen = broadcast_layout(numpy_layout(view, host), out.shape)
        if case.policy == ops.ELEMENTWISE and same_elements_by_hand(seen, out_layout):
            continue
        return True
    return False


# ---------------------------------------------------------------------- 3. copy equivalence
def check_copy_equivalent(case: Case, device_name: str) -> None:
    buffer, operands, out = prepare(case, device_name)
    exhausted = aliasing.budget_exhausted
    assert call(case, operands, out) is out
    assert_matches_oracle(case, buffer.numpy())
    assert aliasing.budget_exhausted == exhausted, "the overlap test gave up on its budget"


def test_view_specs_build_the_same_view_in_numpy_and_runtime():
    spec = ViewSpec((4, 5), (slice(3, 0, -2), slice(None, None, 3)), transposed=True, offset=2)
    host = np.arange(30.0)
    buffer = on_device(host, "cpu")
    # window rows 3 and 1, columns 0 and 3, of arange(2, 22).reshape(4, 5), transposed
    np.testing.assert_array_equal(spec.numpy(host), [[17, 7], [20, 10]])
    np.testing.assert_array_equal(spec.tensor(buffer).numpy(), [[17, 7], [20, 10]])


@pytest.mark.parametrize("device_name", DEVICES)
@settings(max_examples=60)
@given(case=elementwise_cases(UNARY_OPS, 1))
def test_unary_ops_are_copy_equivalent(device_name, case):
    check_copy_equivalent(case, device_name)


@pytest.mark.parametrize("device_name", DEVICES)
@settings(max_examples=60)
@given(case=elementwise_cases(BINARY_OPS, 2))
def test_binary_ops_are_copy_equivalent(device_name, case):
    check_copy_equivalent(case, device_name)


@pytest.mark.parametrize("device_name", DEVICES)
@settings(max_examples=60)
@given(case=matmul_cases())
def test_matmul_is_copy_equivalent(device_name, case):
    check_copy_equivalent(case, device_name)


@pytest.mark.parametrize("device_name", DEVICES)
@settings(max_examples=60)
@given(case=reduce_cases())
def test_reductions_are_copy_equivalent(device_name, case):
    check_copy_equivalent(case, device_name)


@pytest.mark.parametrize("device_name", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op", UNARY_OPS + BINARY_OPS)
def test_in_place_on_the_identical_strided_view(device_name, dtype, op):
    # The identical view goes straight to the kernel (no temporary), so the backend's kernel must
    # be right in place for every stride. (The unary property found np.negative in NumPy 2.4
    # getting 16-byte float32 and 64-byte float64 strides wrong in place on AVX-512.)
    scalar = () if op in UNARY_OPS else (0.75,)
    for step in range(1, 10):
        data = np.linspace(0.5, 2.0, 3 * step + 1).astype(dtype)
        x = on_device(data, device_name)
        view = x[::step]
        getattr(ops, op)(view, *scalar, out=view)
        expected = data.copy()
        expected[::step] = NUMPY_OPS[op](data[::step].copy(), *scalar)
        np.testing.assert_allclose(x.numpy(), expected, rtol=RTOL[np.dtype(dtype)],
                                   err_msg=f"{op} in place with a step of {step}")


# ---------------------------------------------------------------------- 4. raise mode
@pytest.mark.parametrize("device_name", DEVICES)
@settings(max_examples=100)
@given(case=ALL_CASES)
def test_raise_mode_raises_exactly_on_forbidden_overlap(device_name, case):
    buffer, operands, out = prepare(case, device_name)
    with aliasing_mode("raise"):
        if forbidden_overlap(case):
            event("raises")
            with pytest.raises(runtime.AliasingError, match=rf"^{case.op}: the output out .* "
                                                            rf"overlaps input"):
                call(case, operands, out)
            np.testing.assert_array_equal(buffer.numpy(), case.data)
            return
        event("computes")
        call(case, operands, out)
    assert_matches_oracle(case, buffer.numpy())


# ---------------------------------------------------------------------- 5. overlaps() is exact
BASE_BYTES = 2048


@st.composite
def byte_layouts(draw: Any, like: tuple[int, ...] = ()) -> tuple[int, tuple, tuple, int]:
    """An unplaced layout (offset 0): 1-4 dims, any byte strides, itemsize 4 or 8.

    Strides are often those of `like` (either sign), so two layouts interleave on one grid.
    """
    itemsize = draw(st.sampled_from([4, 8]))
    ndim = draw(st.integers(1, 4))
    shape = [draw(st.integers(1, 5)) for _ in range(ndim)]
    if draw(st.integers(0, 9)) == 0:
        shape[draw(st.integers(0, ndim - 1))] = 0  # now and then an empty view
    stride = st.one_of(st.integers(-4, 4).map(lambda k: k * itemsize), st.integers(-40, 40))
    if any(like):
        stride = stride | st.sampled_from([s for s in like if s] + [-s for s in like if s])
    strides = tuple(draw(stride) for _ in range(ndim))
    return 0, tuple(shape), strides, itemsize


def offset_range(layout: tuple) -> tuple[int, int]:
    """The offsets at which the layout stays inside a buffer of BASE_BYTES."""
    _, shape, strides, itemsize = layout
    low = sum(s * max(n - 1, 0) for n, s in zip(shape, strides) if s < 0)
    high = sum(s * max(n - 1, 0) for n, s in zip(shape, strides) if s > 0)
    return -low, BASE_BYTES - itemsize - high


@st.composite
def strided_pairs(draw: Any) -> tuple[tuple, tuple]:
    """Two layouts of random strides, the second placed near the first."""
    first = draw(byte_layouts())
    second = first if draw(st.booleans()) else draw(byte_layouts(like=first[2]))
    lo, hi = offset_range(first)
    offset = draw(st.integers(lo, hi))
    lo, hi = offset_range(second)
    near = offset + draw(st.integers(-64, 64))
    return (offset,) + first[1:], (min(max(near, lo), hi),) + second[1:]


# A C-order float64 grid over the first 1920 bytes, and the same bytes as a float32 grid.
GRIDS = {8: (2, 4, 5, 6), 4: (2, 4, 5, 12)}


@st.composite
def grid_slices(draw: Any, n: int) -> slice:
    """A non-empty slice of range(n) with a step of either sign."""
    step = draw(st.sampled_from([1, 2, 3, -1, -2]))
    start = draw(st.integers(0, n - 1))
    count = draw(st.integers(1, len(range(start, n if step > 0 else -1, step))))
    stop = start + step * count
    return slice(start, stop if stop >= 0 else None, step)


@st.composite
def sliced_layout(draw: Any, base: np.ndarray) -> tuple:
    """A layout NumPy makes by indexing (ints, slices of any step) and transposing a grid."""
    itemsize = draw(st.sampled_from(sorted(GRIDS)))
    shape = GRIDS[itemsize]
    grid = base[:math.prod(shape) * itemsize].view(f"f{itemsize}").reshape(shape)
    key = []
    for n in shape:
        if draw(st.integers(0, 4)) == 0:
            key.append(draw(st.integers(0, n - 1)))
        else:
            key.append(draw(grid_slices(n)))
    view = grid[tuple(key) + (Ellipsis,)]  # a view even when every index is an int
    view = view.transpose(draw(st.permutations(range(view.ndim))))
    return numpy_layout(view, base)


@st.composite
def sliced_pairs(draw: Any) -> tuple[tuple, tuple]:
    """Two slicings of one grid (or of its float32 twin): they often interleave exactly."""
    base = np.zeros(BASE_BYTES, np.uint8)
    return draw(sliced_layout(base)), draw(sliced_layout(base))


LAYOUT_PAIRS = strided_pairs() | sliced_pairs()


def numpy_over(base: np.ndarray, layout: tuple) -> np.ndarray:
    offset, shape, strides, itemsize = layout
    dtype = {4: np.float32, 8: np.float64}[itemsize]
    return np.ndarray(shape, dtype, buffer=base, offset=offset, strides=strides)


def shares_memory(a: tuple, b: tuple) -> bool:
    base = np.zeros(BASE_BYTES, np.uint8)
    return bool(np.shares_memory(numpy_over(base, a), numpy_over(base, b), max_work=None))


@settings(max_examples=300)
@given(pair=LAYOUT_PAIRS)
def test_overlaps_agrees_with_numpy_shares_memory(pair):
    a, b = pair
    exhausted = aliasing.budget_exhausted
    expected = shares_memory(a, b)
    spans = aliasing.byte_span(a), aliasing.byte_span(b)
    if expected:
        event("shares memory")
    elif None not in spans and spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1]:
        event("spans overlap, no byte shared")
    assert aliasing.overlaps(a, b) == expected
    assert aliasing.overlaps(b, a) == expected
    # The exact solver answered within its work budget (no conservative "may overlap").
    assert aliasing.budget_exhausted == exhausted


def test_budget_exhausted_counts_a_conservative_answer():
    # NumPy's own too-hard example (test_mem_overlap.py): far past the work budget.
    a = (0, (1049, 1049, 1049), (36674, 61119, 85569), 1)
    b = (64023025, (1049, 1049, 1), (12223, 12224, 1), 1)
    exhausted = aliasing.budget_exhausted
    assert aliasing.overlaps(a, b) is True
    assert aliasing.budget_exhausted == exhausted + 1


def _grid() -> runtime.Tensor:
    return runtime.tensor(np.arange(24.0).reshape(4, 6))


@pytest.mark.parametrize("pick_a, pick_b, expected", [
    (lambda x: x[:, ::2], lambda x: x[:, 1::2], False),   # interleaved: no false positive
    (lambda x: x[:, ::2], lambda x: x[:, 2::2], True),
    (lambda x: x[1:3, 2:5], lambda x: x[1:3, 2:5], True),  # identical views
    (lambda x: x[:2], lambda x: x[2:], False),             # disjoint halves
    (lambda x: x[:0], lambda x: x, False),                 # zero-size view
    (lambda x: x[:, 2:2], lambda x: x[:, 2], False),       # zero-size inside the span
    (lambda x: x[::-1, ::2], lambda x: x.T[1::2], False),  # negative steps, transposed
    (lambda x: x[::-1, ::2], lambda x: x.T[::2], True),
    (lambda x: x[::2, 5], lambda x: x[1::2, 0], False),    # spans overlap, rows alternate
], ids=["interleaved", "shifted", "identical", "halves", "empty", "empty-inside", "reversed",
        "reversed-shared", "alternate-rows"])
def test_overlaps_on_tensor_views(pick_a, pick_b, expected):
    x = _grid()
    host = np.arange(24.0).reshape(4, 6)
    assert bool(np.shares_memory(pick_a(host), pick_b(host), max_work=None)) == expected
    assert runtime.overlaps(pick_a(x).layout(), pick_b(x).layout()) == expected


@pytest.mark.parametrize("a, b, expected", [
    ((0, (3,), (16,), 4), (8, (2,), (16,), 8), False),   # float32 every 16 B, float64 between
    ((0, (3,), (8,), 8), (4, (3,), (8,), 4), True),      # float32 inside float64 items
    ((2, (4,), (8,), 4), (6, (4,), (8,), 4), False),     # byte offsets off the item grid
    ((2, (4,), (8,), 4), (5, (4,), (8,), 4), True),
    ((1, (3, 2), (20, 5), 4), (10, (3,), (20,), 8), False),  # unaligned, in the gaps
    ((1, (3, 2), (20, 5), 4), (9, (3,), (20,), 8), True),
], ids=["f32-f64-apart", "f32-in-f64", "odd-offsets-apart", "odd-offsets-shared",
        "unaligned-2d-apart", "unaligned-2d-shared"])
def test_overlaps_on_mixed_itemsizes_and_odd_offsets(a, b, expected):
    assert shares_memory(a, b) == expected
    assert runtime.overlaps(a, b) == expected
    assert runtime.overlaps(b, a) == expected


# ---------------------------------------------------------------------- 6. internal overlap
@st.composite
def sliced_tensor_views(draw: Any) -> runtime.Tensor:
    """A view made through the public API: reshape, slices of any step, ints, None, transpose."""
    shape = draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
    dtype = draw(st.sampled_from(["float32", "float64", "uint8", "int64"]))
    view = runtime.zeros(math.prod(shape), dtype).reshape(shape)
    key = []
    for n in shape:
        kind = draw(st.sampled_from(["slice", "int", "none-then-slice"]))
        if kind == "int":
            key.append(draw(st.integers(-n, n - 1)))
            continue
        if kind == "none-then-slice":
            key.append(None)
        bound = st.none() | st.integers(-n - 1, n + 1)
        step = draw(st.sampled_from([1, 2, 3, -1, -2, -3]))
        key.append(slice(draw(bound), draw(bound), step))
    view = view[tuple(key)]
    return view.transpose(draw(st.permutations(range(view.ndim))))


@settings(max_examples=200)
@given(view=sliced_tensor_views())
def test_no_internal_overlap_for_sliced_and_transposed_views(view):
    assert not aliasing.has_internal_overlap(view.layout())


def _bytes_touched(layout: tuple) -> list[int]:
    offset, shape, strides, itemsize = layout
    starts = [offset + sum(i * s for i, s in zip(index, strides)) for index in np.ndindex(*shape)]
    return [start + byte for start in starts for byte in range(itemsize)]


@settings(max_examples=300)
@given(layout=byte_layouts())
def test_has_internal_overlap_never_misses_a_shared_byte(layout):
    touched = _bytes_touched(layout)
    if len(set(touched)) < len(touched):
        assert aliasing.has_internal_overlap(layout)


@pytest.mark.parametrize("layout, expected", [
    ((0, (3,), (0,), 8), True),             # a zero stride over 3 elements
    ((0, (2, 4), (0, 8), 8), True),         # a broadcast row
    ((0, (1, 4), (0, 8), 8), False),        # a zero stride over one element is harmless
    ((0, (3,), (2,), 4), True),             # items wider than their stride
    ((0, (2, 3), (24, 8), 8), False),       # C order
    ((0, (0, 3), (0, 0), 8), False),        # no elements at all
])
def test_has_internal_overlap_examples(layout, expected):
    assert aliasing.has_internal_overlap(layout) == expected


def test_broadcast_layout_has_internal_overlap():
    row = runtime.tensor(np.arange(3.0))
    assert not aliasing.has_internal_overlap(row.layout())
    assert aliasing.has_internal_overlap(row.layout((4, 3)))


def test_out_with_internal_overlap_is_refused():
    x = runtime.tensor(np.arange(4.0))
    smeared = runtime.Tensor(x.block, (4,), x.dtype, strides=(0,), offset=0)
    with pytest.raises(ValueError, match="internally overlapping"):
        ops.add(x, 1.0, out=smeared)
    np.testing.assert_array_equal(x.numpy(), np.arange(4.0))


# ---------------------------------------------------------------------- 7. interleaved views
@pytest.mark.parametrize("device_name", DEVICES)
def test_interleaved_out_does_not_raise(device_name):
    x = on_device(np.arange(12.0).reshape(3, 4), device_name)
    with aliasing_mode("raise"):
        ops.add(x[:, ::2], 100.0, out=x[:, 1::2])
    np.testing.assert_array_equal(x.numpy(), [[0, 100, 2, 102], [4, 104, 6, 106],
                                              [8, 108, 10, 110]])


def test_same_elements_ignores_only_the_strides_of_size_one_dimensions():
    base = (8, (1, 3), (24, 8), 8)
    assert aliasing.same_elements(base, (8, (1, 3), (999, 8), 8))
    assert not aliasing.same_elements(base, (8, (1, 3), (24, 16), 8))
    assert not aliasing.same_elements(base, (0, (1, 3), (24, 8), 8))
    assert not aliasing.same_elements(base, (8, (3, 1), (8, 24), 8))


def test_every_op_declares_a_policy_and_keeps_it():
    # NOTE: can_cast is a rule, Generator and default_generator dropout's masks, not ops
    public = set(ops.__all__) - {"ALIASING_POLICY", "can_cast", "Generator", "default_generator"}
    # NOTE: autograd's derivative kernels of backends/optable.py, not public ops
    backward_kernels = {op.name for op in optable.OPS if not op.public}
    internal = {"cross_entropy_backward", "sub_scaled"}  # autograd's, an optimizer's update
    # NOTE: embedding's and max pooling's backward, batch norm's statistics and a
    # convolution's columns and their adjoint (fresh outs, or an image of a fresh gradient), an
    # op's pointwise formula in one pass (a fresh out),
    # BatchNorm's count, dropout's draw and embedding's max_norm renorm (in place), a training
    # step's held state writes (a copy of a fresh value into state: ops.state_writes)
    unlaunched = {"cross_entropy_backward", "embedding_backward", "max_pool2d_backward",
                  "count_up", "dropout_mask", "embedding_renorm", "commit_state", "moments",
                  "channel_dots", "im2col", "col2im", "pointwise"}
    internal |= unlaunched
    assert set(ops.ALIASING_POLICY) == public | backward_kernels | internal
    assert ops.ALIASING_POLICY["cross_entropy_backward"] == ops.NEVER  # autograd's, fresh out
    runtime.set_aliasing("raise")
    for name, policy in ops.ALIASING_POLICY.items():
        if name in unlaunched:
            continue
        x = runtime.tensor(np.linspace(0.5, 2.0, 9).reshape(3, 3))
        op = getattr(ops, name, None) or (lambda *a, name=name, **k: ops._elementwise(
            name, k["out"], *a))
        args = (x, x) if name in ("matmul", "linear") else (x,)
        if name in optable.BY_NAME:
            condition = runtime.tensor(np.eye(3, dtype=bool))
            args = tuple(condition if kind == optable.BOOL else x
                         for kind in optable.BY_NAME[name].operand_kinds)
        kwargs = {"axis": 0, "keepdims": True} if name in ("sum", "mean", "amax") else {}
        out = x
        if name in ("sum", "mean", "amax"):
            out = x[:1]
        elif name == "layer_norm":
            args = (x, 3)
        elif name == "scaled_dot_product_attention":
            args = (x, x, x)
        elif name == "cross_entropy":
            args, out = (x, np.array([0, 1, 2])), x[0]
        elif name == "cast":
            args = (x, x.dtype)
        elif name == "sub_scaled":
            op, args = ops._sub_scaled, (x, x, 0.5)
        elif name == "batch_norm":
            args, kwargs = (x, None, None), {"training": True}
        elif name == "embedding":
            args, out = ([0, 1], x), x[:2]
        elif name in ("conv2d", "max_pool2d", "avg_pool2d"):  # NCHW: x as one 3x3 image
            image = x.reshape(1, 1, 3, 3)
            args, out = (image, image[:, :, :1, :1] if name == "conv2d" else 1), image
        if policy == ops.ELEMENTWISE:
            assert op(*args, out=out, **kwargs) is out  # the identical view is allowed
        else:
            with pytest.raises(runtime.AliasingError, match=name):
                op(*args, out=out, **kwargs)
