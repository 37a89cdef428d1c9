"""The transformer pieces (issue 30): amax, softmax, log_softmax, layer_norm, GELU, batched
matmul, transposes and scaled_dot_product_attention, against PyTorch CPU on the CPU and on
OpenCL (PoCL, where present); finite differences in float64; `out=` and overlaps; edge values
and bad input; and an attention block whose training step, captured under every plan,
checkpointing and a memory budget, equals the eager step bit for bit."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_autograd import check_gradients
from test_budget import least_bytes

import allocators
import backends
import runtime
from naive_device import NaiveDevice
from runtime import amp, dtypes, nn, ops

torch = pytest.importorskip("torch", reason="PyTorch CPU is the reference of these tests")
F = torch.nn.functional

FLOAT32, FLOAT64 = np.dtype("float32"), np.dtype("float64")
HALVES = [np.dtype("float16"), dtypes.BFLOAT16]
#: forward and gradient tolerances against PyTorch per dtype (a few roundings of each)
TOL = {FLOAT32: dict(rtol=2e-5, atol=2e-6), FLOAT64: dict(rtol=1e-11, atol=1e-12),
       np.dtype("float16"): dict(rtol=2e-3, atol=2e-3), dtypes.BFLOAT16: dict(rtol=2e-2,
                                                                             atol=2e-2)}


def _devices() -> list:
    found = [backends.get_device("cpu")]
    if "opencl" in backends.available():
        found.append(backends.get_device("opencl"))
    return found


DEVICES = _devices()
DEVICE_IDS = [d.name for d in DEVICES]
OPENCL_MISSING = "opencl" not in backends.available()


def _floats(device) -> list[np.dtype]:
    return [d for d in (FLOAT32, FLOAT64) if d in device.capabilities.compute_dtypes]


def _torch(x: np.ndarray, grad: bool = True):
    """x as a float64-exact torch tensor of x's dtype (bfloat16 through float32)."""
    if x.dtype == dtypes.BFLOAT16:
        t = torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
    else:
        t = torch.from_numpy(np.array(x))
    return t.requires_grad_(grad)


def _host(t) -> np.ndarray:
    t = t.detach()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def _close(got: np.ndarray, want: np.ndarray, dtype: np.dtype) -> None:
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                               **TOL[np.dtype(dtype)])


def _compare(fn_ours, fn_torch, arrays, device, dtype, grads=True) -> int:
    """Forward and the gradient of every input (weighted by fixed numbers) against PyTorch;
    returns how many arrays it compared (the value, and each input's gradient)."""
    stored = [a.astype(dtype) for a in arrays]
    ours = [runtime.tensor(a, device=device, requires_grad=grads) for a in stored]
    theirs = [_torch(a, grads) for a in stored]
    out = fn_ours(*ours)
    ref = fn_torch(*theirs)
    assert out.dtype == np.dtype(dtype) and out.shape == tuple(ref.shape)
    _close(out.numpy(), _host(ref), dtype)
    if not grads:
        return 1
    weights = np.random.default_rng(3).uniform(0.5, 1.5, out.shape)
    ops.sum(ops.mul(out, runtime.tensor(weights.astype(dtype), device=device))).backward()
    (ref * _torch(weights.astype(dtype), False)).sum().backward()
    compared = 1
    for mine, theirs_ in zip(ours, theirs):
        _close(mine.grad.numpy(), _host(theirs_.grad), dtype)
        compared += 1
    return compared


# ---------------------------------------------------------------------- amax
@pytest.mark.parametrize("device", DEVICES, ids=DEVICE_IDS)
@pytest.mark.parametrize("axis", [None, 0, 1, -1, (0, 2)])
@pytest.mark.parametrize("keepdims", [False, True])
def test_amax_and_its_gradient_match_torch_ties_split_evenly(device, axis, keepdims):
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 4, (3, 4, 5)).astype(np.float64)  # many ties
    dims = tuple(range(3)) if axis is None else axis
    for dtype in _floats(device):
        assert _compare(lambda t: ops.amax(t, axis, keepdims),
                 lambda t: torch.amax(t, dims, keepdims), [x], device, dtype) == 2


@pytest.mark.parametrize("device", DEVICES, ids=DEVICE_IDS)
def test_amax_propagates_nan_as_torch(device):
    x = np.array([[1.0, np.nan, 3.0], [-np.inf, -np.inf, -np.inf], [2.0, 2.0, -1.0]],
                 np.float32)
    t = runtime.tensor(x, device=device, requires_grad=True)
    y = ops.amax(t, 1)
    ref = _torch(x)
    want = torch.amax(ref, 1)
    np.testing.assert_array_equal(y.numpy(), _host(want))
    ops.sum(y).backward()
    want.sum().backward()
    np.testing.assert_array_equal(t.grad.numpy(), _host(ref.grad))  # NaN row, split tie


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_amax_of_halves_is_exact(dtype):
    x = np.random.default_rng(1).normal(0, 3, (4, 7)).astype(dtype)
    for device in DEVICES:
        got = ops.amax(runtime.tensor(x, device=device), 0).numpy()
        np.testing.assert_array_equal(got, x.max(0))


