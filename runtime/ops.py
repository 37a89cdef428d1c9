"""Ops on tensors, each with `out=`, dispatched to the device's kernels under an aliasing policy.

Every op declares how its output may share memory with its inputs:

- ELEMENTWISE: the output may be the identical view of an input (each element is read before
  the same element is written); any other overlap is unsafe.
- NEVER: no overlap at all (matmul, reductions), not even the identical view.

Before a kernel runs, `out` is tested against every input on the same block, and against every
input when either block is over imported memory (compared on device addresses), with the exact
test of `runtime.aliasing`. An unsafe overlap is computed into a temporary and copied into `out`
("copy" mode, the default) or raises AliasingError ("raise" mode). Kernels therefore never see
partially overlapping operands, on any backend.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from backends import optable
from backends.base import ieee
from runtime import aliasing, autograd, config, dtypes, fastpath, tape
from runtime._tensor import Tensor, _brief, _fill, as_axes, as_dtype, as_flag, host_array, tensor
from runtime.autograd import _mode
from runtime.block import Block
from runtime.errors import AliasingError, AutogradError, device_names
from runtime.upcalls import OPS

__all__ = ["ALIASING_POLICY", *(op.name for op in optable.OPS if op.public), "matmul", "linear",
           "cross_entropy", "sum", "mean", "cast", "can_cast"]

ELEMENTWISE = optable.ELEMENTWISE
NEVER = "never"

#: What each op declares about its output sharing memory with its inputs (see the module docstring).
ALIASING_POLICY: dict[str, str] = {
    # every elementwise op of backends/optable.py, public or autograd's derivative kernels
    **{op.name: op.aliasing for op in optable.OPS},
    **dict.fromkeys(("matmul", "linear", "cross_entropy", "sum", "mean", "cast"), NEVER),
    "cross_entropy_backward": NEVER,
    # an optimizer's update, p - lr * g in one pass (not a public op: `_sub_scaled`)
    "sub_scaled": ELEMENTWISE,
}

#: The dtypes the arithmetic ops compute in (runtime/dtypes.py COMPUTE).
FLOAT_DTYPES = dtypes.COMPUTE
#: dtypes.FLOATS as a set: `in` hashes, where a tuple compares with each dtype before a match
_FLOAT_SET = frozenset(dtypes.FLOATS)
#: The largest finite value of each float dtype, as a Python float.
_LARGEST = {dtype: float(np.finfo(dtype).max) for dtype in FLOAT_DTYPES}
_FLOAT32 = np.dtype("float32")
_INT64 = np.dtype("int64")
_FLOAT64 = np.dtype("float64")

#: a Tensor, or a Python/NumPy real number for binary ops
Operand = Any


# ---------------------------------------------------------------------- checks
def _common(op: str, tensors: Sequence[Tensor], floats_only: bool = True) -> tuple:
    """(device, dtype) shared by all tensor operands, or a clear TypeError/ValueError."""
    first = tensors[0]
    for t in tensors:
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: expected a Tensor, got {type(t).__name__} {_brief(t)}")
    device, dtype = first.block.device, first.dtype
    for t in tensors[1:]:
        if t.block.device is not device:
            a, b = device_names(device, t.device)
            raise ValueError(f"{op}: operands are on different devices: {a} and {b}; "
                             f"copy one over first")
        if t.dtype is not dtype and t.dtype != dtype:  # NOTE: `is` first: == costs more
            raise TypeError(f"{op}: operands have different dtypes: {dtype} and {t.dtype}; "
                            f"convert one first (runtime.ops.cast)")
    if floats_only and dtype not in _FLOAT_SET:
        raise TypeError(f"{op}: computes on float dtypes only (float32, float64, and float16 "
                        f"and bfloat16 in float32), got {dtype}; {dtype} tensors "
                        f"are stored, copied, viewed and cast: cast first "
                        f"(runtime.ops.cast(x, 'float32'))")
    return device, dtype


def _broadcast_shapes(shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """NumPy's broadcasting rule, with a fast path for equal shapes (the common case)."""
    first = shapes[0]
    if all(s == first for s in shapes):
        return first
    ndim = max(len(s) for s in shapes)
    result = [1] * ndim
    for s in shapes:
        for i, n in enumerate(s, ndim - len(s)):
            if n != 1:
                if result[i] not in (1, n):
                    raise ValueError("shapes do not broadcast")
                result[i] = n
    return tuple(result)


def _result_allocator(like: Tensor) -> Any:
    """Where a result computed from `like` goes: like's allocator, unless that one hands out
    read-only memory (a constant pool's); then the device's default allocator."""
    allocator = like.block.allocator
    if like.block.readonly and allocator.read_only_memory:
        return config.get_default_allocator(like.device)
    return allocator


def _prepare_out(op: str, out: Tensor | None, shape: tuple, dtype: np.dtype,
                 like: Tensor, operands: Sequence[Any] = ()) -> Tensor:
    if out is None:
        return Tensor._fresh(shape, dtype, _result_allocator(like))
    if not isinstance(out, Tensor):
        raise TypeError(f"{op}: out must be a Tensor, got {type(out).__name__} {_brief(out)}")
    if autograd.needs_grad(out, *operands):
        what = ("out requires grad" if out.requires_grad else
                "an input requires grad, and autograd does not record writes into out=")
        raise AutogradError(f"{op}: cannot write into out= while recording gradients: {what} "
                            f"(shape {out.shape}); use the op without out=, or write under "
                            f"runtime.no_grad()")
    if out.shape != shape:
        raise ValueError(f"{op}: out has shape {out.shape}, the result has shape {shape}")
    if out.dtype != dtype:
        raise TypeError(f"{op}: out has dtype {out.dtype}, the result has dtype {dtype}")
    if out.device is not like.device:
        where, inputs = device_names(out.device, like.device)
        raise ValueError(f"{op}: out is on {where}, the inputs on {inputs}")
    if out.has_internal_overlap():
        raise ValueError(f"{op}: out has internally overlapping memory (strides {out.strides}); "
                         f"writing to it is ill-defined")
    return out


def _address(block: Any) -> int | None:
    """The device address of `block`'s memory, or None when it holds none."""
    memory = block._allocation
    if memory is None:
        return None
    if memory is getattr(block, "foreign", None):
        return block.address  # NOTE: taken at import; Allocation.ptr costs microseconds
    return memory.ptr


def _clashes(policy: str, out: Tensor, inputs: Sequence[tuple[str, Tensor, tuple]]) -> list[str]:
    """Descriptions of the inputs whose memory `out` may not share under `policy`.

    See Note [blocks that may share memory] in docs/aliasing.md: two plain Blocks (allocator
    memory) never share a byte, which costs a class test per operand and no address; a pair
    where either is not a plain Block (a ForeignBlock, from `from_dlpack`) is compared on device
    addresses, by shifting the input's layout into out's block.
    """
    found = []
    out_block = out.block
    out_plain = out_block.__class__ is Block
    out_span = out_address = None
    for label, t, shape in inputs:
        block = t.block
        if block is out_block:
            shift = 0
        elif out_plain and block.__class__ is Block:
            continue
        else:
            out_address = out_address or _address(out_block)
            address = _address(block)
            if address is None or out_address is None:
                continue  # a block without memory shares none
            shift = address - out_address  # where block's byte 0 lies in out_block's bytes
        out_span = out_span or out.byte_span()
        span = t.byte_span()  # NOTE: broadcasting adds only zero strides: the span is the same
        if (out_span is None or span is None or span[1] + shift <= out_span[0]
                or out_span[1] <= span[0] + shift):
            continue
        layout, out_layout = t.layout(shape), out.layout()
        shifted = (layout[0] + shift, *layout[1:]) if shift else layout  # in out_block's bytes
        if policy == ELEMENTWISE and aliasing.same_elements(shifted, out_layout):
            continue
        if aliasing.overlaps(shifted, out_layout):
            placed = None if block is out_block else (out_block.id, shift)
            found.append(aliasing.describe(f"input {label}", block.id, layout, placed))
    return found


# ---------------------------------------------------------------------- dispatch
def _launch(op: str, out: Tensor, inputs: Sequence[tuple[str, Tensor, tuple]],
            run: Callable[..., None], scalars: dict[int, Any] | None = None,
            also: Sequence[Tensor] = ()) -> Tensor:
    """Run `run(input_views, out_view, *also_views)` under the op's declared aliasing policy.

    `inputs` are (label, tensor, broadcast shape); `scalars` maps argument positions to numbers;
    `also` are further outputs, fresh tensors that overlap nothing. Inside a graph capture the
    launch is recorded on the tape instead (see runtime.tape).
    """
    policy = ALIASING_POLICY[op]
    clashes = _clashes(policy, out, inputs)
    if clashes:
        if config.get_aliasing() == "raise":
            rule = ("may only be the identical view of an input" if policy == ELEMENTWISE
                    else "may not share memory with any input")
            raise AliasingError(
                f"{op}: the output {aliasing.describe('out', out.block.id, out.layout())} "
                f"overlaps {'; '.join(clashes)}. The output of {op} {rule}. Use a separate "
                f"output, or runtime.set_aliasing('copy') to compute through a temporary")
        temp = Tensor._fresh(out.shape, out.dtype, _result_allocator(out))
        try:
            _launch(op, temp, inputs, run, scalars, also)
            device = out.device
            _launch("copy", out, [("x", temp, out.shape)],
                    lambda v, o: device.unary("copy", v[0], o))
        finally:
            temp.release()
        return out
    # NOTE: `run` holds no tensor: a capture keeps it and a replay calls it on other views:
    # Note [closures hold no tensors] in runtime/autograd.py
    recorder = tape.active()
    if recorder is not None:
        recorder.record(op, policy, run, [(t, shape) for _, t, shape in inputs], [out, *also],
                        scalars)
        return out
    views = [t._native_read(op, shape) for _, t, shape in inputs]
    if scalars:
        for position, value in scalars.items():
            views.insert(position, value)
    target = out._native_write(op)
    # NOTE: Note [IEEE results, no floating-point signals] in backends/base.py
    ieee(run, views, target, *[t._native_write(op) for t in also])
    out.block.mark_written()
    for t in also:
        t.block.mark_written()
    return out


