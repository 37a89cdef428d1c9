"""The `Device` interface every backend implements, and what backends share.

A device hands out raw memory, copies bytes between host and device, makes native array views
(numpy.ndarray, pyopencl.array.Array, cupy.ndarray) at a byte offset into raw memory, and runs
kernels on such views. It knows nothing of allocators, blocks or tensors.

Raw memory comes in two kinds: ordinary, and read-only (`raw_alloc(nbytes, read_only=True)`),
which kernels may only read while the host still fills it (`copyin`) and reads it back
(`copyout`); constants live there. A device that has no such memory (CUDA) hands out ordinary
memory instead and says so (`Capabilities.read_only_memory` False).

Public methods hold the policy (argument checks, error wording); a backend implements the
underscore hooks: those of `Device.REQUIRED_HOOKS` always, those of `Device.CAPABILITY_HOOKS`
for each capability it claims in its `Capabilities` record. A hook that a backend lacks raises
`NotImplementedError` naming it.

Note [checked before written]: a kernel that refuses its operands (cross_entropy's labels
outside [0, classes)) raises before it writes any output, so an op that raises leaves `out=`
bit for bit as it was, and its version where it was (tests/test_atomic_out.py). A backend
checks on the host before its first write (NumPy), or on the device ahead of the kernel that
writes (OpenCL: a check kernel whose flag the loss kernel reads; CUDA: a reduction read back
before the first write). Computing into a scratch output and copying it on success would do
too, at the price of a second pass over the output.

Note [IEEE results, no floating-point signals]: kernels on every backend give IEEE results for
division by zero, overflow and invalid operations (inf, nan) and never raise or warn for them,
as OpenCL, CUDA and PyTorch do. NumPy would signal under `np.errstate(...="raise")` (or with its
RuntimeWarning turned into an error) only after its ufunc has written `out`, breaking Note
[checked before written]; so the runtime runs kernels through `ieee()`, which switches NumPy's
error handling off for the call (the op dispatch point, `ops._launch`, and each graph replay).

Note [one formula on every backend]: an elementwise kernel computes the formula of the NumPy
device (`backends/numpy.py`), written the same way on every backend, so that the backends agree
on overflow and NaN, and up to their own exp and tanh, on rounding: sigmoid is
0.5 * tanh(0.5 * x) + 0.5, which never overflows where 1 / (1 + exp(-x)) does; relu is
x < 0 ? +0 : x (Note [relu's zero]); relu_backward is g * (y > 0), so a NaN gradient stays NaN
where y <= 0 too; tanh_backward and sigmoid_backward are g * (1 - y * y) and g * ((1 - y) * y)
of the op's output y. Each formula is written once, in backends/optable.py (Note [one
declaration per op]), and every backend renders it; tests/test_bits.py holds every backend to
the CPU's bits.

Note [relu's zero]: relu(x) is +0 where x < 0 and x itself elsewhere, so -0.0 stays -0.0 and a
NaN passes as it is: PyTorch's CPU relu, the reference users compare against (torch 2.13 gives
-0.0 for relu(-0.0) in every float dtype). np.maximum(x, 0) is no reference for the zero's sign:
NumPy 2.4 gives +0.0 for -0.0 in its float32 / float64 SIMD loops and -0.0 in its float16 one.
Every backend writes relu as that compare and select, never as a maximum.

Note [two-byte floats compute in float32]: a kernel whose output is float16 or bfloat16
(HALVES) gives, bit for bit, what its float32 kernel gives on the exactly widened operands,
rounded once (to nearest even) to the output's dtype; a number meets it as float32. The
reference way is `Device._in_float32` (widened scratch copies, the float32 kernel, one
narrowing); a backend may take an elementwise kernel itself in `_half_elementwise` where it
gets the same bits (the CPU's `backends/_halfconv.c` `apply`: one pass over the half operands
in float32 chunks, one IEEE single operation per step of the formula, so no product and sum
are contracted into one rounding). A fused chain is a chain of such kernels: each link's
result is rounded to its dtype, as the ops it replaces were, never the chain once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from backends import optable

#: Elementwise kernels of one input, two and three, each an op of backends/optable.py (its
#: formula, operand kinds and derivative there: Note [one declaration per op]). "copy" writes
#: its input (possibly broadcast) into out, of any dtype; the "*_backward" ones are autograd's
#: derivative kernels, (gradient, the op's output or input) -> gradient; "where" takes a bool
#: condition first.
UNARY_KERNELS = optable.kernels(1)
#: Binary kernels' inputs are broadcast by the runtime to the output's shape.
BINARY_KERNELS = optable.kernels(2)
TERNARY_KERNELS = optable.kernels(3)
#: Reductions over an axis (or all axes). "max" is `_reduce_max`'s (a default made of the
#: required hooks, `Device.DEFAULT_HOOKS`); "sum" and "mean" are `_reduce`'s.
REDUCE_KERNELS = ("sum", "mean", "max")
#: The default `Device.fused` runs a chain in blocks of about this many bytes per operand (L2).
FUSED_BLOCK_BYTES = 64 << 10
#: ... and a row larger than that (an NCHW activation's) in pieces of at most this many bytes
#: (`_fused_blocks`). A BN-affine-ReLU chain on 4 x 64 x 112 x 112 float32 took 3.3 ms in
#: 64 KiB pieces (the calls), 2.0 in 256 KiB ones, 1.5 in 1 MiB ones and 2.0 as one block of
#: 12.5 MiB (AMD EPYC family 25 model 17, 1 MiB of L2 a core; 2026-11-28): 256 KiB is as fast
#: as the whole rows it replaces, with a quarter of 1 MiB's scratch per link.
FUSED_PIECE_BYTES = 256 << 10
#: The default `Device.moments` and `channel_dots` make their products and squares a few
#: samples at a time, in scratch of at most this many items (one sample at least).
STATS_CHUNK = 1 << 20
#: The two-byte floats: every kernel computes them in float32 and rounds each result to the
#: output's dtype once (Note [two-byte floats compute in float32]), as PyTorch's CPU kernels do
#: for half and bfloat16 (their "opmath" type) and NumPy's float16 loops do op by op.
HALVES = (np.dtype("float16"), np.dtype(ml_dtypes.bfloat16))
_FLOAT32 = np.dtype("float32")
#: The dtypes the arithmetic kernels take (every kernel but "copy" and `cast`, which move and
#: convert any dtype): a backend computes a subset (`Capabilities.compute_dtypes`), checked
#: before any kernel is built (`Device._check_computes`).
COMPUTE_DTYPES = (*HALVES, _FLOAT32, np.dtype("float64"))


def _half(x: Any) -> bool:
    return getattr(x, "dtype", None) in HALVES


class BackendUnavailableError(RuntimeError):
    """A backend was asked for but cannot run here (its package or its hardware is missing)."""


class RecordError(RuntimeError):
    """`Device.record` could not make the work one replayable device graph; the message says
    why (the device records none, or the work synchronised with the host, called a library
    that cannot be recorded, ...). Nothing the work queued has run: run it again, launch by
    launch."""


@dataclasses.dataclass(frozen=True)
class HostCheck:
    """A check of an op's operand that reads it on the host, moved out of a device graph
    (`Device.record`): `check(array)` raises, naming the bad value, where the values are
    refused. `view` is the device memory it reads at every launch, `layout` that memory as a
    layout of runtime/aliasing.py (device address, shape, byte strides, itemsize); an array
    of the same values (the host array copied there) may be checked in its place."""

    layout: tuple[int, tuple[int, ...], tuple[int, ...], int]
    view: Any
    check: Callable[[Any], None]


def check_nbytes(nbytes: Any, what: str = "size") -> int:
    """Return `nbytes` as an int, or raise TypeError/ValueError naming the bad value.

    Booleans and floats are refused even when integral: a size is a count of bytes.
    """
    if type(nbytes) is int and nbytes >= 0:
        return nbytes  # the hot path: a plain non-negative int
    if isinstance(nbytes, (bool, np.bool_)) or not isinstance(nbytes, (int, np.integer)):
        raise TypeError(f"{what} must be an integer number of bytes, got {nbytes!r} "
                        f"of type {type(nbytes).__name__}")
    nbytes = int(nbytes)
    if nbytes < 0:
        raise ValueError(f"{what} must be >= 0 bytes, got {nbytes}")
    return nbytes


try:  # NOTE: NumPy's own per-context error state: setting it is about 0.3 us, np.errstate 1.7
    from numpy._core import umath as _umath

    _FP_STATE: Any = _umath._extobj_contextvar
    _FP_IGNORE = _umath._make_extobj(all="ignore")
except (ImportError, AttributeError, TypeError):  # another NumPy: the public (slower) way
    _FP_STATE = None


def ieee(fn: Callable[..., Any], *args: Any) -> Any:
    """Call `fn(*args)` with NumPy's floating-point error handling off, whatever the caller's
    `np.errstate` says (Note [IEEE results, no floating-point signals])."""
    if _FP_STATE is None:
        with np.errstate(all="ignore"):
            return fn(*args)
    token = _FP_STATE.set(_FP_IGNORE)
    try:
        return fn(*args)
    finally:
        _FP_STATE.reset(token)


def contiguous_strides(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    """The byte strides of a C-order array of `shape` with items of `itemsize` bytes."""
    strides = []
    step = itemsize
    for n in reversed(tuple(shape)):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


@functools.lru_cache(maxsize=64)
def _rows(count: int) -> np.ndarray:
    """np.arange(count), made once per count (read-only: it is shared)."""
    rows = np.arange(count)
    rows.flags.writeable = False
    return rows


def numpy_cross_entropy(logits: np.ndarray, labels: np.ndarray, losses: np.ndarray,
                        probs: np.ndarray) -> None:
    """`Device.cross_entropy` on NumPy arrays, as the CPU device computes it (the labels
    checked before the first write: Note [checked before written]); the default of
    `Device._cross_entropy`, on the host."""
    classes = logits.shape[1]
    # NOTE: as unsigned, a negative label is huge: one reduction checks both ends
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


def numpy_cross_entropy_backward(probs: np.ndarray, labels: np.ndarray, grad: np.ndarray,
                                 out: np.ndarray) -> None:
    """`Device.cross_entropy_backward` on NumPy arrays, as the CPU device computes it."""
    np.copyto(out, probs)
    out[_rows(out.shape[0]), labels] -= 1
    np.multiply(out, grad[:, None], out=out)


def numpy_max_pool2d(x: np.ndarray, kernel: tuple[int, int], stride: tuple[int, int],
                     padding: tuple[int, int], out: np.ndarray,
                     indices: np.ndarray | None) -> None:
    """`Device.max_pool2d` on NumPy arrays, PyTorch's CPU scan: each window's elements of x in
    row-major order, the padding skipped, a running maximum that starts at -inf and an
    element taken where it is greater or NaN (so the first maximum, or the last NaN), its
    index starting at the window's first element of x (where every element is -inf). One
    vectorised step per window offset; the default of `Device._max_pool2d`, on the host."""
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    n, c, h, w = x.shape
    ho, wo = out.shape[2:]
    xp = np.full((n, c, h + 2 * ph, w + 2 * pw), -np.inf, x.dtype)  # NOTE: never taken
    xp[:, :, ph:ph + h, pw:pw + w] = x
    rows, cols = np.arange(ho) * sh - ph, np.arange(wo) * sw - pw
    best = np.full((n, c, ho, wo), -np.inf, x.dtype)
    where = np.empty((n, c, ho, wo), np.int64)
    where[...] = np.maximum(rows, 0)[:, None] * w + np.maximum(cols, 0)
    for i in range(kh):
        for j in range(kw):
            v = xp[:, :, i:i + sh * (ho - 1) + 1:sh, j:j + sw * (wo - 1) + 1:sw]
            with np.errstate(invalid="ignore"):  # NOTE: a NaN compared is no signal here
                take = (v > best) | np.isnan(v)
            np.copyto(best, v, where=take)
            np.copyto(where, (rows + i)[:, None] * w + (cols + j), where=take)
    out[...] = best
    if indices is not None:
        indices[...] = where


def numpy_max_pool2d_backward(grad: np.ndarray, indices: np.ndarray, out: np.ndarray) -> None:
    """`Device.max_pool2d_backward` on NumPy arrays: zeros, then each output's gradient
    added at its index, plane by plane and in each plane in row-major order (`np.add.at`,
    one addition at a time, as PyTorch's CPU kernel adds them)."""
    n, c, h, w = out.shape
    planes = n * c
    flat = np.asarray(indices).reshape(planes, -1)
    if flat.size and (flat.min() < 0 or flat.max() >= h * w):
        raise ValueError(f"max_pool2d_backward: an index is outside [0, {h * w}) for a "
                         f"{h}x{w} plane")
    total = np.zeros((planes, h * w), out.dtype)
    np.add.at(total, (_rows(planes)[:, None], flat),
              np.asarray(grad, out.dtype).reshape(planes, -1))
    out[...] = total.reshape(out.shape)


def _conv_output(x_shape: Sequence[int], kernel: tuple[int, int], stride: tuple[int, int],
                 padding: tuple[int, int]) -> tuple[int, int]:
    """(Ho, Wo) of a convolution or a pool of an (N, C, H, W) x."""
    (h, w), (kh, kw), (sh, sw), (ph, pw) = x_shape[2:], kernel, stride, padding
    return (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1


def _column_windows(columns: np.ndarray, x_shape: Sequence[int], kernel: tuple[int, int],
                    stride: tuple[int, int], padding: tuple[int, int]
                    ) -> Iterator[tuple[np.ndarray, tuple]]:
    """Per window element (i, j), in that order: the (N, C, rows, cols) view of the columns
    (C*kh*kw, N*Ho*Wo) whose input lies inside x, and the index of x they read (the padding
    is nobody's)."""
    n, c = x_shape[:2]
    (kh, kw), out = kernel, _conv_output(x_shape, kernel, stride, padding)
    parts = columns.reshape(c, kh, kw, n, *out)
    for i in range(kh):
        for j in range(kw):
            spans = []
            for k, s, p, n_out, size in zip((i, j), stride, padding, out, x_shape[2:]):
                lo = min(max(0, -(-(p - k) // s)), n_out)
                hi = max(lo, min(n_out, (size - 1 + p - k) // s + 1))
                spans.append((slice(lo, hi), slice(lo * s + k - p, (hi - 1) * s + k - p + 1, s)
                              if hi > lo else slice(0, 0)))
            (rows, in_rows), (cols, in_cols) = spans
            yield (parts[:, i, j, :, rows, cols].transpose(1, 0, 2, 3),
                   (slice(None), slice(None), in_rows, in_cols))


def numpy_im2col(x: np.ndarray, kernel: tuple[int, int], stride: tuple[int, int],
                 padding: tuple[int, int], columns: np.ndarray) -> None:
    """`Device.im2col` on NumPy arrays: zeros, then one strided copy per window element."""
    columns[...] = 0
    for part, index in _column_windows(columns, x.shape, kernel, stride, padding):
        part[...] = x[index]


def numpy_col2im(columns: np.ndarray, kernel: tuple[int, int], stride: tuple[int, int],
                 padding: tuple[int, int], out: np.ndarray) -> None:
    """`Device.col2im` on NumPy arrays: zeros, then one strided add per window element in the
    order of (i, j)."""
    out[...] = 0
    for part, index in _column_windows(columns, out.shape, kernel, stride, padding):
        target = out[index]
        target += part


def _missing(device: Device, hook: str) -> NotImplementedError:
    name = type(device).__name__
    return NotImplementedError(f"{name} does not implement the Device hook {hook}()")


def _fused_blocks(shape: tuple[int, ...], itemsize: int
                  ) -> tuple[tuple[int, ...], list[tuple[Any, ...]]]:
    """How the blocked default cuts a fused chain's output of `shape`: the shape of one block
    (its scratch arrays' shape) and the index of each block in the output. Blocks are runs of
    rows of at most FUSED_BLOCK_BYTES where a row (shape[1:]) fits; where it does not (an NCHW
    activation: 4 x 64 x 112 x 112 has rows of 3.1 MiB), runs of at most FUSED_PIECE_BYTES
    along the first axis whose every slice fits, below single indices of the axes before it.
    Whole rows of 3.1 MiB made each chain's scratch arrays a row each, 32 MiB in all on
    ResNet-50's step, which every plan of it held on top of its intermediates."""
    if not shape:
        return (), [()]
    axis, inner = 0, int(np.prod(shape[1:], dtype=np.int64)) * itemsize
    target = FUSED_BLOCK_BYTES if inner <= FUSED_BLOCK_BYTES else FUSED_PIECE_BYTES
    while inner > target and axis < len(shape) - 1:
        axis += 1
        inner //= shape[axis]
    run = max(1, min(shape[axis], target // max(inner, 1)))
    outer = [()] if axis == 0 else list(np.ndindex(*shape[:axis]))
    blocks = [(*index, slice(start, min(start + run, shape[axis])))
              for index in outer for start in range(0, shape[axis], run)]
    return (run, *shape[axis + 1:]), blocks


def _blocked_scratch(program: Sequence[tuple[str, tuple, Any]], shape: Sequence[int],
                     dtype: Any) -> list[tuple[tuple[int, ...], np.dtype, int]]:
    """The scratch arrays the blocked default (`Device._blocked`) runs `program` with, for an
    output of `shape` and `dtype`: one key (shape, dtype, link) per link but the last."""
    block = _fused_blocks(tuple(shape), np.dtype(dtype).itemsize)[0]
    return [(block, np.dtype(link), i) for i, (_, _, link) in enumerate(program[:-1])]


def _check_program(program: Sequence[tuple[str, tuple, Any]]) -> None:
    """Raise ValueError unless every link of a fused program names an elementwise kernel that
    a chain may run (`Op.fusible`), with its number of arguments, and reads only inputs,
    numbers and links before it."""
    for i, (name, args, _) in enumerate(program):
        op = optable.BY_NAME.get(name)
        if op is None or not op.fusible or op.arity != len(args):
            raise ValueError(f"fused: link {i} names no elementwise kernel: {name!r} with "
                             f"{len(args)} argument(s)")
        for kind, ref in args:
            if kind == "link" and not 0 <= ref < i:
                raise ValueError(f"fused: link {i} reads link {ref}, which is not before it")


class Deferred:
    """A capability a device learns only after it is made: its truth is `ask()`, asked at each
    read. The CPU's `gemm_accumulates` is one: whether a CBLAS runs its products, which
    backends/_blas.py chooses at the first product (BLOCKRT_BLAS), not when the device is made.

    Example:
        >>> bool(Deferred(lambda: False, "never"))
        False
    """

    __slots__ = ("ask", "what")

    def __init__(self, ask: Callable[[], bool], what: str) -> None:
        self.ask = ask
        #: what is asked, for the repr
        self.what = what

    def __bool__(self) -> bool:
        return bool(self.ask())

    def __repr__(self) -> str:
        return f"Deferred({self.what!r})"  # NOTE: not asked: a repr has no side effect


@dataclasses.dataclass(frozen=True, slots=True)
class Capabilities:
    """What a device does beyond the hooks every backend writes (`Device.REQUIRED_HOOKS`): one
    record per device, each field's default what the base `Device` does without it.

    A backend declares its record as a class attribute, `capabilities = Capabilities(...)`, or
    sets `self.capabilities` in `__init__` where it depends on the machine (an OpenCL device
    without cl_khr_fp64 computes no float64). A capability that needs hooks of its own names
    them in `Device.CAPABILITY_HOOKS`; the runtime reads the record, never the hooks, to learn
    what a device does, and `backends.testing` checks the record's claims on the device.

    Example:
        >>> import backends
        >>> backends.get_device("cpu").capabilities.host_memory
        True
        >>> Capabilities(read_only_memory=True).queues
        False
    """

    #: `raw_alloc(n, read_only=True)` gives memory that the device itself marks read-only to
    #: kernels (`_raw_alloc_read_only`, `_is_read_only`: an OpenCL `READ_ONLY` buffer, a
    #: non-writeable ndarray); False: ordinary memory, and only the runtime's ReadOnlyError
    #: checks keep kernels off constants (CUDA).
    read_only_memory: bool = False
    #: The device's memory is the host's own (NumPy): moving a tensor to host memory and back
    #: would free nothing, so a graph under a memory budget never does it.
    host_memory: bool = False
    #: The dtypes the arithmetic kernels compute (all but "copy" and `cast`, which move and
    #: convert any dtype), of COMPUTE_DTYPES and float32 among them; the others are refused
    #: with a TypeError before any kernel is built (an OpenCL device without cl_khr_fp64 has
    #: no float64). Kept float32 first.
    compute_dtypes: tuple[np.dtype, ...] = COMPUTE_DTYPES
    #: Every kernel hook (elementwise, products, reductions) loads float16 / bfloat16 views
    #: itself, computes in float32 and rounds once as it stores (Note [two-byte floats compute
    #: in float32]); False: the base hands the hooks float32 scratch copies (`_in_float32`).
    half_kernels: bool = False
    #: `_half_elementwise` runs elementwise kernels on two-byte views itself, where it can, with
    #: `_in_float32`'s bits; the base widens the others.
    half_elementwise: bool = False
    #: `_compile_fused` makes a fused chain one kernel of the device's own; False: the base
    #: runs a chain's links block by block (`Device.fused`).
    compiles_fused: bool = False
    #: a graph runs each lone elementwise step as a one-link chain of `_compile_fused` (the
    #: CPU's chains split over its pool of threads, where its single kernels are NumPy's
    #: loops on one thread); False: as the op's own kernel. Needs `compiles_fused`.
    chains_lone_steps: bool = False
    #: `gemm(a, b, out, alpha, beta)` accumulates into out in the product itself (BLAS's beta,
    #: `_gemm`), so a graph folds an update such as w -= lr * (a @ b) into the product and
    #: saves a pass; False: a graph never asks for it (the base's `_gemm` is a product into
    #: scratch and a fused pass). Read it as a truth value: it may be `Deferred`.
    gemm_accumulates: bool | Deferred = False
    #: `_plan_products` hears which 2-D products a captured graph runs at every step
    #: (`Device.plan_products`: the CPU measures which CBLAS runs them faster).
    measures_products: bool = False
    #: `_im2col` and `_col2im` make a convolution's columns from x, and x's gradient from the
    #: columns' gradient, each in one kernel (`Device.im2col`, `Device.col2im`); False: the
    #: runtime makes them of copies and adds of padded views.
    conv_columns: bool = False
    #: The device runs its copies and kernels in order on a queue (stream) and has events on
    #: queues (the queue hooks, Note [queue-ordered reuse]); False: every command is done when
    #: its call returns, `home_queue` is None and a queue asked of the device is a TypeError.
    queues: bool = False
    #: `_record` records the kernels and copies a function queues as one device graph that
    #: replays them with one launch (a CUDA graph: Note [a static plan as one device graph] in
    #: runtime/graph/replay.py); False: `record` raises RecordError.
    records_graphs: bool = False
    #: Kernels by name for the runtime's eager fast path (Note [the eager fast path] in
    #: runtime/fastpath.py): each elementwise one called as kernel(*input_views, out_view) with
    #: inputs it broadcasts itself, "sum" and "mean" as kernel(x, out, axes, keepdims),
    #: "sub_scaled" as kernel(a, b, scale, out); None: ops go through `unary`, `binary`,
    #: `ternary` and `reduce` only.
    fast_kernels: Mapping[str, Callable[..., Any]] | None = dataclasses.field(default=None,
                                                                               repr=False)
    #: The same for float16 and bfloat16 (copy, which moves bits, is `fast_kernels`' own), each
    #: computing in float32 and rounding once.
    fast_half_kernels: Mapping[str, Callable[..., Any]] | None = dataclasses.field(
        default=None, repr=False)

    def __post_init__(self) -> None:
        dtypes = tuple(np.dtype(d) for d in self.compute_dtypes)
        unknown = [str(d) for d in dtypes if d not in COMPUTE_DTYPES]
        if unknown or _FLOAT32 not in dtypes:
            raise ValueError(f"Capabilities: compute_dtypes are float32 and any of "
                             f"{', '.join(str(d) for d in COMPUTE_DTYPES if d != _FLOAT32)}, "
                             f"not {', '.join(map(str, dtypes)) or 'none'} (the two-byte "
                             f"floats compute in float32)")
        # NOTE: a tuple, float32 first: `in` settles the common dtype by identity (a set hashes)
        object.__setattr__(self, "compute_dtypes",
                           tuple(sorted(dict.fromkeys(dtypes), key=lambda d: d != _FLOAT32)))


class Device:
    """One compute device: raw memory, host<->device copies, native views and kernels.

    A backend is a subclass that sets `name` (and `alignment`, where raw memory starts on
    another boundary than 64 bytes), writes the hooks of `REQUIRED_HOOKS` and declares what
    else it does in `capabilities` (a `Capabilities` record), with the hooks each claimed
    capability needs (`CAPABILITY_HOOKS`). The public methods hold the policy (checks, error
    wording, the two-byte floats' widening); every other hook has a default made of the
    required ones (`DEFAULT_HOOKS`), which a backend may replace with a faster one.
    docs/backends.md writes one, and `backends.testing` checks one.

    Attributes:
        name: the canonical spec, e.g. "cpu", "opencl:0", "cuda:1".
        alignment: every raw allocation starts at a multiple of this many bytes.
        capabilities: what the device does beyond the required hooks (`Capabilities`).

    Example:
        >>> import backends
        >>> dev = backends.get_device("cpu")
        >>> raw = dev.raw_alloc(64)
        >>> dev.address(raw) % dev.alignment
        0
        >>> dev.raw_free(raw)
    """

    #: The hooks every backend writes: raw memory, copies, views, the elementwise kernels of
    #: backends/optable.py (one, two and three operands), products, reductions and casts. A
    #: missing one raises NotImplementedError naming it when it is first called.
    REQUIRED_HOOKS = ("_raw_alloc", "_raw_free", "_copyin", "_copyout", "_array_view",
                      "_address", "_nbytes_of", "_unary", "_binary", "_ternary", "_matmul",
                      "_reduce", "_cast")
    #: The hooks of each capability of `Capabilities` that needs hooks of its own: a device that
    #: claims the capability writes them. The base calls the hooks of half_elementwise,
    #: compiles_fused, measures_products and queues only where they are claimed (their
    #: defaults raise NotImplementedError); the read-only ones default to ordinary memory, and
    #: `_gemm` to a product into scratch and a fused pass.
    CAPABILITY_HOOKS: dict[str, tuple[str, ...]] = {
        "read_only_memory": ("_raw_alloc_read_only", "_is_read_only"),
        "half_elementwise": ("_half_elementwise",),
        "compiles_fused": ("_compile_fused",),
        "gemm_accumulates": ("_gemm",),
        "measures_products": ("_plan_products",),
        "conv_columns": ("_im2col", "_col2im"),
        "queues": ("_home_queue", "_queue_key", "_record_event", "_event_done", "_wait_event",
                   "_join", "_synchronize"),
        "records_graphs": ("_record",),
    }
    #: The hooks whose default is made of the required ones, and what the default does: a
    #: backend may write a faster one with the same results.
    DEFAULT_HOOKS: dict[str, str] = {
        "_to_host": "the copy kernel into contiguous raw memory of its own, then `_copyout`",
        "_cross_entropy": "on the host, by the CPU's formula (`host_cross_entropy`)",
        "_cross_entropy_backward": "on the host, by the CPU's formula",
        "_sub_scaled": "the mul and sub kernels (one fused chain where `compiles_fused`)",
        "_gemm": "the product into scratch, then one fused pass for alpha and beta",
        "_prepared_gemm": "a function that calls `_gemm` on the views (`prepare_gemm`)",
        "_prepared_matmul": "a function that calls `_matmul` on the views (`prepare_matmul`)",
        "_widened": "a cast into float32 scratch",
        "_scratch": "a view of new raw memory (`raw_alloc`)",
        "_gather": "the copy kernel, one row at a time",
        "_scatter_add": "the add kernel in place, one row at a time, in index order",
        "_from_host": "staged in raw memory of its own by `copyin`, moved by the copy kernel",
        "_reduce_max": "on the host: `to_host`, NumPy's maximum reduction, `_from_host`",
        "_moments": "the reduce and elementwise kernels, channel by channel, a few samples at a "
                    "time in scratch",
        "_channel_dots": "the reduce and mul kernels, a few samples at a time in scratch",
        "_max_pool2d": "on the host, by the CPU's formula (`numpy_max_pool2d`)",
        "_max_pool2d_backward": "on the host, by the CPU's formula "
                                "(`numpy_max_pool2d_backward`)",
    }

    name: str = "device"
    alignment: int = 64
    capabilities: Capabilities = Capabilities()

    def __init__(self, index: int = 0) -> None:
        """Device number `index` of the backend (`backends.get_device` passes it): a backend
        with one device needs no constructor of its own."""

    @classmethod
    def device_count(cls) -> int:
        """How many devices of this backend the machine has (`backends.get_device` refuses an
        index past them); the default is one."""
        return 1

    # ----------------------------------------------------------------- memory (public policy)
    def raw_alloc(self, nbytes: int, read_only: bool = False) -> Any:
        """Return `nbytes` of raw device memory aligned to `self.alignment`.

        With `read_only=True` the memory is for constants: kernels may only read it (an OpenCL
        `CL_MEM_READ_ONLY` buffer, a non-writeable ndarray); `copyin` and `copyout` work as on
        any memory. Where the device has no read-only memory (`read_only_memory` False) it is
        ordinary memory, and only the runtime's `ReadOnlyError` checks keep kernels off it.

        Raises MemoryError (from the backend) when the device cannot provide it.
        """
        nbytes = check_nbytes(nbytes)
        return self._raw_alloc_read_only(nbytes) if read_only else self._raw_alloc(nbytes)

    def raw_free(self, raw: Any) -> None:
        """Give raw memory from `raw_alloc` back to the device."""
        self._raw_free(raw)

    def copyin(self, raw: Any, offset: int, host: np.ndarray) -> None:
        """Copy the bytes of the host array `host` into `raw` starting at byte `offset`."""
        host = np.ascontiguousarray(host)
        self._check_range(raw, offset, host.nbytes)
        self._copyin(raw, offset, host.reshape(-1).view(np.uint8))

    def copyout(self, raw: Any, offset: int, nbytes: int) -> np.ndarray:
        """Return a new host uint8 array with `nbytes` bytes of `raw` from byte `offset`."""
        self._check_range(raw, offset, nbytes)
        return self._copyout(raw, offset, nbytes)

    def array_view(self, raw: Any, offset: int, shape: Sequence[int], dtype: Any,
                   strides: Sequence[int]) -> Any:
        """A native array over `raw` at byte `offset` with byte `strides`; no copy is made."""
        return self._array_view(raw, offset, tuple(shape), np.dtype(dtype), tuple(strides))

    def scratch(self, shape: Sequence[int], dtype: Any) -> Any:
        """A new contiguous native array of `shape`, for a kernel's own temporaries (fused
        chains keep their inner results in block-sized ones). Not tracked by any allocator:
        keep them small."""
        return self._scratch(tuple(shape), np.dtype(dtype))

    def _scratch(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return self._array_view(self.raw_alloc(nbytes), 0, shape, dtype,
                                contiguous_strides(shape, dtype.itemsize))

    def is_read_only(self, raw: Any) -> bool:
        """True when the device marks `raw` read-only for kernels (see `raw_alloc`)."""
        return self._is_read_only(raw)

    def address(self, raw: Any) -> int:
        """The integer device address of `raw` (for tracing and overlap checks)."""
        return self._address(raw)

    def nbytes_of(self, raw: Any) -> int:
        """How many bytes `raw` holds."""
        return self._nbytes_of(raw)

    @property
    def total_memory(self) -> int | None:
        """Bytes of memory the device has, or None when unknown."""
        return None

    def _check_range(self, raw: Any, offset: int, nbytes: int) -> None:
        size = self.nbytes_of(raw)
        if offset < 0 or nbytes < 0 or offset + nbytes > size:
            raise ValueError(f"byte range [{offset}, {offset + nbytes}) is outside the raw "
                             f"allocation of {size} bytes on {self.name}")

    # ----------------------------------------------------------------- kernels (public policy)
    def _check_computes(self, kernel: str, inputs: Sequence[Any], out: Any) -> None:
        """Raise TypeError, before any kernel is built or run, where `out` or an array among
        `inputs` has a dtype this device's kernels do not compute (`compute_dtypes`); numbers
        pass (they meet the kernel in out's compute dtype). One rule and one message on every
        backend."""
        dtype = out.dtype
        computed = self.capabilities.compute_dtypes
        if dtype not in computed:
            self._refuse_dtype(kernel, dtype)
        for x in inputs:  # NOTE: most inputs have out's dtype object: `is` settles them
            other = getattr(x, "dtype", dtype)
            if other is not dtype and other not in computed and not isinstance(
                    x, np.generic):
                self._refuse_dtype(kernel, other)

    def _refuse_dtype(self, kernel: str, dtype: np.dtype) -> None:
        names = ", ".join(str(d) for d in COMPUTE_DTYPES
                          if d in self.capabilities.compute_dtypes)
        why = (f" ({self.name} lacks {dtype} arithmetic: an OpenCL device without cl_khr_fp64, "
               f"say)" if dtype in COMPUTE_DTYPES else "")
        raise TypeError(f"{self.name}: the {kernel} kernel computes on {names}, not {dtype}"
                        f"{why}; cast first (runtime.ops.cast), or move the bits with the copy "
                        f"kernel")

    def unary(self, name: str, x: Any, out: Any) -> None:
        """out = f(x) elementwise, f one of UNARY_KERNELS; x may be identical to out. Every
        kernel but "copy" (any dtype) takes the dtypes of `compute_dtypes` only (TypeError)."""
        if name not in UNARY_KERNELS:
            raise ValueError(f"unknown unary kernel {name!r}; known: {', '.join(UNARY_KERNELS)}")
        if name != "copy":
            self._check_computes(name, (x,), out)
            # NOTE: ops give x out's dtype
            if out.dtype in HALVES and self._widening(name, (x,), out, self._unary):
                return
        self._unary(name, x, out)

    def binary(self, name: str, a: Any, b: Any, out: Any) -> None:
        """out = a (op) b elementwise; a and b already have out's shape (zero strides broadcast)."""
        if name not in BINARY_KERNELS:
            raise ValueError(f"unknown binary kernel {name!r}; known: {', '.join(BINARY_KERNELS)}")
        self._check_computes(name, (a, b), out)
        # NOTE: ops give a and b out's dtype
        if out.dtype in HALVES and self._widening(name, (a, b), out, self._binary):
            return
        self._binary(name, a, b, out)

    def ternary(self, name: str, a: Any, b: Any, c: Any, out: Any) -> None:
        """out = op(a, b, c) elementwise, op one of TERNARY_KERNELS; the operands already have
        out's shape (zero strides broadcast). A BOOL operand of the op (where's condition) is
        a bool view; the others take the dtypes of `compute_dtypes` (TypeError)."""
        if name not in TERNARY_KERNELS:
            raise ValueError(f"unknown ternary kernel {name!r}; known: "
                             f"{', '.join(TERNARY_KERNELS)}")
        operands = (a, b, c)
        kinds = optable.BY_NAME[name].operand_kinds
        for x, kind in zip(operands, kinds):
            if kind == optable.BOOL and getattr(x, "dtype", None) != np.bool_:
                raise TypeError(f"{self.name}: the {name} kernel takes a bool condition, not "
                                f"{getattr(x, 'dtype', type(x).__name__)}")
        floats = tuple(x for x, kind in zip(operands, kinds) if kind == optable.FLOAT)
        self._check_computes(name, floats, out)
        if out.dtype in HALVES and self._widening(name, operands, out, self._ternary):
            return
        self._ternary(name, a, b, c, out)

    def _widening(self, name: str, operands: Sequence[Any], out: Any,
                  hook: Callable[..., None]) -> bool:
        """Run the elementwise kernel `name` into the half view `out` where the hooks take no
        halves (`half_kernels` False), and return True: by `_half_elementwise` where claimed
        and it takes the call, else `hook` on float32 copies (`_in_float32`). False, nothing
        done, where `hook` takes halves itself."""
        capabilities = self.capabilities
        if capabilities.half_kernels:
            return False
        if not (capabilities.half_elementwise and self._half_elementwise(name, operands, out)):
            self._in_float32(functools.partial(hook, name), operands, (out,))
        return True

    def elementwise(self, name: str, operands: Sequence[Any], out: Any) -> None:
        """The elementwise kernel `name` of any arity: `unary`, `binary` or `ternary`."""
        call = (self.unary, self.binary, self.ternary)[len(operands) - 1]
        call(name, *operands, out)

    def sub_scaled(self, a: Any, b: Any, scale: Any, out: Any, scratch: Any = None) -> None:
        """out = a - scale * b elementwise with the product rounded to out's dtype before the
        subtraction (never one fused multiply-add): bit for bit `binary("mul", b, scale, t)`
        then `binary("sub", a, t, out)`, in one pass where the backend can. It is plain SGD's
        update p -= lr * grad. a and b have out's shape and dtype; out may be a or b itself and
        overlaps them in no other way; `scale` is a number of out's compute dtype (float32 for
        a two-byte float). `scratch`: None, or a view of out's shape and dtype that overlaps
        nothing, where a backend that runs the two kernels puts the product (an optimizer
        passes its own, so its step allocates nothing: Note [the commit point] in
        runtime/nn.py)."""
        self._check_computes("sub_scaled", (a, b), out)
        self._sub_scaled(a, b, scale, out, scratch)

    def matmul(self, a: Any, b: Any, out: Any) -> None:
        """out = a @ b for 2-D (or batched N-D) views; out never overlaps a or b."""
        self._check_computes("matmul", (a, b), out)
        if out.dtype in HALVES and not self.capabilities.half_kernels:
            return self._in_float32(self._matmul, (a, b), (out,))
        self._matmul(a, b, out)

    def product_in_float32(self, a: Any, b: Any, out: Any) -> None:
        """out = a @ b for a and b of one two-byte float dtype (HALVES) and a float32 `out`:
        the product as a float32 `matmul` of the widened operands computes it, not rounded to
        the operands' dtype (a linear layer adds its bias before its one rounding). A backend
        whose library multiplies the halves themselves into float32 (cuBLAS's GemmEx)
        overrides `_product_in_float32`; its sums may then differ from the widened product's
        in the last place, as its two-byte `matmul` does."""
        self._product_in_float32(a, b, out)

    def _product_in_float32(self, a: Any, b: Any, out: Any) -> None:
        self._in_float32(self.matmul, (a, b), (out,))

    def cast(self, x: Any, out: Any) -> None:
        """out = x converted to out's dtype (same shape; never overlapping), under the rules of
        `runtime.ops.cast` (which refuses the other pairs before a device sees them)."""
        self._cast(x, out)

    def gemm(self, a: Any, b: Any, out: Any, alpha: float = 1.0, beta: float = 0.0) -> None:
        """out = alpha * (a @ b) + beta * out for 2-D views; out never overlaps a or b. With
        beta 0 the old contents of out are not read. Where `gemm_accumulates` is True this is
        one BLAS-style product that rounds once; otherwise a product into scratch and a fused
        elementwise pass (the same result up to rounding)."""
        self._check_computes("gemm", (a, b), out)
        if out.dtype in HALVES and not self.capabilities.half_kernels:
            return self._in_float32(lambda a, b, o: self._gemm(a, b, o, float(alpha),
                                                               float(beta)),
                                    (a, b), (out,), read=beta != 0)
        self._gemm(a, b, out, float(alpha), float(beta))

    def prepare_gemm(self, a: Any, b: Any, out: Any, alpha: float = 1.0,
                     beta: float = 0.0) -> Callable[[], None]:
        """`gemm(a, b, out, alpha, beta)` checked and set up once, as a function that runs
        it: for a caller that runs the same product on the same views many times (a graph's
        replay), as `prepare_fused` is for chains. The same result as `gemm`, bit for bit."""
        self._check_computes("gemm", (a, b), out)
        alpha, beta = float(alpha), float(beta)
        if out.dtype in HALVES and not self.capabilities.half_kernels:
            return lambda: self.gemm(a, b, out, alpha, beta)
        return self._prepared_gemm(a, b, out, alpha, beta)

    def prepare_matmul(self, a: Any, b: Any, out: Any) -> Callable[[], None]:
        """`matmul(a, b, out)` checked and set up once, as a function that runs it (as
        `prepare_gemm`); the same result as `matmul`, bit for bit."""
        self._check_computes("matmul", (a, b), out)
        if out.dtype in HALVES and not self.capabilities.half_kernels:
            return lambda: self.matmul(a, b, out)
        return self._prepared_matmul(a, b, out)

    def _prepared_gemm(self, a: Any, b: Any, out: Any, alpha: float,
                       beta: float) -> Callable[[], None]:
        return lambda: self._gemm(a, b, out, alpha, beta)

    def _prepared_matmul(self, a: Any, b: Any, out: Any) -> Callable[[], None]:
        return lambda: self._matmul(a, b, out)

    def plan_products(self, products: Sequence[tuple[Any, Any, Any, bool]]) -> None:
        """Hear which 2-D products a captured graph runs at every step, as (a, b, out,
        accumulates) layouts (anything with shape, strides in bytes and dtype), one entry per
        `matmul` or `gemm` call. A device that picks how to run its products by measuring
        them (the CPU's CBLAS, backends/_blas_choice.py) hears them (`measures_products`);
        the others ignore them."""
        if self.capabilities.measures_products:
            self._plan_products(list(products))

    def reduce(self, name: str, x: Any, axis: tuple[int, ...] | None, keepdims: bool,
               out: Any) -> None:
        """out = sum, mean or max of x over `axis` (None: all axes); out never overlaps x.

        "max" propagates NaN (a NaN among the elements gives NaN, as torch.amax and np.max)
        and refuses an empty reduction (an axis of size 0, or x empty with axis None) with a
        ValueError before writing anything; "sum" of nothing is +0, "mean" of nothing NaN."""
        if name not in REDUCE_KERNELS:
            raise ValueError(f"unknown reduction {name!r}; known: {', '.join(REDUCE_KERNELS)}")
        self._check_computes(name, (x,), out)
        if name == "max":
            reduced = range(len(x.shape)) if axis is None else axis
            if any(x.shape[i] == 0 for i in reduced):
                raise ValueError(f"reduce: max over no element: axis {axis} of shape "
                                 f"{tuple(x.shape)} has size 0, and a maximum of nothing has "
                                 f"no value")
            hook = self._reduce_max
        else:
            hook = functools.partial(self._reduce, name)
        if out.dtype in HALVES and not self.capabilities.half_kernels:
            return self._in_float32(lambda x, o: hook(x, axis, keepdims, o), (x,), (out,))
        hook(x, axis, keepdims, out)

    def moments(self, x: Any, mean: Any, m2: Any) -> None:
        """Per channel of x, an (N, C, S) view: mean[0, k, 0] = the mean of x[:, k, :] and
        m2[0, k, 0] = the sum of (x - mean[0, k, 0])**2 over the same elements (batch norm's
        statistics; the biased variance is m2 / (N * S)). mean and m2 are (1, C, 1) views of
        x's dtype that overlap nothing. Each device sums in one fixed order of its own, so the
        same x gives the same bits every time (a graph's replay, eager's); within a few ULPs
        of the exact values where the device sums in double (the CPU's C kernel, OpenCL with
        float64)."""
        self._check_stats("moments", (x,), (mean, m2))
        self._halves_widened(self._moments, (x,), (mean, m2))

    def channel_dots(self, g: Any, y: Any, sums: Any, dots: Any) -> None:
        """Per channel of g and y, (N, C, S) views of one shape: sums[0, k, 0] = the sum of
        g[:, k, :] and dots[0, k, 0] = the sum of g * y there (batch norm's backward: the
        bias's and the weight's gradients). sums and dots are (1, C, 1) views of g's dtype that
        overlap nothing; one fixed order of additions per device, as `moments`."""
        self._check_stats("channel_dots", (g, y), (sums, dots))
        self._halves_widened(self._channel_dots, (g, y), (sums, dots))

    def _halves_widened(self, hook: Callable[..., None], inputs: Sequence[Any],
                        outputs: Sequence[Any]) -> None:
        """hook(*inputs, *outputs) on float32 or float64 views: two-byte operands widened to
        float32 scratch first (the hooks compute only those two), the results rounded once."""
        if inputs[0].dtype not in HALVES:
            hook(*inputs, *outputs)
            return
        wide = [self._widened(v) for v in inputs]
        targets = [self.scratch(tuple(o.shape), _FLOAT32) for o in outputs]
        hook(*wide, *targets)
        for t, o in zip(targets, outputs):
            self._cast(t, o)

    def _check_stats(self, kernel: str, inputs: Sequence[Any], outputs: Sequence[Any]) -> None:
        """`moments` / `channel_dots`: (N, C, S) inputs of one shape, (1, C, 1) outputs, one
        float dtype the device computes; a ValueError or TypeError naming the shapes, before
        anything is written."""
        shape = tuple(inputs[0].shape)
        if len(shape) != 3 or any(tuple(v.shape) != shape for v in inputs):
            raise ValueError(f"{kernel}: inputs must be (N, C, S) views of one shape, got "
                             f"{', '.join(str(tuple(v.shape)) for v in inputs)}")
        if any(tuple(v.shape) != (1, shape[1], 1) for v in outputs):
            raise ValueError(f"{kernel}: outputs must be (1, {shape[1]}, 1) for inputs of "
                             f"shape {shape}, got "
                             f"{', '.join(str(tuple(v.shape)) for v in outputs)}")
        dtype = np.dtype(inputs[0].dtype)
        if dtype not in COMPUTE_DTYPES or any(np.dtype(v.dtype) != dtype
                                            for v in (*inputs, *outputs)):
            raise TypeError(f"{kernel}: every operand must have one float dtype, got "
                            f"{', '.join(str(v.dtype) for v in (*inputs, *outputs))}")
        self._check_computes(kernel, inputs, outputs[0])

    def cross_entropy(self, logits: Any, labels: Any, losses: Any, probs: Any) -> None:
        """Softmax cross-entropy per row, computed stably (the row maximum is subtracted first).

        `logits` is (rows, classes), `labels` (rows,) integer class indices. Writes
        losses[i] = logsumexp(logits[i]) - logits[i, labels[i]] and probs = softmax(logits)
        (kept for the backward pass). Outputs never overlap inputs.

        Raises ValueError("cross_entropy: label L is outside [0, C) for C classes", L the first
        bad label in row order) before writing either output (Note [checked before written]):
        labels in a Tensor reach the kernel unchecked.
        """
        self._check_computes("cross_entropy", (logits, probs), losses)
        if logits.dtype in HALVES:
            return self._in_float32(self._cross_entropy,
                                    (logits, labels), (losses, probs))
        self._cross_entropy(logits, labels, losses, probs)

    def cross_entropy_backward(self, probs: Any, labels: Any, grad: Any, out: Any) -> None:
        """out = (probs - one_hot(labels)) * grad[:, None]: the gradient of the per-row losses
        of `cross_entropy` with respect to the logits, given the gradient `grad` (rows,).
        `labels` are those `cross_entropy` checked (autograd saves them with their version), so
        a backend need not check them again; outside [0, classes) the result is undefined."""
        self._check_computes("cross_entropy_backward", (probs, grad), out)
        if out.dtype in HALVES:
            return self._in_float32(self._cross_entropy_backward, (probs, labels, grad), (out,))
        self._cross_entropy_backward(probs, labels, grad, out)

    def gather(self, table: Any, indices: Any, out: Any) -> None:
        """out[i, :] = table[indices[i], :]: rows of the 2-D view `table` picked by the 1-D
        integer view `indices`, into the 2-D view `out` (len(indices), table's columns), whose
        memory overlaps neither. Moves bits, so any dtype of table and out (one dtype).

        Raises ValueError naming the first index outside [0, rows) and the row count, before
        anything is written (Note [checked before written]): the indices are read back to the
        host for the check (a wait on a device with queues)."""
        self._check_rows("gather", indices, table.shape[0])
        if out.shape[0]:
            self._gather(table, indices, out)

    def scatter_add(self, src: Any, indices: Any, out: Any) -> None:
        """out[indices[i], :] += src[i, :] for i = 0, 1, ... in that order (NumPy's
        `np.add.at`): repeated indices accumulate, one addition at a time in index order, so
        every backend gives the CPU's bits. `src` is (len(indices), columns), `out` (rows,
        columns), one float dtype; out overlaps neither input. A float16 or bfloat16 out
        accumulates in float32 and is rounded once at the end (Note [two-byte floats compute
        in float32]).

        Raises ValueError as `gather` does, before anything is written."""
        self._check_computes("scatter_add", (src,), out)
        self._check_rows("scatter_add", indices, out.shape[0])
        if not src.shape[0]:
            return
        if out.dtype in HALVES:
            return self._in_float32(self._scatter_add, (src, indices), (out,), read=True)
        self._scatter_add(src, indices, out)

    def im2col(self, x: Any, kernel: tuple[int, int], stride: tuple[int, int],
               padding: tuple[int, int], columns: Any) -> None:
        """A convolution's columns: x (N, C, H, W) into columns (C*kh*kw, N*Ho*Wo), row (c, i,
        j) and column (n, oh, ow) holding x[n, c, oh*sh + i - ph, ow*sw + j - pw], zero where
        that lies in the padding. Moves values (any dtype); columns overlaps nothing. Called
        only where `conv_columns` is claimed.

        Raises ValueError, before anything is written, where the shapes do not match the
        geometry."""
        self._check_columns("im2col", tuple(x.shape), kernel, stride, padding,
                            tuple(columns.shape))
        self._im2col(x, kernel, stride, padding, columns)

    def col2im(self, columns: Any, kernel: tuple[int, int], stride: tuple[int, int],
               padding: tuple[int, int], out: Any) -> None:
        """`im2col`'s adjoint, x's gradient from its columns' gradient: out (N, C, H, W)
        zeroed, then each item of columns (C*kh*kw, N*Ho*Wo) added where im2col took it from,
        each element's additions in the order of (i, j); two-byte floats in float32, rounded
        once. out overlaps nothing. Called only where `conv_columns` is claimed."""
        self._check_computes("col2im", (columns,), out)
        self._check_columns("col2im", tuple(out.shape), kernel, stride, padding,
                            tuple(columns.shape))
        self._halves_widened(lambda c, o: self._col2im(c, kernel, stride, padding, o),
                             (columns,), (out,))

    def _check_columns(self, kernel_name: str, x_shape: tuple[int, ...], kernel: tuple,
                       stride: tuple, padding: tuple, columns_shape: tuple[int, ...]) -> None:
        if len(x_shape) != 4:
            raise ValueError(f"{kernel_name}: x must be (N, C, H, W), got {x_shape}")
        (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
        n, c, h, w = x_shape
        ho, wo = _conv_output(x_shape, kernel, stride, padding)
        want = (c * kh * kw, n * ho * wo)
        if (min(kh, kw, sh, sw) < 1 or min(ph, pw) < 0 or h + 2 * ph < kh or w + 2 * pw < kw
                or columns_shape != want):
            raise ValueError(f"{kernel_name}: columns of shape {columns_shape} do not match x "
                             f"{x_shape} under kernel {kh}x{kw}, stride {sh},{sw} and padding "
                             f"{ph},{pw} (expected {want})")

    def max_pool2d(self, x: Any, kernel: tuple[int, int], stride: tuple[int, int],
                   padding: tuple[int, int], out: Any, indices: Any = None) -> None:
        """PyTorch's max pooling of the 4-D view x (N, C, H, W) into out (N, C, Ho, Wo), and
        where each maximum was into the int64 view `indices` (out's shape; None: not wanted),
        as PyTorch's indices: h * W + w within the (n, c) plane. Each window (kernel, stride,
        padding: (h, w) pairs) is scanned in row-major order over its elements of x (the
        padding is no element): the first maximum is taken, or the last NaN; a window of -inf
        gives -inf at its first element of x. Moves values, so out is bits of x. The outputs
        overlap neither x nor each other.

        Raises ValueError, before anything is written, for a geometry whose windows do not
        make out's shape or may hold no element of x (padding above half the kernel)."""
        self._check_computes("max_pool2d", (x,), out)
        self._check_pool("max_pool2d", tuple(x.shape), kernel, stride, padding,
                         tuple(out.shape))
        if indices is not None and (np.dtype(indices.dtype) != np.int64
                                    or tuple(indices.shape) != tuple(out.shape)):
            raise ValueError(f"max_pool2d: indices must be int64 of shape {tuple(out.shape)}, "
                             f"got {indices.dtype} {tuple(indices.shape)}")
        if not out.size:
            return
        if out.dtype in HALVES:  # NOTE: exact either way: the maximum moves a widened value
            return self._in_float32(
                lambda a, o, *i: self._max_pool2d(a, kernel, stride, padding, o, (*i, None)[0]),
                (x,), (out,) if indices is None else (out, indices))
        self._max_pool2d(x, kernel, stride, padding, out, indices)

    def max_pool2d_backward(self, grad: Any, indices: Any, out: Any) -> None:
        """x's gradient of `max_pool2d`: out (N, C, H, W) = zeros, then grad (N, C, Ho, Wo)
        added at each output's index in its (n, c) plane, one addition at a time, plane by
        plane and in row-major order within each (PyTorch's CPU order). `indices` are those
        `max_pool2d` wrote (autograd saves them with their version): each lies in [0, H * W).
        A float16 or bfloat16 out accumulates in float32 and is rounded once (Note [two-byte
        floats compute in float32]). out overlaps neither input."""
        self._check_computes("max_pool2d_backward", (grad,), out)
        if tuple(grad.shape) != tuple(indices.shape) or len(out.shape) != 4 or \
                tuple(grad.shape[:2]) != tuple(out.shape[:2]):
            raise ValueError(f"max_pool2d_backward: grad {tuple(grad.shape)}, indices "
                             f"{tuple(indices.shape)} and out {tuple(out.shape)} do not "
                             f"match")
        if out.dtype in HALVES:
            return self._in_float32(self._max_pool2d_backward, (grad, indices), (out,))
        self._max_pool2d_backward(grad, indices, out)

    def _check_pool(self, kernel_name: str, shape: tuple[int, ...], kernel: tuple[int, int],
                    stride: tuple[int, int], padding: tuple[int, int],
                    out_shape: tuple[int, ...]) -> None:
        """ValueError unless every window holds an element of x and they make out_shape."""
        if len(shape) != 4 or min(*kernel, *stride) < 1 or min(padding) < 0 or \
                padding[0] > kernel[0] // 2 or padding[1] > kernel[1] // 2:
            raise ValueError(f"{kernel_name}: x {shape}, kernel {kernel}, stride {stride}, "
                             f"padding {padding}: not a geometry whose every window holds an "
                             f"element of x")
        size = _conv_output(shape, kernel, stride, padding)
        if min(size) < 1 or out_shape != (*shape[:2], *size):
            raise ValueError(f"{kernel_name}: out has shape {out_shape}, the windows make "
                             f"{(*shape[:2], *size)}")

    def from_host(self, host: np.ndarray, view: Any) -> None:
        """Write the host array `host` (the view's shape and dtype) into the native view
        `view`, any strides: the mirror of `to_host`."""
        self._from_host(np.asarray(host, view.dtype).reshape(view.shape), view)

    def _check_rows(self, kernel: str, indices: Any, rows: int) -> None:
        """ValueError naming the first of `indices` outside [0, rows) (checked on the host)."""
        if indices.dtype.kind not in "iu":
            raise TypeError(f"{kernel}: indices must be integers, got {indices.dtype}")
        if not indices.shape[0]:
            return
        host = self.to_host(indices)
        if host.min() < 0 or host.max() >= rows:
            where = int(np.flatnonzero((host < 0) | (host >= rows))[0])
            raise ValueError(f"{kernel}: index {int(host[where])} (at position {where}) is "
                             f"outside [0, {rows}) for {rows} rows")

    def _in_float32(self, kernel: Callable[..., None], inputs: Sequence[Any],
                    outs: Sequence[Any], read: bool = False) -> None:
        """kernel(*inputs, *outs) with each half operand (HALVES) widened to a float32 scratch
        copy, exactly (not where `half_kernels`: the kernel reads them as they are), and each
        half output computed in float32 scratch and then rounded to its dtype once (`_cast`,
        round to nearest even); `read`: the outputs' old contents are read too. Numbers pass
        as float32, as PyTorch keeps a Python number in its opmath type; other operands (None,
        integer labels) as they are."""
        wide = []
        widen = not self.capabilities.half_kernels
        for x in inputs:
            if widen and _half(x):
                x = self._widened(x)
            elif isinstance(x, np.generic) and x.dtype in HALVES:
                x = np.float32(x)
            wide.append(x)
        targets = []
        for o in outs:
            t = o
            if _half(o):
                t = self.scratch(tuple(o.shape), _FLOAT32)
                if read:
                    self._cast(o, t)
            targets.append(t)
        kernel(*wide, *targets)
        for t, o in zip(targets, outs):
            if t is not o:
                self._cast(t, o)

    def _half_elementwise(self, name: str, operands: Sequence[Any], out: Any) -> bool:
        """Run the elementwise kernel `name` into the half view `out` under Note [two-byte
        floats compute in float32] (`_in_float32`'s result bit for bit) without widened
        copies, if the backend can; return False, having written nothing, to have
        `_in_float32` run the float32 kernel. Called only where `half_elementwise` is
        claimed."""
        raise _missing(self, "_half_elementwise")

    def _widened(self, x: Any) -> Any:
        """A float32 array equal to the half view `x` (its shape; any strides). The default
        converts into a scratch copy; a backend may widen less (a broadcast view's one row)."""
        w = self.scratch(tuple(x.shape), _FLOAT32)
        self._cast(x, w)
        return w

    def fused(self, program: Sequence[tuple[str, tuple, Any]], inputs: Sequence[Any],
              out: Any) -> None:
        """Run a chain of elementwise kernels as one, so inner results never exist at full size.

        `program[i]` is (kernel name, args, result dtype); each arg is ("input", k) for
        `inputs[k]` (a native view already broadcast to out's shape), ("link", j) for the result
        of `program[j]` (j < i) or ("number", value). The last link's result goes to `out`.
        The default runs the kernels block by block over the leading axis with block-sized
        scratch arrays; a backend may compile the chain into one kernel instead
        (`_compile_fused`).
        """
        self._check_chain(program, inputs, out)
        self._prepared(program, inputs, out, {})()

    def prepare_fused(self, program: Sequence[tuple[str, tuple, Any]], inputs: Sequence[Any],
                      out: Any, scratch: dict | None = None, *,
                      compiled_only: bool = False) -> Callable[[], None] | None:
        """`fused(program, inputs, out)` checked and set up once, as a function that runs it:
        for a caller that runs the same chain on the same views many times (a graph's replay).
        The backend's kernel is found and its arguments made here, as are the default's scratch
        arrays and block views, not at every run; pass the same `scratch` dict to chains that
        never run at the same time and they share them. With `compiled_only`, None where the
        backend has no kernel of its own for the chain (the caller runs it another way, not
        by the blocked default): a graph's lone elementwise step runs as a one-link chain only
        where that is the backend's compiled kernel."""
        self._check_chain(program, inputs, out)
        if compiled_only:
            return (self._compile_fused(program, inputs, out)
                    if self.capabilities.compiles_fused else None)
        return self._prepared(program, inputs, out, {} if scratch is None else scratch)

    def _check_chain(self, program: Sequence[tuple[str, tuple, Any]], inputs: Sequence[Any],
                     out: Any) -> None:
        """A fused program's checks: its shape (`_check_program`), then the dtypes of its
        inputs, out and links (`_check_computes`; a chain of copies moves any dtype)."""
        _check_program(program)
        if all(name == "copy" for name, _, _ in program):
            return
        self._check_computes("fused", inputs, out)
        for name, _, dtype in program:
            if name != "copy" and np.dtype(dtype) not in self.capabilities.compute_dtypes:
                self._refuse_dtype(f"fused chain's {name}", np.dtype(dtype))

    def _prepared(self, program: Sequence[tuple[str, tuple, Any]], inputs: Sequence[Any],
                  out: Any, shared: dict) -> Callable[[], None]:
        run = None
        if self.capabilities.compiles_fused:
            run = self._compile_fused(program, inputs, out)
        return self._blocked(program, inputs, out, shared) if run is None else run

    def _compile_fused(self, program: Sequence[tuple[str, tuple, Any]], inputs: Sequence[Any],
                       out: Any) -> Callable[[], None] | None:
        """The chain as one kernel of the backend's own, set up for these views: a function
        that launches it with every argument made now; None where the backend has no kernel
        for this chain, and the blocked default runs it. Called only where `compiles_fused`
        is claimed."""
        raise _missing(self, "_compile_fused")

    def fused_scratch(self, program: Sequence[tuple[str, tuple, Any]], shape: Sequence[int],
                      dtype: Any) -> list[tuple[tuple[int, ...], np.dtype, int]]:
        """The scratch arrays the blocked default runs `program` with, for an output of `shape`
        and `dtype`: one key (shape, dtype, link) per link but the last, in order. Chains
        prepared with one `scratch` dict share the array of a key (`prepare_fused`); a caller
        that puts arrays of its own under these keys first (a graph, from its allocator)
        decides where the scratch lives, and no other is made. A backend that compiles the
        chain (`_compile_fused`) uses none of them."""
        return _blocked_scratch(program, shape, dtype)

    def _blocked(self, program: Sequence[tuple[str, tuple, Any]], inputs: Sequence[Any],
                 out: Any, shared: dict) -> Callable[[], None]:
        """The chain as kernel calls over blocks of at most FUSED_BLOCK_BYTES (`_fused_blocks`),
        inner results in block-sized scratch arrays: every view made now, a function runs
        them."""
        shape = tuple(out.shape)
        _, blocks = _fused_blocks(shape, out.dtype.itemsize)
        scratch = []
        for key in _blocked_scratch(program, shape, out.dtype):
            if key not in shared:
                shared[key] = self.scratch(key[0], key[1])
            scratch.append(shared[key])
        calls: list[tuple[Callable[..., None], tuple]] = []
        for index in blocks:
            size = index[-1].stop - index[-1].start if shape else 0
            results: list[Any] = []
            for i, (name, args, _) in enumerate(program):
                operands = []
                for kind, ref in args:
                    if kind == "input":
                        operands.append(inputs[ref][index] if shape else inputs[ref])
                    elif kind == "link":
                        operands.append(results[ref])
                    else:
                        operands.append(ref)
                if i == len(program) - 1:
                    target = out[index] if shape else out
                else:
                    target = scratch[i][:size] if shape else scratch[i]
                # NOTE: the public kernels: a half link is rounded once, as its op would be
                calls.append((self.elementwise, (name, operands, target)))
                results.append(target)

        def run() -> None:
            for kernel, args in calls:
                kernel(*args)

        return run

    def to_host(self, view: Any) -> np.ndarray:
        """A new host numpy array equal to the native view `view` (any strides)."""
        return self._to_host(view)

    def synchronize(self) -> None:
        """Wait until every queued kernel and copy has finished (a device without queues has
        nothing to wait for)."""
        if self.capabilities.queues:
            self._synchronize()

    def record(self, run: Callable[[], None]) -> Any:
        """Record the copies and kernels that `run()` queues as one device graph, without
        running them, and return it: an object whose `launch()` queues them all again on the
        home queue, on the same memory, with one call; whose `checks` are the host checks
        (`HostCheck`) the recorded ops moved out of the graph, which the caller runs before
        each launch (so the graph is right only where nothing in it writes what they read:
        the caller makes sure); and whose `held_bytes` is the memory the work took while it
        was recorded (a kernel's temporaries), which stays with the graph.

        Raises:
            RecordError: the device records no graphs (`Capabilities.records_graphs`), or the
                work cannot be recorded (it waits for the device, reads memory back to the
                host, calls a library that refuses to be recorded); the message says which.
                Nothing `run` queued has run.
        """
        if not self.capabilities.records_graphs:
            raise RecordError(f"{self.name} records no device graphs")
        return self._record(run)

    def _record(self, run: Callable[[], None]) -> Any:
        """`record`; called only where `records_graphs` is claimed."""
        raise _missing(self, "_record")

    # ----------------------------------------------------------------- queues
    # Note [queue-ordered reuse]: a device runs its copies and kernels on one in-order queue
    # (stream), its home queue, so memory freed there may be handed out again at once: whatever
    # reuses it is queued behind whatever used it. Memory that is also used on another queue
    # (recorded with `Allocator.record_queue`, PyTorch's record_stream) is not: its free queues
    # an event on each recorded queue, and the memory stays out of the allocator (pending) until
    # every event has completed, so no command queued there before the free can touch it after
    # it is handed out again, to any queue. The other direction: memory handed to another queue
    # (an interop hook bound to that queue) may have been freed on the home queue a moment ago,
    # with its last kernels still queued there; the other queue first waits for the home queue,
    # on the device (a marker and a barrier, cudaStreamWaitEvent), as CUDA's stream-ordered
    # allocator inserts dependencies between streams. Together: every command on memory before
    # its free comes before every command on it after its next allocation, whatever the queues.
    # The public methods below are the queues' policy: on a device without queues
    # (`Capabilities.queues` False) there is no home queue and every other one raises TypeError.
    @property
    def home_queue(self) -> Any:
        """The queue (stream) all of this device's copies and kernels run on, in order; None for
        a synchronous device."""
        return self._home_queue() if self.capabilities.queues else None

    def queue_key(self, queue: Any) -> int:
        """A number naming `queue` (two objects for one queue give one key).

        Raises:
            TypeError: `queue` is not a queue of this device's kind (a synchronous device has
                none).
            ValueError: `queue` belongs to another device or context.
        """
        if not self.capabilities.queues:
            raise TypeError(f"{self.name} runs every command synchronously and has no queues; "
                            f"got {type(queue).__name__}")
        return self._queue_key(queue)

    def record_event(self, queue: Any) -> Any:
        """An event that completes when everything queued on `queue` so far has run."""
        if not self.capabilities.queues:
            raise TypeError(f"{self.name} runs every command synchronously and has no queues")
        return self._record_event(queue)

    def event_done(self, event: Any) -> bool:
        """Whether `event` has completed (without waiting)."""
        if not self.capabilities.queues:
            raise TypeError(f"{self.name} runs every command synchronously and has no events")
        return self._event_done(event)

    def wait_event(self, event: Any) -> None:
        """Block the host until `event` has completed."""
        if not self.capabilities.queues:
            raise TypeError(f"{self.name} runs every command synchronously and has no events")
        self._wait_event(event)

    def join(self, waiter: Any, signaller: Any) -> None:
        """Make what is queued on `waiter` from now on wait for everything queued on `signaller`
        so far, without blocking the host (a marker and a barrier, or an event)."""
        if not self.capabilities.queues:
            raise TypeError(f"{self.name} runs every command synchronously and has no queues")
        self._join(waiter, signaller)

    # ----------------------------------------------------------------- hooks (mechanism)
    def _raw_alloc(self, nbytes: int) -> Any:
        raise _missing(self, "_raw_alloc")

    def _raw_alloc_read_only(self, nbytes: int) -> Any:
        """Ordinary memory: a device with read-only memory overrides this (and `_is_read_only`)
        and claims `read_only_memory`."""
        return self._raw_alloc(nbytes)

    def _is_read_only(self, raw: Any) -> bool:
        return False

    def _raw_free(self, raw: Any) -> None:
        raise _missing(self, "_raw_free")

    def _copyin(self, raw: Any, offset: int, host_bytes: np.ndarray) -> None:
        raise _missing(self, "_copyin")

    def _copyout(self, raw: Any, offset: int, nbytes: int) -> np.ndarray:
        raise _missing(self, "_copyout")

    def _array_view(self, raw: Any, offset: int, shape: tuple, dtype: np.dtype,
                    strides: tuple) -> Any:
        raise _missing(self, "_array_view")

    def _address(self, raw: Any) -> int:
        raise _missing(self, "_address")

    def _nbytes_of(self, raw: Any) -> int:
        raise _missing(self, "_nbytes_of")

    def _unary(self, name: str, x: Any, out: Any) -> None:
        raise _missing(self, "_unary")

    def _binary(self, name: str, a: Any, b: Any, out: Any) -> None:
        raise _missing(self, "_binary")

    def _ternary(self, name: str, a: Any, b: Any, c: Any, out: Any) -> None:
        raise _missing(self, "_ternary")

    def _matmul(self, a: Any, b: Any, out: Any) -> None:
        raise _missing(self, "_matmul")

    def _cast(self, x: Any, out: Any) -> None:
        raise _missing(self, "_cast")

    def _im2col(self, x: Any, kernel: tuple[int, int], stride: tuple[int, int],
                padding: tuple[int, int], columns: Any) -> None:
        """`im2col`; called only where `conv_columns` is claimed."""
        raise _missing(self, "_im2col")

    def _col2im(self, columns: Any, kernel: tuple[int, int], stride: tuple[int, int],
                padding: tuple[int, int], out: Any) -> None:
        """`col2im` on float32 / float64; called only where `conv_columns` is claimed."""
        raise _missing(self, "_col2im")

    def _plan_products(self, products: list[tuple[Any, Any, Any, bool]]) -> None:
        """Hear a graph's products (`plan_products`); called only where `measures_products`
        is claimed."""
        raise _missing(self, "_plan_products")

    def _gemm(self, a: Any, b: Any, out: Any, alpha: float, beta: float) -> None:
        if beta == 0.0 and alpha == 1.0:
            self._matmul(a, b, out)
            return
        product = self.scratch(tuple(out.shape), out.dtype)
        self._matmul(a, b, product)
        dtype = out.dtype
        scaled = ("mul", (("input", 0), ("number", alpha)), dtype)
        if beta == 0.0:
            self.fused([scaled], [product], out)
        else:
            self.fused([scaled, ("mul", (("input", 1), ("number", beta)), dtype),
                        ("add", (("link", 0), ("link", 1)), dtype)], [product, out], out)

    def _sub_scaled(self, a: Any, b: Any, scale: Any, out: Any, scratch: Any) -> None:
        """One pass where the backend compiles fused chains itself (`compiles_fused`: each link
        rounded to its dtype, as its own kernel would round it); else the two kernels, the
        product in `scratch` (made here when None)."""
        dtype = out.dtype
        product = ("mul", (("input", 1), ("number", scale)), dtype)
        if self.capabilities.compiles_fused:
            self.fused([product, ("sub", (("input", 0), ("link", 0)), dtype)], [a, b], out)
            return
        if scratch is None:
            scratch = self.scratch(tuple(out.shape), dtype)
        self.binary("mul", b, scale, scratch)
        self.binary("sub", a, scratch, out)

    def _reduce(self, name: str, x: Any, axis: tuple[int, ...] | None, keepdims: bool,
                out: Any) -> None:
        raise _missing(self, "_reduce")

    def _reduce_max(self, x: Any, axis: tuple[int, ...] | None, keepdims: bool,
                    out: Any) -> None:
        """On the host: x read back (`to_host`), NumPy's maximum reduction (NaN propagates),
        the result copied into out; a backend writes a kernel of its own for speed. x has an
        element in every reduced position (`reduce` refused empty reductions)."""
        host = np.empty(tuple(out.shape), out.dtype)
        np.maximum.reduce(self.to_host(x), axis=axis, keepdims=keepdims, out=host)
        self._from_host(host, out)

    def _moments(self, x: Any, mean: Any, m2: Any) -> None:
        """The reduce and elementwise kernels: the mean, read back to the host, then channel by
        channel (x - mean)**2 a few samples at a time in scratch (`_summed_in_chunks`; the
        kernels take operands of out's shape or numbers, so each channel's mean is a number):
        a backend writes one kernel of its own for speed."""
        self._reduce("mean", x, (0, 2), True, mean)
        for k, centre in enumerate(self.to_host(mean).reshape(-1)):

            def squares(parts: list, scratch: Any, centre: Any = centre) -> None:
                self._binary("sub", parts[0], centre, scratch)
                self._binary("mul", scratch, scratch, scratch)

            self._summed_in_chunks(squares, (x[:, k:k + 1, :],), m2[:, k:k + 1, :])

    def _channel_dots(self, g: Any, y: Any, sums: Any, dots: Any) -> None:
        """The reduce and mul kernels, g * y a few samples at a time in scratch, as `_moments`."""
        self._reduce("sum", g, (0, 2), True, sums)
        self._summed_in_chunks(lambda parts, scratch: self._binary("mul", *parts, scratch),
                               (g, y), dots)

    def _summed_in_chunks(self, make: Callable[..., None], inputs: Sequence[Any],
                          out: Any) -> None:
        """out (1, C, 1) = the sum over axes 0 and 2 of what `make(parts, scratch)` writes into
        scratch for each run of samples of the (N, C, S) inputs (`parts`: the inputs' runs):
        runs of at most STATS_CHUNK items, their sums added in order."""
        n, c, s = (int(d) for d in inputs[0].shape)
        step = max(1, STATS_CHUNK // max(1, c * s))
        scratch = self.scratch((min(n, step), c, s), out.dtype)
        partial = self.scratch((1, c, 1), out.dtype) if n > step else None
        for start in range(0, n, step):
            stop = min(n, start + step)
            parts = [v[start:stop] for v in inputs]
            room = scratch if stop - start == scratch.shape[0] else scratch[:stop - start]
            make(parts, room)
            self._reduce("sum", room, (0, 2), True, out if start == 0 else partial)
            if start:
                self._binary("add", out, partial, out)

    def _cross_entropy(self, logits: Any, labels: Any, losses: Any, probs: Any) -> None:
        """On the host, by the CPU's formula (`numpy_cross_entropy`, which checks the labels
        before anything is written): a backend writes a kernel of its own for speed."""
        host_losses = np.empty(tuple(losses.shape), losses.dtype)
        host_probs = np.empty(tuple(probs.shape), probs.dtype)
        numpy_cross_entropy(self.to_host(logits), self.to_host(labels), host_losses, host_probs)
        self._from_host(host_losses, losses)
        self._from_host(host_probs, probs)

    def _cross_entropy_backward(self, probs: Any, labels: Any, grad: Any, out: Any) -> None:
        """On the host, by the CPU's formula (`numpy_cross_entropy_backward`)."""
        host_out = np.empty(tuple(out.shape), out.dtype)
        numpy_cross_entropy_backward(self.to_host(probs), self.to_host(labels),
                                     self.to_host(grad), host_out)
        self._from_host(host_out, out)

    def _gather(self, table: Any, indices: Any, out: Any) -> None:
        """The copy kernel, one row at a time (indices read on the host): a backend writes
        one kernel of its own for speed."""
        for i, row in enumerate(self.to_host(indices).tolist()):
            self.unary("copy", table[row:row + 1], out[i:i + 1])

    def _scatter_add(self, src: Any, indices: Any, out: Any) -> None:
        """The add kernel in place, one row of `src` at a time in index order (indices read
        on the host): a backend writes one kernel of its own for speed, with the same order
        of additions."""
        for i, row in enumerate(self.to_host(indices).tolist()):
            target = out[row:row + 1]
            self._binary("add", target, src[i:i + 1], target)

    def _max_pool2d(self, x: Any, kernel: tuple[int, int], stride: tuple[int, int],
                    padding: tuple[int, int], out: Any, indices: Any) -> None:
        """On the host, by the CPU's formula (`numpy_max_pool2d`): a backend writes a kernel
        of its own for speed."""
        host_out = np.empty(tuple(out.shape), out.dtype)
        host_indices = None if indices is None else np.empty(tuple(out.shape), np.int64)
        numpy_max_pool2d(self.to_host(x), kernel, stride, padding, host_out, host_indices)
        self._from_host(host_out, out)
        if indices is not None:
            self._from_host(host_indices, indices)

    def _max_pool2d_backward(self, grad: Any, indices: Any, out: Any) -> None:
        """On the host, by the CPU's formula (`numpy_max_pool2d_backward`)."""
        host_out = np.empty(tuple(out.shape), out.dtype)
        numpy_max_pool2d_backward(self.to_host(grad), self.to_host(indices), host_out)
        self._from_host(host_out, out)

    def _to_host(self, view: Any) -> np.ndarray:
        """The copy kernel moves the view (any strides) into contiguous raw memory of its own,
        which `_copyout` reads."""
        shape, dtype = tuple(view.shape), np.dtype(view.dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        raw = self.raw_alloc(nbytes)
        try:
            self.unary("copy", view, self._array_view(raw, 0, shape, dtype,
                                                     contiguous_strides(shape, dtype.itemsize)))
            host = self._copyout(raw, 0, nbytes)
        finally:
            self.raw_free(raw)
        return host.view(dtype).reshape(shape)

    def _from_host(self, host: np.ndarray, view: Any) -> None:
        """Write the host array `host` (view's shape and dtype) into the native view `view`:
        staged in raw memory of its own by `copyin`, moved by the copy kernel (any strides)."""
        host = np.ascontiguousarray(host)
        raw = self.raw_alloc(host.nbytes)
        try:
            self.copyin(raw, 0, host)
            staged = self._array_view(raw, 0, host.shape, host.dtype,
                                      contiguous_strides(host.shape, host.dtype.itemsize))
            self.unary("copy", staged, view)
            self.synchronize()  # NOTE: the copy has read the staged bytes before they go
        finally:
            self.raw_free(raw)

    # NOTE: the queue hooks, called only where `queues` is claimed
    def _home_queue(self) -> Any:
        raise _missing(self, "_home_queue")

    def _queue_key(self, queue: Any) -> int:
        raise _missing(self, "_queue_key")

    def _record_event(self, queue: Any) -> Any:
        raise _missing(self, "_record_event")

    def _event_done(self, event: Any) -> bool:
        raise _missing(self, "_event_done")

    def _wait_event(self, event: Any) -> None:
        raise _missing(self, "_wait_event")

    def _join(self, waiter: Any, signaller: Any) -> None:
        raise _missing(self, "_join")

    def _synchronize(self) -> None:
        raise _missing(self, "_synchronize")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"
