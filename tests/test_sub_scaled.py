"""The one-pass update `ops._sub_scaled` (`Device.sub_scaled`): p - lr * g with the product
rounded to the dtype first, bit for bit what the two ops it replaces give, `sub(p, mul(g, lr,
out=scratch), out=p)`, on every device here and for every float dtype, under the aliasing rules
of sub; and plain SGD's step, which runs it.

The CPU's one-pass kernel is `backends/_halfconv.c`'s `sub_scaled` (both its vector and its
portable loops); PoCL compiles the chain into one kernel; `NaiveDevice` (no kernel of its own)
runs the base class's two kernels. The reference is always the two public ops on the same device.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import allocators
import backends
import runtime
from naive_device import NaiveDevice
from runtime import fastpath, nn, ops
from runtime.errors import AliasingError, AutogradError

try:
    from backends import _halfconv
except ImportError:
    _halfconv = None

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = (np.dtype("float32"), np.dtype("float64"), np.dtype("float16"), BF16)
DEVICES = {"cpu": backends.get_device("cpu"), "naive": NaiveDevice()}
if "opencl" in backends.available():
    DEVICES["opencl"] = backends.get_device("opencl")
# NOTE: explicit allocators, so tensors land on exactly these device objects
ALLOCATORS = {name: allocators.create("direct", dev) for name, dev in DEVICES.items()}


def usable(name: str, dtype: np.dtype) -> bool:
    dev = DEVICES[name]
    return not (name == "opencl" and dtype == np.float64 and not dev.fp64)


def on(name: str, host: np.ndarray) -> runtime.Tensor:
    return runtime.tensor(host, device=DEVICES[name], allocator=ALLOCATORS[name])


def bits(t: runtime.Tensor) -> np.ndarray:
    host = t.numpy()
    return np.ascontiguousarray(host).view(f"u{host.dtype.itemsize}")


# Values that make rounding matter: ordinary, large, tiny (subnormal in the two-byte floats),
# signed zeros, infinities and NaN.
SPECIAL = [0.0, -0.0, 1.0, -1.0, 65504.0, 1e-7, -6e-8, 3e38, np.inf, -np.inf, np.nan]


@st.composite
def arrays(draw, n: int, dtype: np.dtype) -> np.ndarray:
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    scale = 10.0 ** draw(st.integers(-8, 6))
    values = rng.standard_normal(n) * scale
    picks = draw(st.lists(st.tuples(st.integers(0, max(n - 1, 0)), st.sampled_from(SPECIAL)),
                          max_size=4))
    for i, v in picks:
        if n:
            values[i] = v
    with np.errstate(over="ignore"):
        return values.astype(dtype)


LAYOUTS = ("contiguous", "strided", "transposed")


def laid_out(name: str, host: np.ndarray, layout: str) -> runtime.Tensor:
    """A tensor equal to `host` (2-D) in the given layout: its own block, a strided view of a
    wider one, or the transpose of a contiguous one."""
    if layout == "contiguous":
        return on(name, host)
    if layout == "strided":
        wide = np.zeros((host.shape[0], 2 * host.shape[1]), host.dtype)
        wide[:, ::2] = host
        return on(name, wide)[:, ::2]
    return on(name, np.ascontiguousarray(host.T)).T


@settings(max_examples=150, deadline=None)
@given(data=st.data(), device=st.sampled_from(sorted(DEVICES)),
       dtype=st.sampled_from(DTYPES), rows=st.integers(1, 5), cols=st.integers(1, 700),
       layouts=st.tuples(st.sampled_from(LAYOUTS), st.sampled_from(LAYOUTS)),
       where=st.sampled_from(["in place", "fresh", "into b"]),
       lr=st.one_of(st.floats(-1e4, 1e4, allow_nan=False, allow_subnormal=False),
                    st.sampled_from([0.01, 0.1, 1e-3, 3.0])),
       fast=st.booleans(), vector=st.booleans(), row=st.booleans())
def test_one_pass_equals_the_two_ops_bit_for_bit(data, device, dtype, rows, cols, layouts,
                                                 where, lr, fast, vector, row):
    """`row`: b is one row that broadcasts over a's rows (as a bias's gradient would not,
    but sub's rules allow)."""
    if not usable(device, dtype):
        return
    p_host = data.draw(arrays(rows * cols, dtype)).reshape(rows, cols)
    g_host = data.draw(arrays(cols if row else rows * cols, dtype)).reshape(-1, cols)
    if row and where == "into b":
        where = "fresh"
    if _halfconv is not None:
        _halfconv.set_f16c(vector)
    try:
        with runtime.no_grad():
            p, g = laid_out(device, p_host, layouts[0]), laid_out(device, g_host, layouts[1])
            scratch = on(device, np.zeros_like(p_host))
            ref_p, ref_g = laid_out(device, p_host, layouts[0]), laid_out(device, g_host,
                                                                           layouts[1])
            product = ops.mul(ref_g, lr, out=on(device, np.zeros_like(g_host)))
            if where == "in place":
                expected, out = ops.sub(ref_p, product, out=ref_p), p
            elif where == "into b":
                expected, out = ops.sub(ref_p, product, out=ref_g), g
            else:
                expected, out = ops.sub(ref_p, product), None
            versions = (p.version, g.version)
            if fast:
                result = ops._sub_scaled(p, g, lr, out, scratch)
            else:
                with fastpath.python_only():
                    result = ops._sub_scaled(p, g, lr, out, scratch)
    finally:
        if _halfconv is not None:
            _halfconv.set_f16c(True)
    assert result.dtype == dtype and result.shape == (rows, cols)
    if out is not None:
        assert result is out
    np.testing.assert_array_equal(bits(result), bits(expected))
    # the written block's version moves on once; a block only read keeps its version
    written = {"in place": (1, 0), "into b": (0, 1), "fresh": (0, 0)}[where]
    assert (p.version - versions[0], g.version - versions[1]) == written


