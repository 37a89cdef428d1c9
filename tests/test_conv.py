"""Convolution and pooling (issue 30): ops.conv2d, ops.max_pool2d, ops.avg_pool2d and the layers
nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d and nn.Flatten.

Values and every gradient against PyTorch's CPU (float32 and float64; two-byte floats within
their rounding) on the CPU device and on OpenCL where it is here, over drawn shapes, strides,
paddings and kernels; gradients against finite differences in float64; ties and NaN in max
pooling as PyTorch's scan has them; `out=` and its refused overlaps; bad input; what the
backward pass keeps; a small conv net's training step captured and replayed bit for bit as
eager. Without PyTorch, the tests that need no reference still run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from test_autograd import check_gradients

import allocators
import backends
import runtime
from backends.testing import assert_same_bits
from runtime import amp, dtypes, nn, ops

try:
    import torch
except ImportError:  # NOTE: the tests with no reference to compare with still run
    torch = F = None
else:
    torch.set_num_threads(1)
    F = torch.nn.functional
#: The tests whose reference is PyTorch's.
needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch, the reference, is not installed")


def _devices() -> list:
    found = [pytest.param("cpu", id="cpu")]
    reason = "no OpenCL device here (pyopencl or a platform is missing)"
    found.append(pytest.param("opencl", id="opencl", marks=pytest.mark.skipif(
        "opencl" not in backends.available(), reason=reason)))
    return found


DEVICES = _devices()


@contextlib.contextmanager
def _composed(device: str = "cpu"):
    """The device with `conv_columns` switched off: the runtime makes the columns of padded
    copies (wide rows where they apply), as on a device without the kernels."""
    found = backends.get_device(device)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(found, "capabilities",
                      dataclasses.replace(found.capabilities, conv_columns=False))
        yield found
F32, F64 = np.dtype("float32"), np.dtype("float64")
#: The distance allowed from PyTorch, relative and absolute, per dtype (sums in other orders);
#: `_close` scales the absolute one by the array's largest element, since a sum taken in
#: another order can cancel to an element much smaller than its terms (a weight's gradient)
TOLERANCE = {F32: (2e-5, 2e-5), F64: (1e-12, 1e-12)}


def _ours(array: np.ndarray, device: str, grad: bool = False) -> runtime.Tensor:
    return runtime.tensor(array, device=device, requires_grad=grad)


def _close(mine: runtime.Tensor, theirs: torch.Tensor, dtype: np.dtype) -> None:
    rtol, atol = TOLERANCE[dtype]
    expected = theirs.detach().numpy()
    scale = max(1.0, float(np.abs(expected).max())) if expected.size else 1.0
    np.testing.assert_allclose(mine.numpy(), expected, rtol=rtol, atol=atol * scale)


def _conv_against_torch(device: str, dtype: np.dtype, n: int, c: int, o: int, hw: tuple,
                        kernel: tuple, stride: tuple, padding: tuple, bias: bool,
                        seed: int = 0) -> int:
    """conv2d's value and the gradients of x, weight and bias against PyTorch's; returns how
    many arrays it compared."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, *hw)).astype(dtype)
    w = rng.standard_normal((o, c, *kernel)).astype(dtype)
    b = rng.standard_normal(o).astype(dtype) if bias else None
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    tb = torch.tensor(b, requires_grad=True) if bias else None
    expected = F.conv2d(tx, tw, tb, stride=stride, padding=padding)
    weights = rng.uniform(0.5, 1.5, tuple(expected.shape)).astype(dtype)
    (expected * torch.tensor(weights)).sum().backward()
    mx, mw = _ours(x, device, True), _ours(w, device, True)
    mb = _ours(b, device, True) if bias else None
    got = ops.conv2d(mx, mw, mb, stride=stride, padding=padding)
    assert got.shape == tuple(expected.shape)
    _close(got, expected, dtype)
    ops.sum(ops.mul(got, _ours(weights, device))).backward()
    _close(mx.grad, tx.grad, dtype)
    _close(mw.grad, tw.grad, dtype)
    if bias:
        _close(mb.grad, tb.grad, dtype)
    return 4 if bias else 3


#: (n, c, o, (h, w), kernel, stride, padding): a plain 3x3, a strided and padded one, a 1x1
#: with no im2col, a strided 1x1, a 7x7/2, wide rows (stride 1, Wp <= 1.05 Wo: a 3x2, a 3x3
#: and a padded 1x1, whose rows drop nothing), batches of one
CONV_CASES = [
    (2, 3, 2, (5, 40), (3, 3), (1, 1), (1, 1)),
    (2, 2, 3, (6, 12), (1, 1), (1, 1), (1, 1)),
    (1, 2, 2, (5, 44), (3, 3), (1, 1), (0, 1)),
    (2, 3, 4, (6, 5), (3, 3), (1, 1), (0, 0)),
    (2, 3, 4, (7, 7), (3, 3), (2, 2), (1, 1)),
    (3, 5, 4, (4, 4), (1, 1), (1, 1), (0, 0)),
    (2, 4, 3, (5, 6), (1, 1), (2, 2), (0, 0)),
    (2, 3, 2, (11, 11), (7, 7), (2, 2), (3, 3)),
    (2, 2, 3, (34, 33), (3, 2), (1, 1), (1, 0)),
    (1, 2, 3, (34, 34), (1, 1), (1, 1), (0, 0)),
    (1, 2, 3, (5, 5), (2, 3), (1, 2), (1, 1)),
]


@needs_torch
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: "x".join(map(str, c[3] + c[4])))
def test_conv2d_and_its_gradients_match_pytorch(device, dtype, case):
    if dtype not in backends.get_device(device).capabilities.compute_dtypes:
        pytest.skip(f"{device} does not compute {dtype} (an OpenCL device without cl_khr_fp64)")
    assert _conv_against_torch(device, dtype, *case, bias=True) == 4


@needs_torch
def test_conv2d_without_bias_and_with_pairs_given_as_lists():
    assert _conv_against_torch("cpu", F64, 2, 2, 3, (6, 5), (3, 2), [2, 1], [0, 1], bias=False) == 3


