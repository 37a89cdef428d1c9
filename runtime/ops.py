"""Ops on tensors, each with `out=`, dispatched to the device's kernels under an aliasing policy.

Every op declares how its output may share memory with its inputs:

- ELEMENTWISE: the output may be the identical view of an input (each element is read before
  the same element is written); any other overlap is unsafe.
- NEVER: no overlap at all (matmul, reductions), not even the identical view.

Before a kernel runs, `out` is tested against every input on the same block with the exact test
of `runtime.aliasing`. An unsafe overlap is computed into a temporary and copied into `out`
("copy" mode, the default) or raises AliasingError ("raise" mode). Kernels therefore never see
partially overlapping operands, on any backend.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from runtime import aliasing, config
from runtime.errors import AliasingError
from runtime.tensor import Tensor

__all__ = ["ALIASING_POLICY", "add", "sub", "mul", "div", "neg", "exp", "log", "tanh", "sigmoid",
           "relu", "matmul", "sum", "mean", "copy"]

ELEMENTWISE = "elementwise"
NEVER = "never"

#: What each op declares about its output sharing memory with its inputs (see the module docstring).
ALIASING_POLICY: dict[str, str] = {
    **dict.fromkeys(("add", "sub", "mul", "div", "neg", "exp", "log", "tanh", "sigmoid", "relu",
                     "copy"), ELEMENTWISE),
    **dict.fromkeys(("matmul", "sum", "mean"), NEVER),
}

FLOAT_DTYPES = (np.dtype("float32"), np.dtype("float64"))

Operand = Any  # a Tensor, or a Python/NumPy real number for binary ops


# ---------------------------------------------------------------------- checks
def _common(op: str, tensors: Sequence[Tensor], floats_only: bool = True) -> tuple:
    """(device, dtype) shared by all tensor operands, or a clear TypeError/ValueError."""
    first = tensors[0]
    for t in tensors:
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: expected a Tensor, got {type(t).__name__}")
    for t in tensors[1:]:
        if t.device is not first.device:
            raise ValueError(f"{op}: operands are on different devices: {first.device.name} and "
                             f"{t.device.name}; copy one over first")
        if t.dtype != first.dtype:
            raise TypeError(f"{op}: operands have different dtypes: {first.dtype} and {t.dtype}; "
                            f"convert one first")
    if floats_only and first.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: supports float32 and float64, got {first.dtype}")
    return first.device, first.dtype


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


def _prepare_out(op: str, out: Tensor | None, shape: tuple, dtype: np.dtype,
                 like: Tensor) -> Tensor:
    if out is None:
        return Tensor._fresh(shape, dtype, like.block.allocator)
    if not isinstance(out, Tensor):
        raise TypeError(f"{op}: out must be a Tensor, got {type(out).__name__}")
    if out.shape != shape:
        raise ValueError(f"{op}: out has shape {out.shape}, the result has shape {shape}")
    if out.dtype != dtype:
        raise TypeError(f"{op}: out has dtype {out.dtype}, the result has dtype {dtype}")
    if out.device is not like.device:
        raise ValueError(f"{op}: out is on {out.device.name}, the inputs on {like.device.name}")
    if out.has_internal_overlap():
        raise ValueError(f"{op}: out has internally overlapping memory (strides {out.strides}); "
                         f"writing to it is ill-defined")
    return out


def _clashes(policy: str, out: Tensor, inputs: Sequence[tuple[str, Tensor, tuple]]) -> list[str]:
    """Descriptions of the inputs whose memory `out` may not share under `policy`."""
    found = []
    out_span = None
    for label, t, shape in inputs:
        if t.block is not out.block:
            continue
        out_span = out_span or out.byte_span()
        span = t.byte_span()  # NOTE: broadcasting adds only zero strides: the span is the same
        if out_span is None or span is None or span[1] <= out_span[0] or out_span[1] <= span[0]:
            continue
        layout, out_layout = t.layout(shape), out.layout()
        if policy == ELEMENTWISE and aliasing.same_elements(layout, out_layout):
            continue
        if aliasing.overlaps(layout, out_layout):
            found.append(aliasing.describe(f"input {label}", t.block.id, layout))
    return found


# ---------------------------------------------------------------------- dispatch
def _launch(op: str, out: Tensor, inputs: Sequence[tuple[str, Tensor, tuple]],
            run: Callable[[list, Any], None], scalars: dict[int, Any] | None = None) -> Tensor:
    """Run `run(input_views, out_view)` under the op's declared aliasing policy.

    `inputs` are (label, tensor, broadcast shape); `scalars` maps argument positions to numbers.
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
        temp = Tensor._fresh(out.shape, out.dtype, out.block.allocator)
        try:
            _launch(op, temp, inputs, run, scalars)
            out.device.unary("copy", temp._native_read(op), out._native_write(op))
            out.block.mark_written()
        finally:
            temp.release()
        return out
    views = [t._native_read(op, shape) for _, t, shape in inputs]
    if scalars:
        for position, value in scalars.items():
            views.insert(position, value)
    target = out._native_write(op)
    run(views, target)
    out.block.mark_written()
    return out


