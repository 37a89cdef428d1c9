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
