"""The `Device` interface every backend implements, and what backends share.

A device hands out raw memory, copies bytes between host and device, makes native array views
(numpy.ndarray, pyopencl.array.Array, cupy.ndarray) at a byte offset into raw memory, and runs
kernels on such views. It knows nothing of allocators, blocks or tensors.

Raw memory comes in two kinds: ordinary, and read-only (`raw_alloc(nbytes, read_only=True)`),
which kernels may only read while the host still fills it (`copyin`) and reads it back
(`copyout`); constants live there. A device that has no such memory (CUDA) hands out ordinary
memory instead and says so with `read_only_memory = False`.

Public methods hold the policy (argument checks, error wording); a backend implements the
underscore hooks. A hook that a backend lacks raises `NotImplementedError` naming it.

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

import functools
from collections.abc import Callable, Sequence
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
#: Reductions over an axis (or all axes).
REDUCE_KERNELS = ("sum", "mean")
#: The default `Device.fused` runs a chain in blocks of about this many bytes per operand (L2).
FUSED_BLOCK_BYTES = 64 << 10
#: The two-byte floats: every kernel computes them in float32 and rounds each result to the
#: output's dtype once (Note [two-byte floats compute in float32]), as PyTorch's CPU kernels do
#: for half and bfloat16 (their "opmath" type) and NumPy's float16 loops do op by op.
HALVES = (np.dtype("float16"), np.dtype(ml_dtypes.bfloat16))
_FLOAT32 = np.dtype("float32")
#: The dtypes the arithmetic kernels take (every kernel but "copy" and `cast`, which move and
#: convert any dtype): a backend computes a subset (`Device._compute_dtypes`), checked before
#: any kernel is built (`Device._check_computes`).
COMPUTE_DTYPES = (*HALVES, _FLOAT32, np.dtype("float64"))


def _half(x: Any) -> bool:
    return getattr(x, "dtype", None) in HALVES


class BackendUnavailableError(RuntimeError):
    """A backend was asked for but cannot run here (its package or its hardware is missing)."""


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


def _missing(device: Device, hook: str) -> NotImplementedError:
    name = type(device).__name__
    return NotImplementedError(f"{name} does not implement the Device hook {hook}()")


def _fused_rows(shape: tuple[int, ...], itemsize: int) -> int:
    """Rows of a fused chain's output of `shape` per block of the blocked default: as many as
    fit in FUSED_BLOCK_BYTES, at least one."""
    row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * itemsize)
    return max(1, FUSED_BLOCK_BYTES // row_bytes) if shape else 1


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


class Device:
    """One compute device: raw memory, host<->device copies, native views and kernels.

    Attributes:
        name: the canonical spec, e.g. "cpu", "opencl:0", "cuda:1".
        alignment: every raw allocation starts at a multiple of this many bytes.
        read_only_memory: True when `raw_alloc(n, read_only=True)` gives memory that the device
            itself marks read-only for kernels; False when it gives ordinary memory.
        gemm_accumulates: True when `gemm(a, b, out, alpha, beta)` runs as one product
            (BLAS-style), False when it is emulated with scratch.
        half_kernels: True when the kernels take float16 / bfloat16 views themselves.

    Example:
        >>> import backends
        >>> dev = backends.get_device("cpu")
        >>> raw = dev.raw_alloc(64)
        >>> dev.address(raw) % dev.alignment
        0
        >>> dev.raw_free(raw)
    """

    name: str = "device"
    alignment: int = 64
    read_only_memory: bool = False
    #: True where the device's memory is the host's own (NumPy): moving a tensor to host memory
    #: and back would free nothing, so a graph under a memory budget never does it.
    host_memory: bool = False
    #: True where `gemm` accumulates into its output in the product itself (BLAS's beta), so a
    #: graph can fold an update such as w -= lr * (a @ b) into the product and save a pass.
    gemm_accumulates: bool = False
    #: True where every kernel loads two-byte operands (HALVES) itself, computes in float32 and
    #: rounds a two-byte output once as it stores (Note [two-byte floats compute in float32]):
    #: elementwise kernels, products and reductions then run on the halves directly, and
    #: `_in_float32` widens no input (only a two-byte output of a float32-only kernel goes
    #: through float32 scratch).
    half_kernels: bool = False
    #: Kernels by name for the runtime's eager fast path (Note [the eager fast path] in
    #: runtime/fastpath.py): each elementwise one called as kernel(*input_views, out_view) with
    #: inputs that it broadcasts itself, "sum" and "mean" as kernel(x, out, axes, keepdims);
    #: None: ops go through `unary`, `binary` and `reduce` only.
    _fast_kernels: dict[str, Any] | None = None

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
        dtype = np.dtype(dtype)
        shape = tuple(shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        strides = []
        step = dtype.itemsize
        for n in reversed(shape):
            strides.append(step)
            step *= max(n, 1)
        return self._array_view(self.raw_alloc(nbytes), 0, shape, dtype, tuple(reversed(strides)))

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
    @functools.cached_property
    def _computed(self) -> tuple[np.dtype, ...]:
        # NOTE: a tuple, float32 first: `in` settles the common dtype by identity (a set hashes)
        computed = self._compute_dtypes()
        return tuple(sorted(computed, key=lambda d: d != _FLOAT32))

    def _check_computes(self, kernel: str, inputs: Sequence[Any], out: Any) -> None:
        """Raise TypeError, before any kernel is built or run, where `out` or an array among
        `inputs` has a dtype this device's kernels do not compute (`_compute_dtypes`); numbers
        pass (they meet the kernel in out's compute dtype). One rule and one message on every
        backend."""
        dtype = out.dtype
        if dtype not in self._computed:
            self._refuse_dtype(kernel, dtype)
        for x in inputs:  # NOTE: most inputs have out's dtype object: `is` settles them
            other = getattr(x, "dtype", dtype)
            if other is not dtype and other not in self._computed and not isinstance(
                    x, np.generic):
                self._refuse_dtype(kernel, other)

    def _refuse_dtype(self, kernel: str, dtype: np.dtype) -> None:
        names = ", ".join(str(d) for d in COMPUTE_DTYPES if d in self._computed)
        why = (f" ({self.name} lacks {dtype} arithmetic: an OpenCL device without cl_khr_fp64, "
               f"say)" if dtype in COMPUTE_DTYPES else "")
        raise TypeError(f"{self.name}: the {kernel} kernel computes on {names}, not {dtype}"
                        f"{why}; cast first (runtime.ops.cast), or move the bits with the copy "
                        f"kernel")

    def unary(self, name: str, x: Any, out: Any) -> None:
        """out = f(x) elementwise, f one of UNARY_KERNELS; x may be identical to out. Every
        kernel but "copy" (any dtype) takes the dtypes of `_compute_dtypes` only (TypeError)."""
        if name not in UNARY_KERNELS:
            raise ValueError(f"unknown unary kernel {name!r}; known: {', '.join(UNARY_KERNELS)}")
        if name != "copy":
            self._check_computes(name, (x,), out)
        if out.dtype in HALVES and name != "copy" and not self.half_kernels:
            # NOTE: ops give x out's dtype
            if not self._half_elementwise(name, (x,), out):
                self._in_float32(functools.partial(self._unary, name), (x,), (out,))
            return
        self._unary(name, x, out)

    def binary(self, name: str, a: Any, b: Any, out: Any) -> None:
        """out = a (op) b elementwise; a and b already have out's shape (zero strides broadcast)."""
        if name not in BINARY_KERNELS:
            raise ValueError(f"unknown binary kernel {name!r}; known: {', '.join(BINARY_KERNELS)}")
        self._check_computes(name, (a, b), out)
        if out.dtype in HALVES and not self.half_kernels:  # NOTE: ops give a and b out's dtype
            if not self._half_elementwise(name, (a, b), out):
                self._in_float32(functools.partial(self._binary, name), (a, b), (out,))
            return
        self._binary(name, a, b, out)

    def ternary(self, name: str, a: Any, b: Any, c: Any, out: Any) -> None:
        """out = op(a, b, c) elementwise, op one of TERNARY_KERNELS; the operands already have
        out's shape (zero strides broadcast). A BOOL operand of the op (where's condition) is
        a bool view; the others take the dtypes of `_compute_dtypes` (TypeError)."""
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
        if out.dtype in HALVES and not self.half_kernels:
            if not self._half_elementwise(name, operands, out):
                self._in_float32(functools.partial(self._ternary, name), operands, (out,))
            return
        self._ternary(name, a, b, c, out)

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
        if out.dtype in HALVES and not self.half_kernels:
            return self._in_float32(self._matmul, (a, b), (out,))
        self._matmul(a, b, out)

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
        if out.dtype in HALVES and not self.half_kernels:
            return self._in_float32(lambda a, b, o: self._gemm(a, b, o, float(alpha),
                                                               float(beta)),
                                    (a, b), (out,), read=beta != 0)
        self._gemm(a, b, out, float(alpha), float(beta))

    def plan_products(self, products: Sequence[tuple[Any, Any, Any, bool]]) -> None:
        """Hear which 2-D products a captured graph runs at every step, as (a, b, out,
        accumulates) layouts (anything with shape, strides in bytes and dtype), one entry per
        `matmul` or `gemm` call. A device that picks how to run its products by measuring
        them (the CPU's CBLAS, backends/_blas_choice.py) uses it; the default ignores it."""
        self._plan_products(list(products))

    def reduce(self, name: str, x: Any, axis: tuple[int, ...] | None, keepdims: bool,
               out: Any) -> None:
        """out = sum or mean of x over `axis` (None: all axes); out never overlaps x."""
        if name not in REDUCE_KERNELS:
            raise ValueError(f"unknown reduction {name!r}; known: {', '.join(REDUCE_KERNELS)}")
        self._check_computes(name, (x,), out)
        if out.dtype in HALVES and not self.half_kernels:
            return self._in_float32(lambda x, o: self._reduce(name, x, axis, keepdims, o), (x,),
                                    (out,))
        self._reduce(name, x, axis, keepdims, out)

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

    def _in_float32(self, kernel: Callable[..., None], inputs: Sequence[Any],
                    outs: Sequence[Any], read: bool = False) -> None:
        """kernel(*inputs, *outs) with each half operand (HALVES) widened to a float32 scratch
        copy, exactly (not where `half_kernels`: the kernel reads them as they are), and each
        half output computed in float32 scratch and then rounded to its dtype once (`_cast`,
        round to nearest even); `read`: the outputs' old contents are read too. Numbers pass
        as float32, as PyTorch keeps a Python number in its opmath type; other operands (None,
        integer labels) as they are."""
        wide = []
        for x in inputs:
            if _half(x) and not self.half_kernels:
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
        `_in_float32` run the float32 kernel. The default always returns False."""
        return False

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
                      out: Any, scratch: dict | None = None) -> Callable[[], None]:
        """`fused(program, inputs, out)` checked and set up once, as a function that runs it:
        for a caller that runs the same chain on the same views many times (a graph's replay).
        The backend's kernel is found and its arguments made here, as are the default's scratch
        arrays and block views, not at every run; pass the same `scratch` dict to chains that
        never run at the same time and they share them."""
        self._check_chain(program, inputs, out)
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
            if name != "copy" and np.dtype(dtype) not in self._computed:
                self._refuse_dtype(f"fused chain's {name}", np.dtype(dtype))

    def _prepared(self, program: Sequence[tuple[str, tuple, Any]], inputs: Sequence[Any],
                  out: Any, shared: dict) -> Callable[[], None]:
        run = self._compile_fused(program, inputs, out)
        return self._blocked(program, inputs, out, shared) if run is None else run

    def _compile_fused(self, program: Sequence[tuple[str, tuple, Any]], inputs: Sequence[Any],
                       out: Any) -> Callable[[], None] | None:
        """The chain as one kernel of the backend's own, set up for these views: a function
        that launches it with every argument made now; None where the backend has no kernel
        for the chain (the default has none), and the blocked default runs it."""
        return None

    def fused_scratch(self, program: Sequence[tuple[str, tuple, Any]], shape: Sequence[int],
                      dtype: Any) -> list[tuple[tuple[int, ...], np.dtype, int]]:
        """The scratch arrays the blocked default runs `program` with, for an output of `shape`
        and `dtype`: one key (shape, dtype, link) per link but the last, in order. Chains
        prepared with one `scratch` dict share the array of a key (`prepare_fused`); a caller
        that puts arrays of its own under these keys first (a graph, from its allocator)
        decides where the scratch lives, and no other is made. A backend that compiles the
        chain (`_compile_fused`) uses none of them."""
        shape = tuple(shape)
        rows = min(_fused_rows(shape, np.dtype(dtype).itemsize), shape[0]) if shape else 1
        return [((rows,) + shape[1:] if shape else (), np.dtype(link), i)
                for i, (_, _, link) in enumerate(program[:-1])]

    def _blocked(self, program: Sequence[tuple[str, tuple, Any]], inputs: Sequence[Any],
                 out: Any, shared: dict) -> Callable[[], None]:
        """The chain as kernel calls over row blocks of at most FUSED_BLOCK_BYTES, inner
        results in block-sized scratch arrays: every view made now, a function runs them."""
        shape = tuple(out.shape)
        rows = _fused_rows(shape, out.dtype.itemsize)
        total = shape[0] if shape else 1
        scratch = []
        for key in self.fused_scratch(program, shape, out.dtype):
            if key not in shared:
                shared[key] = self.scratch(key[0], key[1])
            scratch.append(shared[key])
        calls: list[tuple[Callable[..., None], tuple]] = []
        for start in range(0, total, rows):
            stop = min(start + rows, total)
            results: list[Any] = []
            for i, (name, args, _) in enumerate(program):
                operands = []
                for kind, ref in args:
                    if kind == "input":
                        operands.append(inputs[ref][start:stop] if shape else inputs[ref])
                    elif kind == "link":
                        operands.append(results[ref])
                    else:
                        operands.append(ref)
                if i == len(program) - 1:
                    target = out[start:stop] if shape else out
                else:
                    target = scratch[i][:stop - start] if shape else scratch[i]
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
        """Wait until every queued kernel and copy has finished (no-op for synchronous devices)."""

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
    @property
    def home_queue(self) -> Any:
        """The queue (stream) all of this device's copies and kernels run on, in order; None for
        a synchronous device."""
        return None

    def queue_key(self, queue: Any) -> int:
        """A number naming `queue` (two objects for one queue give one key).

        Raises:
            TypeError: `queue` is not a queue of this device's kind (a synchronous device has
                none).
            ValueError: `queue` belongs to another device or context.
        """
        raise TypeError(f"{self.name} runs every command synchronously and has no queues; got "
                        f"{type(queue).__name__}")

    def record_event(self, queue: Any) -> Any:
        """An event that completes when everything queued on `queue` so far has run."""
        raise TypeError(f"{self.name} runs every command synchronously and has no queues")

    def event_done(self, event: Any) -> bool:
        """Whether `event` has completed (without waiting)."""
        raise TypeError(f"{self.name} runs every command synchronously and has no events")

    def wait_event(self, event: Any) -> None:
        """Block the host until `event` has completed."""
        raise TypeError(f"{self.name} runs every command synchronously and has no events")

    def join(self, waiter: Any, signaller: Any) -> None:
        """Make what is queued on `waiter` from now on wait for everything queued on `signaller`
        so far, without blocking the host (a marker and a barrier, or an event)."""
        raise TypeError(f"{self.name} runs every command synchronously and has no queues")

    # ----------------------------------------------------------------- hooks (mechanism)
    def _compute_dtypes(self) -> Sequence[np.dtype]:
        """The dtypes this device's arithmetic kernels compute, asked once: COMPUTE_DTYPES, or
        fewer where the device lacks one (an OpenCL device without cl_khr_fp64)."""
        return COMPUTE_DTYPES

    def _raw_alloc(self, nbytes: int) -> Any:
        raise _missing(self, "_raw_alloc")

    def _raw_alloc_read_only(self, nbytes: int) -> Any:
        """Ordinary memory: a device with read-only memory overrides this (and `_is_read_only`)
        and sets `read_only_memory`."""
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

    def _plan_products(self, products: list[tuple[Any, Any, Any, bool]]) -> None:
        pass  # optional: only a device that measures its products listens

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
        """One pass where the backend compiles fused chains itself (`_compile_fused`: each link
        rounded to its dtype, as its own kernel would round it); else the two kernels, the
        product in `scratch` (made here when None)."""
        dtype = out.dtype
        product = ("mul", (("input", 1), ("number", scale)), dtype)
        if type(self)._compile_fused is not Device._compile_fused:
            self.fused([product, ("sub", (("input", 0), ("link", 0)), dtype)], [a, b], out)
            return
        if scratch is None:
            scratch = self.scratch(tuple(out.shape), dtype)
        self.binary("mul", b, scale, scratch)
        self.binary("sub", a, scratch, out)

    def _reduce(self, name: str, x: Any, axis: tuple[int, ...] | None, keepdims: bool,
                out: Any) -> None:
        raise _missing(self, "_reduce")

    def _cross_entropy(self, logits: Any, labels: Any, losses: Any, probs: Any) -> None:
        raise _missing(self, "_cross_entropy")

    def _cross_entropy_backward(self, probs: Any, labels: Any, grad: Any, out: Any) -> None:
        raise _missing(self, "_cross_entropy_backward")

    def _to_host(self, view: Any) -> np.ndarray:
        raise _missing(self, "_to_host")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"