def _is_scalar(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _scalar(op: str, x: Any, dtype: np.dtype) -> Any:
    """The number operand `x` of `op` as a `dtype` scalar (rounded to nearest, as NumPy does).

    Infinities and NaN pass, as in NumPy; a finite number that `dtype` cannot hold (a Python
    int beyond float64, 1e300 for float32) is a ValueError naming the op and the number, where
    NumPy would raise OverflowError or compute with an infinity it made up.
    """
    try:
        f = float(x)
    except OverflowError:  # a Python int beyond float64
        f = math.nan
    else:
        if -_LARGEST[dtype] <= f <= _LARGEST[dtype] or not math.isfinite(f):
            return dtype.type(x)  # the common case
        value = ieee(dtype.type, x)  # NOTE: may round down to the largest value, not overflow
        if math.isfinite(value):
            return value
    raise ValueError(f"{op}: the number {_brief(x)} is beyond the largest {dtype}, "
                     f"{np.finfo(dtype).max}; use a smaller number"
                     f"{' or a float64 tensor' if dtype.itemsize < 8 else ''}")


def _result_shape(op: str, tensors: Sequence[Tensor], out: Any) -> tuple[int, ...]:
    """The shape the inputs broadcast to, with out's as in NumPy; ValueError naming them."""
    shapes = [t.shape for t in tensors]
    if isinstance(out, Tensor):
        shapes.append(out.shape)
    try:
        return _broadcast_shapes(shapes)
    except ValueError:
        raise ValueError(f"{op}: shapes {' and '.join(map(str, shapes))} cannot be broadcast "
                         f"together{' (the last is out)' if isinstance(out, Tensor) else ''}"
                         ) from None


def _number_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a number meets `dtype` in: float32 for a two-byte float (its compute dtype,
    as in PyTorch), else `dtype` itself."""
    return _FLOAT32 if dtype in dtypes.HALVES else dtype


#: Each elementwise op's operand labels, operand kinds (None: all FLOAT) and whether it takes
#: any dtype, from backends/optable.py, as `_elementwise` reads them
_SHAPES: dict[str, tuple[tuple[str, ...], tuple[str, ...] | None, bool]] = {
    op.name: (op.params, op.kinds if optable.BOOL in op.operand_kinds else None, op.any_dtype)
    for op in optable.OPS}


def _elementwise(op: str, out: Tensor | None, *operands: Operand) -> Tensor:
    """Run the elementwise kernel named `op`, an op of backends/optable.py (the device's kernel
    has the op's name), under the op's dtype rule: its FLOAT operands Tensors of one float
    dtype (any dtype for copy) or numbers, its BOOL ones bool Tensors."""
    if _fast is not None:  # NOTE: Note [the eager fast path] in runtime/fastpath.py
        result = _fast(op, out, operands)
        if result is not None:
            return result
    labels, kinds, any_dtype = _SHAPES[op]
    # one pass sorts the operands: (label, tensor) pairs, and numbers by argument position
    named: list[tuple[str, Tensor]] = []
    conditions: list[Tensor] = []
    numbers_at: dict[int, Any] = {}
    for i, x in enumerate(operands):
        if kinds is not None and kinds[i] == optable.BOOL:
            if not isinstance(x, Tensor) or x.dtype != np.bool_:
                raise TypeError(f"{op}: {labels[i]} must be a bool Tensor, got "
                                f"{getattr(x, 'dtype', type(x).__name__)} {_brief(x)}")
            conditions.append(x)
        elif isinstance(x, Tensor):
            named.append((labels[i], x))
        elif _is_scalar(x):
            numbers_at[i] = x
        else:
            raise TypeError(f"{op}: operands must be Tensors or real numbers, got "
                            f"{type(x).__name__} {_brief(x)}")
    if not named:
        raise TypeError(f"{op}: needs at least one Tensor operand, got "
                        f"{', '.join(type(x).__name__ for x in operands)} "
                        f"({', '.join(_brief(x) for x in operands)})")
    tensors = [t for _, t in named]
    device, dtype = _common(op, tensors, floats_only=not any_dtype)
    everything = tensors
    if conditions:
        for condition in conditions:
            if condition.block.device is not device:
                a, b = device_names(condition.device, device)
                raise ValueError(f"{op}: the condition is on {a}, the other operands on {b}; "
                                 f"copy one over first")
        everything = [x for x in operands if isinstance(x, Tensor)]
        named = [(label, x) for x, label in zip(operands, labels) if isinstance(x, Tensor)]
    shape = _result_shape(op, everything, out)
    out = _prepare_out(op, out, shape, dtype, tensors[0], everything)
    inputs = [(label, t, shape) for label, t in named]
    wide = _number_dtype(dtype)
    scalars = {i: _scalar(op, x, wide) for i, x in numbers_at.items()}
    if len(operands) == 1:
        _launch(op, out, inputs, lambda v, o: device.unary(op, v[0], o))
    elif len(operands) == 2:
        _launch(op, out, inputs, lambda v, o: device.binary(op, v[0], v[1], o), scalars)
    else:
        _launch(op, out, inputs, lambda v, o: device.ternary(op, v[0], v[1], v[2], o), scalars)
    if autograd.needs_grad(*tensors):
        _record_elementwise(op, out, operands)
    return out


# ---------------------------------------------------------------------- derivatives
def _wants(x: Any) -> bool:
    return isinstance(x, Tensor) and x.requires_grad


#: Each primitive of backends/optable.py on float64 numbers: a derivative whose operands are
#: all numbers (where_finite's a, say) is folded here, not sent to a device
_ON_NUMBERS: dict[str, Callable[..., Any]] = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "sqrt": np.sqrt,
    "abs": np.absolute, "exp": np.exp, "log": np.log, "tanh": np.tanh, "erf": math.erf,
    "lt": np.less, "gt": np.greater, "eq": np.equal, "isnan": np.isnan,
    "isfinite": np.isfinite, "either": np.logical_or, "select": lambda c, a, b: a if c else b,
}


def _run_op(name: str, *values: Any) -> Any:
    """The table's op `name` on tensors (runtime.ops' own function), or on numbers alone."""
    for v in values:
        if isinstance(v, Tensor):
            return _elementwise(name, None, *values)
    numbers = [np.float64(v) for v in values]
    return float(ieee(optable.evaluate, optable.BY_NAME[name].formula, numbers, _ON_NUMBERS))


def _compile(expr: Any, at: dict[str, int]) -> Callable[[Any, Sequence[Any]], Any]:
    """A derivative of backends/optable.py as a function of (g, the saved values) that runs
    the table's ops; `at` says where the output ("output") and each operand ("x<i>") are
    among the saved values."""
    if not isinstance(expr, optable.Expr):
        return lambda g, saved: expr
    if expr.op == "grad":
        return lambda g, saved: g
    if expr.op in ("output", "arg"):
        position = at["output" if expr.op == "output" else f"x{expr.args[0]}"]
        return lambda g, saved: saved[position]
    name, parts = expr.op, [_compile(a, at) for a in expr.args]
    if len(parts) == 1:
        (p0,) = parts
        return lambda g, saved: _run_op(name, p0(g, saved))
    if len(parts) == 2:
        p0, p1 = parts
        return lambda g, saved: _run_op(name, p0(g, saved), p1(g, saved))
    return lambda g, saved: _run_op(name, *[part(g, saved) for part in parts])


def _reads(expr: Any) -> list[str]:
    """What a derivative reads, "output" and "x<i>", in the order it first reads them."""
    found = {"output" if n.op == "output" else f"x{n.args[0]}": None
             for n in optable.nodes(expr) if n.op in ("output", "arg")}
    return list(found)


def _record_elementwise(op: str, out: Tensor, operands: Sequence[Operand]) -> None:
    """Attach the backward function of the elementwise `op`: each operand that wants a
    gradient gets its derivative from backends/optable.py (d out / d operand, times g)."""
    wanted = tuple([_wants(x) for x in operands])
    plan = _PLANS.get((op, wanted))
    if plan is None:
        plan = _PLANS[op, wanted] = _plan(op, wanted)
    saves, fn = plan
    # NOTE: fn gets the tensors it needs as arguments, named like the operands, and holds
    # none: Note [closures hold no tensors] in runtime/autograd.py
    save = [(label, out if i < 0 else operands[i]) for label, i in saves]
    autograd.record(op, out, operands, optable.BY_NAME[op].params, fn, save)


def _plan(op: str, wanted: tuple[bool, ...]) -> tuple:
    """How `_record_elementwise` records `op` when `wanted` says which operands want a
    gradient: what is saved, as (label, operand index or -1 for the output), in the order the
    derivatives read them, and the backward function (made once per op and mask)."""
    entry = optable.BY_NAME[op]
    if entry.derivative is None:
        raise AutogradError(f"{op} has no derivative")
    used = [d if w else None for d, w in zip(entry.derivative, wanted)]
    order = list(dict.fromkeys(key for d in used if d is not None for key in _reads(d)))
    at = {key: position for position, key in enumerate(order)}
    steps = [None if d is None else _compile(d, at) for d in used]

    def fn(g: Tensor, *saved: Any) -> tuple:
        return tuple([None if d is None else d(g, saved) for d in steps])

    saves = [("the output", -1) if key == "output" else
             (entry.params[int(key[1:])], int(key[1:])) for key in order]
    return saves, fn


#: (op, which operands want a gradient) -> `_plan`'s record
_PLANS: dict[tuple[str, tuple[bool, ...]], tuple] = {}


def _swap_last(t: Tensor) -> Tensor:
    """A view with the last two axes swapped (the matrix transpose of a batch)."""
    axes = list(range(t.ndim))
    axes[-2], axes[-1] = axes[-1], axes[-2]
    return t.transpose(axes)


def _matmul_backward(a_shape: tuple, b_shape: tuple, na: bool, nb: bool) -> Callable:
    """d(a @ b): ga = g @ b^T, gb = a^T @ g, with 1-D operands promoted to matrices as NumPy
    does (a as a row, b as a column) and batch broadcasting summed away."""
    # NOTE: made from shapes and flags, so that fn cannot hold a or b:
    # Note [closures hold no tensors] in runtime/autograd.py
    def fn(g: Tensor, b: Tensor | None, a: Tensor | None) -> tuple:
        if len(b_shape) == 1:  # NOTE: b's column first, so that a's row goes before it
            g = g[..., None]
        if len(a_shape) == 1:
            g = g[..., None, :]
        ga = gb = None
        if na:
            bm = b if len(b_shape) > 1 else b.reshape(b_shape[0], 1)
            ga = autograd._unbroadcast(matmul(g, _swap_last(bm)), _matrix(a_shape, True))
            ga = ga.reshape(a_shape)
        if nb:
            am = a if len(a_shape) > 1 else a.reshape(1, a_shape[0])
            gb = autograd._unbroadcast(matmul(_swap_last(am), g), _matrix(b_shape, False))
            gb = gb.reshape(b_shape)
        return ga, gb
    return fn


def _matmul_at(a: Tensor, b: Tensor) -> Tensor:
    """a.T @ b for 2-D a and b; where the eager fast path runs it, without making the view a.T
    (the kernel transposes the native view, as matmul(a.T, b) would have it)."""
    device = a.device
    if (device.capabilities.fast_kernels is not None and b.device is device
            and a.ndim == b.ndim == 2 and a.shape[0] == b.shape[0] and a.dtype == b.dtype
            and a.dtype in FLOAT_DTYPES and not autograd.needs_grad(a, b)):
        done = _fast_launch("matmul", True, None, (a.shape[1], b.shape[1]), a.dtype, (a, b),
                            _matmul_at_kernel, (device,))
        if done is not None:
            return done
    return matmul(a.T, b)


def _matmul_at_kernel(a: Any, b: Any, out: Any, device: Any) -> None:
    device.matmul(a.T, b, out)


def _matrix(shape: tuple, row: bool) -> tuple:
    """The shape of a matmul operand with a 1-D one promoted (a row for a, a column for b)."""
    if len(shape) > 1:
        return shape
    return (1, shape[0]) if row else (shape[0], 1)


# ---------------------------------------------------------------------- elementwise ops
def _public(op: optable.Op) -> Callable[..., Tensor]:
    """runtime.ops.<name> of a public op of backends/optable.py: its parameters, then `out`,
    its docstring; it runs `_elementwise` (Note [one declaration per op])."""
    name = op.name
    if op.params == ("x",):
        def function(x: Operand, out: Tensor | None = None) -> Tensor:
            return _elementwise(name, out, x)
    elif op.params == ("a", "b"):
        def function(a: Operand, b: Operand, out: Tensor | None = None) -> Tensor:
            return _elementwise(name, out, a, b)
    elif op.params == ("cond", "a", "b"):
        def function(cond: Tensor, a: Operand, b: Operand, out: Tensor | None = None) -> Tensor:
            return _elementwise(name, out, cond, a, b)
    else:
        raise ValueError(f"runtime.ops has no function shape for {name}{op.params}: add one "
                         f"to ops._public")
    function.__name__ = function.__qualname__ = name
    function.__doc__ = op.doc
    return function


#: The public elementwise ops of backends/optable.py, in its order.
ELEMENTWISE_OPS = tuple(op.name for op in optable.OPS if op.public)
globals().update({name: _public(optable.BY_NAME[name]) for name in ELEMENTWISE_OPS})
#: GELU's forms (`approximate`), PyTorch's names, and the table op of each.
_GELU_FORMS = {"none": "gelu", "tanh": "gelu_tanh"}


def gelu(x: Operand, approximate: str = "none", out: Tensor | None = None) -> Tensor:
    """The Gaussian error linear unit elementwise, PyTorch's `gelu(x, approximate)`.

    approximate="none": exactly, x * Phi(x), Phi the standard normal's distribution function,
    as x * 0.5 * (1 + erf(x / sqrt(2))); "tanh": the tanh approximation, 0.5 * x * (1 +
    tanh(sqrt(2 / pi) * (x + 0.044715 * x**3))) (`gelu_tanh`). Each in PyTorch's order, with
    PyTorch's gradient. Any other `approximate` is a ValueError. `out` may be x.

    Example:
        >>> import numpy as np, runtime
        >>> x = runtime.tensor(np.float64([-1.0, 0.0, 1.0]))
        >>> runtime.ops.gelu(x).numpy()
        array([-0.15865525,  0.        ,  0.84134475])
        >>> runtime.ops.gelu(x, approximate="tanh").numpy()
        array([-0.15880801,  0.        ,  0.84119199])
    """
    name = _GELU_FORMS.get(approximate) if isinstance(approximate, str) else None
    if name is None:
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh' (PyTorch's), got "
                         f"{_brief(approximate)}")
    return _elementwise(name, out, x)


# NOTE: the names the rest of this module calls, bound for readers and linters alike
add, sub, mul, div, neg, copy, where_finite = (globals()[name] for name in (
    "add", "sub", "mul", "div", "neg", "copy", "where_finite"))


def can_cast(src: Any, dst: Any, *, exact: bool = True) -> bool:
    """Whether `cast` converts tensors of dtype `src` to `dst` (the rule in `cast`)."""
    src, dst = _cast_dtype(src, "can_cast"), _cast_dtype(dst, "can_cast")
    return _cast_refusal(src, dst, as_flag(exact, "can_cast: exact")) is None


def _cast_dtype(dtype: Any, op: str) -> np.dtype:
    """A dtype of cast's, refusing None (which NumPy reads as float64) by name."""
    if dtype is None:
        raise TypeError(f"{op}: dtype None names no dtype (NumPy would read it as float64); "
                        f"name one, e.g. 'float32'")
    return as_dtype(dtype, op)


def _cast_refusal(src: np.dtype, dst: np.dtype, exact: bool) -> str | None:
    """Why `cast` refuses src -> dst, or None where it converts: the one rule of casts."""
    if src == dst or dtypes.is_float(src) and dtypes.is_float(dst):
        return None  # IEEE rounding between floats
    if dtypes.is_float(src):
        return ("a float to an integer or bool would truncate, wrap or lose NaN; convert on "
                "the host, where runtime.tensor(x.numpy(), dtype=...) refuses any value it "
                "would change")
    first = dtypes.first_changed(src, dst)
    if first is None:
        return None  # every value of src is exact in dst
    if dtypes.is_float(dst):
        if not exact:
            return None  # rounded to nearest, as asked
        exactly = 2 ** (dtypes.finfo(dst).nmant + 1)
        became = ieee(np.array(first).astype, dst).item()
        wide = [str(d) for d in dtypes.FLOATS if dtypes.first_changed(src, d) is None]
        return (f"{dst} holds integers exactly only up to {exactly}, and {src} holds {first}, "
                f"which would become {int(became)}; pass exact=False to round such integers "
                f"to nearest, as NumPy and PyTorch do" + (f", or cast to {wide[0]}" if wide
                                                           else ""))
    return (f"{dst} does not hold every {src}: {first} would change; convert on the host, "
            f"where runtime.tensor(x.numpy(), dtype=...) refuses any value it would change")


def cast(x: Tensor, dtype: Any, out: Tensor | None = None, *, exact: bool = True) -> Tensor:
    """x converted to `dtype`, elementwise, on x's device.

    Casts between float dtypes round to nearest even, as IEEE 754 says (a finite value beyond
    the target's range becomes an infinity, as in NumPy and PyTorch; float64 to bfloat16 goes
    through float32, as ml_dtypes does). Integers and bool go wherever every value they hold
    is exact (`runtime.dtypes.first_changed`): into a wider integer, and into a float that
    holds them all (int8 and uint8 into float16 and bfloat16, 16-bit ones into float32,
    32-bit ones into float64). `exact=False` also sends integers into a float that rounds some
    of them (int64 to float32, say), to nearest even, as NumPy and PyTorch do. Everything else
    would change values silently and is refused with a TypeError naming the dtypes and the
    first value that would change (`can_cast` says which): convert on the host instead.
    Gradients flow through casts between float dtypes (the gradient is cast back).

    `out` may not share any memory with x.

    Example:
        >>> import numpy as np, runtime
        >>> half = runtime.ops.cast(runtime.tensor(np.float32([1.0, 0.1, 70000.0])), "float16")
        >>> half.dtype, half.numpy().tolist()
        (dtype('float16'), [1.0, 0.0999755859375, inf])
        >>> big = runtime.tensor(np.int64([2**24 + 1]))
        >>> runtime.ops.cast(big, "float32", exact=False).numpy().tolist()
        [16777216.0]
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"cast: expected a Tensor, got {type(x).__name__} {_brief(x)}")
    target = _cast_dtype(dtype, "cast")
    why = _cast_refusal(x.dtype, target, as_flag(exact, "cast: exact"))
    if why is not None:
        raise TypeError(f"cast: {x.dtype} to {target} is refused: {why}")
    device = x.device
    out = _prepare_out("cast", out, x.shape, target, x, (x,))
    _launch("cast", out, [("x", x, x.shape)], lambda v, o: device.cast(v[0], o))
    if autograd.needs_grad(x) and dtypes.is_float(target):
        source = x.dtype

        def fn(g: Tensor) -> tuple:
            return (cast(g, source),)

        autograd.record("cast", out, (x,), ("x",), fn)
    return out


# ---------------------------------------- batch norm, embedding, dropout
#: The integer dtypes the devices' gather and scatter_add take as indices as they are
_INDEX_DTYPES = (np.dtype("int32"), np.dtype("int64"))


def _wide_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype an op of this section computes a `dtype` tensor in: float32 for float16 and
    bfloat16, as PyTorch's CPU kernels compute them (Note [two-byte floats compute in float32]
    in backends/base.py), else `dtype`."""
    return _FLOAT32 if dtype in dtypes.HALVES else dtype


def _widened(t: Tensor, wide: np.dtype) -> Tensor:
    return t if t.dtype == wide else cast(t, wide)


def _number(op: str, what: str, value: Any, low: float, high: float = math.inf) -> float:
    """`value` as a float in [low, high], or TypeError/ValueError naming op, what and value."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{op}: {what} must be a number, got {_brief(value)}")
    number = float(value)
    if not low <= number <= high:
        raise ValueError(f"{op}: {what} must lie in [{low}, {high}], got {_brief(value)}")
    return number


def _refuse_overlaps(op: str, out: Tensor, inputs: Sequence[tuple[str, Tensor, tuple]]) -> None:
    """Under `runtime.set_aliasing('raise')`, AliasingError where `out` shares memory with an
    input in a way the op's policy forbids, before the op writes anything (its state updates
    included); in "copy" mode the op's last write goes through `_launch`, which copies."""
    if config.get_aliasing() != "raise":
        return
    policy = ALIASING_POLICY[op]
    clashes = _clashes(policy, out, inputs)
    if clashes:
        rule = ("may only be the identical view of an input" if policy == ELEMENTWISE
                else "may not share memory with any input")
        raise AliasingError(
            f"{op}: the output {aliasing.describe('out', out.block.id, out.layout())} overlaps "
            f"{'; '.join(clashes)}. The output of {op} {rule}. Use a separate output, or "
            f"runtime.set_aliasing('copy') to compute through a temporary")


def _channel_operand(op: str, label: str, t: Any, x: Tensor, channels: int) -> Tensor | None:
    """A per-channel operand of batch_norm: None, or a (channels,) float Tensor on x's device
    of x's dtype (or float32 for a two-byte x); TypeError/ValueError naming it otherwise."""
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: {label} must be a Tensor or None, got {_brief(t)}")
    if t.shape != (channels,):
        raise ValueError(f"{op}: {label} has shape {t.shape}, expected ({channels},) for x of "
                         f"shape {x.shape} ({channels} channels on axis 1)")
    if t.device is not x.device:
        where, inputs = device_names(t.device, x.device)
        raise ValueError(f"{op}: {label} is on {where}, x on {inputs}")
    if t.dtype != x.dtype and t.dtype != _wide_dtype(x.dtype):
        raise TypeError(f"{op}: {label} has dtype {t.dtype}, x {x.dtype}; they must match "
                        f"(or be float32 for a two-byte x)")
    return t


def batch_norm(x: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
               weight: Tensor | None = None, bias: Tensor | None = None,
               training: bool = False, momentum: float = 0.1, eps: float = 1e-5,
               out: Tensor | None = None) -> Tensor:
    """Batch normalisation over axis 1 of x (N, C, ...), PyTorch's
    `torch.nn.functional.batch_norm`: y = (x - mean) / sqrt(var + eps) * weight + bias per
    channel.

    In training (`training=True`) mean and var are the batch's, over every axis but 1 (var
    biased), and the gradient flows through them; running_mean and running_var (when given)
    are then updated in place, running = (1 - momentum) * running + momentum * batch, with
    the unbiased variance (the sum of squares over n - 1): here, or at the step's commit point
    inside `state_writes()` (which `nn.train_step` opens). In evaluation the running
    statistics are used and left as they are. float16 and bfloat16 x compute in float32 and
    round the result once; their per-channel operands may be float32.

    Args:
        x: a float Tensor of at least 2 dimensions, channels on axis 1.
        running_mean, running_var: (C,) Tensors, or None (then `training` must be True).
        weight, bias: (C,) Tensors or None (no scale, no shift).
        training: use and update batch statistics (True) or the running ones.
        momentum: in [0, 1]. eps: >= 0, added to the variance.
        out: where the result goes (x's shape and dtype); it may share memory with no input.

    Raises TypeError / ValueError naming a bad argument (in training, a channel with one
    value: the variance needs two), before anything is written.

    Example:
        >>> import numpy as np, runtime
        >>> x = runtime.tensor(np.array([[1.0, 2.0], [3.0, 6.0]]))
        >>> mean, var = runtime.zeros(2, "float64"), runtime.ones(2, "float64")
        >>> runtime.ops.batch_norm(x, mean, var, training=True, eps=0.0).numpy()
        array([[-1., -1.],
               [ 1.,  1.]])
        >>> mean.numpy()   # 0.9 * 0 + 0.1 * [2, 4]
        array([0.2, 0.4])
    """
    op = "batch_norm"
    if not isinstance(x, Tensor):
        raise TypeError(f"{op}: x must be a Tensor, got {_brief(x)}")
    _common(op, [x])
    if x.ndim < 2:
        raise ValueError(f"{op}: x must have at least 2 dimensions (N, C, ...), got shape "
                         f"{x.shape}")
    channels = x.shape[1]
    labels = ("running_mean", "running_var", "weight", "bias")
    running_mean, running_var, weight, bias = (
        _channel_operand(op, label, t, x, channels)
        for label, t in zip(labels, (running_mean, running_var, weight, bias)))
    training = as_flag(training, f"{op}: training")
    if not (isinstance(momentum, Tensor) and momentum.shape == ()):  # NOTE: `_BatchNorm`'s
        momentum = _number(op, "momentum", momentum, 0.0, 1.0)
    eps = _number(op, "eps", eps, 0.0)
    if (running_mean is None) != (running_var is None):
        raise ValueError(f"{op}: pass both running_mean and running_var, or neither")
    count = x.size // channels if channels else 0
    if training and count <= 1:
        raise ValueError(f"{op}: expected more than 1 value per channel when training, got x "
                         f"of shape {x.shape}")
    if not training and running_mean is None:
        raise ValueError(f"{op}: evaluation (training=False) needs running_mean and "
                         f"running_var")
    operands = [t for t in (x, running_mean, running_var, weight, bias) if t is not None]
    if out is not None:
        out = _prepare_out(op, out, x.shape, x.dtype, x, operands)
        _refuse_overlaps(op, out, [(label, t, t.shape) for label, t in zip(
            ("x", *labels), (x, running_mean, running_var, weight, bias)) if t is not None])
    wide = _wide_dtype(x.dtype)
    along = (1, channels) + (1,) * (x.ndim - 2)

    def per_channel(t: Tensor) -> Tensor:
        return _widened(t, wide).reshape(along)

    if training:
        return _batch_norm_training(x, running_mean, running_var, weight, bias, momentum, eps,
                                    out, count, per_channel)
    xw = _widened(x, wide)
    running_mean, running_var = _current_state(running_mean), _current_state(running_var)
    scale = div(1.0, _elementwise("sqrt", None, add(per_channel(running_var), eps)))
    normalised = mul(sub(xw, per_channel(running_mean)), scale)
    y = normalised
    if weight is not None:
        y = mul(y, per_channel(weight))
    if bias is not None:
        y = add(y, per_channel(bias))
    if y.dtype != x.dtype:
        return cast(y, x.dtype, out=out)
    return y if out is None else copy(y, out=out)