def test_amax_refuses_an_empty_axis_and_bad_axes_by_number():
    x = runtime.tensor(np.zeros((3, 0)))
    with pytest.raises(ValueError, match=r"axis 1 of x's shape \(3, 0\) has size 0"):
        ops.amax(x, 1)
    with pytest.raises(ValueError, match="has size 0"):
        ops.amax(x)
    assert ops.amax(x, 0).shape == (0,)  # nothing reduced over an empty axis: an empty result
    with pytest.raises(ValueError, match="axis 2 is out of range for a 2-dimensional"):
        ops.amax(runtime.tensor(np.ones((2, 2))), 2)
    with pytest.raises(TypeError, match="float dtypes only"):
        ops.amax(runtime.tensor(np.ones(3, np.int32)))


# ---------------------------------------------------------------------- softmax
SOFTMAXES = [("softmax", F.softmax), ("log_softmax", F.log_softmax)]


@pytest.mark.parametrize("device", DEVICES, ids=DEVICE_IDS)
@pytest.mark.parametrize(("name", "reference"), SOFTMAXES, ids=[n for n, _ in SOFTMAXES])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_softmaxes_and_gradients_match_torch(device, name, reference, axis):
    x = np.random.default_rng(2).normal(0, 4, (3, 5, 6))
    for dtype in _floats(device):
        assert _compare(lambda t: getattr(ops, name)(t, axis), lambda t: reference(t, axis),
                 [x], device, dtype) == 2


@pytest.mark.parametrize(("name", "reference"), SOFTMAXES, ids=[n for n, _ in SOFTMAXES])
@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_softmaxes_of_halves_within_rounding_of_torch(name, reference, dtype):
    x = np.random.default_rng(3).normal(0, 2, (4, 9))
    for device in DEVICES:
        assert _compare(lambda t: getattr(ops, name)(t), lambda t: reference(t, -1), [x], device,
                 dtype) == 2


@pytest.mark.parametrize("device", DEVICES, ids=DEVICE_IDS)
@pytest.mark.parametrize(("name", "reference"), SOFTMAXES, ids=[n for n, _ in SOFTMAXES])
def test_softmax_edge_values_as_torch(device, name, reference):
    inf, nan = np.inf, np.nan
    x = np.array([[-inf, -inf, -inf, -inf],        # a row wholly masked: NaN, as PyTorch
                  [0.0, -inf, 1.0, -inf],          # a causal mask's row
                  [3.0, 3.0, 3.0, 3.0],            # all equal: uniform
                  [1.0, nan, 0.0, 2.0],            # a NaN poisons its row
                  [1e30, -1e30, 0.0, 1e30],        # far apart: no overflow
                  [inf, 0.0, 1.0, 2.0]], np.float32)
    got = getattr(ops, name)(runtime.tensor(x, device=device)).numpy()
    want = _host(reference(_torch(x, False), -1))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))


@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4), data=st.data(),
       log=st.booleans())
@settings(max_examples=40)
def test_softmax_over_any_axis_of_any_shape_matches_torch(shape, data, log):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1), label="axis")
    seed = data.draw(st.integers(0, 2 ** 16), label="seed")
    x = np.random.default_rng(seed).normal(0, 3, shape)
    name, reference = SOFTMAXES[log]
    assert _compare(lambda t: getattr(ops, name)(t, axis), lambda t: reference(t, axis), [x],
             DEVICES[0], FLOAT64) == 2


@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), data=st.data())
@settings(max_examples=30)
def test_amax_over_any_axes_matches_torch(shape, data):
    axes = data.draw(st.lists(st.integers(0, len(shape) - 1), unique=True, min_size=1),
                     label="axes")
    keepdims = data.draw(st.booleans(), label="keepdims")
    x = np.random.default_rng(len(shape)).integers(-2, 3, shape).astype(np.float64)
    assert _compare(lambda t: ops.amax(t, tuple(axes), keepdims),
             lambda t: torch.amax(t, tuple(axes), keepdims), [x], DEVICES[0], FLOAT64) == 2


def test_softmax_finite_differences():
    x = np.random.default_rng(4).normal(0, 1, (3, 4))
    for axis in (0, 1):
        check_gradients(lambda t, axis=axis: ops.softmax(t, axis), x, rtol=1e-6, atol=1e-8)
        check_gradients(lambda t, axis=axis: ops.log_softmax(t, axis), x, rtol=1e-6,
                        atol=1e-8)
    check_gradients(lambda t: ops.amax(t, 1), x, rtol=1e-6, atol=1e-8)


def test_softmax_refuses_bad_axes_by_name():
    x = runtime.tensor(np.ones((2, 3)))
    with pytest.raises(ValueError, match="axis 2 is out of range for a 2-dimensional"):
        ops.softmax(x, 2)
    with pytest.raises(TypeError, match="softmax: axis must be one int, got"):
        ops.softmax(x, (0, 1))
    with pytest.raises(TypeError, match="log_softmax: axis must be one int"):
        ops.log_softmax(x, None)
    for op, axis in ((ops.softmax, 1), (ops.log_softmax, -2)):
        with pytest.raises(ValueError, match=f"{op.__name__}: axis {axis} is out of range for "
                                             "a 0-dimensional x .* axis 0 or -1"):
            op(runtime.tensor(np.float64(1.0)), axis)
        with pytest.raises(IndexError, match="Dimension out of range"):  # NOTE: PyTorch too
            getattr(torch, op.__name__)(torch.tensor(1.0), axis)
    assert ops.softmax(runtime.tensor(np.ones((2, 0))), -1).shape == (2, 0)


