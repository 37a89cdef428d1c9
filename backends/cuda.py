"""The CUDA device, through CuPy: raw memory from cudaMalloc, kernels from CuPy on one stream.

CuPy is imported only inside the functions that need it (as rmm's CuPy allocator does), so this
module imports without CuPy or a GPU; `CudaDevice.device_count()` is then 0 and
`backends.available()` leaves "cuda" out.

Raw memory is a `cupy.cuda.Memory` (one cudaMalloc each), not a block of CuPy's pool: blockrt's
allocators are the pool. Native views are `cupy.ndarray`s over a `MemoryPointer` into it.

Read-only memory: CUDA has no flag that makes device memory read-only to kernels (`__constant__`
memory is a 64 KiB per-module symbol, not an allocation, and `cudaMemAdviseSetReadMostly` is a
hint for managed memory), and a cupy.ndarray has no writeable flag. So the device claims no
`read_only_memory` (`Capabilities`) and `raw_alloc(n, read_only=True)` gives ordinary cudaMalloc
memory: constants here are protected only by the runtime, which raises `ReadOnlyError` before
any kernel would write them.

Why a freed block is safe to reuse: every copy and kernel of a device runs on its one stream,
`CudaDevice.stream` (a new one, or a framework's own through `backends.from_queue(stream)`),
and a stream runs its work in order. When a block goes back to an allocator
its last kernel may still be queued, but whatever reuses the memory is queued behind it on the
same stream, so it cannot start before that kernel ends. Host reads (`copyout`, `to_host`) wait
for the stream.

The device's own stream is a blocking one (not `non_blocking`), so it is ordered both ways with
CuPy's default stream, the legacy null stream, where CuPy runs whatever a caller does to a
native view (`view[0, 0] = -1`, `view.get()`) unless another stream is current: a copy queued
on the device's stream after such a write waits for it, and the write waits for the device's
earlier kernels. (A non-blocking stream left that write unordered: a loaded test suite once
read the old value back.) A caller who makes another stream current, or runs CuPy's
per-thread default stream (CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1), orders that stream itself:
`backends.from_queue(stream)`, `Allocator.record_queue`, or its own events.

With several streams the reuse argument above no longer holds: a block freed by work on stream A and
reused on stream B needs an event recorded on A and waited on by B (PyTorch's `record_stream`),
or a pool per stream (CuPy's). `Allocator.record_queue` records such a use, and the free joins
the streams (Note [queue-ordered reuse] in backends/base.py); `use_with_cupy` records CuPy's
current stream for the memory it lends.
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from backends import _cublas, _torchbridge, optable
from backends._cublas import get_float32_matmul_precision, set_float32_matmul_precision
from backends.base import (
    HALVES,
    BackendUnavailableError,
    Capabilities,
    Device,
    HostCheck,
    RecordError,
)

__all__ = ["CudaDevice", "get_float32_matmul_precision", "has_bfloat16",
           "set_float32_matmul_precision", "use_with_cupy", "use_with_torch"]

_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation
_BF16 = np.dtype(ml_dtypes.bfloat16)
_F32 = np.dtype("float32")
_F64 = np.dtype("float64")


def _cupy() -> Any:
    """The cupy module, or BackendUnavailableError saying how to get it."""
    try:
        import cupy
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the CUDA backend needs CuPy ({exc}); install blockrt[cuda]") from exc
    return cupy


#: NVRTC options of blockrt's own kernels: no contraction of a product and a sum into one
#: rounding (an FMA), so each step of a formula rounds as an IEEE operation, as on the CPU, and
#: a fused chain gives its links' own bits (Note [one formula on every backend] in
#: backends/base.py)
_NO_FMA = ("--fmad=false",)


@functools.cache
def has_bfloat16() -> bool:
    """Whether this CuPy stores ml_dtypes' bfloat16 (CuPy 14 and newer, with ml_dtypes
    installed): arrays, casts and kernels of it. Older CuPy refuses the dtype."""
    cp = _cupy()
    try:
        cp.ndarray((0,), _BF16)
    except (TypeError, ValueError, NotImplementedError):
        return False
    return True


class _CudaC(optable.CStyle):
    """The table's formulas in CUDA C++ (Note [one declaration per op] in backends/optable.py):
    C's spelling throughout, compiled without contraction (`_NO_FMA`, which reaches the math
    library's code too), so a link gives its eager op's bits. relu is +0 where x < 0, else x,
    as on every backend: -0.0 stays -0.0 and a NaN passes with its bits (Note [relu's zero] in
    backends/base.py; CuPy's maximum would give +0.0 or -0.0 by argument order and a canonical
    NaN)."""


def _formula(name: str, ctype: str, operands: list[str]) -> str:
    """The op `name` computed in `ctype` ("float", "double", or a type placeholder)."""
    return _CudaC(ctype).op(name, operands)


def _names(name: str) -> list[str]:
    return [f"x{i}" for i in range(optable.BY_NAME[name].arity)]


#: The ops CuPy's own ufuncs run (one IEEE operation each, so no formula whose bits could
#: differ), by CuPy's names
_UFUNCS = {"add": "add", "sub": "subtract", "mul": "multiply", "div": "divide"}


def _params(name: str, types: list[str]) -> str:
    """A kernel's input parameters x0, x1, ...: a BOOL operand's type bool, each float one's
    from `types` in order."""
    kinds = optable.BY_NAME[name].operand_kinds
    floats = iter(types)
    return ", ".join(f"{'bool' if kind == optable.BOOL else next(floats)} x{i}"
                     for i, kind in enumerate(kinds))


@functools.cache
def _kernels() -> dict[str, Any]:
    """The float32 and float64 kernels of the table's ops (their formulas: the expressions the
    half kernels and the chains compile too, so an eager op and a chain's link give the same
    bits) and cross_entropy's backward, compiled by CuPy on first use."""
    kernel = functools.partial(_cupy().ElementwiseKernel, options=_NO_FMA)
    made = {op.name: kernel(_params(op.name, ["T"] * op.arity), "T out",
                            f"out = {_formula(op.name, 'T', _names(op.name))}",
                            f"blockrt_{op.name}")
            for op in optable.OPS if op.name not in _UFUNCS and op.name != "copy"}
    made["cross_entropy_backward"] = kernel(
        "T p, L label, T g, L col", "T out", "out = (p - (T)(col == label)) * g",
        "blockrt_cross_entropy_backward")
    return made