@needs_torch
@pytest.mark.parametrize("device", DEVICES)
def test_strided_inputs_and_weights_give_the_contiguous_ones_results(device):
    """x, the weight and out as strided views (a step, a transpose): the padded copy and
    im2col read any strides."""
    rng = np.random.default_rng(14)
    big = rng.standard_normal((2, 3, 12, 5)).astype(np.float32)
    w = rng.standard_normal((4, 4, 3, 3)).astype(np.float32)  # (kh, kw) swapped below
    for kernel, padding in (((3, 3), 1), ((1, 1), 0)):
        x = big[:, :, ::2, :]  # (2, 3, 6, 5), strided
        weight = np.ascontiguousarray(w[:, :3, :kernel[0], :kernel[1]].transpose(0, 1, 3, 2))
        mx = _ours(big, device)[:, :, ::2, :]
        mw = _ours(np.ascontiguousarray(weight.transpose(0, 1, 3, 2)), device).transpose(
            0, 1, 3, 2)
        expected = F.conv2d(torch.tensor(x), torch.tensor(weight), padding=padding).numpy()
        for n in (1, 2):
            np.testing.assert_allclose(ops.conv2d(mx[:n], mw, padding=padding).numpy(),
                                       expected[:n], *TOLERANCE[F32])


@needs_torch
@settings(max_examples=40)
@given(n=st.integers(1, 3), c=st.integers(1, 3), o=st.integers(1, 3),
       h=st.integers(1, 9), w=st.integers(1, 9), kh=st.integers(1, 4), kw=st.integers(1, 4),
       sh=st.integers(1, 3), sw=st.integers(1, 3), ph=st.integers(0, 2), pw=st.integers(0, 2),
       bias=st.booleans(), seed=st.integers(0, 99))
# NOTE: wide rows with no padding: the extra zero row must be cut from x's gradient (found)
@example(n=1, c=1, o=1, h=2, w=1, kh=2, kw=1, sh=1, sw=1, ph=0, pw=0, bias=False, seed=0)
def test_conv2d_matches_pytorch_on_drawn_geometries(n, c, o, h, w, kh, kw, sh, sw, ph, pw,
                                                     bias, seed):
    if kh > h + 2 * ph or kw > w + 2 * pw:
        with pytest.raises(ValueError, match="bigger than the padded input"):
            ops.conv2d(runtime.tensor(np.zeros((n, c, h, w))),
                       runtime.tensor(np.zeros((o, c, kh, kw))), padding=(ph, pw))
        return
    compared = _conv_against_torch("cpu", F64, n, c, o, (h, w), (kh, kw), (sh, sw), (ph, pw),
                                   bias, seed)
    assert compared == (4 if bias else 3)


@needs_torch
@settings(max_examples=25)
@given(n=st.integers(1, 2), c=st.integers(1, 2), o=st.integers(1, 2), h=st.integers(1, 5),
       w=st.integers(64, 72), kh=st.integers(1, 4), kw=st.integers(1, 4), ph=st.integers(0, 2),
       pw=st.integers(0, 2), seed=st.integers(0, 99))
def test_conv2d_on_wide_rows_matches_pytorch(n, c, o, h, w, kh, kw, ph, pw, seed):
    """Stride 1 on images wide enough for wide rows (Wp <= 1.05 Wo) whatever the kernel:
    the rows' extra columns dropped, the extra zero row cut."""
    if kh > h + 2 * ph:
        return
    geometry = ops._geometry("conv2d", (n, c, h, w), (kh, kw), (1, 1), (ph, pw))
    with _composed() as device:
        assert ops._wide_rows(geometry, device) or (kh == kw == 1 and (ph, pw) == (0, 0))
        assert _conv_against_torch("cpu", F64, n, c, o, (h, w), (kh, kw), (1, 1), (ph, pw),
                                   True, seed) == 4


def _same_non_finite(mine: np.ndarray, theirs: np.ndarray) -> int:
    """NaN where PyTorch has NaN, each infinity with PyTorch's sign, the finite rest close;
    returns how many non-finite elements PyTorch's array holds."""
    np.testing.assert_array_equal(np.isnan(mine), np.isnan(theirs))
    np.testing.assert_array_equal(np.isposinf(mine), np.isposinf(theirs))
    np.testing.assert_array_equal(np.isneginf(mine), np.isneginf(theirs))
    finite = np.isfinite(theirs)
    np.testing.assert_allclose(mine[finite], theirs[finite], *TOLERANCE[np.dtype(mine.dtype)])
    return int((~finite).sum())


@needs_torch
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["x", "weight"])
@pytest.mark.parametrize("width", [44, 6], ids=["wide-rows", "narrow"])
@pytest.mark.parametrize("columns", ["device", "composed"])
def test_gradients_with_infinities_and_nan_are_pytorchs(device, where, width, columns):
    with _composed(device) if columns == "composed" else contextlib.nullcontext():
        found = backends.get_device(device)
        padding = 1 if where == "x" else 0
        geometry = ops._geometry("conv2d", (2, 3, 5, width), (3, 3), (1, 1), (padding, padding))
        # NOTE: the path under test: wide rows where the columns are composed
        assert ops._wide_rows(geometry, found) == (width == 44
                                                   and not found.capabilities.conv_columns)
        held = _infinities_against_pytorch(device, where, width)
    # NOTE: non-finite values where PyTorch has them, in the output and in the gradient of
    # the other operand (`_same_non_finite` compares them element by element and counts them)
    assert held["output"] > 0
    assert held["weight" if where == "x" else "x"] > 0


def _infinities_against_pytorch(device: str, where: str, width: int) -> dict[str, int]:
    """An infinity of each sign and a NaN in x (or two infinities in the weight): the
    output's and the gradients' NaN and infinities where PyTorch's are (asserted), counted per
    array ("output", "x", "weight"). On wide rows a dropped column reads
    the next row's first columns; its zero of g must not meet them (0 * inf = NaN). The
    weight's case has no padding: an infinite tap over zero padding is NaN in PyTorch's
    im2col path and ours, but its oneDNN path skips the padding (docs/layers.md)."""
    rng = np.random.default_rng(21)
    x = rng.standard_normal((2, 3, 5, width)).astype(np.float32)
    w = rng.standard_normal((2, 3, 3, 3)).astype(np.float32)
    if where == "x":  # NOTE: at a row's ends, which the dropped columns of wide rows read
        x[0, 0, 1, 0], x[1, 2, 2, -1], x[0, 1, 3, 1] = np.inf, -np.inf, np.nan
    else:
        w[0, 0, 1, 2], w[1, 2, 0, 0] = np.inf, -np.inf
    padding = 1 if where == "x" else 0
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    expected = F.conv2d(tx, tw, padding=padding)
    weights = rng.uniform(0.5, 1.5, tuple(expected.shape)).astype(np.float32)
    (expected * torch.tensor(weights)).sum().backward()
    mx, mw = _ours(x, device, True), _ours(w, device, True)
    got = ops.conv2d(mx, mw, padding=padding)
    ops.sum(ops.mul(got, _ours(weights, device))).backward()
    return {"output": _same_non_finite(got.numpy(), expected.detach().numpy()),
            "x": _same_non_finite(mx.grad.numpy(), tx.grad.numpy()),
            "weight": _same_non_finite(mw.grad.numpy(), tw.grad.numpy())}