@pytest.mark.parametrize("device", sorted(DEVICES))
@pytest.mark.parametrize("shift", [1, -1])
def test_a_partial_overlap_is_copied_or_refused_as_sub_does(device, shift):
    host = np.arange(12, dtype=np.float32) * 0.37
    gh = np.linspace(-1, 1, 10).astype(np.float32)

    def run(fn):
        buffer = on(device, host)
        a, out = (buffer[1:11], buffer[1 + shift:11 + shift])
        with runtime.no_grad():
            fn(a, on(device, gh), out)
        return buffer

    def two_ops(a, g, out):
        ops.sub(a, ops.mul(g, 0.5), out=out)

    expected = run(two_ops)
    got = run(lambda a, g, out: ops._sub_scaled(a, g, 0.5, out))
    np.testing.assert_array_equal(bits(got), bits(expected))
    old = runtime.set_aliasing("raise")
    try:
        with pytest.raises(AliasingError, match="sub_scaled: the output"):
            run(lambda a, g, out: ops._sub_scaled(a, g, 0.5, out))
    finally:
        runtime.set_aliasing(old)


def test_bad_operands_are_refused_with_the_numbers():
    a = runtime.tensor(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"shapes \(2, 3\) and \(2,\) cannot be broadcast"):
        ops._sub_scaled(a, runtime.tensor(np.zeros(2, np.float32)), 0.1)
    with pytest.raises(TypeError, match="different dtypes: float32 and float64"):
        ops._sub_scaled(a, runtime.tensor(np.zeros((2, 3))), 0.1)
    with pytest.raises(ValueError, match="beyond the largest float32"):
        ops._sub_scaled(a, a, 1e300)
    with pytest.raises(ValueError, match=r"scratch must be a float32 Tensor of shape \(2, 3\)"):
        with fastpath.python_only():
            ops._sub_scaled(a, a, 0.1, a, runtime.tensor(np.zeros(3, np.float32)))
    w = runtime.tensor(np.zeros((2, 3), np.float32), requires_grad=True)
    before = w.version
    with pytest.raises(AutogradError, match="sub_scaled has no derivative"):
        ops._sub_scaled(w, a, 0.1, w)
    assert w.version == before
    released = runtime.tensor(np.zeros((2, 3), np.float32))
    released.release()
    with pytest.raises(Exception, match="released") as caught:
        ops._sub_scaled(a, released, 0.1, a)
    with pytest.raises(type(caught.value), match="released"):
        ops.sub(a, released, out=a)


@pytest.mark.skipif(_halfconv is None, reason="the C kernels are not built")
def test_the_c_kernel_declines_what_it_cannot_take_and_writes_nothing():
    p = np.arange(8, dtype=np.float32)
    g = np.ones(8, np.float32)
    before = p.copy()
    assert _halfconv.sub_scaled(0, p[::2], p[::2], g[::2], 1.0) is False  # strided
    assert _halfconv.sub_scaled(0, p, p, g[:4], 1.0) is False  # lengths differ
    assert _halfconv.sub_scaled(1, p, p, g, 1.0) is False  # float32 items named float64
    frozen = p.copy()
    frozen.flags.writeable = False
    assert _halfconv.sub_scaled(0, frozen, p, g, 1.0) is False  # out read-only
    np.testing.assert_array_equal(p, before)
    with pytest.raises(ValueError, match="kind 7 names no dtype"):
        _halfconv.sub_scaled(7, p, p, g, 1.0)
    assert _halfconv.sub_scaled(0, p, p, g, 0.5) is True
    np.testing.assert_array_equal(p, before - np.float32(0.5))


@pytest.mark.parametrize("device", sorted(DEVICES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("momentum", "decay"), [(0.0, 0.0), (0.9, 0.0), (0.9, 0.01)])
def test_sgd_steps_as_the_two_ops_do(device, dtype, momentum, decay):
    """Three steps of nn.SGD (the one-pass update, plain or with momentum; with weight decay
    the two ops) against the same steps written with mul, add and sub, on the bits of the
    parameters."""
    if not usable(device, dtype):
        pytest.skip(f"{device} has no {dtype}")
    if dtype.itemsize == 2:
        pytest.skip("two-byte parameters update in float32, as PyTorch's ops do "
                    "(tests/test_optim_edges.py)")
    rng = np.random.default_rng(7)
    hosts = [rng.standard_normal(s).astype(dtype) for s in ((5, 300), (300,), (3,))]
    grads = [rng.standard_normal(h.shape).astype(dtype) for h in hosts]
    params = [on(device, h) for h in hosts]
    mirror = [on(device, h) for h in hosts]
    buffers = [on(device, np.zeros_like(h)) for h in hosts]
    for p in params:
        p.requires_grad = True
    opt = nn.SGD(params, lr=0.0173, momentum=momentum, weight_decay=decay)
    for _ in range(3):
        for p, g in zip(params, grads):
            p.grad = on(device, g)
        opt.step()
        with runtime.no_grad():
            for m, g, buf in zip(mirror, grads, buffers):
                d = on(device, g)
                if decay:
                    d = ops.add(ops.mul(m, decay), d)
                if momentum:
                    d = ops.add(ops.mul(buf, momentum, out=buf), d, out=buf)
                ops.sub(m, ops.mul(d, 0.0173), out=m)
    for p, m in zip(params, mirror):
        np.testing.assert_array_equal(bits(p), bits(m))
