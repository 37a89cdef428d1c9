"""Embedding (issue 30): `ops.embedding` and `nn.Embedding` against PyTorch's CPU, the gather and
scatter_add hooks of every device (the kit's rule "gather and scatter", the base's defaults on
the naive device, OpenCL's kernels and a planted device that adds in another order), repeated
indices accumulating as np.add.at does, indices checked and named before anything is written.
(tests/test_embedding.py is about embedding blockrt in frameworks.)"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import backends
import runtime
from backends import testing
from backends.numpy import NumpyDevice
from naive_device import NaiveDevice
from runtime import nn, ops

KINDS = ["cpu"] + [pytest.param("opencl", marks=pytest.mark.skipif(
    "opencl" not in backends.available(), reason="no OpenCL device (PoCL) here"))]
FLOATS = ["float32", "float64", "float16", np.dtype(ml_dtypes.bfloat16)]
NAIVE = NaiveDevice()


def _torch():
    return pytest.importorskip("torch", reason="PyTorch (CPU) is the reference here")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", FLOATS)
def test_rows_and_the_gradient_of_repeated_indices_match_pytorch(kind, dtype):
    torch = _torch()
    dev = backends.get_device(kind)
    rng = np.random.default_rng(1)
    table = rng.standard_normal((5, 3)).astype(dtype)
    indices = np.array([[4, 0, 4], [1, 4, 2]])
    g = rng.standard_normal((2, 3, 3)).astype(dtype)
    w = runtime.tensor(table, device=dev, requires_grad=True)
    y = ops.embedding(indices, w)
    y.backward(runtime.tensor(g, device=dev))
    assert y.shape == (2, 3, 3) and y.dtype == dtype
    assert y.numpy().tobytes() == table[indices].tobytes()  # NOTE: rows are moved, not computed
    want = np.zeros((5, 3), np.float32 if dtype in FLOATS[2:] else dtype)
    np.add.at(want, indices.reshape(-1), g.reshape(6, 3).astype(want.dtype))
    assert w.grad.numpy().tobytes() == want.astype(dtype).tobytes()
    tw = torch.tensor(table.astype(np.float64), requires_grad=True)
    torch.nn.functional.embedding(torch.tensor(indices), tw).backward(
        torch.tensor(g.astype(np.float64)))
    np.testing.assert_allclose(w.grad.numpy().astype(np.float64), tw.grad.numpy(),
                               rtol=float(ml_dtypes.finfo(dtype).eps) * 4, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), data=st.data())
def test_repeated_indices_accumulate_in_index_order_on_every_device(rows, data):
    """The gradient of a row used many times is the np.add.at sum in index order, the same
    bits on the CPU, the naive device (the base's defaults) and OpenCL."""
    indices = np.array(data.draw(st.lists(st.integers(0, rows - 1), max_size=20)), np.int64)
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    g = (rng.standard_normal((len(indices), 2)) * 2.0 ** rng.integers(-12, 12, (len(indices),
                                                                            2)))
    g = g.astype(np.float32)
    want = np.zeros((rows, 2), np.float32)
    np.add.at(want, indices, g)
    devices = [backends.get_device("cpu"), NAIVE]
    if "opencl" in backends.available():
        devices.append(backends.get_device("opencl"))
    for dev in devices:
        w = runtime.tensor(np.zeros((rows, 2), np.float32), device=dev, requires_grad=True)
        ops.embedding(runtime.tensor(indices, device=dev), w).backward(
            runtime.tensor(g, device=dev))
        assert w.grad.numpy().tobytes() == want.tobytes(), dev.name


@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_index_is_named_with_the_row_count_before_anything_is_written(kind):
    dev = backends.get_device(kind)
    w = runtime.tensor(np.arange(8.0).reshape(4, 2), device=dev)
    out = runtime.tensor(np.full((3, 2), 7.0), device=dev)
    for bad, number in (([0, 4, 1], 4), ([0, -1, 1], -1)):
        with pytest.raises(ValueError, match=rf"embedding: index {number} is outside \[0, 4\) "
                                             r"for a weight of 4 rows"):
            ops.embedding(bad, w, out=out)
        with pytest.raises(ValueError, match=rf"gather: index {number} \(at position 1\) is "
                                             r"outside \[0, 4\) for 4 rows"):
            ops.embedding(runtime.tensor(np.array(bad), device=dev), w, out=out)
        assert out.numpy().tolist() == [[7.0, 7.0]] * 3
    with pytest.raises(TypeError, match="embedding: indices must be integers, got float64"):
        ops.embedding([0.0, 1.0], w)
    with pytest.raises(TypeError, match="indices must be integers, got a float32 Tensor"):
        ops.embedding(runtime.zeros(2), w)
    with pytest.raises(ValueError, match=r"weight must be 2-D"):
        ops.embedding([0], runtime.zeros(3))


def test_indices_of_any_integer_dtype_and_shape_and_a_scalar_index():
    w = runtime.tensor(np.arange(6.0, dtype=np.float32).reshape(3, 2))
    for dtype in ("int8", "uint8", "int16", "int32", "uint32", "int64"):
        idx = runtime.tensor(np.array([[2, 0], [1, 1]], dtype))
        assert ops.embedding(idx, w).numpy().tolist() == [[[4, 5], [0, 1]], [[2, 3], [2, 3]]]
    assert ops.embedding(1, w).numpy().tolist() == [2, 3]
    assert ops.embedding(np.zeros((0, 4), np.int64), w).shape == (0, 4, 2)


def test_out_takes_the_rows_strided_or_not_and_may_not_overlap_the_weight():
    w = runtime.tensor(np.arange(6.0).reshape(3, 2))
    out = runtime.zeros((2, 2), "float64")
    assert ops.embedding([2, 1], w, out=out) is out
    assert out.numpy().tolist() == [[4, 5], [2, 3]]
    wide = runtime.zeros((2, 4), "float64")
    ops.embedding([0, 2], w, out=wide[:, ::2])
    assert wide.numpy().tolist() == [[0, 0, 1, 0], [4, 0, 5, 0]]
    runtime.set_aliasing("raise")
    with pytest.raises(runtime.AliasingError, match="embedding: the output .* overlaps input "
                                                    "weight"):
        ops.embedding([2, 1], w, out=w[:2])
    assert w.numpy().tolist() == [[0, 1], [2, 3], [4, 5]]
    runtime.set_aliasing("copy")
    ops.embedding([2, 1], w, out=w[:2])  # NOTE: through a temporary: rows read before written
    assert w.numpy().tolist() == [[4, 5], [2, 3], [4, 5]]


def test_the_layer_starts_standard_normal_and_looks_up_rows():
    nn.manual_seed(0)
    layer = nn.Embedding(200, 50)
    values = layer.weight.numpy()
    assert layer.weight.requires_grad and values.dtype == np.float32
    assert abs(values.mean()) < 0.02 and abs(values.std() - 1) < 0.02
    assert repr(layer) == "Embedding(200, 50)"
    assert np.array_equal(layer([3, 3]).numpy(), values[[3, 3]])
    again = nn.Embedding(200, 50, rng=np.random.default_rng(0))
    assert np.array_equal(again.weight.numpy(), values)  # NOTE: manual_seed's generator
    half = nn.Embedding(4, 2, dtype="bfloat16", rng=1)
    assert half.weight.dtype == ml_dtypes.bfloat16
    with pytest.raises(ValueError, match="Embedding: num_embeddings must be a positive int"):
        nn.Embedding(0, 2)
    with pytest.raises(TypeError, match="Embedding: parameters are a float dtype"):
        nn.Embedding(2, 2, dtype="int32")


def test_float64_gradient_matches_finite_differences():
    rng = np.random.default_rng(2)
    table, r = rng.standard_normal((3, 2)), rng.standard_normal((4, 2))
    indices = [2, 0, 2, 2]
    w = runtime.tensor(table, requires_grad=True)
    ops.sum(ops.mul(ops.embedding(indices, w), runtime.tensor(r))).backward()
    h, numeric = 1e-6, np.zeros_like(table)
    for index in np.ndindex(table.shape):
        up, down = table.copy(), table.copy()
        up[index] += h
        down[index] -= h
        numeric[index] = ((up[indices] * r).sum() - (down[indices] * r).sum()) / (2 * h)
    np.testing.assert_allclose(w.grad.numpy(), numeric, rtol=1e-7, atol=1e-9)


class AddsInReverse(NumpyDevice):
    """Planted: scatter_add adds the rows last index first (as an unordered atomic might)."""

    def _scatter_add(self, src, indices, out) -> None:
        np.add.at(out, indices[::-1], src[::-1])


class GathersUnchecked(NumpyDevice):
    """Planted: gather writes before it checks (a NumPy take that wraps negative indices)."""

    def gather(self, table, indices, out) -> None:
        np.take(table, indices, axis=0, out=out, mode="wrap")
        super().gather(table, indices, out)


@pytest.mark.parametrize(("device_class", "message"), [
    (AddsInReverse, r"scatter_add \((float32|float64|float16|bfloat16)\): element \d+ is"),
    (GathersUnchecked, "a refused index left gather's out written"),
])
def test_the_kit_rule_catches_a_planted_bug(device_class, message):
    device = device_class()
    device.name = device_class.__name__.lower()
    with pytest.raises(AssertionError, match=r"^\[gather and scatter\] " + device_class.__name__
                       + ".*" + message):
        testing.check_device(device, examples=60, rules=["gather and scatter"])


# ---------------------------------------------------------------------- padding_idx, max_norm
#: (padding_idx, max_norm, norm_type): a padding row, a negative one with a renorm, renorms
#: under the 1-, infinity- and 3-norms (the padding row itself renormalised too)
OPTIONS = [(5, None, 2.0), (-1, 1.5, 2.0), (None, 1.0, 1.0), (0, 2.0, float("inf")),
           (2, 3.0, 3.0)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_padding_idx_and_max_norm_match_pytorch(kind, dtype, options):
    """Rows, the weight's gradient and the weight after the renorm against PyTorch's, with
    repeated indices (row 5 three times: renormalised once; the padding row's uses add
    nothing)."""
    torch = _torch()
    padding_idx, max_norm, norm_type = options
    rng = np.random.default_rng(7)
    table = (rng.standard_normal((6, 4)) * 2).astype(dtype)
    table[1] *= 0.05  # NOTE: a row looked up whose norm is under every max_norm
    indices = np.array([[5, 0, 5], [2, 5, 1]])
    g = rng.standard_normal((2, 3, 4)).astype(dtype)
    w = runtime.tensor(table, device=backends.get_device(kind), requires_grad=True)
    y = ops.embedding(indices, w, padding_idx, max_norm, norm_type)
    y.backward(runtime.tensor(g, device=w.device))
    tw = torch.tensor(table, requires_grad=True)
    ty = torch.nn.functional.embedding(torch.tensor(indices), tw, padding_idx, max_norm,
                                       norm_type)
    ty.backward(torch.tensor(g))
    tolerance = dict(rtol=2e-7, atol=0) if dtype == "float32" else dict(rtol=1e-15, atol=0)
    renormed = tw.detach().numpy()
    np.testing.assert_allclose(w.numpy(), renormed, **tolerance)
    assert (renormed != table).any() == (max_norm is not None)
    np.testing.assert_array_equal(w.numpy()[[1, 3, 4]], table[[1, 3, 4]])  # NOTE: left alone
    np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), **tolerance)
    assert y.numpy().tobytes() == w.numpy()[indices].tobytes()  # NOTE: the renormed rows
    np.testing.assert_array_equal(w.grad.numpy(), tw.grad.numpy())  # NOTE: sums in one order
    if padding_idx is not None:
        assert not w.grad.numpy()[padding_idx].any()


