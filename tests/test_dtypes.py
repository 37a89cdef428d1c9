"""Every storage dtype (runtime/dtypes.py) on every device here: creation, views, copies,
constants and `ops.cast`, against NumPy (and ml_dtypes for bfloat16), bit for bit; the ops that
compute refuse the non-float dtypes by name; casts between floats carry gradients and replay in
a captured graph. float16 and bfloat16 compute by the rule "in float32, rounded once to the
result's dtype" (backends/base.py HALVES), checked against the same op on float32 tensors of
the same values, and their gradients against float32 finite differences."""

from __future__ import annotations

import itertools
import math
import re
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import backends
import runtime
from backends.base import ieee
from helpers import assert_rounded_product
from runtime import dtypes, ops

DEVICES = backends.available()
STORAGE = dtypes.DTYPES
PAIRS = list(itertools.product(STORAGE, STORAGE))


def _cuda_stores(dtype: Any) -> bool:
    """False for bfloat16 on a CUDA device whose CuPy has none (older than 14)."""
    from backends.cuda import has_bfloat16

    return np.dtype(dtype) != dtypes.BFLOAT16 or has_bfloat16()


def _on(kind: str, *used: Any) -> Any:
    """The device `kind`; a case using bfloat16 (in `used`) skips on CUDA without it."""
    if kind == "cuda" and not all(_cuda_stores(d) for d in used):
        pytest.skip("this CuPy has no bfloat16 (CuPy 14 or newer with ml_dtypes stores it)")
    return backends.get_device(kind)


def _edges(dtype: np.dtype) -> list[Any]:
    """Values at the edges of `dtype`, as Python numbers."""
    if dtype.kind == "b":
        return [False, True]
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return [int(info.min), int(info.min) + 1, 0, 1, int(info.max) - 1, int(info.max)]
    info = dtypes.finfo(dtype)
    return [float(info.max), -float(info.max), float(info.tiny), float(info.smallest_subnormal),
            0.0, -0.0, math.nan, math.inf, -math.inf, 0.1, 1 / 3, -2.5, 65504.0, 65520.0,
            1 + 2.0**-8 + 2.0**-30, 2.0**24 + 1, 3.3961e38]


@st.composite
def host_values(draw: Any, dtype: np.dtype) -> np.ndarray:
    """An array of `dtype`, shape (2..4, 2..5), with edge values and random ones."""
    shape = (draw(st.integers(2, 4)), draw(st.integers(2, 5)))
    n = shape[0] * shape[1]
    if dtype.kind == "b":
        values = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        return np.array(values, dtype).reshape(shape)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        numbers = st.integers(int(info.min), int(info.max)) | st.sampled_from(_edges(dtype))
        return np.array(draw(st.lists(numbers, min_size=n, max_size=n)), dtype).reshape(shape)
    floats = st.floats(width=64) | st.sampled_from(_edges(dtype))
    wide = np.array(draw(st.lists(floats, min_size=n, max_size=n)), np.float64)
    with np.errstate(over="ignore"):
        return wide.astype(dtype).reshape(shape)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal values and dtypes, NaN equal to NaN, +0 told from -0 (compared as bits)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not dtypes.is_float(a.dtype):
        return bool(np.array_equal(a, b))
    nan = np.isnan(a.astype(np.float64))
    bits = f"u{a.dtype.itemsize}"
    return bool(np.array_equal(nan, np.isnan(b.astype(np.float64)))
                and np.array_equal(np.where(nan, 0, a.view(bits)), np.where(nan, 0, b.view(bits))))


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("dtype", STORAGE, ids=str)
def test_every_dtype_is_stored_viewed_and_copied(kind, dtype):
    device = _on(kind, dtype)
    host = np.arange(12).reshape(3, 4).astype(dtype)
    t = runtime.tensor(host, device=device)
    assert t.dtype == dtype and t.nbytes == host.nbytes
    assert _same(t.numpy(), host)
    assert _same(t.T.numpy(), host.T)  # views
    assert _same(t[1:, ::2].numpy(), host[1:, ::2])
    assert _same(t.reshape(4, 3).numpy(), host.reshape(4, 3))
    copied = ops.copy(t[:, ::-1])
    assert _same(copied.numpy(), host[:, ::-1])
    assert copied.block is not t.block
    empty = runtime.empty((3, 4), dtype, device=device)  # lazy until written
    ops.copy(t, out=empty)
    assert _same(empty.numpy(), host)
    c = runtime.constant(host, device=device)
    assert c.dtype == dtype and runtime.constant(host.copy(), device=device).block is c.block
    assert _same(c.numpy(), host)