@pytest.mark.parametrize("device", DEVICES, ids=DEVICE_IDS)
@pytest.mark.parametrize("axis", [0, -1])
@pytest.mark.parametrize("value", [2.5, -1e30, np.inf, -np.inf, np.nan])
def test_softmax_of_a_0d_tensor_is_pytorchs(device, axis, value):
    """A 0-d x is one element to normalise, as in PyTorch: softmax 1 and log_softmax 0 with
    gradient 0, NaN for an infinity or a NaN; eagerly and in a captured graph."""
    for op in (ops.softmax, ops.log_softmax):
        for dtype in _floats(device):
            x = runtime.tensor(np.array(value, dtype), device=device, requires_grad=True)
            y = op(x, axis)
            y.backward(runtime.tensor(np.array(1.5, dtype), device=device))
            tx = torch.tensor(np.array(value, dtype), requires_grad=True)
            ty = getattr(torch, op.__name__)(tx, axis)
            ty.backward(torch.tensor(np.array(1.5, dtype)))
            assert y.shape == () and y.dtype == dtype
            np.testing.assert_array_equal(y.numpy(), ty.detach().numpy())
            np.testing.assert_array_equal(x.grad.numpy(), tx.grad.numpy())
            captured = runtime.graph(lambda t, op=op: op(t, axis), plan="static")
            for _ in range(2):  # NOTE: a NaN's sign is the machine's (docs/testing.md)
                got = captured(np.array(value, dtype)).numpy()
                assert got.tobytes() == y.numpy().tobytes() or np.isnan(got) and np.isnan(y.numpy())


def test_softmax_under_autocast_runs_in_float32():
    x = runtime.tensor(np.random.default_rng(5).normal(size=(2, 5)).astype(np.float16))
    w = runtime.tensor(np.eye(5, dtype=np.float32))
    with amp.autocast("float16"):
        h = ops.matmul(x, w)
        assert h.dtype == np.float16
        for op in (ops.softmax, ops.log_softmax):
            y = op(h)
            assert y.dtype == np.float32
            np.testing.assert_allclose(y.numpy(), op(ops.cast(h, "float32")).numpy())
        assert ops.layer_norm(h, 5).dtype == np.float32


# ---------------------------------------------------------------------- layer norm
@pytest.mark.parametrize("device", DEVICES, ids=DEVICE_IDS)
@pytest.mark.parametrize("normalized", [(6,), (5, 6)], ids=["last", "last-two"])
@pytest.mark.parametrize("affine", ["both", "weight", "none"])
def test_layer_norm_and_gradients_match_torch(device, normalized, affine):
    rng = np.random.default_rng(6)
    x = rng.normal(1, 3, (4, 5, 6))
    params = [rng.normal(1, 0.5, normalized), rng.normal(0, 0.5, normalized)]
    params = {"both": params, "weight": params[:1], "none": []}[affine]

    def ours(x, *p):
        return ops.layer_norm(x, normalized, *p, eps=1e-5)

    def theirs(x, *p):
        return F.layer_norm(x, normalized, *p, eps=1e-5)

    for dtype in _floats(device):
        assert _compare(ours, theirs, [x, *params], device, dtype) == 2 + len(params)


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_layer_norm_of_halves_within_rounding_of_torch(dtype):
    rng = np.random.default_rng(7)
    x, w, b = rng.normal(0, 2, (3, 8)), rng.normal(1, 0.2, 8), rng.normal(0, 0.2, 8)
    for device in DEVICES:
        assert _compare(lambda *t: ops.layer_norm(t[0], 8, t[1], t[2]),
                 lambda *t: F.layer_norm(t[0], (8,), t[1], t[2]), [x, w, b], device,
                 dtype) == 4


def test_layer_norm_finite_differences():
    rng = np.random.default_rng(8)
    x, w, b = rng.normal(0, 1, (3, 5)), rng.normal(1, 0.3, 5), rng.normal(0, 0.3, 5)
    check_gradients(lambda x, w, b: ops.layer_norm(x, 5, w, b), x, w, b, rtol=1e-5, atol=1e-7)
    check_gradients(lambda x: ops.layer_norm(x, (3, 5)), x, rtol=1e-5, atol=1e-7)


def test_layer_norm_edge_values():
    x = runtime.tensor(np.array([[2.0, 2.0, 2.0], [1.0, np.nan, 0.0], [1e10, -1e10, 0.0]]))
    got = ops.layer_norm(x, 3).numpy()
    want = _host(F.layer_norm(_torch(x.numpy(), False), (3,)))
    np.testing.assert_array_equal(got[0], [0.0, 0.0, 0.0])  # var 0: rstd 1/sqrt(eps) times 0
    assert np.isnan(got[1]).all() and np.isnan(want[1]).all()
    np.testing.assert_allclose(got[2], want[2], rtol=1e-12)


def test_layer_norm_refuses_bad_input_by_number():
    x = runtime.tensor(np.ones((2, 3, 4)))
    with pytest.raises(ValueError, match=r"normalized_shape \(3,\) must be the last 1 "
                                         r"dimensions of x, whose shape is \(2, 3, 4\)"):
        ops.layer_norm(x, 3)
    with pytest.raises(ValueError, match=r"weight has shape \(3,\), expected \(4,\)"):
        ops.layer_norm(x, 4, runtime.tensor(np.ones(3)))
    with pytest.raises(ValueError, match="eps must be a finite number >= 0, got -1"):
        ops.layer_norm(x, 4, eps=-1)
    with pytest.raises(TypeError, match="normalized_shape is an int or a tuple of ints"):
        ops.layer_norm(x, "4")
    with pytest.raises(TypeError, match="different dtypes"):
        ops.layer_norm(x, 4, runtime.tensor(np.ones(4, np.float32)))
    with pytest.raises(ValueError, match="LayerNorm: normalized_shape must be a positive int"):
        nn.LayerNorm(0)