def test_the_padding_row_gets_no_gradient_even_from_non_finite_uses():
    w = runtime.tensor(np.ones((3, 2)), requires_grad=True)
    y = ops.embedding([1, 0, 1], w, padding_idx=1)
    y.backward(runtime.tensor(np.array([[np.inf, np.nan], [2.0, 3.0], [1.0, 1.0]])))
    assert w.grad.numpy().tolist() == [[2.0, 3.0], [0.0, 0.0], [0.0, 0.0]]


def test_the_layer_takes_pytorchs_padding_idx_and_max_norm():
    torch = _torch()
    layer = nn.Embedding(10, 3, padding_idx=-2, max_norm=1.0, rng=0)
    assert layer.padding_idx == 8
    assert not layer.weight.numpy()[8].any() and layer.weight.numpy()[7].all()
    assert repr(layer) == repr(torch.nn.Embedding(10, 3, padding_idx=-2, max_norm=1.0))
    assert repr(nn.Embedding(4, 2, norm_type=1.0)) == repr(torch.nn.Embedding(4, 2,
                                                                              norm_type=1.0))
    assert repr(nn.Embedding(4, 2, max_norm=2.0, norm_type=1.0)) == repr(
        torch.nn.Embedding(4, 2, max_norm=2.0, norm_type=1.0))
    rows = layer([[7, 8], [7, 3]])
    norms = np.linalg.norm(layer.weight.numpy()[[3, 7]], axis=1)
    assert (norms <= 1.0 + 1e-6).all()
    assert not rows.numpy()[0, 1].any()


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda w: ops.embedding([0], w, padding_idx=4), ValueError,
     r"embedding: padding_idx 4 is outside \[-4, 4\) for 4 embeddings"),
    (lambda w: ops.embedding([0], w, padding_idx=-5), ValueError,
     r"embedding: padding_idx -5 is outside \[-4, 4\)"),
    (lambda w: ops.embedding([0], w, padding_idx=1.0), TypeError,
     "embedding: padding_idx must be an int or None, got 1.0"),
    (lambda w: ops.embedding([0], w, max_norm="1"), TypeError,
     "embedding: max_norm must be a number"),
    (lambda w: ops.embedding([0], w, max_norm=float("nan")), ValueError,
     "embedding: max_norm must lie in"),
    (lambda w: nn.Embedding(4, 2, padding_idx=4), ValueError,
     r"Embedding: padding_idx 4 is outside \[-4, 4\) for 4 embeddings"),
    (lambda w: nn.Embedding(4, 2, max_norm=True), TypeError, "Embedding: max_norm must be a"),
])
def test_bad_padding_idx_and_max_norm_are_named_with_the_numbers(call, error, message):
    w = runtime.tensor(np.ones((4, 2)))
    with pytest.raises(error, match=message):
        call(w)
    assert w.numpy().tolist() == [[1.0, 1.0]] * 4