@needs_torch
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("device", DEVICES)
def test_two_byte_convolutions_and_pools_are_pytorchs_within_their_rounding(device, dtype):
    half = np.dtype(dtypes.BFLOAT16) if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 8, 8)).astype(half)
    w = rng.standard_normal((4, 3, 3, 3)).astype(half)
    b = rng.standard_normal(4).astype(half)
    # the reference: PyTorch in float32 on the same two-byte values
    x32, w32, b32 = (torch.tensor(a.astype(np.float32)) for a in (x, w, b))
    eps = float(dtypes.finfo(half).eps)
    conv = ops.conv2d(_ours(x, device), _ours(w, device), _ours(b, device), 2, 1)
    assert conv.dtype == half
    expected = F.conv2d(x32, w32, b32, stride=2, padding=1).numpy()
    scale = np.abs(expected).max()
    np.testing.assert_allclose(conv.numpy().astype(np.float32), expected, rtol=2 * eps,
                               atol=4 * eps * scale)
    pooled = ops.max_pool2d(_ours(x, device), 3, 2, 1)
    np.testing.assert_array_equal(pooled.numpy().astype(np.float32),
                                  F.max_pool2d(x32, 3, 2, 1).numpy())
    averaged = ops.avg_pool2d(_ours(x, device), 3, 2, 1).numpy().astype(np.float32)
    # NOTE: summed in float32 and rounded once: within half an ulp of PyTorch's float32 mean
    np.testing.assert_allclose(averaged, F.avg_pool2d(x32, 3, 2, 1).numpy(), rtol=eps,
                               atol=1e-6)
    whole = ops.avg_pool2d(_ours(x, device), 8).numpy().astype(np.float32)  # one mean
    np.testing.assert_allclose(whole, F.avg_pool2d(x32, 8).numpy(), rtol=eps, atol=1e-6)


@needs_torch
def test_conv2d_under_autocast_computes_in_half_as_torch_autocast():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 6, 6)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    mx, mw = runtime.tensor(x, requires_grad=True), runtime.tensor(w, requires_grad=True)
    with amp.autocast("float16"):
        y = ops.conv2d(mx, mw, padding=1)
    assert y.dtype == np.float16
    expected = F.conv2d(torch.tensor(x).half().float(), torch.tensor(w).half().float(),
                        padding=1).numpy()
    np.testing.assert_allclose(y.numpy().astype(np.float32), expected, rtol=2e-3, atol=1e-2)
    ops.sum(ops.cast(y, "float32")).backward()
    assert mx.grad.dtype == np.float32 and mw.grad.dtype == np.float32  # cast back, as torch
    with amp.autocast("float16"):
        doubles = ops.conv2d(runtime.tensor(x.astype(np.float64)),
                             runtime.tensor(w.astype(np.float64)))
    assert doubles.dtype == np.float64  # float64 is left alone, as in PyTorch


@pytest.mark.parametrize("dtype", [F64], ids=str)
def test_gradients_match_finite_differences(dtype):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 2, 5, 4))
    w = rng.standard_normal((3, 2, 3, 2))
    b = rng.standard_normal(3)
    check_gradients(lambda x, w, b: ops.conv2d(x, w, b, (2, 1), (1, 1)), x, w, b)
    check_gradients(lambda x: ops.avg_pool2d(x, (3, 2), (2, 1), (1, 1)), x)
    # NOTE: distinct values a step apart: no tie moves under the differences' small steps
    apart = rng.permutation(40).reshape(2, 2, 5, 2) / 4.0
    check_gradients(lambda x: ops.max_pool2d(x, 3, 2, 1), apart)


# ---------------------------------------------------------------------- pieces of images
@pytest.fixture
def pieces(monkeypatch):
    """Convolutions in pieces of `images` images (Note [convolution in pieces of images]):
    the columns of one image already pass the bytes allowed, and a piece needs no more
    positions than `images` images have."""

    def set_images(images: int) -> None:
        monkeypatch.setattr(ops, "CONV_PIECE_BYTES", 1)
        monkeypatch.setattr(ops, "CONV_PIECE_POSITIONS", 1)
        if images > 1:  # NOTE: at least `images` images' positions, counted on a 1x1 output
            monkeypatch.setattr(ops, "CONV_PIECE_POSITIONS", images)

    return set_images


@pytest.mark.parametrize("columns", ["device", "composed"])
def test_pieces_are_whole_images_within_the_bytes_and_positions_allowed(monkeypatch, columns):
    geometry = ops._geometry("conv2d", (4, 64, 56, 56), (3, 3), (1, 1), (1, 1))
    with _composed() if columns == "composed" else contextlib.nullcontext():
        device = backends.get_device("cpu")
        wide = ops._wide_rows(geometry, device)
        assert wide == (not device.capabilities.conv_columns)
        one = 64 * 9 * 56 * (58 if wide else 56) * 4  # NOTE: one image's columns
        pieces = lambda shape, g=geometry: ops._conv_pieces(shape, g, 4, device)  # noqa: E731
        assert pieces((4, 64, 56, 56)) == [(0, 1), (1, 2), (2, 3), (3, 4)]
        monkeypatch.setattr(ops, "CONV_PIECE_BYTES", 2 * one)
        assert pieces((4, 64, 56, 56)) == [(0, 2), (2, 4)]
        assert pieces((5, 64, 56, 56)) == [(0, 2), (2, 4), (4, 5)]
        monkeypatch.setattr(ops, "CONV_PIECE_BYTES", 2 * one - 1)
        assert pieces((4, 64, 56, 56)) == [(0, 1), (1, 2), (2, 3), (3, 4)]
        monkeypatch.setattr(ops, "CONV_PIECE_BYTES", 2 * one)
        monkeypatch.setattr(ops, "CONV_PIECE_POSITIONS", 3 * 56 * 56)
        assert pieces((4, 64, 56, 56)) == [(0, 4)]  # NOTE: 1 piece
        assert pieces((6, 64, 56, 56)) == [(0, 3), (3, 6)]
        small = ops._geometry("conv2d", (4, 256, 14, 14), (3, 3), (1, 1), (1, 1))
        monkeypatch.setattr(ops, "CONV_PIECE_BYTES", 1 << 20)
        monkeypatch.setattr(ops, "CONV_PIECE_POSITIONS", 3000)
        assert pieces((4, 256, 14, 14), small) == [(0, 4)]  # NOTE: thin