@pytest.mark.parametrize("dtype", [d for d in STORAGE if not dtypes.is_float(d)], ids=str)
def test_ops_that_compute_refuse_other_dtypes_by_name(dtype):
    t = runtime.tensor(np.ones((2, 2), dtype))
    for call in (lambda: ops.add(t, t), lambda: ops.exp(t), lambda: ops.matmul(t, t),
                 lambda: ops.sum(t), lambda: ops.relu(t)):
        with pytest.raises(TypeError, match=f"computes on float dtypes only .*, got {dtype}"):
            call()
    with pytest.raises(TypeError, match="cast first"):
        ops.mul(t, 2)


def _integers(dtype: np.dtype) -> np.ndarray:
    """Every value of an integer or bool dtype of at most 16 bits; of a wider one, each value
    next to a power of two or an end of its range (where a narrower dtype first fails)."""
    if dtype.kind == "b" or dtype.itemsize <= 2:
        info = np.iinfo(dtype) if dtype.kind != "b" else None
        low, high = (0, 1) if info is None else (int(info.min), int(info.max))
        return np.arange(low, high + 1).astype(dtype)
    info = np.iinfo(dtype)
    near = {int(info.min), int(info.max), 0}
    for k in range(8 * dtype.itemsize + 1):
        near |= {2**k - 1, 2**k, 2**k + 1, -(2**k) - 1, -(2**k), -(2**k) + 1}
    return np.array(sorted(v for v in near if info.min <= v <= info.max), dtype)


def _survives(values: np.ndarray, dst: np.dtype) -> bool:
    """Whether every value comes through `dst` unchanged (host conversions, the oracle)."""
    there = ieee(values.astype, dst)
    if dtypes.is_float(dst):
        return bool(np.all(np.isfinite(there))
                    and [int(v) for v in there.astype(object)] == values.astype(int).tolist())
    return bool(np.array_equal(there.astype(object), values.astype(object)))


@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=lambda d: str(d))
def test_cast_refuses_exactly_the_pairs_that_change_a_value(src, dst):
    """The rule, against values: floats go to floats by IEEE rounding; integers and bool go
    wherever every value they hold comes through unchanged (every value of a 16-bit dtype is
    tried, the values next to powers of two of a wider one); float to integer never. A refusal
    names both dtypes and the first value that would change; exact=False lets integers round
    into floats, and nothing else."""
    t = runtime.tensor(np.zeros(3, src))
    if dtypes.is_float(src):
        allowed = dtypes.is_float(dst)
        first = None
    else:
        values = _integers(src)
        allowed = _survives(values, dst)
        first = dtypes.first_changed(src, dst)
        assert (first is None) == allowed
        if first is not None:
            assert not _survives(np.array([first], src), dst)  # it does change
    assert ops.can_cast(src, dst) == allowed
    rounding = allowed or dtypes.kind(src) in "iub" and dtypes.is_float(dst)
    assert ops.can_cast(src, dst, exact=False) == rounding
    if allowed:
        assert ops.cast(t, dst).dtype == dst
        if not dtypes.is_float(src):
            got = ops.cast(runtime.tensor(values), dst).numpy()
            assert got.astype(object).tolist() == values.astype(object).tolist()
        return
    with pytest.raises(TypeError, match=f"^cast: {src} to {dst} is refused: ") as caught:
        ops.cast(t, dst)
    if first is not None:
        assert re.search(rf"\b{dst}\b.*(?<![\d-]){first}(?!\d)", str(caught.value))
    if rounding:
        assert "exact=False" in str(caught.value)
        assert ops.cast(t, dst, exact=False).dtype == dst


