"""Autograd: every op's gradient against central finite differences in float64, accumulation,
no_grad, version counters, graph freeing and memory."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import allocators
import runtime
from runtime import nn, ops

EPS = 1e-6


# ---------------------------------------------------------------------- the reference
def finite_differences(f: Callable[[list[np.ndarray]], float],
                       arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """d f / d arrays[i] by central differences, one element at a time (float64)."""
    grads = []
    for i, a in enumerate(arrays):
        grad = np.zeros_like(a)
        for index in np.ndindex(a.shape):
            values = [x.copy() for x in arrays]
            values[i][index] += EPS
            up = f(values)
            values[i][index] -= 2 * EPS
            down = f(values)
            grad[index] = (up - down) / (2 * EPS)
        grads.append(grad)
    return grads


def check_gradients(fn: Callable[..., runtime.Tensor], *arrays: np.ndarray,
                    rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Backward through `fn(*tensors)` weighted by fixed random numbers equals the finite
    differences of the same weighted sum, for every input."""
    weights: list[np.ndarray] = []

    def scalar(values: list[np.ndarray]) -> float:
        with runtime.no_grad():
            out = fn(*[runtime.tensor(v) for v in values]).numpy()
        if not weights:
            weights.append(np.random.default_rng(1).uniform(0.5, 1.5, out.shape))
        return float(np.sum(out * weights[0]))

    expected = finite_differences(scalar, [np.asarray(a, np.float64) for a in arrays])
    leaves = [runtime.tensor(np.asarray(a, np.float64), requires_grad=True) for a in arrays]
    out = fn(*leaves)
    assert out.requires_grad and not out.is_leaf
    loss = ops.sum(ops.mul(out, runtime.tensor(weights[0])))
    loss.backward()
    for leaf, grad in zip(leaves, expected):
        assert leaf.grad is not None, "no gradient reached an input"
        assert leaf.grad.shape == leaf.shape
        np.testing.assert_allclose(leaf.grad.numpy(), grad, rtol=rtol, atol=atol)


def arrays(shape, low=-2.0, high=2.0, away_from_zero=False):
    elements = st.floats(low, high)
    if away_from_zero:  # relu's kink: keep central differences off it
        elements = elements.filter(lambda v: abs(v) > 0.05)
    return hnp.arrays(np.float64, shape, elements=elements)


small_shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=4)

UNARY_DOMAINS = {"neg": (-2, 2), "exp": (-2, 2), "log": (0.2, 3), "tanh": (-2, 2),
                 "sigmoid": (-3, 3), "relu": (-2, 2), "sqrt": (0.2, 3), "copy": (-2, 2)}


# ---------------------------------------------------------------------- every op
@pytest.mark.parametrize("name", sorted(UNARY_DOMAINS))
@given(data=st.data())
@settings(max_examples=10)
def test_unary_gradients_match_finite_differences(name, data):
    shape = data.draw(small_shapes, label="shape")
    low, high = UNARY_DOMAINS[name]
    x = data.draw(arrays(shape, low, high, away_from_zero=name == "relu"), label="x")
    check_gradients(getattr(ops, name), x)


@pytest.mark.parametrize("name", ["add", "sub", "mul", "div"])
@given(data=st.data())
@settings(max_examples=15)
def test_binary_gradients_with_broadcasting_match_finite_differences(name, data):
    shapes = data.draw(hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3,
                                                         min_side=1, max_side=3), label="shapes")
    a = data.draw(arrays(shapes.input_shapes[0]), label="a")
    b = data.draw(arrays(shapes.input_shapes[1], 0.5, 2.0), label="b")  # away from 0 for div
    check_gradients(getattr(ops, name), a, b)


@pytest.mark.parametrize("name", ["add", "sub", "mul", "div"])
@given(x=arrays((2, 3), 0.5, 2.0), number=st.floats(0.5, 2.0))
@settings(max_examples=5)
def test_gradients_with_a_number_operand_on_either_side(name, x, number):
    op = getattr(ops, name)
    check_gradients(lambda t: op(t, number), x)
    check_gradients(lambda t: op(number, t), x)


def test_the_same_tensor_on_both_sides_gets_both_contributions():
    x = np.array([[0.5, -1.5], [2.0, 0.75]])
    for op in (ops.add, ops.sub, ops.mul, ops.div):
        check_gradients(lambda t, op=op: op(t, t), x + 3.0)