@needs_torch
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
@pytest.mark.parametrize("images", [1, 2])
@pytest.mark.parametrize("case", [c for c in CONV_CASES if c[0] > 1]
                         + [(5, 3, 2, (7, 9), (3, 3), (1, 1), (1, 1)),
                            (3, 4, 5, (6, 6), (1, 1), (1, 1), (0, 0))],
                         ids=lambda c: "x".join(map(str, c[:1] + c[3] + c[4])))
def test_conv2d_in_pieces_and_its_gradients_match_pytorch(device, dtype, images, case,
                                                         pieces):
    if dtype not in backends.get_device(device).capabilities.compute_dtypes:
        pytest.skip(f"{device} does not compute {dtype} (an OpenCL device without cl_khr_fp64)")
    pieces(images)
    assert _conv_against_torch(device, dtype, *case, bias=True) == 4


@needs_torch
@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 5), c=st.integers(1, 3), o=st.integers(1, 3), h=st.integers(1, 7),
       w=st.integers(1, 9), kh=st.integers(1, 3), kw=st.integers(1, 3), sh=st.integers(1, 2),
       sw=st.integers(1, 2), ph=st.integers(0, 1), pw=st.integers(0, 1),
       images=st.integers(1, 4), bias=st.booleans(), seed=st.integers(0, 99))
def test_conv2d_in_drawn_pieces_matches_pytorch(n, c, o, h, w, kh, kw, sh, sw, ph, pw, images,
                                                bias, seed):
    assume(kh <= h + 2 * ph and kw <= w + 2 * pw)
    geometry = ops._geometry("conv2d", (n, c, h, w), (kh, kw), (sh, sw), (ph, pw))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ops, "CONV_PIECE_BYTES", 1)
        patch.setattr(ops, "CONV_PIECE_POSITIONS", images * math.prod(geometry[4]))
        # NOTE: as many pieces as hold `images` images each at least (one: the whole batch)
        found = ops._conv_pieces((n, c, h, w), geometry, 8, backends.get_device("cpu"))
        assert len(found) == max(1, n // images), found
        assert found[0][0] == 0 and found[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(found, found[1:]))
        assert all(stop - start >= images for start, stop in found) or found == [(0, n)]
        compared = _conv_against_torch("cpu", F64, n, c, o, (h, w), (kh, kw), (sh, sw),
                                       (ph, pw), bias=bias, seed=seed)
    assert compared == (4 if bias else 3)


def test_pieces_hold_one_images_columns_not_the_batchs():
    """The most bytes a forward pass, and then forward and backward, take at once, whole
    batch against pieces of one image: about the columns of the three other images less
    (forward: the columns; backward: the columns, then their gradient; the pieces' other
    temporaries fall elsewhere), so at least two images' columns less."""
    rng = np.random.default_rng(16)
    values = rng.standard_normal((4, 8, 24, 24)).astype(np.float32)
    weights = rng.standard_normal((8, 8, 3, 3)).astype(np.float32)
    one = 8 * 9 * 24 * 24 * 4  # NOTE: one image's columns (26 > 1.05 x 24: not wide rows)
    peaks = {}
    for label, size in (("whole", 1 << 40), ("pieces", 1)):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ops, "CONV_PIECE_BYTES", size)
            patch.setattr(ops, "CONV_PIECE_POSITIONS", 1)
            stats = allocators.StatisticsAdaptor(allocators.create("direct", "cpu"))
            x = runtime.tensor(values, allocator=stats, requires_grad=True)
            w = runtime.tensor(weights, allocator=stats, requires_grad=True)
            base = stats.stats()["allocated_bytes"]
            y = ops.conv2d(x, w, padding=1)
            forward = stats.stats()["peak_allocated_bytes"] - base
            ops.sum(y).backward()  # NOTE: the step's peak, forward and backward
            peaks[label] = (forward, stats.stats()["peak_allocated_bytes"] - base)
            del y
    assert peaks["pieces"][0] <= peaks["whole"][0] - 2 * one, peaks
    assert peaks["pieces"][1] <= peaks["whole"][1] - 2 * one, peaks


