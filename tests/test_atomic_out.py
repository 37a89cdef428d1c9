"""No half-written outputs: an op that raises leaves `out=` bit for bit as it was, on every backend.

Each case fills the block under `out` with random bits (all of it, when `out` is a strided or
transposed view of a larger block), calls an op with one bad input that must make it raise, and
checks the error's class, that it names the op, that every byte of the blocks under `out` and
the readable inputs reads back as before, and that their versions did not move (a version that
stands still while the bytes change would let autograd and graph replays read stale data).

Ops: every public op of runtime.ops and autograd's elementwise derivative kernels
(`*_backward`). Backends: every one available. Bad inputs (`BAD`): out of the wrong shape,
dtype or device, read-only (a constant), overlapping itself, requiring grad; an input of the
wrong shape, dtype or device, requiring grad, never written, released, or on a freed block; out
overlapping an input in `set_aliasing("raise")` mode; the allocation of a temporary failing (a
fault injected at the Nth allocation); labels outside [0, classes), of the wrong dtype or shape;
numbers no dtype can hold; bad axes. `test_every_op_with_every_bad_input` runs each pair once
with fixed data, so none is left to chance; the hypothesis test draws the op, sizes, dtype,
layout of out and the bits. Item assignment (`out[:] = x`) counts as an op. Below the ops, the
Device kernels that graph replays call are checked the same way, and so are training steps
(eager and under each graph plan) given a bad label.

Before the fix, OpenCL's cross_entropy wrote the losses of the rows before and after a bad label,
then raised; now a check kernel runs first and the loss kernel writes nothing when it found one.
A graph replay runs the label check before any write to state or outputs (a momentum update
needs no gradient and once ran first), and floating-point conditions give IEEE results on every
backend instead of NumPy raising after it wrote `out`.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import allocators
import backends
import runtime
from allocators import Allocation, OutOfMemoryError
from allocators.adaptors import Adaptor
from backends.numpy import NumpyDevice
from runtime import (
    AliasingError,
    AutogradError,
    ReadOnlyError,
    UninitializedMemoryError,
    UseAfterFreeError,
    nn,
    ops,
)
from runtime._tensor import Tensor

DEVICES = backends.available()
UNARY = ("neg", "exp", "log", "tanh", "sigmoid", "relu", "sqrt", "copy")
BINARY = ("add", "sub", "mul", "div", "tanh_backward", "sigmoid_backward", "relu_backward")
#: "setitem" is `out[:] = x`: item assignment, which writes through ops.copy
OTHERS = ("matmul", "linear", "cross_entropy", "sum", "mean", "setitem")
OPS = UNARY + BINARY + OTHERS
#: How an error names the op, where not by the op's own name.
NAMED = {"setitem": r"\bcopy\b|item assignment"}
LAYOUTS = ("fresh", "strided", "transposed")
FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


class FailNth(Adaptor):
    """Fails the `nth` allocation (0: the next) after `arm(nth)` with OutOfMemoryError."""

    name = "fail-nth"

    def __init__(self, upstream: allocators.Allocator) -> None:
        super().__init__(upstream)
        self.countdown: int | None = None
        self.calls = 0

    def arm(self, nth: int) -> None:
        self.countdown, self.calls = nth, 0

    def _allocate(self, nbytes: int) -> Allocation:
        if self.countdown is not None:
            self.calls += 1
            self.countdown -= 1
            if self.countdown < 0:
                self.countdown = None
                raise MemoryError(f"fault injected at allocation {self.calls} (test)")
        return super()._allocate(nbytes)


# ---------------------------------------------------------------------- one case
@dataclass
class Spec:
    """A good call of `op`: input names -> (shape, kind), the output shape, the call."""

    inputs: dict[str, tuple[tuple[int, ...], str]]
    out_shape: tuple[int, ...]
    call: Callable[[dict[str, Any], Tensor], Any]


def spec_of(op: str, m: int, n: int, k: int) -> Spec:
    """Operands of (m, n) elementwise ops, (m, k) @ (k, n) products, (m, n) logits."""
    if op in UNARY:
        return Spec({"x": ((m, n), "float")}, (m, n), lambda a, o: getattr(ops, op)(a["x"], out=o))
    if op in BINARY:
        run = getattr(ops, op, None) or (lambda a, b, out: ops._elementwise(op, out, a, b))
        return Spec({"a": ((m, n), "float"), "b": ((m, n), "float")}, (m, n),
                    lambda a, o: run(a["a"], a["b"], out=o))
    if op == "matmul":
        return Spec({"a": ((m, k), "float"), "b": ((k, n), "float")}, (m, n),
                    lambda a, o: ops.matmul(a["a"], a["b"], out=o))
    if op == "linear":
        return Spec({"x": ((m, k), "float"), "weight": ((n, k), "float"),
                     "bias": ((n,), "float")}, (m, n),
                    lambda a, o: ops.linear(a["x"], a["weight"], a["bias"], out=o))
    if op == "cross_entropy":
        return Spec({"logits": ((m, n), "float"), "labels": ((m,), "label")}, (m,),
                    lambda a, o: ops.cross_entropy(a["logits"], a["labels"], out=o))
    if op == "setitem":
        return Spec({"x": ((m, n), "float")}, (m, n),
                    lambda a, o: o.__setitem__(slice(None), a["x"]))
    axis = 1
    return Spec({"x": ((m, n), "float")}, (m,),
                lambda a, o: getattr(ops, op)(a["x"], axis=a.get("axis", axis), out=o))


@dataclass
class Case:
    """A call that must raise `error`, and the tensors whose blocks it may not touch."""

    run: Callable[[Tensor], Any]  # NOTE: called with `out`, which a bad input may replace
    error: type[BaseException]
    out: Tensor
    keep: list[Tensor] = field(default_factory=list)
    names_op: bool = True
    #: the aliasing mode the call runs in (the previous one is restored after it)
    aliasing: str = "copy"
    #: FailNth cases: the call may succeed when it allocates fewer than nth + 1 times
    flaky: FailNth | None = None


class Maker:
    """Tensors for one case on `device`: good values, random bits, layouts, constants."""

    def __init__(self, kind: str, dtype: np.dtype, rng: np.random.Generator) -> None:
        self.device = backends.get_device(kind)
        self.dtype = dtype
        self.rng = rng
        self.allocator = allocators.create("direct", self.device)

    def other_dtype(self) -> np.dtype:
        return FLOATS[1] if self.dtype == FLOATS[0] else FLOATS[0]

    def values(self, shape: tuple, kind: str, classes: int) -> np.ndarray:
        if kind == "label":
            return self.rng.integers(0, classes, shape)
        return self.rng.uniform(0.5, 2.0, shape).astype(self.dtype)  # NOTE: fine for log, sqrt

    def bits(self, shape: tuple, dtype: np.dtype) -> np.ndarray:
        count = int(np.prod(shape, dtype=np.int64))
        raw = self.rng.integers(0, 256, count * dtype.itemsize, dtype=np.uint8)
        return raw.view(dtype).reshape(shape)

    def tensor(self, host: np.ndarray, allocator: Any = None) -> Tensor:
        return runtime.tensor(host, device=self.device, allocator=allocator or self.allocator)

    def out(self, shape: tuple, layout: str, dtype: np.dtype | None = None,
            allocator: Any = None) -> Tensor:
        """A tensor of `shape` filled with random bits: its own block, or a strided or
        transposed view of a larger block of random bits."""
        dtype = dtype or self.dtype
        if layout == "strided":  # every other row (element, for 1-D) of a padded block
            whole = self.tensor(self.bits((2 * shape[0] + 1, *[d + 3 for d in shape[1:]]),
                                          dtype), allocator)
            return whole[1::2, 2:shape[1] + 2] if len(shape) == 2 else whole[1::2]
        if layout == "transposed" and len(shape) == 2:
            return self.tensor(self.bits(shape[::-1], dtype), allocator).T
        return self.tensor(self.bits(shape, dtype), allocator)

    def other_device(self) -> backends.Device:
        """Another backend if there is one, else a second NumPy device (also named "cpu")."""
        others = [kind for kind in DEVICES if backends.get_device(kind) is not self.device]
        return backends.get_device(others[0]) if others else NumpyDevice(0)


def build(op: str, bad: str, kind: str, dtype: Any, layout: str, sizes: tuple[int, int, int],
          rng: np.random.Generator, nth: int = 0) -> Case | None:
    """The call of `op` with the bad input `bad` (one of BAD) on the device `kind`, or None when
    that bad input does not apply to the op."""
    maker = Maker(kind, np.dtype(dtype), rng)
    m, n, k = sizes
    spec = spec_of(op, m, n, k)
    args = {name: maker.tensor(maker.values(shape, what, n))
            for name, (shape, what) in spec.inputs.items()}
    floats = [name for name, (_, what) in spec.inputs.items() if what == "float"]
    first = floats[0]
    out = maker.out(spec.out_shape, layout)

    def case(error: type[BaseException], names_op: bool = True) -> Case:
        keep = [t for t in args.values() if isinstance(t, Tensor) and readable(t)]
        return Case(lambda o: spec.call(args, o), error, out, keep, names_op)

    return BAD[bad](maker, op, spec, args, first, out, layout, case, nth)


def readable(t: Tensor) -> bool:
    return not t.released and t.block.generation == t._gen and t.block.written


# ---------------------------------------------------------------------- the bad inputs
def _wrong_out_shape(maker, op, spec, args, first, out, layout, case, nth):
    shape = (spec.out_shape[0] + 1,) + spec.out_shape[1:]  # NOTE: never broadcasts: m >= 2
    made = case(ValueError)
    made.out = maker.out(shape, layout)
    return made


def _wrong_out_dtype(maker, op, spec, args, first, out, layout, case, nth):
    made = case(TypeError)
    made.out = maker.out(spec.out_shape, layout, maker.other_dtype())
    return made


def _out_on_another_device(maker, op, spec, args, first, out, layout, case, nth):
    other = allocators.create("direct", maker.other_device())
    made = case(ValueError)
    made.out = runtime.tensor(maker.bits(spec.out_shape, maker.dtype), allocator=other)
    return made


def _constant_out(maker, op, spec, args, first, out, layout, case, nth):
    made = case(ReadOnlyError)
    made.out = runtime.constant(maker.bits(spec.out_shape, maker.dtype), device=maker.device)
    return made


def _out_overlapping_itself(maker, op, spec, args, first, out, layout, case, nth):
    made = case(ValueError)
    base = maker.out(spec.out_shape, "fresh")
    strides = (0,) + base.strides[1:]  # NOTE: every row is the first one
    made.out = Tensor(base.block, spec.out_shape, base.dtype, strides, 0)
    return made


def _out_requires_grad(maker, op, spec, args, first, out, layout, case, nth):
    out.requires_grad = True
    return case(AutogradError)


def _input_requires_grad(maker, op, spec, args, first, out, layout, case, nth):
    args[first].requires_grad = True
    return case(AutogradError)


def _input_of_wrong_shape(maker, op, spec, args, first, out, layout, case, nth):
    if op in ("sum", "mean"):
        args["axis"] = 2
    else:
        name = "labels" if op == "cross_entropy" else list(spec.inputs)[-1]
        shape, what = spec.inputs[name]
        args[name] = maker.tensor(maker.values(shape[:-1] + (shape[-1] + 1,), what, 1))
    return case(ValueError)


def _input_of_other_dtype(maker, op, spec, args, first, out, layout, case, nth):
    shape = spec.inputs[first][0]
    args[first] = maker.tensor(maker.values(shape, "float", 0).astype(maker.other_dtype()))
    return case(TypeError)


def _integer_input(maker, op, spec, args, first, out, layout, case, nth):
    shape = spec.inputs[first][0]
    args[first] = maker.tensor(maker.rng.integers(1, 3, shape))
    return case(TypeError)


def _input_on_another_device(maker, op, spec, args, first, out, layout, case, nth):
    shape = spec.inputs[first][0]
    other = allocators.create("direct", maker.other_device())
    args[first] = runtime.tensor(maker.values(shape, "float", 0), allocator=other)
    return case(ValueError)


def _input_never_written(maker, op, spec, args, first, out, layout, case, nth):
    args[first] = runtime.empty(spec.inputs[first][0], maker.dtype, allocator=maker.allocator)
    return case(UninitializedMemoryError)


def _released_input(maker, op, spec, args, first, out, layout, case, nth):
    args[first].release()
    return case(UseAfterFreeError)


def _input_on_a_freed_block(maker, op, spec, args, first, out, layout, case, nth):
    view = args[first][:]
    args[first].block.free()
    args[first] = view
    return case(UseAfterFreeError)


def _sharing(maker, spec, args, first, allocator=None) -> Tensor:
    """Put `args[first]` and an out one element further on into one block of random values;
    return that out (it overlaps the input partially: no op may compute it in place)."""
    shape = spec.inputs[first][0]
    size = max(np.prod(shape), 1 + np.prod(spec.out_shape))
    whole = maker.tensor(maker.values((int(size),), "float", 0), allocator)
    args[first] = runtime.view(whole, shape)
    return runtime.view(whole, spec.out_shape, offset=1)


def _aliasing_raise(maker, op, spec, args, first, out, layout, case, nth):
    out = _sharing(maker, spec, args, first)
    made = case(AliasingError)
    made.out, made.aliasing = out, "raise"
    return made


def _temporary_out_of_memory(maker, op, spec, args, first, out, layout, case, nth):
    flaky = FailNth(maker.allocator)
    for name, (shape, what) in spec.inputs.items():
        if what == "label":
            args[name] = args[name].numpy()  # NOTE: a host array: the op makes a label tensor
        else:
            args[name] = maker.tensor(maker.values(shape, what, 0), flaky)
    out = _sharing(maker, spec, args, first, flaky)
    made = case(OutOfMemoryError, names_op=False)  # NOTE: in "copy" mode: into a temporary
    made.out, made.flaky = out, flaky
    flaky.arm(nth % 3)  # NOTE: ops allocate one temporary here, cross_entropy three
    return made


def _bad_labels(maker, op, spec, args, first, out, layout, case, nth):
    if op != "cross_entropy":
        return None
    rows, classes = spec.inputs["logits"][0]
    labels = maker.rng.integers(0, classes, rows)
    row = int(maker.rng.integers(0, rows))
    choice = nth % 5
    labels[row] = (-1, classes, classes + 7, -(2**40), 2**40)[choice]
    dtype = (np.int64, np.int32, np.int64, np.int64, np.int64)[choice]
    host = labels.astype(dtype)
    args["labels"] = host if nth % 2 else maker.tensor(host)  # checked here / by the kernel
    return case(ValueError)


def _unsigned_labels_too_large(maker, op, spec, args, first, out, layout, case, nth):
    if op != "cross_entropy":
        return None
    rows, classes = spec.inputs["logits"][0]
    labels = maker.rng.integers(0, classes, rows).astype(np.uint8)
    labels[-1] = 200 + classes
    args["labels"] = maker.tensor(labels)
    return case(ValueError)


def _float_labels(maker, op, spec, args, first, out, layout, case, nth):
    if op != "cross_entropy":
        return None
    rows = spec.inputs["labels"][0]
    args["labels"] = maker.tensor(np.zeros(rows, maker.dtype))
    return case(TypeError)


def _bad_number(maker, op, spec, args, first, out, layout, case, nth):
    if op not in BINARY:
        return None
    # NOTE: a number beyond the tensor's dtype is refused before anything runs (ValueError naming
    # the op), never rounded to inf or wrapped
    huge = 1e39 if maker.dtype == np.float32 else 10**400
    number, error = ((10**400, ValueError), (1j, TypeError), (True, TypeError),
                     ("2", TypeError), (huge, ValueError))[nth % 5]
    args["b"] = number
    return case(error, names_op=True)


def _bad_axis(maker, op, spec, args, first, out, layout, case, nth):
    if op not in ("sum", "mean"):
        return None
    args["axis"], error = (((1, 1), ValueError), (1.0, TypeError), (-3, ValueError))[nth % 3]
    return case(error)


#: name -> builder(maker, op, spec, args, first, out, layout, case, nth) -> Case, or None when
#: the bad input does not apply to the op
BAD: dict[str, Callable[..., Case | None]] = {
    "out-shape": _wrong_out_shape,
    "out-dtype": _wrong_out_dtype,
    "out-device": _out_on_another_device,
    "out-constant": _constant_out,
    "out-overlaps-itself": _out_overlapping_itself,
    "out-requires-grad": _out_requires_grad,
    "input-requires-grad": _input_requires_grad,
    "input-shape": _input_of_wrong_shape,
    "input-dtype": _input_of_other_dtype,
    "input-integer": _integer_input,
    "input-device": _input_on_another_device,
    "input-never-written": _input_never_written,
    "input-released": _released_input,
    "input-freed-block": _input_on_a_freed_block,
    "aliasing-raise": _aliasing_raise,
    "temporary-out-of-memory": _temporary_out_of_memory,
    "labels-out-of-range": _bad_labels,
    "labels-unsigned-too-large": _unsigned_labels_too_large,
    "labels-float": _float_labels,
    "number": _bad_number,
    "axis": _bad_axis,
}


# ---------------------------------------------------------------------- the check
def block_bytes(t: Tensor) -> bytes:
    """Every byte of the block under `t`, read back raw from its device."""
    allocation = t.block.memory_for_read("test")
    return t.device.copyout(allocation.raw, allocation.offset, t.block.nbytes).tobytes()


def failure(op: str, case: Case) -> str | None:
    """Run the case; None when it raised the expected error naming the op and touched nothing,
    else what went wrong."""
    watched = [case.out, *case.keep]
    before = [(block_bytes(t), t.block.version) for t in watched]
    old = runtime.set_aliasing(case.aliasing)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # NOTE: as pytest is configured here, whoever runs it
            case.run(case.out)
    except case.error as exc:
        message = str(exc)
    except Exception as exc:  # NOTE: the wrong error is a finding, not a crash of the sweep
        return f"raised {type(exc).__name__} ({exc}), expected {case.error.__name__}"
    else:
        if case.flaky is not None and case.flaky.countdown is not None:
            return None  # NOTE: the op allocated fewer times than the fault waited for
        return f"did not raise {case.error.__name__}"
    finally:
        runtime.set_aliasing(old)
        if case.flaky is not None:
            case.flaky.countdown = None
    if case.names_op and not re.search(NAMED.get(op, rf"\b{op}\b"), message):
        return f"{case.error.__name__} does not name {op}: {message}"
    for i, (t, (data, version)) in enumerate(zip(watched, before)):
        what = "out" if i == 0 else f"input {i}"
        if block_bytes(t) != data:
            return f"{case.error.__name__} ({message}) but the block under {what} was written"
        if t.block.version != version:
            return f"{case.error.__name__} ({message}) but the version of {what} moved"
    return None


@pytest.mark.parametrize("kind", DEVICES)
def test_every_op_with_every_bad_input(kind):
    """Each (op, bad input) pair once, both float dtypes and every layout of out over the
    sweep; every failure is listed, not just the first."""
    rng = np.random.default_rng(0)
    found, ran = [], 0
    for i, (op, bad) in enumerate((op, bad) for op in OPS for bad in BAD):
        for nth in range(5 if bad in ("labels-out-of-range", "number") else 2):
            dtype, layout = FLOATS[i % 2], LAYOUTS[(i + nth) % 3]
            case = build(op, bad, kind, dtype, layout, (3, 4, 2), rng, nth)
            if case is None:
                continue
            ran += 1
            problem = failure(op, case)
            if problem:
                found.append(f"{op} / {bad} (nth {nth}, {dtype}, out {layout}): {problem}")
    assert not found, f"{len(found)} of {ran} cases on {kind}:\n" + "\n".join(found)
    assert ran > len(OPS) * 15


@functools.cache
def applies(bad: str) -> list[str]:
    """The ops that the bad input `bad` applies to."""
    return [op for op in OPS if build(op, bad, "cpu", np.float32, "fresh", (2, 2, 2),
                                      np.random.default_rng(0)) is not None]


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("bad", BAD)
@settings(max_examples=15)
@given(data=st.data(), dtype=st.sampled_from(FLOATS), layout=st.sampled_from(LAYOUTS),
       m=st.integers(2, 40), n=st.integers(1, 9), k=st.integers(1, 5), nth=st.integers(0, 9),
       seed=st.integers(0, 2**32 - 1))
def test_an_op_that_raises_leaves_out_bit_identical(kind, bad, data, dtype, layout, m, n, k, nth,
                                                    seed):
    op = data.draw(st.sampled_from(applies(bad)), label="op")
    case = build(op, bad, kind, dtype, layout, (m, n, k), np.random.default_rng(seed), nth)
    problem = failure(op, case)
    assert problem is None, f"{op} / {bad} on {kind}: {problem}"


@pytest.mark.parametrize(("label_dtype", "bad"), [
    (dtype, bad) for dtype in ("int64", "int32", "uint8") for bad in (-1, 4, 9, 300, 2**40)
    if np.iinfo(dtype).min <= bad <= np.iinfo(dtype).max])
def test_a_bad_label_gets_the_same_message_on_every_backend(label_dtype, bad):
    """Labels in a Tensor reach each backend's own check; the error is the same everywhere: a
    ValueError naming the op, the first bad label in row order (row 2, before the 9 of row 4)
    and the number of classes."""
    labels = np.array([0, 3, bad, 1, 9], np.int64)
    messages = set()
    for kind in DEVICES:
        logits = runtime.tensor(np.ones((5, 4), np.float32), device=kind)
        with pytest.raises(ValueError) as info:
            ops.cross_entropy(logits, runtime.tensor(labels.astype(label_dtype), device=kind))
        messages.add(str(info.value))
    assert messages == {f"cross_entropy: label {bad} is outside [0, 4) for 4 classes"}


# ---------------------------------------------------------------------- at the Device
def _placed(device: backends.Device, host: np.ndarray) -> tuple[Any, Any]:
    """(raw memory, a C-order native view over it) holding a copy of `host`."""
    raw = device.raw_alloc(host.nbytes)
    device.copyin(raw, 0, host)
    return raw, device.array_view(raw, 0, host.shape, host.dtype, host.strides)


def _bad_labels_strided(device, x, out, probs, labels):
    device.cross_entropy(x, labels[::2], out[:, 0], probs)


KERNEL_CALLS = {
    "unknown-unary": (ValueError, lambda d, x, out, p, lab: d.unary("cube", x, out)),
    "unknown-binary": (ValueError, lambda d, x, out, p, lab: d.binary("pow", x, x, out)),
    "unknown-reduction": (ValueError,
                          lambda d, x, out, p, lab: d.reduce("prod", x, None, True, out[:1, :1])),
    "fused-unknown-kernel": (ValueError, lambda d, x, out, p, lab: d.fused(
        [("exp", (("input", 0),), x.dtype), ("cube", (("link", 0),), x.dtype)], [x], out)),
    "fused-later-link": (ValueError, lambda d, x, out, p, lab: d.prepare_fused(
        [("neg", (("link", 1),), x.dtype), ("exp", (("input", 0),), x.dtype)], [x], out)()),
    "gemm-alpha": (ValueError, lambda d, x, out, p, lab: d.gemm(x, x[:4].T, out[:, :4], "x")),
    "integer-out": (TypeError, lambda d, x, out, p, lab: d.unary("exp", lab[:6], lab[6:])),
    "cross-entropy-bad-label": (ValueError, _bad_labels_strided),
}


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("name", KERNEL_CALLS)
def test_a_kernel_that_refuses_its_operands_writes_nothing(kind, name):
    """The Device API under the ops (what graph replays call): a kernel that raises leaves
    every output buffer as it was (Note [checked before written] in backends/base.py)."""
    error, call = KERNEL_CALLS[name]
    device = backends.get_device(kind)
    maker = Maker(kind, np.dtype(np.float32), np.random.default_rng(3))
    _, x = _placed(device, maker.values((6, 5), "float", 0))
    labels_host = maker.rng.integers(0, 5, 12)
    labels_host[6] = 5  # NOTE: the strided view labels[::2] holds it at row 3
    raws = [_placed(device, maker.bits(shape, maker.dtype)) for shape in ((6, 5), (6, 5))]
    raws.append(_placed(device, labels_host))
    (_, out), (_, probs), (_, labels) = raws
    before = [device.copyout(raw, 0, device.nbytes_of(raw)).tobytes() for raw, _ in raws]
    with pytest.raises(error):
        call(device, x, out, probs, labels)
    device.synchronize()
    assert [device.copyout(raw, 0, device.nbytes_of(raw)).tobytes() for raw, _ in raws] == before


# ---------------------------------------------------------------------- through a graph
def _training(kind: str):
    """A graph of a step that returns the per-row losses and their mean, with its model."""
    nn.manual_seed(0)
    device = backends.get_device(kind)
    model = nn.Sequential(nn.Dense(5, 7, device=device), nn.ReLU(), nn.Dense(7, 4, device=device))
    opt = nn.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        opt.prepare()
        losses = ops.cross_entropy(model(x), y)
        loss = ops.mean(losses)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return losses, loss

    return model, step


RNG = np.random.default_rng(1)
X = RNG.standard_normal((6, 5)).astype(np.float32)
GOOD = RNG.integers(0, 4, 6)
BAD_LABELS = np.where(np.arange(6) == 3, 4, GOOD)  # NOTE: row 3 names class 4 of 0..3


def _stepper(kind: str, plan: str) -> tuple[nn.Module, Callable]:
    model, step = _training(kind)
    if plan == "eager":
        device = backends.get_device(kind)
        return model, lambda x, y: step(runtime.tensor(x, device=device),
                                        runtime.tensor(y, device=device))
    return model, runtime.graph(step, plan=plan, device=kind)


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("plan", ["eager", "none", "recycle", "static"])
def test_a_step_with_a_bad_label_writes_no_output_and_no_parameter(kind, plan):
    """A bad label reaches the kernel's own check (a graph holds the labels in a tensor of its
    own, and so does this eager step). The step raises; the parameters and the per-row losses
    and loss the last call returned keep their bytes and versions."""
    model, step = _stepper(kind, plan)
    for _ in range(2):
        returned = step(X, GOOD)
    watched = [*model.parameters(), *returned]
    before = [(block_bytes(t), t.block.version) for t in watched]
    with pytest.raises(ValueError, match=r"cross_entropy: label 4 is outside \[0, 4\)"):
        step(X, BAD_LABELS)
    assert [(block_bytes(t), t.block.version) for t in watched] == before


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("plan", ["eager", "none", "recycle", "static"])
def test_a_step_with_a_bad_label_leaves_the_optimizer_state_as_it_was(kind, plan):
    """After a step that raised on a bad label, training goes on exactly as if it had never
    been called: the same parameters as a twin that never saw the bad labels."""
    model, step = _stepper(kind, plan)
    twin, twin_step = _stepper(kind, plan)
    for _ in range(2):
        step(X, GOOD)
        twin_step(X, GOOD)
    with pytest.raises(ValueError, match="cross_entropy: label 4"):
        step(X, BAD_LABELS)
    step(X, GOOD)
    twin_step(X, GOOD)
    for mine, theirs in zip(model.parameters(), twin.parameters()):
        assert block_bytes(mine) == block_bytes(theirs)


# ---------------------------------------------------------------------- floating-point signals
@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_floating_point_conditions_give_ieee_results_and_never_raise(kind, mode):
    """Division by zero, overflow and invalid operations give inf and nan on every backend,
    whatever np.errstate says: NumPy would raise only after writing `out` (Note [IEEE results,
    no floating-point signals] in backends/base.py). OpenCL and CUDA never signal anyway."""
    maker = Maker(kind, np.dtype(np.float64), np.random.default_rng(2))
    host = np.array([[1.0, -1.0, 0.0, 800.0]])
    zero = np.zeros_like(host)

    def step(x, z):
        return ops.div(x, z), ops.exp(x), ops.log(ops.sub(z, x)), ops.mul(ops.exp(x), 1e300)

    with np.errstate(all="ignore"):
        wanted = [host / zero, np.exp(host), np.log(zero - host), np.exp(host) * 1e300]
    run = runtime.graph(step) if mode == "graph" else step
    with np.errstate(all="raise"), warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            got = run(maker.tensor(host), maker.tensor(zero))
            for tensor, expected in zip(got, wanted):
                np.testing.assert_allclose(tensor.numpy(), expected, rtol=1e-12)