MATMUL_SHAPES = [((3, 4), (4, 2)), ((4,), (4, 3)), ((2, 4), (4,)), ((4,), (4,)),
                 ((2, 3, 4), (4, 2)), ((3, 4), (2, 4, 5)), ((2, 1, 2, 3), (3, 3, 2))]


@pytest.mark.parametrize(("a_shape", "b_shape"), MATMUL_SHAPES)
def test_matmul_gradients_match_finite_differences(a_shape, b_shape):
    rng = np.random.default_rng(3)
    check_gradients(ops.matmul, rng.normal(size=a_shape), rng.normal(size=b_shape))


@given(rows=st.integers(1, 4), inner=st.integers(1, 4), cols=st.integers(1, 4),
       transpose=st.booleans())
@settings(max_examples=10)
def test_matmul_of_transposed_views_matches_finite_differences(rows, inner, cols, transpose):
    rng = np.random.default_rng(rows * 16 + inner * 4 + cols)
    a = rng.normal(size=(inner, rows) if transpose else (rows, inner))
    b = rng.normal(size=(cols, inner))
    check_gradients(lambda x, y: ops.matmul(x.T if transpose else x, y.T), a, b)


@pytest.mark.parametrize("name", ["sum", "mean"])
@given(data=st.data(), keepdims=st.booleans())
@settings(max_examples=15)
def test_reduction_gradients_match_finite_differences(name, data, keepdims):
    shape = data.draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4))
    axis = data.draw(st.one_of(st.none(), st.integers(0, len(shape) - 1),
                               st.lists(st.integers(0, len(shape) - 1), min_size=1,
                                        unique=True).map(tuple)), label="axis")
    x = data.draw(arrays(shape), label="x")
    check_gradients(lambda t: getattr(ops, name)(t, axis=axis, keepdims=keepdims), x)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("x_shape", [(3, 4), (4,), (2, 3, 4)])
def test_linear_gradients_match_finite_differences(bias, x_shape):
    rng = np.random.default_rng(5)
    x, w, b = rng.normal(size=x_shape), rng.normal(size=(2, 4)), rng.normal(size=2)
    if bias:
        check_gradients(ops.linear, x, w, b)
    else:
        check_gradients(ops.linear, x, w)


def test_linear_weight_gradient_is_contiguous_like_the_weight():
    w = runtime.tensor(np.ones((3, 5)), requires_grad=True)
    ops.sum(ops.linear(runtime.ones((2, 5), "float64"), w)).backward()
    assert w.grad.is_contiguous() and w.grad.shape == (3, 5)


@given(logits=arrays((4, 3), -5.0, 5.0), labels=hnp.arrays(np.int64, 4, elements=st.integers(0, 2)))
@settings(max_examples=10)
def test_cross_entropy_gradients_match_finite_differences(logits, labels):
    check_gradients(lambda t: ops.cross_entropy(t, labels), logits)


@st.composite
def view_cases(draw):
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4))
    key = []
    for n in shape:
        kind = draw(st.sampled_from(["slice", "int", "all"]))
        if kind == "int":
            key.append(draw(st.integers(-n, n - 1)))
        elif kind == "slice":
            start = draw(st.integers(0, n - 1))
            step = draw(st.sampled_from([1, 2, -1]))
            key.append(slice(start, None, step))
        else:
            key.append(slice(None))
    if draw(st.booleans()):
        key.insert(draw(st.integers(0, len(key))), None)
    return shape, tuple(key)


@given(case=view_cases())
@settings(max_examples=25)
def test_indexing_gradients_scatter_into_the_source(case):
    shape, key = case
    x = np.random.default_rng(len(shape)).normal(size=shape)
    check_gradients(lambda t: ops.mul(t[key], 2.0), x)


def test_view_transpose_and_reshape_gradients_match_finite_differences():
    x = np.random.default_rng(9).normal(size=(2, 3, 4))
    check_gradients(lambda t: ops.mul(t.T, 1.5), x)
    check_gradients(lambda t: ops.tanh(t.transpose(1, 2, 0)), x)
    check_gradients(lambda t: ops.exp(t.reshape(6, 4)), x)
    check_gradients(lambda t: ops.exp(t[:, ::2].reshape(-1)), x)  # the reshape copies
    check_gradients(lambda t: ops.exp(runtime.view(t, (5,), offset=3)), x)


def test_a_view_of_a_leaf_then_in_place_use_keeps_both_paths():
    x = np.arange(1.0, 7.0).reshape(2, 3)
    check_gradients(lambda t: ops.add(ops.mul(t[0], t[1]), ops.sum(t, axis=0)), x)