def test_layer_norm_module_as_torch():
    norm = nn.LayerNorm((2, 3), eps=1e-6)
    assert [p.shape for p in norm.parameters()] == [(2, 3), (2, 3)]
    np.testing.assert_array_equal(norm.weight.numpy(), np.ones((2, 3), np.float32))
    np.testing.assert_array_equal(norm.bias.numpy(), np.zeros((2, 3), np.float32))
    assert repr(norm) == "LayerNorm((2, 3), eps=1e-06, elementwise_affine=True)"
    assert nn.LayerNorm(4, elementwise_affine=False).parameters() == []
    assert len(nn.LayerNorm(4, bias=False).parameters()) == 1
    x = np.random.default_rng(9).normal(size=(4, 2, 3)).astype(np.float32)
    want = torch.nn.LayerNorm((2, 3), eps=1e-6)(torch.from_numpy(x))
    np.testing.assert_allclose(norm(runtime.tensor(x)).numpy(), _host(want), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("device", DEVICES, ids=DEVICE_IDS)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_module_and_op_as_torch(device, approximate):
    """Both forms, the module and the op, value and gradient against PyTorch's, and against
    finite differences."""
    x = np.linspace(-6, 6, 49)
    for dtype in _floats(device):
        assert _compare(lambda t: nn.GELU(approximate)(t),
                        lambda t: torch.nn.GELU(approximate)(t), [x], device, dtype) == 2
        assert _compare(lambda t: ops.gelu(t, approximate),
                        lambda t: torch.nn.functional.gelu(t, approximate=approximate), [x],
                        device, dtype) == 2
    assert repr(nn.GELU(approximate)) == repr(torch.nn.GELU(approximate))
    check_gradients(lambda t: ops.gelu(t, approximate=approximate), x[::4], rtol=1e-6,
                    atol=1e-8)


@pytest.mark.parametrize("bad", ["Tanh", "erf", None, 1])
def test_gelu_refuses_an_unknown_approximation(bad):
    with pytest.raises(ValueError, match=r"approximate must be 'none' or 'tanh'.*got"):
        nn.GELU(bad)
    with pytest.raises(ValueError, match=r"gelu: approximate must be 'none' or 'tanh'.*got"):
        ops.gelu(runtime.tensor(np.zeros(2)), approximate=bad)


# ---------------------------------------------------------------------- out= and overlaps
OUT_OPS = {
    "amax": lambda x, out: ops.amax(x, 1, True, out=out),
    "softmax": lambda x, out: ops.softmax(x, 1, out=out),
    "log_softmax": lambda x, out: ops.log_softmax(x, 1, out=out),
    "layer_norm": lambda x, out: ops.layer_norm(x, 4, out=out),
}


@pytest.mark.parametrize("name", sorted(OUT_OPS))
@pytest.mark.parametrize("device", DEVICES, ids=DEVICE_IDS)
def test_out_is_written_and_overlaps_are_copied_or_refused(name, device):
    run = OUT_OPS[name]
    x = np.random.default_rng(10).normal(size=(3, 4))
    want = run(runtime.tensor(x, device=device), None).numpy()
    out = runtime.empty(want.shape, "float64", device=device)
    assert run(runtime.tensor(x, device=device), out) is out
    np.testing.assert_array_equal(out.numpy(), want)
    # out over x itself (the identical view): refused, never computed in place
    runtime.set_aliasing("raise")
    t = runtime.tensor(x, device=device)
    target = t if want.shape == x.shape else t[:, :1]
    with pytest.raises(runtime.AliasingError, match=f"{name}: the output .* may not share "
                                                    f"memory with any input"):
        run(t, target)
    np.testing.assert_array_equal(t.numpy(), x)  # nothing written
    runtime.set_aliasing("copy")
    assert run(t, target) is target
    np.testing.assert_array_equal(target.numpy(), want)
    with pytest.raises(runtime.AutogradError, match="out="):
        run(runtime.tensor(x, device=device, requires_grad=True), out)
    with pytest.raises(ValueError, match="out has shape"):
        run(runtime.tensor(x, device=device), runtime.empty((9,), "float64", device=device))


def test_attention_out_refuses_overlap_with_query():
    q = runtime.tensor(np.random.default_rng(11).normal(size=(2, 3, 4)))
    want = ops.scaled_dot_product_attention(q, q, q).numpy()
    runtime.set_aliasing("raise")
    with pytest.raises(runtime.AliasingError, match="input query"):
        ops.scaled_dot_product_attention(q, q, q, out=q)
    runtime.set_aliasing("copy")
    ops.scaled_dot_product_attention(q, q, q, out=q)
    np.testing.assert_array_equal(q.numpy(), want)


# ---------------------------------------------------------------------- batched products
@pytest.mark.parametrize("device", DEVICES, ids=DEVICE_IDS)
@pytest.mark.parametrize(("a_shape", "b_shape"), [((2, 3, 4, 5), (2, 3, 5, 2)),
                                                  ((2, 1, 4, 5), (3, 5, 2)),
                                                  ((4, 5), (2, 3, 5, 2)),
                                                  ((2, 3, 4, 5), (5,))])
def test_batched_matmul_broadcasts_as_torch(device, a_shape, b_shape):
    rng = np.random.default_rng(12)
    a, b = rng.normal(size=a_shape), rng.normal(size=b_shape)
    for dtype in _floats(device):
        assert _compare(ops.matmul, torch.matmul, [a, b], device, dtype) == 3


@pytest.mark.parametrize("device", DEVICES, ids=DEVICE_IDS)
def test_transposed_views_into_products_as_torch(device):
    x = np.random.default_rng(13).normal(size=(2, 5, 3, 4))  # (batch, seq, heads, dim)

    def ours(t):
        h = t.transpose(0, 2, 1, 3)                            # (batch, heads, seq, dim)
        return ops.matmul(h, h.transpose(0, 1, 3, 2)).transpose(0, 2, 1, 3).reshape(2, 5, 15)

    def theirs(t):
        h = t.permute(0, 2, 1, 3)
        return (h @ h.transpose(-1, -2)).permute(0, 2, 1, 3).reshape(2, 5, 15)

    for dtype in _floats(device):
        assert _compare(ours, theirs, [x], device, dtype) == 2


# ---------------------------------------------------------------------- attention
@pytest.mark.parametrize("device", DEVICES, ids=DEVICE_IDS)
@pytest.mark.parametrize("mask", ["none", "causal", "bool", "float"])
def test_scaled_dot_product_attention_matches_torch(device, mask):
    rng = np.random.default_rng(14)
    q, k, v = rng.normal(size=(2, 3, 5, 4)), rng.normal(size=(2, 3, 6, 4)), \
        rng.normal(size=(2, 3, 6, 7))
    allowed = rng.random((5, 6)) < 0.7
    allowed[:, 0] = True
    extra = {"none": {}, "causal": {"is_causal": True}}.get(mask)
    for dtype in _floats(device):
        if extra is None:
            host = allowed if mask == "bool" else np.where(allowed, 0.0, -1e4).astype(dtype)
            mine = {"attn_mask": runtime.tensor(host, device=device)}
            theirs = {"attn_mask": torch.from_numpy(host)}
        else:
            mine = theirs = extra
        assert _compare(lambda *t, kw=mine: ops.scaled_dot_product_attention(*t, **kw),
                 lambda *t, kw=theirs: F.scaled_dot_product_attention(*t, **kw), [q, k, v],
                 device, dtype) == 4


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_scaled_dot_product_attention_of_halves_within_rounding_of_torch(dtype):
    rng = np.random.default_rng(17)
    q, k, v = (rng.normal(size=(2, 5, 4)) for _ in range(3))
    for device in DEVICES:
        assert _compare(lambda *t: ops.scaled_dot_product_attention(*t, is_causal=True),
                 lambda *t: F.scaled_dot_product_attention(*t, is_causal=True), [q, k, v],
                 device, dtype, grads=False) == 1


def test_the_ops_on_the_overlap_unsafe_naive_device_give_the_cpus_results():
    """Element-by-element kernels (tests/naive_device.py): each op's result is the CPU's, so
    no kernel met overlapping operands."""
    naive = NaiveDevice()
    x = np.random.default_rng(18).normal(size=(3, 4))
    for run in (lambda t: ops.amax(t, 1), lambda t: ops.softmax(t, 0),
                lambda t: ops.log_softmax(t), lambda t: ops.layer_norm(t, 4),
                lambda t: ops.gelu(t)):
        np.testing.assert_allclose(run(runtime.tensor(x, device=naive)).numpy(),
                                   run(runtime.tensor(x)).numpy(), rtol=1e-12, atol=1e-15)


def test_scaled_dot_product_attention_finite_differences():
    rng = np.random.default_rng(15)
    q, k, v = (rng.normal(size=(2, 3, 4)) for _ in range(3))
    check_gradients(lambda *t: ops.scaled_dot_product_attention(*t, is_causal=True), q, k, v,
                    rtol=1e-5, atol=1e-7)


def test_scaled_dot_product_attention_refuses_bad_input_by_number():
    q = runtime.tensor(np.ones((2, 3, 4)))
    with pytest.raises(ValueError, match=r"query \(2, 3, 4\), key \(2, 3, 5\) and value"):
        ops.scaled_dot_product_attention(q, runtime.tensor(np.ones((2, 3, 5))), q)
    with pytest.raises(ValueError, match=r"dropout_p must lie in \[0.0, 1.0\], got 1.5"):
        ops.scaled_dot_product_attention(q, q, q, dropout_p=1.5)
    with pytest.raises(TypeError, match="generator must be an ops.Generator or None, got 7"):
        ops.scaled_dot_product_attention(q, q, q, dropout_p=0.1, generator=7)
    with pytest.raises(ValueError, match="not both"):
        ops.scaled_dot_product_attention(q, q, q, runtime.tensor(np.zeros((3, 3))),
                                         is_causal=True)
    with pytest.raises(ValueError, match=r"at least 2 dimensions .* got shape \(4,\)"):
        ops.scaled_dot_product_attention(runtime.tensor(np.ones(4)), q, q)


def _held_after_forward(dropout_p: float) -> tuple[int, int]:
    """Bytes an attention forward leaves allocated (its output and what its backward keeps)
    beyond its operands, and the output's own bytes."""
    stats = allocators.StatisticsAdaptor(allocators.create("direct", "cpu"))
    rng = np.random.default_rng(21)
    q, k, v = (runtime.tensor(rng.normal(size=(2, 3, 16, 8)), allocator=stats,
                              requires_grad=True) for _ in range(3))
    before = stats.stats()["allocated_bytes"]
    y = ops.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                         generator=ops.Generator(1))
    return stats.stats()["allocated_bytes"] - before, y.nbytes


