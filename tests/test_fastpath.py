"""The eager fast path (runtime/_dispatch.c) against the Python path of ops (Note [the eager
fast path] in runtime/fastpath.py).

The same random programs of elementwise ops run twice over worlds built alike: once with the C
fast path, once inside `fastpath.python_only()` (the Python path alone). Every step must end the
same way (the same result values, dtype, shape and autograd record, or the same error and
message), and after every step every tensor of the world must hold the same bytes at the same
block version, with the same allocator statistics. The worlds hold what the fast path must
refuse or hand back: views of one buffer that are identical, interleaved or overlapping, a
transposed view, a released tensor, an unwritten one, a constant, one that requires grad, an
int32 tensor, and numbers beyond float32 or of the wrong kind.
"""

from __future__ import annotations

import contextlib
import gc
import re
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import allocators
import runtime
from runtime import fastpath, ops

pytestmark = pytest.mark.skipif(not fastpath.ACCELERATED, reason=(
    "the eager fast path is not built (no C compiler at install) or BLOCKRT_PURE_PYTHON is set"))

#: The C fast path itself, whatever a test sets `ops._fast` to.
C_FAST = ops._fast
C_LAUNCH = ops._fast_launch
C_REDUCE = ops._fast_reduce

UNARY = ("neg", "exp", "log", "tanh", "sigmoid", "relu", "sqrt", "copy")
BINARY = ("add", "sub", "mul", "div", "tanh_backward", "sigmoid_backward", "relu_backward")
#: Ops whose second half (`_prepare_out` + `_launch`) the fast path's launch runs.
LAUNCHED = ("matmul", "linear", "sum", "mean")
AXES = (None, 0, 1, -1, (0, 1), (1,), (1, 1), 2, [0], True, np.int64(0))
NUMBERS = (2.0, -0.5, 3, 0.0, -0.0, float("nan"), float("inf"), 1e39, 1e300, 10 ** 400, True,
           np.float32(2.0), 2 ** 60 + 1)


def build_world(allocator: allocators.Allocator) -> list[runtime.Tensor]:
    """The tensors a program may use, by index; the same layout every time it is called."""
    rng = np.random.default_rng(7)
    dev = allocator.device

    def make(data: Any, **kwargs: Any) -> runtime.Tensor:
        return runtime.tensor(data, device=dev, allocator=allocator, **kwargs)

    a32 = make(rng.normal(size=(3, 4)).astype(np.float32))
    b32 = make(rng.normal(size=(3, 4)).astype(np.float32))
    bias32 = make(rng.normal(size=4).astype(np.float32))
    a64 = make(rng.normal(size=(3, 4)))
    col64 = make(rng.normal(size=(3, 1)))
    buffer = make(rng.normal(size=24).astype(np.float32))
    first = runtime.view(buffer, (3, 4))               # elements 0..11
    second = runtime.view(buffer, (3, 4), offset=12)   # elements 12..23: disjoint from first
    shifted = runtime.view(buffer, (3, 4), offset=2)   # overlaps both, not identically
    again = runtime.view(buffer, (3, 4))               # the identical view of first
    strided = buffer[::2].reshape(3, 4)                # interleaved with the odd elements
    odd = buffer[1::2].reshape(3, 4)
    transposed = make(rng.normal(size=(4, 3)).astype(np.float32)).T
    released = make(np.ones((3, 4), np.float32))
    released.release()
    unwritten = runtime.empty((3, 4), "float32", device=dev, allocator=allocator)
    constant = runtime.constant(rng.normal(size=(3, 4)).astype(np.float32), device=dev)
    leaf = make(rng.normal(size=(3, 4)).astype(np.float32), requires_grad=True)
    ints = make(np.arange(12, dtype=np.int32).reshape(3, 4))
    a16 = make(rng.normal(size=(3, 4)).astype(np.float16))
    bias16 = make(rng.normal(size=4).astype(np.float16))
    abf = make(rng.normal(size=(3, 4)).astype(ml_dtypes.bfloat16))
    colbf = make(rng.normal(size=(3, 1)).astype(ml_dtypes.bfloat16))
    weight = make(rng.normal(size=(4, 4)).astype(np.float32), requires_grad=True)
    square = runtime.view(buffer, (4, 4), offset=4)    # overlaps first and second
    return [a32, b32, bias32, a64, col64, first, second, shifted, again, strided, odd,
            transposed, released, unwritten, constant, leaf, ints, a16, bias16, abf, colbf,
            weight, square]