def test_an_exact_cast_changes_no_value_that_a_rounding_cast_would():
    """int64 2**24 + 1 into float32: refused, and rounded to 2**24 only when asked."""
    t = runtime.tensor(np.array([2**24 + 1, -(2**24) - 1, 3], np.int64))
    with pytest.raises(TypeError, match=r"int64 to float32 is refused: .* 16777217, which "
                                        r"would become 16777216; pass exact=False"):
        ops.cast(t, "float32")
    assert ops.cast(t, "float32", exact=False).numpy().tolist() == [2**24, -(2**24), 3]
    small = runtime.tensor(np.array([-128, 127, 0], np.int8))
    assert ops.cast(small, "float16").numpy().tolist() == [-128, 127, 0]


@pytest.mark.parametrize("call", [lambda t: ops.cast(t, None),
                                  lambda t: ops.can_cast(t.dtype, None),
                                  lambda t: ops.can_cast(None, "float32")])
def test_cast_to_none_is_a_type_error_not_float64(call):
    with pytest.raises(TypeError, match="dtype None names no dtype"):
        call(runtime.tensor(np.zeros(3, np.float32)))


#: every pair cast converts, those it rounds integers for on request (exact=False) too
ALLOWED = [(s, d) for s, d in PAIRS if ops.can_cast(s, d, exact=False)]


@settings(max_examples=200, deadline=None)
@given(data=st.data(), pair=st.sampled_from(ALLOWED), kind=st.sampled_from(DEVICES),
       layout=st.sampled_from(["contiguous", "transposed", "strided"]))
def test_cast_equals_numpy_bit_for_bit_on_every_device(data, pair, kind, layout):
    src, dst = pair
    device = _on(kind, src, dst)
    if "float64" in (src.name, dst.name) and kind == "opencl" and not device.fp64:
        return
    host = data.draw(host_values(src))
    t = runtime.tensor(host, device=device)
    view, expected_in = {"contiguous": (t, host), "transposed": (t.T, host.T),
                         "strided": (t[:, ::2], host[:, ::2])}[layout]
    with np.errstate(over="ignore", invalid="ignore"):
        expected = expected_in.astype(dst)  # ml_dtypes: float64 -> bfloat16 via float32
    assert _same(ops.cast(view, dst, exact=False).numpy(), expected)


def test_float64_to_bfloat16_rounds_through_float32_as_ml_dtypes_does():
    x = np.array([1 + 2.0**-8 + 2.0**-30])  # just above a tie, which float32 makes a tie
    assert x.astype(ml_dtypes.bfloat16)[0] == 1.0
    for kind in DEVICES:
        if kind != "cuda" or _cuda_stores("bfloat16"):
            out = ops.cast(runtime.tensor(x, device=backends.get_device(kind)), "bfloat16")
            assert out.numpy()[0] == 1.0


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_gradients_flow_through_casts_between_floats(half):
    host = np.array([[0.5, -1.25], [2.0, 3.0]], np.float32)
    x = runtime.tensor(host, requires_grad=True)
    y = ops.cast(ops.cast(x, half), "float32")  # stored in half, computed in float32
    loss = ops.sum(ops.mul(y, y))
    loss.backward()
    np.testing.assert_array_equal(x.grad.numpy(), 2 * host.astype(half).astype(np.float32))
    assert x.grad.dtype == np.float32


def test_cast_is_captured_and_replayed_by_a_graph():
    host = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)

    def step(x):
        return ops.cast(ops.mul(ops.cast(ops.cast(x, "bfloat16"), "float32"), 3.0), "float16")

    g = runtime.graph(step)
    for scale in (1.0, 0.1, 1000.0):
        x = runtime.tensor(host * scale)
        assert _same(g(x).numpy(), step(x).numpy())


def test_a_cast_into_its_own_memory_goes_through_a_temporary_or_raises():
    """cast's output may not share memory with its input: a float32 view of an int32 tensor's
    own bytes is computed through a temporary (the default) or refused ("raise")."""
    host = np.arange(-3, 5, dtype=np.int32)
    t = runtime.tensor(host)
    same_bytes = runtime.Tensor(t.block, t.shape, np.float32, t.strides, t.offset)
    ops.cast(t, "float32", out=same_bytes, exact=False)  # NOTE: int32 rounds above 2**24
    np.testing.assert_array_equal(same_bytes.numpy(), host.astype(np.float32))
    old = runtime.set_aliasing("raise")
    try:
        with pytest.raises(runtime.AliasingError, match="cast: the output"):
            ops.cast(runtime.tensor(host), "float32", out=same_bytes, exact=False)  # fine
            ops.cast(t, "float32", out=same_bytes, exact=False)
    finally:
        runtime.set_aliasing(old)