class _Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 3, padding_idx=0, max_norm=0.8)
        self.head = nn.Dense(6, 3)

    def forward(self, indices):
        h = self.embed(indices)
        return self.head(h.reshape(h.shape[0], 6))


@pytest.mark.parametrize("options", [
    dict(plan="static"), dict(plan="static", checkpoint="sqrt"),
    dict(plan="recycle", memory_budget=1 << 12),
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_a_captured_step_renormalises_at_every_replay_as_eager(options):
    """The renorm is one recorded launch: each replay renormalises the rows of its own
    indices, bit for bit as the eager steps do, under a checkpoint and a budget too."""
    rng = np.random.default_rng(3)
    batches = [(rng.integers(0, 7, (5, 2)), rng.integers(0, 3, 5)) for _ in range(3)]

    def make():
        nn.manual_seed(1)
        model = _Bag()
        with runtime.no_grad():  # NOTE: rows large enough that every lookup renormalises
            ops.mul(model.embed.weight, 3.0, out=model.embed.weight)
        return model, nn.train_step(model, nn.SGD(model.parameters(), lr=0.5))

    eager_model, eager = make()
    want = [eager(runtime.tensor(x), runtime.tensor(y)).numpy().tobytes() for x, y in batches]
    model, step = make()
    graph = runtime.graph(step, **options)
    assert [graph(x, y).numpy().tobytes() for x, y in batches] == want
    for name, value in eager_model.state_dict().items():
        assert model.state_dict()[name].numpy().tobytes() == value.numpy().tobytes(), name
    assert not model.embed.weight.numpy()[0].any()  # NOTE: the padding row never learns