def test_attention_keeps_no_weights_for_backward():
    """Recording a gradient, attention keeps its operands and the rows' log-sum-exp, not its
    (..., L, S) weights nor the scaled query (Note [attention recomputes its weights]): after
    the forward only the output and one float64 a row are allocated. With dropout it stays
    composed, and keeps them."""
    held, output = _held_after_forward(0.0)
    assert held == output + 2 * 3 * 16 * 8
    held, output = _held_after_forward(0.25)
    weights = 2 * 3 * 16 * 16 * 8
    assert held >= output + 2 * weights  # NOTE: softmax's output and the dropped weights


def _attention_both_ways(monkeypatch, shapes, mask_kind, seed):
    """Value and gradients of attention recomputing its weights, and of the composed ops."""
    rng = np.random.default_rng(seed)
    arrays = [rng.normal(size=shape) for shape in shapes]
    rows, cols = shapes[0][-2], shapes[1][-2]
    allowed = rng.random((rows, cols)) < 0.6
    allowed[0] = False  # NOTE: a row that attends to nothing: NaN, as the composed ops give
    masks = {"none": {}, "causal": {"is_causal": True},
             "bool": {"attn_mask": runtime.tensor(allowed)},
             "float": {"attn_mask": runtime.tensor(np.where(allowed, 0.5, -1e4))}}
    upstream = runtime.tensor(rng.uniform(0.5, 1.5, shapes[0][:-1] + shapes[2][-1:]))
    results = []
    for recompute in (True, False):
        if not recompute:
            monkeypatch.setattr(ops, "_recomputes_weights", lambda *args: False)
        tensors = [runtime.tensor(a, requires_grad=True) for a in arrays]
        y = ops.scaled_dot_product_attention(*tensors, **masks[mask_kind])
        ops.sum(ops.mul(y, upstream)).backward()
        results.append([y.numpy()] + [t.grad.numpy() for t in tensors])
    monkeypatch.undo()
    return results