# ---------------------------------------------------------------------- half compute
HALF = [np.dtype("float16"), dtypes.BFLOAT16]
UNARY = ["neg", "exp", "log", "tanh", "sigmoid", "relu", "sqrt"]
BINARY = ["add", "sub", "mul", "div"]


def _half_and_wide(values: np.ndarray, half: np.dtype, device: Any) -> tuple[Any, Any]:
    """The same values as a half tensor and as a float32 tensor (widening is exact)."""
    h = runtime.tensor(values.astype(half), device=device)
    return h, ops.cast(h, "float32")


@settings(max_examples=60, deadline=None)
@given(data=st.data(), half=st.sampled_from(HALF), kind=st.sampled_from(DEVICES),
       name=st.sampled_from(UNARY + BINARY + ["matmul", "linear", "sum", "mean",
                                              "cross_entropy", "mul-number"]))
def test_half_ops_compute_in_float32_and_round_once(data, half, kind, name):
    device = _on(kind, half)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    a = rng.normal(0, 2, (3, 4)).astype(np.float32)
    b = rng.normal(0, 2, (3, 4)).astype(np.float32)
    if name in ("log", "sqrt"):
        a = np.abs(a) + 0.01
    ha, wa = _half_and_wide(a, half, device)
    hb, wb = _half_and_wide(b, half, device)
    f = getattr(ops, name, None)
    calls = {
        **{op: (lambda: (f(ha), f(wa))) for op in UNARY},
        **{op: (lambda: (f(ha, hb), f(wa, wb))) for op in BINARY},
        "matmul": lambda: (ops.matmul(ha, hb.T), ops.matmul(wa, wb.T)),
        "linear": lambda: (ops.linear(ha, hb, ha[0, :3]), ops.linear(wa, wb, wa[0, :3])),
        "sum": lambda: (ops.sum(ha, axis=0), ops.sum(wa, axis=0)),
        "mean": lambda: (ops.mean(ha), ops.mean(wa)),
        "cross_entropy": lambda: (ops.cross_entropy(ha, [0, 3, 1]),
                                  ops.cross_entropy(wa, [0, 3, 1])),
        "mul-number": lambda: (ops.mul(ha, 0.1), ops.mul(wa, 0.1)),  # 0.1 stays float32
    }
    got, wide = calls[name]()
    assert got.dtype == half
    if kind == "cuda" and name == "matmul":  # NOTE: one GemmEx, in cuBLAS's order
        assert_rounded_product(got.numpy(), ha.numpy(), hb.numpy().T)
        return
    assert _same(got.numpy(), ops.cast(wide, half).numpy())


KERNELS = [*(k for k in backends.base.UNARY_KERNELS if k != "copy"), *backends.base.BINARY_KERNELS]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), half=st.sampled_from(HALF), name=st.sampled_from(KERNELS),
       second=st.sampled_from(["array", "broadcast row", "number"]))
def test_every_half_kernel_of_the_cpu_computes_in_float32_and_rounds_once(seed, half, name,
                                                                          second):
    """The CPU device's kernels on half views (the C pass where it takes them, NumPy's float32
    loops where not) against the same kernel on float32 views of the widened values, rounded
    once: the autograd kernels, broadcast rows and numbers included; random bit patterns (NaN,
    inf, subnormals) as operands."""
    device = backends.get_device("cpu")
    rng = np.random.default_rng(seed)

    def bits(shape):
        return rng.integers(0, 2**16, shape, dtype=np.uint32).astype(np.uint16).view(half)

    a = bits((70, 300))
    b = {"array": bits((70, 300)), "broadcast row": np.broadcast_to(bits((300,)), (70, 300)),
         "number": np.float32(rng.normal(0, 2))}[second]
    operands = (a,) if name in backends.base.UNARY_KERNELS else (a, b)
    wide = [x.astype(np.float32) if isinstance(x, np.ndarray) else x for x in operands]
    got = np.zeros(a.shape, half)
    want = np.zeros(a.shape, np.float32)
    run = device.unary if len(operands) == 1 else device.binary
    backends.base.ieee(run, name, *operands, got)
    backends.base.ieee(run, name, *wide, want)
    with np.errstate(all="ignore"):
        assert _same(got, want.astype(half))