def _batch_norm_training(x: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
                         weight: Tensor | None, bias: Tensor | None, momentum: Any, eps: float,
                         out: Tensor | None, count: int,
                         per_channel: Callable[[Tensor], Tensor]) -> Tensor:
    """batch_norm with the batch's statistics, as one autograd node: the forward pass runs
    without recording and saves only the normalised x (one activation, as PyTorch's saves its
    input) and the per-channel 1 / sqrt(var + eps); the backward pass is PyTorch's formula,
    gx = rstd * weight * (g - sum(g) / count - xhat * sum(g * xhat) / count) over every axis
    but 1, whose two sums are the bias's and the weight's gradients. Composed of ops, autograd would
    keep the centred and the normalised x for every layer."""
    channels = x.shape[1]
    recording = autograd.needs_grad(*(t for t in (x, weight, bias) if t is not None))
    with autograd.no_grad():
        xw = _widened(x, _wide_dtype(x.dtype))
        # NOTE: one kernel for both statistics, no temporary of x's size (Note [batch norm's
        # statistics in one kernel])
        mean_, squares = _channel_stats("moments", [("x", xw)])
        var = div(squares, float(count))  # NOTE: biased, as PyTorch normalises
        shifted = add(var, eps)
        root = _elementwise("sqrt", None, shifted)
        rstd = div(1.0, root)
        _release(var, shifted, root)
        xhat = _pointwise([("sub", (("input", 0), ("input", 1))),
                           ("mul", (("link", 0), ("input", 2)))], [xw, mean_, rstd])
        if xw is not x:
            xw.release()
        if running_mean is not None:
            _running_update(running_mean, mean_.reshape(channels), momentum)
            unbiased = div(squares, float(count - 1))
            _running_update(running_var, unbiased.reshape(channels), momentum)
            unbiased.release()
        _release(mean_, squares)
        y = xhat
        if weight is not None and bias is not None:
            y = _pointwise([("mul", (("input", 0), ("input", 1))),
                            ("add", (("link", 0), ("input", 2)))],
                           [xhat, per_channel(weight), per_channel(bias)])
        elif weight is not None:
            y = mul(y, per_channel(weight))
        elif bias is not None:
            y = add(y, per_channel(bias))
        if y.dtype != x.dtype:
            result = cast(y, x.dtype, out=out)
        else:
            result = y if out is None else copy(y, out=out)
        if y is not result and y is not xhat:
            y.release()
    if not recording:
        _release(xhat if xhat is not result else None, rstd)
        return result
    # NOTE: flags and per_channel (which holds a dtype and a shape) only: Note [closures
    # hold no tensors] in runtime/autograd.py
    nw, nb = weight is not None and weight.requires_grad, bias is not None and bias.requires_grad

    def fn(g: Tensor, xhat: Tensor, rstd: Tensor, weight: Tensor | None) -> tuple:
        # NOTE: the weight factored out of both means, as PyTorch's kernel does: mean(gy) =
        # w * sum(g) / count and mean(gy * xhat) = w * sum(g * xhat) / count, the two sums
        # the bias's and the weight's gradients; so g is multiplied once (by xhat, into the
        # sum), not three times, and two passes over g are sums, not four
        gw = _widened(g, xhat.dtype)
        sums, dots = _channel_stats("channel_dots", [("grad", gw), ("xhat", xhat)])
        a = div(sums, float(count))
        b = div(dots, float(count))
        scale = rstd if weight is None else mul(rstd, per_channel(weight))
        # NOTE: ((g - xhat * b) - a) * scale: one pass eagerly, one fused chain in a graph
        u = _pointwise([("mul", (("input", 0), ("input", 1))),
                        ("sub", (("input", 2), ("link", 0))),
                        ("sub", (("link", 1), ("input", 3))),
                        ("mul", (("link", 2), ("input", 4)))], [xhat, b, gw, a, scale])
        _release(gw if gw is not g else None, a, b, scale if scale is not rstd else None)
        gx = u if u.dtype == g.dtype else _narrowed(u, g.dtype)
        g_weight = g_bias = None
        if nw:
            g_weight = _channel_vector(dots, weight.dtype)
        if nb:
            g_bias = _channel_vector(sums, bias_dtype)
        _release(sums, dots)
        return gx, None, None, g_weight, g_bias

    bias_dtype = bias.dtype if bias is not None else None
    autograd.record("batch_norm", result, (x, running_mean, running_var, weight, bias),
                    ("x", "running_mean", "running_var", "weight", "bias"), fn,
                    [("xhat", xhat), ("rstd", rstd), ("weight", weight)])
    _release(xhat if xhat is not result else None, rstd)  # NOTE: the node keeps its own handles
    return result


# Note [an op's pointwise formula in one pass]: an op whose result is a pointwise formula of
# several tensors (batch norm's x-hat, its affine map, its backward) writes the formula once, as
# links of backends/optable.py's ops (`_pointwise`). Eagerly, on a device that compiles fused
# chains, the links run as one `Device.fused` pass into one new tensor, so no link's result
# exists at full size; inside a capture, and elsewhere, each link is its own op, which a graph
# fuses with its neighbours. A compiled chain rounds each link as the link's own kernel does
# (`Device.fused`'s contract, which the device kit's "fused chains" rule holds every device
# to), so both ways give one result, bit for bit, and a captured step keeps eager's bits.
#: (op, args) links: each arg ("input", k), ("link", j) or ("number", value)
Links = Sequence[tuple[str, tuple]]


def _pointwise(links: Links, inputs: Sequence[Tensor]) -> Tensor:
    """The formula `links` over `inputs` (each broadcast to the result's shape) as a new
    tensor (Note [an op's pointwise formula in one pass]), under no_grad."""
    first = inputs[0]
    device, dtype = first.device, first.dtype
    shape = np.broadcast_shapes(*(t.shape for t in inputs))
    if (tape.active() is not None or not device.capabilities.compiles_fused
            or dtype not in (np.float32, np.float64)
            or any(t.dtype != dtype or t.device is not device for t in inputs)):
        results: list[Tensor] = []
        for name, args in links:
            operands = [inputs[ref] if kind == "input" else results[ref] if kind == "link"
                        else ref for kind, ref in args]
            results.append(_elementwise(name, None, *operands))
        _release(*results[:-1])
        return results[-1]
    out = Tensor._fresh(shape, dtype, _result_allocator(first))
    program = [(name, args, dtype) for name, args in links]
    _launch("pointwise", out, [(f"operand {k}", t, shape) for k, t in enumerate(inputs)],
            lambda v, o: device.fused(program, v, o))
    return out


# Note [batch norm's statistics in one kernel]: batch norm's forward needs each channel's mean
# and the sum of squares around it, and its backward the sums of g and of g * x-hat. Composed
# of ops, the forward made the centred x and its square (two temporaries of x's size, four
# passes over it: on ResNet-50 a budget's peak sat on that square) and the backward the
# product g * x-hat. `Device.moments` and `Device.channel_dots` compute each pair in one
# kernel that makes nothing of x's size (the CPU's: two reading passes in C, summed in double;
# OpenCL's: one work item per channel), as PyTorch's CPU kernel does. Eager and a graph call
# the same kernel, so a captured step keeps eager's bits; the order of the additions is the
# device's own, so results differ from NumPy's pairwise sums by rounding only.
def _channel_stats(op: str, inputs: list[tuple[str, Tensor]]) -> tuple[Tensor, Tensor]:
    """`Device.moments` ("moments": the mean and the sum of squares around it) or
    `Device.channel_dots` ("channel_dots": the sums of g and of g * y) of (N, C, ...) float32
    / float64 tensors of one shape, over every axis but 1, under no_grad: two new (1, C, 1,
    ...) tensors."""
    first = inputs[0][1]
    n, c = first.shape[:2]
    spatial = first.size // (n * c) if n * c else 0
    kept = (1, c) + (1,) * (first.ndim - 2)
    results = [Tensor._fresh(kept, first.dtype, _result_allocator(first)) for _ in range(2)]
    flat = [r.reshape(1, c, 1) for r in results]
    views = [(label, t.reshape(n, c, spatial)) for label, t in inputs]
    hook = getattr(first.device, op)  # NOTE: Device.moments or Device.channel_dots
    _launch(op, flat[0], [(label, v, v.shape) for label, v in views],
            lambda v, o, o2: hook(*v, o, o2), also=flat[1:])
    _release(*flat, *(v for _, v in views))
    return results[0], results[1]


def _channel_vector(stat: Tensor, dtype: np.dtype) -> Tensor:
    """A (1, C, 1, ...) statistic as a new (C,) tensor of `dtype` (a parameter's gradient)."""
    vector = stat.reshape(stat.size)  # NOTE: a view of the whole block
    if vector.dtype == dtype:
        return vector
    result = _narrowed(vector, dtype)
    vector.release()
    return result


# Note [state writes wait for the commit point]: batch norm's running statistics and count
# are state a training step writes in its forward pass, long before the optimizer's update.
# Written there, they would move the step's commit point (Note [the commit point] in
# runtime/nn.py) to the first batch norm: a failed backward would leave them updated (and a
# retried step update them twice), a captured "recycle" or "none" replay would have to make
# the whole step's allocations before its first layer, and checkpointing could recompute no
# segment that holds one (runtime/graph/checkpoint.py: a segment that writes into earlier data
# cannot run again). So inside `state_writes()` (which `nn.train_step` opens) each new value
# is computed into a fresh tensor where the old code wrote, and `StateWrites.commit` copies
# them all into their state at the commit point; a later read of that state in the same step
# (a layer called twice) reads the pending value, so the arithmetic is PyTorch's exactly.
# Outside `state_writes()` the writes happen where they are computed, as PyTorch's.
class StateWrites:
    """The state writes of one training step's forward pass held until its commit point
    (Note [state writes wait for the commit point]): `current(state)` is the value a read
    sees, `put(state, value)` holds a new value, `commit()` writes them all, `discard()`
    drops them."""

    def __init__(self) -> None:
        #: id of the state tensor -> (state, its pending value); the state is held, so the
        #: id names it while the entry lives
        self._pending: dict[int, tuple[Tensor, Tensor]] = {}

    def current(self, state: Tensor) -> Tensor:
        entry = self._pending.get(id(state))
        return state if entry is None else entry[1]

    def put(self, state: Tensor, value: Tensor) -> None:
        entry = self._pending.get(id(state))
        self._pending[id(state)] = (state, value)
        if entry is not None and entry[1] is not value:
            entry[1].release()

    def commit(self) -> None:
        """Copy every pending value into its state (allocating nothing) and forget them. Each
        copy is the op "commit_state", which a captured schedule runs after every instruction
        recorded before it (runtime/graph/schedule.py), as here."""
        pending, self._pending = self._pending, {}
        with autograd.no_grad(), tape.phase("update"):
            for state, value in pending.values():
                _launch("commit_state", state, [("value", value, state.shape)],
                        _copy_kernel(state.device))
                value.release()

    def discard(self) -> None:
        """Drop every pending value: the state stays as it was before the step."""
        pending, self._pending = self._pending, {}
        for _, value in pending.values():
            value.release()

    def __len__(self) -> int:
        return len(self._pending)


_STATE_WRITES = threading.local()


def _copy_kernel(device: Any) -> Callable[..., None]:
    return lambda v, o: device.unary("copy", v[0], o)


def _state_writes() -> StateWrites | None:
    """The innermost open `state_writes()` of this thread, or None."""
    stack = getattr(_STATE_WRITES, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def state_writes() -> Iterator[StateWrites]:
    """Hold the state writes of the forward passes inside (batch norm's running statistics
    and num_batches_tracked) until the caller's `commit()`; what is still pending when the
    block ends is committed then, or dropped if the block raises (the state is then as it was
    before), Note [state writes wait for the commit point]."""
    writes = StateWrites()
    stack = _STATE_WRITES.__dict__.setdefault("stack", [])
    stack.append(writes)
    try:
        yield writes
    except BaseException:
        stack.pop()
        writes.discard()
        raise
    stack.pop()
    writes.commit()


def _current_state(state: Tensor) -> Tensor:
    """`state` as the step has it now: its pending value inside `state_writes()`, else itself."""
    writes = _state_writes()
    return state if writes is None else writes.current(state)


def _running_update(stat: Tensor, batch: Tensor, momentum: float | Tensor) -> None:
    """stat = momentum * batch + (1 - momentum) * stat, in batch's dtype (PyTorch's update,
    as its CPU kernel writes it), rounded once into a two-byte stat: in place, or held until
    the commit point inside `state_writes()`. `momentum` may be a 0-d Tensor of batch's dtype
    (BatchNorm's cumulative average, `momentum=None`)."""
    writes = _state_writes()
    old = stat if writes is None else writes.current(stat)
    rest = sub(1.0, momentum) if isinstance(momentum, Tensor) else 1.0 - momentum
    update = add(mul(batch, momentum), mul(_widened(old, batch.dtype), rest))
    if writes is not None:
        writes.put(stat, update if stat.dtype == update.dtype else _narrowed(update, stat.dtype))
    elif stat.dtype == update.dtype:
        copy(update, out=stat)
    else:
        cast(update, stat.dtype, out=stat)


def _count_up(counter: Tensor) -> Tensor:
    """counter += 1, for an integer Tensor of any shape (BatchNorm's num_batches_tracked): on
    the host, between a read and a write of the device's memory, since the devices' arithmetic
    kernels take floats only; in place, or held until the commit point inside
    `state_writes()`. Recorded as one op, so a captured graph counts at every replay."""
    device = counter.device

    def run(v: list, o: Any) -> None:
        device.from_host(device.to_host(v[0]) + 1, o)

    writes = _state_writes()
    if writes is None:
        return _launch("count_up", counter, [("counter", counter, counter.shape)], run)
    new = Tensor._fresh(counter.shape, counter.dtype, _result_allocator(counter))
    _launch("count_up", new, [("counter", writes.current(counter), counter.shape)], run)
    writes.put(counter, new)
    return new


def _indices(op: str, indices: Any, weight: Tensor) -> Tensor:
    """The indices of `embedding` as an int32 or int64 Tensor on weight's device: a Tensor of
    another integer dtype is cast (exactly, or refused by cast), an array-like is checked here
    (ValueError naming the first bad index and the row count, TypeError for non-integers)."""
    rows = weight.shape[0]
    if isinstance(indices, Tensor):
        if indices.dtype.kind not in "iu":
            raise TypeError(f"{op}: indices must be integers, got a {indices.dtype} Tensor")
        if indices.device is not weight.device:
            where, on = device_names(indices.device, weight.device)
            raise ValueError(f"{op}: indices are on {where}, the weight on {on}")
        return indices if indices.dtype in _INDEX_DTYPES else cast(indices, "int64")
    host = host_array(indices, None, f"{op} indices")
    if host.dtype.kind not in "iu":
        raise TypeError(f"{op}: indices must be integers, got {host.dtype} {_brief(indices)}")
    if host.size and (host.min() < 0 or host.max() >= rows):
        bad = host[(host < 0) | (host >= rows)][0]
        raise ValueError(f"{op}: index {bad} is outside [0, {rows}) for a weight of {rows} "
                         f"rows")
    return tensor(host.astype(np.int64, copy=False), device=weight.device,
                  allocator=_result_allocator(weight))


def _padding_index(op: str, padding_idx: Any, rows: int) -> int | None:
    """`padding_idx` as a row in [0, rows), a negative one counted from the end (PyTorch's
    rule), or None; TypeError for a non-integer, ValueError naming the bounds outside them."""
    if padding_idx is None:
        return None
    if isinstance(padding_idx, (bool, np.bool_)) or not isinstance(padding_idx,
                                                                  numbers.Integral):
        raise TypeError(f"{op}: padding_idx must be an int or None, got {_brief(padding_idx)}")
    if not -rows <= padding_idx < rows:
        raise ValueError(f"{op}: padding_idx {padding_idx} is outside [-{rows}, {rows}) for "
                         f"{rows} embeddings")
    return int(padding_idx) % rows


def _renorm_rows(weight: Tensor, flat: Tensor, max_norm: float, norm_type: float) -> None:
    """PyTorch's embedding_renorm_ in place, as one recorded launch (so a captured graph
    renormalises at every replay): each distinct row that `flat` names whose norm exceeds
    max_norm is scaled by max_norm / (norm + 1e-7). On the host: the indices and the weight
    are read back and the weight written whole (a table of R rows costs two copies of it)."""
    device = weight.device
    dtype = weight.dtype
    compute = _FLOAT64 if dtype == _FLOAT64 else _FLOAT32

    def run(v: list, o: Any) -> None:
        table = device.to_host(v[0])
        rows = np.unique(device.to_host(v[1]))
        if rows.size == 0:
            return
        picked = table[rows].astype(np.float64)
        norms = np.linalg.norm(picked, ord=norm_type, axis=1)
        over = norms > max_norm
        if not over.any():
            return
        # NOTE: the scale in double, then a product in the compute dtype rounded once, as
        # PyTorch's `row *= scale` on a float32, half or float64 row
        scale = (max_norm / (norms[over] + 1e-7)).astype(compute)
        scaled = table[rows[over]].astype(compute) * scale[:, None]
        table = table.copy()
        table[rows[over]] = scaled.astype(dtype)
        device.from_host(table, o)

    _launch("embedding_renorm", weight, [("weight", weight, weight.shape),
                                          ("indices", flat, flat.shape)], run)


def embedding(indices: Any, weight: Tensor, padding_idx: int | None = None,
              max_norm: float | None = None, norm_type: float = 2.0,
              out: Tensor | None = None) -> Tensor:
    """Rows of `weight` (num_embeddings, embedding_dim) picked by integer `indices` (any
    shape): the result has shape indices.shape + (embedding_dim,), PyTorch's
    `torch.nn.functional.embedding`. The weight's gradient adds the gradient of every use of a
    row into it, repeated indices accumulating one after another in their order (np.add.at),
    the same bits on every backend (`Device.scatter_add`).

    `indices` is an integer Tensor on weight's device or an array-like of ints; each must lie
    in [0, num_embeddings): ValueError naming the first that does not and the row count,
    before anything is written. `out` may not share memory with the weight.

    As PyTorch's: the row `padding_idx` (negative: counted from the end) gets no gradient;
    with `max_norm`, each distinct row looked up whose `norm_type`-norm is above max_norm is
    first scaled in place to max_norm / (norm + 1e-7) of itself (not recorded for gradients:
    PyTorch's embedding_renorm_; the weight's version moves, so a product that saved the same
    weight refuses its backward, as PyTorch's does).

    Example:
        >>> import numpy as np, runtime
        >>> w = runtime.tensor(np.arange(6.0).reshape(3, 2))
        >>> runtime.ops.embedding([2, 0, 2], w).numpy()
        array([[4., 5.],
               [0., 1.],
               [4., 5.]])
    """
    op = "embedding"
    if not isinstance(weight, Tensor):
        raise TypeError(f"{op}: weight must be a Tensor, got {_brief(weight)}")
    if weight.ndim != 2:
        raise ValueError(f"{op}: weight must be 2-D (num_embeddings, embedding_dim), got shape "
                         f"{weight.shape}")
    padding = _padding_index(op, padding_idx, weight.shape[0])
    if max_norm is not None:
        max_norm = _number(op, "max_norm", max_norm, -math.inf)
        norm_type = _number(op, "norm_type", norm_type, -math.inf)
    index = _indices(op, indices, weight)
    device, dtype = weight.device, weight.dtype
    rows, dim = weight.shape
    shape = index.shape + (dim,)
    out = _prepare_out(op, out, shape, dtype, weight, (weight,))
    count = index.size
    flat = index.reshape(count)
    if out.is_contiguous():
        target = out.reshape(count, dim)
    else:  # NOTE: the kernel writes (count, dim): a strided out gets a copy
        _refuse_overlaps(op, out, [("weight", weight, weight.shape)])
        target = Tensor._fresh((count, dim), dtype, _result_allocator(weight))
    with autograd.no_grad():
        if max_norm is not None:
            _renorm_rows(weight, flat, max_norm, norm_type)
        _launch(op, target, [("weight", weight, weight.shape), ("indices", flat, flat.shape)],
                lambda v, o: device.gather(v[0], v[1], o))
        if target.block is not out.block:
            copy(target.reshape(shape), out=out)
    if autograd.needs_grad(weight):
        # NOTE: shapes, not tensors: Note [closures hold no tensors] in runtime/autograd.py
        def fn(g: Tensor, index: Tensor) -> tuple:
            g2 = g.reshape(count, dim)
            result = Tensor._fresh((rows, dim), g.dtype, g.block.allocator)
            _launch("embedding_backward", result, [("grad", g2, g2.shape),
                                                   ("indices", index, index.shape)],
                    lambda v, o: _scatter_rows(device, v[0], v[1], o))
            if padding is not None:  # NOTE: the padding row's uses add nothing, as PyTorch's
                row = result[padding]
                _fill(row, 0.0)
                row.release()
            return (result,)

        autograd.record(op, out, (weight,), ("weight",), fn, [("indices", flat)])
    return out


def _scatter_rows(device: Any, grad: Any, indices: Any, out: Any) -> None:
    """out = zeros, then out[indices[i]] += grad[i] in index order (embedding's backward)."""
    device.from_host(np.zeros(out.shape, out.dtype), out)
    device.scatter_add(grad, indices, out)


class Generator:
    """Where dropout's masks come from: a seed and, on each device, how many masks were
    drawn, kept in a small int64 Tensor there, [seed, count]. Mask k depends on (seed, k) and
    the shape and probability alone (NumPy's generator seeded with both), so the masks of a
    step are the same whether it runs eagerly or as a captured graph: a replay reads the
    count on the device and moves it on, as the eager call does. `manual_seed` starts the
    stream again (writing the tensors, so graphs that captured them see it too).

    Example:
        >>> import numpy as np, runtime
        >>> x = runtime.tensor(np.ones(6, np.float32))
        >>> a = runtime.ops.dropout(x, 0.5, generator=runtime.ops.Generator(7)).numpy()
        >>> b = runtime.ops.dropout(x, 0.5, generator=runtime.ops.Generator(7)).numpy()
        >>> bool((a == b).all()) and set(a.tolist()) <= {0.0, 2.0}
        True
    """

    def __init__(self, seed: int | None = None) -> None:
        #: by device, the [seed, masks drawn] Tensor the draws read and move on
        self._states: dict[Any, Tensor] = {}
        self.seed = self._seed(seed)

    @staticmethod
    def _seed(seed: Any) -> int:
        if seed is None:
            return int(np.random.SeedSequence().entropy % 2**63)
        if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"Generator: seed must be an int, got {_brief(seed)}")
        if not 0 <= seed < 2**63:
            raise ValueError(f"Generator: seed must lie in [0, 2**63), got {seed}")
        return int(seed)

    def manual_seed(self, seed: int) -> Generator:
        """Start again from mask 0 of `seed`; returns self."""
        self.seed = self._seed(seed)
        with autograd.no_grad():
            for state in self._states.values():
                state[...] = np.array([self.seed, 0], np.int64)
        return self

    def state(self, like: Tensor) -> Tensor:
        """The [seed, masks drawn] Tensor on like's device (made at its first draw there)."""
        state = self._states.get(like.device)
        if state is None:
            state = tensor(np.array([self.seed, 0], np.int64), device=like.device,
                           allocator=_result_allocator(like))
            self._states[like.device] = state
        return state

    def __repr__(self) -> str:
        return f"Generator(seed={self.seed})"