def _is_scalar(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _elementwise(op: str, out: Tensor | None, *operands: Operand) -> Tensor:
    """Run the elementwise kernel named `op` (the device's kernel has the op's name)."""
    # NOTE: one pass sorts the operands: (label, tensor) pairs, and numbers by argument position.
    labels = "ab" if len(operands) == 2 else "x"
    named: list[tuple[str, Tensor]] = []
    numbers_at: dict[int, Any] = {}
    for i, x in enumerate(operands):
        if isinstance(x, Tensor):
            named.append((labels[i], x))
        elif _is_scalar(x):
            numbers_at[i] = x
        else:
            raise TypeError(f"{op}: operands must be Tensors or real numbers, got "
                            f"{type(x).__name__}")
    if not named:
        raise TypeError(f"{op}: needs at least one Tensor operand, got "
                        f"{', '.join(type(x).__name__ for x in operands)}")
    tensors = [t for _, t in named]
    device, dtype = _common(op, tensors, floats_only=op != "copy")
    shapes = [t.shape for t in tensors]
    if isinstance(out, Tensor):
        shapes.append(out.shape)  # as in NumPy, the inputs broadcast to out's shape
    try:
        shape = _broadcast_shapes(shapes)
    except ValueError:
        raise ValueError(f"{op}: shapes {' and '.join(map(str, shapes))} cannot be broadcast "
                         f"together{' (the last is out)' if isinstance(out, Tensor) else ''}"
                         ) from None
    out = _prepare_out(op, out, shape, dtype, tensors[0])
    inputs = [(label, t, shape) for label, t in named]
    scalars = {i: dtype.type(x) for i, x in numbers_at.items()}
    if len(operands) == 1:
        return _launch(op, out, inputs, lambda v, o: device.unary(op, v[0], o))
    return _launch(op, out, inputs, lambda v, o: device.binary(op, v[0], v[1], o), scalars)


# ---------------------------------------------------------------------- elementwise ops
def add(a: Operand, b: Operand, out: Tensor | None = None) -> Tensor:
    """a + b elementwise, with broadcasting; either may be a number. `out` may be a or b."""
    return _elementwise("add", out, a, b)


def sub(a: Operand, b: Operand, out: Tensor | None = None) -> Tensor:
    """a - b elementwise, with broadcasting."""
    return _elementwise("sub", out, a, b)


def mul(a: Operand, b: Operand, out: Tensor | None = None) -> Tensor:
    """a * b elementwise, with broadcasting."""
    return _elementwise("mul", out, a, b)


def div(a: Operand, b: Operand, out: Tensor | None = None) -> Tensor:
    """a / b elementwise, with broadcasting."""
    return _elementwise("div", out, a, b)


def neg(x: Tensor, out: Tensor | None = None) -> Tensor:
    """-x elementwise."""
    return _elementwise("neg", out, x)


def exp(x: Tensor, out: Tensor | None = None) -> Tensor:
    """e**x elementwise."""
    return _elementwise("exp", out, x)


def log(x: Tensor, out: Tensor | None = None) -> Tensor:
    """Natural logarithm elementwise."""
    return _elementwise("log", out, x)


def tanh(x: Tensor, out: Tensor | None = None) -> Tensor:
    """Hyperbolic tangent elementwise."""
    return _elementwise("tanh", out, x)


def sigmoid(x: Tensor, out: Tensor | None = None) -> Tensor:
    """1 / (1 + e**-x) elementwise, without overflow for large |x|."""
    return _elementwise("sigmoid", out, x)


def relu(x: Tensor, out: Tensor | None = None) -> Tensor:
    """max(x, 0) elementwise."""
    return _elementwise("relu", out, x)


def copy(x: Tensor, out: Tensor | None = None) -> Tensor:
    """A copy of x (any dtype); with `out`, x is broadcast into out's shape.

    Example:
        >>> import numpy as np, runtime
        >>> runtime.ops.copy(runtime.tensor(np.arange(3.0))).numpy()
        array([0., 1., 2.])
    """
    return _elementwise("copy", out, x)


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
    device, dtype = _common("matmul", [a, b])
    shape = _matmul_shape(a, b)
    out = _prepare_out("matmul", out, shape, dtype, a)
    inputs = [("a", a, a.shape), ("b", b, b.shape)]
    return _launch("matmul", out, inputs, lambda v, o: device.matmul(v[0], v[1], o))


# ---------------------------------------------------------------------- reductions
def _axes(op: str, axis: Any, ndim: int) -> tuple[int, ...] | None:
    if axis is None:
        return None
    items = axis if isinstance(axis, (tuple, list)) else (axis,)
    axes = []
    for a in items:
        if isinstance(a, bool) or not isinstance(a, numbers.Integral):
            raise TypeError(f"{op}: axis must be an int or a tuple of ints, got {axis!r}")
        if not -ndim <= a < ndim:
            raise ValueError(f"{op}: axis {a} is out of range for a {ndim}-dimensional tensor")
        axes.append(int(a) % ndim)
    if len(set(axes)) != len(axes):
        raise ValueError(f"{op}: axis {axis!r} repeats an axis")
    return tuple(sorted(axes))


def _reduce(op: str, x: Tensor, axis: Any, keepdims: bool, out: Tensor | None) -> Tensor:
    device, dtype = _common(op, [x])
    axes = _axes(op, axis, x.ndim)
    reduced = range(x.ndim) if axes is None else axes
    shape = tuple(1 if i in reduced else n for i, n in enumerate(x.shape) if keepdims or
                  i not in reduced)
    out = _prepare_out(op, out, shape, dtype, x)
    return _launch(op, out, [("x", x, x.shape)],
                   lambda v, o: device.reduce(op, v[0], axes, keepdims, o))


def sum(x: Tensor, axis: Any = None, keepdims: bool = False,
        out: Tensor | None = None) -> Tensor:
    """The sum over `axis` (an int, a tuple, or None for all). `out` may not overlap x."""
    return _reduce("sum", x, axis, keepdims, out)


def mean(x: Tensor, axis: Any = None, keepdims: bool = False,
         out: Tensor | None = None) -> Tensor:
    """The mean over `axis` (an int, a tuple, or None for all). `out` may not overlap x."""
    return _reduce("mean", x, axis, keepdims, out)
