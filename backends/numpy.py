"""The NumPy CPU device: the embedded default backend.

Raw memory is a uint8 ndarray whose first byte is aligned to 64 bytes (a cache line and the
widest AVX-512 vector). Read-only memory (constants) is the same with `flags.writeable` off, so
every view over it is read-only too and a ufunc writing into one raises ValueError; only
`copyin` fills it, through a writable view of its own. Kernels are NumPy ufuncs writing into
`out=`; the runtime guarantees that `out` never partially overlaps an input, so nothing here
relies on NumPy's own overlap handling.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from backends import _blas, _erf, accelerated, optable

# NOTE: importing it starts the pool (Note [one pool for kernels and products] in
# backends/threads.py)
from backends import threads as _threads
from backends.base import (
    HALVES,
    Capabilities,
    Deferred,
    Device,
    numpy_col2im,
    numpy_cross_entropy,
    numpy_cross_entropy_backward,
    numpy_im2col,
    numpy_max_pool2d,
    numpy_max_pool2d_backward,
)

# NOTE: optional, as the allocator's hot path: np.copyto converts the same bits
_halfconv = accelerated.load("backends._halfconv")
_F16, _F32, _BF16 = np.dtype("float16"), np.dtype("float32"), np.dtype(ml_dtypes.bfloat16)
_WIDEN = {} if _halfconv is None else {_F16: _halfconv.widen, _BF16: _halfconv.widen_bf16}
_NARROW = {} if _halfconv is None else {_F16: _halfconv.narrow, _BF16: _halfconv.narrow_bf16}
#: `_halfconv`'s code of each op it runs, by name (its `ops`, made from backends/optable.py):
#: `apply` runs them on half operands, `float_op` on float32 and float64 ones (the
#: transcendental ones are left to NumPy's float32 loops, whose bits C's libm need not give).
#: Empty without the extension, as the two tables below.
_CODE = {} if _halfconv is None else {name: code for code, name in enumerate(_halfconv.ops)}
_APPLY = {name: code for name, code in _CODE.items() if name != "copy"}
#: `_halfconv.sub_scaled`'s code for each dtype it takes
_SUB_SCALED = {} if _halfconv is None else {_F32: 0, np.dtype(np.float64): 1, _F16: 2,
                                            _BF16: 3}
#: `_halfconv.float_op`'s kind for each dtype it takes (vectorised loops over contiguous
#: operands, NumPy's bits but for the payload of an operation on two NaNs)
_FLOAT_OP = {} if _halfconv is None else {_F32: 0, np.dtype(np.float64): 1}
#: The ops whose float32 and float64 kernels try `float_op` first: NumPy runs relu as a compare
#: and two masked copies, relu_backward through a boolean temporary and a casting multiply and
#: an add of a bias row through its broadcasting iterator (2-3x the C loops' time at 64x256)
_IN_C = ("relu", "relu_backward", "add")

# ---------------------------------------------------------------------- kernels from the table
#: Each primitive of backends/optable.py as NumPy computes it: a ufunc called as
#: f(*operands, out=target) (select is `_select`).
_PRIMITIVES = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
               "sqrt": np.sqrt, "abs": np.absolute, "exp": np.exp, "log": np.log,
               "tanh": np.tanh, "erf": functools.partial(_erf.erf, c=_halfconv),
               "lt": np.less, "gt": np.greater, "eq": np.equal, "isnan": np.isnan,
               "isfinite": np.isfinite, "either": np.logical_or}


def _identical(out: np.ndarray, x: Any) -> bool:
    """Whether x is out's own elements: the runtime lets out be the identical view of an input
    and overlap it in no other way. (np.may_share_memory alone is no test: it compares spans,
    and says True of disjoint views that interleave in one buffer.)"""
    if type(x) is not np.ndarray or not np.may_share_memory(out, x):
        return False
    x = np.broadcast_to(x, out.shape)  # NOTE: inputs come unbroadcast (NumPy broadcasts)
    return (x.__array_interface__["data"][0] == out.__array_interface__["data"][0]
            and all(n == 1 or s == t for n, s, t in zip(out.shape, x.strides, out.strides)))


def _select(c, a, b, out: np.ndarray) -> None:
    """out = a where c, else b; out may be a or b itself (each is read where out is not yet
    written)."""
    if _identical(out, a):
        np.copyto(out, b, where=np.logical_not(c))
        return
    if not _identical(out, b):
        np.copyto(out, b)
    np.copyto(out, a, where=c)


def _mask(node: Any) -> bool:
    """select(c, 1, 0): NumPy multiplies by the boolean c itself (cast to 1.0 or 0.0 exactly)."""
    return node.op == "select" and node.args[1:] == (1.0, 0.0)


def _plan(formula: Any) -> tuple[list, int]:
    """The formula as NumPy steps (Note [one declaration per op] in backends/optable.py): each
    node once, in the tree's order, (function, operands, target), an operand being ("arg", i),
    ("step", j) or a number and a target "out", ("temp", k) or None (a condition: NumPy makes
    its boolean array); and how many temporaries. A step may write out itself once no later
    step reads an operand of the op (which may be out: the runtime lets out be the identical
    view of an input); a buffer is reused once its value has been read (a step may write the
    buffer it reads: ufuncs and `_select` read each element first)."""
    order = [n for n in optable.nodes(formula) if n.op != "arg"]
    order = list(dict.fromkeys(order))
    position = {node: j for j, node in enumerate(order)}
    last_read: dict[int, int] = {}
    reads_arg = -1
    for j, node in enumerate(order):
        for a in node.args:
            if isinstance(a, optable.Expr):
                if a.op == "arg":
                    reads_arg = j
                else:
                    last_read[position[a]] = j
    steps: list = []
    held: dict[Any, int] = {}  # buffer -> the step whose value it holds

    def free(buffer: Any, j: int) -> bool:  # NOTE: read at step j at the latest
        return buffer not in held or last_read.get(held[buffer], -1) <= j

    temps = 0
    for j, node in enumerate(order):
        operands = tuple(a if not isinstance(a, optable.Expr) else
                         ("arg", a.args[0]) if a.op == "arg" else ("step", position[a])
                         for a in node.args)
        function = _select if node.op == "select" else _PRIMITIVES.get(node.op)
        if _mask(node):
            function, operands, target = None, operands[:1], None
        elif node.op in optable.CONDITIONS:
            target = None
        elif j == len(order) - 1 or j >= reads_arg and free("out", j):
            target = "out"
        else:
            spare = [("temp", k) for k in range(temps) if free(("temp", k), j)]
            target = spare[0] if spare else ("temp", temps)
            temps += not spare
        if target is not None:
            held[target] = j
        steps.append((function, operands, target))
    return steps, temps


#: The fewest items of a transposed 2-D copy that `_copy` hands to `_halfconv.transpose`
_TILED_LEAST = 1 << 12


def _copy(x: np.ndarray, out: np.ndarray) -> None:
    """out = x. A 2-D x that is the transpose of contiguous memory (conv2d's weight gradient,
    `ops.py`'s `copy(total.T)`), copied into a contiguous out, runs in tiles of 16 x 16 items
    (`_halfconv.transpose`): NumPy's copy reads such an x a cache line per item. On an AMD EPYC
    (2 vCPUs), float32: (4608, 512) 4.4 against 12.0 ms, (512, 2048) 0.95 against 2.98 ms,
    (2304, 256) 0.36 against 0.82 ms; tiles of 32, 64 and 128 were slower there (measured on
    this CPU only: BENCHMARKS.md)."""
    # NOTE: a Fortran-ordered 2-D x is the transpose of contiguous memory, x.T that memory
    if (x.ndim == 2 and x.size >= _TILED_LEAST and x.dtype == out.dtype and _halfconv is not None
            and x.flags.f_contiguous and out.flags.c_contiguous
            and _halfconv.transpose(out, x.T)):
        return
    if (out.size >= _POOLED_COPY_LEAST and x.dtype == out.dtype and out.dtype in _COPY_PROGRAMS
            and out.ndim and _threads.get_num_threads() > 1):
        # NOTE: runs of x's last axis (or one value: a fill) copied by a one-link chain, split
        # over the pool: NumPy's copy runs on one thread (4x512x28x28 float32 from its (1, 0,
        # 2, 3) transpose: 0.48 ms, 0.25 on two threads, 0.31 with the plan's making; Intel
        # Xeon, 2 vCPUs)
        spread = np.broadcast_to(x, out.shape)
        # NOTE: the chain reads a tile before writing it, which an x that overlaps out
        # elsewhere (a shifted view) would not survive: NumPy's copy takes those
        if spread.strides[-1] in (0, x.itemsize) and not np.may_share_memory(out, x):
            plan = _chain_plan(_COPY_PROGRAMS[out.dtype], [spread], out)
            if plan is not None:
                _halfconv.chain(plan)
                return
    np.copyto(out, x)


#: The fewest items of a copy that `_copy` splits over the pool (Note [one pool for kernels and
#: products] in backends/threads.py)
_POOLED_COPY_LEAST = 1 << 18
#: A copy as a one-link chain of `_halfconv.chain`, for each dtype it takes
_COPY_PROGRAMS = {dtype: [("copy", (("input", 0),), dtype)] for dtype in _FLOAT_OP}


def _kernel(op: Any) -> Any:
    """The NumPy kernel of a table op, called as kernel(*operands, out) or with out=: the ufunc
    itself where the formula is one primitive on the operands in order; else the steps of
    `_plan`, temporaries of out's shape and dtype made at each call."""
    formula = op.formula
    if formula.op == "arg":  # NOTE: copy
        return _copy
    if formula.op in _PRIMITIVES and formula.args == tuple(
            optable.Arg(i) for i in range(op.arity)):
        return _PRIMITIVES[formula.op]
    steps, temps = _plan(formula)

    def kernel(*operands: Any, out: Any = None) -> None:
        if out is None:
            *operands, out = operands
        scratch = [np.empty(out.shape, out.dtype) for _ in range(temps)]
        values: list[Any] = []
        for function, args, target in steps:
            inputs = [a if not isinstance(a, tuple) else operands[a[1]] if a[0] == "arg"
                      else values[a[1]] for a in args]
            where = out if target == "out" else None if target is None else scratch[target[1]]
            if function is None:  # NOTE: a mask: the condition itself
                values.append(inputs[0])
            elif where is None:
                values.append(function(*inputs))
            else:
                function(*inputs, out=where)
                values.append(where)

    kernel.__name__ = op.name
    return kernel


def _in_c(name: str, kernel: Any) -> Any:
    """`kernel` behind `_halfconv.float_op`, which takes contiguous float32 and float64
    operands of out's dtype (a row of out's last dimension for b) and returns False, having
    written nothing, for anything else."""
    code = _CODE.get(name)
    if code is None:
        return kernel
    if optable.BY_NAME[name].arity == 1:
        def unary(x: np.ndarray, out: np.ndarray) -> None:
            kind = _FLOAT_OP.get(out.dtype)
            if kind is None or x.dtype != out.dtype or not _halfconv.float_op(code, kind, out, x):
                kernel(x, out=out)
        return unary

    def binary(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        kind = _FLOAT_OP.get(out.dtype)
        if (kind is None or type(a) is not np.ndarray or type(b) is not np.ndarray
                or not a.dtype == b.dtype == out.dtype
                or not _halfconv.float_op(code, kind, out, a, b)):
            kernel(a, b, out=out)
    return binary


#: Items per tile of `_gelu_backward`'s exp: 64 KiB of float32, which stays in a core's cache
#: between the passes
_GELU_TILE = 1 << 14


def _gelu(kernel: Any) -> Any:
    """gelu's kernel as one C pass (`_halfconv.gelu_op`) over contiguous float32 and float64 x
    and out, else `kernel`, the formula op by op (its twin: the same bits, tests/test_halfconv.py).
    The op by op run makes three arrays of out's size and walks them six times; the C pass
    reads x once."""
    def gelu(x: np.ndarray, out: np.ndarray) -> None:
        kind = _FLOAT_OP.get(out.dtype)
        if (kind is None or type(x) is not np.ndarray or x.dtype != out.dtype
                or not _halfconv.gelu_op(kind, out, x)):
            kernel(x, out=out)
    return gelu


def _ufunc_loop(ufunc: np.ufunc, dtype: np.dtype) -> tuple[int, int] | None:
    """The (inner loop, data) addresses of a NumPy ufunc's loop with every operand of `dtype`,
    read from the ufunc object's public C layout (numpy/ufuncobject.h: after the object's
    header, int nin, nout, nargs, identity; then functions, data, int ntypes, reserved; then
    name, types), or None where the object does not read as that layout says (its name and
    arity are checked first). The caller checks the loop's bits before it uses it."""
    if ufunc.nout != 1 or ufunc.nin not in (1, 2):
        return None
    base, word = id(ufunc), ctypes.sizeof(ctypes.c_void_p)
    head = object.__basicsize__  # NOTE: PyObject_HEAD

    def read(offset: int, kind: Any) -> Any:
        return kind.from_address(base + offset).value

    ints = [read(head + 4 * k, ctypes.c_int) for k in range(3)]
    functions, data = read(head + 16, ctypes.c_void_p), read(head + 16 + word, ctypes.c_void_p)
    ntypes = read(head + 16 + 2 * word, ctypes.c_int)
    name, types = read(head + 24 + 2 * word, ctypes.c_void_p), read(
        head + 24 + 3 * word, ctypes.c_void_p)
    nargs = ufunc.nin + 1
    if (ints != [ufunc.nin, 1, nargs] or not functions or not name or not types
            or not 0 < ntypes < 256 or ctypes.string_at(name) != ufunc.__name__.encode()):
        return None
    codes = ctypes.string_at(types, nargs * ntypes)
    for k in range(ntypes):
        if all(code == dtype.num for code in codes[nargs * k:nargs * (k + 1)]):
            loop = ctypes.c_void_p.from_address(functions + k * word).value
            given = ctypes.c_void_p.from_address(data + k * word).value if data else None
            return (loop, given or 0) if loop else None
    return None


#: The one-input ufuncs whose NumPy loops a chain may call as links, in `_halfconv.set_loop`'s
#: order; np.add's loop comes next (`_ADD_LOOP`), for `_halfconv.sum_last`
_LOOPS = ("exp", "log", "tanh")
_ADD_LOOP = len(_LOOPS)


def _taken(which: int, ufunc: np.ufunc, dtype: np.dtype, kind: int,
           same: Callable[[int], bool]) -> int | None:
    """NumPy's loop of `ufunc` for `dtype`, read from its object (`_ufunc_loop`) and handed to
    C as loop `which` (`_halfconv.set_loop`): its chain code where `same(code)` finds the
    ufunc's own bits (run with floating-point warnings off), else None, the loop forgotten."""
    found = _ufunc_loop(ufunc, dtype)
    if found is None:
        return None
    code = _halfconv.set_loop(which, kind, *found)
    with np.errstate(all="ignore"):
        if same(code):
            return code
    _halfconv.set_loop(which, kind, 0, 0)
    return None


def _loops_in_c() -> dict[tuple[str, int], int]:
    """The chain code of each (ufunc name, float kind) whose NumPy loop C calls (`_taken`),
    checked in a one-link chain against the ufunc's own bits on values around every exponent
    and the special values. gelu's gradient calls the exp loops, and a chain of `_chain_plan`
    may take these ufuncs as links."""
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.standard_normal(4096) * 40, rng.uniform(-120, 90, 4096),
                             rng.uniform(0, 2, 4096), [0.0, -0.0, np.inf, -np.inf, np.nan,
                             1e-30, -1e-30, 88.7, 709.8, -745.2, -103.9, 1e-310, -1.0]])
    codes = {}
    for which, name in enumerate(_LOOPS):
        ufunc = _PRIMITIVES[name]
        for dtype, kind in _FLOAT_OP.items():
            x = values.astype(dtype)

            def same(code: int, x: np.ndarray = x, name: str = name, kind: int = kind,
                     ufunc: np.ufunc = ufunc) -> bool:
                got = np.empty_like(x)
                _halfconv.chain(_chain_plan([(name, (("input", 0),), x.dtype)], [x], got,
                                            {(name, kind): code}))
                return got.tobytes() == ufunc(x).tobytes()

            code = _taken(which, ufunc, dtype, kind, same)
            if code is not None:
                codes[(name, kind)] = code
    return codes