#: The generator `dropout` draws from when it is given none.
default_generator = Generator()


def _mask(seed: int, k: int, shape: tuple[int, ...], p: float, dtype: np.dtype) -> np.ndarray:
    """Mask k of `seed`: 1 / (1 - p) where a uniform draw is >= p (kept), else 0, in dtype
    (the scale computed as PyTorch computes it: in float32 for float32 and the halves)."""
    keep = np.random.default_rng([seed, k]).random(shape) >= p
    if p >= 1.0:
        scale = np.float64(0.0)
    elif dtype == _FLOAT64:
        scale = np.float64(1.0) / np.float64(1.0 - p)
    else:
        scale = np.float32(1.0) / np.float32(1.0 - p)
    return np.where(keep, scale, scale.dtype.type(0)).astype(dtype)


def dropout(x: Tensor, p: float = 0.5, training: bool = True,
            generator: Generator | None = None, out: Tensor | None = None) -> Tensor:
    """Inverted dropout, PyTorch's `torch.nn.functional.dropout`: in training each element is
    zeroed with probability p and the others scaled by 1 / (1 - p); otherwise (or with p 0)
    x itself is returned (copied into `out` when given). The mask comes from `generator`
    (default: `default_generator`): see `Generator` for why a captured graph draws the same
    masks as eager calls, and docs/layers-state.md for how a recomputed segment keeps them.
    `out` may be x itself and may not overlap it otherwise.

    Raises TypeError / ValueError naming a bad argument (p outside [0, 1]) before anything is
    drawn or written.
    """
    op = "dropout"
    if not isinstance(x, Tensor):
        raise TypeError(f"{op}: x must be a Tensor, got {_brief(x)}")
    _common(op, [x])
    p = _number(op, "p (the probability of zeroing an element)", p, 0.0, 1.0)
    training = as_flag(training, f"{op}: training")
    if generator is not None and not isinstance(generator, Generator):
        raise TypeError(f"{op}: generator must be an ops.Generator or None, got "
                        f"{_brief(generator)}")
    if out is not None:
        out = _prepare_out(op, out, x.shape, x.dtype, x, (x,))
    if not training or p == 0.0 or x.size == 0:
        return x if out is None or out is x else copy(x, out=out)
    if out is not None:
        _refuse_overlaps("dropout", out, [("x", x, x.shape)])
    state = (generator or default_generator).state(x)
    device, dtype, shape = x.device, x.dtype, x.shape
    mask = Tensor._fresh(shape, dtype, _result_allocator(x))

    def run(v: list, o: Any, m: Any) -> None:
        seed, k = (int(n) for n in device.to_host(v[0]))
        device.from_host(np.array([seed, k + 1], np.int64), o)
        device.from_host(_mask(seed, k, shape, p, dtype), m)

    _launch("dropout_mask", state, [("state", state, state.shape)], run, also=(mask,))
    return mul(x, mask, out=out)


__all__ += ["Generator", "batch_norm", "default_generator", "dropout", "embedding"]
ALIASING_POLICY.update({"batch_norm": NEVER, "embedding": NEVER, "embedding_backward": NEVER,
                        # NOTE: x * mask: out may be x itself
                        "dropout": ELEMENTWISE,
                        # NOTE: both write their state in place (the identical view)
                        "count_up": ELEMENTWISE, "dropout_mask": ELEMENTWISE,
                        "embedding_renorm": ELEMENTWISE, "commit_state": NEVER})



def _sub_scaled(a: Tensor, b: Tensor, scale: Any, out: Tensor | None = None,
                scratch: Tensor | None = None) -> Tensor:
    """a - scale * b with the product rounded to the dtype first: bit for bit
    `sub(a, mul(b, scale, out=scratch), out=out)`, in one pass where the device can
    (`Device.sub_scaled`); plain SGD's update. a and b broadcast to one shape (and out's, as in
    sub) and have one dtype and device; `out` may be a itself (the policy of sub). `scratch`
    (the result's shape and dtype, sharing memory with nothing) is where a device without the
    one-pass kernel puts the product, so that the update allocates nothing (Note [the commit
    point] in runtime/nn.py). Records no gradient: an input that requires one, with gradients
    on, is an AutogradError before anything is written."""
    if autograd.needs_grad(a, b):
        raise AutogradError("sub_scaled has no derivative: run it under runtime.no_grad() or on "
                            "tensors that do not require grad")
    if _fast is not None:  # NOTE: Note [the eager fast path] in runtime/fastpath.py
        result = _fast("sub_scaled", out, (a, b, scale))
        if result is not None:
            return result
    device, dtype = _common("sub_scaled", [a, b])
    shape = _result_shape("sub_scaled", [a, b], out)
    value = _scalar("sub_scaled", scale, _number_dtype(dtype))
    out = _prepare_out("sub_scaled", out, shape, dtype, a, (a, b))
    also: tuple[Tensor, ...] = ()
    if scratch is not None:
        if (not isinstance(scratch, Tensor) or scratch.shape != shape or scratch.dtype != dtype
                or scratch.device is not device):
            raise ValueError(f"sub_scaled: scratch must be a {dtype} Tensor of shape {shape} on "
                             f"{device.name}, got {_brief(scratch)}")
        also = (scratch,)
    _launch("sub_scaled", out, [("a", a, shape), ("b", b, shape)],
            lambda v, o, *t: device.sub_scaled(v[0], v[1], value, o, t[0] if t else None),
            also=also)
    return out


# ---------------------------------------------------------------------- matmul
def _matmul_shape(a: Tensor, b: Tensor) -> tuple[int, ...]:
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError(f"matmul: operands must have at least one dimension, got shapes "
                         f"{a.shape} and {b.shape}")
    ka = a.shape[-1]
    kb = b.shape[0] if b.ndim == 1 else b.shape[-2]
    if ka != kb:
        raise ValueError(f"matmul: shapes {a.shape} and {b.shape} do not align: "
                         f"{ka} (last dim of a) != {kb} ({'dim 0' if b.ndim == 1 else 'dim -2'} "
                         f"of b)")
    batch_a = a.shape[:-2]
    batch_b = b.shape[:-2]
    try:
        batch = _broadcast_shapes([batch_a, batch_b])
    except ValueError:
        raise ValueError(f"matmul: batch dimensions {batch_a} and {batch_b} cannot be "
                         f"broadcast together") from None
    rows = (a.shape[-2],) if a.ndim >= 2 else ()
    cols = (b.shape[-1],) if b.ndim >= 2 else ()
    return tuple(batch) + rows + cols


def _autocast(*operands: Any) -> tuple[Any, ...]:
    """The operands of a product inside `runtime.amp.autocast(half)`: each float32 (or other
    two-byte) tensor cast to `half`, differentiably; float64 tensors, `half` ones, other
    dtypes and None as they are.

    Note [autocast in ops]: inside `amp.autocast(half)`, `matmul` and `linear` compute in
    `half` and `cross_entropy` in float32, as torch.autocast runs its lower-precision and
    float32 lists: a product's float32 operands are cast to `half`, and two-byte logits to
    float32. As in PyTorch, float64 is left alone (a product of float64 and float32 then
    refuses its mixed dtypes, by name), a call with `out=` is not autocast (it runs in its
    inputs' dtype), and the backward pass runs without autocast (`backward()` turns it off), so
    each backward op computes in the dtypes its forward op chose. Each call casts again:
    `nn.Dense` keeps working copies of its parameters instead (`amp.linear`), so a training
    step casts each of its weights once.
    """
    half = _mode.autocast
    return tuple(cast(t, half) if isinstance(t, Tensor) and t.dtype != half
                 and t.dtype != _FLOAT64 and dtypes.is_float(t.dtype) else t for t in operands)


