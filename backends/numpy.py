"""The NumPy CPU device: the embedded default backend.

Raw memory is a uint8 ndarray whose first byte is aligned to 64 bytes (a cache line and the
widest AVX-512 vector). Read-only memory (constants) is the same with `flags.writeable` off, so
every view over it is read-only too and a ufunc writing into one raises ValueError; only
`copyin` fills it, through a writable view of its own. Kernels are NumPy ufuncs writing into
`out=`; the runtime guarantees that `out` never partially overlaps an input, so nothing here
relies on NumPy's own overlap handling.
"""

from __future__ import annotations

import functools
import math
import os

import ml_dtypes
import numpy as np

from backends import _blas, accelerated
from backends.base import HALVES, Device

# NOTE: optional, as the allocator's hot path: np.copyto converts the same bits
_halfconv = accelerated.load("backends._halfconv")
_F16, _F32, _BF16 = np.dtype("float16"), np.dtype("float32"), np.dtype(ml_dtypes.bfloat16)
_WIDEN = {} if _halfconv is None else {_F16: _halfconv.widen, _BF16: _halfconv.widen_bf16}
_NARROW = {} if _halfconv is None else {_F16: _halfconv.narrow, _BF16: _halfconv.narrow_bf16}
#: The kernels `_halfconv.apply` runs on half operands itself, by its code for them (the
#: transcendental ones are left to NumPy's float32 loops, whose bits C's libm need not give).
#: Empty without the extension, as the two tables below.
_APPLY = {} if _halfconv is None else {
    "add": 1, "sub": 2, "mul": 3, "div": 4, "neg": 5, "relu": 6, "sqrt": 7, "relu_backward": 8,
    "tanh_backward": 9, "sigmoid_backward": 10}
#: `_halfconv.sub_scaled`'s code for each dtype it takes
_SUB_SCALED = {} if _halfconv is None else {_F32: 0, np.dtype(np.float64): 1, _F16: 2,
                                            _BF16: 3}
#: `_halfconv.float_op`'s kind for each dtype it takes (its relu, relu_backward, add and sum
#: of rows: vectorised loops over contiguous operands, NumPy's bits but for the payload of a sum
#: of two NaNs; NumPy takes 2-3x as long at 64x256)
_FLOAT_OP = {} if _halfconv is None else {_F32: 0, np.dtype(np.float64): 1}


def _sigmoid(x: np.ndarray, out: np.ndarray) -> None:
    # NOTE: 0.5 * tanh(0.5 x) + 0.5, never 1 / (1 + exp(-x)), which overflows:
    # Note [one formula on every backend] in backends/base.py
    np.multiply(x, 0.5, out=out)
    np.tanh(out, out=out)
    np.multiply(out, 0.5, out=out)
    np.add(out, 0.5, out=out)


def _neg(x: np.ndarray, out: np.ndarray) -> None:
    # NOTE: NumPy 2.4.6's SIMD np.negative, in place on a 16-byte float32 (64-byte float64) stride,
    # writes wrong values on AVX-512 machines (a[::4] negated in place gets a[1] in a[4]).
    # Multiplying by -1 gives the same bits (-0.0 included) and is right at every stride.
    np.multiply(x, -1, out=out)


def _relu(x: np.ndarray, out: np.ndarray) -> None:
    kind = _FLOAT_OP.get(out.dtype)
    if kind is not None and x.dtype == out.dtype and _halfconv.float_op(0, kind, out, x):
        return
    # NOTE: not np.maximum(x, 0), which makes -0.0 +0.0 in some loops: Note [relu's zero] in
    # backends/base.py. The mask is made before out (which may be x) is written.
    negative = np.less(x, 0)
    np.copyto(out, x)
    np.copyto(out, 0, where=negative)


def _relu_backward(grad: np.ndarray, y: np.ndarray, out: np.ndarray) -> None:
    kind = _FLOAT_OP.get(out.dtype)
    if (kind is not None and type(grad) is np.ndarray and type(y) is np.ndarray
            and grad.dtype == y.dtype == out.dtype and _halfconv.float_op(1, kind, out, grad, y)):
        return
    np.multiply(grad, np.greater(y, 0), out=out)