def _sum_loops_in_c() -> set[int]:
    """The float kinds whose sums over a last axis run NumPy's add loop from C
    (`_halfconv.sum_last`, `_taken`), checked against np.add.reduce's bits over rows of every
    length up to 3000 and of the special values (-0.0, NaN, infinities)."""
    rng = np.random.default_rng(1)
    kinds = set()
    for dtype, kind in _FLOAT_OP.items():
        cases = [(rng.standard_normal((3, n)) * 10.0 ** rng.integers(-3, 4)).astype(dtype)
                 for n in (1, 2, 7, 8, 9, 31, 128, 129, 768, 3000)]
        cases += [np.array([[-0.0], [-0.0], [0.0]], dtype),
                  np.array([[-0.0, -0.0], [np.inf, -np.inf], [np.nan, 1.0]], dtype)]

        def same(code: int, cases: list = cases, kind: int = kind) -> bool:
            for x in cases:
                got = np.empty(x.shape[0], x.dtype)
                if not (_halfconv.sum_last(kind, got, x)
                        and got.tobytes() == np.add.reduce(x, axis=-1).tobytes()):
                    return False
            return True

        if _taken(_ADD_LOOP, np.add, dtype, kind, same) is not None:
            kinds.add(kind)
    return kinds


def _gelu_backward(kernel: Any) -> Any:
    """gelu_backward's kernel over contiguous float32 and float64 g, x and out of one shape,
    in tiles: exp((x * -0.5) * x) by NumPy into a tile (the formula's own ufunc calls, so its
    bits), then the rest of the formula in one C pass (`_halfconv.gelu_op`); else `kernel`, the
    formula op by op, whose run makes four arrays of out's size and walks them eleven times."""
    def gelu_backward(g: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
        kind = _FLOAT_OP.get(out.dtype)
        if (kind is None or type(g) is not np.ndarray or type(x) is not np.ndarray
                or not g.dtype == x.dtype == out.dtype or not g.shape == x.shape == out.shape
                or not (g.flags.c_contiguous and x.flags.c_contiguous
                        and out.flags.c_contiguous and out.flags.writeable)):
            kernel(g, x, out=out)
            return
        if ("exp", kind) in _LOOP_CODES and _halfconv.gelu_op(kind, out, x, g):
            return  # NOTE: NumPy's exp loop on each tile, inside the one pass
        gs, xs, outs = g.reshape(-1), x.reshape(-1), out.reshape(-1)
        tile = np.empty(min(outs.size, _GELU_TILE), out.dtype)
        for start in range(0, outs.size, _GELU_TILE):
            part = slice(start, start + _GELU_TILE)
            x_part = xs[part]
            e = tile[:x_part.size]
            np.multiply(x_part, -0.5, out=e)
            np.multiply(e, x_part, out=e)
            np.exp(e, out=e)
            if not _halfconv.gelu_op(kind, outs[part], x_part, gs[part], e):
                # NOTE: the checks above are gelu_op's own: a refusal here is a bug, never a
                # tile silently left unwritten
                raise RuntimeError(f"gelu_op refused a tile of {x_part.size} items that "
                                   f"passed its checks ({out.dtype}, shape {out.shape})")
    return gelu_backward


#: Every elementwise kernel of the table, called as kernel(*inputs, out) (NumPy broadcasts the
#: inputs) or with out=
_KERNELS = {op.name: _in_c(op.name, _kernel(op)) if op.name in _IN_C else _kernel(op)
            for op in optable.OPS}
if _halfconv is not None:
    _KERNELS.update(gelu=_gelu(_KERNELS["gelu"]),
                    gelu_backward=_gelu_backward(_KERNELS["gelu_backward"]))
#: The kernels the eager fast path may run: it holds every operand to one dtype, so an op
#: with a bool condition (where) is left to the Python path, which checks it
_FAST = {op.name: _KERNELS[op.name] for op in optable.OPS
         if optable.BOOL not in op.operand_kinds}
_REDUCE = {"sum": np.sum, "mean": np.mean}


def _reduce(name: str, x: np.ndarray, axis: tuple[int, ...] | None, keepdims: bool,
            out: np.ndarray) -> None:
    if x.dtype in _FLOATS and x.dtype == out.dtype:
        # NOTE: what np.sum and np.mean do for floats, without their Python wrappers (a third
        # of the time of a small reduction): the same ufunc calls, the same bits; and over no
        # element 0 / 0, NaN, where np.mean would warn "Mean of empty slice" (Note [IEEE
        # results, no floating-point signals] in backends/base.py)
        if not (_rows_summed(x, axis, out) or _last_summed(x, axis, out)):
            np.add.reduce(x, axis=axis, keepdims=keepdims, out=out)
        if name == "mean":
            count = x.size if axis is None else math.prod(x.shape[i] for i in axis)
            np.true_divide(out, count, out=out)
        return
    _REDUCE[name](x, axis=axis, keepdims=keepdims, out=out)
_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _rows_summed(x: np.ndarray, axis: tuple[int, ...] | None, out: np.ndarray) -> bool:
    """Sum the rows of a 2-D float x into out in C, as NumPy adds them (in order; a bias's
    gradient, 2-3x NumPy's speed at 64x256); False, nothing written, where it does not apply."""
    return (axis == (0,) and x.ndim == 2 and bool(_FLOAT_OP)
            and _halfconv.sum_rows(_FLOAT_OP[x.dtype], out, x))


def _last_summed(x: np.ndarray, axis: tuple[int, ...] | None, out: np.ndarray) -> bool:
    """Sum a C-contiguous float x over its last axis in C, each row by NumPy's own add loop as
    its reduction calls it (`_halfconv.sum_last`, rows split over the pool: layer norm's
    means, softmax's sums), NumPy's bits by construction (checked at import:
    `_sum_loops_in_c`); False, nothing written, where it does not apply."""
    kind = _FLOAT_OP.get(x.dtype)
    return (kind in _SUM_IN_C and axis == (x.ndim - 1,) and x.flags.c_contiguous
            and out.flags.c_contiguous and bool(_halfconv.sum_last(kind, out, x)))


def _max_rows(x: np.ndarray, axis: tuple[int, ...] | None, out: np.ndarray) -> bool:
    """The maximum over the last axis of a contiguous float x in C (`_halfconv.max_rows`, 2.5x
    NumPy's time on softmax's 4 x 12 x 128 x 128), with NumPy's bits: a row whose maximum is
    NaN or zero is taken again from NumPy's own reduction, in place, since the payload of a NaN
    and the sign of a zero follow the order in which a reduction meets them; False, nothing
    written, where it does not apply."""
    kind = _FLOAT_OP.get(x.dtype)
    if (kind is None or axis != (x.ndim - 1,) or x.dtype != out.dtype
            or not out.flags.c_contiguous):
        return False
    count = _halfconv.max_rows(kind, out, x)  # NOTE: the rows to take again, or False
    if count is False or count > _MAX_ROWS_AGAIN:
        return False  # NOTE: NumPy writes every row (over)
    if count:
        rows, flat = x.reshape(-1, x.shape[-1]), out.reshape(-1)
        for row in np.flatnonzero((flat == 0) | np.isnan(flat)).tolist():
            flat[row] = np.maximum.reduce(rows[row])
    return True


#: The most rows `_max_rows` takes again from NumPy one by one (beyond it, NumPy takes all)
_MAX_ROWS_AGAIN = 32


def _sum(x: np.ndarray, out: np.ndarray, axes: tuple[int, ...] | None, keepdims: bool) -> None:
    """The fast path's sum: `_reduce("sum", ...)`, with the float case's ufunc called first
    (positional arguments: a fifth of the call's time goes to keywords)."""
    if x.dtype is out.dtype and x.size and x.dtype in _FLOATS:
        if not _rows_summed(x, axes, out):
            np.add.reduce(x, axes, None, out, keepdims)
    else:
        _reduce("sum", x, axes, keepdims, out)


def _rows(x: np.ndarray) -> np.ndarray | None:
    """x (..., m, k) as one (rows, k) view of its memory, or None where its leading axes do
    not merge without a copy."""
    try:
        return np.reshape(x, (-1, x.shape[-1]), copy=False)
    except ValueError:
        return None


def _convert(x: np.ndarray, out: np.ndarray) -> None:
    """out = x converted to out's dtype: float16 and bfloat16 to and from float32 in C
    (`backends/_halfconv.c`, any layout), anything else by NumPy."""
    if _halfconv is not None and x.shape == out.shape:
        if out.dtype == _F32 and x.dtype in _WIDEN:
            if x.flags.c_contiguous and out.flags.c_contiguous:
                return _WIDEN[x.dtype](x, out)  # NOTE: NumPy converts one item at a time
            if _halfconv.apply(_CODE["copy"], x.dtype == _BF16, out, x):
                return
        elif x.dtype == _F32 and out.dtype in _NARROW:
            if x.flags.c_contiguous and out.flags.c_contiguous:
                return _NARROW[out.dtype](x, out)
            if _halfconv.apply(_CODE["copy"], out.dtype == _BF16, out, x):
                return
    np.copyto(out, x, casting="unsafe")  # NOTE: runtime.ops.cast allowed only exact or IEEE


def _widen(x: np.ndarray) -> np.ndarray:
    """A float32 array equal to the half array x (`Device._widened`): new, or a broadcast
    view of a new one."""
    flags = x.flags
    if flags.c_contiguous and _halfconv is not None:
        w = np.empty(x.shape, _F32)
        _WIDEN[x.dtype](x, w)
        return w
    if not flags.c_contiguous:
        if flags.f_contiguous:  # NOTE: a transposed weight, widened as its contiguous self
            return _widen(x.T).T
        strides = x.strides
        if 0 in strides:  # NOTE: a broadcast operand is widened once, not at every repeat
            compact = x[tuple(0 if s == 0 else slice(None) for s in strides)]
            return np.broadcast_to(np.expand_dims(_widen(compact), tuple(
                i for i, s in enumerate(strides) if s == 0)), x.shape)
    w = np.empty(x.shape, _F32)
    _convert(x, w)
    return w


def _compute_in_float32(kernel, inputs, outs, read=False) -> None:
    """`Device._in_float32` with its scratch as np.empty and its tests inline (a product of
    64x256 halves spent as long in that Python as in its three conversions)."""
    wide = []
    for x in inputs:
        dtype = getattr(x, "dtype", None)
        if dtype in HALVES:
            x = _widen(x) if type(x) is np.ndarray else np.float32(x)
        wide.append(x)
    targets = []
    for o in outs:
        if o.dtype in HALVES:
            t = np.empty(o.shape, _F32)
            if read:
                _convert(o, t)
            targets.append(t)
        else:
            targets.append(o)
    kernel(*wide, *targets)
    for t, o in zip(targets, outs):
        if t is not o:
            _convert(t, o)


def _sub_scaled_kernel(a: np.ndarray, b: np.ndarray, scale, out: np.ndarray) -> None:
    """The fast path's `Device.sub_scaled` (inputs that NumPy broadcasts, `scale` of the compute
    dtype): one C pass over contiguous operands of out's shape, else the product into a
    temporary and the difference, by the device's own kernels (the same bits either way)."""
    kind = _SUB_SCALED.get(out.dtype)
    if kind is not None and _halfconv.sub_scaled(kind, out, a, b, scale):
        return
    kernels = _FAST_HALF if out.dtype in HALVES else _KERNELS
    product = np.empty(b.shape, out.dtype)
    kernels["mul"](b, scale, product)
    kernels["sub"](a, product, out)


def _half_kernel(name: str):
    """The fast path's kernel `name` for float16 and bfloat16 (Note [the eager fast path] in
    runtime/fastpath.py), called as kernel(*inputs, out) with inputs NumPy would broadcast:
    one C pass where `_halfconv.apply` takes it, else NumPy's float32 kernel on widened copies
    (Note [two-byte floats compute in float32] in backends/base.py)."""
    code = _APPLY.get(name)
    float32 = _KERNELS[name]

    def kernel(*args):
        out = args[-1]
        if code is None or not _halfconv.apply(code, out.dtype == _BF16, out, *args[:-1]):
            _compute_in_float32(float32, args[:-1], (out,))
    return kernel


#: The fast path's kernels for float16 and bfloat16 (copy, which moves bits, is the float
#: table's own)
_FAST_HALF = {**{name: _half_kernel(name) for name in _FAST if name != "copy"},
              "sub_scaled": _sub_scaled_kernel}


def _bound(blas: Any, a: np.ndarray, b: np.ndarray, out: np.ndarray, alpha: float,
           beta: float) -> Any:
    """`blas`'s product bound to these views (`_blas.Gemm.bind`), or None: no CBLAS, layouts
    it cannot read, or a Chooser still measuring two libraries (it has no `bind`, and each
    call decides)."""
    bind = getattr(blas, "bind", None)
    return None if bind is None else bind(a, b, out, alpha, beta)


#: The most dims (after merging) and operands `_halfconv.chain` takes
_CHAIN_DIMS, _CHAIN_OPERANDS = 8, 64


def _chain_ops(program: Any, dtype: np.dtype, loops: Any = None) -> bool:
    """Whether `_halfconv.chain` runs every link of `program` (an op of `_CODE` or one of
    NumPy's loops that C calls, `_LOOP_CODES`, of one or two operands, of `dtype`, float32 or
    float64) with out of `dtype`."""
    kind = _FLOAT_OP.get(dtype)
    loops = _LOOP_CODES if loops is None else loops
    return kind is not None and all(
        (name in _CODE or (name, kind) in loops) and np.dtype(link) == dtype and len(args) <= 2
        for name, args, link in program)


def _chain_plan(program: Any, inputs: Sequence[np.ndarray], out: np.ndarray,
                loops: Any = None) -> np.ndarray | None:
    """The int64 plan of `_halfconv.chain` for a fused chain (`Device.fused`): every link an
    op of `_CODE` of its arity, every dtype out's float32 or float64, out C-contiguous, and
    the operands (inputs, and each number as a one-item array) laid over out's dims after
    merging the neighbours that every operand walks alike; the plan holds the arrays it
    points into. None where the chain is not of that form (the blocked default runs it)."""
    kind = _FLOAT_OP.get(out.dtype)
    loops = _LOOP_CODES if loops is None else loops
    if (kind is None or not out.flags.c_contiguous or out.size == 0
            or not _chain_ops(program, out.dtype, loops)):
        return None
    shape = out.shape
    numbers: list[np.ndarray] = []
    links: list[int] = []
    for name, args, _ in program:
        code = _CODE[name] if name in _CODE else loops[(name, kind)]
        refs = []
        for what, ref in args:
            if what == "input":
                view = inputs[ref]
                if view.dtype != out.dtype or view.shape != shape:
                    return None
                refs.append(ref)
            elif what == "link":
                refs.append(-1 - ref)
            else:
                refs.append(len(inputs) + len(numbers))
                numbers.append(np.array(ref, out.dtype).reshape((1,) * len(shape)))
        links += [code, *refs, *(0,) * (2 - len(refs))]
    views = [*inputs, *numbers]
    itemsize = out.dtype.itemsize
    if len(views) > _CHAIN_OPERANDS or any(s % itemsize for v in views for s in v.strides):
        return None
    dims: list[int] = []
    steps: list[list[int]] = [[] for _ in views]
    for axis, n in enumerate(shape):
        if n == 1:
            continue
        strides = [0 if v.shape[axis] == 1 else v.strides[axis] // itemsize for v in views]
        if dims and all(st[-1] == s * n for st, s in zip(steps, strides)):
            dims[-1] *= n
            for st, s in zip(steps, strides):
                st[-1] = s
            continue
        dims.append(n)
        for st, s in zip(steps, strides):
            st.append(s)
    if len(dims) > _CHAIN_DIMS:
        return None
    pad = max(0, 2 - len(dims))
    dims = [1] * pad + dims
    plan = [kind, len(program), len(views), len(dims), out.ctypes.data, *dims, *links]
    for view, st in zip(views, steps):
        plan += [view.ctypes.data, *([0] * pad + st)]
    return _Plan(np.array(plan, np.int64), [out, *views])


class _Plan(np.ndarray):
    """A chain's plan that holds the arrays its addresses point into."""

    def __new__(cls, plan: np.ndarray, held: list[np.ndarray]) -> _Plan:
        obj = plan.view(cls)
        obj.held = held
        return obj


#: NumPy's loops that C calls, by (ufunc name, float kind): their chain codes (`_loops_in_c`)
_LOOP_CODES = _loops_in_c() if _halfconv is not None else {}
#: The float kinds whose last-axis sums run NumPy's add loop from C (`_sum_loops_in_c`)
_SUM_IN_C = _sum_loops_in_c() if _halfconv is not None else set()


class NumpyDevice(Device):
    """Host memory and NumPy kernels. There is one CPU device: index 0."""

    alignment = 64
    capabilities = Capabilities(
        read_only_memory=True,  # NOTE: non-writeable ndarrays
        host_memory=True,
        half_elementwise=True,  # NOTE: `_halfconv.apply`, where the extension is built
        # NOTE: `_halfconv.chain` for float32 / float64 chains of its ops, where it is built
        compiles_fused=_halfconv is not None,
        # NOTE: a graph's lone elementwise steps too, so that they split over the pool (Note
        # [one pool for kernels and products] in backends/threads.py)
        chains_lone_steps=_halfconv is not None,
        # NOTE: `_halfconv.im2col` and `col2im`, one C pass each (their NumPy references
        # without the extension)
        conv_columns=True,
        # NOTE: the CBLAS is chosen at the first product (BLOCKRT_BLAS), not with the device
        gemm_accumulates=Deferred(lambda: _blas.find() is not None, "a CBLAS is in use"),
        measures_products=True,
        # NOTE: every elementwise kernel, called as kernel(*inputs, out) (NumPy broadcasts the
        # inputs), and the reductions, as kernel(x, out, axes, keepdims)
        fast_kernels={**_FAST, "sum": _sum,
                      "mean": lambda x, out, axes, keepdims: _reduce("mean", x, axes, keepdims,
                                                                    out),
                      "sub_scaled": _sub_scaled_kernel},
        fast_half_kernels=_FAST_HALF)

    def __init__(self, index: int = 0) -> None:
        self.name = "cpu"

    @property
    def total_memory(self) -> int | None:
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None

    def _raw_alloc(self, nbytes: int) -> np.ndarray:
        try:
            base = np.empty(nbytes + self.alignment, dtype=np.uint8)
        except ValueError as exc:  # NumPy's "array is too big" is a failed allocation too
            raise MemoryError(f"cannot allocate {nbytes} bytes: {exc}") from exc
        start = -base.ctypes.data % self.alignment
        # NOTE: an empty slice keeps its base's pointer; slice one byte first so 0 bytes align too
        return base[start:start + nbytes] if nbytes else base[start:start + 1][:0]

    def _raw_alloc_read_only(self, nbytes: int) -> np.ndarray:
        raw = self._raw_alloc(nbytes)
        raw.flags.writeable = False
        return raw

    def _is_read_only(self, raw: np.ndarray) -> bool:
        return not raw.flags.writeable

    def _raw_free(self, raw: np.ndarray) -> None:
        pass  # the memory goes back when the last reference to `raw` is dropped

    def _copyin(self, raw: np.ndarray, offset: int, host_bytes: np.ndarray) -> None:
        if not raw.flags.writeable:  # read-only to kernels, not to the host filling it
            raw = raw.view()
            raw.flags.writeable = True  # NOTE: allowed: the base array we allocated is writable
        raw[offset:offset + host_bytes.size] = host_bytes

    def _copyout(self, raw: np.ndarray, offset: int, nbytes: int) -> np.ndarray:
        return raw[offset:offset + nbytes].copy()

    def _array_view(self, raw, offset, shape, dtype, strides) -> np.ndarray:
        # NOTE: positional: NumPy parses ndarray()'s keywords slowly (0.80 against 0.39 us)
        return np.ndarray(shape, dtype, raw, offset, strides)

    def _address(self, raw: np.ndarray) -> int:
        return raw.ctypes.data

    def _nbytes_of(self, raw: np.ndarray) -> int:
        return raw.nbytes

    def _unary(self, name, x, out) -> None:
        _KERNELS[name](x, out=out)

    def _binary(self, name, a, b, out) -> None:
        _KERNELS[name](a, b, out=out)

    def _ternary(self, name, a, b, c, out) -> None:
        _KERNELS[name](a, b, c, out=out)

    def scratch(self, shape, dtype) -> np.ndarray:  # NOTE: a host array is its own memory
        return np.empty(tuple(shape), dtype)

    def _half_elementwise(self, name, operands, out) -> bool:
        # NOTE: one C pass: Note [two-byte floats compute in float32] in backends/base.py
        code = _APPLY.get(name)
        if code is None:
            return False
        dtype = out.dtype
        for x in operands:  # NOTE: ops give them out's dtype; a float32 one is read as such
            if getattr(x, "dtype", dtype) != dtype and x.dtype != _F32:
                return False
        return _halfconv.apply(code, dtype == _BF16, out, *operands)

    def _sub_scaled(self, a, b, scale, out, scratch) -> None:
        # NOTE: one C pass over contiguous operands (the product rounded first, no FMA)
        kind = _SUB_SCALED.get(out.dtype)
        if kind is None or not _halfconv.sub_scaled(kind, out, a, b, scale):
            super()._sub_scaled(a, b, scale, out, scratch)

    # NOTE: functions of the module (the conversions need no device state), set as methods
    _in_float32 = staticmethod(_compute_in_float32)
    _widened = staticmethod(_widen)
    _cast = staticmethod(_convert)

    def _matmul(self, a, b, out) -> None:
        if out.ndim > 2 and b.ndim == 2 and a.ndim == out.ndim:
            # NOTE: a stack of matrices times one matrix (linear on (batch, seq, features)) is
            # one 2-D product where the stack's rows merge into one matrix: the CBLAS's call,
            # where np.matmul would loop over the stack (1.2x the time at 4x128x3072 @ 3072x768)
            rows_a, rows_out = _rows(a), _rows(out)
            if rows_a is not None and rows_out is not None:
                a, out = rows_a, rows_out
        blas = _blas.find()
        # NOTE: 2-D products go where gemm goes, unless that is NumPy's own BLAS (`products`
        # False): Note [one thread pool per process] in backends/_blas_choice.py
        if out.ndim != 2 or blas is None or not blas.products or not blas(a, b, out, 1.0, 0.0):
            np.matmul(a, b, out=out)

    def _prepared_gemm(self, a, b, out, alpha, beta):
        # NOTE: the CBLAS call `_gemm` makes, its arguments converted once
        run = _bound(_blas.find(), a, b, out, alpha, beta)
        return run if run is not None else super()._prepared_gemm(a, b, out, alpha, beta)

    def _prepared_matmul(self, a, b, out):
        # NOTE: where `_matmul` sends a 2-D product: np.matmul, or the CBLAS (bound once)
        if out.ndim == 2:
            blas = _blas.find()
            if blas is None or not blas.products:
                return functools.partial(np.matmul, a, b, out=out)
            run = _bound(blas, a, b, out, 1.0, 0.0)
            if run is not None:
                return run
        return super()._prepared_matmul(a, b, out)

    def _plan_products(self, products) -> None:
        _blas.expect(products)  # while the CBLAS is being chosen, these are what it times

    def _gemm(self, a, b, out, alpha, beta) -> None:
        blas = _blas.find()
        if blas is None or not blas(a, b, out, alpha, beta):  # False: layouts it can't read
            super()._gemm(a, b, out, alpha, beta)

    def _reduce(self, name, x, axis, keepdims, out) -> None:
        _reduce(name, x, axis, keepdims, out)

    def fused_scratch(self, program, shape, dtype):
        # NOTE: a chain `_chain_plan` takes needs none (its tiles are its own); one it does
        # not take makes its scratch when first prepared
        if self.capabilities.compiles_fused and _chain_ops(program, np.dtype(dtype)):
            return []
        return super().fused_scratch(program, shape, dtype)

    if _halfconv is not None:  # NOTE: written where `compiles_fused` is claimed, as the kit holds

        def _compile_fused(self, program, inputs, out):
            plan = _chain_plan(program, inputs, out)
            if plan is None:
                return None
            run = _halfconv.chain
            return lambda: run(plan)

    def _im2col(self, x, kernel, stride, padding, columns) -> None:
        if _halfconv is None or not _halfconv.im2col(columns, x, *kernel, *stride, *padding):
            numpy_im2col(x, kernel, stride, padding, columns)

    def _col2im(self, columns, kernel, stride, padding, out) -> None:
        kind = _FLOAT_OP.get(out.dtype)
        if kind is None or not _halfconv.col2im(kind, out, columns, *kernel, *stride, *padding):
            numpy_col2im(columns, kernel, stride, padding, out)

    def _moments(self, x, mean, m2) -> None:
        # NOTE: one C pass for the mean and one for the squares around it, in double, over
        # contiguous float32 / float64 (`_halfconv.moments`); the base's chunks elsewhere:
        # Note [batch norm's statistics in one kernel] in runtime/ops.py
        kind = _FLOAT_OP.get(x.dtype)
        if kind is None or not _halfconv.moments(kind, mean, m2, x):
            super()._moments(x, mean, m2)

    def _channel_dots(self, g, y, sums, dots) -> None:
        kind = _FLOAT_OP.get(g.dtype)
        if kind is None or not _halfconv.channel_dots(kind, sums, dots, g, y):
            super()._channel_dots(g, y, sums, dots)

    def _reduce_max(self, x, axis, keepdims, out) -> None:
        if not _max_rows(x, axis, out):
            np.maximum.reduce(x, axis=axis, keepdims=keepdims, out=out)  # NOTE: NaN propagates

    # NOTE: the host formulas are the CPU's own (the base's default runs them on copies)
    _cross_entropy = staticmethod(numpy_cross_entropy)
    _cross_entropy_backward = staticmethod(numpy_cross_entropy_backward)

    def _max_pool2d(self, x, kernel, stride, padding, out, indices) -> None:
        # NOTE: one C pass over contiguous float32 / float64 (`_halfconv.max_pool`; the
        # vectorised twin, which takes any other layout, takes 12x its time on ResNet-50's
        # pool, and 6x on the backward)
        kind = _FLOAT_OP.get(out.dtype)
        if (kind is None or x.dtype != out.dtype or type(x) is not np.ndarray
                or not _halfconv.max_pool(kind, out, indices, x, *kernel, *stride, *padding)):
            numpy_max_pool2d(x, kernel, stride, padding, out, indices)

    def _max_pool2d_backward(self, grad, indices, out) -> None:
        kind = _FLOAT_OP.get(out.dtype)
        if (kind is None or grad.dtype != out.dtype or indices.dtype != np.int64
                or not _halfconv.max_pool_backward(kind, out, grad, indices)):
            numpy_max_pool2d_backward(grad, indices, out)

    def _to_host(self, view: np.ndarray) -> np.ndarray:
        return np.array(view, copy=True)

    def _from_host(self, host: np.ndarray, view: np.ndarray) -> None:
        np.copyto(view, host)

    def _gather(self, table, indices, out) -> None:
        np.take(table, indices, axis=0, out=out)  # NOTE: `gather` checked the indices

    def _scatter_add(self, src, indices, out) -> None:
        np.add.at(out, indices, src)  # NOTE: unbuffered, in index order: the kit's reference

