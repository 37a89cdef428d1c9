"""Edges of the graph runtime where a result could silently go wrong.

- Inputs of every dtype and byte order: a graph gives exactly what `runtime.tensor` gives for
  its array arguments, on the capture and on every replay, or the same error.
- Zero-size intermediates under every plan.
- Arguments baked into the capture: NaN finds its capture again, 0.0 and -0.0 do not share one,
  and the captures a graph keeps are bounded.
- A step that writes into its own argument, or is handed a parameter it updates, is refused.
- A capture that fails leaves the state it made usable.
- The plan-time memory check counts only bytes the limited allocator will serve.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import allocators
import runtime
from allocators import LimitAdaptor
from runtime import GraphCaptureError, dtypes, nn, ops
from runtime._tensor import DTYPES

PLANS = ("none", "recycle", "static")

#: Every scalar dtype NumPy has (ml_dtypes' too, which runtime imports), in both byte orders
#: where it has one.
ALL_DTYPES = sorted({np.dtype(t) for t in np.sctypeDict.values()}, key=str)
BOTH_ORDERS = ALL_DTYPES + [d.newbyteorder() for d in ALL_DTYPES if d.byteorder not in "|"]
#: The ones hypothesis can fill with values (NumPy's own numbers and booleans).
NUMERIC = [d for d in BOTH_ORDERS if d.kind in "biufc" and d.num < 256]


def outcome(make) -> tuple[str, object]:
    """("ok", the array) or ("error", the exception's type) of calling make()."""
    try:
        return "ok", make().numpy()
    except (TypeError, ValueError) as error:
        return "error", type(error)


def same(a: tuple[str, object], b: tuple[str, object]) -> bool:
    if a[0] != b[0]:
        return False
    if a[0] == "error":
        return a[1] is b[1]
    x, y = a[1], b[1]
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


@settings(max_examples=150, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(NUMERIC), plan=st.sampled_from(PLANS))
def test_a_graph_input_gives_what_runtime_tensor_gives(data, dtype, plan):
    shape = data.draw(hnp.array_shapes(min_dims=0, max_dims=2, max_side=4), label="shape")
    first, second = (data.draw(hnp.arrays(dtype, shape), label=name)
                     for name in ("first", "second"))
    graphed = runtime.graph(lambda x: ops.copy(x), plan=plan)
    for array in (first, second, first):  # capture, then replays
        wanted = outcome(functools.partial(runtime.tensor, array))
        got = outcome(functools.partial(graphed, array))
        assert same(got, wanted), (array, got, wanted)


@pytest.mark.parametrize("dtype", [d for d in BOTH_ORDERS if dtypes.kind(d) not in "biufc"],
                         ids=str)
def test_inputs_runtime_tensor_refuses_are_refused_by_a_graph(dtype):
    array = np.zeros(3, dtype)
    with pytest.raises(TypeError):
        runtime.tensor(array)
    with pytest.raises(TypeError) as got:
        runtime.graph(lambda x: ops.copy(x))(array)
    assert "graph input" in str(got.value) and str(array.dtype) in str(got.value)


@pytest.mark.parametrize("dtype", [d for d in BOTH_ORDERS if d.num >= 256
                                   and dtypes.kind(d) in "biuf"], ids=str)
def test_ml_dtypes_inputs_give_what_runtime_tensor_gives(dtype):
    graphed = runtime.graph(lambda x: ops.copy(x))
    for values in ([0.0, 1.5, -2.0], [3.0, 0.25, -0.5]):
        array = np.array(values).astype(dtype)
        assert same(outcome(functools.partial(graphed, array)),
                    outcome(functools.partial(runtime.tensor, array)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_arguments_of_every_tensor_dtype(dtype):
    graphed = runtime.graph(lambda x: ops.copy(x))
    for values in ([0, 1, 1, 0], [1, 0, 0, 1]):
        source = runtime.tensor(np.array(values).astype(dtype))
        np.testing.assert_array_equal(graphed(source).numpy(), source.numpy())


# ---------------------------------------------------------------------- zero-size intermediates
@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("fuse", [True, False])
def test_zero_size_intermediates_under_every_plan(plan, fuse):
    graphed = runtime.graph(lambda x: ops.sum(ops.exp(ops.mul(x, 2.0))), plan=plan, fuse=fuse)
    for _ in range(2):
        assert graphed(np.ones((0, 3))).item() == 0.0
    report = graphed.memory_report()
    assert report["planned_bytes"] == 0 and report["naive_bytes"] == 0


# ---------------------------------------------------------------------- baked-in arguments
def test_a_nan_argument_finds_its_capture_again():
    graphed = runtime.graph(lambda x, s: ops.mul(x, s))
    for _ in range(5):
        assert np.isnan(graphed(np.ones(2), float("nan")).numpy()).all()
    assert len(graphed._captures) == 1


def test_zero_and_negative_zero_do_not_share_a_capture():
    graphed = runtime.graph(lambda x, s: ops.mul(x, s))
    positive = graphed(np.ones(2), 0.0).numpy()
    negative = graphed(np.ones(2), -0.0).numpy()
    assert not np.signbit(positive).any() and np.signbit(negative).all()
    assert len(graphed._captures) == 2


def test_the_captures_a_graph_keeps_are_bounded():
    class Fresh:  # hashed by identity: a new one at every call never finds a capture
        pass

    graphed = runtime.graph(lambda x, tag: ops.add(x, 1.0), max_captures=3)
    with pytest.warns(RuntimeWarning, match="holds 3 captures"):
        for _ in range(10):
            np.testing.assert_array_equal(graphed(np.zeros(2), Fresh()).numpy(), np.ones(2))
    assert len(graphed._captures) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graphed(np.zeros(2), Fresh())  # warned once per graph


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_max_captures_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=f"max_captures must be an int >= 1, got {bad!r}"):
        runtime.graph(lambda x: x, max_captures=bad)


# ---------------------------------------------------------------------- writes to arguments
@pytest.mark.parametrize("plan", PLANS)
def test_a_step_that_writes_into_its_argument_is_refused(plan):
    def clip(x):
        ops.relu(x, out=x)
        return ops.sum(x)

    x = runtime.tensor(np.array([-1.0, 2.0]))
    with pytest.raises(GraphCaptureError, match=r"clip: it writes into its argument 0 in "
                                                r"place \(relu\)"):
        runtime.graph(clip, plan=plan)(x)
    assert x.numpy().tolist() == [-1.0, 2.0]


def test_a_parameter_passed_as_an_argument_is_refused():
    w = runtime.tensor(np.ones(3))

    def step(x):
        with runtime.no_grad():
            ops.mul(w, 2.0, out=w)
        return ops.add(x, w)

    graphed = runtime.graph(step)
    np.testing.assert_array_equal(graphed(np.zeros(3)).numpy(), np.full(3, 2.0))
    with pytest.raises(GraphCaptureError, match="argument 0 shares block"):
        graphed(w)  # eager would read w after the update, the graph its copy from before
    np.testing.assert_array_equal(w.numpy(), np.full(3, 2.0))


def test_a_graph_output_fed_back_as_an_argument_is_not_state():
    graphed = runtime.graph(lambda h: ops.add(ops.mul(h, 0.5), 1.0))
    h = graphed(np.zeros(2))
    for k in range(2, 6):
        h = graphed(h)
        np.testing.assert_allclose(h.numpy(), np.full(2, 2.0 - 2.0 ** (1 - k)))


# ---------------------------------------------------------------------- a capture that fails
def test_a_failed_capture_leaves_the_optimizer_state_it_made_usable():
    nn.manual_seed(0)
    model = nn.Dense(4, 2)
    opt = nn.Adam(model.parameters(), lr=0.1)

    def step(x):
        loss = ops.sum(model(x))
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()  # a read while capturing: refused
        return loss

    with pytest.raises(GraphCaptureError):
        runtime.graph(step)(np.ones((3, 4), np.float32))
    loss = ops.sum(model(runtime.tensor(np.ones((3, 4), np.float32))))
    loss.backward()
    opt.step()  # reads the moments the failed capture made
    assert all(np.isfinite(p.numpy()).all() for p in model.parameters())


@pytest.mark.parametrize("before", ["none", "held"])
def test_a_failed_capture_takes_back_the_gradients_only_its_tape_wrote(before):
    """backward inside a capture gives a leaf a gradient the tape only recorded: a capture
    that then fails leaves the leaf's .grad as it was before the call (None, or the old one
    with its values), so an eager step afterwards needs no zero_grad()."""
    nn.manual_seed(0)
    model = nn.Dense(4, 2)
    x = runtime.tensor(np.ones((3, 4), np.float32))
    if before == "held":
        ops.sum(model(x)).backward()
    held = [None if p.grad is None else p.grad.numpy() for p in model.parameters()]

    def step(x):
        loss = ops.sum(model(x))
        loss.backward()
        loss.item()  # a read while capturing: refused
        return loss

    with pytest.raises(GraphCaptureError):
        runtime.graph(step)(np.ones((3, 4), np.float32))
    for p, old in zip(model.parameters(), held):
        if old is None:
            assert p.grad is None
        else:
            np.testing.assert_array_equal(p.grad.numpy(), old)
    ops.sum(model(x)).backward()  # eager: accumulates into what is there
    for p, old in zip(model.parameters(), held):
        assert np.isfinite(p.grad.numpy()).all()
        if old is not None:
            np.testing.assert_array_equal(p.grad.numpy(), old * 2)


# ---------------------------------------------------------------------- plan-time limits
def test_the_plan_check_counts_only_what_the_limited_allocator_serves():
    """Adam's moments go on the parameters' allocator: they do not count against a limit on
    the graph's allocator, so a plan that fits there is not refused."""

    def training():
        nn.manual_seed(0)
        params = allocators.create("direct", "cpu")
        model = nn.Sequential(nn.Dense(256, 512, allocator=params), nn.ReLU(),
                              nn.Dense(512, 4, allocator=params))
        opt = nn.Adam(model.parameters(), lr=1e-3)

        def step(x, y):
            loss = nn.softmax_cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step, 2 * sum(p.nbytes for p in model.parameters())

    x, y = np.ones((2, 256), np.float32), np.arange(2)
    step, _ = training()
    probe = runtime.graph(step, allocator=allocators.create("direct", "cpu"))
    probe(x, y)
    needed = max(probe.timeline()) + 64 * 1024  # intermediates, and outputs with slack
    probe.release()
    step, state_bytes = training()
    assert state_bytes > needed  # the moments alone would not fit under the limit
    limited = LimitAdaptor(allocators.create("direct", "cpu"), needed)
    graphed = runtime.graph(step, allocator=limited)
    for _ in range(2):
        assert np.isfinite(graphed(x, y).item())


@pytest.mark.parametrize("plan", ["static", "recycle"])
def test_a_views_gradient_fills_its_zeros_on_the_device(plan):
    """The gradient of a view (here the three parts of one projection, as attention's q, k and
    v) is the view's gradient in zeros shaped like its base: a graph makes those zeros with a
    fill on the device, so no replay copies, and no graph holds, a host array of the base's
    size; the steps give eager's bits."""
    rng = np.random.default_rng(7)
    weight_data = rng.standard_normal((16, 48)).astype(np.float32)
    x_data = rng.standard_normal((5, 16)).astype(np.float32)

    def make_step():
        weight = runtime.tensor(weight_data, requires_grad=True)

        def step(x):
            qkv = ops.matmul(x, weight).reshape(5, 3, 16).transpose(1, 0, 2)
            loss = ops.sum(ops.mul(ops.mul(qkv[0], qkv[1]), qkv[2]))
            loss.backward()
            grad, weight.grad = weight.grad, None
            return grad

        return step

    eager = make_step()(runtime.tensor(x_data)).numpy()
    graph = runtime.graph(make_step(), plan=plan)
    for _ in range(2):
        assert graph(x_data).numpy().tobytes() == eager.tobytes()
    loads = [i for step in graph._last.steps for i in step.instructions if i.kind == "load"]
    assert max((i.host.nbytes for i in loads), default=0) <= 4, [i.host.shape for i in loads]