# ---------------------------------------------------------------------- whole models
@given(widths=st.lists(st.integers(1, 5), min_size=2, max_size=4),
       activation=st.sampled_from([nn.Tanh, nn.Sigmoid]), batch=st.integers(1, 3),
       seed=st.integers(0, 1000))
@settings(max_examples=10)
def test_mlp_gradients_match_finite_differences(widths, activation, batch, seed):
    rng = np.random.default_rng(seed)
    layers = [nn.Dense(a, b, dtype="float64", rng=seed + i)
              for i, (a, b) in enumerate(zip(widths, widths[1:]))]
    modules = []
    for layer in layers:
        modules += [layer, activation()]
    model = nn.Sequential(*modules[:-1])
    params = model.parameters()
    x = rng.normal(size=(batch, widths[0]))
    labels = rng.integers(0, widths[-1], size=batch)
    initial = [p.numpy() for p in params]

    def loss_of(values: list[np.ndarray]) -> float:
        with runtime.no_grad():
            for p, v in zip(params, values):
                p[...] = v
            return nn.softmax_cross_entropy(model(runtime.tensor(x)), labels).item()

    expected = finite_differences(loss_of, initial)
    with runtime.no_grad():
        for p, v in zip(params, initial):
            p[...] = v
    nn.softmax_cross_entropy(model(runtime.tensor(x)), labels).backward()
    for p, grad in zip(params, expected):
        np.testing.assert_allclose(p.grad.numpy(), grad, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------- accumulation, modes
def test_gradients_accumulate_across_backward_calls_until_cleared():
    w = runtime.tensor(np.array([1.0, 2.0]), requires_grad=True)
    for expected in ([3.0, 3.0], [6.0, 6.0]):
        ops.sum(ops.mul(w, 3.0)).backward()
        np.testing.assert_array_equal(w.grad.numpy(), expected)
    w.grad = None
    ops.sum(w).backward()
    np.testing.assert_array_equal(w.grad.numpy(), [1.0, 1.0])


def test_a_shared_gradient_is_never_aliased_between_leaves():
    a = runtime.tensor(np.ones(3), requires_grad=True)
    b = runtime.tensor(np.ones(3), requires_grad=True)
    ops.sum(ops.add(a, b)).backward()  # add hands the same gradient to both
    assert a.grad.block is not b.grad.block
    ops.sum(ops.mul(a, 2.0)).backward()
    np.testing.assert_array_equal(a.grad.numpy(), [3.0, 3.0, 3.0])
    np.testing.assert_array_equal(b.grad.numpy(), [1.0, 1.0, 1.0])


@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=4), data=st.data())
def test_a_partial_sum_takes_the_next_part_in_place_only_where_it_can_be_written(shape, data):
    """`autograd._accumulate` (Note [accumulating in place]) against counting: the sum is
    written into the partial sum only where no two of its indices share an element (its
    offsets all differ), and always for a permutation of C order (a transposed view's
    gradient); the values are the sum either way, and a partial sum it does not write keeps
    its memory."""
    from runtime import autograd
    from runtime._tensor import Tensor

    permuted = data.draw(st.booleans())
    if permuted:
        order = data.draw(st.permutations(range(len(shape))))
        strides, step = [0] * len(shape), 1
        for axis in reversed(order):
            strides[axis], step = step, step * shape[axis]
    else:
        strides = data.draw(st.lists(st.integers(0, 12), min_size=len(shape),
                                     max_size=len(shape)))
    offsets = [sum(i * st_ for i, st_ in zip(index, strides)) for index in np.ndindex(*shape)]
    span = max(offsets) + 1
    memory = runtime.tensor(np.arange(span, dtype=np.float64))
    previous = Tensor(memory.block, tuple(shape), memory.dtype, tuple(strides), 0)
    before = previous.numpy().copy()
    part = runtime.tensor(np.full(shape, 0.5))
    total = autograd._accumulate(previous, part)
    np.testing.assert_array_equal(total.numpy(), before + 0.5)
    in_place = total is previous
    if in_place:
        assert len(set(offsets)) == len(offsets)
    else:
        np.testing.assert_array_equal(memory.numpy(), np.arange(span))
    if permuted:
        assert in_place and sorted(offsets) == list(range(len(offsets)))