def matmul(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """The matrix product a @ b (NumPy's rules for 1-D and batched operands).

    `out` may not share any memory with a or b; see runtime.set_aliasing.

    Example:
        >>> import numpy as np, runtime
        >>> a = runtime.tensor(np.eye(2))
        >>> runtime.ops.matmul(a, a).numpy()
        array([[1., 0.],
               [0., 1.]])
    """
    if _mode.autocast is not None and out is None:
        a, b = _autocast(a, b)
    device, dtype = _common("matmul", [a, b])
    shape = _matmul_shape(a, b)
    done = _fast_launch("matmul", True, out, shape, dtype, (a, b), device.matmul, ())
    if done is not None:
        out = done
    else:
        out = _prepare_out("matmul", out, shape, dtype, a, (a, b))
        inputs = [("a", a, a.shape), ("b", b, b.shape)]
        _launch("matmul", out, inputs, lambda v, o: device.matmul(v[0], v[1], o))
    if autograd.needs_grad(a, b):
        na, nb = a.requires_grad, b.requires_grad
        autograd.record("matmul", out, (a, b), ("a", "b"),
                        _matmul_backward(a.shape, b.shape, na, nb),
                        [("b", b if na else None), ("a", a if nb else None)])
    return out


def _launch_linear(x: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor | None,
                   shape: tuple[int, ...], dtype: np.dtype, operands: list[Tensor]) -> Tensor:
    """linear's `_prepare_out` and `_launch`, in Python."""
    device, features = x.device, weight.shape[0]
    out = _prepare_out("linear", out, shape, dtype, x, operands)
    with autograd.no_grad():
        inputs = [("x", x, x.shape), ("weight", weight.T, (weight.shape[1], features))]
        if bias is not None:
            inputs.append(("bias", bias, shape))
        biased = bias is not None  # NOTE: not `bias`: Note [closures hold no tensors]

        def run(v: list, o: Any) -> None:
            _linear_views(device, v[0], v[1], v[2] if biased else None, o)

        _launch("linear", out, inputs, run)
    return out


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None,
           out: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias, as PyTorch's linear: weight is (out_features, in_features), bias
    (out_features,) or None, x (..., in_features). One op with one backward, so the weight's
    gradient comes out contiguous in the weight's own layout (g.T @ x).

    `out` may not share any memory with the inputs.
    """
    if _mode.autocast is not None and out is None:
        x, weight, bias = _autocast(x, weight, bias)
    operands = [x, weight] if bias is None else [x, weight, bias]
    device, dtype = _common("linear", operands)
    if weight.ndim != 2 or x.ndim < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: x of shape {x.shape} needs a last dimension equal to "
                         f"in_features of a 2-D weight; the weight has shape {weight.shape}")
    features = weight.shape[0]
    if bias is not None and bias.shape != (features,):
        raise ValueError(f"linear: bias has shape {bias.shape}, expected ({features},)")
    shape = x.shape[:-1] + (features,)
    done = None
    # NOTE: the kernel broadcasts
    if bias is not None and device.capabilities.fast_kernels is not None:
        done = _fast_launch("linear", True, out, shape, dtype, (x, weight, bias),
                            _linear_kernel, (device,))
    if done is not None:
        out = done
    else:
        out = _launch_linear(x, weight, bias, out, shape, dtype, operands)
    if autograd.needs_grad(*operands):
        nx, nw = x.requires_grad, weight.requires_grad
        nb = bias is not None and bias.requires_grad
        # NOTE: x's shape, not x; x and w come saved, as arguments: Note [closures hold no tensors]
        # in runtime/autograd.py
        x_shape = x.shape
        # NOTE: the products of a 2-D x go straight to the launch when g is what it must be (a
        # gradient of out's shape, dtype and device, gradients off, as in backward()): the
        # checks of matmul and _matmul_at hold already; anything else takes their full road
        direct = len(x_shape) == 2 and device.capabilities.fast_kernels is not None
        weight_shape = weight.shape

        def fn(g: Tensor, x: Tensor | None, w: Tensor | None) -> tuple:
            gx = gw = None
            if (direct and g.shape == shape and g.dtype is dtype and g.block.device is device
                    and not autograd._mode.enabled):
                if nx:
                    gx = _fast_launch("matmul", True, None, x_shape, dtype, (g, w),
                                      device.matmul, ())
                if nw:
                    gw = _fast_launch("matmul", True, None, weight_shape, dtype, (g, x),
                                      _matmul_at_kernel, (device,))
            g2 = g if len(g.shape) == 2 else g.reshape(-1, features)
            if nx and gx is None:
                gx = matmul(g, w)
            if nw and gw is None:
                gw = _matmul_at(g2, x if len(x.shape) == 2 else x.reshape(-1, x_shape[-1]))
            gb = sum(g2, axis=0) if nb else None
            return gx, gw, gb

        autograd.record("linear", out, operands, ("x", "weight", "bias"), fn,
                        [("x", x if nw else None), ("weight", weight if nx else None)])
    return out


def cross_entropy(logits: Tensor, labels: Any, out: Tensor | None = None) -> Tensor:
    """Softmax cross-entropy of each row of `logits` (rows, classes) against integer class
    indices `labels` (rows,): logsumexp(row) - row[label], computed stably. Returns (rows,).

    `labels` is an integer array-like (checked here) or an integer Tensor on the same device
    (checked by the kernel). Raises ValueError for labels of the wrong shape or outside
    [0, classes), TypeError for non-integer labels. `out` may not share memory with the inputs.
    """
    if (_mode.autocast is not None and out is None and isinstance(logits, Tensor)
            and logits.dtype in dtypes.HALVES):
        logits = cast(logits, _FLOAT32)  # NOTE: Note [autocast in ops]
    device, dtype = _common("cross_entropy", [logits])
    if logits.ndim != 2:
        raise ValueError(f"cross_entropy: logits must be (rows, classes), got shape "
                         f"{logits.shape}")
    rows, classes = logits.shape
    if isinstance(labels, Tensor):
        label_tensor = labels
        kind, shape = labels.dtype.kind, labels.shape
        if labels.device is not device:
            where, logits_on = device_names(labels.device, device)
            raise ValueError(f"cross_entropy: labels are on {where}, logits on {logits_on}")
    else:
        host = host_array(labels, None, "label tensor")
        kind, shape = host.dtype.kind, host.shape
        if kind in "iu" and shape == (rows,):
            _check_labels(host, classes)
            label_tensor = tensor(host.astype(np.int64, copy=False), device=device,
                                  allocator=_result_allocator(logits))
    if kind not in "iu":
        raise TypeError(f"cross_entropy: labels must be integer class indices, got "
                        f"{labels.dtype if isinstance(labels, Tensor) else host.dtype}")
    if shape != (rows,):
        raise ValueError(f"cross_entropy: labels have shape {shape}, expected ({rows},) "
                         f"for logits of shape {logits.shape}")
    out = _prepare_out("cross_entropy", out, (rows,), dtype, logits, (logits,))
    probs = Tensor._fresh((rows, classes), dtype, _result_allocator(logits))
    _launch("cross_entropy", out, [("logits", logits, logits.shape),
                                   ("labels", label_tensor, (rows,))],
            lambda v, o, p: device.cross_entropy(v[0], v[1], o, p), also=(probs,))
    if autograd.needs_grad(logits):
        # NOTE: probs and labels come saved, as arguments:
        # Note [closures hold no tensors] in runtime/autograd.py
        def fn(g: Tensor, probs: Tensor, labels: Tensor) -> tuple:
            # NOTE: every operand is known good (saved by this op, g of its output's shape)
            done = _fast_launch("cross_entropy_backward", True, None, probs.shape, probs.dtype,
                                (probs, labels, g), _cross_entropy_backward_kernel, (device,))
            if done is not None:
                return (done,)
            result = Tensor._fresh(probs.shape, probs.dtype, probs.block.allocator)
            _launch("cross_entropy_backward", result,
                    [("probs", probs, probs.shape), ("labels", labels, labels.shape),
                     ("grad", g, g.shape)],
                    lambda v, o: device.cross_entropy_backward(v[0], v[1], v[2], o))
            return (result,)

        autograd.record("cross_entropy", out, (logits,), ("logits",), fn,
                        [("softmax", probs), ("labels", label_tensor)])
    return out


def _check_labels(labels: np.ndarray, classes: int) -> None:
    """ValueError naming the first label outside [0, classes) (the kernels check them too)."""
    if labels.size and (labels.min() < 0 or labels.max() >= classes):
        bad = labels[(labels < 0) | (labels >= classes)][0]
        raise ValueError(f"cross_entropy: label {bad} is outside [0, {classes}) for "
                         f"{classes} classes")


# ---------------------------------------------------------------------- reductions
# ---------------------------------------- convolution and pooling
# conv2d and avg_pool2d launch no kernel of their own (docs/layers.md). A padded copy of x
# (the `copy` kernel, broadcasting one number into the border), its sliding windows as one
# strided view (`Tensor._view`: window offsets are strides too) copied into a contiguous
# column tensor (im2col), and products (`matmul`) make a convolution; average pooling runs
# `add` over the kh * kw window views. So they run on every device that runs the table's
# kernels and products, inside a graph capture too (each step is an op with its own launch),
# and every temporary comes from an allocator and goes back as soon as it is used. Max
# pooling is the device's kernel pair (`Device.max_pool2d`, which keeps where each maximum
# came from, and `Device.max_pool2d_backward`, which adds the gradient there), whose
# default every device has (on the host, by the CPU's NumPy formula).

#: PyTorch's keywords that these ops do not take, with the value that means "not used":
#: passing that value is accepted, any other is refused by name (never silently ignored).
_UNSUPPORTED = {
    "conv2d": {"dilation": 1, "groups": 1},
    "max_pool2d": {"dilation": 1, "ceil_mode": False, "return_indices": False},
    "avg_pool2d": {"ceil_mode": False, "count_include_pad": True, "divisor_override": None},
}
# NOTE: every product of a convolution is one 2-D product for the whole batch, its columns
# laid out channels first, (C*kh*kw, N*Ho*Wo): measured against one product per image
# (batched, columns (N, C*kh*kw, Ho*Wo)) on ResNet-50's layers, it is as fast or faster on
# each (up to 2x on 7x7 images, where per-image products are thin), and it runs on the
# device's 2-D product (the CPU's chosen CBLAS) rather than a batched one, for the price of
# transposing the output and g between (N, O, ...) and (O, N, ...): benchmarks/bench_conv.py.


def _refuse_keywords(op: str, given: dict[str, Any]) -> None:
    """TypeError for a keyword the op does not know; ValueError for one of PyTorch's that
    blockrt does not implement, unless it has its no-op value."""
    known = _UNSUPPORTED[op]
    for name, value in given.items():
        if name not in known:
            raise TypeError(f"{op}() got an unexpected keyword argument {name!r}")
        default = known[name]
        same = value is default or (
            not isinstance(value, (bool, np.bool_)) and isinstance(default, int)
            and not isinstance(default, bool)
            and (value == default or value in ((default, default), [default, default])))
        if not same:
            raise ValueError(f"{op}: {name}={_brief(value)} is not supported (blockrt's {op} "
                             f"has no {name}; only {name}={default!r}, PyTorch's default)")


def _pair(op: str, what: str, value: Any, least: int) -> tuple[int, int]:
    """An int or a pair of ints (height, width), each at least `least`."""
    items = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if len(items) != 2 or any(isinstance(v, (bool, np.bool_)) or
                              not isinstance(v, numbers.Integral) for v in items):
        raise TypeError(f"{op}: {what} must be an int or a pair of ints, got {_brief(value)}")
    pair = (int(items[0]), int(items[1]))
    if min(pair) < least:
        raise ValueError(f"{op}: {what} must be at least {least}, got {_brief(value)}")
    return pair


def _image(op: str, x: Tensor, what: str = "x") -> tuple[int, int, int, int]:
    if x.ndim != 4:
        raise ValueError(f"{op}: {what} must be 4-D (batch, channels, height, width), got "
                         f"shape {x.shape}")
    return x.shape


def _geometry(op: str, shape: tuple[int, ...], kernel: tuple[int, int],
              stride: tuple[int, int], padding: tuple[int, int]) -> tuple:
    """(kernel, stride, padding, padded size, output size), each an (h, w) pair; ValueError
    when the kernel does not fit in the padded input."""
    h, w = shape[2:]
    padded = (h + 2 * padding[0], w + 2 * padding[1])
    if kernel[0] > padded[0] or kernel[1] > padded[1]:
        raise ValueError(f"{op}: the kernel {kernel[0]}x{kernel[1]} is bigger than the padded "
                         f"input {padded[0]}x{padded[1]} (input {h}x{w}, padding "
                         f"{padding[0]},{padding[1]})")
    size = ((padded[0] - kernel[0]) // stride[0] + 1, (padded[1] - kernel[1]) // stride[1] + 1)
    return kernel, stride, padding, padded, size


def _window(xp: Tensor, geometry: tuple, i: int, j: int) -> Tensor:
    """The (N, C, Ho, Wo) view of the padded `xp` that window offset (i, j) reads."""
    (_, _), (sh, sw), _, _, (ho, wo) = geometry
    n, c = xp.shape[:2]
    sn, sc, sy, sx = xp.strides
    return xp._view((n, c, ho, wo), (sn, sc, sy * sh, sx * sw), xp.offset + i * sy + j * sx)


def _columns(xp: Tensor, geometry: tuple) -> Tensor:
    """im2col: the windows of the padded `xp` as one strided view, (C, kh, kw, N, Ho, Wo),
    copied into a contiguous (C*kh*kw, N*Ho*Wo) tensor."""
    (kh, kw), (sh, sw), _, _, (ho, wo) = geometry
    n, c = xp.shape[:2]
    sn, sc, sy, sx = xp.strides
    windows = xp._view((c, kh, kw, n, ho, wo), (sc, sy, sx, sn, sy * sh, sx * sw), xp.offset)
    columns = copy(windows)
    windows.release()
    view = columns.reshape(c * kh * kw, n * ho * wo)
    columns.release()
    return view


def _fill_value(like: Tensor, value: float) -> Tensor:
    """A 0-d tensor holding `value` in like's dtype, on like's device (a fill to broadcast)."""
    return tensor(np.full((), value, like.dtype), device=like.device,
                  allocator=_result_allocator(like))


def _padded(x: Tensor, padding: tuple[int, int], value: float, below: int = 0) -> Tensor:
    """x inside a border of `value`, `padding` wide (and `below` more rows of it at the
    bottom): a new tensor, or x itself when there is no border (the caller releases only
    what is not x)."""
    ph, pw = padding
    if ph == pw == below == 0:
        return x
    n, c, h, w = x.shape
    xp = Tensor._fresh((n, c, h + 2 * ph + below, w + 2 * pw), x.dtype, _result_allocator(x))
    fill = _fill_value(x, value)
    # NOTE: the border only, in four strips: the interior is written once, by the copy of x
    strips = [xp[:, :, :ph]] if ph else []
    if ph + below:
        strips.append(xp[:, :, ph + h:])
    if pw:
        strips += [xp[:, :, ph:ph + h, :pw], xp[:, :, ph:ph + h, pw + w:]]
    for strip in strips:
        copy(fill, out=strip)
        strip.release()
    fill.release()
    interior = xp[:, :, ph:ph + h, pw:pw + w]
    copy(x, out=interior)
    interior.release()
    return xp


def _interior(xp: Tensor, padding: tuple[int, int], shape: tuple[int, ...],
              out: Tensor | None = None) -> Tensor:
    """The unpadded part of a padded gradient, copied into `out` when given, else as a new
    contiguous tensor (xp released), or xp itself when there is no border (nor wide rows'
    extra row) and no `out`."""
    ph, pw = padding
    h, w = shape[2:]
    if xp.shape[2:] == (h, w) and out is None:
        return xp
    view = xp[:, :, ph:ph + h, pw:pw + w]
    result = copy(view, out=out)
    view.release()
    xp.release()
    return result


def _zeros_like_padded(x_shape: tuple[int, ...], geometry: tuple, like: Tensor) -> Tensor:
    """A zeroed (N, C, Hp, Wp) tensor, for a gradient that windows add into."""
    hp, wp = geometry[3]
    result = Tensor._fresh((x_shape[0], x_shape[1], hp, wp), like.dtype, _result_allocator(like))
    _fill(result, 0.0)
    return result


def _guarded(op: str, out: Tensor | None, shape: tuple[int, ...], dtype: np.dtype,
             operands: Sequence[Tensor], labels: Sequence[str],
             compute: Callable[[Tensor], None]) -> Tensor:
    """Run `compute(target)` under the op's aliasing policy (NEVER): into a new tensor, or
    into `out` when out shares no memory with an operand. An overlapping `out` raises
    AliasingError in "raise" mode (through `_launch`, which words it) and, in "copy" mode, gets
    the result through a temporary."""
    like = operands[0]
    target = _prepare_out(op, out, shape, dtype, like, operands)  # NOTE: with gradients on
    with autograd.no_grad():
        if out is None:
            compute(target)
            return target
        inputs = [(label, t, t.shape) for label, t in zip(labels, operands)]
        if _clashes(NEVER, out, inputs):
            if config.get_aliasing() == "raise":
                _launch(op, out, inputs, _no_launch)  # NOTE: raises, naming op and operands
            temp = Tensor._fresh(shape, dtype, _result_allocator(like))
            compute(temp)
            copy(temp, out=out)
            temp.release()
            return out
        compute(out)
    return out


def _wide_rows(geometry: tuple, device: Any) -> bool:
    """Whether a convolution runs on wide rows: at stride 1, each output row as wide as a
    padded input row (Wp, not Wo), so that window (i, j) of the columns is one flat stretch of
    the padded image, at offset i * Wp + j, and im2col and col2im copy and add long
    contiguous rows, not rows of Wo. The Wp - Wo columns more of each row are computed and
    dropped (the products grow by Wp / Wo), so only where that costs at most 5%: on
    ResNet-50's 3x3 64->64 layer at 56x56 (3.6% more) its step took 0.86 of the narrow one's
    (median of 11 paired rounds), at 28x28 (7% more) 1.02. Never on a device that makes the
    columns itself (`Capabilities.conv_columns`: one pass, no padded copy)."""
    (kh, kw), (sh, sw), padding, (_, wp), (_, wo) = geometry
    pointwise = kh == kw == 1 and padding == (0, 0)
    return (sh == sw == 1 and not pointwise and wp * 20 <= wo * 21
            and not device.capabilities.conv_columns)


def _conv_columns(x: Tensor, geometry: tuple) -> Tensor:
    """x's columns, (C*kh*kw, N*Ho*Wo) (wide: (C*kh*kw, N*Ho*Wp), `_wide`): a view of x
    itself for one image under a 1x1 kernel with stride 1 and no padding, else a new tensor
    (padded, then im2col; on a device that makes them itself, its `Device.im2col`)."""
    (kh, kw), (sh, sw), padding, (hp, wp), (ho, wo) = geometry
    n, c, h, w = x.shape
    if kh == kw == sh == sw == 1 and padding == (0, 0):
        if n == 1:
            return x.reshape(c, h * w)  # NOTE: a view where x's strides allow
        nchw = x.transpose(1, 0, 2, 3)
        columns = copy(nchw)
        nchw.release()
        view = columns.reshape(c, n * h * w)
        columns.release()
        return view
    if x.device.capabilities.conv_columns:  # NOTE: one kernel, no padded copy
        columns = Tensor._fresh((c * kh * kw, n * ho * wo), x.dtype, _result_allocator(x))
        device, kernel, stride = x.device, (kh, kw), (sh, sw)
        _launch("im2col", columns, [("x", x, x.shape)],
                lambda v, o: device.im2col(v[0], kernel, stride, padding, o))
        return columns
    if _wide_rows(geometry, x.device):
        # NOTE: one zero row below, where the last windows' dropped columns end
        xp = _padded(x, padding, 0.0, below=1)
        sn, sc = xp.strides[:2]
        windows = xp._view((c, kh, kw, n, ho * wp), (sc, wp, 1, sn, 1), xp.offset)
        columns = copy(windows)
        windows.release()
        xp.release()
        view = columns.reshape(c * kh * kw, n * ho * wp)
        columns.release()
        return view
    xp = _padded(x, padding, 0.0)
    columns = _columns(xp, geometry)
    if xp is not x:
        xp.release()
    return columns


def _zero_dropped(columns: Tensor, geometry: tuple) -> None:
    """Write zeros into the Wp - Wo dropped columns of each row of wide columns (C*kh*kw,
    N*Ho*Wp), in place, before they meet a gradient's product or col2im: a dropped column
    reads (or adds into) the next positions of the padded image, so where x or the weight
    holds an infinity or a NaN, the 0 that g has there would make NaN of it (0 * inf), where
    PyTorch's gradient has the infinity. One strided fill of 2-D rows, about 1/30 of the
    columns' bytes under a 3x3 kernel on ResNet-50's 56x56 layer (about 1% of its step)."""
    (_, _), _, _, (_, wp), (_, wo) = geometry
    if wp == wo:
        return
    rows = columns.reshape(columns.shape[0] * columns.shape[1] // wp, wp)
    dropped = rows[:, wo:]
    rows.release()
    _fill(dropped, 0.0)
    dropped.release()


#: The most bytes of columns (im2col) a convolution makes at once: a batch whose columns
#: are larger runs in pieces of whole images, each with its own columns and product
#: (Note [convolution in pieces of images]).
CONV_PIECE_BYTES = 1 << 20
#: The fewest output positions (images x Ho x Wo) a piece has: thinner products run slower
#: (Note [convolution in pieces of images])
CONV_PIECE_POSITIONS = 3000

# Note [convolution in pieces of images]: one product for the whole batch needs the whole
# batch's columns at once: on ResNet-50's 56x56 layers at batch 4, 28.5 MiB for one 3x3
# convolution's columns, more than any activation, and in backward its columns' gradient as
# large again; a 1x1 convolution's columns are a transposed copy of x, its product is transposed
# back into out, and backward transposes g and x's gradient the same way. So a convolution whose
# columns pass CONV_PIECE_BYTES runs in pieces of whole images, as few as keep each piece's
# columns under it, but never with fewer than CONV_PIECE_POSITIONS output positions a piece
# (products over a 14x14 or 7x7 image are thin: 1.3-1.5x slower per image than for the batch).
# On ResNet-50 that is every layer at 56x56 and the stem, one image a piece. A piece of one
# image needs no transpose: a 1x1 convolution's columns are a view of x, its product is written
# into out's image, g's image is the product's operand as it is, and x's gradient is written
# into its image; forward and backward of the 1x1 layers at 56x56 took 0.73 of the whole batch's
# time, the 3x3 and the stem about the same (benchmarks/bench_conv.py, "whole batch"). The
# weight's gradient adds the pieces' products into a new tensor each time (a chain of adds,
# never an accumulating gemm, whose bits a graph's fold would change: captured stays eager bit
# for bit).


def _conv_pieces(shape: tuple[int, ...], geometry: tuple, itemsize: int, device: Any
                 ) -> list[tuple[int, int]]:
    """The (start, stop) image ranges a convolution of an x of `shape` runs in: as few as
    keep each piece's columns within CONV_PIECE_BYTES, each with at least
    CONV_PIECE_POSITIONS output positions (a whole image at least)."""
    (kh, kw), _, _, (_, wp), (ho, wo) = geometry
    n, channels = shape[:2]
    per_image = channels * kh * kw * ho * (wp if _wide_rows(geometry, device) else wo) * itemsize
    least = max(1, -(-CONV_PIECE_POSITIONS // (ho * wo)))  # NOTE: images a piece needs
    fit = max(1, CONV_PIECE_BYTES // per_image)  # NOTE: images whose columns fit the bytes
    count = min(n // least, -(-n // fit))
    if count <= 1:
        return [(0, n)]
    size = -(-n // count)
    return [(start, min(n, start + size)) for start in range(0, n, size)]


def _conv_forward(x: Tensor, weight: Tensor, bias: Tensor | None, geometry: tuple,
                  out: Tensor) -> None:
    """out = conv2d(x, weight) + bias, under no_grad: in pieces of images
    (Note [convolution in pieces of images]), each one product of the weight, viewed as
    (O, C*kh*kw), and the piece's columns."""
    kh, kw = geometry[0]
    c = x.shape[1]
    o = weight.shape[0]
    w2 = weight.reshape(o, c * kh * kw)
    bias4 = None if bias is None else bias.reshape(1, o, 1, 1)
    for start, stop in _conv_pieces(x.shape, geometry, x.dtype.itemsize, x.device):
        xs, target = x[start:stop], out[start:stop]
        _conv_piece(xs, w2, bias4, geometry, target)
        xs.release()
        target.release()
    w2.release()
    if bias4 is not None:
        bias4.release()


def _conv_piece(x: Tensor, w2: Tensor, bias4: Tensor | None, geometry: tuple,
                out: Tensor) -> None:
    """One piece of `_conv_forward`: the product of w2 and x's columns, then its (O, N, Ho,
    Wo) result transposed into out (one image: the product is out's layout)."""
    (_, _), _, _, _, (ho, wo) = geometry
    n = x.shape[0]
    o = w2.shape[0]
    columns = _conv_columns(x, geometry)
    wide = _wide_rows(geometry, x.device)
    if n == 1 and out.is_contiguous() and not wide:  # NOTE: (O, 1, Ho, Wo) is out's layout
        target = out.reshape(o, ho * wo)
        matmul(w2, columns, out=target)
        target.release()
        columns.release()
        if bias4 is not None:
            add(out, bias4, out=out)
        return
    product = matmul(w2, columns)  # (o, n * positions)
    columns.release()
    if wide:  # NOTE: the rows' last Wp - Wo columns dropped
        rows = product.reshape(o, n, ho, geometry[3][1])
        nchw = rows[:, :, :, :wo].transpose(1, 0, 2, 3)
        rows.release()
    else:
        nchw = product.reshape(o, n, ho, wo).transpose(1, 0, 2, 3)
    product.release()
    if bias4 is None:
        copy(nchw, out=out)
    else:  # NOTE: the transpose and the bias in one pass
        add(nchw, bias4, out=out)
    nchw.release()


def _col2im(columns: Tensor, x_shape: tuple[int, ...], geometry: tuple,
            out: Tensor | None = None) -> Tensor:
    """x's gradient from its columns' gradient, (C*kh*kw, N*Ho*Wo): each of the kh * kw
    window views of a zeroed padded tensor gets its slice added (where windows overlap, the
    adds accumulate), and the border is cut off, into `out` when given (an (N, C, H, W)
    view), else a new tensor. `columns` is released."""
    (kh, kw), (sh, sw), padding, _, (ho, wo) = geometry
    n, c, h, w = x_shape
    if kh == kw == sh == sw == 1 and padding == (0, 0):  # NOTE: the columns are x's layout
        cnhw = columns.reshape(c, n, h, w)
        columns.release()
        if n == 1 and out is None:
            return cnhw.reshape(x_shape)
        grad = copy(cnhw.transpose(1, 0, 2, 3), out=out)
        cnhw.release()
        return grad
    if columns.device.capabilities.conv_columns:  # NOTE: one kernel, no padded gradient
        grad = out if out is not None else Tensor._fresh(x_shape, columns.dtype,
                                                          _result_allocator(columns))
        device = columns.device
        _launch("col2im", grad, [("columns", columns, columns.shape)],
                lambda v, o: device.col2im(v[0], (kh, kw), (sh, sw), padding, o))
        columns.release()
        return grad
    if _wide_rows(geometry, columns.device):  # NOTE: window (i, j): the stretch at i * Wp + j
        hp, wp = geometry[3]
        positions = ho * wp
        parts = columns.reshape(c, kh, kw, n, positions).transpose(3, 0, 1, 2, 4)
        columns.release()
        grad = Tensor._fresh((n, c, hp + 1, wp), parts.dtype, _result_allocator(parts))
        _fill(grad, 0.0)
        sn, sc = grad.strides[:2]
        for i in range(kh):
            for j in range(kw):
                target = grad._view((n, c, positions), (sn, sc, 1), grad.offset + i * wp + j)
                part = parts[:, :, i, j]
                add(target, part, out=target)
                target.release()
                part.release()
        parts.release()
        return _interior(grad, padding, x_shape, out)
    parts = columns.reshape(c, kh, kw, n, ho, wo).transpose(3, 0, 1, 2, 4, 5)
    columns.release()
    grad = _zeros_like_padded(x_shape, geometry, parts)
    for i in range(kh):
        for j in range(kw):
            target = _window(grad, geometry, i, j)
            part = parts[:, :, i, j]
            add(target, part, out=target)
            target.release()
            part.release()
    parts.release()
    return _interior(grad, padding, x_shape, out)


def _conv_backward(x_shape: tuple[int, ...], weight_shape: tuple[int, ...], geometry: tuple,
                   nx: bool, nw: bool, nb: bool) -> Callable:
    """conv2d's backward function: from shapes, the geometry and flags only; x and the
    weight come saved (Note [closures hold no tensors] in runtime/autograd.py). In the
    forward's pieces of images (Note [convolution in pieces of images]), with g as (O,
    N*Ho*Wo): the weight's gradient is g times the columns (made again) transposed, the
    columns' gradient the weight transposed times g, and x's gradient their col2im."""
    kh, kw = geometry[0]
    c = x_shape[1]
    o = weight_shape[0]

    def fn(g: Tensor, x: Tensor | None, w: Tensor | None) -> tuple:
        gx = gw = gb = None
        if nb:
            gb = sum(g, axis=(0, 2, 3))
        pieces = _conv_pieces(x_shape, geometry, g.dtype.itemsize, g.device)
        w2 = w.reshape(o, c * kh * kw) if nx else None
        if nx and len(pieces) > 1:  # NOTE: each piece writes its images' gradient into it
            gx = Tensor._fresh(x_shape, g.dtype, _result_allocator(g))
        total = None  # NOTE: the weight's gradient, (O, C*kh*kw), summed over the pieces
        for start, stop in pieces:
            gs = g[start:stop]
            g2 = _conv_g2(gs, geometry, o)
            gs.release()
            if nw:
                xs = x[start:stop]
                product = _weight_product(xs, g2, geometry)
                xs.release()
                if total is None:
                    total = product
                else:
                    summed = add(total, product)
                    _release(total, product)
                    total = summed
            if nx:
                shape = (stop - start, *x_shape[1:])
                if gx is None:  # NOTE: one piece: a new tensor
                    gx = _input_grad(w2, g2, shape, geometry, None)
                else:
                    target = gx[start:stop]
                    _input_grad(w2, g2, shape, geometry, target)
                    target.release()
            g2.release()
        if w2 is not None:
            w2.release()
        if total is not None:
            gw = total.reshape(weight_shape)
            total.release()
        return gx, gw, gb

    return fn


def _input_grad(w2: Tensor, g2: Tensor, x_shape: tuple[int, ...], geometry: tuple,
                out: Tensor | None) -> Tensor:
    """x's gradient from the weight (O, C*kh*kw) and g2: the columns' gradient w2.T @ g2, then
    col2im, into `out` when given (a 1x1 kernel over one image: the product writes out's
    image, which is the columns' layout), else a new tensor."""
    (kh, kw), (sh, sw), padding = geometry[:3]
    n, c, h, w = x_shape
    if (out is not None and n == 1 and kh == kw == sh == sw == 1 and padding == (0, 0)
            and out.is_contiguous()):
        image = out.reshape(c, h * w)
        matmul(w2.T, g2, out=image)
        image.release()
        return out
    grad_columns = matmul(w2.T, g2)
    if _wide_rows(geometry, g2.device):
        _zero_dropped(grad_columns, geometry)
    return _col2im(grad_columns, x_shape, geometry, out)


def _conv_g2(g: Tensor, geometry: tuple, o: int) -> Tensor:
    """g (N, O, Ho, Wo) as the products' (O, N*Ho*Wo) (wide rows: (O, N*Ho*Wp), zeros in the
    dropped columns): a view for one image, else a transposed copy."""
    (_, _), _, _, (_, wp), (ho, wo) = geometry
    n = g.shape[0]
    if _wide_rows(geometry, g.device):  # NOTE: zeros in the dropped columns and those they meet
        g2 = Tensor._fresh((o, n * ho * wp), g.dtype, _result_allocator(g))
        _zero_dropped(g2, geometry)
        rows = g2.reshape(o, n, ho, wp)
        kept = rows[:, :, :, :wo]
        rows.release()
        copy(g.transpose(1, 0, 2, 3), out=kept)
        kept.release()
        return g2
    if n == 1:
        return g.reshape(o, ho * wo)
    return copy(g.transpose(1, 0, 2, 3)).reshape(o, n * ho * wo)


# Note [the weight's gradient in the weight's layout]: the weight's gradient is the product
# g2 @ columns.T, (O, C*kh*kw), which is the 4-D weight's own layout, so no transposed copy
# follows it: an optimizer reads the product reshaped. The other orientation, columns @ g2.T
# then a transposed copy, was chosen first on a measurement that no longer holds: summed over
# ResNet-50's layer shapes at batch 4 the two products took 153.6 and 156.7 ms (AMD EPYC,
# OpenBLAS 0.3.31, 2 threads; per shape 0.85-1.16 of each other), and the transposed copies
# 20-37 ms more a step. Measured on this CPU only: the choice has no knob, since a copy saved
# costs the same on any CPU. A graph does not fold plain SGD's update into this product (an
# accumulating gemm: `runtime/graph/fuse.py`, `_folding`, takes only a product of the
# update's own shape): OpenBLAS's kernel for it may round alpha * product + out once, and a
# captured step must keep eager's bits (tests/test_graph_layers.py's programs found it).


def _weight_product(x: Tensor, g2: Tensor, geometry: tuple) -> Tensor:
    """g2 times x's columns transposed: the weight's gradient as (O, C*kh*kw), the weight's
    own layout (Note [the weight's gradient in the weight's layout])."""
    columns = _conv_columns(x, geometry)
    if _wide_rows(geometry, x.device):
        _zero_dropped(columns, geometry)
    product = matmul(g2, columns.T)
    columns.release()
    return product


def conv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: Any = 1,
           padding: Any = 0, out: Tensor | None = None, **unsupported: Any) -> Tensor:
    """The 2-D convolution (cross-correlation) of PyTorch's conv2d, NCHW.

    x is (N, C, H, W), weight (O, C, kh, kw), bias (O,) or None; stride and padding an int
    or an (h, w) pair (zero padding). Returns (N, O, Ho, Wo) with Ho = (H + 2*ph - kh) // sh
    + 1. dilation and groups are not supported (a value other than 1 is refused).

    Built from the device's copies and products (docs/layers.md): a zero-padded copy, its
    windows copied into columns in one strided copy (im2col), and one product for the whole
    batch. A 1x1 convolution with stride 1 and no padding needs no im2col. The backward
    pass saves x and the weight, not the columns: it makes them again for the weight's
    gradient, and adds the columns' gradient back through kh * kw strided views (col2im).
    Inside `amp.autocast(half)` it computes in `half`, as torch.autocast does
    (Note [autocast in ops]).

    `out` may not share any memory with the inputs.

    Example:
        >>> import numpy as np, runtime
        >>> x = runtime.tensor(np.arange(16.0).reshape(1, 1, 4, 4))
        >>> w = runtime.tensor(np.ones((1, 1, 2, 2)))
        >>> runtime.ops.conv2d(x, w, stride=2).numpy()[0, 0]
        array([[10., 18.],
               [42., 50.]])
    """
    _refuse_keywords("conv2d", unsupported)
    if _mode.autocast is not None and out is None:
        x, weight, bias = _autocast(x, weight, bias)
    operands = [x, weight] if bias is None else [x, weight, bias]
    _, dtype = _common("conv2d", operands)
    n, c = _image("conv2d", x)[:2]
    o, wc = _image("conv2d", weight, "weight")[:2]
    if wc != c:
        raise ValueError(f"conv2d: x has {c} channels (shape {x.shape}), but the weight "
                         f"expects {wc} (shape {weight.shape}: out, in, kh, kw)")
    if bias is not None and bias.shape != (o,):
        raise ValueError(f"conv2d: bias has shape {bias.shape}, expected ({o},) for a weight "
                         f"of shape {weight.shape}")
    geometry = _geometry("conv2d", x.shape, weight.shape[2:],
                         _pair("conv2d", "stride", stride, 1),
                         _pair("conv2d", "padding", padding, 0))
    shape = (n, o, *geometry[4])
    out = _guarded("conv2d", out, shape, dtype, operands, ("x", "weight", "bias"),
                   lambda target: _conv_forward(x, weight, bias, geometry, target))
    if autograd.needs_grad(*operands):
        nx, nw = x.requires_grad, weight.requires_grad
        nb = bias is not None and bias.requires_grad
        autograd.record("conv2d", out, operands, ("x", "weight", "bias"),
                        _conv_backward(x.shape, weight.shape, geometry, nx, nw, nb),
                        [("x", x if nw else None), ("weight", weight if nx else None)])
    return out


