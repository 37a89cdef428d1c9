"""A catalogue of bad input: each case raises an error of the documented type whose message names
the problem and its numbers (sizes, shapes, dtypes, names), and loses nothing already computed.

"Loses nothing" is checked after every error: the tensors, views and constants made before still
hold their data and versions (nothing was written), the allocator has the same allocations live
with the same accounting, and the allocator and constant pool pass their invariant checks.
"""

from __future__ import annotations

import gc
import importlib.util
import math
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import allocators
import backends
import helpers
import runtime
from allocators import InvalidFreeError, OutOfMemoryError
from allocators.interop import pyopencl_allocator
from backends.numpy import NumpyDevice
from runtime import AliasingError, AutogradError, ReadOnlyError, UseAfterFreeError, config, nn, ops
from runtime._tensor import MAX_NBYTES, Tensor
from runtime.errors import UninitializedMemoryError

ROOT = Path(__file__).resolve().parent.parent
ALLOCATOR_KINDS = ("direct", "caching")
#: What a failed call may not change: the memory in use and the allocations live.
IN_USE = ("allocated_bytes", "requested_bytes", "active_allocations")


def parts(*pieces: str) -> str:
    """A regex matching the literal `pieces` in this order, anything between them."""
    return ".*".join(re.escape(piece) for piece in pieces)


def in_use(allocator: allocators.Allocator) -> dict[str, Any]:
    stats = allocator.stats()
    return {key: stats[key] for key in IN_USE}


# ---------------------------------------------------------------------- what must survive
class World:
    """Tensors with known data over one allocator, a constant pool, and a snapshot of both."""

    def __init__(self, allocator: allocators.Allocator) -> None:
        self.allocator = allocator
        self.x = runtime.tensor(np.arange(12.0).reshape(3, 4), allocator=allocator)
        self.view = self.x[:, 1::2]
        self.f32 = runtime.tensor(np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3),
                                  allocator=allocator)
        self.i64 = runtime.tensor(np.arange(6).reshape(2, 3), allocator=allocator)
        self.pool = runtime.ConstantPool(allocator)
        self.c = self.pool.constant(np.arange(4.0))
        self.tensors: dict[str, Tensor] = {}
        self.adopt(x=self.x, view=self.view, f32=self.f32, i64=self.i64, c=self.c)

    def adopt(self, **tensors: Tensor) -> None:
        """Add `tensors` to what must survive, and snapshot everything again."""
        self.tensors.update(tensors)
        self.data = {name: t.numpy() for name, t in self.tensors.items()}
        self.versions = {name: t.version for name, t in self.tensors.items()}
        self.live = [a.serial for a in self.allocator.live_allocations()]
        self.stats = in_use(self.allocator)
        self.pool_blocks = len(self.pool)

    def check_intact(self) -> None:
        """Assert that nothing made before the bad call was lost, written or leaked."""
        gc.collect()  # NOTE: temporaries of the failed call may sit in reference cycles
        for name, t in self.tensors.items():
            assert not t.released, f"{name} was released"
            np.testing.assert_array_equal(t.numpy(), self.data[name], err_msg=name)
            assert t.version == self.versions[name], f"{name} was written"
        assert [a.serial for a in self.allocator.live_allocations()] == self.live
        assert in_use(self.allocator) == self.stats
        assert len(self.pool) == self.pool_blocks
        self.allocator.check_invariants()
        self.pool.check_invariants()


@pytest.fixture(params=ALLOCATOR_KINDS)
def world(request) -> World:
    return World(allocators.create(request.param, "cpu"))


def raises_and_keeps(world: World, call: Callable[[World], Any], error: type, match: str) -> str:
    """Run `call(world)`, expecting `error` with a message matching `match`; then check that the
    world is intact. Returns the message."""
    with pytest.raises(error, match=match) as info:
        call(world)
    message = str(info.value)
    del info  # NOTE: its traceback holds the failed call's frames and their temporaries
    world.check_intact()
    return message


# ---------------------------------------------------------------------- the catalogue
def _empty(shape, dtype="float64"):
    """runtime.empty on the world's allocator."""
    return lambda w: runtime.empty(shape, dtype, allocator=w.allocator)


def _assign(key, value):
    """x[key] = value."""
    return lambda w: w.x.__setitem__(key, value)


DTYPE_CASES = [
    pytest.param(lambda w: ops.add(w.x[:2, :3], w.f32), TypeError,
                 parts("add: operands have different dtypes: float64 and float32"),
                 id="add-float64-float32"),
    pytest.param(lambda w: ops.matmul(w.i64, w.i64.T), TypeError,
                 parts("matmul: computes on float dtypes only", "got int64", "cast first"),
                 id="matmul-int64"),
    pytest.param(lambda w: ops.exp(w.i64), TypeError,
                 parts("exp: computes on float dtypes only", "got int64", "cast first"),
                 id="exp-int64"),
    pytest.param(lambda w: ops.add(w.x[:2, :3], 1.0, out=w.f32), TypeError,
                 parts("add: out has dtype float32, the result has dtype float64"),
                 id="out-dtype"),
    pytest.param(lambda w: ops.copy(w.i64, out=w.x[:2, :3]), TypeError,
                 parts("copy: out has dtype float64, the result has dtype int64"),
                 id="copy-into-other-dtype"),
    pytest.param(lambda w: ops.matmul(w.f32, w.f32.T, out=w.x[:2, :2]), TypeError,
                 parts("matmul: out has dtype float64, the result has dtype float32"),
                 id="out-dtype-matmul"),
    pytest.param(_empty(3, "complex64"), TypeError,
                 parts("dtype complex64 is not supported; use one of float32, float64, int32"),
                 id="empty-complex64"),
    pytest.param(_empty(3, "complex64"), TypeError, parts("dtype complex64 is not supported"),
                 id="empty-complex64"),
    pytest.param(_empty(3, "nonsense"), TypeError, parts("not a dtype: 'nonsense'"),
                 id="empty-not-a-dtype"),
    pytest.param(lambda w: runtime.tensor(np.ones(3, complex), allocator=w.allocator), TypeError,
                 parts("cannot make a tensor from data of dtype complex128"),
                 id="tensor-complex"),
    pytest.param(lambda w: runtime.tensor(["a", "b"], allocator=w.allocator), TypeError,
                 parts("cannot make a tensor from data of dtype <U1"), id="tensor-strings"),
    pytest.param(lambda w: runtime.tensor([1.0, 200.0], dtype="int8", allocator=w.allocator),
                 ValueError, parts("int8 from float64 data: 200.0 is outside the range of int8, "
                                   "[-128, 127]"), id="tensor-200-int8"),
    pytest.param(lambda w: runtime.tensor([1.0, 7e4], dtype="float16", allocator=w.allocator),
                 ValueError, parts("float16 from float64 data: 70000.0 is beyond the largest "
                                   "float16, 65504"), id="tensor-70000-float16"),
    pytest.param(_assign(0, "abc"), TypeError,
                 parts("value to assign to a tensor of float64", "dtype <U3"),
                 id="assign-string"),
    pytest.param(_assign(0, None), TypeError,
                 parts("value to assign to a tensor of float64", "dtype object"),
                 id="assign-None"),
    pytest.param(lambda w: w.i64.requires_grad_(), AutogradError,
                 parts("only float tensors can require gradients, not int64"),
                 id="requires-grad-int64"),
    pytest.param(lambda w: ops.cross_entropy(w.x, [0.0, 1.0, 2.0]), TypeError,
                 parts("cross_entropy: labels must be integer class indices, got float64"),
                 id="cross-entropy-float-labels"),
    pytest.param(lambda w: ops.add(w.x, "1"), TypeError,
                 parts("add: operands must be Tensors or real numbers, got str"),
                 id="add-string-operand"),
    pytest.param(lambda w: ops.mul(w.x, np.ones(4)), TypeError,
                 parts("mul: operands must be Tensors or real numbers, got ndarray"),
                 id="mul-ndarray-operand"),
    pytest.param(lambda w: ops.add(1.0, 2.0), TypeError,
                 parts("add: needs at least one Tensor operand, got float, float"),
                 id="add-no-tensor"),
]