@pytest.mark.parametrize("half", HALF, ids=str)
def test_the_cpu_runs_a_training_step_s_half_kernels_in_one_pass(half, monkeypatch):
    """Guards the speed of the rule, not its bits (the tests above): the elementwise kernels a
    training step makes on half tensors (a broadcast bias, relu and its backward, a number,
    in place) never go through float32 copies on the CPU where the C conversions are built."""
    pytest.importorskip("backends._halfconv", reason="the C conversions are not built")
    from backends import numpy as cpu

    if cpu._halfconv is None:
        pytest.skip("BLOCKRT_PURE_PYTHON: the conversions run in NumPy")
    device = backends.get_device("cpu")
    copied = []
    real = cpu.NumpyDevice._in_float32

    def counting(kernel: Any, *args: Any, **kwargs: Any) -> None:
        copied.append(kernel)
        real(kernel, *args, **kwargs)

    monkeypatch.setattr(cpu.NumpyDevice, "_in_float32", staticmethod(counting))
    rng = np.random.default_rng(2)
    x, g = (rng.normal(0, 1, (64, 256)).astype(half) for _ in range(2))
    bias = np.broadcast_to(rng.normal(0, 1, 256).astype(half), (64, 256))
    out = np.empty_like(x)
    device.binary("add", x, bias, out)
    device.unary("relu", out, out)
    device.binary("relu_backward", g, out, out)
    device.binary("mul", out, np.float32(0.01), out)
    device.binary("sub", x, out, out)
    assert copied == []
    device.unary("tanh", out, out)  # NumPy's float32 loop: through copies
    assert len(copied) == 1


@pytest.mark.parametrize("half", HALF, ids=str)
def test_a_fused_half_chain_rounds_once_per_link_as_the_unfused_ops(half):
    """A fused chain (the graph's, and the CPU device's blocked one) rounds each link's result
    to the half dtype, as the ops it replaces would: bit for bit the same as running them one
    by one, over more rows than one block holds."""
    device = backends.get_device("cpu")
    rng = np.random.default_rng(11)
    w = rng.normal(0, 1, (300, 256)).astype(half)
    g = rng.normal(0, 1, (300, 256)).astype(half)
    y = rng.normal(0, 1, (300, 256)).astype(half)
    program = [("mul", (("input", 0), ("number", np.float32(0.01))), half),
               ("tanh_backward", (("link", 0), ("input", 2)), half),
               ("sub", (("input", 1), ("link", 1)), half)]
    fused = w.copy()
    device.fused(program, [g, fused, y], fused)
    prepared = w.copy()
    device.prepare_fused(program, [g, prepared, y], prepared)()
    step = ops.mul(runtime.tensor(g), 0.01).numpy()  # each link as its own op, whole
    factor = np.empty_like(step)
    device.binary("tanh_backward", step, y, factor)  # one kernel: one rounding
    unfused = ops.sub(runtime.tensor(w), runtime.tensor(factor)).numpy()
    assert _same(fused, unfused)
    assert _same(prepared, unfused)
    wide = w.astype(np.float32) - (g.astype(np.float32) * np.float32(0.01)) * (
        1 - y.astype(np.float32) ** 2)
    assert not _same(fused, wide.astype(half))  # NOTE: one rounding for the chain differs


