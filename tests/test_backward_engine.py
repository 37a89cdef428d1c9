"""The C autograd (`runtime._dispatch.backward` and `runtime._dispatch.record`) against its
specification, the Python engine `runtime.autograd._run` and `autograd.python_record`
(Note [the backward engine] in runtime/autograd.py).

Random graphs of ops over leaves that share subexpressions, broadcast, view, get written in
place after being saved, or released, are recorded and run backward twice over worlds built
alike: once in C, once on the Python path alone (`fastpath.python_only()`: the Python engine,
record and ops). Both must end the same way: the same gradient bytes in every leaf, the same
errors with the same messages, the same block versions and the same allocator statistics,
during the pass and after everything is dropped.
"""

from __future__ import annotations

import contextlib
import gc
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import allocators
import runtime
from runtime import autograd, fastpath, ops

pytestmark = pytest.mark.skipif(not fastpath.ACCELERATED, reason=(
    "the C extension is not built (no C compiler at install) or BLOCKRT_PURE_PYTHON is set"))

#: The C engine and record themselves, whatever a test sets in autograd.
C_ENGINE = autograd._engine
C_RECORD = autograd.record

#: Each op with how many operands it takes from the pool.
OPS = {"add": 2, "sub": 2, "mul": 2, "div": 2, "relu": 1, "tanh": 1, "exp": 1, "copy": 1,
       "matmul": 2, "linear": 3, "sum0": 1, "sum": 1, "mean": 1, "transpose": 1, "row": 1,
       "cross_entropy": 1, "write": 1, "release": 1}

step = st.tuples(st.sampled_from(sorted(OPS)), st.lists(st.integers(0, 63), min_size=3,
                                                         max_size=3))
programs = st.tuples(st.lists(step, min_size=1, max_size=14), st.booleans(), st.booleans(),
                     st.booleans())


def build(allocator: allocators.Allocator) -> tuple[list[runtime.Tensor], list[runtime.Tensor]]:
    """The leaves that require gradients and the starting pool, the same every time."""
    rng = np.random.default_rng(11)

    def make(shape: tuple, grad: bool = True, dtype: Any = np.float32) -> runtime.Tensor:
        data = rng.uniform(0.5, 1.5, size=shape).astype(dtype)
        return runtime.tensor(data, allocator=allocator, requires_grad=grad)

    leaves = [make((3, 4)), make((4, 4)), make((4, 4)), make((4,)), make((1, 4)),
              make((3, 4), dtype=np.float64)]
    return leaves, leaves + [make((3, 4), grad=False), make((4,), grad=False)]


def apply(op: str, args: list[runtime.Tensor]) -> runtime.Tensor | None:
    """One program step on tensors of the pool; None for the steps that make no tensor."""
    a, b, c = args
    if op == "write":
        with runtime.no_grad():  # NOTE: bumps the version of a tensor a node may have saved
            ops.add(a, 1.0, out=a)
        return None
    if op == "release":
        a.release()
        return None
    if op in ("add", "sub", "mul", "div"):
        return getattr(ops, op)(a, b)
    if op in ("relu", "tanh", "exp", "copy"):
        return getattr(ops, op)(a)
    if op == "matmul":
        return ops.matmul(a, b)
    if op == "linear":
        return ops.linear(a, b, c)
    if op == "cross_entropy":
        return ops.cross_entropy(a, np.array([0, 3, 1]))
    if op == "sum0":
        return ops.sum(a, axis=0)
    if op in ("sum", "mean"):
        return getattr(ops, op)(a)
    if op == "transpose":
        return a.T
    return a[0]  # a row: a view whose backward scatters into its base


def _words(message: str) -> str:
    """An error message without block ids, which differ between two worlds."""
    return re.sub(r"#\d+", "#?", message)


def _bytes(t: runtime.Tensor | None) -> Any:
    if t is None:
        return None
    try:
        return t.numpy().tobytes()
    except Exception as error:  # released: the same reason on both sides
        return type(error).__name__


def run(program: tuple, fast: bool) -> list[Any]:
    """What the program did and what backward left, with the C engine and record (`fast`) or
    the Python ones."""
    steps, retain, again, seeded = program
    allocator = allocators.create("caching", "cpu")
    leaves, pool = build(allocator)
    log: list[Any] = []
    saved = autograd._engine, autograd.record
    autograd._engine = C_ENGINE if fast else None
    autograd.record = C_RECORD if fast else autograd.python_record
    path = contextlib.nullcontext() if fast else fastpath.python_only()
    try:
        path.__enter__()
        for op, picks in steps:
            args = [pool[i % len(pool)] for i in picks]
            try:
                made = apply(op, args)
            except Exception as error:
                log.append(("error", type(error).__name__, _words(str(error))))
                continue
            if made is not None:
                pool.append(made)
                log.append(("ok", made.shape, made.grad_fn.op if made.grad_fn else None))
        root = pool[-1]
        for attempt in range(2 if again else 1):
            try:
                if seeded and root.requires_grad:  # NOTE: a gradient of the root's own shape
                    gradient = runtime.tensor(np.full(root.shape, 0.5, root.dtype),
                                              allocator=allocator)
                    root.backward(gradient, retain_graph=retain)
                else:
                    ops.sum(root).backward(retain_graph=retain)
            except Exception as error:
                log.append((attempt, type(error).__name__, _words(str(error))))
            log.append([_bytes(leaf.grad) for leaf in leaves])
            log.append([(_bytes(t), t.block.version) for t in pool])
            stats = allocator.stats()
            log.append({key: stats[key] for key in ("allocated_bytes", "peak_allocated_bytes",
                                                    "num_allocs", "num_frees")})
        del leaves, pool, root
        gc.collect()  # NOTE: every tensor goes: the frees are part of what is compared
        stats = allocator.stats()
        log.append((stats["num_frees"], stats["allocated_bytes"]))
    finally:
        path.__exit__(None, None, None)
        autograd._engine, autograd.record = saved
    return log