@pytest.mark.parametrize("name", ["conv2d", "conv2d 1x1"])
def test_out_gets_the_pieces_contiguous_or_strided(name, pieces):
    """In pieces of one image, into a contiguous out and into every other column of a wider
    tensor: the whole batch's values, and nothing written between the columns."""
    x = runtime.tensor(np.random.default_rng(10).standard_normal((2, 2, 4, 4)))
    expected = OPS[name](x).numpy()  # NOTE: the whole batch, one piece
    pieces(1)
    kernel = 3 if name == "conv2d" else 1
    geometry = ops._geometry("conv2d", x.shape, (kernel, kernel), (1, 1),
                             (kernel // 2, kernel // 2))
    assert len(ops._conv_pieces(x.shape, geometry, 8, x.device)) == 2
    out = runtime.empty((2, 2, 4, 4), "float64")
    assert OPS[name](x, out=out) is out
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-12, atol=1e-12)
    wide = runtime.tensor(np.full((2, 2, 4, 8), 7.0))
    strided = wide[:, :, :, ::2]
    assert OPS[name](x, out=strided) is strided
    np.testing.assert_allclose(strided.numpy(), expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(wide.numpy()[:, :, :, 1::2], 7.0)


@pytest.mark.parametrize("options", [
    {"plan": "recycle"}, {"plan": "static"}, {"plan": "static", "checkpoint": "sqrt"},
    {"plan": "static", "checkpoint": "pointwise"}, {"plan": "static", "fuse": False}],
    ids=["recycle", "static", "sqrt", "pointwise", "unfused"])
@pytest.mark.parametrize("images", [1, 3])
def test_a_conv_nets_step_in_pieces_replays_bit_for_bit_as_eager(options, images, pieces):
    pieces(images)
    eager_losses, eager_params = _trained(None)
    losses, params = _trained(options)
    assert losses == eager_losses
    for mine, theirs in zip(params, eager_params):
        np.testing.assert_array_equal(mine, theirs)


# ---------------------------------------------------------------------- pooling
def _pool_against_torch(device: str, dtype: np.dtype, x: np.ndarray, kind: str, kernel, stride,
                        padding, exact: bool = False) -> int:
    """A pool's value and x's gradient against PyTorch's (`exact`: bit for bit); returns how
    many arrays it compared."""
    rng = np.random.default_rng(7)
    tx = torch.tensor(x, requires_grad=True)
    reference = F.max_pool2d if kind == "max" else F.avg_pool2d
    expected = reference(tx, kernel, stride, padding)
    weights = rng.uniform(0.5, 1.5, tuple(expected.shape)).astype(dtype)
    if exact:  # NOTE: small integers: gradients that meet at an element add up exactly
        weights = rng.integers(1, 9, tuple(expected.shape)).astype(dtype)
    (expected * torch.tensor(weights)).sum().backward()
    mx = _ours(x, device, True)
    ours = ops.max_pool2d if kind == "max" else ops.avg_pool2d
    got = ours(mx, kernel, stride, padding)
    ops.sum(ops.mul(got, _ours(weights, device))).backward()
    if exact:
        np.testing.assert_array_equal(got.numpy(), expected.detach().numpy())
        np.testing.assert_array_equal(mx.grad.numpy(), tx.grad.numpy())
    else:
        _close(got, expected, dtype)
        _close(mx.grad, tx.grad, dtype)
    return 2


@needs_torch
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize(("kernel", "stride", "padding"),
                         [(2, None, 0), (3, 2, 1), ((3, 2), (1, 2), (1, 0)), (3, 1, 1)])
def test_pools_and_their_gradients_match_pytorch(device, dtype, kind, kernel, stride, padding):
    if dtype not in backends.get_device(device).capabilities.compute_dtypes:
        pytest.skip(f"{device} does not compute {dtype} (an OpenCL device without cl_khr_fp64)")
    x = np.random.default_rng(8).standard_normal((2, 3, 7, 6)).astype(dtype)
    assert _pool_against_torch(device, dtype, x, kind, kernel, stride, padding) == 2


@needs_torch
@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
def test_max_pool_reads_no_column_past_the_right_edge(dtype):
    # a 3-wide window over a 1-wide image padded by 1: kernel column 2 lies past the edge for
    # every output; the C kernel's last output there was (w - 1 + pw - j) / sw + 1 = 1 (C's
    # division truncates -1 / 2 to 0), so it read one element past each row: garbage, or an
    # index outside the plane (hypothesis found it in test_pools_match_pytorch_on_drawn_...)
    for seed in range(20):
        x = np.random.default_rng(seed).standard_normal((2, 3, 3, 1)).astype(dtype)
        assert _pool_against_torch("cpu", dtype, x, "max", (4, 3), (1, 2), (2, 1),
                                   exact=True) == 2


@needs_torch
@settings(max_examples=40)
@given(n=st.integers(1, 2), c=st.integers(1, 3), h=st.integers(1, 8), w=st.integers(1, 8),
       kh=st.integers(1, 4), kw=st.integers(1, 4), sh=st.integers(1, 3), sw=st.integers(1, 3),
       ph=st.integers(0, 2), pw=st.integers(0, 2), kind=st.sampled_from(["max", "avg"]),
       seed=st.integers(0, 99))
def test_pools_match_pytorch_on_drawn_geometries(n, c, h, w, kh, kw, sh, sw, ph, pw, kind,
                                                  seed):
    x = np.random.default_rng(seed).standard_normal((n, c, h, w))
    pool = ops.max_pool2d if kind == "max" else ops.avg_pool2d
    if ph > kh // 2 or pw > kw // 2:
        with pytest.raises(ValueError, match="at most half the kernel"):
            pool(runtime.tensor(x), (kh, kw), (sh, sw), (ph, pw))
        return
    if kh > h + 2 * ph or kw > w + 2 * pw:
        with pytest.raises(ValueError, match="bigger than the padded input"):
            pool(runtime.tensor(x), (kh, kw), (sh, sw), (ph, pw))
        return
    assert _pool_against_torch("cpu", F64, x, kind, (kh, kw), (sh, sw), (ph, pw)) == 2


@needs_torch
@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=25)
@given(seed=st.integers(0, 10**6), padding=st.integers(0, 1), stride=st.integers(1, 2))
def test_max_pool_sends_each_gradient_to_the_element_pytorchs_scan_picks(device, seed, padding,
                                                                          stride):
    """Few distinct values make ties in most windows; NaN and -inf are drawn in too: values
    and gradients equal PyTorch's bit for bit (the first maximum in row-major order, the last
    NaN of a window holding NaN, an all -inf window's first element of x)."""
    rng = np.random.default_rng(seed)
    x = rng.choice(np.float32([0.0, 1.0, 2.0, -np.inf, np.nan]), size=(2, 2, 5, 5),
                   p=[0.3, 0.3, 0.2, 0.1, 0.1])
    assert _pool_against_torch(device, F32, x, "max", 3, stride, padding, exact=True) == 2


@needs_torch
def test_max_pool_with_padding_ignores_the_border_when_a_window_is_all_minus_infinity():
    x = np.full((1, 1, 4, 4), -np.inf, np.float32)
    assert _pool_against_torch("cpu", F32, x, "max", 3, 2, 1, exact=True) == 2


@needs_torch
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize(("kernel", "stride", "padding"), [(3, 2, 1), ((2, 3), (1, 2), (1, 1))])
def test_max_pool_in_every_dtype_is_pytorchs_bit_for_bit(device, dtype, kernel, stride, padding):
    """Ties, NaN and -inf in every float dtype the op takes: the value, and a gradient of
    small integers (sums exact in every dtype), equal PyTorch's on the same values in
    float32, bit for bit."""
    wanted = np.dtype(dtypes.BFLOAT16) if dtype == "bfloat16" else np.dtype(dtype)
    if wanted not in backends.get_device(device).capabilities.compute_dtypes:
        pytest.skip(f"{device} does not compute {dtype}")
    rng = np.random.default_rng(11)
    values = np.float32([0.0, 1.0, 2.0, -np.inf, np.nan])
    x = rng.choice(values, size=(2, 3, 7, 6), p=[0.3, 0.3, 0.2, 0.1, 0.1]).astype(wanted)
    tx = torch.tensor(x.astype(np.float32), requires_grad=True)
    expected = F.max_pool2d(tx, kernel, stride, padding)
    weights = rng.integers(1, 9, tuple(expected.shape)).astype(wanted)
    (expected * torch.tensor(weights.astype(np.float32))).sum().backward()
    mx = _ours(x, device, True)
    got = ops.max_pool2d(mx, kernel, stride, padding)
    assert got.dtype == wanted
    ops.sum(ops.mul(got, _ours(weights, device))).backward()
    assert mx.grad.dtype == wanted
    np.testing.assert_array_equal(got.numpy().astype(np.float32), expected.detach().numpy())
    np.testing.assert_array_equal(mx.grad.numpy().astype(np.float32), tx.grad.numpy())
    with runtime.no_grad():  # NOTE: no indices wanted: the same maxima
        plain = ops.max_pool2d(_ours(x, device), kernel, stride, padding)
    np.testing.assert_array_equal(plain.numpy().astype(np.float32), expected.detach().numpy())


@pytest.mark.parametrize("device", DEVICES)
def test_max_pool_of_a_strided_x_is_the_contiguous_ones(device):
    """A strided x (the CPU's NumPy formula, where a contiguous one runs its C kernel) gives
    the same values and gradient, bit for bit."""
    rng = np.random.default_rng(12)
    x = rng.choice(np.float32([0.0, 1.0, 2.0, np.nan, -np.inf]), size=(2, 3, 9, 8))
    g = rng.standard_normal((2, 3, 5, 4)).astype(np.float32)
    results = []
    for strided in (False, True):
        base = _ours(np.ascontiguousarray(x.transpose(0, 1, 3, 2)) if strided else x,
                     device, True)
        mx = base.transpose(0, 1, 3, 2) if strided else base
        assert mx.is_contiguous() != strided
        y = ops.max_pool2d(mx, 3, 2, 1)
        y.backward(_ours(g, device))
        results.append((y.numpy(), base.grad.numpy().transpose(0, 1, 3, 2) if strided
                         else base.grad.numpy()))
    for mine, theirs in zip(*results):
        assert_same_bits(np.ascontiguousarray(mine), np.ascontiguousarray(theirs), "max_pool2d")


@needs_torch
def test_max_pool_of_resnet_shape_and_avg_pool_of_a_whole_image():
    x = np.random.default_rng(9).standard_normal((1, 2, 16, 16)).astype(np.float32)
    assert _pool_against_torch("cpu", F32, x, "max", 3, 2, 1) == 2
    assert _pool_against_torch("cpu", F32, x, "avg", 16, None, 0) == 2


# ---------------------------------------------------------------------- out=
OPS = {
    "conv2d": lambda x, out=None: ops.conv2d(x, runtime.tensor(np.ones((2, 2, 3, 3))),
                                             padding=1, out=out),
    "conv2d 1x1": lambda x, out=None: ops.conv2d(x, runtime.tensor(np.ones((2, 2, 1, 1))),
                                                 out=out),
    "max_pool2d": lambda x, out=None: ops.max_pool2d(x, 3, 1, 1, out=out),
    "avg_pool2d": lambda x, out=None: ops.avg_pool2d(x, 3, 1, 1, out=out),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_out_gets_the_result_contiguous_or_strided(name):
    x = runtime.tensor(np.random.default_rng(10).standard_normal((2, 2, 4, 4)))
    expected = OPS[name](x).numpy()
    out = runtime.empty((2, 2, 4, 4), "float64")
    assert OPS[name](x, out=out) is out
    np.testing.assert_array_equal(out.numpy(), expected)
    wide = runtime.tensor(np.full((2, 2, 4, 8), 7.0))
    strided = wide[:, :, :, ::2]
    assert OPS[name](x, out=strided) is strided
    np.testing.assert_array_equal(strided.numpy(), expected)
    np.testing.assert_array_equal(wide.numpy()[:, :, :, 1::2], 7.0)  # nothing else written


@pytest.mark.parametrize("name", sorted(OPS))
def test_out_overlapping_an_input_is_refused_or_computed_through_a_temporary(name):
    values = np.random.default_rng(11).standard_normal((2, 2, 4, 4))
    expected = OPS[name](runtime.tensor(values)).numpy()
    x = runtime.tensor(values)
    runtime.set_aliasing("raise")
    with pytest.raises(runtime.AliasingError, match=name.split()[0]):
        OPS[name](x, out=x)
    np.testing.assert_array_equal(x.numpy(), values)  # nothing written
    runtime.set_aliasing("copy")
    assert OPS[name](x, out=x) is x
    np.testing.assert_array_equal(x.numpy(), expected)


def test_out_overlapping_the_weight_is_refused():
    weight = runtime.tensor(np.ones((1, 1, 2, 2)))
    runtime.set_aliasing("raise")
    with pytest.raises(runtime.AliasingError, match="weight"):
        ops.conv2d(runtime.tensor(np.ones((1, 1, 3, 3))), weight, out=weight)


def test_out_is_refused_while_recording_gradients():
    x = runtime.tensor(np.ones((1, 1, 3, 3)), requires_grad=True)
    with pytest.raises(runtime.AutogradError, match="out="):
        ops.max_pool2d(x, 2, 1, out=runtime.empty((1, 1, 2, 2), "float64"))


# ---------------------------------------------------------------------- bad input
def _image(*shape):
    return runtime.tensor(np.zeros(shape, np.float32))


@pytest.mark.parametrize(("call", "error", "words"), [
    (lambda: ops.conv2d(_image(3, 4, 4), _image(2, 3, 1, 1)), ValueError,
     r"4-D \(batch, channels, height, width\), got shape \(3, 4, 4\)"),
    (lambda: ops.conv2d(_image(1, 3, 4, 4), _image(2, 3, 1)), ValueError,
     r"weight must be 4-D"),
    (lambda: ops.conv2d(_image(1, 3, 4, 4), _image(2, 5, 1, 1)), ValueError,
     r"x has 3 channels .* the weight expects 5"),
    (lambda: ops.conv2d(_image(1, 3, 4, 4), _image(2, 3, 7, 3), padding=1), ValueError,
     r"kernel 7x3 is bigger than the padded input 6x6 \(input 4x4, padding 1,1\)"),
    (lambda: ops.conv2d(_image(1, 3, 4, 4), _image(2, 3, 1, 1), stride=1.5), TypeError,
     r"stride must be an int or a pair of ints, got 1.5"),
    (lambda: ops.conv2d(_image(1, 3, 4, 4), _image(2, 3, 1, 1), stride=0), ValueError,
     r"stride must be at least 1, got 0"),
    (lambda: ops.conv2d(_image(1, 3, 4, 4), _image(2, 3, 1, 1), padding=(1, 2, 3)), TypeError,
     r"padding must be an int or a pair"),
    (lambda: ops.conv2d(_image(1, 3, 4, 4), _image(2, 3, 1, 1), _image(3)), ValueError,
     r"bias has shape \(3,\), expected \(2,\)"),
    (lambda: ops.conv2d(_image(1, 3, 4, 4), _image(2, 3, 1, 1), dilation=2), ValueError,
     r"dilation=2 is not supported"),
    (lambda: ops.conv2d(_image(1, 3, 4, 4), _image(2, 3, 1, 1), groups=3), ValueError,
     r"groups=3 is not supported"),
    (lambda: ops.conv2d(_image(1, 3, 4, 4), _image(2, 3, 1, 1), dilations=1), TypeError,
     r"unexpected keyword argument 'dilations'"),
    (lambda: ops.conv2d(_image(1, 3, 4, 4), runtime.tensor(np.zeros((2, 3, 1, 1)))),
     TypeError, r"different dtypes"),
    (lambda: ops.max_pool2d(_image(1, 1, 4, 4), 2, ceil_mode=True), ValueError,
     r"ceil_mode=True is not supported"),
    (lambda: ops.avg_pool2d(_image(1, 1, 4, 4), 2, count_include_pad=False), ValueError,
     r"count_include_pad=False is not supported"),
    (lambda: ops.max_pool2d(_image(1, 1, 4, 4), 3, padding=2), ValueError,
     r"padding 2,2 must be at most half the kernel 3x3"),
    (lambda: ops.avg_pool2d(_image(1, 1, 2, 2), 5, padding=1), ValueError,
     r"kernel 5x5 is bigger than the padded input 4x4"),
    (lambda: ops.max_pool2d(_image(1, 4, 4), 2), ValueError, r"must be 4-D"),
    (lambda: ops.avg_pool2d(_image(1, 1, 4, 4), (2, True)), TypeError,
     r"kernel_size must be an int or a pair of ints"),
    (lambda: ops.max_pool2d(runtime.tensor(np.zeros((1, 1, 2, 2), np.int32)), 2), TypeError,
     r"float dtypes only"),
])
def test_bad_input_is_refused_with_the_numbers(call, error, words):
    with pytest.raises(error, match=words):
        call()


def test_pytorchs_defaults_of_unsupported_keywords_are_accepted():
    x, w = _image(1, 2, 4, 4), _image(2, 2, 1, 1)
    pairs = [(ops.conv2d(x, w, dilation=1, groups=1), ops.conv2d(x, w)),
             (ops.max_pool2d(x, 2, dilation=(1, 1), ceil_mode=False, return_indices=False),
              ops.max_pool2d(x, 2)),
             (ops.avg_pool2d(x, 2, ceil_mode=False, count_include_pad=True,
                             divisor_override=None), ops.avg_pool2d(x, 2))]
    for with_keywords, default in pairs:
        np.testing.assert_array_equal(with_keywords.numpy(), default.numpy())


# ---------------------------------------------------------------------- memory
def test_the_backward_pass_keeps_x_and_the_weight_not_the_columns():
    """After the forward pass only x, the weight, the bias and the result hold memory: the
    padded copy and the columns went back as soon as they were used."""
    stats = allocators.StatisticsAdaptor(allocators.create("direct", "cpu"))
    rng = np.random.default_rng(12)
    x = runtime.tensor(rng.standard_normal((2, 3, 16, 16)).astype(np.float32), allocator=stats,
                       requires_grad=True)
    w = runtime.tensor(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), allocator=stats,
                       requires_grad=True)
    b = runtime.tensor(np.zeros(4, np.float32), allocator=stats, requires_grad=True)
    before = stats.stats()["allocated_bytes"]
    y = ops.conv2d(x, w, b, padding=1)
    assert stats.stats()["allocated_bytes"] - before == y.nbytes
    columns = 2 * 3 * 9 * 16 * 16 * 4
    assert stats.stats()["peak_allocated_bytes"] - before < y.nbytes + 2 * columns
    ops.sum(y).backward()
    del y
    grads = x.nbytes + w.nbytes + b.nbytes
    assert stats.stats()["allocated_bytes"] - before == grads


# ---------------------------------------------------------------------- a conv net in a graph
def conv_net(seed: int = 0, depth: int = 3) -> nn.Sequential:
    """`depth` 3x3 convolutions, a max pool, a 1x1 convolution, an average pool, a Dense."""
    nn.manual_seed(seed)
    layers = [nn.Conv2d(2, 4, 3, padding=1), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Conv2d(4, 4, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*layers, nn.MaxPool2d(3, 2, 1), nn.Conv2d(4, 4, 1), nn.ReLU(),
                         nn.AvgPool2d(2), nn.Flatten(), nn.Dense(16, 3))


def conv_batches(count: int = 3) -> list:
    rng = np.random.default_rng(13)
    return [(rng.standard_normal((4, 2, 8, 8)).astype(np.float32), rng.integers(0, 3, 4))
            for _ in range(count)]


def _conv_step(depth: int = 3) -> tuple[nn.Module, object]:
    model = conv_net(depth=depth)
    return model, nn.train_step(model, nn.SGD(model.parameters(), lr=0.1, momentum=0.9))


def _trained(graph_options: dict | None,
             depth: int = 3) -> tuple[list[float], list[np.ndarray]]:
    model, step = _conv_step(depth)
    if graph_options is not None:
        step = runtime.graph(step, **graph_options)
    losses = [step(runtime.tensor(x) if graph_options is None else x, y).item()
              for x, y in conv_batches()]
    return losses, [p.numpy() for p in model.parameters()]


@pytest.mark.parametrize("options", [
    {"plan": "recycle"}, {"plan": "static"}, {"plan": "static", "checkpoint": "sqrt"},
    {"plan": "static", "fuse": False}], ids=["recycle", "static", "sqrt", "unfused"])
def test_a_conv_nets_training_step_replays_bit_for_bit_as_eager(options):
    eager_losses, eager_params = _trained(None)
    losses, params = _trained(options)
    assert losses == eager_losses
    for mine, theirs in zip(params, eager_params):
        np.testing.assert_array_equal(mine, theirs)


@pytest.mark.parametrize("plan", ["static", "recycle"])
def test_a_conv_net_under_a_memory_budget_replays_bit_for_bit_as_eager(plan):
    # NOTE: five 3x3 convolutions: at three, the step's peak is where no recompute lowers it
    depth = 5
    eager_losses, eager_params = _trained(None, depth)
    x, y = conv_batches()[0]
    with pytest.raises(runtime.BudgetError) as caught:
        runtime.graph(_conv_step(depth)[1], plan=plan, memory_budget=0)(x, y)
    budget = caught.value.least_bytes  # NOTE: the least any choice of keeping reaches
    model, step = _conv_step(depth)
    graph = runtime.graph(step, plan=plan, memory_budget=budget)
    losses = [graph(x, y).item() for x, y in conv_batches()]
    params = [p.numpy() for p in model.parameters()]
    report = graph.memory_report()
    assert report["recomputed"] > 0 and max(graph.timeline()) <= budget
    assert losses == eager_losses
    for mine, theirs in zip(params, eager_params):
        np.testing.assert_array_equal(mine, theirs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("columns", ["device", "composed"])
def test_a_step_on_wide_rows_replays_bit_for_bit_as_eager(device, columns):
    """8x40 images under 3x3 kernels at stride 1: the convolutions run on wide rows (flat
    window stretches of the padded image) where the device makes no columns itself, or on its
    im2col and col2im kernels, captured with sqrt checkpoints too."""
    with _composed(device) if columns == "composed" else contextlib.nullcontext():
        _wide_rows_step(device)


def _wide_rows_step(device: str) -> None:
    rng = np.random.default_rng(15)
    data = [(rng.standard_normal((2, 2, 8, 40)).astype(np.float32), rng.integers(0, 3, 2))
            for _ in range(2)]
    results = []
    for options in (None, {"plan": "static"}, {"plan": "static", "checkpoint": "sqrt"}):
        nn.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, device=device), nn.ReLU(),
                              nn.Conv2d(4, 4, 3, padding=1, device=device),
                              nn.MaxPool2d(3, 2, 1), nn.AvgPool2d(4), nn.Flatten(),
                              nn.Dense(20, 3, device=device))
        step = nn.train_step(model, nn.SGD(model.parameters(), lr=0.1, momentum=0.9))
        if options is not None:
            step = runtime.graph(step, device=device, **options)
        losses = [step(x if options else runtime.tensor(x, device=device), y).item()
                  for x, y in data]
        results.append((losses, [p.numpy() for p in model.parameters()]))
    for losses, params in results[1:]:
        assert losses == results[0][0]
        for mine, theirs in zip(params, results[0][1]):
            np.testing.assert_array_equal(mine, theirs)


@pytest.mark.parametrize("plan", ["static", "recycle"])
@pytest.mark.skipif("opencl" not in backends.available(), reason="no OpenCL device here")
def test_a_conv_nets_step_on_opencl_replays_bit_for_bit_as_eager(plan):
    device = backends.get_device("opencl")
    results = []
    for captured in (False, True):
        nn.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, device=device), nn.ReLU(),
                              nn.MaxPool2d(3, 2, 1), nn.Conv2d(4, 4, 1, device=device),
                              nn.AvgPool2d(2), nn.Flatten(), nn.Dense(16, 3, device=device))
        step = nn.train_step(model, nn.SGD(model.parameters(), lr=0.1, momentum=0.9))
        if captured:
            step = runtime.graph(step, plan=plan, device=device)
        losses = [step(x if captured else runtime.tensor(x, device=device), y).item()
                  for x, y in conv_batches()]
        results.append((losses, [p.numpy() for p in model.parameters()]))
    assert results[0][0] == results[1][0]
    for mine, theirs in zip(results[1][1], results[0][1]):
        np.testing.assert_array_equal(mine, theirs)