@pytest.mark.parametrize("half", HALF, ids=str)
def test_half_gradients_match_float32_finite_differences(half):
    """d mean(sigmoid(relu(x @ w.T + b))) / d(x, w, b) in half precision, against central
    differences of the same function in float64 at the half values. Tolerances: the half's
    unit roundoff times a few dozen (about 1e-2 for float16, 6e-2 for bfloat16, relative to the
    largest gradient), since each op rounds its result once."""
    rng = np.random.default_rng(7)
    x = rng.normal(0, 1, (4, 3)).astype(half)
    w = rng.normal(0, 1, (5, 3)).astype(half)
    b = rng.normal(0, 1, (5,)).astype(half)
    tensors = [runtime.tensor(v, requires_grad=True) for v in (x, w, b)]
    loss = ops.mean(ops.sigmoid(ops.relu(ops.linear(*tensors))))
    loss.backward()

    def f(x, w, b):
        z = np.maximum(x @ w.T + b, 0)
        return float(np.mean(1 / (1 + np.exp(-z))))

    wide = [v.astype(np.float64) for v in (x, w, b)]
    eps = 1e-6
    tol = {np.dtype("float16"): 1e-2, dtypes.BFLOAT16: 6e-2}[np.dtype(half)]
    for i, t in enumerate(tensors):
        assert t.grad.dtype == half
        numeric = np.zeros_like(wide[i])
        for index in np.ndindex(wide[i].shape):
            up = [v.copy() for v in wide]
            down = [v.copy() for v in wide]
            up[i][index] += eps
            down[i][index] -= eps
            numeric[index] = (f(*up) - f(*down)) / (2 * eps)
        got = t.grad.numpy().astype(np.float64)
        scale = max(np.abs(numeric).max(), 1e-3)
        assert np.abs(got - numeric).max() <= tol * scale, (i, got, numeric)


@pytest.mark.parametrize("half", HALF, ids=str)
def test_a_half_training_step_is_captured_and_replayed_bit_for_bit(half):
    rng = np.random.default_rng(3)
    w0 = rng.normal(0, 0.3, (6, 4)).astype(half)
    x = rng.normal(0, 1, (8, 4)).astype(half)
    labels = rng.integers(0, 6, 8)

    def make():
        w = runtime.tensor(w0, requires_grad=True)

        def step(x):
            loss = ops.mean(ops.cross_entropy(ops.linear(x, w), labels))
            loss.backward()
            with runtime.no_grad():
                ops.sub(w, ops.mul(w.grad, 0.5), out=w)
            w.grad = None
            return loss
        return w, step

    w_eager, eager = make()
    w_graph, graph_step = make()
    graphed = runtime.graph(graph_step)
    for _ in range(3):
        assert _same(graphed(runtime.tensor(x)).numpy(), eager(runtime.tensor(x)).numpy())
        assert _same(w_graph.numpy(), w_eager.numpy())


# ---------------------------------------------------------------------- half chains and sums
#: ops every backend rounds exactly (IEEE): there the devices agree with the CPU bit for bit
EXACT = ["neg", "add", "sub", "mul"]


@st.composite
def half_chains(draw: Any) -> list[tuple[str, int, int | float]]:
    """1-5 ops, each (name, first operand, second operand): operand -1 is input x, -2 input y,
    i >= 0 the result of op i, a float a number."""
    steps: list[tuple[str, int, int | float]] = []
    exact = draw(st.booleans())
    for i in range(draw(st.integers(1, 5))):
        name = draw(st.sampled_from(EXACT if exact else UNARY + BINARY + EXACT))
        first = draw(st.sampled_from([-1, -2] + [i - 1] * 2 * (i > 0) + list(range(i))))
        second = draw(st.sampled_from([-1, -2, *range(i)]) | st.floats(-3, 3, width=32))
        steps.append((name, first, second))
    return steps


def _run_chain(steps: list, x: Any, y: Any) -> Any:
    results: list[Any] = []

    def operand(ref: int | float) -> Any:
        return ref if isinstance(ref, float) else (x, y)[-ref - 1] if ref < 0 else results[ref]

    for name, first, second in steps:
        f = getattr(ops, name)
        args = (operand(first),) if name in UNARY or name == "neg" else (operand(first),
                                                                          operand(second))
        results.append(f(*args))
    return results[-1]


@settings(max_examples=40, deadline=None)
@given(steps=half_chains(), half=st.sampled_from(HALF), kind=st.sampled_from(DEVICES),
       seed=st.integers(0, 2**32 - 1), layout=st.sampled_from(["contiguous", "transposed"]))