SHAPE_CASES = [
    pytest.param(lambda w: ops.add(w.x, runtime.tensor(np.ones(3), allocator=w.allocator)),
                 ValueError, parts("add: shapes (3, 4) and (3,) cannot be broadcast together"),
                 id="broadcast"),
    pytest.param(lambda w: ops.matmul(w.x, w.x), ValueError,
                 parts("matmul: shapes (3, 4) and (3, 4) do not align: 4 (last dim of a) != 3 "
                       "(dim -2 of b)"), id="matmul-inner-dim"),
    pytest.param(lambda w: ops.matmul(w.c[:3], w.x.T), ValueError,
                 parts("matmul: shapes (3,) and (4, 3) do not align: 3 (last dim of a) != 4 "
                       "(dim -2 of b)"), id="matmul-vector"),
    pytest.param(lambda w: ops.matmul(w.x[0, 0], w.x), ValueError,
                 parts("matmul: operands must have at least one dimension, got shapes () and "
                       "(3, 4)"), id="matmul-0d"),
    pytest.param(lambda w: ops.matmul(w.x.reshape(3, 1, 4), w.x[:2].reshape(2, 4, 1)),
                 ValueError, parts("matmul: batch dimensions (3,) and (2,) cannot be broadcast"),
                 id="matmul-batch"),
    pytest.param(lambda w: ops.add(w.x, w.x, out=w.view), ValueError,
                 parts("add: shapes (3, 4) and (3, 4) and (3, 2) cannot be broadcast together "
                       "(the last is out)"), id="out-shape-elementwise"),
    pytest.param(lambda w: ops.neg(w.x, out=w.x[:, :, None]), ValueError,
                 parts("neg: shapes (3, 4) and (3, 4, 1) cannot be broadcast together"),
                 id="out-shape-extra-axis"),
    pytest.param(lambda w: ops.matmul(w.x, w.x.T, out=w.view), ValueError,
                 parts("matmul: out has shape (3, 2), the result has shape (3, 3)"),
                 id="out-shape-matmul"),
    pytest.param(lambda w: ops.sum(w.x, axis=0, out=w.view[:, 0]), ValueError,
                 parts("sum: out has shape (3,), the result has shape (4,)"),
                 id="out-shape-sum"),
    pytest.param(lambda w: ops.mean(w.x, out=w.x[0]), ValueError,
                 parts("mean: out has shape (4,), the result has shape ()"),
                 id="out-shape-mean"),
    pytest.param(lambda w: w.x.reshape(5, 2), ValueError,
                 parts("cannot reshape 12 elements (3, 4) into (5, 2) (10 elements)"),
                 id="reshape-count"),
    pytest.param(lambda w: w.x.reshape(-1, 5), ValueError,
                 parts("cannot reshape 12 elements (3, 4) into (-1, 5)"), id="reshape-infer"),
    pytest.param(lambda w: w.x.reshape(-1, -1), ValueError,
                 parts("can only infer one dimension of (-1, -1)"), id="reshape-two-unknown"),
    pytest.param(lambda w: w.x.reshape(2, 1.5), TypeError,
                 parts("non-integer dimension 1.5"), id="reshape-float"),
    pytest.param(lambda w: w.x.transpose(0, 0), ValueError,
                 parts("axes (0, 0) are not a permutation of the 2 axes"), id="transpose"),
    pytest.param(lambda w: runtime.view(w.x, (2, 2), offset=10), ValueError,
                 parts("a view of 4 elements (2, 2) at offset 10 does not fit in a source of 12 "
                       "elements"), id="view-past-end"),
    pytest.param(lambda w: runtime.view(w.x, (2,), offset=-1), ValueError,
                 parts("a view of 2 elements (2,) at offset -1 does not fit"),
                 id="view-negative-offset"),
    pytest.param(lambda w: runtime.view(w.x, (2,), offset=1.0), TypeError,
                 parts("offset counts elements and must be an int, got 1.0"), id="view-float"),
    pytest.param(lambda w: runtime.view(w.view, (2,)), ValueError,
                 parts("view() needs a contiguous source; this one has shape (3, 2) and strides "
                       "(4, 2)"), id="view-non-contiguous"),
    pytest.param(lambda w: runtime.view(np.ones(4), (2,)), TypeError,
                 parts("view() needs a Tensor source, got ndarray"), id="view-of-ndarray"),
    pytest.param(_assign(0, np.ones(5)), ValueError,
                 parts("shapes (5,) and (4,) cannot be broadcast together (the last is out)"),
                 id="assign-shape"),
    pytest.param(_assign(0, [[1.0, 2.0], [3.0]]), ValueError,
                 parts("cannot make a value to assign to a tensor of float64 from list",
                       "inhomogeneous"), id="assign-ragged"),
    pytest.param(lambda w: runtime.tensor([[1.0, 2.0], [3.0]], allocator=w.allocator),
                 ValueError, parts("cannot make a tensor from list [[1.0, 2.0], [3.0]]"),
                 id="tensor-ragged"),
    pytest.param(lambda w: ops.linear(w.x, w.x.T), ValueError,
                 parts("linear: x of shape (3, 4) needs a last dimension equal to in_features",
                       "the weight has shape (4, 3)"), id="linear-weight"),
    pytest.param(lambda w: ops.linear(w.x, w.x[:2], w.c), ValueError,
                 parts("linear: bias has shape (4,), expected (2,)"), id="linear-bias"),
    pytest.param(lambda w: ops.cross_entropy(w.x, [0, 1]), ValueError,
                 parts("cross_entropy: labels have shape (2,), expected (3,) for logits of "
                       "shape (3, 4)"), id="cross-entropy-label-shape"),
    pytest.param(lambda w: ops.cross_entropy(w.x, [0, 1, 4]), ValueError,
                 parts("cross_entropy: label 4 is outside [0, 4) for 4 classes"),
                 id="cross-entropy-label-range"),
    pytest.param(lambda w: ops.cross_entropy(w.c, [0]), ValueError,
                 parts("cross_entropy: logits must be (rows, classes), got shape (4,)"),
                 id="cross-entropy-1d-logits"),
    pytest.param(lambda w: w.x.item(), ValueError,
                 parts("item() needs a tensor of one element, this one has 12 (shape (3, 4))"),
                 id="item"),
    pytest.param(lambda w: len(w.x[0, 0]), TypeError, parts("len() of a 0-d tensor"),
                 id="len-0d"),
    pytest.param(lambda w: ops.sum(ops.mul(w.x, 2.0)).backward(), AutogradError,
                 parts("backward() on a tensor that does not require grad (shape (), float64"),
                 id="backward-no-grad"),
]

AXIS_AND_INDEX_CASES = [
    pytest.param(lambda w: ops.sum(w.x, axis=2), ValueError,
                 parts("sum: axis 2 is out of range for a 2-dimensional tensor"), id="axis-2"),
    pytest.param(lambda w: ops.mean(w.x, axis=-3), ValueError,
                 parts("mean: axis -3 is out of range for a 2-dimensional tensor"),
                 id="axis-minus-3"),
    pytest.param(lambda w: ops.sum(w.x, axis=(0, -2)), ValueError,
                 parts("sum: axis (0, -2) repeats an axis"), id="axis-repeated"),
    pytest.param(lambda w: ops.sum(w.x, axis=1.0), TypeError,
                 parts("sum: axis must be an int or a tuple of ints, got 1.0"), id="axis-float"),
    pytest.param(lambda w: ops.mean(w.x, axis="0"), TypeError,
                 parts("mean: axis must be an int or a tuple of ints, got '0'"), id="axis-str"),
    pytest.param(lambda w: w.x[3], IndexError,
                 parts("index 3 is out of bounds for axis 0 with size 3"), id="index-3"),
    pytest.param(lambda w: w.x[0, -5], IndexError,
                 parts("index -5 is out of bounds for axis 1 with size 4"), id="index-minus-5"),
    pytest.param(lambda w: w.x[0, 0, 0], IndexError,
                 parts("too many indices: tensor is 2-dimensional, but 3 were indexed"),
                 id="index-too-many"),
    pytest.param(lambda w: w.x[[0, 1]], TypeError,
                 parts("unsupported index [0, 1]: tensors take ints, slices, None and '...'"),
                 id="index-list"),
    pytest.param(lambda w: w.x[1.0], TypeError, parts("unsupported index 1.0"),
                 id="index-float"),
    pytest.param(lambda w: w.x[True], TypeError, parts("unsupported index True"),
                 id="index-bool"),
    pytest.param(lambda w: w.x[..., ...], IndexError, parts("single ellipsis"),
                 id="index-two-ellipses"),
    pytest.param(lambda w: w.x[::0], ValueError, parts("slice step cannot be zero"),
                 id="slice-step-0"),
    pytest.param(_assign((0, 7), 1.0), IndexError,
                 parts("index 7 is out of bounds for axis 1 with size 4"), id="assign-index"),
]

SIZE_CASES = [
    pytest.param(_empty((2, -3)), ValueError, parts("shape (2, -3) has a negative dimension -3"),
                 id="empty-negative"),
    pytest.param(lambda w: runtime.zeros(-1, allocator=w.allocator), ValueError,
                 parts("shape (-1,) has a negative dimension -1"), id="zeros-negative"),
    pytest.param(_empty((2.0, 3)), TypeError,
                 parts("shape (2.0, 3) has a non-integer dimension 2.0"),
                 id="empty-float-dim"),
    pytest.param(_empty((2, True)), TypeError, parts("non-integer dimension True"),
                 id="empty-bool-dim"),
    pytest.param(_empty(None), TypeError,
                 parts("a shape is an int or a sequence of ints, got None"),
                 id="empty-None"),
    pytest.param(_empty("23"), TypeError,
                 parts("a shape is an int or a sequence of ints, got '23'"),
                 id="empty-str"),
    pytest.param(_empty({2: 3}), TypeError, parts("a shape is an int or a sequence of ints"),
                 id="empty-dict"),
    pytest.param(_empty((2**40, 2**40), "float32"), ValueError,
                 parts(f"shape {(2**40, 2**40)} of float32 needs {2**82} bytes",
                       f"more than the {MAX_NBYTES} bytes"), id="empty-huge"),
    pytest.param(lambda w: runtime.zeros((2**31, 2**31), allocator=w.allocator), ValueError,
                 parts(f"shape {(2**31, 2**31)} of float32 needs {2**64} bytes (16.00 EiB)"),
                 id="zeros-huge"),
    pytest.param(lambda w: runtime.ones(2**62, "float64", allocator=w.allocator), ValueError,
                 parts(f"shape {(2**62,)} of float64 needs {2**65} bytes"), id="ones-huge"),
    # a huge shape that can be addressed is lazy; the first write asks for the memory
    pytest.param(lambda w: ops.copy(w.x[0, 0], out=runtime.empty((2**29, 2**30), "float64",
                                                                 allocator=w.allocator)),
                 OutOfMemoryError, parts("out of memory on cpu: tried to allocate 4.00 EiB"),
                 id="write-huge-lazy"),
]

