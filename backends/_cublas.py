"""Matrix products on CUDA through cuBLAS itself (ctypes), on a handle of blockrt's own.

Why not CuPy's `matmul`: CuPy refuses any cuBLAS call while a stream captures a CUDA graph
(its `cublas.setStream` raises NotImplementedError), so a static plan whose step has a product
could never be recorded. cuBLAS itself supports capture (cuBLAS's "CUDA Graphs Support": with
host pointer mode the alpha and beta values are baked in, and a workspace the caller owns keeps
cuBLAS from allocating memory inside the graph). So every product of the CUDA device, eager or
recorded, is one `cublasGemmEx` (or `cublasGemmStridedBatchedEx`) call here, on one handle per
thread and device whose stream is the device's and whose workspace is set once: a recorded
product is the very call eager execution makes, with the same handle, workspace and algorithm
choice, so a replayed graph gives eager's bits.

Row-major products on a column-major library: out (m, n) = a (m, k) @ b (k, n) in row-major
order is, read column-major, out^T (n, m) = b^T (n, k) @ a^T (k, m); so cuBLAS multiplies b by a,
each as stored (transa N) where its rows are contiguous, or transposed (T) where its columns are
(a transposed view such as `x.T` in backward). Other layouts (neither axis of unit stride, a
batch whose matrices are not evenly spaced) are `Unsupported`: the device then runs CuPy's
matmul eagerly, and a graph that needs one is not recorded (it says so).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

#: cudaDataType_t of each dtype
_DATA = {np.dtype("float32"): 0, np.dtype("float64"): 1, np.dtype("float16"): 2,
         np.dtype(ml_dtypes.bfloat16): 14}
#: the two-byte floats whose products cuBLAS may also store in float32, unrounded (A and B
#: of the dtype, C float32, float32 compute: a combination cublasGemmEx lists)
HALF_INTO_FLOAT32 = (np.dtype("float16"), np.dtype(ml_dtypes.bfloat16))
_OP_N, _OP_T = 0, 1
_COMPUTE_32F, _COMPUTE_64F, _COMPUTE_32F_FAST_TF32 = 68, 70, 77
_GEMM_DEFAULT = -1
#: Bytes of the workspace each handle owns (PyTorch's default on Hopper, 32 MiB; cuBLAS asks
#: for at most this much for the products it runs)
WORKSPACE_BYTES = 32 << 20

#: "highest": float32 products in float32 (the default, eager's and NumPy's contract); "high":
#: float32 products on TF32 tensor cores (10 bits of mantissa in the multiplications, float32
#: accumulation), PyTorch's `torch.set_float32_matmul_precision("high")`
PRECISIONS = ("highest", "high")
_precision = ["highest"]


class Unsupported(Exception):
    """A product whose layout `prepare` does not run; the message says why."""


class CublasError(RuntimeError):
    """A cuBLAS call returned a status other than CUBLAS_STATUS_SUCCESS."""


_STATUS = {1: "NOT_INITIALIZED", 3: "ALLOC_FAILED", 7: "INVALID_VALUE", 8: "ARCH_MISMATCH",
           11: "MAPPING_ERROR", 13: "EXECUTION_FAILED", 14: "INTERNAL_ERROR",
           15: "NOT_SUPPORTED", 16: "LICENSE_ERROR"}


def set_float32_matmul_precision(precision: str) -> None:
    """How CUDA float32 products compute from now on: "highest" (float32, the default) or
    "high" (TF32 tensor cores; results differ from float32's in about the fourth digit).

    Raises:
        ValueError: another precision.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"float32 matmul precision must be one of {PRECISIONS}, not "
                         f"{precision!r}")
    _precision[0] = precision


def get_float32_matmul_precision() -> str:
    """The precision `set_float32_matmul_precision` set ("highest" by default)."""
    return _precision[0]


_library: list[Any] = []


