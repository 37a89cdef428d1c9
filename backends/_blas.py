"""The CBLAS `?gemm` of the BLAS that NumPy itself loaded, called through ctypes.

NumPy's `matmul` computes `a @ b` only. BLAS computes `alpha * a @ b + beta * c` into `c` in the
same time, which lets the graph fold an update such as `w -= lr * (x.T @ g)` into the product:
no gradient buffer and no extra pass over it. No new dependency: the library is the one NumPy
already uses (so the same threads), found among the shared objects this process has loaded.

Only OpenBLAS builds are recognised (NumPy's wheels carry one, named `scipy_openblas64_`, with
64-bit integers); the integer width comes from the library's own configuration string. A found
library must then pass a self-test against NumPy, with every transposition, before it is used.
Anywhere else (Accelerate, MKL, a stripped build) `find()` returns None and callers fall back
to `matmul` plus elementwise kernels.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
from typing import Any

import numpy as np

__all__ = ["Gemm", "find"]

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
#: (symbol prefix, symbol suffix) of OpenBLAS builds: NumPy's wheels, then plain ones.
_NAMINGS = (("scipy_", "64_"), ("", "64_"), ("", ""))


class Gemm:
    """`c = alpha * a @ b + beta * c` for float32 and float64 2-D arrays, through CBLAS.

    Calling it does the product and returns True, or returns False without touching anything
    when CBLAS cannot read the layouts (`supports`): each operand must be row-major or the
    transpose of a row-major matrix, element-aligned, `c` row-major and not empty.
    """

    def __init__(self, library: ctypes.CDLL, prefix: str, suffix: str, integer: type) -> None:
        self.path = library._name
        self._functions = {}
        for dtype, letter, real in ((np.float32, "s", ctypes.c_float),
                                    (np.float64, "d", ctypes.c_double)):
            function = getattr(library, f"{prefix}cblas_{letter}gemm{suffix}")
            function.restype = None
            function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, integer, integer,
                                 integer, real, ctypes.c_void_p, integer, ctypes.c_void_p,
                                 integer, real, ctypes.c_void_p, integer]
            self._functions[np.dtype(dtype)] = function

    @staticmethod
    def _layout(x: np.ndarray) -> tuple[int, int] | None:
        """(transpose flag, leading dimension) of a 2-D view, or None if CBLAS cannot read it."""
        item = x.itemsize
        s0, s1 = x.strides
        rows, cols = x.shape
        if (s1 == item or cols == 1) and s0 % item == 0 and s0 // item >= max(cols, 1):
            return _NO_TRANS, max(s0 // item, cols, 1)
        if (s0 == item or rows == 1) and s1 % item == 0 and s1 // item >= max(rows, 1):
            return _TRANS, max(s1 // item, rows, 1)
        return None

    def _layouts(self, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> tuple | None:
        if not (a.dtype == b.dtype == c.dtype and c.dtype in self._functions
                and a.ndim == b.ndim == c.ndim == 2 and c.size > 0 and a.shape[1] > 0):
            return None
        out, left, right = self._layout(c), self._layout(a), self._layout(b)
        if out is None or out[0] != _NO_TRANS or left is None or right is None:
            return None
        return left, right, out[1]

    def supports(self, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> bool:
        return self._layouts(a, b, c) is not None

    def __call__(self, a: np.ndarray, b: np.ndarray, c: np.ndarray, alpha: float,
                 beta: float) -> bool:
        layouts = self._layouts(a, b, c)
        if layouts is None:
            return False
        (trans_a, lda), (trans_b, ldb), ldc = layouts
        self._functions[c.dtype](_ROW_MAJOR, trans_a, trans_b, c.shape[0], c.shape[1],
                                 a.shape[1], alpha, a.ctypes.data, lda, b.ctypes.data, ldb,
                                 beta, c.ctypes.data, ldc)
        return True


def _candidates() -> list[str]:
    """Paths of loaded (or NumPy-bundled) shared objects whose names say OpenBLAS."""
    found: list[str] = []
    try:
        with open("/proc/self/maps") as maps:  # Linux: what this process has loaded
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if "openblas" in os.path.basename(path).lower() and path not in found:
                    found.append(path)
    except OSError:
        pass
    here = os.path.dirname(np.__file__)
    for pattern in (here + ".libs/*openblas*", os.path.join(here, ".dylibs", "*openblas*")):
        found.extend(p for p in sorted(glob.glob(pattern)) if p not in found)
    return found


def _open(path: str) -> Gemm | None:
    try:
        library = ctypes.CDLL(path)
    except OSError:
        return None
    for prefix, suffix in _NAMINGS:
        config = getattr(library, f"{prefix}openblas_get_config{suffix}", None)
        if config is None or not hasattr(library, f"{prefix}cblas_sgemm{suffix}"):
            continue
        config.restype = ctypes.c_char_p
        wide = b"USE64BITINT" in (config() or b"")
        gemm = Gemm(library, prefix, suffix, ctypes.c_int64 if wide else ctypes.c_int32)
        return gemm if _passes(gemm) else None
    return None


def _passes(gemm: Gemm) -> bool:
    """The library agrees with NumPy on small products, every transposition, both dtypes."""
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        a = rng.integers(-4, 5, (3, 5)).astype(dtype)
        b = rng.integers(-4, 5, (5, 4)).astype(dtype)
        for left in (a, np.ascontiguousarray(a.T).T):
            for right in (b, np.ascontiguousarray(b.T).T):
                c = rng.integers(-4, 5, (3, 4)).astype(dtype)
                want = 0.5 * (a @ b) + 2.0 * c
                if not gemm(left, right, c, 0.5, 2.0) or not np.array_equal(c, want):
                    return False
    return True


_found: list[Any] = []
_lock = threading.Lock()


def find() -> Gemm | None:
    """NumPy's BLAS as a `Gemm`, or None where it cannot be found or fails the self-test.
    Looked up once per process."""
    if _found:
        return _found[0]
    with _lock:
        if not _found:
            np.ones((2, 2)) @ np.ones((2, 2))  # NOTE: makes sure NumPy's BLAS is loaded
            gemm = None
            for path in _candidates():
                gemm = _open(path)
                if gemm is not None:
                    break
            _found.append(gemm)
        return _found[0]