@settings(max_examples=25, deadline=None)
@given(lead=st.lists(st.integers(1, 3), min_size=0, max_size=2), rows=st.integers(1, 6),
       cols=st.integers(1, 6), e=st.integers(1, 5), ev=st.integers(1, 5),
       mask_kind=st.sampled_from(["none", "causal", "bool", "float"]),
       seed=st.integers(0, 2**16))
def test_recomputed_attention_gives_the_composed_gradients(lead, rows, cols, e, ev, mask_kind,
                                                          seed):
    """Attention that makes its weights again in backward gives the composed ops' value bit for
    bit and their gradients to rounding (float64; NaN where they give NaN: a fully masked row),
    over leading dimensions and every mask."""
    shapes = [(*lead, rows, e), (*lead, cols, e), (*lead, cols, ev)]
    with pytest.MonkeyPatch.context() as monkeypatch:
        recomputed, composed = _attention_both_ways(monkeypatch, shapes, mask_kind, seed)
    # NOTE: the forward computes softmax by softmax's own ops: the value bit for bit
    assert recomputed[0].tobytes() == composed[0].tobytes()
    for mine, theirs in zip(recomputed, composed):
        np.testing.assert_allclose(mine, theirs, rtol=1e-10, atol=1e-12)


def test_a_float_mask_that_wants_a_gradient_gets_it():
    """A float mask that requires a gradient keeps attention composed, and gets the gradient
    of an added score (the scores' gradient), as PyTorch's."""
    rng = np.random.default_rng(22)
    q, k, v = (rng.normal(size=(2, 4, 3)) for _ in range(3))
    mask = rng.normal(size=(4, 4))
    assert _compare(lambda *t: ops.scaled_dot_product_attention(*t[:3], attn_mask=t[3]),
                    lambda *t: F.scaled_dot_product_attention(*t[:3], attn_mask=t[3]),
                    [q, k, v, mask], "cpu", np.float64) == 5