# Arguments that once reached Python or NumPy unchecked (a bare error from deep inside, a
# crash, or a silently changed value); each now names the call and the bad value.
ARGUMENT_CASES = [
    pytest.param(lambda w: Tensor(w.x.block, (12,), object), TypeError,
                 parts("Tensor: dtype object is not supported"), id="Tensor-object-dtype"),
    pytest.param(lambda w: Tensor(w.x.block, (12,), np.complex64), TypeError,
                 parts("Tensor: dtype complex64 is not supported"), id="Tensor-complex64"),
    pytest.param(lambda w: Tensor(w.x.block, (6,), "complex128"), TypeError,
                 parts("Tensor: dtype complex128 is not supported"), id="Tensor-complex"),
    pytest.param(lambda w: Tensor(w.x.block, (12.0,), "float64"), TypeError,
                 parts("Tensor: shape (12.0,) has a non-integer dimension 12.0"),
                 id="Tensor-float-shape"),
    pytest.param(lambda w: Tensor(w.x.block, (2, 3), "float64", (1,)), ValueError,
                 parts("Tensor: strides (1,) have 1 entries for the 2 dimensions of shape (2, 3)"),
                 id="Tensor-strides-length"),
    pytest.param(lambda w: Tensor(w.x.block, (2,), "float64", (1.5,)), TypeError,
                 parts("Tensor: strides (1.5,): a stride must be an int, got 1.5"),
                 id="Tensor-float-stride"),
    pytest.param(lambda w: Tensor(w.x.block, (2,), "float64", None, 1.0), TypeError,
                 parts("Tensor: offset must be an int, got 1.0"), id="Tensor-float-offset"),
    pytest.param(lambda w: Tensor(w.x.block, (2,), "float64", None, 11), ValueError,
                 parts("Tensor: a view of shape (2,), strides (1,) at offset 11 reaches elements "
                       "[11, 12]"), id="Tensor-past-the-block"),
    pytest.param(lambda w: Tensor("block", (2,), "float64"), TypeError,
                 parts("Tensor: block must be a runtime Block, got 'block' (str)"),
                 id="Tensor-not-a-block"),
    pytest.param(lambda w: w.x.reshape(12.0), TypeError,
                 parts("reshape: a shape is an int or a sequence of ints, got 12.0"),
                 id="reshape-bare-float"),
    pytest.param(lambda w: w.x.reshape(-2, -6), ValueError,
                 parts("reshape: shape (-2, -6) has a negative dimension -2"),
                 id="reshape-negative"),
    pytest.param(lambda w: w.x.transpose(1.0, 0.0), TypeError,
                 parts("transpose: axes (1.0, 0.0): an axis must be an int, got 1.0"),
                 id="transpose-floats"),
    pytest.param(lambda w: w.x.transpose(True, False), TypeError,
                 parts("transpose: axes (True, False): an axis must be an int, got True"),
                 id="transpose-bools"),
    pytest.param(lambda w: w.x.transpose(1.5), TypeError,
                 parts("transpose: axes are ints, or one tuple or list of ints; got 1.5"),
                 id="transpose-one-float"),
    pytest.param(lambda w: w.x[1.5:], TypeError,
                 parts("index: bad slice slice(1.5, None, None) for axis 0"), id="slice-float"),
    pytest.param(lambda w: ops.sum(w.x, keepdims="no"), TypeError,
                 parts("sum: keepdims must be True or False, got 'no' (str)"),
                 id="keepdims-str"),
    pytest.param(lambda w: ops.mean(w.x, axis=0, keepdims=1), TypeError,
                 parts("mean: keepdims must be True or False, got 1 (int)"), id="keepdims-int"),
    pytest.param(lambda w: ops.sum(w.x, axis=(0, 5)), ValueError,
                 parts("sum: axis 5 (of (0, 5)) is out of range for a 2-dimensional tensor"),
                 id="axis-in-tuple"),
    pytest.param(lambda w: ops.add(w.x, 10**400), ValueError,
                 parts("add: the number 1000000", "is beyond the largest float64"),
                 id="add-int-beyond-float64"),
    pytest.param(lambda w: ops.mul(w.f32, 1e300), ValueError,
                 parts("mul: the number 1e+300 is beyond the largest float32", "float64 tensor"),
                 id="mul-float32-overflow"),
    pytest.param(lambda w: ops.sub(-(10**400), w.x, out=w.x), ValueError,
                 parts("sub: the number -1000000", "is beyond the largest float64"),
                 id="sub-huge-into-out"),
    pytest.param(lambda w: ops.add(w.x, None), TypeError,
                 parts("add: operands must be Tensors or real numbers, got NoneType None"),
                 id="add-None"),
    pytest.param(lambda w: runtime.tensor([1e20], dtype="int32", allocator=w.allocator),
                 ValueError, parts("cannot make a tensor of int32 from float64 data: 1e+20 is "
                                   "outside the range of int32, [-2147483648, 2147483647]"),
                 id="tensor-1e20-int32"),
    pytest.param(lambda w: runtime.tensor(np.array([2**64 - 1], np.uint64), dtype="int64",
                                          allocator=w.allocator),
                 ValueError, parts("tensor of int64 from uint64 data: 18446744073709551615 is "
                                   "outside the range of int64"),
                 id="tensor-uint64-above-int64"),
    pytest.param(lambda w: runtime.tensor([2**63], dtype="int64", allocator=w.allocator),
                 ValueError,
                 parts("tensor of int64 from uint64 data: 9223372036854775808 is outside"),
                 id="tensor-python-int-2**63"),
    pytest.param(lambda w: runtime.tensor([2**70], allocator=w.allocator), ValueError,
                 parts("the integer 1180591620717411303424 is outside the range of int64"),
                 id="tensor-python-int-2**70"),
    pytest.param(lambda w: runtime.tensor([-1, 2**64 - 1], allocator=w.allocator), ValueError,
                 parts("the integer 18446744073709551615", "rounded it to 1.8446744073709552e+19"),
                 id="tensor-ints-of-both-signs"),
    pytest.param(lambda w: runtime.tensor([0.5, 2**60 + 1], dtype="int64",
                                          allocator=w.allocator),
                 ValueError, parts("the integer 1152921504606846977", "rounded it"),
                 id="tensor-int-among-floats"),
    pytest.param(lambda w: runtime.tensor([0.5, 2**53 + 1], allocator=w.allocator), ValueError,
                 parts("the integer 9007199254740993", "rounded it to 9007199254740992.0"),
                 id="tensor-2**53+1-among-floats"),
    pytest.param(lambda w: runtime.tensor([1.5], dtype="int64", allocator=w.allocator),
                 ValueError, parts("tensor of int64 from float64 data: 1.5 is not a whole number",
                                   "np.round"), id="tensor-fraction-to-int"),
    pytest.param(lambda w: runtime.tensor([np.nan], dtype="int64", allocator=w.allocator),
                 ValueError, parts("nan has no int64 value"), id="tensor-nan-to-int"),
    pytest.param(lambda w: runtime.tensor([300, -1], dtype="uint8", allocator=w.allocator),
                 ValueError, parts("uint8 from int64 data: -1 is outside the range of uint8, "
                                   "[0, 255]"), id="tensor-300-uint8"),
    pytest.param(lambda w: runtime.tensor([0, 2], dtype="bool", allocator=w.allocator),
                 ValueError, parts("bool from int64 data: 2 is neither 0 nor 1"),
                 id="tensor-2-to-bool"),
    pytest.param(lambda w: runtime.tensor([1e300], dtype="float32", allocator=w.allocator),
                 ValueError, parts("float32 from float64 data: 1e+300 is beyond the largest "
                                   "float32"), id="tensor-float32-overflow"),
    pytest.param(lambda w: runtime.tensor(np.complex64([1.5]), allocator=w.allocator), TypeError,
                 parts("from data of dtype complex64", "tensors hold real numbers"),
                 id="tensor-complex64"),
    pytest.param(lambda w: runtime.tensor(np.array([1, 2], object), allocator=w.allocator),
                 TypeError, parts("cannot make a tensor from data of dtype object"),
                 id="tensor-object-array"),
    pytest.param(lambda w: runtime.tensor(np.longdouble(1) / 3, allocator=w.allocator),
                 ValueError, parts("tensor of float64 from float128 data", "has no exact "
                                   "float64 value"), id="tensor-longdouble",
                 marks=pytest.mark.skipif(np.finfo(np.longdouble).nmant <= 52,
                                          reason="longdouble is float64 here")),
    pytest.param(lambda w: runtime.tensor([1.0], requires_grad="yes", allocator=w.allocator),
                 TypeError, parts("tensor: requires_grad must be True or False, got 'yes'"),
                 id="tensor-requires-grad-str"),
    pytest.param(lambda w: runtime.empty(3, requires_grad=None, allocator=w.allocator),
                 TypeError, parts("empty: requires_grad must be True or False, got None"),
                 id="empty-requires-grad-None"),
    pytest.param(lambda w: setattr(w.f32, "requires_grad", "no"), TypeError,
                 parts("requires_grad must be True or False, got 'no'"),
                 id="requires-grad-setter"),
    pytest.param(lambda w: w.i64.__setitem__(0, 1.5), ValueError,
                 parts("cannot make a value to assign to a tensor of int64 from float64 data: "
                       "1.5 is not a whole number"), id="assign-fraction-to-int"),
    pytest.param(lambda w: w.f32.__setitem__(0, 1e300), ValueError,
                 parts("value to assign to a tensor of float32", "1e+300 is beyond the largest "
                       "float32"), id="assign-float32-overflow"),
    pytest.param(lambda w: w.i64.__setitem__(0, 2**64 - 1), ValueError,
                 parts("value to assign to a tensor of int64", "18446744073709551615 is outside "
                       "the range of int64"), id="assign-uint64-to-int64"),
    pytest.param(lambda w: w.x.backward(retain_graph="yes"), TypeError,
                 parts("backward(): retain_graph must be True or False, got 'yes'"),
                 id="backward-retain-graph"),
]

FREED_CASES = [
    pytest.param(lambda w, t: t.numpy(), id="numpy"),
    pytest.param(lambda w, t: ops.add(t, 1.0), id="add"),
    pytest.param(lambda w, t: ops.add(w.x[0], 1.0, out=t), id="out"),
    pytest.param(lambda w, t: t[0], id="index"),
    pytest.param(lambda w, t: t.reshape(2, 2), id="reshape"),
    pytest.param(lambda w, t: t.T, id="transpose"),
    pytest.param(lambda w, t: t.__setitem__(0, 1.0), id="assign"),
    pytest.param(lambda w, t: runtime.view(t, (2,)), id="view"),
    pytest.param(lambda w, t: np.from_dlpack(t), id="dlpack"),
]


@pytest.mark.parametrize(("call", "error", "match"),
                         DTYPE_CASES + SHAPE_CASES + AXIS_AND_INDEX_CASES + SIZE_CASES
                         + ARGUMENT_CASES)
def test_bad_arguments_raise_a_clear_error_and_lose_nothing(world, call, error, match):
    raises_and_keeps(world, call, error, match)