def test_a_conv_net_learns():
    model = conv_net(1)
    step = runtime.graph(nn.train_step(model, nn.SGD(model.parameters(), lr=0.1,
                                                     momentum=0.9)))
    x, y = conv_batches(1)[0]
    losses = [step(x, y).item() for _ in range(40)]
    assert losses[-1] < losses[0] / 2


# ---------------------------------------------------------------------- layers
@needs_torch
def test_conv2d_layer_shapes_and_pytorchs_initial_bounds():
    conv = nn.Conv2d(3, 64, 5, stride=2, padding=(2, 1), rng=0)
    assert conv.weight.shape == (64, 3, 5, 5) and conv.bias.shape == (64,)
    bound = 1 / math.sqrt(3 * 5 * 5)
    for p in (conv.weight, conv.bias):
        values = p.numpy()
        assert values.dtype == np.float32 and np.abs(values).max() <= bound
        assert np.abs(values).max() > 0.9 * bound  # drawn over the whole range
    assert [name for name, _ in conv.named_parameters()] == ["weight", "bias"]
    assert "kernel_size=(5, 5), stride=(2, 2), padding=(2, 1)" in repr(conv)
    assert nn.Conv2d(2, 3, (1, 3), bias=False, dtype="float64").bias is None
    y = conv(runtime.tensor(np.ones((2, 3, 9, 8), np.float32)))
    assert y.shape == (2, 64, 5, 3)
    expected = F.conv2d(torch.ones(2, 3, 9, 8), torch.tensor(conv.weight.numpy()),
                        torch.tensor(conv.bias.numpy()), stride=2, padding=(2, 1))
    np.testing.assert_allclose(y.numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("args", "error"), [((0, 3, 3), ValueError), ((3, 2.5, 3), ValueError),
                                             ((3, 3, 0), ValueError), ((3, 3, "3"), TypeError)])