@given(programs)
@settings(max_examples=200, deadline=None)
def test_the_c_engine_does_what_the_python_engine_does(program):
    c_log = run(program, True)
    assert c_log == run(program, False)
    errors = [entry[1] for entry in c_log if isinstance(entry, tuple) and len(entry) == 3
              and isinstance(entry[1], str) and entry[1].endswith("Error")]
    event(f"errors: {sorted(set(errors))}")


def test_the_engine_in_use_is_the_c_one_and_takes_the_common_case(monkeypatch):
    """Guards the test above: `backward()` runs the C engine, and a training step's graph never
    needs its Python fallbacks (a change that sent every node to `Node.unpack` would still pass
    the comparison)."""
    from runtime import _dispatch, nn

    assert autograd._engine is _dispatch.backward
    calls = []
    for name in ("unpack", "free"):
        original = getattr(autograd.Node, name)

        def counted(node: autograd.Node, original: Any = original, name: str = name) -> Any:
            calls.append(name)
            return original(node)

        monkeypatch.setattr(autograd.Node, name, counted)
    model = nn.Sequential(nn.Dense(4, 8), nn.ReLU(), nn.Dense(8, 3))
    x = runtime.tensor(np.ones((5, 4), np.float32))
    loss = nn.softmax_cross_entropy(model(x), np.array([0, 1, 2, 0, 1]))
    loss.backward()
    assert calls == []
    assert all(p.grad is not None for p in model.parameters())


def test_the_python_fallbacks_of_the_c_engine_raise_the_python_errors():
    """A saved tensor written since and a second pass through a freed graph reach `Node.unpack`
    from C, which raises the error naming the op and the versions."""
    w = runtime.tensor(np.ones(3, np.float32), requires_grad=True)
    y = ops.mul(w, w)
    with runtime.no_grad():
        ops.add(w, 1.0, out=w)
    with pytest.raises(runtime.AutogradError,
                       match=r"b of mul .* version 2, but version 1 was saved"):
        ops.sum(y).backward()
    loss = ops.sum(ops.tanh(w))
    loss.backward()
    with pytest.raises(runtime.AutogradError, match="a second time"):
        loss.backward()


def _node_fields(t: runtime.Tensor) -> tuple:
    """What a Node records, with saved handles as what they are (not which object)."""
    node = t.grad_fn
    saved = [(label, version, None if not isinstance(value, runtime.Tensor) else
              (value.shape, value.strides, value.offset, value.name, value.requires_grad,
               value.block is not None and value.block.refcount, value.is_leaf))
             for label, value, version in node.saved]
    inputs = [entry if entry is None or not isinstance(entry, autograd.Node) else entry.op
              for entry in node.inputs]
    return (node.op, inputs, node.shapes, node.labels, node.backward_fn, saved, node.freed,
            t.requires_grad)


def test_the_c_record_makes_the_node_the_python_record_makes():
    """Every field of the Node, and the saved handles, alike; a saved tensor released before
    it is saved raises the same error from both."""
    allocator = allocators.create("caching", "cpu")
    leaves, pool = build(allocator)
    x, w, _, b, _, _ = leaves
    x.name = "x"

    def fn(g: Any, *saved: Any) -> tuple:
        return (g,)

    for save in ([], [("x", x), ("weight", None)], (("the output", w),), [("n", 2.0)]):
        made = []
        for record in (C_RECORD, autograd.python_record):
            out = runtime.tensor(np.ones((3, 4), np.float32), allocator=allocator)
            made.append(record("linear", out, [x, w, b, pool[6], 3.0], ("x", "w", "b", "c", "n"),
                               fn, save))
            assert made[-1] is out
        assert _node_fields(made[0]) == _node_fields(made[1])
    stale = runtime.tensor(np.ones(3, np.float32), allocator=allocator)
    stale.release()
    out = runtime.tensor(np.ones(3, np.float32), allocator=allocator)
    errors = []
    for record in (C_RECORD, autograd.python_record):
        with pytest.raises(runtime.UseAfterFreeError) as caught:
            record("mul", out, (x,), ("x",), fn, [("b", stale)])
        errors.append(str(caught.value))
        assert out.grad_fn is None  # NOTE: nothing recorded before the error
    assert errors[0] == errors[1]