# ---------------------------------------------------------------------- bad out=
def test_out_that_is_not_a_tensor(world):
    raises_and_keeps(world, lambda w: ops.add(w.x, 1.0, out=np.empty((3, 4))), TypeError,
                     parts("add: out must be a Tensor, got ndarray"))


def test_out_that_overlaps_itself(world):
    # a row repeated by a zero stride: two elements of out share memory
    scratch = runtime.tensor(np.zeros(4), allocator=world.allocator)
    world.adopt(scratch=scratch)
    repeated = Tensor(scratch.block, (3, 4), scratch.dtype, strides=(0, 1))
    raises_and_keeps(world, lambda w: ops.add(w.x, 1.0, out=repeated), ValueError,
                     parts("add: out has internally overlapping memory (strides (0, 1))"))


def test_out_that_requires_grad():
    x = runtime.tensor(np.ones(3), requires_grad=True)
    out = runtime.zeros(3, "float64")
    with pytest.raises(AutogradError, match=parts("add: cannot write into out= while recording "
                                                  "gradients", "(shape (3,))")):
        ops.add(x, 1.0, out=out)
    np.testing.assert_array_equal(out.numpy(), np.zeros(3))
    assert x.grad is None


def test_an_overlapping_out_in_raise_mode_is_refused_and_writes_nothing(world):
    runtime.set_aliasing("raise")  # conftest restores "copy"
    square = runtime.tensor(np.arange(16.0).reshape(4, 4), allocator=world.allocator)
    before = square.numpy()
    with pytest.raises(AliasingError, match=parts("matmul: the output", "overlaps input a",
                                                  "may not share memory with any input")):
        ops.matmul(square, square, out=square)
    np.testing.assert_array_equal(square.numpy(), before)
    square.release()
    world.check_intact()


# ---------------------------------------------------------------------- autograd misuse
def _modified_after_save(w: runtime.Tensor) -> None:
    y = ops.exp(w)
    with runtime.no_grad():
        y[0] = 5.0
    ops.sum(y).backward()


def _backward_twice(w: runtime.Tensor) -> None:
    loss = ops.sum(ops.exp(w))
    loss.backward()
    w.grad = None
    loss.backward()


@pytest.mark.parametrize(("call", "match"), [
    pytest.param(lambda w: ops.exp(w).backward(), parts(
        "backward() without a gradient needs a scalar (one element) output, this one has shape "
        "(3,)"), id="non-scalar"),
    pytest.param(lambda w: ops.exp(w).backward(runtime.tensor(np.ones(2))), parts(
        "backward(): gradient has shape (2,) and dtype float64; the output has shape (3,)"),
        id="gradient-shape"),
    pytest.param(_modified_after_save, parts(
        "a tensor needed to compute gradients was modified in place: the output of exp (shape "
        "(3,), float64", "is at version 2, but version 1 was saved"), id="modified-after-save"),
    pytest.param(_backward_twice, parts("backward through the graph of sum a second time",
                                        "retain_graph=True"), id="twice"),
    pytest.param(lambda w: w.__setitem__(0, 2.0), parts(
        "item assignment is not recorded by autograd", "(target shape (3,))"), id="assign"),
])
def test_autograd_misuse_names_the_problem(world, call, match):
    w = runtime.tensor(np.arange(3.0), requires_grad=True, allocator=world.allocator)
    world.adopt(w=w)
    raises_and_keeps(world, lambda _: call(w), AutogradError, match)
    assert w.grad is None


# ---------------------------------------------------------------------- sizes at the allocator
def _allocator(kind: str) -> allocators.Allocator:
    if kind == "statistics(direct)":
        return allocators.StatisticsAdaptor(allocators.create("direct"))
    if kind == "limit(caching)":
        return allocators.LimitAdaptor(allocators.create("caching"), 1 << 20)
    return allocators.create(kind)


ALLOCATORS = [*ALLOCATOR_KINDS, "statistics(direct)", "limit(caching)",
              *(["buddy"] if "buddy" in allocators.names() else [])]


@pytest.mark.parametrize("kind", ALLOCATORS)
@pytest.mark.parametrize(("nbytes", "error", "match"), [
    pytest.param(-1, ValueError, parts("allocation size must be >= 0 bytes, got -1"), id="-1"),
    pytest.param(np.int64(-3), ValueError, parts("must be >= 0 bytes, got -3"), id="np-int-3"),
    pytest.param(1.5, TypeError, parts("must be an integer number of bytes, got 1.5 of type float"),
                 id="float"),
    pytest.param(8.0, TypeError, parts("got 8.0 of type float"), id="integral-float"),
    pytest.param(True, TypeError, parts("got True of type bool"), id="bool"),
    pytest.param("8", TypeError, parts("got '8' of type str"), id="str"),
    pytest.param(None, TypeError, parts("got None of type NoneType"), id="None"),
    pytest.param(2**70, OutOfMemoryError, parts("tried to allocate 1.00 ZiB"), id="2**70"),
    pytest.param(2**64, OutOfMemoryError, parts("tried to allocate 16.00 EiB"), id="2**64"),
])
def test_bad_sizes_at_the_allocator(kind, nbytes, error, match):
    alloc = _allocator(kind)
    kept = alloc.allocate(100)
    before = alloc.stats()
    with pytest.raises(error, match=match):
        alloc.allocate(nbytes)
    after = alloc.stats()
    assert {k: after[k] for k in IN_USE} == {k: before[k] for k in IN_USE}
    assert after["num_allocs"] == before["num_allocs"]
    assert after["num_ooms"] == before["num_ooms"] + (error is OutOfMemoryError)
    assert alloc.live_allocations() == [kept]
    alloc.check_invariants()
    alloc.free(kept)
    assert alloc.stats()["allocated_bytes"] == 0