WORLD_SIZE = 23
#: The world's views of one buffer (first, second, shifted, again, strided, odd, square): drawn
#: half the time, so that outputs often share memory with inputs.
SHARED = (5, 6, 7, 8, 9, 10, 22)

index = st.one_of(st.sampled_from(SHARED), st.integers(0, WORLD_SIZE - 1))
operand = st.one_of(index.map(lambda i: ("t", i)),
                    st.sampled_from(NUMBERS).map(lambda x: ("n", x)))
step = st.tuples(st.sampled_from(UNARY + BINARY + LAUNCHED),
                 st.lists(operand, min_size=1, max_size=3),
                 st.one_of(st.none(), index), st.booleans(),
                 st.tuples(st.sampled_from(AXES), st.booleans()))
programs = st.lists(step, min_size=1, max_size=12)


def _words(message: str) -> str:
    """An error message without block ids and addresses, which differ between two worlds."""
    return re.sub(r"0x[0-9a-f]+", "0x?", re.sub(r"#\d+", "#?", message))


def _state(world: list[runtime.Tensor], made: list[runtime.Tensor]) -> list[Any]:
    """Every tensor's bytes (or why they cannot be read) and its block's version."""
    found = []
    for t in world + made:
        try:
            data = t.numpy().tobytes()
        except Exception as error:  # released, unwritten: the same reason on both paths
            data = type(error).__name__
        found.append((data, t.block.version, t.requires_grad))
    return found


def call(op: str, values: list, out: Any, axis: Any, keepdims: bool,
         world: list[runtime.Tensor]) -> runtime.Tensor:
    """`op` on `values` (padded or cut to the op's count), as a program step calls it. A
    product's second operand is mostly a (4, 4) tensor, one of them over the shared buffer, so
    that most products are valid and some write into the memory they read."""
    if op in ("sum", "mean"):
        return getattr(ops, op)(values[0], axis=axis, keepdims=keepdims, out=out)
    if op in ("matmul", "linear"):
        values = (values * 3)[:3]
        if isinstance(values[1], runtime.Tensor) and values[1].shape != (4, 4):
            position = next(i for i, t in enumerate(world) if t is values[1])
            values[1] = world[-1] if position % 2 else world[-2]
        return getattr(ops, op)(*values[:3 if op == "linear" else 2], out=out)
    values = (values * 2)[:2] if op in BINARY else values[:1]
    return ops._elementwise(op, out, *values)


def run(program: list, fast: Any = None, launch: Any = None, reduce: Any = None) -> list[Any]:
    """What each step of `program` did, and the world after it, with the elementwise fast
    path `fast`, the launch `launch` and the reduction `reduce` in place of the C ones (the C
    ones, counted), or with none of them given inside `fastpath.python_only()` (Python only)."""
    allocator = allocators.create("caching", "cpu")
    world = build_world(allocator)
    made: list[runtime.Tensor] = []
    log: list[Any] = []
    saved = ops._fast, ops._fast_launch, ops._fast_reduce
    if fast is not None:
        ops._fast, ops._fast_launch, ops._fast_reduce = fast, launch, reduce
    path = fastpath.python_only() if fast is None else contextlib.nullcontext()
    try:
        path.__enter__()
        for op, args, out_index, grad, (axis, keepdims) in program:
            values = [world[i] if kind == "t" else i for kind, i in args]
            out = None if out_index is None else world[out_index]
            try:
                if grad:
                    result = call(op, values, out, axis, keepdims, world)
                else:
                    with runtime.no_grad():
                        result = call(op, values, out, axis, keepdims, world)
            except Exception as error:
                log.append(("error", type(error).__name__, _words(str(error))))
            else:
                is_out = result is out
                if not is_out:
                    made.append(result)
                node = result.grad_fn.op if result.grad_fn is not None else None
                log.append(("ok", is_out, result.shape, str(result.dtype), node))
            log.append(_state(world, made))
        stats = allocator.stats()
        log.append({key: stats[key] for key in ("allocated_bytes", "peak_allocated_bytes",
                                                "num_allocs", "num_frees", "cache_misses")})
        del world, made
        gc.collect()  # NOTE: every tensor goes: the frees are part of what is compared
        stats = allocator.stats()
        log.append((stats["num_frees"], stats["allocated_bytes"]))
    finally:
        path.__exit__(None, None, None)
        ops._fast, ops._fast_launch, ops._fast_reduce = saved
    return log