@pytest.mark.parametrize("pure", [False, True], ids=["C engine", "Python engine"])
def test_parts_of_a_gradient_are_summed_into_the_partial_sum(pure, monkeypatch):
    """Note [accumulating in place]: q, k and v, views of one transposed block, send their
    gradients to it; the second and third are added into the first's memory, in its layout
    (the transposed view's), not into new tensors, and the values are the sums. A partial sum
    that repeats elements (a broadcast view) gets a new tensor instead. The Python engine is
    watched; the C one, which calls the same `_accumulate`, gives the same values
    (tests/test_fastpath.py compares the two engines' allocations on random graphs)."""
    from runtime import autograd

    calls = []
    if pure:
        monkeypatch.setattr(autograd, "_engine", None)
        accumulate = autograd._accumulate

        def watched(previous, grad):
            layout = (previous.strides, previous.block.id)
            total = accumulate(previous, grad)
            calls.append((layout, total is previous, (total.strides, total.block.id)))
            return total

        monkeypatch.setattr(autograd, "_accumulate", watched)
    rng = np.random.default_rng(0)
    base = rng.standard_normal((2, 5, 3, 4)).astype(np.float32)
    x = runtime.tensor(base, requires_grad=True)
    q, k, v = ops.mul(x, 1.0).transpose(2, 0, 1, 3)
    ops.sum(ops.add(ops.mul(q, k), ops.mul(v, 3.0))).backward()
    want = np.zeros_like(base)
    want[:, :, 0], want[:, :, 1], want[:, :, 2] = base[:, :, 1], base[:, :, 0], 3.0
    np.testing.assert_array_equal(x.grad.numpy(), want)
    if pure:
        assert len(calls) == 2
        for layout, in_place, total in calls:
            assert in_place and total == layout
            assert layout[0] == (4, 60, 12, 1)  # NOTE: the transposed view's, not C order
    # NOTE: a partial sum that repeats elements (a broadcast view) cannot hold the sum
    from runtime._tensor import Tensor

    row = runtime.tensor(np.arange(4, dtype=np.float32))
    repeated = Tensor(row.block, (3, 4), row.dtype, (0, 1), 0)
    part = runtime.tensor(np.ones((3, 4), np.float32))
    total = autograd._accumulate(repeated, part)
    assert total.block is not row.block
    np.testing.assert_array_equal(total.numpy(), np.arange(4) + np.ones((3, 4)))
    np.testing.assert_array_equal(row.numpy(), np.arange(4))


def test_no_grad_records_nothing_and_nests():
    w = runtime.tensor(np.ones(2), requires_grad=True)
    with runtime.no_grad():
        y = ops.mul(w, 2.0)
        with runtime.enable_grad():
            z = ops.mul(w, 2.0)
        assert not runtime.is_grad_enabled()
    assert runtime.is_grad_enabled()
    assert not y.requires_grad and y.grad_fn is None
    assert z.requires_grad and z.grad_fn is not None


def test_constants_and_plain_tensors_get_no_gradient():
    w = runtime.tensor(np.ones(2), requires_grad=True)
    c = runtime.constant(np.array([2.0, 3.0]))
    x = runtime.tensor(np.array([1.0, 1.0]))
    ops.sum(ops.mul(ops.mul(w, c), x)).backward()
    np.testing.assert_array_equal(w.grad.numpy(), [2.0, 3.0])
    assert c.grad is None and x.grad is None and not x.requires_grad


def test_backward_errors_name_the_problem():
    w = runtime.tensor(np.ones(3), requires_grad=True)
    with pytest.raises(runtime.AutogradError, match="does not require grad"):
        runtime.tensor(np.ones(1)).backward()
    with pytest.raises(runtime.AutogradError, match=r"scalar.*\(3,\)"):
        ops.mul(w, 2.0).backward()
    with pytest.raises(runtime.AutogradError, match="gradient has shape"):
        ops.mul(w, 2.0).backward(runtime.tensor(np.ones(2)))
    y = ops.mul(w, 2.0)
    y.backward(runtime.tensor(np.array([1.0, 2.0, 3.0])))
    np.testing.assert_array_equal(w.grad.numpy(), [2.0, 4.0, 6.0])
    with pytest.raises(runtime.AutogradError, match="integer|float"):
        runtime.tensor(np.arange(3)).requires_grad = True
    with pytest.raises(runtime.AutogradError, match="detach"):
        ops.mul(w, 2.0).requires_grad = False