def _add(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    # NOTE: NumPy broadcasts a bias row through its iterator, 2.3x the C loop's time
    kind = _FLOAT_OP.get(out.dtype)
    if (kind is not None and type(a) is np.ndarray and type(b) is np.ndarray
            and a.dtype == b.dtype == out.dtype and _halfconv.float_op(2, kind, out, a, b)):
        return
    np.add(a, b, out=out)


def _where_finite(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    finite = np.isfinite(a)
    if np.may_share_memory(out, a):  # NOTE: then out is a itself (ops allow no other overlap)
        np.copyto(out, b, where=~finite)
        return
    np.copyto(out, b)
    np.copyto(out, a, where=finite)


def _tanh_backward(grad: np.ndarray, y: np.ndarray, out: np.ndarray) -> None:
    # NOTE: out may be grad or y itself, so the factor is built in a temporary first.
    factor = np.multiply(y, y, out=np.empty(out.shape, out.dtype))
    np.subtract(1, factor, out=factor)
    np.multiply(grad, factor, out=out)


def _sigmoid_backward(grad: np.ndarray, y: np.ndarray, out: np.ndarray) -> None:
    factor = np.subtract(1, y, out=np.empty(out.shape, out.dtype))
    np.multiply(factor, y, out=factor)
    np.multiply(grad, factor, out=out)


_UNARY = {
    "neg": _neg,
    "exp": np.exp,
    "log": np.log,
    "tanh": np.tanh,
    "sigmoid": _sigmoid,
    "relu": _relu,
    "sqrt": np.sqrt,
    "copy": lambda x, out: np.copyto(out, x),
}
_BINARY = {"add": _add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
           "tanh_backward": _tanh_backward, "sigmoid_backward": _sigmoid_backward,
           "relu_backward": _relu_backward, "where_finite": _where_finite}
_REDUCE = {"sum": np.sum, "mean": np.mean}


def _reduce(name: str, x: np.ndarray, axis: tuple[int, ...] | None, keepdims: bool,
            out: np.ndarray) -> None:
    if x.dtype in _FLOATS and x.dtype == out.dtype:
        # NOTE: what np.sum and np.mean do for floats, without their Python wrappers (a third
        # of the time of a small reduction): the same ufunc calls, the same bits; and over no
        # element 0 / 0, NaN, where np.mean would warn "Mean of empty slice" (Note [IEEE
        # results, no floating-point signals] in backends/base.py)
        if not _rows_summed(x, axis, out):
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
            and _halfconv.float_op(3, _FLOAT_OP[x.dtype], out, x))


def _sum(x: np.ndarray, out: np.ndarray, axes: tuple[int, ...] | None, keepdims: bool) -> None:
    """The fast path's sum: `_reduce("sum", ...)`, with the float case's ufunc called first
    (positional arguments: a fifth of the call's time goes to keywords)."""
    if x.dtype is out.dtype and x.size and x.dtype in _FLOATS:
        if not _rows_summed(x, axes, out):
            np.add.reduce(x, axes, None, out, keepdims)
    else:
        _reduce("sum", x, axes, keepdims, out)


@functools.lru_cache(maxsize=64)
def _rows(count: int) -> np.ndarray:
    """np.arange(count), made once per count (read-only: it is shared)."""
    rows = np.arange(count)
    rows.flags.writeable = False
    return rows


def _convert(x: np.ndarray, out: np.ndarray) -> None:
    """out = x converted to out's dtype: float16 and bfloat16 to and from float32 in C
    (`backends/_halfconv.c`, any layout), anything else by NumPy."""
    if _halfconv is not None and x.shape == out.shape:
        if out.dtype == _F32 and x.dtype in _WIDEN:
            if x.flags.c_contiguous and out.flags.c_contiguous:
                return _WIDEN[x.dtype](x, out)  # NOTE: NumPy converts one item at a time
            if _halfconv.apply(0, x.dtype == _BF16, out, x):
                return
        elif x.dtype == _F32 and out.dtype in _NARROW:
            if x.flags.c_contiguous and out.flags.c_contiguous:
                return _NARROW[out.dtype](x, out)
            if _halfconv.apply(0, out.dtype == _BF16, out, x):
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
    kernels = NumpyDevice._fast_half_kernels if out.dtype in HALVES else _BINARY
    product = np.empty(b.shape, out.dtype)
    kernels["mul"](b, scale, product)
    kernels["sub"](a, product, out)


def _half_kernel(name: str):
    """The fast path's kernel `name` for float16 and bfloat16 (Note [the eager fast path] in
    runtime/fastpath.py), called as kernel(*inputs, out) with inputs NumPy would broadcast:
    one C pass where `_halfconv.apply` takes it, else NumPy's float32 kernel on widened copies
    (Note [two-byte floats compute in float32] in backends/base.py)."""
    code = _APPLY.get(name)
    float32 = _UNARY.get(name) or _BINARY[name]

    def kernel(*args):
        out = args[-1]
        if code is None or not _halfconv.apply(code, out.dtype == _BF16, out, *args[:-1]):
            _compute_in_float32(float32, args[:-1], (out,))
    return kernel


class NumpyDevice(Device):
    """Host memory and NumPy kernels. There is one CPU device: index 0."""

    alignment = 64
    #: non-writeable ndarrays
    read_only_memory = True
    host_memory = True
    #: every elementwise kernel, called as kernel(*inputs, out) (NumPy broadcasts the inputs),
    #: and the reductions, as kernel(x, out, axes, keepdims)
    _fast_kernels = {**_UNARY, **_BINARY, "sum": _sum,
                     "mean": lambda x, out, axes, keepdims: _reduce("mean", x, axes, keepdims,
                                                                   out),
                     "sub_scaled": _sub_scaled_kernel}

    #: the same for float16 and bfloat16 (copy, which moves bits, is `_fast_kernels`' own)
    _fast_half_kernels = {**{name: _half_kernel(name) for name in (*_UNARY, *_BINARY)
                             if name != "copy"}, "sub_scaled": _sub_scaled_kernel}

    def __init__(self, index: int = 0) -> None:
        self.name = "cpu"

    @classmethod
    def device_count(cls) -> int:
        return 1

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
        _UNARY[name](x, out=out)

    def _binary(self, name, a, b, out) -> None:
        _BINARY[name](a, b, out=out)

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
        blas = _blas.find()
        # NOTE: 2-D products go where gemm goes, unless that is NumPy's own BLAS (`products`
        # False): Note [one thread pool per process] in backends/_blas_choice.py
        if out.ndim != 2 or blas is None or not blas.products or not blas(a, b, out, 1.0, 0.0):
            np.matmul(a, b, out=out)

    def _plan_products(self, products) -> None:
        _blas.expect(products)  # while the CBLAS is being chosen, these are what it times

    @property
    def gemm_accumulates(self) -> bool:  # type: ignore[override]
        return _blas.find() is not None

    def _gemm(self, a, b, out, alpha, beta) -> None:
        blas = _blas.find()
        if blas is None or not blas(a, b, out, alpha, beta):  # False: layouts it can't read
            super()._gemm(a, b, out, alpha, beta)

    def _reduce(self, name, x, axis, keepdims, out) -> None:
        _reduce(name, x, axis, keepdims, out)

    def _cross_entropy(self, logits, labels, losses, probs) -> None:
        classes = logits.shape[1]
        # NOTE: Note [checked before written] in backends/base.py: the labels are checked before
        # the first write. As unsigned, a negative label is huge: one reduction checks both ends.
        if labels.size:
            unsigned = labels.view(f"u{labels.itemsize}") if labels.dtype.kind == "i" else labels
            if np.maximum.reduce(unsigned) >= classes:
                bad = labels[(labels < 0) | (labels >= classes)][0]
                raise ValueError(f"cross_entropy: label {bad} is outside [0, {classes}) for "
                                 f"{classes} classes")
        rows = _rows(logits.shape[0])
        np.maximum.reduce(logits, axis=1, keepdims=True, out=probs[:, :1])  # row maxima, parked
        top = probs[:, 0].copy()
        np.subtract(logits, top[:, None], out=probs)
        picked = probs[rows, labels]  # logit of the label minus the row maximum
        np.exp(probs, out=probs)
        total = np.add.reduce(probs, axis=1)
        np.divide(probs, total[:, None], out=probs)
        np.log(total, out=total)
        np.subtract(total, picked, out=losses)

    def _cross_entropy_backward(self, probs, labels, grad, out) -> None:
        np.copyto(out, probs)
        out[_rows(out.shape[0]), labels] -= 1
        np.multiply(out, grad[:, None], out=out)

    def _to_host(self, view: np.ndarray) -> np.ndarray:
        return np.array(view, copy=True)