def test_out_of_memory_in_an_op_names_the_limit_and_loses_nothing():
    alloc = allocators.LimitAdaptor(allocators.create("caching"), 2048)
    world = World(alloc)  # about 1.8 KiB in use: no room for one more 96-byte result
    room = 2048 - alloc.stats()["allocated_bytes"]
    shape = (room // 8 + 1,)
    source = runtime.empty(shape, "float64", allocator=alloc)
    raises_and_keeps(world, lambda w: ops.copy(w.c[0], out=source), OutOfMemoryError,
                     parts(f"tried to allocate {shape[0] * 8} B", "limit 2.00 KiB"))
    raises_and_keeps(world, lambda w: runtime.tensor(np.ones(shape), allocator=alloc),
                     OutOfMemoryError, parts("limit 2.00 KiB"))


# ---------------------------------------------------------------------- use after free
@pytest.mark.parametrize("use", FREED_CASES)
def test_a_released_tensor_refuses_every_use(world, use):
    t = runtime.tensor(np.arange(4.0), allocator=world.allocator)
    sibling = t[1:]
    t.release()
    world.adopt(sibling=sibling)  # it keeps the block's memory
    raises_and_keeps(world, lambda w: use(w, t), UseAfterFreeError,
                     r"the tensor was released and can no longer be used \(shape \(4,\), "
                     rf"block #{t.block.id}\)")
    np.testing.assert_array_equal(sibling.numpy(), [1.0, 2.0, 3.0])


@pytest.mark.parametrize("use", FREED_CASES)
def test_a_view_of_a_freed_block_refuses_every_use(world, use):
    t = runtime.tensor(np.arange(4.0), allocator=world.allocator)
    block = t.block
    block.free()  # every handle goes stale; the memory is back at once
    assert in_use(world.allocator) == world.stats
    raises_and_keeps(world, lambda w: use(w, t), UseAfterFreeError,
                     parts(f"uses block #{block.id} (32 B) after its memory was freed (handle "
                           f"generation 0, block generation 1)"))


def test_reading_a_tensor_never_written(world):
    fresh = runtime.empty((2, 2), "float64", allocator=world.allocator)
    raises_and_keeps(world, lambda w: fresh.numpy(), UninitializedMemoryError,
                     parts(f"numpy() reads block #{fresh.block.id} (32 B) before anything was "
                           f"written to it"))
    assert not fresh.block.allocated


# ---------------------------------------------------------------------- foreign allocations
PAIRS = [(a, b) for a in ALLOCATORS for b in ALLOCATORS
         if "(" not in a and "(" not in b]


@pytest.mark.parametrize(("owner_kind", "other_kind"), PAIRS)
def test_freeing_another_allocators_allocation(owner_kind, other_kind):
    owner, other = _allocator(owner_kind), _allocator(other_kind)
    foreign = owner.allocate(1000)
    own = other.allocate(1000)  # NOTE: serial #1 in both allocators
    assert foreign.serial == own.serial == 1
    stats = owner.stats(), other.stats()
    message = parts("invalid free: allocation #1 of 1000 B belongs to another allocator, "
                    f"<{type(owner).__name__} on cpu", f"not to this one, <{type(other).__name__}",
                    "free it through its owner")
    with pytest.raises(InvalidFreeError, match=message):
        other.free(foreign)
    assert (owner.stats(), other.stats()) == stats
    assert foreign.live and own.live
    assert owner.live_allocations() == [foreign] and other.live_allocations() == [own]
    owner.check_invariants()
    other.check_invariants()
    owner.free(foreign)
    other.free(own)
    assert owner.stats()["allocated_bytes"] == other.stats()["allocated_bytes"] == 0


def test_two_allocators_of_one_kind_are_told_apart():
    first, second = allocators.create("direct"), allocators.create("direct")
    allocation = first.allocate(16)
    with pytest.raises(InvalidFreeError, match=rf"at {id(first):#x}, not to this one, "
                                               rf"<DirectAllocator on cpu> at {id(second):#x}"):
        second.free(allocation)
    first.free(allocation)


@pytest.mark.parametrize("kind", ALLOCATORS)
def test_double_free_and_non_allocations(kind):
    alloc = _allocator(kind)
    kept, gone = alloc.allocate(64), alloc.allocate(64)
    alloc.free(gone)
    before = alloc.stats()
    with pytest.raises(InvalidFreeError, match=parts(f"double free: allocation #{gone.serial} of "
                                                     "64 B was already freed")):
        alloc.free(gone)
    for bad in (None, object(), 4096):
        with pytest.raises(TypeError, match=parts("free() takes an Allocation, got "
                                                  f"{type(bad).__name__}")):
            alloc.free(bad)
    assert alloc.stats() == before
    assert alloc.live_allocations() == [kept]
    alloc.check_invariants()


def test_an_adaptor_refuses_its_upstreams_allocation():
    upstream = allocators.create("caching")
    adaptor = allocators.StatisticsAdaptor(upstream)
    mine = adaptor.allocate(64)
    theirs = upstream.allocate(64)
    before = adaptor.stats(), upstream.stats()
    with pytest.raises(InvalidFreeError, match="belongs to another allocator"):
        adaptor.free(theirs)
    with pytest.raises(InvalidFreeError, match="belongs to another allocator"):
        upstream.free(mine)
    assert (adaptor.stats(), upstream.stats()) == before
    adaptor.free(mine)
    upstream.free(theirs)
    upstream.check_invariants()


# ---------------------------------------------------------------------- writes to constants
READ_ONLY = parts("writes to read-only block #", "(32 B): constants are immutable; copy one with "
                  "runtime.ops.copy()")


@pytest.mark.parametrize("write", [
    pytest.param(lambda w: ops.neg(w.x[0], out=w.c), id="out"),
    pytest.param(lambda w: ops.add(w.c, 1.0, out=w.c), id="out-in-place"),
    pytest.param(lambda w: ops.add(w.c[::2], 1.0, out=w.c[::2]), id="out-view"),
    pytest.param(lambda w: ops.copy(w.x[1], out=w.c), id="copy-into"),
    pytest.param(lambda w: w.c.__setitem__(0, 5.0), id="assign"),
    pytest.param(lambda w: w.c.__setitem__(slice(None), w.x[2]), id="assign-tensor"),
    pytest.param(lambda w: w.c[1:].__setitem__(0, 5.0), id="assign-through-view"),
    pytest.param(lambda w: w.c.reshape(2, 2).__setitem__((1, 1), 5.0), id="assign-reshaped"),
    pytest.param(lambda w: runtime.view(w.c, (2,), offset=2).__setitem__(0, 5.0),
                 id="assign-through-runtime-view"),
])
def test_writes_to_a_constant_are_refused(world, write):
    message = raises_and_keeps(world, write, ReadOnlyError, READ_ONLY)
    assert f"#{world.c.block.id} " in message
    assert world.c.block.readonly


# ---------------------------------------------------------------------- mixed devices
def _second_cpu() -> allocators.Allocator:
    """An allocator on a second NumPy device: also named "cpu", but another Device."""
    device = NumpyDevice(0)
    assert device is not backends.get_device("cpu") and device.name == "cpu"
    return allocators.create("direct", device)


TWO_CPUS = r"cpu \(Device instance 0x[0-9a-f]+\)", r"cpu \(another Device instance, 0x[0-9a-f]+\)"
A_CPU = r"cpu \((?:another )?Device instance,? 0x[0-9a-f]+\)"


@pytest.mark.parametrize(("call", "match"), [
    pytest.param(lambda w, o: ops.add(w.x, o), "add: operands are on different devices: "
                 "{0} and {1}; copy one over first", id="add"),
    pytest.param(lambda w, o: ops.matmul(w.x, o.T), "matmul: operands are on different devices: "
                 "{0} and {1}", id="matmul"),
    pytest.param(lambda w, o: ops.add(w.x, w.x, out=o), "add: out is on {1}, the inputs on {0}",
                 id="out"),
    pytest.param(lambda w, o: w.x.__setitem__(slice(None), o), "copy: out is on {0}, the "
                 "inputs on {1}", id="assign"),
    pytest.param(lambda w, o: runtime.tensor([1.0], device="cpu", allocator=o.block.allocator),
                 r"allocator <DirectAllocator on cpu> is on {1}, but device {0} was asked for",
                 id="tensor-allocator"),
    pytest.param(lambda w, o: ops.cross_entropy(w.x, runtime.tensor(
                 np.zeros(3, np.int64), allocator=o.block.allocator)),
                 "cross_entropy: labels are on {1}, logits on {0}", id="labels"),
])
def test_two_numpy_devices_do_not_mix(world, call, match):
    other = runtime.tensor(np.ones((3, 4)), allocator=_second_cpu())
    message = raises_and_keeps(world, lambda w: call(w, other), ValueError,
                               match.format(A_CPU, A_CPU))
    # NOTE: both "cpu" devices are named, told apart by their ids; {0} is the world's device
    here, there = f"{id(world.x.device):#x}", f"{id(other.device):#x}"
    assert here in message and there in message, message
    assert (message.index(here) < message.index(there)) == (match.index("{0}") <
                                                              match.index("{1}"))
    np.testing.assert_array_equal(other.numpy(), np.ones((3, 4)))


def test_set_default_allocator_on_another_device_changes_nothing(monkeypatch):
    monkeypatch.delattr(backends.get_device("cpu"), config._ALLOCATOR, raising=False)
    default = runtime.get_default_allocator("cpu")
    foreign = _second_cpu()
    with pytest.raises(ValueError, match=r"allocator <DirectAllocator on cpu> lives on "
                                         rf"{TWO_CPUS[0]}, not on {TWO_CPUS[1]}"):
        runtime.set_default_allocator(foreign, "cpu")
    assert runtime.get_default_allocator("cpu") is default


def _opencl() -> backends.Device:
    pytest.importorskip("pyopencl", reason="pyopencl is not installed")
    if "opencl" not in backends.available():
        pytest.skip("pyopencl finds no OpenCL device here")
    return backends.get_device("opencl")


@pytest.mark.parametrize(("call", "match"), [
    pytest.param(lambda w, g: ops.add(w.x, g), parts("add: operands are on different devices: "
                                                     "cpu and opencl:0"), id="add"),
    pytest.param(lambda w, g: ops.matmul(g, w.x.T), parts("matmul: operands are on different "
                                                          "devices: opencl:0 and cpu"),
                 id="matmul"),
    pytest.param(lambda w, g: ops.add(g, g, out=w.x), parts("add: out is on cpu, the inputs on "
                                                            "opencl:0"), id="out-on-cpu"),
    pytest.param(lambda w, g: w.x.__setitem__(slice(None), g), parts("copy: out is on cpu, the "
                                                                     "inputs on opencl:0"),
                 id="assign"),
    pytest.param(lambda w, g: runtime.tensor([1.0], device="opencl", allocator=w.allocator),
                 parts("is on cpu, but device opencl:0 was asked for"), id="tensor-allocator"),
])
def test_numpy_and_opencl_do_not_mix(world, call, match):
    gpu = runtime.tensor(np.ones((3, 4)), device=_opencl())
    raises_and_keeps(world, lambda w: call(w, gpu), ValueError, match)
    np.testing.assert_array_equal(gpu.numpy(), np.ones((3, 4)))


# ---------------------------------------------------------------------- unknown names
def test_an_unknown_allocator_name_lists_the_known_ones():
    known = allocators.names()
    for call in (lambda: allocators.create("bogus", "cpu"),
                 lambda: runtime.set_default_allocator("bogus")):
        with pytest.raises(ValueError, match=r"unknown allocator 'bogus'; known: ") as info:
            call()
        assert str(info.value).endswith(", ".join(known))


@pytest.mark.parametrize(("call", "error", "match"), [
    pytest.param(lambda: allocators.create(3), TypeError,
                 parts("an allocator name is a string, got int"), id="create-int"),
    pytest.param(lambda: allocators.create("direct", bogus=1), TypeError,
                 parts("unexpected keyword argument 'bogus'"), id="create-bad-option"),
    pytest.param(lambda: allocators.create("caching", size_classes="bogus"), ValueError,
                 parts("unknown size classes 'bogus'; known: granule, pow2, mantissa"),
                 id="size-classes"),
    pytest.param(lambda: allocators.create("caching", segments="bogus"), ValueError,
                 parts("segments must be one of ('exact', 'pytorch'), got 'bogus'"),
                 id="segments"),
    pytest.param(lambda: allocators.create("caching", max_cached_bytes=-1), ValueError,
                 parts("max_cached_bytes must be >= 0 bytes, got -1"), id="max-cached"),
    pytest.param(lambda: allocators.create("caching", limit_bytes=1.5), TypeError,
                 parts("limit_bytes must be an integer number of bytes, got 1.5"), id="limit"),
    pytest.param(lambda: allocators.LimitAdaptor(allocators.create("direct"), -5), ValueError,
                 parts("limit_bytes must be >= 0 bytes, got -5"), id="limit-adaptor"),
    pytest.param(lambda: allocators.StatisticsAdaptor("direct"), TypeError,
                 parts("StatisticsAdaptor wraps an allocators.Allocator, got str"),
                 id="adaptor-of-a-name"),
    pytest.param(lambda: allocators.register("", allocators.DirectAllocator), ValueError,
                 parts("an allocator name cannot be empty"), id="register-empty"),
    pytest.param(lambda: allocators.register("x", 5), TypeError,
                 parts("the factory for allocator 'x' must be callable, got 5"),
                 id="register-not-callable"),
    pytest.param(lambda: allocators.create("direct", "nonsense"), ValueError,
                 parts("unknown device 'nonsense'; known backends: cpu, cuda, opencl"),
                 id="create-on-unknown-device"),
    pytest.param(lambda: backends.get_device("bogus"), ValueError,
                 parts("unknown device 'bogus'; known backends: cpu, cuda, opencl"),
                 id="device-bogus"),
    pytest.param(lambda: backends.get_device("cpu:5"), ValueError,
                 parts("device 'cpu:5' does not exist: backend 'cpu' has 1 device(s), "
                       "indices 0..0"), id="device-index"),
    pytest.param(lambda: backends.get_device("cpu:x"), ValueError,
                 parts("device index in 'cpu:x' must be a non-negative integer"),
                 id="device-index-x"),
    pytest.param(lambda: backends.get_device(0), TypeError,
                 parts("a device spec is a string such as 'cpu' or 'opencl:1', got 0 of type "
                       "int"), id="device-int"),
    pytest.param(lambda: runtime.set_default_allocator(3), TypeError,
                 parts("set_default_allocator takes a name or an Allocator, got int"),
                 id="default-allocator-int"),
    pytest.param(lambda: runtime.tensor([1.0], allocator="direct"), TypeError,
                 parts("allocator must be an allocators.Allocator, got str"),
                 id="tensor-allocator-name"),
    pytest.param(lambda: runtime.set_aliasing("bogus"), ValueError,
                 parts("aliasing mode must be one of ('copy', 'raise'), got 'bogus'"),
                 id="aliasing-mode"),
    pytest.param(lambda: runtime.from_dlpack([1, 2]), TypeError,
                 parts("from_dlpack needs an object with __dlpack__ and __dlpack_device__, got "
                       "list"), id="from-dlpack"),
])
def test_unknown_names_and_bad_options(call, error, match):
    registered = allocators.names()
    with pytest.raises(error, match=match):
        call()
    assert allocators.names() == registered  # a failed register or create registers nothing
    assert runtime.get_aliasing() == "copy"


# ---------------------------------------------------------------------- graph arguments
def _step(x):
    return ops.add(x, 1.0)


@pytest.mark.parametrize(("make", "error", "match"), [
    pytest.param(lambda: runtime.graph(_step, plan="bogus"), ValueError,
                 parts("plan must be one of ('none', 'recycle', 'static'), got 'bogus'"),
                 id="plan"),
    pytest.param(lambda: runtime.graph(_step, plan=None), ValueError,
                 parts("plan must be one of ('none', 'recycle', 'static'), got None"),
                 id="plan-None"),
    pytest.param(lambda: runtime.graph(_step, checkpoint="bogus"), ValueError,
                 parts("checkpoint must be one of (None, 'sqrt', 'pointwise'), got 'bogus'"),
                 id="checkpoint"),
    pytest.param(lambda: runtime.graph(_step, checkpoint=3), ValueError,
                 parts("checkpoint must be one of (None, 'sqrt', 'pointwise'), got 3"),
                 id="checkpoint-int"),
    pytest.param(lambda: runtime.graph(42), TypeError,
                 parts("graph() needs a callable, got int"), id="fn-not-callable"),
])
def test_bad_graph_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make()


# ---------------------------------------------------------------------- environment values
@pytest.fixture
def fresh_config(monkeypatch):
    """No default device or allocator chosen yet, as in a process that just started."""
    monkeypatch.setitem(config._state, "device", None)
    with helpers.fresh_defaults():
        yield


@pytest.mark.parametrize(("environ", "error", "match"), [
    pytest.param({"BLOCKRT_DEVICE": "nonsense"}, ValueError,
                 parts("environment variable BLOCKRT_DEVICE='nonsense': unknown device "
                       "'nonsense'; known backends: cpu, cuda, opencl"), id="device-nonsense"),
    pytest.param({"BLOCKRT_DEVICE": "cpu:7"}, ValueError,
                 parts("environment variable BLOCKRT_DEVICE='cpu:7': device 'cpu:7' does not "
                       "exist: backend 'cpu' has 1 device(s)"), id="device-index"),
    pytest.param({"BLOCKRT_DEVICE": "cpu:-1"}, ValueError,
                 parts("BLOCKRT_DEVICE='cpu:-1': device index in 'cpu:-1' must be a "
                       "non-negative integer"), id="device-negative-index"),
    pytest.param({"BLOCKRT_DEVICE": "cuda"}, backends.BackendUnavailableError,
                 parts("environment variable BLOCKRT_DEVICE='cuda': backend 'cuda' "),
                 marks=pytest.mark.skipif("cuda" in backends.available(),
                                          reason="CUDA is available here"),
                 id="device-unavailable"),
    pytest.param({"BLOCKRT_ALLOCATOR": "bogus"}, ValueError,
                 parts("environment variable BLOCKRT_ALLOCATOR is 'bogus', which names no "
                       f"allocator; known: {', '.join(allocators.names())}"),
                 id="allocator-bogus"),
])
def test_bad_environment_values_name_the_variable(fresh_config, monkeypatch, environ, error,
                                                  match):
    monkeypatch.setattr(config, "SETTINGS", config.Settings.from_environ(environ))
    kept = runtime.tensor(np.arange(3.0), device="cpu", allocator=allocators.create("direct"))
    calls = [lambda: runtime.tensor([1.0]), lambda: runtime.zeros(2)]
    if "BLOCKRT_ALLOCATOR" in environ:
        # NOTE: constants live in read-only memory from an allocator of their pool's own
        np.testing.assert_array_equal(runtime.constant(np.ones(2)).numpy(), np.ones(2))
    else:
        calls.append(lambda: runtime.constant(np.ones(2)))
    for call in calls:
        with pytest.raises(error, match=match):
            call()
    assert config._state["device"] is None or "BLOCKRT_ALLOCATOR" in environ
    assert config.default_allocators() == {}  # nothing half-made is kept
    np.testing.assert_array_equal(kept.numpy(), np.arange(3.0))
    runtime.set_default_device("cpu")  # the way out works
    runtime.set_default_allocator("direct")
    assert runtime.tensor([1.0]).numpy().tolist() == [1.0]


def _python(code: str, **environ: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh Python with this checkout importable, no BLOCKRT_* variable from
    our environment, and `environ` added."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLOCKRT_")}
    env.update(environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.mark.parametrize(("variable", "value", "match"), [
    ("BLOCKRT_DEVICE", "nonsense", "environment variable BLOCKRT_DEVICE='nonsense': unknown "
                                   "device 'nonsense'"),
    ("BLOCKRT_ALLOCATOR", "bogus", "environment variable BLOCKRT_ALLOCATOR is 'bogus', which "
                                   "names no allocator; known: "),
])
def test_bad_environment_values_end_to_end(variable, value, match):
    """Importing works; the first tensor raises, naming the variable and its value."""
    result = _python(textwrap.dedent("""
        import runtime
        try:
            runtime.tensor([1.0])
        except ValueError as exc:
            print("ValueError:", exc)
    """), **{variable: value})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ValueError: " + match), result.stdout


@pytest.mark.parametrize("value", ["nonsense", "2", "enable"])
def test_a_bad_pure_python_switch_names_the_variable(value):
    """BLOCKRT_PURE_PYTHON takes 1/true/yes/on or 0/false/no/off; anything else stops the
    import of allocators with the variable and the value, rather than silently picking a mode."""
    result = _python("import allocators", BLOCKRT_PURE_PYTHON=value)
    assert result.returncode != 0
    assert f"environment variable BLOCKRT_PURE_PYTHON={value!r}: expected 1/true/yes/on" in \
        result.stderr, result.stderr


@pytest.mark.parametrize(("value", "accelerated"), [("off", True), ("on", False)])
def test_the_pure_python_switch_words(value, accelerated):
    # NOTE: whether the extension is built, not this process's mode (which the switch may set)
    built = importlib.util.find_spec("allocators._speedups") is not None
    result = _python("import allocators; print(allocators.ACCELERATED)", BLOCKRT_PURE_PYTHON=value)
    assert result.stdout.strip() == str(accelerated and built), result.stderr


def test_a_pool_on_another_device_instance_tells_the_two_apart():
    other = type(backends.get_device("cpu"))(0)
    pool = runtime.ConstantPool(device=other)
    with pytest.raises(ValueError, match=r"the pool is on cpu \(Device instance 0x[0-9a-f]+\), "
                                         r"but device cpu \(another Device instance"):
        runtime.constant(np.ones(2), device="cpu", pool=pool)
    assert pool.stats()["lookups"] == 0


# ---------------------------------------------------------------------- broken plugins
PLUGIN_MODULE = "blockrt_bad_input_plugin"
PLUGINS = {
    "exploding": f"{PLUGIN_MODULE}_exploding:Factory",   # importing the module raises
    "missing": f"{PLUGIN_MODULE}:NoSuchFactory",          # the attribute is not there
    "not_an_allocator": f"{PLUGIN_MODULE}:make_dict",     # returns a dict
    "raises": f"{PLUGIN_MODULE}:make_nothing",            # the factory itself raises
}


@pytest.fixture
def broken_plugins(tmp_path, monkeypatch):
    """A real installed distribution on sys.path whose blockrt.allocators entry points are
    broken in the ways third-party code breaks."""
    dist = tmp_path / "blockrt_bad_input_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: blockrt-bad-input-plugin\n"
                                   "Version: 1.0\n")
    lines = [f"{name} = {target}" for name, target in PLUGINS.items()]
    (dist / "entry_points.txt").write_text(f"[{allocators.ENTRY_POINT_GROUP}]\n" +
                                           "\n".join(lines) + "\n")
    (tmp_path / f"{PLUGIN_MODULE}_exploding.py").write_text(
        "raise RuntimeError('the plugin is broken: no libfoo.so')\n")
    (tmp_path / f"{PLUGIN_MODULE}.py").write_text(textwrap.dedent("""
        def make_dict(device=None, **options):
            return {"device": device}


        def make_nothing(device=None, **options):
            raise RuntimeError("make_nothing: cannot reach the pool server")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in (PLUGIN_MODULE, f"{PLUGIN_MODULE}_exploding"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize(("name", "error", "match"), [
    pytest.param("exploding", ImportError,
                 parts("allocator plugin 'exploding' (blockrt_bad_input_plugin_exploding:Factory,"
                       " entry point group blockrt.allocators) failed to load: the plugin is "
                       "broken: no libfoo.so"), id="import-raises"),
    pytest.param("missing", ImportError,
                 parts("allocator plugin 'missing' (blockrt_bad_input_plugin:NoSuchFactory",
                       "failed to load", "NoSuchFactory"), id="no-attribute"),
    pytest.param("not_an_allocator", TypeError,
                 parts("allocator factory 'not_an_allocator' returned dict, not an "
                       "allocators.Allocator"), id="returns-a-dict"),
    pytest.param("raises", RuntimeError, parts("make_nothing: cannot reach the pool server"),
                 id="factory-raises"),
])
def test_a_broken_plugin_fails_clearly_and_breaks_nothing(broken_plugins, name, error, match):
    assert set(PLUGINS) <= set(allocators.names())
    alloc = allocators.create("direct")
    kept = runtime.tensor(np.arange(3.0), allocator=alloc)
    with pytest.raises(error, match=match) as info:
        allocators.create(name, "cpu")
    if error is ImportError:
        assert info.value.__cause__ is not None  # the plugin's own error is chained
    np.testing.assert_array_equal(kept.numpy(), np.arange(3.0))
    assert set(PLUGINS) <= set(allocators.names())  # the registry still lists everything
    assert type(allocators.create("caching")).__name__ == "CachingAllocator"


# ---------------------------------------------------------------------- families of bad input
small_shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4)


def _broadcasts(a: tuple, b: tuple) -> bool:
    try:
        np.broadcast_shapes(a, b)
    except ValueError:
        return False
    return True


@st.composite
def clashing_shapes(draw) -> tuple[tuple, tuple]:
    """Two shapes that cannot broadcast: drawn freely, then one aligned axis set to two
    different sizes above 1 (drawing freely and filtering threw away two draws in three)."""
    a, b = list(draw(small_shapes)), list(draw(small_shapes))
    axis = -draw(st.integers(1, min(len(a), len(b))))
    a[axis], b[axis] = draw(st.lists(st.integers(2, 4), min_size=2, max_size=2, unique=True))
    return tuple(a), tuple(b)


# NOTE: about 0.1 s an example (each checks every byte stays as it was); more in soak mode
@settings(max_examples=25)
@given(clashing_shapes(), st.sampled_from(["add", "sub", "mul", "div"]))
def test_shapes_that_do_not_broadcast_always_raise_and_never_write(shapes, op):
    a_shape, b_shape = shapes
    assert not _broadcasts(a_shape, b_shape)
    world = World(allocators.create("direct"))
    a = runtime.tensor(np.ones(a_shape), allocator=world.allocator)
    b = runtime.tensor(np.full(b_shape, 2.0), allocator=world.allocator)
    world.adopt(a=a, b=b)
    raises_and_keeps(world, lambda w: getattr(ops, op)(a, b), ValueError,
                     parts(f"{op}: shapes {a_shape} and {b_shape} cannot be broadcast together"))
    raises_and_keeps(world, lambda w: getattr(ops, op)(a, 1.0, out=b), ValueError,
                     parts(f"{op}: shapes {a_shape} and {b_shape} cannot be broadcast together "
                           "(the last is out)"))


@given(st.integers(1, 5), st.integers(1, 5), st.integers(1, 5), st.integers(1, 5))
def test_matmul_with_unequal_inner_dimensions_names_both(m, k, k2, n):
    assume(k != k2)
    alloc = allocators.create("direct")
    a = runtime.tensor(np.ones((m, k)), allocator=alloc)
    b = runtime.tensor(np.ones((k2, n)), allocator=alloc)
    before = in_use(alloc)
    with pytest.raises(ValueError, match=parts(f"shapes {(m, k)} and {(k2, n)} do not align: "
                                               f"{k} (last dim of a) != {k2} (dim -2 of b)")):
        ops.matmul(a, b)
    assert in_use(alloc) == before
    assert a.numpy().sum() == m * k and b.numpy().sum() == k2 * n


@given(small_shapes, st.lists(st.integers(1, 6), min_size=1, max_size=3))
def test_reshape_to_another_element_count_names_both_counts(shape, new_shape):
    size, new_size = int(np.prod(shape)), int(np.prod(new_shape))
    assume(size != new_size)
    x = runtime.tensor(np.arange(float(size)).reshape(shape), allocator=allocators.create("direct"))
    with pytest.raises(ValueError, match=parts(f"cannot reshape {size} elements {shape} into "
                                               f"{tuple(new_shape)} ({new_size} elements)")):
        x.reshape(new_shape)
    np.testing.assert_array_equal(x.numpy(), np.arange(float(size)).reshape(shape))


@given(small_shapes, st.data())
def test_an_index_out_of_range_names_the_index_axis_and_size(shape, data):
    axis = data.draw(st.integers(0, len(shape) - 1))
    n = shape[axis]
    index = data.draw(st.one_of(st.integers(n, n + 100), st.integers(-n - 100, -n - 1)))
    x = runtime.tensor(np.zeros(shape), allocator=allocators.create("direct"))
    key = (0,) * axis + (index,)
    with pytest.raises(IndexError, match=parts(f"index {index} is out of bounds for axis {axis} "
                                               f"with size {n}")):
        x[key]
    with pytest.raises(IndexError, match=parts(f"index {index} is out of bounds")):
        x[key] = 1.0
    assert not x.numpy().any() and x.version == 1


@given(st.sampled_from(ALLOCATORS), st.integers(max_value=-1))
def test_any_negative_size_is_refused_with_its_number(kind, nbytes):
    alloc = _allocator(kind)
    kept = alloc.allocate(10)
    before = alloc.stats()
    match = parts(f"allocation size must be >= 0 bytes, got {nbytes}")
    with pytest.raises(ValueError, match=match):
        alloc.allocate(nbytes)
    assert alloc.stats() == before
    assert alloc.live_allocations() == [kept]


@given(st.lists(st.integers(-5, 5), min_size=1, max_size=4))
def test_a_negative_dimension_is_named(shape):
    assume(any(n < 0 for n in shape))
    first = next(n for n in shape if n < 0)
    alloc = allocators.create("direct")
    for make in (runtime.empty, runtime.zeros, runtime.ones):
        with pytest.raises(ValueError, match=parts(f"shape {tuple(shape)} has a negative "
                                                   f"dimension {first}")):
            make(shape, allocator=alloc)
    assert alloc.stats()["num_allocs"] == 0


# ---------------------------------------------------------------------- modules and interop
class _Holder(nn.Module):
    def forward(self, x):
        return x


@pytest.mark.parametrize(("link", "match"), [
    pytest.param(lambda outer, inner, leaf: setattr(outer, "me", outer),
                 "_Holder: assigning _Holder as .me would make a module that contains itself "
                 "(through me)", id="itself"),
    pytest.param(lambda outer, inner, leaf: setattr(inner, "up", outer), "(through up.inner)",
                 id="its-parent"),
    pytest.param(lambda outer, inner, leaf: setattr(leaf, "root", outer),
                 "Dense: assigning _Holder as .root", id="its-grandparent"),
    pytest.param(lambda outer, inner, leaf: setattr(inner, "seq", nn.Sequential(nn.ReLU(), outer)),
                 "(through seq.1.inner)", id="through-a-sequential"),
])
def test_a_module_that_would_contain_itself_is_refused_where_the_cycle_is_made(link, match):
    outer, inner, leaf = _Holder(), _Holder(), nn.Dense(2, 2)
    outer.inner = inner
    inner.leaf = leaf
    before = [id(p) for p in outer.parameters()]
    with pytest.raises(ValueError, match=parts(match, "a module tree cannot have cycles")):
        link(outer, inner, leaf)
    # nothing was assigned, and every walk of the tree still ends
    assert [id(p) for p in outer.parameters()] == before
    assert "Dense(in_features=2" in repr(outer)


def test_a_module_may_hold_one_submodule_twice():
    shared = nn.Dense(2, 2)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    assert len(model.parameters()) == 2  # each parameter once
    assert repr(model).count("Dense") == 2


def test_pyopencl_hook_refuses_an_allocator_on_another_device():
    cpu = allocators.create("direct", "cpu")
    with pytest.raises(ValueError, match=parts("pyopencl_allocator needs an allocator on an "
                                               "OpenCL device", "is on cpu (NumpyDevice)")):
        pyopencl_allocator(cpu)
    assert cpu.stats()["num_allocs"] == 0


@pytest.mark.parametrize(("nbytes", "error", "match"), [
    (-5, ValueError, "pyopencl_allocator hook: size must be >= 0 bytes, got -5"),
    (-(2**70), ValueError, f"got {-(2**70)}"),
    (1.5, TypeError, "pyopencl_allocator hook: size must be an integer number of bytes, got 1.5"),
    (True, TypeError, "got True of type bool"),
    ("64", TypeError, "got '64' of type str"),
])
def test_pyopencl_hook_refuses_a_bad_size(nbytes, error, match):
    alloc = allocators.create("direct", _opencl())
    hook = pyopencl_allocator(alloc)
    with pytest.raises(error, match=parts(match)):
        hook(nbytes)
    assert alloc.stats()["num_allocs"] == 0


# ---------------------------------------------------------------------- bad arguments, generated
def _numbers_beyond(limit: int) -> st.SearchStrategy:
    """Python ints of either sign whose magnitude is at least `limit`."""
    return st.integers(limit, limit * 2**64) | st.integers(-limit * 2**64, -limit)


_JUNK = st.one_of(st.none(), st.text(max_size=3), st.binary(min_size=1, max_size=2),
                  st.complex_numbers(allow_nan=False, max_magnitude=1e3).filter(lambda z: z.imag),
                  st.sampled_from([{}, object(), {1}, np.complex64(1j)]))
_NOT_AN_INT = st.one_of(_JUNK, st.floats(), st.booleans(),
                        st.sampled_from([np.float64(2.0), np.bool_(True), np.float32(1.0)]))
#: The bad values each kind of argument is tried with; every one must be refused.
BAD = {
    # a shape (the tensor x of the calls has 12 elements; -1 is reshape's inferred dimension)
    "shape": st.one_of(_NOT_AN_INT, st.integers(max_value=-2), _numbers_beyond(2**63).filter(
        lambda n: n > 0), st.lists(st.integers(0, 3) | _NOT_AN_INT | st.integers(max_value=-2),
                                   min_size=1, max_size=3).filter(
        lambda dims: any(type(n) is not int or n < -1 for n in dims))),
    "dtype": st.sampled_from(["complex64", "object", "U3", "S2", ">f8", ">i4", "datetime64[s]",
                              "timedelta64[s]", "V8", "V2", "nonsense", np.complex128, object,
                              str, 1.5, 3, [("a", "f8")], "i4,i4", "float128", "int4",
                              "float8_e4m3fn"]),
    # an axis of a 2-D tensor
    "axis": st.one_of(_NOT_AN_INT.filter(lambda a: a is not None), st.integers(min_value=2),
                      st.integers(max_value=-3), _numbers_beyond(2**64),
                      st.lists(st.integers(-2, 1) | _NOT_AN_INT.filter(lambda a: a is not None),
                               min_size=1, max_size=3).filter(
                          lambda axes: len({a % 2 if type(a) is int else a for a in axes
                                            if type(a) is not dict and type(a) is not set})
                          != len(axes) or any(type(a) is not int for a in axes)).map(tuple)),
    "flag": st.one_of(_JUNK, st.integers(), st.floats(), st.lists(st.booleans(), max_size=2)),
    "scalar": st.one_of(_JUNK, st.booleans(), st.just(np.bool_(False)), _numbers_beyond(2**1024),
                        st.lists(st.floats(), max_size=2)),
    "scalar32": st.one_of(st.floats(3.5e38, 1e308), st.floats(-1e308, -3.5e38),
                          st.floats(3.5e38, 1e308).map(np.float64),
                          _numbers_beyond(2**128)),
    # an offset into the 12 elements of x, for a view of 2
    "offset": st.one_of(_NOT_AN_INT, st.integers(max_value=-1), st.integers(min_value=11),
                        _numbers_beyond(2**64)),
    "axes": st.one_of(
        st.lists(st.integers(-3, 2) | _NOT_AN_INT, min_size=0, max_size=3).map(tuple),
        _NOT_AN_INT.map(lambda a: (a,)),
        st.lists(st.integers(-2, 1) | _NOT_AN_INT, min_size=2, max_size=2).map(lambda a: (a,)),
    ).filter(lambda axes: axes != () and not _a_permutation_of_two(axes)),
    "index": st.one_of(_NOT_AN_INT.filter(lambda k: k is not None), st.integers(min_value=3),
                       st.integers(max_value=-4), _numbers_beyond(2**64),
                       st.lists(st.integers(0, 2), min_size=1, max_size=2),
                       st.builds(slice, st.floats() | st.text(max_size=1), st.none()),
                       st.just(slice(None, None, 0)), st.just(np.array([0]))),
    "data": st.one_of(_JUNK, st.lists(st.text(max_size=2), min_size=1, max_size=2),
                      st.lists(st.complex_numbers(max_magnitude=10).filter(lambda z: z.imag),
                               min_size=1, max_size=2),
                      st.lists(_numbers_beyond(2**64), min_size=1, max_size=2),
                      st.sampled_from([[[1.0], [1.0, 2.0]], [-1, 2**64 - 1], [0.5, 2**60 + 1],
                                       np.array([1 + 1j]), np.array(["a"]),
                                       np.zeros(2, "V2"), np.zeros(2, object),
                                       np.array([1], "datetime64[s]"), [None, 1.0]])),
    "features": st.one_of(_NOT_AN_INT, st.integers(max_value=0), st.integers(2**62, 2**100)),
    "rate": st.one_of(_JUNK, st.booleans(), st.floats(max_value=-1e-300),
                      st.sampled_from([math.nan, math.inf, -math.inf]), _numbers_beyond(2**1024)),
    "eps": st.one_of(_JUNK, st.booleans(), st.floats(max_value=0.0),
                     st.sampled_from([math.nan, math.inf])),
}
BAD["int data"] = BAD["data"] | st.sampled_from([[1.5], [math.nan], [1e30], np.float64(-0.5)])
BAD["implicit data"] = BAD["data"] | st.just(np.complex64([1]))


def _a_permutation_of_two(axes: tuple) -> bool:
    if len(axes) == 1 and isinstance(axes[0], (list, tuple)):
        axes = tuple(axes[0])  # transpose([1, 0]) is transpose(1, 0)
    return (len(axes) == 2 and all(type(a) is int and -2 <= a < 2 for a in axes)
            and {a % 2 for a in axes} == {0, 1})


class _Targets:
    """What the calls work on: x (3, 4) float64 with distinct values, f32, i64 and a leaf."""

    def __init__(self) -> None:
        self.alloc = allocators.create("direct")
        self.x = runtime.tensor(np.arange(12.0).reshape(3, 4), allocator=self.alloc)
        self.f32 = runtime.tensor(np.ones(3, np.float32), allocator=self.alloc)
        self.leaf = runtime.tensor(np.ones(2), allocator=self.alloc, requires_grad=True)
        self.i64 = runtime.tensor(np.arange(4), allocator=self.alloc)


#: (the name the message must carry, the kind of bad argument, the call)
CALLS = [
    ("empty", "shape", lambda t, v: runtime.empty(v, allocator=t.alloc)),
    ("zeros", "shape", lambda t, v: runtime.zeros(v, allocator=t.alloc)),
    ("ones", "shape", lambda t, v: runtime.ones(v, allocator=t.alloc)),
    ("view()", "shape", lambda t, v: runtime.view(t.x, v)),
    ("reshape", "shape", lambda t, v: t.x.reshape(v)),
    ("Tensor", "shape", lambda t, v: Tensor(t.x.block, v, "float64")),
    ("empty", "dtype", lambda t, v: runtime.empty(2, v, allocator=t.alloc)),
    ("zeros", "dtype", lambda t, v: runtime.zeros(2, v, allocator=t.alloc)),
    ("tensor", "dtype", lambda t, v: runtime.tensor([1.0], v, allocator=t.alloc)),
    ("Tensor", "dtype", lambda t, v: Tensor(t.x.block, (2,), v)),
    ("sum", "axis", lambda t, v: ops.sum(t.x, axis=v)),
    ("mean", "axis", lambda t, v: ops.mean(t.x, axis=v)),
    ("sum", "flag", lambda t, v: ops.sum(t.x, 0, keepdims=v)),
    ("mean", "flag", lambda t, v: ops.mean(t.x, keepdims=v)),
    ("empty", "flag", lambda t, v: runtime.empty(2, allocator=t.alloc, requires_grad=v)),
    ("tensor", "flag", lambda t, v: runtime.tensor([1.0], allocator=t.alloc, requires_grad=v)),
    ("requires_grad", "flag", lambda t, v: setattr(t.x, "requires_grad", v)),
    ("SGD: nesterov", "flag", lambda t, v: nn.SGD([t.leaf], 0.1, momentum=0.9, nesterov=v)),
    ("Dense: bias", "flag", lambda t, v: nn.Dense(2, 2, bias=v)),
    ("add", "scalar", lambda t, v: ops.add(t.x, v)),
    ("sub", "scalar", lambda t, v: ops.sub(v, t.x)),
    ("mul", "scalar", lambda t, v: ops.mul(t.x, v, out=t.x)),
    ("div", "scalar", lambda t, v: ops.div(v, t.x)),
    ("mul", "scalar32", lambda t, v: ops.mul(t.f32, v)),
    ("sub", "scalar32", lambda t, v: ops.sub(v, t.f32, out=t.f32)),
    ("view()", "offset", lambda t, v: runtime.view(t.x, (2,), v)),
    ("Tensor", "offset", lambda t, v: Tensor(t.x.block, (2,), "float64", None, v)),
    ("transpose", "axes", lambda t, v: t.x.transpose(*v)),
    ("index", "index", lambda t, v: t.x[v]),
    ("index", "index", lambda t, v: t.x.__setitem__(v, 0.0)),
    ("tensor", "implicit data", lambda t, v: runtime.tensor(v, allocator=t.alloc)),
    ("tensor", "int data", lambda t, v: runtime.tensor(v, "int64", allocator=t.alloc)),
    ("to assign", "int data", lambda t, v: t.i64.__setitem__(slice(0, 2), v)),
    ("Dense", "features", lambda t, v: nn.Dense(v, 2)),
    ("Dense", "features", lambda t, v: nn.Dense(3, v)),
    ("SGD: lr", "rate", lambda t, v: nn.SGD([t.leaf], lr=v)),
    ("SGD: momentum", "rate", lambda t, v: nn.SGD([t.leaf], 0.1, momentum=v)),
    ("Adam: lr", "rate", lambda t, v: nn.Adam([t.leaf], lr=v)),
    ("Adam: eps", "eps", lambda t, v: nn.Adam([t.leaf], eps=v)),
]


def _shown(value: Any) -> list[str]:
    """Ways a message may show `value` (cut, as messages cut long values): its repr, as a tuple,
    as a dtype, or the repr of one of its items."""
    forms = [repr(value)]
    if isinstance(value, (list, tuple)):
        forms.append(repr(tuple(value)))
        for item in value:
            forms += [repr(item), repr(tuple(item)) if isinstance(item, list) else repr(item)]
    if isinstance(value, int) and not isinstance(value, bool):
        forms.append(repr((value,)))
    if isinstance(value, (np.ndarray, np.generic)):  # its dtype, or a value in it
        forms += [str(value.dtype), *map(repr, np.ravel(value)[:3].tolist())]
    try:
        forms.append(str(np.dtype(value)))
    except Exception:
        pass
    return [form[:40] for form in forms]


@pytest.mark.parametrize(("name", "kind", "call"), CALLS,
                         ids=[f"{name}-{kind}" for name, kind, _ in CALLS])
@settings(max_examples=30)
@given(data=st.data())
def test_every_bad_argument_is_refused_with_the_call_and_the_value(name, kind, call, data):
    targets = _Targets()
    value = data.draw(BAD[kind], label=kind)
    allowed = (TypeError, ValueError, IndexError) if name == "index" else (TypeError, ValueError)
    with pytest.raises(Exception) as info:
        call(targets, value)
    error = info.value
    assert isinstance(error, allowed), f"{type(error).__name__}: {error}"
    message = str(error)
    assert name in message, message
    assert any(form in message for form in _shown(value)), message
    assert not isinstance(error, (OverflowError, KeyError, AttributeError, RecursionError))
    # nothing was written
    np.testing.assert_array_equal(targets.x.numpy(), np.arange(12.0).reshape(3, 4))
    assert targets.x.version == targets.f32.version == targets.i64.version == 1