@functools.cache
def _scatter_add_kernel() -> Any:
    """out[idx[k], i] += src[k, i] for k in order, thread i per column (C-order operands)."""
    return _cupy().ElementwiseKernel(
        "raw T src, raw int64 idx, int64 n, int64 cols", "raw T out",
        "for (long long k = 0; k < n; k++) { long long at = idx[k] * cols + i; "
        "out[at] = out[at] + src[k * cols + i]; }",
        "blockrt_scatter_add", options=_NO_FMA)


@functools.cache
def _half_kernel(name: str, numbers: tuple[bool, ...]) -> Any:
    """The elementwise kernel `name` for a float16 or bfloat16 output: operands (half or float32
    arrays, a bool condition; a number where `numbers` says so, typed float32, since a number
    cannot decide a type placeholder) loaded into float, the float32 formula, one rounding as
    it stores (Note [two-byte floats compute in float32] in backends/base.py)."""
    params, loads = [], []
    for i, (kind, number, letter) in enumerate(zip(optable.BY_NAME[name].operand_kinds, numbers,
                                                   "ABC")):
        if kind == optable.BOOL:
            params.append(f"bool x{i}")
        else:
            params.append(f"{'float32' if number else letter} x_{i}")
            loads.append(f"float x{i} = (float)x_{i};")
    return _cupy().ElementwiseKernel(", ".join(params), "H out",
                                     f"{' '.join(loads)} out = (H)"
                                     f"({_formula(name, 'float', _names(name))})",
                                     f"blockrt_half_{name}", options=_NO_FMA)


#: The type placeholder of each float dtype in a chain kernel's parameters (CuPy's placeholders
#: are one letter): arrays of one dtype share one, and a two-byte link rounds through its
#: dtype's placeholder type, as the half kernels' stores do
_LETTERS = {np.dtype("float16"): "H", _BF16: "B", _F32: "F", _F64: "D"}


@functools.cache
def _chain_kernel(program: tuple, inputs: tuple[str, ...], out: str) -> tuple[Any, list[str]]:
    """One kernel for a fused chain, and the names of its parameters in order. A float64 chain
    computes in double; a chain of float32, float16 and bfloat16 in float (Note [two-byte
    floats compute in float32] in backends/base.py): link i is `v<i> = <its formula>` in
    registers over its operands loaded into the compute type, and a two-byte link is then
    rounded to its dtype and back, as its own kernel's store rounds it; the last link is
    stored into `out`. Input k is `i<k>`, number k `n<k>` (float32, or float64 in a float64
    chain, as the half kernels and the ops pass numbers). Compiled without contraction, so
    each link gives its own kernel's bits. `program`: ((name, ((kind, ref), ...), letter),
    ...), numbers' refs being their positions; `inputs` and `out`: the `_LETTERS` of the
    inputs' and out's dtypes; every two-byte link's letter is one of the referenced inputs'
    or out's, so its type is defined."""
    ctype, number = ("double", "float64") if out == "D" else ("float", "float32")
    params: list[str] = []
    body = []
    for i, (name, args, letter) in enumerate(program):
        operands = []
        for kind, ref in args:
            operand = f"v{ref}" if kind == "link" else f"{kind[0]}{ref}"
            if kind != "link" and operand not in params:
                params.append(operand)
            if kind == "input":
                operand = f"(({ctype}){operand})"
            operands.append(operand)
        body.append(f"{ctype} v{i} = {_formula(name, ctype, operands)};")
        if letter in ("H", "B"):
            body.append(f"v{i} = ({ctype})({letter})v{i};")
    body.append(f"out = ({out})v{len(program) - 1};")
    types = [number if p[0] == "n" else inputs[int(p[1:])] for p in params]
    kernel = _cupy().ElementwiseKernel(", ".join(f"{t} {p}" for t, p in zip(types, params)),
                                       f"{out} out", " ".join(body), "blockrt_chain",
                                       options=_NO_FMA)
    return kernel, params