# ---------------------------------------------------------------------- an attention block
class Attention(nn.Module):
    """A GPT block: LayerNorm, a qkv Dense, heads by reshape and transpose, causal attention,
    a projection and a residual; LayerNorm, an MLP with GELU and a residual."""

    def __init__(self, width: int, heads: int, rng: np.random.Generator,
                 dtype: str = "float32") -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width, dtype=dtype)
        self.qkv = nn.Dense(width, 3 * width, dtype=dtype, rng=rng)
        self.proj = nn.Dense(width, width, dtype=dtype, rng=rng)
        self.ln2 = nn.LayerNorm(width, dtype=dtype)
        self.fc = nn.Dense(width, 4 * width, dtype=dtype, rng=rng)
        self.gelu = nn.GELU()
        self.out = nn.Dense(4 * width, width, dtype=dtype, rng=rng)

    def forward(self, x):
        batch, seq, width = x.shape
        qkv = self.qkv(self.ln1(x)).reshape(batch, seq, 3, self.heads, width // self.heads)
        qkv = qkv.transpose(2, 0, 3, 1, 4)                   # (3, batch, heads, seq, dim)
        y = ops.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        y = y.transpose(0, 2, 1, 3).reshape(batch, seq, width)
        x = ops.add(x, self.proj(y))
        return ops.add(x, self.out(self.gelu(self.fc(self.ln2(x)))))


class TinyGPT(nn.Module):
    def __init__(self, width: int = 16, heads: int = 4, classes: int = 7, seed: int = 0,
                 dtype: str = "float32") -> None:
        super().__init__()
        rng = np.random.default_rng(seed)
        self.block = Attention(width, heads, rng, dtype)
        self.ln = nn.LayerNorm(width, dtype=dtype)
        self.head = nn.Dense(width, classes, dtype=dtype, rng=rng)

    def forward(self, x):
        h = self.ln(self.block(x))
        return self.head(h.reshape(-1, h.shape[-1]))


def _gpt_data(steps: int, batch: int = 2, seq: int = 5, width: int = 16, classes: int = 7):
    rng = np.random.default_rng(16)
    return [(rng.normal(size=(batch, seq, width)).astype(np.float32),
             rng.integers(0, classes, batch * seq)) for _ in range(steps)]


def _adam_step() -> tuple[nn.Module, Any]:
    model = TinyGPT()
    return model, nn.train_step(model, nn.Adam(model.parameters(), lr=1e-2))


def _train(graph_options: dict | None, steps: int = 3) -> tuple[list, list, dict | None]:
    model, step = _adam_step()
    if graph_options is not None:
        step = runtime.graph(step, **graph_options)
    losses = [step(runtime.tensor(x), y).numpy() for x, y in _gpt_data(steps)]
    report = step.memory_report() if graph_options is not None else None
    return losses, [p.numpy() for p in model.parameters()], report


GRAPHS = {"recycle": dict(plan="recycle"), "static": dict(plan="static"),
          "static-plain": dict(plan="static", fuse=False),
          "sqrt": dict(plan="static", checkpoint="sqrt"),
          # NOTE: the least this step's intermediates reach (the refusal of a 1-byte budget
          # names it: 18.5 KiB against 21 KiB keeping everything where the CPU's chains are
          # compiled, more where a chain needs scratch), which recomputes most activations
          "budget": dict(memory_budget="least")}


@pytest.mark.parametrize("config", sorted(GRAPHS))
def test_an_attention_block_trains_under_a_graph_bit_for_bit_as_eager(config):
    eager_losses, eager_params, _ = _train(None)
    options = dict(GRAPHS[config])
    if options.get("memory_budget") == "least":
        x, y = _gpt_data(1)[0]
        options["memory_budget"] = least_bytes(lambda: _adam_step()[1], runtime.tensor(x), y)
    losses, params, report = _train(options)
    for got, want in zip(losses, eager_losses):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(params, eager_params):
        np.testing.assert_array_equal(got, want)
    assert eager_losses[-1] < eager_losses[0]
    if config in ("sqrt", "budget"):
        assert report["recomputed"] > 0, report


def test_the_attention_block_matches_torch():
    model = TinyGPT(dtype="float64")
    x, labels = _gpt_data(1)[0]
    ours = nn.softmax_cross_entropy(model(runtime.tensor(x.astype(np.float64))), labels)
    ours.backward()
    params = {name: torch.from_numpy(p.numpy()).requires_grad_()
              for name, p in model.named_parameters()}

    def dense(h, name):
        return F.linear(h, params[f"{name}.weight"], params[f"{name}.bias"])

    def norm(h, name):
        return F.layer_norm(h, (16,), params[f"{name}.weight"], params[f"{name}.bias"])

    h = torch.from_numpy(x.astype(np.float64))
    qkv = dense(norm(h, "block.ln1"), "block.qkv").reshape(2, 5, 3, 4, 4).permute(2, 0, 3, 1, 4)
    y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
    h = h + dense(y.permute(0, 2, 1, 3).reshape(2, 5, 16), "block.proj")
    h = h + dense(F.gelu(dense(norm(h, "block.ln2"), "block.fc")), "block.out")
    logits = dense(norm(h, "ln").reshape(10, 16), "head")
    theirs = F.cross_entropy(logits, torch.from_numpy(labels))
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.grad.numpy(), params[name].grad.numpy(), rtol=1e-9,
                                   atol=1e-12, err_msg=name)


@pytest.mark.skipif(OPENCL_MISSING, reason="no OpenCL device (pyopencl with PoCL) here")
def test_the_attention_block_on_opencl_matches_the_cpu():
    losses = {}
    for on in ("cpu", "opencl"):
        model = _on_device(on)
        x, labels = _gpt_data(1)[0]
        loss = nn.softmax_cross_entropy(model(runtime.tensor(x, device=on)),
                                        runtime.tensor(labels, device=on))
        loss.backward()
        losses[on] = (loss.item(), {n: p.grad.numpy() for n, p in model.named_parameters()})
    assert losses["opencl"][0] == pytest.approx(losses["cpu"][0], rel=1e-5)
    for name, grad in losses["cpu"][1].items():
        np.testing.assert_allclose(losses["opencl"][1][name], grad, rtol=1e-3, atol=1e-5,
                                   err_msg=name)


def _on_device(device: str) -> TinyGPT:
    """TinyGPT with its parameters copied onto `device`."""
    model = TinyGPT()
    if device == "cpu":
        return model
    for module in _modules(model):
        for name, p in list(module._parameters.items()):
            setattr(module, name, runtime.tensor(p.numpy(), device=device, requires_grad=True))
    return model


def _modules(module: nn.Module):
    yield module
    for child in module._modules.values():
        yield from _modules(child)



# ---------------------------------------------------------------------- attention dropout
def _dropout_mask(device, shape, p, seed, dtype) -> np.ndarray:
    """The kept (scaled) entries of the attention weights that `seed`'s first draw gives:
    with value the identity, attention returns the dropped weights themselves (no weight of
    a finite score is 0, so a 0 is a dropped entry)."""
    rows, cols = shape[-2:]
    q = runtime.tensor(np.zeros((*shape[:-1], 2), dtype), device=device)
    k = runtime.tensor(np.zeros((*shape[:-2], cols, 2), dtype), device=device)
    eye = np.broadcast_to(np.eye(cols, dtype=dtype), (*shape[:-2], cols, cols)).copy()
    dropped = ops.scaled_dot_product_attention(q, k, runtime.tensor(eye, device=device),
                                               dropout_p=p, generator=ops.Generator(seed))
    return dropped.numpy() != 0