def _pool_geometry(op: str, x: Tensor, kernel_size: Any, stride: Any, padding: Any) -> tuple:
    _image(op, x)
    kernel = _pair(op, "kernel_size", kernel_size, 1)
    steps = kernel if stride is None else _pair(op, "stride", stride, 1)
    pads = _pair(op, "padding", padding, 0)
    if pads[0] > kernel[0] // 2 or pads[1] > kernel[1] // 2:
        raise ValueError(f"{op}: padding {pads[0]},{pads[1]} must be at most half the kernel "
                         f"{kernel[0]}x{kernel[1]} (as in PyTorch), so that every window "
                         f"holds an element of x")
    return _geometry(op, x.shape, kernel, steps, pads)


def _max_forward(x: Tensor, geometry: tuple, out: Tensor, indices: Tensor | None) -> None:
    """The device's max pooling kernel (`Device.max_pool2d`): out, and where each maximum
    came from into `indices` (int64, PyTorch's h * W + w in the plane) when a gradient wants
    them."""
    kernel, stride, padding = geometry[:3]
    device = x.device
    _launch("max_pool2d", out, [("x", x, x.shape)],
            lambda v, o, *at: device.max_pool2d(v[0], kernel, stride, padding, o,
                                                at[0] if at else None),
            also=() if indices is None else (indices,))


def _max_backward(x_shape: tuple[int, ...]) -> Callable:
    """max_pool2d's backward function: each output's gradient added at the index its
    forward kept (`Device.max_pool2d_backward`), PyTorch's order of additions."""

    def fn(g: Tensor, indices: Tensor) -> tuple:
        device = g.device
        result = Tensor._fresh(x_shape, g.dtype, _result_allocator(g))
        _launch("max_pool2d_backward", result, [("grad", g, g.shape),
                                                ("indices", indices, indices.shape)],
                lambda v, o: device.max_pool2d_backward(v[0], v[1], o))
        return (result,)

    return fn


def max_pool2d(x: Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0,
               out: Tensor | None = None, **unsupported: Any) -> Tensor:
    """PyTorch's max_pool2d, NCHW: the maximum of each kh x kw window of x (N, C, H, W),
    `stride` apart (default: kernel_size), over x padded with -inf (`padding` at most half
    the kernel). A NaN in a window gives NaN, as in PyTorch.

    One kernel of the device (`Device.max_pool2d`) scans each window as PyTorch's CPU does
    and keeps where its maximum came from (int64, as PyTorch's indices), when x needs a
    gradient; the backward pass saves those indices (not x) and adds each output's gradient
    at its index (`Device.max_pool2d_backward`, in PyTorch's order): to the first maximum of
    each window in row-major order, the last NaN in a window holding NaN, the first element
    of x in a window of -inf. dilation, ceil_mode and return_indices are not supported.

    `out` may not share any memory with x.

    Example:
        >>> import numpy as np, runtime
        >>> x = runtime.tensor(np.arange(16.0).reshape(1, 1, 4, 4))
        >>> runtime.ops.max_pool2d(x, 2).numpy()[0, 0]
        array([[ 5.,  7.],
               [13., 15.]])
    """
    return _pool("max_pool2d", x, kernel_size, stride, padding, out, unsupported)


def _global(x_shape: tuple[int, ...], geometry: tuple) -> bool:
    """Whether a pool's one window is the whole unpadded image (ResNet's last pool)."""
    return geometry[2] == (0, 0) and geometry[0] == tuple(x_shape[2:])


def _avg_forward(x: Tensor, geometry: tuple, out: Tensor) -> None:
    (kh, kw), _, padding = geometry[:3]
    if _global(x.shape, geometry):  # NOTE: one reduction, not kh * kw adds of (N, C, 1, 1)
        mean(x, axis=(2, 3), keepdims=True, out=out)
        return
    if x.dtype in dtypes.HALVES:  # NOTE: summed in float32 and rounded once, as PyTorch's
        wide = cast(x, _FLOAT32)
        result = Tensor._fresh(out.shape, _FLOAT32, _result_allocator(x))
        _avg_forward(wide, geometry, result)
        wide.release()
        cast(result, out.dtype, out=out)
        result.release()
        return
    xp = _padded(x, padding, 0.0)
    for k in range(kh * kw):
        window = _window(xp, geometry, *divmod(k, kw))
        if k == 0:
            copy(window, out=out)
        else:
            add(out, window, out=out)
        window.release()
    if xp is not x:
        xp.release()
    div(out, kh * kw, out=out)  # NOTE: a division by the count, as PyTorch's


def _avg_backward(x_shape: tuple[int, ...], geometry: tuple) -> Callable:
    (kh, kw), _, padding = geometry[:3]

    def fn(g: Tensor) -> tuple:
        share = div(g, kh * kw)
        if _global(x_shape, geometry):  # NOTE: the share broadcast over the image at once
            result = Tensor._fresh(x_shape, g.dtype, _result_allocator(g))
            copy(share, out=result)
            share.release()
            return (result,)
        grad = _zeros_like_padded(x_shape, geometry, g)
        for k in range(kh * kw):
            target = _window(grad, geometry, *divmod(k, kw))
            add(target, share, out=target)
            target.release()
        share.release()
        return (_interior(grad, padding, x_shape),)

    return fn