def _chain_call(program: Any, inputs: Any, out: Any) -> tuple[tuple, dict[str, Any]] | None:
    """How `CudaDevice._compile_fused` runs a fused program: the `_chain_kernel` arguments (the
    program's shape, the inputs' and out's `_LETTERS`) and the value of each kernel parameter
    by name (inputs, and numbers as float32 or float64 scalars); or None where the chain runs
    the blocked default: float64 mixed with another dtype, a link no formula covers, or a
    two-byte link whose dtype no array of the kernel names. Reads only the operands' dtypes
    (`.ci/cuda_compile.py` passes NumPy arrays)."""
    dtypes = {np.dtype(d) for _, _, d in program} | {x.dtype for x in inputs} | {out.dtype}
    if (not (dtypes == {_F64} or dtypes <= _LETTERS.keys() - {_F64})
            or any(name not in optable.BY_NAME for name, _, _ in program)):
        return None
    number = np.float64 if out.dtype == _F64 else np.float32
    values: dict[str, Any] = {}
    shape, numbers = [], 0
    for name, args, dtype in program:
        refs = []
        for kind, ref in args:
            if kind == "number":
                values[f"n{numbers}"] = number(ref)
                ref, numbers = numbers, numbers + 1
            elif kind == "input":
                values[f"i{ref}"] = inputs[ref]
            refs.append((kind, ref))
        shape.append((name, tuple(refs), _LETTERS[np.dtype(dtype)]))
    letters = tuple(_LETTERS[x.dtype] for x in inputs)
    defined = {letters[int(p[1:])] for p in values if p[0] == "i"} | {_LETTERS[out.dtype]}
    if any(letter in "HB" and letter not in defined for _, _, letter in shape):
        return None  # NOTE: a two-byte link with no type to name
    return (tuple(shape), letters, _LETTERS[out.dtype]), values