def test_a_second_backward_needs_retain_graph():
    w = runtime.tensor(np.array([1.0, 2.0]), requires_grad=True)
    loss = ops.sum(ops.tanh(w))
    loss.backward(retain_graph=True)
    first = w.grad.numpy()
    loss.backward()
    np.testing.assert_allclose(w.grad.numpy(), 2 * first)
    with pytest.raises(runtime.AutogradError, match="second time.*retain_graph"):
        loss.backward()


def test_writes_while_recording_are_refused():
    w = runtime.tensor(np.ones(3), requires_grad=True)
    out = runtime.zeros(3, "float64")
    with pytest.raises(runtime.AutogradError, match="out="):
        ops.mul(w, 2.0, out=out)
    with pytest.raises(runtime.AutogradError, match="out requires grad"):
        ops.mul(out, 2.0, out=w)
    with pytest.raises(runtime.AutogradError, match="item assignment"):
        w[0] = 5.0
    with runtime.no_grad():
        ops.mul(w, 2.0, out=w)
        w[0] = 5.0
    np.testing.assert_array_equal(w.numpy(), [5.0, 2.0, 2.0])


def test_detach_shares_memory_but_leaves_the_graph():
    w = runtime.tensor(np.ones(2), requires_grad=True)
    y = ops.mul(w, 2.0)
    d = y.detach()
    assert d.block is y.block and not d.requires_grad and d.is_leaf


def test_a_deep_chain_does_not_hit_the_recursion_limit():
    w = runtime.tensor(np.array([1.0]), requires_grad=True)
    y = w
    for _ in range(3000):
        y = ops.mul(y, 1.0)
    ops.sum(y).backward()
    np.testing.assert_array_equal(w.grad.numpy(), [1.0])


# ---------------------------------------------------------------------- version counters
def test_modifying_a_saved_tensor_in_place_is_caught_naming_it():
    x = runtime.tensor(np.array([0.5, 1.0]), requires_grad=True)
    y = ops.tanh(x)
    loss = ops.sum(ops.mul(y, y))
    with runtime.no_grad():
        ops.add(y, 1.0, out=y)  # y was saved by tanh (its output) and by mul (both operands)
    with pytest.raises(runtime.AutogradError, match=r"modified in place.*of mul.*version") as info:
        loss.backward()
    assert f"block #{y.block.id}" in str(info.value)


def test_a_write_through_a_view_bumps_the_version_of_every_view():
    x = runtime.tensor(np.arange(4.0))
    view = x[1:3]
    before = (x.version, view.version)
    with runtime.no_grad():
        view[...] = 7.0
    assert x.version == view.version == before[0] + 1


def test_a_saved_parameter_changed_by_the_optimizer_is_caught_with_its_name():
    model = nn.Sequential(nn.Dense(3, 2, dtype="float64", rng=0))
    opt = nn.SGD(model.parameters(), lr=0.1)
    x = runtime.tensor(np.ones((4, 3)), requires_grad=True)  # so linear saves the weight
    loss = ops.sum(model(x))
    loss.backward(retain_graph=True)
    opt.step()
    with pytest.raises(runtime.AutogradError, match="'0.weight'"):
        loss.backward()


def test_writing_an_unsaved_input_is_fine():
    x = runtime.tensor(np.array([1.0, 2.0]), requires_grad=True)
    a = ops.mul(x, 1.0)
    loss = ops.sum(ops.add(a, 1.0))  # add saves nothing
    with runtime.no_grad():
        ops.mul(a, 5.0, out=a)
    loss.backward()
    np.testing.assert_array_equal(x.grad.numpy(), [1.0, 1.0])


# ---------------------------------------------------------------------- memory
def test_backward_returns_activation_memory_and_the_graph_holds_no_unsaved_tensor():
    alloc = allocators.create("caching", "cpu")
    w = runtime.tensor(np.ones((64, 64)), allocator=alloc, requires_grad=True)
    baseline = alloc.stats()["allocated_bytes"]
    h = ops.add(w, 1.0)   # add saves nothing ...
    y = ops.tanh(h)       # ... and tanh saves only its output
    del h                 # so h's memory goes back now, though the graph goes through it
    assert alloc.stats()["allocated_bytes"] == baseline + w.nbytes
    loss = ops.sum(y)
    del y
    loss.backward()
    del loss
    assert alloc.stats()["allocated_bytes"] == baseline + w.grad.nbytes
    w.grad = None
    assert alloc.stats()["allocated_bytes"] == baseline