@given(programs)
@settings(max_examples=150)
def test_the_fast_path_does_what_the_python_path_does(program):
    taken = []

    def counting(op: str, out: Any, operands: tuple) -> Any:
        result = C_FAST(op, out, operands)
        taken.append(result is not None)
        return result

    def counting_launch(*args: Any) -> Any:
        result = C_LAUNCH(*args)
        taken.append(result is not None)
        return result

    def counting_reduce(*args: Any) -> Any:
        result = C_REDUCE(*args)
        taken.append(result is not None)
        return result

    fast = run(program, counting, counting_launch, counting_reduce)
    assert fast == run(program)
    share = sum(taken) / len(taken) if taken else 0.0
    event(f"share of ops the fast path took: {round(4 * share) / 4:.2f}")


def test_the_common_cases_take_the_fast_path(monkeypatch):
    """Guards the test above: the cases an eager training step makes run in C (a change that
    made the fast path refuse them would still pass the comparison)."""
    taken = []

    def counting(op: str, out: Any, operands: tuple) -> Any:
        result = C_FAST(op, out, operands)
        taken.append((op, result is not None))
        return result

    monkeypatch.setattr(ops, "_fast", counting)
    allocator = allocators.create("caching", "cpu")
    a32, b32, bias32, _, _, first, second, *_ = build_world(allocator)
    scratch = runtime.empty((3, 4), "float32", allocator=allocator)
    with runtime.no_grad():
        ops.add(a32, bias32, out=scratch)       # broadcast into out=
        ops.relu(scratch, out=scratch)          # the identical view, in place
        ops.mul(first, 2.0, out=second)         # disjoint views of one buffer
        ops.sub(a32, ops.mul(b32, 0.1))         # a fresh result, a number
        ops._elementwise("relu_backward", None, a32, b32)
    leaf = runtime.tensor(np.ones((3, 4), np.float32), requires_grad=True)
    y = ops.tanh(ops.mul(leaf, a32))            # recorded for autograd
    ops.sum(y).backward()
    assert leaf.grad is not None
    world = build_world(allocator)
    for half, bias in ((world[17], world[18]), (world[19], world[20])):  # float16, bfloat16
        ops.relu(ops.add(half, bias))           # the rule's own kernels
        ops.tanh(ops.mul(half, 0.5))            # a number (float32) and a NumPy loop
    assert all(ok for _, ok in taken), f"fell back: {[op for op, ok in taken if not ok]}"
    assert len(taken) >= 15