@pytest.mark.parametrize("device", DEVICES, ids=DEVICE_IDS)
@pytest.mark.parametrize("p", [0.2, 0.6])
def test_attention_dropout_drops_about_p_and_scales_the_rest(device, p):
    """value = the identity: the output is the dropped weights, softmax * mask / (1 - p)."""
    rng = np.random.default_rng(21)
    q, k = (rng.normal(size=(2, 4, 32, 8)).astype(np.float32) for _ in range(2))
    eye = np.broadcast_to(np.eye(32, dtype=np.float32), (2, 4, 32, 32)).copy()
    got = ops.scaled_dot_product_attention(
        *(runtime.tensor(a, device=device) for a in (q, k, eye)), dropout_p=p,
        generator=ops.Generator(3)).numpy()
    weights = _host(torch.softmax(torch.from_numpy(q) @ torch.from_numpy(k).transpose(-1, -2)
                                  / math.sqrt(8), -1))
    kept = got != 0
    # NOTE: 8192 draws: the fraction dropped is p within 5 standard deviations
    assert abs((1 - kept.mean()) - p) < 5 * math.sqrt(p * (1 - p) / kept.size)
    np.testing.assert_allclose(got[kept], weights[kept] / np.float32(1 - p), rtol=2e-6)
    again = ops.scaled_dot_product_attention(
        *(runtime.tensor(a, device=device) for a in (q, k, eye)), dropout_p=p,
        generator=ops.Generator(3)).numpy()
    assert again.tobytes() == got.tobytes()  # NOTE: a seed's first mask, on any device


@pytest.mark.parametrize("device", DEVICES, ids=DEVICE_IDS)
@pytest.mark.parametrize("is_causal", [False, True])
def test_attention_dropout_gradients_equal_pytorchs_with_the_same_mask(device, is_causal):
    """The mask the seed draws, read back (`_dropout_mask`), applied by hand in PyTorch:
    the value and the gradients of query, key and value agree."""
    rng = np.random.default_rng(22)
    q, k, v = (rng.normal(size=(2, 3, 5, 4)) for _ in range(3))
    p = 0.3
    for dtype in _floats(device):
        kept = _dropout_mask(device, (2, 3, 5, 5), p, 11, dtype)
        assert 0 < kept.mean() < 1

        def by_hand(tq, tk, tv, kept=kept):
            scores = tq @ tk.transpose(-1, -2) / math.sqrt(4)
            if is_causal:
                scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1),
                                            -math.inf)
            weights = torch.softmax(scores, -1) * torch.from_numpy(kept) / (1 - p)
            return weights @ tv

        assert _compare(lambda *t: ops.scaled_dot_product_attention(
            *t, dropout_p=p, is_causal=is_causal, generator=ops.Generator(11)),
            by_hand, [q, k, v], device, dtype) == 4


class _DroppedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.head = nn.Dense(6, 18), nn.Dense(16 * 6, 3)
        self.generator = ops.Generator(5)

    def forward(self, x):
        batch = x.shape[0]
        qkv = self.qkv(x).reshape(batch, 16, 3, 2, 3)  # (batch, seq, q/k/v, heads, dim)
        q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
        y = ops.scaled_dot_product_attention(q, k, v, dropout_p=0.4, is_causal=True,
                                             generator=self.generator)
        return self.head(ops.relu(y.transpose(0, 2, 1, 3).reshape(batch, 16 * 6)))


@pytest.mark.parametrize("options", [
    dict(plan="static"), dict(plan="static", checkpoint="sqrt"),
    dict(plan="static", memory_budget="least"),
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_attention_dropout_in_a_captured_step_equals_eager_bit_for_bit(options):
    """A recomputed segment (checkpoint, budget) multiplies by the masks the step drew, not
    new ones: the losses, parameters and the generator's count are the eager steps'."""
    rng = np.random.default_rng(23)
    batches = [(rng.normal(size=(3, 16, 6)).astype(np.float32), rng.integers(0, 3, 3))
               for _ in range(3)]

    def make():
        nn.manual_seed(2)
        model = _DroppedAttention()
        return model, nn.train_step(model, nn.Adam(model.parameters(), lr=0.05))

    eager_model, eager = make()
    want = [eager(runtime.tensor(x), runtime.tensor(y)).numpy().tobytes() for x, y in batches]
    model, step = make()
    if options.get("memory_budget") == "least":
        try:
            runtime.graph(make()[1], memory_budget=1, plan=options["plan"])(*batches[0])
        except runtime.BudgetError as error:
            options = {**options, "memory_budget": error.least_bytes}
    graph = runtime.graph(step, **options)
    assert [graph(x, y).numpy().tobytes() for x, y in batches] == want
    for name, value in eager_model.state_dict().items():
        assert model.state_dict()[name].numpy().tobytes() == value.numpy().tobytes(), name
    count = model.generator.state(model.head.weight).numpy()[1]
    assert count == eager_model.generator.state(eager_model.head.weight).numpy()[1] == 3
    if len(options) > 1:
        assert graph.memory_report()["recomputed"] + graph.memory_report()["moved"] > 0