def test_conv2d_layer_refuses_bad_sizes(args, error):
    with pytest.raises(error, match="Conv2d"):
        nn.Conv2d(*args)


def test_pool_layers_default_their_stride_to_the_kernel():
    pool = nn.MaxPool2d(3)
    assert pool.stride == (3, 3) and nn.AvgPool2d(2, 1).stride == (1, 1)
    x = runtime.tensor(np.arange(36.0).reshape(1, 1, 6, 6))
    assert pool(x).numpy().ravel().tolist() == [14.0, 17.0, 32.0, 35.0]
    assert nn.AvgPool2d(6)(x).numpy().ravel().tolist() == [17.5]
    assert pool.parameters() == [] and "kernel_size=(3, 3)" in repr(pool)


@needs_torch
@pytest.mark.parametrize(("start", "end", "shape"), [
    (1, -1, (2, 60)), (0, -1, (120,)), (1, 2, (2, 12, 5)), (-2, -1, (2, 3, 20)),
    (2, 2, (2, 3, 4, 5))])
def test_flatten_merges_axes_as_pytorch(start, end, shape):
    values = np.arange(120.0).reshape(2, 3, 4, 5)
    got = nn.Flatten(start, end)(runtime.tensor(values))
    assert got.shape == shape == tuple(torch.nn.Flatten(start, end)(torch.tensor(values)).shape)
    np.testing.assert_array_equal(got.numpy(), values.reshape(shape))


def test_flatten_refuses_axes_outside_the_input():
    with pytest.raises(ValueError, match="start_dim 4"):
        nn.Flatten(4)(runtime.tensor(np.zeros((2, 3))))
    with pytest.raises(ValueError, match="comes after"):
        nn.Flatten(2, 1)(runtime.tensor(np.zeros((2, 3, 4))))