def test_what_the_fast_path_hands_back(monkeypatch):
    """Each case the C code must not take returns None, so the Python path raises or copies."""
    allocator = allocators.create("caching", "cpu")
    (a32, b32, bias32, a64, _, first, _, shifted, _, strided, odd, transposed, released,
     unwritten, constant, leaf, ints, _, _, _, _, weight, square) = build_world(allocator)
    fast = C_FAST
    with runtime.no_grad():
        cases = {
            "different dtypes": ("add", None, (a32, a64)),
            "a released input": ("add", None, (a32, released)),
            "an unwritten input": ("add", None, (a32, unwritten)),
            "an int32 add": ("add", None, (ints, ints)),
            "a number beyond float32": ("mul", None, (a32, 1e39)),
            "a bool": ("mul", None, (a32, True)),
            "a NumPy scalar": ("mul", None, (a32, np.float32(2.0))),
            "out overlapping an input": ("add", shifted, (first, first)),
            "out over a constant": ("add", constant, (a32, b32)),
            "out of another shape": ("add", bias32, (a32, b32)),
            "a constant's result": ("neg", None, (constant,)),
            "shapes that do not broadcast": ("add", None, (a32, transposed.T)),
        }
        for name, (op, out, operands) in cases.items():
            assert fast(op, out, operands) is None, name
        # out= that overlaps itself: a view with a zero stride
        zero = runtime.Tensor(a32.block, (3, 4), a32.dtype, strides=(0, 1))
        assert fast("add", zero, (a32, b32)) is None
    leaf_out = runtime.tensor(np.zeros((3, 4), np.float32), requires_grad=True)
    assert fast("add", leaf_out, (a32, b32)) is None  # out= while recording gradients
    assert fast("add", None, (leaf, b32)) is not None  # recorded, in C
    # interleaved views are disjoint elements but their byte spans overlap: the exact test
    with runtime.no_grad():
        assert fast("mul", odd, (strided, 2.0)) is None
        ops.mul(strided, 2.0, out=odd)  # and the Python path finds no clash
        # launch: out= on an input's block (any overlap: matmul's policy is never)
        dev = a32.device
        assert C_LAUNCH("matmul", True, first, (3, 4), first.dtype, (square, first),
                        dev.matmul, ()) is None
        assert C_LAUNCH("matmul", True, None, (3, 4), a32.dtype, (a32, released),
                        dev.matmul, ()) is None
    assert C_LAUNCH("matmul", True, bias32, (4,), a32.dtype, (leaf, weight),
                    dev.matmul, ()) is None  # out= while recording gradients
    # reductions: what ops._reduce refuses or records goes to Python
    for axis, keepdims in [((1, 1), False), ([0], False), (True, False), (np.int64(0), False),
                           (2, False), (-3, False), (0, "no"), (0, np.True_)]:
        assert C_REDUCE("sum", a32, axis, keepdims, None) is None, (axis, keepdims)
    assert C_REDUCE("sum", leaf, 0, False, None) is None  # recorded for autograd
    assert C_REDUCE("sum", ints, 0, False, None) is None
    assert C_REDUCE("mean", a32, (0, -1), True, None).shape == (1, 1)


def test_a_fresh_result_in_c_sets_every_slot_as_tensor_fresh_does():
    """The C code makes fresh results itself; every slot of the Tensor and its Block holds what
    `Tensor._fresh` (and `Block.__init__`) would put there."""
    allocator = allocators.create("caching", "cpu")
    a = runtime.tensor(np.ones((3, 4), np.float32), allocator=allocator)
    with runtime.no_grad():
        made = C_FAST("neg", None, (a,))
    assert made is not None
    python = runtime.Tensor._fresh(made.shape, made.dtype, allocator)
    python.block.memory_for_write("test")
    python._native_on(python.block._allocation)
    python.block.mark_written()

    def slots(obj: Any, cls: type) -> dict[str, Any]:
        return {name: getattr(obj, name) for name in cls.__slots__ if name != "__weakref__"}

    mine, theirs = slots(made, runtime.Tensor), slots(python, runtime.Tensor)
    for name in ("block", "_native"):
        assert type(mine.pop(name)) is type(theirs.pop(name)), name
    assert mine == theirs
    block_mine = slots(made.block, type(made.block))
    block_theirs = slots(python.block, type(python.block))
    for name in ("id", "_allocation"):
        assert type(block_mine.pop(name)) is type(block_theirs.pop(name)), name
    assert block_mine == block_theirs