def _cublas() -> Any:
    """libcublas, the copy CuPy loaded (found in the process's mappings once CuPy has made its
    own handle), with the prototypes used here."""
    if _library:
        return _library[0]
    import cupy

    cupy.cuda.device.get_cublas_handle()  # NOTE: makes CuPy load libcublas
    path = None
    with open("/proc/self/maps") as maps:
        for line in maps:
            name = line.rsplit(None, 1)[-1]
            if "/libcublas.so" in name:
                path = name
                break
    if path is None:
        raise CublasError("libcublas is not mapped in this process although CuPy made a "
                          "cuBLAS handle; blockrt calls cuBLAS through the library CuPy loads")
    lib = ctypes.CDLL(path)
    p, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    lib.cublasCreate_v2.argtypes = [ctypes.POINTER(p)]
    lib.cublasDestroy_v2.argtypes = [p]
    lib.cublasSetStream_v2.argtypes = [p, p]
    lib.cublasSetWorkspace_v2.argtypes = [p, p, ctypes.c_size_t]
    lib.cublasGemmEx.argtypes = [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i]
    lib.cublasGemmStridedBatchedEx.argtypes = [p, i, i, i, i, i, p, p, i, i, ll, p, i, i, ll,
                                               p, p, i, i, ll, i, i, i]
    for name in ("cublasCreate_v2", "cublasDestroy_v2", "cublasSetStream_v2",
                 "cublasSetWorkspace_v2", "cublasGemmEx", "cublasGemmStridedBatchedEx"):
        getattr(lib, name).restype = i
    _library.append(lib)
    return lib


def _check(status: int, call: str) -> None:
    if status:
        raise CublasError(f"{call} failed: CUBLAS_STATUS_{_STATUS.get(status, status)}")