def avg_pool2d(x: Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0,
               out: Tensor | None = None, **unsupported: Any) -> Tensor:
    """PyTorch's avg_pool2d, NCHW: the mean of each kh x kw window of x (N, C, H, W),
    `stride` apart (default: kernel_size), over x padded with zeros that count in the mean
    (count_include_pad=True, PyTorch's default; `padding` at most half the kernel).

    The sum runs `add` over the kh * kw window views, then one division by kh * kw (a two-byte
    x is summed in float32 and rounded once); a window as large as x is one `mean`. The
    gradient spreads g / (kh * kw) back through the same views. ceil_mode,
    count_include_pad=False and divisor_override are not supported.

    `out` may not share any memory with x.

    Example:
        >>> import numpy as np, runtime
        >>> x = runtime.tensor(np.arange(16.0).reshape(1, 1, 4, 4))
        >>> runtime.ops.avg_pool2d(x, 2).numpy()[0, 0]
        array([[ 2.5,  4.5],
               [10.5, 12.5]])
    """
    return _pool("avg_pool2d", x, kernel_size, stride, padding, out, unsupported)


def _pool(op: str, x: Tensor, kernel_size: Any, stride: Any, padding: Any,
          out: Tensor | None, unsupported: dict[str, Any]) -> Tensor:
    """max_pool2d and avg_pool2d: the checks, the forward pass under the NEVER policy and the
    record (max's backward reads x and its result, avg's neither)."""
    _refuse_keywords(op, unsupported)
    _, dtype = _common(op, [x])
    geometry = _pool_geometry(op, x, kernel_size, stride, padding)
    shape = (*x.shape[:2], *geometry[4])
    if op == "avg_pool2d":
        out = _guarded(op, out, shape, dtype, [x], ("x",),
                       lambda target: _avg_forward(x, geometry, target))
        if autograd.needs_grad(x):
            autograd.record(op, out, (x,), ("x",), _avg_backward(x.shape, geometry))
        return out
    grad = autograd.needs_grad(x)
    indices = Tensor._fresh(shape, _INT64, _result_allocator(x)) if grad else None
    out = _guarded(op, out, shape, dtype, [x], ("x",),
                   lambda target: _max_forward(x, geometry, target, indices))
    if grad:
        autograd.record(op, out, (x,), ("x",), _max_backward(x.shape), [("indices", indices)])
    return out


__all__ += ["conv2d", "max_pool2d", "avg_pool2d"]
ALIASING_POLICY.update(dict.fromkeys(("conv2d", "max_pool2d", "max_pool2d_backward",
                                      "avg_pool2d", "moments", "channel_dots", "im2col",
                                      "col2im", "pointwise"), NEVER))


def _reduce(op: str, x: Tensor, axis: Any, keepdims: bool, out: Tensor | None) -> Tensor:
    device, dtype = _common(op, [x])
    axes = as_axes(op, axis, x.ndim)
    keepdims = as_flag(keepdims, f"{op}: keepdims")
    reduced = range(x.ndim) if axes is None else axes
    shape = tuple(1 if i in reduced else n for i, n in enumerate(x.shape) if keepdims or
                  i not in reduced)
    done = _fast_launch(op, True, out, shape, dtype, (x,), _reduce_kernel,
                        (device, op, axes, keepdims))
    if done is not None:
        out = done
    else:
        out = _prepare_out(op, out, shape, dtype, x, (x,))
        _launch(op, out, [("x", x, x.shape)],
                lambda v, o: device.reduce(op, v[0], axes, keepdims, o))
    if autograd.needs_grad(x):
        # NOTE: x's shape, not x: Note [closures hold no tensors] in runtime/autograd.py
        x_shape = x.shape
        kept = tuple(1 if i in reduced else n for i, n in enumerate(x_shape))
        scale = 1 / math.prod(x_shape[i] for i in reduced) if op == "mean" and x.size else None

        def fn(g: Tensor) -> tuple:
            result = Tensor._fresh(x_shape, g.dtype, g.block.allocator)
            # NOTE: a 0-d gradient (a reduction over every axis) spreads as it is: no reshape
            spread = g if g.ndim == 0 or g.shape == kept else g.reshape(kept)
            if scale is None:
                copy(spread, out=result)
            else:  # NOTE: each element is g * scale, as when scaling first and then spreading
                mul(spread, scale, out=result)
            return (result,)

        autograd.record(op, out, (x,), ("x",), fn)
    return out


def sum(x: Tensor, axis: Any = None, keepdims: bool = False,
        out: Tensor | None = None) -> Tensor:
    """The sum over `axis` (an int, a tuple, or None for all). `out` may not overlap x."""
    done = _fast_reduce("sum", x, axis, keepdims, out)  # NOTE: Note [the eager fast path]
    return done if done is not None else _reduce("sum", x, axis, keepdims, out)


def mean(x: Tensor, axis: Any = None, keepdims: bool = False,
         out: Tensor | None = None) -> Tensor:
    """The mean over `axis` (an int, a tuple, or None for all). `out` may not overlap x."""
    done = _fast_reduce("mean", x, axis, keepdims, out)  # NOTE: Note [the eager fast path]
    return done if done is not None else _reduce("mean", x, axis, keepdims, out)


# ---------------------------------------- softmax and layer norm
# NOTE: the table's ops this section calls, bound by name (made by `_public` above)
_exp, _log, _sqrt, _where = (globals()[name] for name in ("exp", "log", "sqrt", "where"))


def _composite_out(op: str, out: Tensor | None, shape: tuple[int, ...], dtype: np.dtype,
                   like: Tensor, inputs: Sequence[tuple[str, Tensor]]) -> tuple[Tensor, Tensor]:
    """`out=` of an op composed of other ops, whose output may share no memory with its inputs
    (NEVER): `_prepare_out`'s checks, then `_launch`'s aliasing test against `inputs`, (label,
    tensor) pairs. Returns (target, out): the tensor the composed ops write, out itself, or a
    temporary where out overlaps an input in "copy" mode (`_finish` copies it into out)."""
    out = _prepare_out(op, out, shape, dtype, like, [t for _, t in inputs])
    clashes = _clashes(NEVER, out, [(label, t, t.shape) for label, t in inputs])
    if not clashes:
        return out, out
    if config.get_aliasing() == "raise":
        raise AliasingError(
            f"{op}: the output {aliasing.describe('out', out.block.id, out.layout())} overlaps "
            f"{'; '.join(clashes)}. The output of {op} may not share memory with any input. "
            f"Use a separate output, or runtime.set_aliasing('copy') to compute through a "
            f"temporary")
    return Tensor._fresh(shape, dtype, _result_allocator(out)), out


def _finish(target: Tensor, out: Tensor) -> Tensor:
    """out, with the composed result copied in from `target` where they differ."""
    if target is not out:
        copy(target, out=out)
        target.release()
    return out


def _wide(x: Tensor) -> Tensor:
    """x in float32 where it is two-byte (a composed op computes in float32 and rounds its
    result once, as its kernels would: Note [two-byte floats compute in float32] in
    backends/base.py), else x itself."""
    return cast(x, _FLOAT32) if x.dtype in dtypes.HALVES else x


def _into(result: Tensor, target: Tensor) -> None:
    """Put `result` (float32 for a two-byte target, else target's dtype) into target, rounding
    once where it is two-byte."""
    if result is target:
        return
    if result.dtype != target.dtype:
        cast(result, target.dtype, out=target)
    else:
        copy(result, out=target)


def _release(*tensors: Tensor | None) -> None:
    for t in tensors:
        if t is not None:
            t.release()


def _one_axis(op: str, axis: Any, x: Tensor) -> int | tuple[()]:
    """`axis` as one axis of x in [0, ndim), or a TypeError/ValueError naming it. A 0-d x
    takes axis 0 or -1, as in PyTorch, which normalises it as one element: then the axes are
    (), so that its maximum and sum are the element itself (softmax 1, log_softmax 0; NaN
    for an infinity or a NaN)."""
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"{op}: axis must be one int, got {_brief(axis)}")
    if x.ndim == 0:
        if axis not in (0, -1):
            raise ValueError(f"{op}: axis {axis} is out of range for a 0-dimensional x "
                             f"(shape ()): it takes axis 0 or -1, as in PyTorch")
        return ()
    return as_axes(op, axis, x.ndim)[0]


def _autocast_float32(*operands: Any) -> tuple[Any, ...]:
    """Inside `amp.autocast`, two-byte tensors cast to float32 (softmax, log_softmax and
    layer_norm are on torch.autocast's float32 list: Note [autocast in ops]); else as they
    are."""
    return tuple(cast(t, _FLOAT32) if isinstance(t, Tensor) and t.dtype in dtypes.HALVES
                 else t for t in operands)


def amax(x: Tensor, axis: Any = None, keepdims: bool = False,
         out: Tensor | None = None) -> Tensor:
    """The maximum over `axis` (an int, a tuple, or None for all), as torch.amax and np.max: a
    NaN among the elements gives NaN. An axis of size 0 is a ValueError (a maximum of nothing
    has no value).

    The gradient goes to the elements equal to their maximum; where several tie, each gets an
    equal share (g / count), as PyTorch's amax (a NaN maximum gives NaN gradients along it).
    `out` may not share any memory with x.

    Example:
        >>> import numpy as np, runtime
        >>> x = runtime.tensor(np.float32([[1.0, 5.0, 2.0], [-1.0, np.nan, 0.0]]))
        >>> runtime.ops.amax(x, axis=1).numpy()
        array([ 5., nan], dtype=float32)
    """
    device, dtype = _common("amax", [x])
    axes = as_axes("amax", axis, x.ndim)
    keepdims = as_flag(keepdims, "amax: keepdims")
    reduced = range(x.ndim) if axes is None else axes
    for i in reduced:
        if x.shape[i] == 0:
            raise ValueError(f"amax: axis {i} of x's shape {x.shape} has size 0, and a "
                             f"maximum of no element has no value")
    shape = tuple(1 if i in reduced else n for i, n in enumerate(x.shape) if keepdims or
                  i not in reduced)
    done = _fast_launch("amax", True, out, shape, dtype, (x,), _reduce_kernel,
                        (device, "max", axes, keepdims))
    if done is not None:
        out = done
    else:
        out = _prepare_out("amax", out, shape, dtype, x, (x,))
        _launch("amax", out, [("x", x, x.shape)],
                lambda v, o: device.reduce("max", v[0], axes, keepdims, o))
    if autograd.needs_grad(x):
        # NOTE: shapes and axes only: Note [closures hold no tensors] in runtime/autograd.py
        kept = tuple(1 if i in reduced else n for i, n in enumerate(x.shape))

        def fn(g: Tensor, x: Tensor, y: Tensor) -> tuple:
            g = g if g.ndim == 0 or g.shape == kept else g.reshape(kept)
            y = y if y.ndim == 0 or y.shape == kept else y.reshape(kept)
            mask = _elementwise("amax_backward", None, 1.0, x, y)  # 1 at each maximum
            count = sum(mask, axis=axes, keepdims=True)
            mask.release()
            share = div(g, count, out=count)
            result = _elementwise("amax_backward", None, share, x, y)
            share.release()
            return (result,)

        autograd.record("amax", out, (x,), ("x",), fn, [("x", x), ("the output", out)])
    return out


def softmax(x: Tensor, axis: int = -1, out: Tensor | None = None) -> Tensor:
    """exp(x) / sum(exp(x)) along `axis`, computed stably (the maximum along the axis is
    subtracted first); PyTorch's softmax. A row of -inf gives NaN there, as in PyTorch.

    The backward pass is one expression of the output y, y * (g - sum(g * y)), not the chain
    of the forward ops. A two-byte x is computed in float32 and rounded once; inside
    `amp.autocast` it is cast to float32 first and the result is float32, as torch.autocast
    (Note [autocast in ops]). `out` may not share any memory with x.

    Example:
        >>> import numpy as np, runtime
        >>> x = runtime.tensor(np.float64([[1.0, 2.0, 3.0], [0.0, 0.0, -np.inf]]))
        >>> runtime.ops.softmax(x, axis=-1).numpy().round(4)
        array([[0.09  , 0.2447, 0.6652],
               [0.5   , 0.5   , 0.    ]])
    """
    return _of_shifted("softmax", x, axis, out, _softmax_tail, _softmax_derivative)


def _softmax_tail(shifted: Tensor, ax: int, dest: Tensor | None) -> Tensor:
    """softmax from x - max(x) (released here), into `dest` (None: into a new wide tensor)."""
    result, total = _softmax_and_sum(shifted, ax, dest)
    total.release()
    return result


def _softmax_and_sum(shifted: Tensor, ax: int, dest: Tensor | None) -> tuple[Tensor, Tensor]:
    """`_softmax_tail`, and the sum of exp(x - max(x)) it divides by."""
    # NOTE: no in-place writes in a forward op: a checkpointed graph keeps a segment that
    # writes in place into an earlier block (runtime/graph/checkpoint.py)
    e = _exp(shifted)
    shifted.release()
    total = sum(e, ax, keepdims=True)
    result = div(e, total, out=e if dest is None else dest)
    _release(e if dest is not None else None)
    return result, total


def _softmax_derivative(g: Tensor, y: Tensor, ax: int) -> Tensor:
    """y * (g - sum(g * y)) along ax, g and y wide; the pointwise part one formula (Note [an
    op's pointwise formula in one pass])."""
    t = mul(g, y)
    s = sum(t, ax, keepdims=True)
    t.release()
    result = _pointwise([("sub", (("input", 0), ("input", 1))),
                         ("mul", (("input", 2), ("link", 0)))], [g, s, y])
    s.release()
    return result


def _of_shifted(op: str, x: Tensor, axis: int, out: Tensor | None,
                tail: Callable[[Tensor, int, Tensor | None], Tensor],
                derivative: Callable[[Tensor, Tensor, int], Tensor]) -> Tensor:
    """softmax or log_softmax of x along `axis`: the checks, autocast, x - max(x) in the wide
    dtype, `tail` of it written into out (or cast into it once for a two-byte out), and the
    backward pass `derivative(g, y, ax)` of the output y, both wide."""
    if _mode.autocast is not None and out is None:
        (x,) = _autocast_float32(x)
    _, dtype = _common(op, [x])
    ax = _one_axis(op, axis, x)
    target, out = _composite_out(op, out, x.shape, dtype, x, [("x", x)])
    with autograd.no_grad():
        if x.size == 0:
            copy(x, out=target)
        else:
            wide = _wide(x)
            shifted, top = _less_max(wide, ax)
            _release(top, wide if wide is not x else None)
            narrow = target.dtype != shifted.dtype
            result = tail(shifted, ax, None if narrow else target)
            if narrow:
                cast(result, target.dtype, out=target)
                result.release()
    _finish(target, out)
    if autograd.needs_grad(x):
        # NOTE: ax and two functions only: Note [closures hold no tensors] in runtime/autograd.py
        def fn(g: Tensor, y: Tensor) -> tuple:
            gw, yw = _wide(g), _wide(y)
            t = derivative(gw, yw, ax)
            _release(gw if gw is not g else None, yw if yw is not y else None)
            return (t if t.dtype == g.dtype else _narrowed(t, g.dtype),)

        autograd.record(op, out, (x,), ("x",), fn, [("the output", out)])
    return out


def _less_max(x: Tensor, ax: int) -> tuple[Tensor, Tensor]:
    """x - max(x) along ax, and the maximum (kept dims): the first steps of softmax and
    log_softmax, and of attention's softmax that keeps its log-sum-exp."""
    top = amax(x, ax, keepdims=True)
    return sub(x, top), top


def _narrowed(t: Tensor, dtype: np.dtype) -> Tensor:
    """t cast to `dtype`, t released."""
    result = cast(t, dtype)
    t.release()
    return result


def log_softmax(x: Tensor, axis: int = -1, out: Tensor | None = None) -> Tensor:
    """log(softmax(x)) along `axis`, computed stably as (x - m) - log(sum(exp(x - m))), m the
    maximum along the axis; PyTorch's log_softmax.

    The backward pass is g - exp(y) * sum(g) of the output y. Two-byte floats and autocast as
    `softmax`. `out` may not share any memory with x.

    Example:
        >>> import numpy as np, runtime
        >>> x = runtime.tensor(np.float64([1000.0, 1000.0]))
        >>> runtime.ops.log_softmax(x).numpy()
        array([-0.69314718, -0.69314718])
    """
    return _of_shifted("log_softmax", x, axis, out, _log_softmax_tail,
                       _log_softmax_derivative)


def _log_softmax_tail(shifted: Tensor, ax: int, dest: Tensor | None) -> Tensor:
    """log_softmax from x - max(x) (released here, or written over when dest is None)."""
    e = _exp(shifted)
    total = sum(e, ax, keepdims=True)
    e.release()
    logs = _log(total)  # NOTE: no in-place write, as in softmax
    total.release()
    result = sub(shifted, logs, out=shifted if dest is None else dest)
    _release(logs, shifted if dest is not None else None)
    return result


def _log_softmax_derivative(g: Tensor, y: Tensor, ax: int) -> Tensor:
    """g - exp(y) * sum(g) along ax, g and y wide; the pointwise part one formula."""
    s = sum(g, ax, keepdims=True)
    result = _pointwise([("exp", (("input", 0),)),
                         ("mul", (("link", 0), ("input", 1))),
                         ("sub", (("input", 2), ("link", 1)))], [y, s, g])
    s.release()
    return result