def _on_stream(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Run a hook with this device current and its stream as CuPy's current stream."""
    @functools.wraps(hook)
    def run(self: CudaDevice, *args: Any) -> Any:
        with self.cuda_device, self.stream:
            return hook(self, *args)
    return run


class CudaDevice(Device):
    """One CUDA GPU through CuPy, with one stream for all of its copies and kernels.

    Args:
        index: the CUDA device ordinal.
        stream: a framework's own `cupy.cuda.Stream` on device `index`, already checked by
            `locate_queue`; the device then runs on it (`backends.from_queue(stream)` is the way
            in). Default: a new blocking stream, ordered with CuPy's default stream (the
            module docstring).

    Attributes:
        index: the CUDA device ordinal.
        cuda_device: the `cupy.cuda.Device`.
        stream: the `cupy.cuda.Stream` every copy and kernel of this device runs on.
    """

    #: cudaMalloc returns 256-byte aligned memory
    alignment = 256
    capabilities = Capabilities(half_elementwise=True, compiles_fused=True, queues=True,
                                records_graphs=True, gemm_accumulates=True)

    def __init__(self, index: int = 0, stream: Any = None) -> None:
        cp = _cupy()
        self.index = index
        self.cuda_device = cp.cuda.Device(index)
        if stream is None:
            self.name = f"cuda:{index}"
            with self.cuda_device:
                # NOTE: blocking: ordered with the legacy null stream (the module docstring)
                stream = cp.cuda.Stream(non_blocking=False)
        else:
            self.name = f"cuda:{index}@stream:{stream.ptr:#x}"
        self.stream = stream
        #: this device's cuBLAS handles, one per thread (backends/_cublas.py)
        self._handles = _cublas.Handles()
        #: per thread: the `_Recording` being recorded (`_record`), else None
        self._recording = threading.local()

    @classmethod
    def device_count(cls) -> int:
        """GPUs CuPy can see; 0 when CuPy, the driver or a GPU is missing."""
        try:
            cp = _cupy()
            return int(cp.cuda.runtime.getDeviceCount())
        except Exception:  # no cupy, no driver, no device: all mean "none here"
            return 0

    @classmethod
    def locate_queue(cls, queue: Any) -> tuple[int, int]:
        """(device ordinal, the stream's handle) of a framework's `cupy.cuda.Stream` (or
        `ExternalStream`), for `backends.from_queue`. A CUDA stream always runs in order.

        Raises:
            BackendUnavailableError: CuPy is missing.
            TypeError: `queue` is not a CuPy stream.
            ValueError: the stream's device is not one CuPy can see.
        """
        cp = _cupy()
        if not isinstance(queue, (cp.cuda.Stream, cp.cuda.ExternalStream)):
            raise TypeError(f"expected a cupy.cuda.Stream, got {type(queue).__module__}."
                            f"{type(queue).__qualname__}")
        index = getattr(queue, "device_id", -1)
        if index < 0:  # CuPy's -1 (Stream.null, say): the current device's stream
            index = cp.cuda.Device().id
        count = cls.device_count()
        if not 0 <= index < count:
            raise ValueError(f"the stream's device cuda:{index} is not one of the {count} CUDA "
                             f"device(s) CuPy can see")
        return index, int(queue.ptr)

    @property
    def total_memory(self) -> int | None:
        with self.cuda_device:
            return int(_cupy().cuda.runtime.memGetInfo()[1])

    # NOTE: the queue hooks: Note [queue-ordered reuse] in backends/base.py
    def _synchronize(self) -> None:
        self.stream.synchronize()

    def _home_queue(self) -> Any:
        return self.stream

    def _queue_key(self, queue: Any) -> int:
        cp = _cupy()
        if not isinstance(queue, (cp.cuda.Stream, cp.cuda.ExternalStream)):
            raise TypeError(f"{self.name}: expected a cupy.cuda.Stream, got "
                            f"{type(queue).__name__}")
        device_id = getattr(queue, "device_id", self.index)  # -1: the current device
        if device_id not in (-1, self.index):
            raise ValueError(f"{self.name}: the stream {queue!r} belongs to cuda:{device_id}")
        return queue.ptr

    def _record_event(self, queue: Any) -> Any:
        with self.cuda_device:
            return queue.record(_cupy().cuda.Event(disable_timing=True))

    def _event_done(self, event: Any) -> bool:
        return event.done

    def _wait_event(self, event: Any) -> None:
        event.synchronize()

    def _join(self, waiter: Any, signaller: Any) -> None:
        with self.cuda_device:
            waiter.wait_event(signaller.record())

    # ----------------------------------------------------------------- memory
    def _raw_alloc(self, nbytes: int) -> Any:
        cp = _cupy()
        try:
            with self.cuda_device:
                memory = cp.cuda.Memory(nbytes)
            recording = getattr(self._recording, "now", None)
            if recording is not None:
                # NOTE: taken while a graph is recorded (a scratch array): the graph keeps it
                recording.kept.append(memory)
            return memory
        except OverflowError as exc:  # NOTE: CuPy takes a size_t: 2**64 bytes cannot be asked
            raise MemoryError(f"cudaMalloc of {nbytes} bytes is impossible on {self.name}: more "
                              f"than a size_t holds") from exc
        except cp.cuda.runtime.CUDARuntimeError as exc:
            if getattr(exc, "status", None) != _ERROR_MEMORY_ALLOCATION:
                raise
            raise MemoryError(f"cudaMalloc of {nbytes} bytes failed on {self.name}: {exc}") \
                from exc

    def _raw_free(self, raw: Any) -> None:
        pass  # cudaFree runs when the last reference to `raw` (views included) goes

    @_on_stream
    def _scratch(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        # NOTE: from CuPy's current allocator on the device's stream (its pool, or blockrt's
        # after use_with_cupy), not one cudaMalloc each: a kernel's temporaries (a half's
        # widened copy) come and go at every call, and the cudaFree of one waits for the whole
        # device. The pool hands the memory out again only behind the stream's queued work.
        # While a graph records, the recording's own allocator keeps it (`_record`).
        return _cupy().empty(shape, dtype)

    def _pointer(self, raw: Any, offset: int) -> Any:
        return _cupy().cuda.MemoryPointer(raw, offset)

    def _copyin(self, raw: Any, offset: int, host_bytes: np.ndarray) -> None:
        # NOTE: from pageable memory the copy returns once the source is staged: `host_bytes`
        # may go right after; the copy itself stays ordered on the stream.
        self._pointer(raw, offset).copy_from_host_async(host_bytes.ctypes.data, host_bytes.nbytes,
                                                        self.stream)

    def _copyout(self, raw: Any, offset: int, nbytes: int) -> np.ndarray:
        host = np.empty(nbytes, np.uint8)
        self._pointer(raw, offset).copy_to_host_async(host.ctypes.data, nbytes, self.stream)
        self.stream.synchronize()
        return host

    def _array_view(self, raw, offset, shape, dtype, strides) -> Any:
        cp = _cupy()
        if np.dtype(dtype) == _BF16 and not has_bfloat16():
            raise TypeError(f"{self.name}: CuPy {cp.__version__} has no bfloat16 (CuPy 14 or "
                            f"newer with ml_dtypes stores it); use float16 or float32 on CUDA")
        return cp.ndarray(shape, dtype, memptr=self._pointer(raw, offset), strides=strides)

    def _address(self, raw: Any) -> int:
        return int(raw.ptr)

    def _nbytes_of(self, raw: Any) -> int:
        return int(raw.size)

    # ----------------------------------------------------------------- kernels
    @_on_stream
    def _unary(self, name, x, out) -> None:
        if name == "copy":
            _cupy().copyto(out, x)
        else:
            _kernels()[name](x, out)

    @_on_stream
    def _binary(self, name, a, b, out) -> None:
        if name in _UFUNCS:
            getattr(_cupy(), _UFUNCS[name])(a, b, out=out)
        else:
            _kernels()[name](a, b, out)

    @_on_stream
    def _ternary(self, name, a, b, c, out) -> None:
        _kernels()[name](a, b, c, out)

    @_on_stream
    def _half_elementwise(self, name, operands, out) -> bool:
        # NOTE: one kernel, no widened copies: Note [two-byte floats compute in float32] in
        # backends/base.py
        if name == "copy":
            return False
        cp = _cupy()
        args = []
        for x, kind in zip(operands, optable.BY_NAME[name].operand_kinds):
            # NOTE: ops give them out's dtype; a float32 one is read as such
            if isinstance(x, cp.ndarray):
                if x.dtype not in ((np.dtype(np.bool_),) if kind == optable.BOOL
                                   else (out.dtype, _F32)):
                    return False
            elif isinstance(x, (int, float, np.floating, np.integer)) and kind == optable.FLOAT:
                x = np.float32(x)  # NOTE: a number meets the formula as float32
            else:
                return False
            args.append(x)
        numbers = tuple(isinstance(x, np.float32) for x in args)
        _half_kernel(name, numbers)(*args, out)
        return True

    def _compile_fused(self, program, inputs, out) -> Callable[[], None] | None:
        """A chain of float64, or of float32 and two-byte floats, as one kernel
        (`_chain_kernel`), so nothing but the inputs and `out` touches memory: the default's
        row blocks are 64 KiB, a launch each per link, far too small for a GPU. Other chains
        (float64 mixed with another dtype, a link no formula covers) run the default (None)."""
        call = _chain_call(program, inputs, out)
        if call is None:
            return None
        key, values = call
        kernel, params = _chain_kernel(*key)
        return functools.partial(self._launch, kernel, *(values[p] for p in params), out)

    @_on_stream
    def _launch(self, kernel, *args) -> None:
        kernel(*args)

    @_on_stream
    def _cast(self, x, out) -> None:
        # NOTE: runtime.ops.cast allowed only exact or IEEE conversions; float64 goes to
        # bfloat16 through float32, as ml_dtypes does (one rounding each)
        if out.dtype == _BF16 and x.dtype == _F64:
            x = x.astype(_F32)
        out[...] = x

    def matmul(self, a, b, out) -> None:
        """A two-byte product runs as one cuBLAS GemmEx: half operands, float32 accumulation
        (CUBLAS_COMPUTE_32F, CuPy's default for them, on tensor cores where the GPU has them)
        and one rounding as it stores. That is the rule of HALVES in substance (each product
        of two halves is exact in float32, the sums are float32's, one rounding), but the
        accumulation order is cuBLAS's own, so the bits may differ in the last place from the
        widened float32 product that other dtypes' pairs take. bfloat16 takes it only on a GPU
        of compute capability 8.0 or more (cuBLAS has no bfloat16 GEMM before Ampere); older
        ones, and float16 before 5.3, widen."""
        self._check_computes("matmul", (a, b), out)  # NOTE: the GemmEx path skips base's
        if (out.dtype in HALVES and a.dtype == b.dtype == out.dtype
                and self._half_gemm[out.dtype]):
            self._matmul(a, b, out)
            return
        super().matmul(a, b, out)

    @functools.cached_property
    def _half_gemm(self) -> dict[np.dtype, bool]:
        """Whether cuBLAS multiplies each two-byte dtype on this GPU (`matmul`)."""
        capability = int(self.cuda_device.compute_capability)
        return {np.dtype("float16"): capability >= 53, _BF16: capability >= 80}

    def gemm(self, a, b, out, alpha: float = 1.0, beta: float = 0.0) -> None:
        if alpha == 1.0 and beta == 0.0:
            self.matmul(a, b, out)  # NOTE: the half products' one GemmEx, above
            return
        super().gemm(a, b, out, alpha, beta)

    def _matmul(self, a, b, out) -> None:
        self._prepared_matmul(a, b, out)()

    def _product_in_float32(self, a, b, out) -> None:
        """One GemmEx, half operands into a float32 output on tensor cores, where cuBLAS
        multiplies the dtype here and takes the layout; else the widened product."""
        call = self._cublas_call(a, b, out) if self._half_gemm[a.dtype] else None
        if call is None:
            super()._product_in_float32(a, b, out)
        else:
            call()

    def _prepared_matmul(self, a, b, out) -> Callable[[], None]:
        """One cuBLAS call of blockrt's own (the same call eagerly and in a recorded graph);
        layouts it does not run go to CuPy's matmul, which a graph cannot record."""
        call = self._cublas_call(a, b, out)
        return functools.partial(self._cupy_matmul, a, b, out) if call is None else call

    def _gemm(self, a, b, out, alpha: float, beta: float) -> None:
        self._prepared_gemm(a, b, out, alpha, beta)()

    def _prepared_gemm(self, a, b, out, alpha: float, beta: float) -> Callable[[], None]:
        """out = alpha * (a @ b) + beta * out as one cuBLAS call (`gemm_accumulates`: a graph
        folds an SGD update into its product, Note [a folded update's rounding]); layouts
        cuBLAS does not take go to the base's product in scratch and a fused pass."""
        call = self._cublas_call(a, b, out, alpha, beta)
        return functools.partial(super()._gemm, a, b, out, alpha, beta) if call is None else call

    def _cublas_call(self, a, b, out, alpha: float = 1.0,
                     beta: float = 0.0) -> Callable[[], None] | None:
        """out = alpha * (a @ b) + beta * out as one call on this thread's handle
        (backends/_cublas.py), made on this device, or None where `_cublas.prepare` does not
        take the dtypes or layout."""
        try:
            call = _cublas.prepare(self._handles, self._new_handle, a, b, out, alpha, beta)
        except _cublas.Unsupported:
            return None
        device = self.cuda_device

        def run() -> None:
            with device:
                call()
        return run

    def _new_handle(self) -> _cublas.Handle:
        with self.cuda_device:
            return _cublas.Handle(self.stream.ptr,
                                  _cupy().cuda.Memory(_cublas.WORKSPACE_BYTES))

    @_on_stream
    def _cupy_matmul(self, a, b, out) -> None:
        _cupy().matmul(a, b, out=out)

    @_on_stream
    def _reduce(self, name, x, axis, keepdims, out) -> None:
        cp = _cupy()
        cp.sum(x, axis=axis, dtype=out.dtype, out=out, keepdims=keepdims)
        if name == "mean":
            # NOTE: the sum divided by the count, as the NumPy device divides (not cupy.mean,
            # whatever it does over no element): 0 / 0 is NaN, with no warning (Note [IEEE
            # results, no floating-point signals] in backends/base.py)
            count = x.size if axis is None else math.prod(x.shape[i] for i in axis)
            cp.true_divide(out, count, out=out)

    @_on_stream
    def _moments(self, x, mean, m2) -> None:
        # NOTE: CuPy broadcasts the mean itself; its temporaries come from CuPy's current
        # allocator, as cross_entropy's do (untested here: no GPU was at hand)
        cp = _cupy()
        self._reduce("mean", x, (0, 2), True, mean)
        centred = x - mean
        cp.sum(centred * centred, axis=(0, 2), dtype=m2.dtype, out=m2, keepdims=True)

    @_on_stream
    def _reduce_max(self, x, axis, keepdims, out) -> None:
        _cupy().max(x, axis=axis, out=out, keepdims=keepdims)  # NOTE: NaN propagates, as here

    @_on_stream
    def _cross_entropy(self, logits, labels, losses, probs) -> None:
        cp = _cupy()
        classes = logits.shape[1]
        recording = getattr(self._recording, "now", None)
        if recording is None:
            _check_labels(labels, classes)
        else:
            # NOTE: a host read cannot be recorded: the graph's launch checks first
            recording.checks.append(HostCheck(_layout(labels), labels,
                                              functools.partial(_check_labels, classes=classes)))
        # NOTE: the small temporaries below come from CuPy's current allocator (its pool, or
        # blockrt after use_with_cupy); the outputs are blockrt memory.
        cp.subtract(logits, cp.max(logits, axis=1, keepdims=True), out=probs)
        picked = probs[cp.arange(logits.shape[0]), labels]  # label logit minus the row maximum
        cp.exp(probs, out=probs)
        total = cp.sum(probs, axis=1)
        cp.divide(probs, total[:, None], out=probs)
        cp.subtract(cp.log(total), picked, out=losses)

    @_on_stream
    def _cross_entropy_backward(self, probs, labels, grad, out) -> None:
        columns = _cupy().arange(probs.shape[1], dtype=labels.dtype)
        _kernels()["cross_entropy_backward"](probs, labels[:, None], grad[:, None],
                                             columns[None, :], out)

    @_on_stream
    def _gather(self, table, indices, out) -> None:
        out[...] = table[indices]  # NOTE: `gather` checked the indices; moves bits

    @_on_stream
    def _scatter_add(self, src, indices, out) -> None:
        # NOTE: one thread per column adds the rows in index order (never atomics, whose
        # order varies): np.add.at's additions, so the CPU's bits. The kernel reads C-order
        # operands: strided ones go through contiguous copies
        cp = _cupy()
        work = out if out.flags.c_contiguous else cp.ascontiguousarray(out)
        _scatter_add_kernel()(cp.ascontiguousarray(src, dtype=out.dtype),
                              cp.ascontiguousarray(indices, dtype=np.int64),
                              src.shape[0], src.shape[1], work, size=src.shape[1])
        if work is not out:
            out[...] = work

    @_on_stream
    def _to_host(self, view: Any) -> np.ndarray:
        return view.get(stream=self.stream)  # blocking: waits for the stream

    def _record(self, run: Callable[[], None]) -> _Recording:
        """Record `run()` by CUDA stream capture on the device's stream (relaxed mode), CuPy's
        allocations meanwhile from a memory pool of the recording's own (PyTorch's private
        graph pool): a kernel's temporaries then have the same addresses at every launch, and
        nobody else is handed them. A temporary freed while the step records is handed to a
        later one of the same step, which the stream runs after it, so the pool holds the most
        the step's temporaries take at once, not their sum."""
        cp = _cupy()
        recording = _Recording(self)
        with self.cuda_device:
            recording.pool = cp.cuda.MemoryPool()
        failure: BaseException | None = None
        self._recording.now = recording
        try:
            with self.cuda_device, self.stream, cp.cuda.using_allocator(recording.pool.malloc):
                self.stream.begin_capture()
                try:
                    run()
                except Exception as exc:  # NOTE: reported below, once the capture has ended
                    failure = exc
                try:
                    graph = self.stream.end_capture()
                except Exception as exc:  # NOTE: an invalidated capture ends with an error
                    failure = failure or exc
        finally:
            self._recording.now = None
        if failure is not None:
            raise RecordError(f"{self.name}: the work could not be recorded as a CUDA graph: "
                              f"{type(failure).__name__}: {failure}") from failure
        recording.graph = graph
        return recording


def _check_labels(labels: Any, classes: int) -> None:
    """Raise ValueError where a label is outside [0, classes): a host read, so before the
    first write (Note [checked before written] in backends/base.py)."""
    bad = labels[(labels < 0) | (labels >= classes)]
    if bad.size:
        raise ValueError(f"cross_entropy: label {int(bad[0])} is outside [0, {classes}) for "
                         f"{classes} classes")


def _layout(view: Any) -> tuple[int, tuple, tuple, int]:
    """A CuPy view as a layout of runtime/aliasing.py at its device address."""
    return int(view.data.ptr), view.shape, view.strides, view.itemsize


class _Recording:
    """A recorded CUDA graph (`CudaDevice.record`): `launch()` queues it on the device's
    stream."""

    def __init__(self, device: CudaDevice) -> None:
        self.device = device
        self.graph: Any = None
        #: memory taken while recording, which the graph's kernels use at every launch: raw
        #: allocations, and CuPy's (its temporaries) from this pool
        self.kept: list[Any] = []
        self.pool: Any = None
        #: host checks the recorded ops moved out of the graph, for the caller to run before
        #: each launch (`Device.record`)
        self.checks: list[HostCheck] = []

    @property
    def held_bytes(self) -> int:
        """Device memory the recording holds for its kernels (what they allocated while it
        recorded): the graph's own nodes not counted."""
        pooled = int(self.pool.total_bytes()) if self.pool is not None else 0
        return pooled + sum(int(memory.size) for memory in self.kept)

    def launch(self) -> None:
        device = self.device
        with device.cuda_device:
            self.graph.launch(device.stream)


# ---------------------------------------------------------------------- embedding in CuPy
class _Lease:
    """Owns one blockrt allocation lent to CuPy; CuPy's memory object keeps it alive."""

    __slots__ = ("allocation", "__weakref__")

    def __init__(self, allocation: Any) -> None:
        self.allocation = allocation


def _give_back(allocator: Any, allocation: Any, device: CudaDevice, stream: Any) -> None:
    # NOTE: CuPy may have used the memory on `stream`; the device's own stream, where blockrt
    # reuses it, waits for that work before anything queued after this point runs
    # (Note [queue-ordered reuse] in backends/base.py).
    if stream is not None and stream.ptr != device.stream.ptr:
        device.join(device.stream, stream)
    allocator.free(allocation)


def use_with_cupy(allocator: Any) -> Callable[[int], Any]:
    """Make `allocator` (on a CUDA device) CuPy's allocator for the whole process.

    Every CuPy allocation then comes from `allocator.allocate(nbytes)`: CuPy gets a
    `MemoryPointer` over `UnownedMemory` whose owner holds the blockrt Allocation, and when CuPy
    drops the memory the Allocation goes back with `allocator.free`. Any object shaped like an
    allocator works (`allocate(nbytes) -> allocation` with `.ptr`, and `free(allocation)`).

    Memory allocated while CuPy's current stream is not the device's stream is ordered after
    the device's stream first, and recorded as used on CuPy's stream (`Allocator.record_queue`),
    so the device's stream waits for it when the memory comes back: reuse across streams is
    safe (Note [queue-ordered reuse] in backends/base.py).

    Returns the malloc function that was installed (it also works with
    `cupy.cuda.using_allocator`). CuPy's own pool comes back with
    `cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)`.

    Raises:
        BackendUnavailableError: CuPy is missing.
        ValueError: the allocator is not on a CUDA device.

    Example:
        >>> import allocators, backends                       # doctest: +SKIP
        >>> alloc = allocators.create("caching", "cuda")      # doctest: +SKIP
        >>> backends.cuda.use_with_cupy(alloc)                # doctest: +SKIP
    """
    cp = _cupy()
    device = allocator.device
    if not isinstance(device, CudaDevice):
        raise ValueError(f"use_with_cupy needs an allocator on a CUDA device, not on "
                         f"{device.name}")

    def malloc(nbytes: int) -> Any:
        if cp.cuda.Device().id != device.index:
            raise ValueError(f"CuPy asked for memory on cuda:{cp.cuda.Device().id}, but the "
                             f"blockrt allocator lends memory of {device.name}")
        stream = cp.cuda.get_current_stream()
        foreign = stream.ptr != device.stream.ptr
        if foreign:
            # NOTE: earlier users of the memory come first: Note [queue-ordered reuse] in
            # backends/base.py
            device.join(stream, device.stream)
        allocation = allocator.allocate(nbytes)
        lease = _Lease(allocation)
        record = getattr(allocator, "record_queue", None)
        if foreign and record is not None:  # NOTE: a blockrt Allocator joins when it frees
            try:
                record(allocation, stream)
            except BaseException:
                allocator.free(allocation)
                raise
            weakref.finalize(lease, allocator.free, allocation)
        else:
            weakref.finalize(lease, _give_back, allocator, allocation, device, stream)
        memory = cp.cuda.UnownedMemory(allocation.ptr, nbytes, lease, device_id=device.index)
        return cp.cuda.MemoryPointer(memory, 0)

    cp.cuda.set_allocator(malloc)
    return malloc


def use_with_torch(allocator: Any) -> Any:
    """Make `allocator` (on a CUDA device) PyTorch's CUDA allocator for the whole process,
    through `torch.cuda.memory.CUDAPluggableAllocator` and blockrt's compiled entry points
    (backends/_torchbridge.py): every CUDA tensor PyTorch makes from then on is blockrt memory,
    counted by the allocator (`blockrt.memory_summary()` shows it), and given back when
    PyTorch frees it. Memory PyTorch takes on another stream than the device's is ordered after
    the device's stream and recorded as used on PyTorch's, as `use_with_cupy` does.

    Call it before PyTorch's first CUDA allocation: PyTorch swaps its allocator only then.
    Returns the bridge (`errors` holds what a malloc or free raised: PyTorch itself hears an
    out-of-memory error; `lent_bytes`).

    Raises:
        BackendUnavailableError: PyTorch without CUDA, or blockrt's entry points not built.
        ValueError: the allocator is not on a CUDA device.
        RuntimeError: PyTorch's allocator is already in use (PyTorch's own message).
    """
    device = allocator.device
    if not isinstance(device, CudaDevice):
        raise ValueError(f"use_with_torch needs an allocator on a CUDA device, not on "
                         f"{device.name}")
    cp = _cupy()
    try:
        import torch
    except ImportError as exc:
        raise BackendUnavailableError(f"use_with_torch needs PyTorch ({exc})") from exc
    if not torch.cuda.is_available():
        raise BackendUnavailableError(f"use_with_torch: this PyTorch ({torch.__version__}) "
                                      f"has no CUDA device")
    bridge = _torchbridge.Bridge(
        allocator, lambda stream: cp.cuda.ExternalStream(stream, device.index))
    pluggable = torch.cuda.memory.CUDAPluggableAllocator(
        bridge.path, _torchbridge.MALLOC_NAME, _torchbridge.FREE_NAME)
    torch.cuda.memory.change_current_allocator(pluggable)
    bridge.install()
    bridge.torch_allocator = pluggable  # NOTE: PyTorch keeps the library loaded through it
    return bridge