class Handle:
    """One cuBLAS handle on one stream, with its own workspace (kept alive here)."""

    def __init__(self, stream_ptr: int, workspace: Any) -> None:
        lib = _cublas()
        handle = ctypes.c_void_p()
        _check(lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
        self.ptr, self.workspace = handle, workspace
        # NOTE: cublasSetStream puts the default workspace back: the stream first
        _check(lib.cublasSetStream_v2(handle, ctypes.c_void_p(stream_ptr)), "cublasSetStream")
        _check(lib.cublasSetWorkspace_v2(handle, ctypes.c_void_p(int(workspace.ptr)),
                                         workspace.size), "cublasSetWorkspace")

    def __del__(self) -> None:
        if _library and self.ptr:
            _library[0].cublasDestroy_v2(self.ptr)


class Handles(threading.local):
    """A device's handles, one per thread (cuBLAS wants a handle used by one thread at a
    time), made at a thread's first product."""

    handle: Handle | None = None


def _matrix(rows: int, cols: int, strides: tuple[int, int]) -> tuple[int, int]:
    """(op, leading dimension) of a row-major (rows, cols) matrix with these element strides,
    as cuBLAS reads its column-major transpose: N where rows are contiguous, T where columns
    are; a size-1 axis takes any stride."""
    row, col = strides
    if cols == 1 or col == 1:
        if rows == 1 or row >= max(cols, 1):
            return _OP_N, max(row if rows > 1 else cols, 1)
    if rows == 1 or row == 1:
        if cols == 1 or col >= max(rows, 1):
            return _OP_T, max(col if cols > 1 else rows, 1)
    raise Unsupported(f"a matrix of shape ({rows}, {cols}) with element strides {strides}: "
                      f"neither its rows nor its columns are contiguous")


def _batch(x: Any, count: int) -> int:
    """The element stride between the matrices of a 3-D operand (0 where it is 2-D)."""
    if x.ndim == 2:
        return 0
    if x.shape[0] != count:
        raise Unsupported(f"a batch of {x.shape[0]} against {count}")
    return x.strides[0] // x.dtype.itemsize if count > 1 else 0


def prepare(handles: Handles, make: Callable[[], Handle], a: Any, b: Any, out: Any,
            alpha: float = 1.0, beta: float = 0.0) -> Callable[[], None]:
    """out = alpha * (a @ b) + beta * out as one cuBLAS call, its arguments made now: a
    function that makes the call (beta 0: out is not read). a, b, out: CuPy arrays of one
    dtype of `_DATA`, or a and b of one two-byte float dtype and out float32 (the product
    accumulated in float32 and stored unrounded: `HALF_INTO_FLOAT32`); 2-D, or 3-D out with a
    and b 3-D of the same batch or 2-D (broadcast). Raises Unsupported for other layouts and
    dtypes."""
    dtype = out.dtype
    wide = dtype == np.float32 and a.dtype in HALF_INTO_FLOAT32
    if dtype not in _DATA or a.dtype != b.dtype or not (a.dtype == dtype or wide):
        raise Unsupported(f"a product of {a.dtype} and {b.dtype} into {dtype}")
    if out.ndim not in (2, 3) or a.ndim not in (2, out.ndim) or b.ndim not in (2, out.ndim):
        raise Unsupported(f"a product of {a.ndim}-D and {b.ndim}-D operands into {out.ndim}-D")
    m, n = out.shape[-2:]
    k = a.shape[-1]
    if 0 in out.shape:
        return lambda: None
    if k == 0:
        raise Unsupported("a product over an axis of length 0")
    count = out.shape[0] if out.ndim == 3 else 1
    size, operand_size = dtype.itemsize, a.dtype.itemsize
    element = tuple(s // size for s in out.strides[-2:])
    if (any(s % operand_size for s in (*a.strides, *b.strides))
            or any(s % size for s in out.strides)):
        raise Unsupported("strides that are not whole elements")
    if not (element[1] == 1 or n == 1) or (m > 1 and element[0] < max(n, 1)):
        raise Unsupported(f"an output of shape {out.shape} with element strides "
                          f"{element}: its rows must be contiguous")
    ldc = max(element[0] if m > 1 else n, 1)
    # NOTE: cuBLAS computes out^T = b^T @ a^T: b is its first operand
    op_b, ldb = _matrix(k, n, tuple(s // operand_size for s in b.strides[-2:]))
    op_a, lda = _matrix(m, k, tuple(s // operand_size for s in a.strides[-2:]))
    stride_b, stride_a = _batch(b, count), _batch(a, count)
    stride_c = out.strides[0] // size if out.ndim == 3 and count > 1 else 0
    if dtype == np.float64:
        compute, scalar = _COMPUTE_64F, ctypes.c_double
    else:
        compute, scalar = _COMPUTE_32F, ctypes.c_float
        if a.dtype == np.float32 and _precision[0] == "high":
            compute = _COMPUTE_32F_FAST_TF32
    scalars = (scalar(alpha), scalar(beta))  # NOTE: host scalars, read at each call
    alpha_ref, beta_ref = (ctypes.byref(x) for x in scalars)
    kind, out_kind = _DATA[a.dtype], _DATA[dtype]
    lib = _cublas()
    pa, pb, pc = (ctypes.c_void_p(int(x.data.ptr)) for x in (a, b, out))
    if count == 1:
        args = (op_b, op_a, n, m, k, alpha_ref, pb, kind, ldb, pa, kind, lda,
                beta_ref, pc, out_kind, ldc, compute, _GEMM_DEFAULT)
        call, name = lib.cublasGemmEx, "cublasGemmEx"
    else:
        args = (op_b, op_a, n, m, k, alpha_ref, pb, kind, ldb, stride_b, pa, kind, lda,
                stride_a, beta_ref, pc, out_kind, ldc, stride_c, count, compute,
                _GEMM_DEFAULT)
        call, name = lib.cublasGemmStridedBatchedEx, "cublasGemmStridedBatchedEx"
    keep = (a, b, out, *scalars)  # NOTE: the arrays and scalars live as long as the call

    def run() -> None:
        handle = handles.handle
        if handle is None:
            handle = handles.handle = make()
        _check(call(handle.ptr, *args), name)

    run.keep = keep  # type: ignore[attr-defined]
    return run
