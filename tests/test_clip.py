"""Gradient clipping (`nn.clip_grad_norm_`): the total norm and the clipped gradients against
NumPy in float64 and against torch.nn.utils.clip_grad_norm_, non-finite norms as PyTorch
treats them, the exact min(c, 1) it is built on, on every device, and eager against captured
bit for bit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import backends
import runtime
from helpers import same_bits
from runtime import nn, ops

DEVICES = backends.available()
#: norm types with a path of their own (2: dot products, 1: magnitudes) and two through exp/log
NORMS = st.sampled_from([2.0, 1.0, 3.0, 0.5])
SHAPES = st.lists(st.sampled_from([(1,), (7,), (3, 4), (2, 3, 2), (16, 5)]), min_size=1,
                  max_size=4)


def _params(grads: list[np.ndarray], device: Any = None) -> list[runtime.Tensor]:
    params = []
    for g in grads:
        p = runtime.tensor(np.zeros_like(g), device=device, requires_grad=True)
        p.grad = runtime.tensor(g, device=device)
        params.append(p)
    return params


def _reference(grads: list[np.ndarray], max_norm: float, p: float) -> tuple[float, list]:
    """The total norm and the clipped gradients in float64 (PyTorch's formula)."""
    flat = np.concatenate([g.astype(np.float64).ravel() for g in grads])
    norm = float(np.sum(np.abs(flat) ** p) ** (1 / p))
    coefficient = min(max_norm / (norm + 1e-6), 1.0)
    return norm, [g.astype(np.float64) * coefficient for g in grads]


def _tolerance(p: float) -> float:
    """Relative: float32 sums of at most 320 terms (pairwise or BLAS, a few ulps of 2**-24 in
    all) for p 1 and 2; exp(p * log|g|) in float32 loses about |p log|g|| ulps more (|g| here
    mostly within 1e-5..1e3)."""
    return 2e-6 if p in (1.0, 2.0) else 5e-5


@settings(max_examples=40, deadline=None)
@given(shapes=SHAPES, seed=st.integers(0, 2**32 - 1), p=NORMS,
       max_norm=st.floats(0.0, 50.0), magnitude=st.sampled_from([1e-3, 1.0, 30.0]),
       kind=st.sampled_from(DEVICES))
def test_the_norm_and_the_clipped_gradients_match_float64(shapes, seed, p, max_norm,
                                                          magnitude, kind):
    rng = np.random.default_rng(seed)
    grads = [(rng.normal(size=s) * magnitude).astype(np.float32) for s in shapes]
    params = _params(grads, backends.get_device(kind))
    total = nn.clip_grad_norm_(params, max_norm, norm_type=p)
    norm, clipped = _reference(grads, max_norm, p)
    assert total.shape == () and total.dtype == np.float32 and total.device is params[0].device
    tol = _tolerance(p)
    assert abs(total.item() - norm) <= tol * norm
    for param, want in zip(params, clipped):
        got = param.grad.numpy()
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=2 * tol, atol=1e-30)


@settings(max_examples=40, deadline=None)
@given(shapes=SHAPES, seed=st.integers(0, 2**32 - 1), p=NORMS,
       max_norm=st.floats(1e-3, 50.0), bad=st.sampled_from([None, np.inf, -np.inf, np.nan]))