def test_half_fused_chains_round_every_op_once_on_every_device(steps, half, kind, seed, layout):
    """A chain of half ops run as one `Device.fused` program (what a captured graph replays)
    and captured by `runtime.graph` gives the ops' own results one by one, bit for bit; with
    exactly rounded ops only, the CPU's results too."""
    device = _on(kind, half)
    rng = np.random.default_rng(seed)
    hosts = [rng.normal(0, 2, (4, 6)).astype(half) for _ in range(2)]
    x, y = (runtime.tensor(h, device=device) for h in hosts)
    if layout == "transposed":
        x, y = (runtime.tensor(np.ascontiguousarray(h.T), device=device).T for h in hosts)
    expected = _run_chain(steps, x, y).numpy()
    program = []
    for name, first, second in steps:
        refs = (first,) if name in UNARY or name == "neg" else (first, second)
        args = tuple(("number", np.float32(r)) if isinstance(r, float) else
                     ("input", -r - 1) if r < 0 else ("link", r) for r in refs)
        program.append((name, args, np.dtype(half)))
    out = runtime.tensor(np.zeros((4, 6), half), device=device)
    # NOTE: through ieee(), as the runtime launches kernels: NaN from log(-1) raises no warning
    ieee(device.fused, program, [x._native_read("test"), y._native_read("test")],
         out._native_write("test"))
    assert _same(out.numpy(), expected), program
    graphed = runtime.graph(lambda x, y: _run_chain(steps, x, y))
    assert _same(graphed(x, y).numpy(), expected)
    if all(name in EXACT for name, _, _ in steps):
        on_cpu = _run_chain(steps, *(runtime.tensor(h, device=backends.get_device("cpu"))
                                     for h in hosts))
        assert _same(on_cpu.numpy(), expected)


@settings(max_examples=40, deadline=None)
@given(half=st.sampled_from(HALF), kind=st.sampled_from(DEVICES), seed=st.integers(0, 2**32 - 1),
       name=st.sampled_from(["sum", "mean"]), axis=st.sampled_from([None, 0, 1, 2, (0, 2)]),
       keepdims=st.booleans(), layout=st.sampled_from(["contiguous", "transposed", "strided"]))
def test_half_reductions_compute_in_float32_and_round_once(half, kind, seed, name, axis,
                                                          keepdims, layout):
    device = _on(kind, half)
    rng = np.random.default_rng(seed)
    h, w = _half_and_wide(rng.normal(0, 2, (5, 6, 70)).astype(np.float32), half, device)
    pick = {"contiguous": lambda t: t, "transposed": lambda t: t.T,
            "strided": lambda t: t[:, ::2, 1:]}[layout]
    f = getattr(ops, name)
    got = f(pick(h), axis=axis, keepdims=keepdims)
    assert got.dtype == half
    assert _same(got.numpy(), ops.cast(f(pick(w), axis=axis, keepdims=keepdims), half).numpy())


@pytest.mark.parametrize("half", HALF, ids=str)
def test_the_rounded_product_check_takes_a_rounding_and_refuses_two_steps_off(half):
    """`assert_rounded_product`, which judges CUDA's half GEMM, passes the CPU's half product
    (float32 sums, one rounding) and fails one whose largest value moved two steps of its dtype."""
    rng = np.random.default_rng(2)
    a, b = (rng.normal(0, 2, shape).astype(half) for shape in ((9, 70), (70, 5)))
    got = ops.matmul(runtime.tensor(a), runtime.tensor(b)).numpy()
    assert_rounded_product(got, a, b)
    moved = got.copy()
    largest = np.unravel_index(np.argmax(np.abs(got.astype(np.float32))), got.shape)
    moved.view(np.uint16)[largest] += 2  # NOTE: two steps away from zero, either sign
    with pytest.raises(AssertionError, match="largest error"):
        assert_rounded_product(moved, a, b)


def test_same_bits_tells_signed_zeros_nan_payloads_and_dtypes_apart():
    """`helpers.same_bits`, which the mixed-precision tests judge bit-for-bit claims by."""
    from helpers import same_bits

    zeros = np.array([0.0, -0.0], np.float32)
    assert same_bits(zeros, zeros.copy()) and same_bits(runtime.tensor(zeros), zeros)
    assert not same_bits(zeros, np.zeros(2, np.float32))
    payloads = np.array([0x7FC00000, 0x7FC00001], np.uint32).view(np.float32)
    assert not same_bits(payloads, payloads[::-1].copy())
    halves = np.ones(3, np.float16)
    assert not same_bits(halves, halves.view(dtypes.BFLOAT16))
    assert not same_bits(halves, halves.reshape(3, 1))
    assert same_bits(np.float32(2.5), np.array(2.5, np.float32))