def _normalized(x: Tensor, normalized_shape: Any, weight: Tensor | None,
                bias: Tensor | None, eps: Any) -> tuple[tuple[int, ...], float]:
    """layer_norm's normalized axes and eps, or a TypeError/ValueError naming the numbers."""
    if isinstance(normalized_shape, numbers.Integral) and not isinstance(normalized_shape,
                                                                          (bool, np.bool_)):
        normalized_shape = (int(normalized_shape),)
    if not isinstance(normalized_shape, (tuple, list)) or not all(
            isinstance(n, numbers.Integral) and not isinstance(n, (bool, np.bool_))
            for n in normalized_shape):
        raise TypeError(f"layer_norm: normalized_shape is an int or a tuple of ints, got "
                        f"{_brief(normalized_shape)}")
    dims = tuple(int(n) for n in normalized_shape)
    if not dims or dims != x.shape[x.ndim - len(dims):] or len(dims) > x.ndim:
        raise ValueError(f"layer_norm: normalized_shape {dims} must be the last "
                         f"{len(dims) or 'one or more'} dimensions of x, whose shape is "
                         f"{x.shape}")
    for label, t in (("weight", weight), ("bias", bias)):
        if t is not None and (not isinstance(t, Tensor) or t.shape != dims):
            raise ValueError(f"layer_norm: {label} has shape "
                             f"{getattr(t, 'shape', type(t).__name__)}, expected {dims} "
                             f"(normalized_shape)")
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, numbers.Real) or not (
            0 <= float(eps) < math.inf):
        raise ValueError(f"layer_norm: eps must be a finite number >= 0, got {_brief(eps)}")
    return tuple(range(x.ndim - len(dims), x.ndim)), float(eps)


def layer_norm(x: Tensor, normalized_shape: Any, weight: Tensor | None = None,
               bias: Tensor | None = None, eps: float = 1e-5,
               out: Tensor | None = None) -> Tensor:
    """Layer normalisation over the last dimensions of x, `normalized_shape` (an int or a
    tuple): (x - mean) / sqrt(var + eps) * weight + bias, the variance biased (divided by the
    count, not count - 1); PyTorch's layer_norm. `weight` and `bias` have normalized_shape, or
    are None.

    The backward pass is one expression, as PyTorch's: with xhat the normalised x and
    rstd = 1 / sqrt(var + eps), gx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat)),
    gw = g * weight; weight's gradient sums g * xhat, bias's g, over the leading dimensions.
    Two-byte floats compute in float32 and round once; inside `amp.autocast` two-byte
    operands are cast to float32 first and the result is float32, as torch.autocast. `out` may
    not share any memory with the inputs.

    Example:
        >>> import numpy as np, runtime
        >>> x = runtime.tensor(np.float64([[1.0, 2.0, 3.0]]))
        >>> runtime.ops.layer_norm(x, 3).numpy().round(4)
        array([[-1.2247,  0.    ,  1.2247]])
    """
    if _mode.autocast is not None and out is None:
        x, weight, bias = _autocast_float32(x, weight, bias)
    operands = [t for t in (x, weight, bias) if t is not None]
    device, dtype = _common("layer_norm", operands)
    axes, eps = _normalized(x, normalized_shape, weight, bias, eps)
    inputs = [(label, t) for label, t in (("x", x), ("weight", weight), ("bias", bias))
              if t is not None]
    target, out = _composite_out("layer_norm", out, x.shape, dtype, x, inputs)
    recording = autograd.needs_grad(*operands)
    with autograd.no_grad():
        wide = _wide(x)
        centre = mean(wide, axes, keepdims=True)
        centred = sub(wide, centre)
        _release(centre, wide if wide is not x else None)
        # NOTE: no in-place writes, as in softmax
        square = mul(centred, centred)
        variance = mean(square, axes, keepdims=True)
        square.release()
        shifted = add(variance, eps)
        root = _sqrt(shifted)
        rstd = div(1.0, root)
        _release(variance, shifted, root)
        xhat = mul(centred, rstd)
        centred.release()
        # NOTE: the last step writes the target itself where it has the compute dtype
        last = target if target.dtype == xhat.dtype else None
        result = xhat
        if weight is not None:
            w = _wide(weight)
            result = mul(xhat, w, out=last if bias is None else None)
            _release(w if w is not weight else None)
        if bias is not None:
            b = _wide(bias)
            scaled = result
            result = add(scaled, b, out=last)
            if scaled is not xhat:
                scaled.release()
            _release(b if b is not bias else None)
        _into(result, target)
        if result is not target and result is not xhat:
            result.release()
    _finish(target, out)
    if not recording:
        _release(xhat, rstd)
        return out
    # NOTE: axes and flags only: Note [closures hold no tensors] in runtime/autograd.py
    leading = tuple(range(x.ndim - len(axes)))
    nw, nb = weight is not None and weight.requires_grad, bias is not None and bias.requires_grad

    def fn(g: Tensor, xhat: Tensor, rstd: Tensor, weight: Tensor | None) -> tuple:
        gw = _wide(g)
        if weight is not None:
            w = _wide(weight)
            gy = mul(gw, w)
            _release(w if w is not weight else None)
        else:
            gy = gw
        a = mean(gy, axes, keepdims=True)
        t = mul(gy, xhat)
        b = mean(t, axes, keepdims=True)
        t.release()
        # NOTE: ((gy - xhat * b) - a) * rstd, batch norm's formula: one pass eagerly, one fused
        # chain in a graph (Note [an op's pointwise formula in one pass])
        u = _pointwise([("mul", (("input", 0), ("input", 1))),
                        ("sub", (("input", 2), ("link", 0))),
                        ("sub", (("link", 1), ("input", 3))),
                        ("mul", (("link", 2), ("input", 4)))], [xhat, b, gy, a, rstd])
        _release(a, b, gy if gy is not gw else None)
        gx = u if u.dtype == g.dtype else _narrowed(u, g.dtype)
        g_weight = g_bias = None
        if nw:
            product = mul(gw, xhat)
            g_weight = sum(product, leading) if leading else product
            if leading:
                product.release()
            if g_weight.dtype != weight.dtype:
                g_weight = _narrowed(g_weight, weight.dtype)
        if nb:
            g_bias = sum(gw, leading) if leading else copy(gw)
            if g_bias.dtype != g.dtype:
                g_bias = _narrowed(g_bias, g.dtype)
        _release(gw if gw is not g else None)
        return gx, g_weight, g_bias

    autograd.record("layer_norm", out, (x, weight, bias), ("x", "weight", "bias"), fn,
                    [("xhat", xhat), ("rstd", rstd), ("weight", weight)])
    _release(xhat, rstd)  # NOTE: the node keeps its own handles
    return out


@functools.lru_cache(maxsize=64)
def _causal_mask(rows: int, cols: int, dtype: np.dtype) -> np.ndarray:
    """-inf above the diagonal, 0 on and below it (PyTorch's is_causal: query i attends to
    keys 0..i, the mask aligned to the top left)."""
    mask = np.triu(np.full((rows, cols), -np.inf, dtype), 1)
    mask.flags.writeable = False
    return mask


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor,
                                 attn_mask: Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 generator: Generator | None = None,
                                 out: Tensor | None = None) -> Tensor:
    """softmax(query @ key^T * scale + mask) @ value, PyTorch's F.scaled_dot_product_attention:
    query (..., L, E), key (..., S, E), value (..., S, Ev), the leading (batch, head)
    dimensions broadcast; returns (..., L, Ev). `scale` defaults to 1 / sqrt(E). `is_causal`
    lets query i attend to keys 0..i only (a -inf upper triangle is added to the scores);
    `attn_mask` is a bool Tensor (True: may attend) or a float Tensor added to the scores,
    broadcast to (..., L, S). With `dropout_p` > 0 the attention weights go through
    `dropout` (always, as PyTorch's: the function has no training flag), each zeroed with
    probability dropout_p and the rest scaled by 1 / (1 - dropout_p); the masks come from
    `generator` (default: `default_generator`), so a captured graph draws the eager masks and
    a recomputed segment reuses them (docs/layers-state.md). They are not PyTorch's draws.

    Composed of ops: a product by the scale, batched `matmul`, the mask, `softmax` and
    `matmul` (so graphs capture, plan and fuse it as those ops). Where it records a gradient
    (float32 or float64 operands of the same leading dimensions, no dropout, no autocast) it
    is one autograd node that keeps query, key, value, the mask and the rows' log-sum-exp,
    not the (..., L, S) weights, and makes the weights again in backward, as PyTorch's CPU
    kernel does (Note [attention recomputes its weights]). `out` may not share any memory
    with the inputs.

    Example:
        >>> import numpy as np, runtime
        >>> q = runtime.tensor(np.ones((1, 2, 3, 4), np.float32))
        >>> y = runtime.ops.scaled_dot_product_attention(q, q, q, is_causal=True)
        >>> y.shape
        (1, 2, 3, 4)
    """
    for label, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"scaled_dot_product_attention: {label} must be a Tensor, got "
                            f"{type(t).__name__} {_brief(t)}")
        if t.ndim < 2:
            raise ValueError(f"scaled_dot_product_attention: {label} needs at least 2 "
                             f"dimensions (..., sequence, features), got shape {t.shape}")
    if query.shape[-1] != key.shape[-1] or key.shape[-2] != value.shape[-2]:
        raise ValueError(f"scaled_dot_product_attention: query {query.shape}, key {key.shape} "
                         f"and value {value.shape} do not fit: query and key share the last "
                         f"dimension (E), key and value the one before it (S)")
    dropout_p = _number("scaled_dot_product_attention", "dropout_p", dropout_p, 0.0, 1.0)
    if generator is not None and not isinstance(generator, Generator):
        raise TypeError(f"scaled_dot_product_attention: generator must be an ops.Generator or "
                        f"None, got {_brief(generator)}")
    is_causal = as_flag(is_causal, "scaled_dot_product_attention: is_causal")
    if is_causal and attn_mask is not None:
        raise ValueError("scaled_dot_product_attention: pass attn_mask or is_causal=True, not "
                         "both (as PyTorch)")
    if scale is None:
        scale = 1 / math.sqrt(query.shape[-1]) if query.shape[-1] else 1.0
    elif isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scaled_dot_product_attention: scale must be a number, got "
                        f"{_brief(scale)}")
    if attn_mask is not None and not isinstance(attn_mask, Tensor):
        raise TypeError(f"scaled_dot_product_attention: attn_mask must be a Tensor, got "
                        f"{type(attn_mask).__name__} {_brief(attn_mask)}")
    if out is None and _recomputes_weights(query, key, value, attn_mask, dropout_p):
        return _attention_recomputed(query, key, value, attn_mask, is_causal, scale)
    weights = _attention_weights(query, key, scale, is_causal, attn_mask)
    if dropout_p > 0:
        dropped = dropout(weights, dropout_p, generator=generator)
        weights.release()
        weights = dropped
    if out is None:
        return matmul(weights, value)
    # NOTE: out may share no memory with query and key either
    inputs = [("query", query), ("key", key), ("value", value)]
    target, out = _composite_out("scaled_dot_product_attention", out,
                                 _matmul_shape(weights, value), weights.dtype, query, inputs)
    matmul(weights, value, out=target)
    weights.release()
    return _finish(target, out)


def _attention_scores(query: Tensor, key: Tensor, scale: float, is_causal: bool,
                      attn_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """query * scale @ key^T + mask, and query * scale: the scores of attention's forward, and
    their recompute in `_attention_recomputed`'s backward (the same ops, so the same bits)."""
    scaled = mul(query, scale)
    scores = matmul(scaled, _swap_last(key))
    if is_causal:
        mask = tensor(_causal_mask(query.shape[-2], key.shape[-2], scores.dtype),
                      device=scores.device, allocator=_result_allocator(scores))
        masked = add(scores, mask)
        _release(scores, mask)
        scores = masked
    elif attn_mask is not None:
        masked = (_where(attn_mask, scores, -math.inf) if attn_mask.dtype == np.bool_
                  else add(scores, attn_mask))
        scores.release()
        scores = masked
    return scores, scaled


def _attention_weights(query: Tensor, key: Tensor, scale: float, is_causal: bool,
                       attn_mask: Tensor | None) -> Tensor:
    """softmax(query * scale @ key^T + mask) along the last axis: the composed forward."""
    scores, scaled = _attention_scores(query, key, scale, is_causal, attn_mask)
    scaled.release()
    weights = softmax(scores, -1)
    scores.release()
    return weights


# Note [attention recomputes its weights]: composed of ops, attention keeps for backward what
# its ops save: softmax's output, a (..., L, S) tensor, and query * scale, the product's left
# operand; BERT-base at batch 4 and sequence 128 keeps 4.7 MB a layer of them, 56 MB over its
# twelve, beside the query, key and value the layer keeps anyway. PyTorch's CPU kernel keeps
# only those and the rows' log-sum-exp, and so does a flash-attention kernel on a GPU. So where
# it records a gradient, `scaled_dot_product_attention` is one autograd node that saves query,
# key, value, the mask and the rows' log-sum-exp m + log(sum(exp(s - m))) (m the row's maximum:
# the forward computes softmax by the very ops of `softmax`, so its weights have softmax's
# bits, and keeps m + log of the sum it divides by). Backward makes the scores again with the
# forward's own ops (`_attention_scores`) and the weights as exp(s - lse), one fused pass (they
# differ from the forward's by rounding), then dv = w^T g, dw = g v^T, the softmax's derivative
# ds = w * (dw - sum(dw * w)), dq = ds k * scale and dk = ds^T (q * scale): one more product of
# query and key a layer, and no (..., L, S) tensor between the passes. The composed path stays
# where the node could not give the composed gradients: dropout (its mask would have to be
# kept or drawn again), a float mask that wants its own gradient, operands whose leading
# dimensions broadcast, two-byte floats (their softmax derivative is computed in float32), and
# autocast (backward runs without it, so a recompute would not be the forward).
def _recomputes_weights(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None,
                        dropout_p: float) -> bool:
    """Whether attention records one node that recomputes its weights (Note [attention
    recomputes its weights])."""
    return (dropout_p == 0 and _mode.autocast is None
            and autograd.needs_grad(query, key, value)
            and query.dtype == key.dtype == value.dtype
            and query.dtype in (np.float32, np.float64)
            and query.shape[:-2] == key.shape[:-2] == value.shape[:-2]
            and (attn_mask is None or not attn_mask.requires_grad))


def _attention_recomputed(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None,
                          is_causal: bool, scale: float) -> Tensor:
    """Attention as one autograd node that saves its operands and the rows' log-sum-exp, not
    its weights (Note [attention recomputes its weights]); no out=, which autograd does not
    record."""
    with autograd.no_grad():
        scores, scaled = _attention_scores(query, key, scale, is_causal, attn_mask)
        scaled.release()
        ax = scores.ndim - 1
        # NOTE: `softmax`'s own steps (`_less_max`, `_softmax_and_sum`), so softmax's bits
        shifted, top = _less_max(scores, ax)
        scores.release()
        weights, total = _softmax_and_sum(shifted, ax, None)
        logs = _log(total)
        lse = add(top, logs)
        _release(top, total, logs)
        out = matmul(weights, value)
        weights.release()
    boolean = attn_mask is not None and attn_mask.dtype == np.bool_

    # NOTE: flags and a number only: Note [closures hold no tensors] in runtime/autograd.py
    def fn(g: Tensor, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None,
           lse: Tensor) -> tuple:
        scores, scaled = _attention_scores(query, key, scale, is_causal, attn_mask)
        weights = _pointwise([("sub", (("input", 0), ("input", 1))),
                              ("exp", (("link", 0),))], [scores, lse])
        scores.release()
        g_value = matmul(_swap_last(weights), g)
        g_weights = matmul(g, _swap_last(value))
        g_scores = _softmax_derivative(g_weights, weights, weights.ndim - 1)
        _release(weights, g_weights)
        if boolean:  # NOTE: as the composed `_where` passes it: zeros where the mask hides
            hidden = _where(attn_mask, g_scores, 0.0)
            g_scores.release()
            g_scores = hidden
        g_query = matmul(g_scores, key)
        mul(g_query, scale, out=g_query)
        g_key = matmul(_swap_last(g_scores), scaled)
        _release(g_scores, scaled)
        return g_query, g_key, g_value

    autograd.record("scaled_dot_product_attention", out, (query, key, value),
                    ("query", "key", "value"), fn,
                    [("query", query), ("key", key), ("value", value), ("attn_mask", attn_mask),
                     ("the rows' log-sum-exp", lse)])
    lse.release()  # NOTE: the node keeps its own handle
    return out


__all__ += ["amax", "softmax", "log_softmax", "layer_norm", "scaled_dot_product_attention"]
ALIASING_POLICY.update(dict.fromkeys(("amax", "softmax", "log_softmax", "layer_norm",
                                      "scaled_dot_product_attention"), NEVER))


def _linear_kernel(x: Any, weight: Any, bias: Any, out: Any, device: Any) -> None:
    """linear's kernel on whole views, for the fast path's launch (NumPy broadcasts the bias)."""
    _linear_views(device, x, weight.T, bias, out)


def _linear_views(device: Any, x: Any, weight_t: Any, bias: Any, out: Any) -> None:
    """out = x @ weight_t (+ bias) on native views; a two-byte float out (its operands share
    its dtype: `_common`) is computed in float32 and rounded once, as one op (backends/base.py
    HALVES): the product in float32 (on the halves themselves where the device can), the bias
    added in float32, one rounding."""
    if out.dtype in dtypes.HALVES:
        wide = device.scratch(out.shape, np.float32)
        device.product_in_float32(x, weight_t, wide)
        if bias is not None:
            device._in_float32(functools.partial(device.binary, "add"), (wide, bias), (wide,))
        device.cast(wide, out)
        return
    device.matmul(x, weight_t, out)
    if bias is not None:
        device.binary("add", out, bias, out)


def _cross_entropy_backward_kernel(probs: Any, labels: Any, grad: Any, out: Any,
                                   device: Any) -> None:
    device.cross_entropy_backward(probs, labels, grad, out)


def _reduce_kernel(x: Any, out: Any, device: Any, op: str, axes: Any, keepdims: bool) -> None:
    device.reduce(op, x, axes, keepdims, out)


def _no_launch(*args: Any) -> None:
    return None


# NOTE: Note [the eager fast path] in runtime/fastpath.py
_dispatch = fastpath.load(_record_elementwise, copy)
#: The C fast path of `_elementwise`, or None.
_fast = _dispatch.elementwise if _dispatch is not None else None
#: The C fast path of `_prepare_out` + `_launch` for matmul, linear and the reductions.
_fast_launch = _dispatch.launch if _dispatch is not None else _no_launch
#: The C fast path of a sum or mean that records nothing.
_fast_reduce = _dispatch.reduce if _dispatch is not None else _no_launch

# NOTE: what the modules below call, set once, last: Note [calls up to ops] in runtime/upcalls.py
OPS.provide(add=add, sub=sub, mul=mul, div=div, matmul=matmul, neg=neg, copy=copy, sum=sum)