def test_it_does_what_torch_clip_grad_norm_does(shapes, seed, p, max_norm, bad):
    """Finite gradients: the same norm and gradients within float32 rounding. A non-finite
    element: the same norm (inf or NaN) and gradients that are NaN, or 0, exactly where
    PyTorch's are (error_if_nonfinite=False multiplies them by 0 or NaN)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(seed)
    grads = [rng.normal(size=s).astype(np.float32) for s in shapes]
    if bad is not None:
        grads[seed % len(grads)].flat[seed % grads[seed % len(grads)].size] = bad
    params = _params(grads)
    total = nn.clip_grad_norm_(params, max_norm, norm_type=p)
    theirs = [torch.nn.Parameter(torch.zeros(g.shape)) for g in grads]
    for t, g in zip(theirs, grads):
        t.grad = torch.tensor(g)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type=p)
    tol = _tolerance(p)
    if bad is None:
        assert abs(total.item() - expected.item()) <= tol * expected.item()
        for param, t in zip(params, theirs):
            np.testing.assert_allclose(param.grad.numpy(), t.grad.numpy(), rtol=2 * tol,
                                       atol=1e-30)
        return
    assert np.isnan(total.item()) == np.isnan(expected.item())
    if not np.isnan(expected.item()):
        assert total.item() == expected.item() == np.inf
    for param, t in zip(params, theirs):
        got, want = param.grad.numpy(), t.grad.numpy()
        assert np.array_equal(np.isnan(got), np.isnan(want))
        assert np.array_equal(got[~np.isnan(got)], want[~np.isnan(want)])


@settings(max_examples=80, deadline=None)
@given(c=st.one_of(st.floats(0.0, 4.0, width=32), st.floats(0.0, allow_infinity=True,
                                                            width=32),
                   st.sampled_from([1.0, np.nextafter(np.float32(1), np.float32(2)),
                                    np.nextafter(np.float32(1), np.float32(0)), np.nan,
                                    0.0, np.inf])),
       kind=st.sampled_from(DEVICES), dtype=st.sampled_from(["float32", "float64"]))
def test_at_most_one_is_min_c_1_exactly(c, kind, dtype):
    """The select clip_grad_norm_ builds from relu, div, mul, add and where_finite is
    np.minimum(c, 1) bit for bit, NaN kept, for every c >= 0 (the ulps beside 1 included)."""
    value = np.array(c, dtype)
    got = nn._at_most_one(runtime.tensor(value, device=backends.get_device(kind)))
    want = np.minimum(value, np.array(1.0, dtype))
    if np.isnan(value):
        assert np.isnan(got.item())
    else:
        assert same_bits(got, want), (value, got.item())


def test_two_byte_gradients_get_a_float32_norm_that_does_not_overflow():
    """float16 gradients whose norm is beyond float16's range (65504): the norm is float32 and
    right; the gradients are scaled by the float16 coefficient."""
    big = np.full((4, 4), 30000.0, np.float16)  # norm 120000
    small = np.array([3.0, 4.0], np.float16)
    params = _params([big, small])
    total = nn.clip_grad_norm_(params, 2.0)
    norm, clipped = _reference([big, small], 2.0, 2.0)
    assert total.dtype == np.float32 and abs(total.item() - norm) <= 1e-6 * norm
    for param, want in zip(params, clipped):
        assert param.grad.dtype == np.float16
        np.testing.assert_allclose(param.grad.numpy().astype(np.float64), want, rtol=2e-3)


def test_a_captured_clip_equals_the_eager_one_bit_for_bit():
    """A float32 SGD step with clipping, eager and under a static graph (whose replays read
    nothing back), for steps that clip and steps that do not."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 6)).astype(np.float32)
    y = rng.integers(0, 3, 8)
    runs = []
    for graphed in (False, True):
        nn.manual_seed(1)
        model = nn.Sequential(nn.Dense(6, 16), nn.ReLU(), nn.Dense(16, 3))
        opt = nn.SGD(model.parameters(), lr=0.5, momentum=0.9)

        def step(xb: Any, yb: Any, model=model, opt=opt) -> tuple:
            loss = nn.softmax_cross_entropy(model(xb), yb)
            loss.backward()
            norm = nn.clip_grad_norm_(model.parameters(), max_norm=1.0)
            opt.step()
            opt.zero_grad()
            return loss, norm

        run = runtime.graph(step) if graphed else step
        outs = []
        for i in range(6):
            xb = x * (1 + i)  # larger inputs: larger gradients, clipped
            loss, norm = run(xb if graphed else runtime.tensor(xb), y)
            outs += [loss.numpy(), norm.numpy()]
        runs.append((outs, [p.numpy() for p in model.parameters()]))
    (o1, p1), (o2, p2) = runs
    assert all(same_bits(a, b) for a, b in zip(o1 + p1, o2 + p2))
    norms = [float(v) for v in o1[1::2]]
    assert min(norms) < 1.0 < max(norms)  # some steps clipped, some not


def test_error_if_nonfinite_raises_before_changing_anything():
    grads = [np.array([1.0, np.inf], np.float32), np.array([2.0], np.float32)]
    params = _params(grads)
    with pytest.raises(RuntimeError, match=r"total norm of order 2.0 .* is inf, so it cannot "
                                           r"be clipped; the gradients are unchanged"):
        nn.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    assert all(same_bits(p.grad, g) for p, g in zip(params, grads))
    finite = _params([np.array([3.0, 4.0], np.float32)])
    assert nn.clip_grad_norm_(finite, 1.0, error_if_nonfinite=True).item() == 5.0

    def captured(x: Any) -> Any:
        return nn.clip_grad_norm_(finite, 1.0, error_if_nonfinite=True)

    with pytest.raises(runtime.GraphCaptureError, match="error_if_nonfinite=True"):
        runtime.graph(captured)(np.zeros(1, np.float32))


def test_bad_arguments_are_refused_by_name_and_no_gradient_is_a_zero_norm():
    params = _params([np.ones(3, np.float32)])
    for kwargs, error, message in (
            ({"max_norm": -1.0}, ValueError, "max_norm must be a number >= 0, got -1.0"),
            ({"max_norm": float("nan")}, ValueError, "max_norm must be a number >= 0"),
            ({"max_norm": "1"}, TypeError, "max_norm must be a number, got '1'"),
            ({"max_norm": 1.0, "norm_type": True}, TypeError, "norm_type must be a number"),
            ({"max_norm": 1.0, "norm_type": 0}, ValueError, "norm_type must be a number > 0"),
            ({"max_norm": 1.0, "norm_type": float("inf")}, ValueError,
             "norm_type inf .* needs a max reduction")):
        with pytest.raises(error, match=message):
            nn.clip_grad_norm_(params, **kwargs)
    with pytest.raises(TypeError, match="parameter 1 is a int, not a Tensor"):
        nn.clip_grad_norm_([params[0], 3], 1.0)
    with pytest.raises(TypeError, match="parameters must be a Tensor or an iterable"):
        nn.clip_grad_norm_(5, 1.0)
    assert np.array_equal(params[0].grad.numpy(), np.ones(3, np.float32))
    bare = runtime.tensor(np.ones(2, np.float32), requires_grad=True)
    zero = nn.clip_grad_norm_(bare, 1.0)  # one tensor, no gradient
    assert zero.item() == 0.0 and zero.dtype == np.float32 and bare.grad is None
    half = nn.clip_grad_norm_(params, float("inf"))  # inf: compute, change nothing
    assert half.item() == pytest.approx(3 ** 0.5) and same_bits(params[0].grad,
                                                            np.ones(3, np.float32))
    assert ops.sum(params[0].grad).item() == 3.0
