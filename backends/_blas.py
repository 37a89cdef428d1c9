"""CBLAS `?gemm` for the CPU device, called through ctypes: MKL where it is installed, else the
OpenBLAS that NumPy itself loaded.

NumPy's `matmul` computes `a @ b` only. BLAS computes `alpha * a @ b + beta * c` into `c` in the
same time, which lets the graph fold an update such as `w -= lr * (x.T @ g)` into the product:
no gradient buffer and no extra pass over it. On MKL the CPU device sends its 2-D products here
too, so one library (one pool of threads) does all of a step's products; on NumPy's OpenBLAS
they stay with `np.matmul`, the same library, which calls it a little faster for small shapes.

Two vendors are recognised. MKL (`pip install blockrt[mkl]` brings Intel's `mkl` wheel; a NumPy
built on MKL has it loaded already) through its 64-bit-integer `cblas_?gemm_64` entry points;
it is the faster of the two on the AVX-512 Xeons these benchmarks run on (BENCHMARKS.md), and the
one PyTorch's CPU build uses. OpenBLAS: NumPy's wheels carry one, named `scipy_openblas64_`; the
integer width comes from the library's own configuration string. No dependency is needed for it.
BLOCKRT_BLAS picks (`CHOICES`): "auto" (the default: MKL, else OpenBLAS), "mkl", "openblas" or
"none". A found library must pass a self-test against NumPy, with every transposition, before it
is used. Where none is found (Accelerate, a stripped build, "none") `find()` returns None and
callers fall back to `matmul` plus elementwise kernels.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading
from typing import Any

import numpy as np

__all__ = ["CHOICES", "ENV", "Gemm", "choice", "find", "load"]

ENV = "BLOCKRT_BLAS"

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
#: (symbol prefix, symbol suffix) of OpenBLAS builds: NumPy's wheels, then plain ones.
_NAMINGS = (("scipy_", "64_"), ("", "64_"), ("", ""))


class Gemm:
    """`c = alpha * a @ b + beta * c` for float32 and float64 2-D arrays, through CBLAS.

    Calling it does the product and returns True, or returns False without touching anything
    when CBLAS cannot read the layouts (`supports`): each operand must be row-major or the
    transpose of a row-major matrix, element-aligned, `c` row-major and not empty.
    """

    def __init__(self, library: ctypes.CDLL, prefix: str, suffix: str, integer: type,
                 name: str, products: bool) -> None:
        self.path = library._name
        self.name = name
        #: whether the CPU device's plain products come here too (MKL: so that one pool of
        #: threads does them all) or stay with np.matmul (NumPy's own OpenBLAS, the same
        #: library, which it calls a little faster for small shapes)
        self.products = products
        #: the largest size a 32-bit-integer BLAS can be told; None for a 64-bit one
        self._largest = np.iinfo(np.int32).max if integer is ctypes.c_int32 else None
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
        if self._largest is not None and max(*a.shape, *b.shape, left[1], right[1],
                                             out[1]) > self._largest:
            return None  # NOTE: a 32-bit integer BLAS cannot be told these sizes
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


def _loaded(word: str) -> list[str]:
    """Paths of shared objects this process has loaded whose file names contain `word`."""
    found: list[str] = []
    try:
        with open("/proc/self/maps") as maps:  # Linux: what this process has loaded
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if word in os.path.basename(path).lower() and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found


def _openblas_paths() -> list[str]:
    """NumPy's OpenBLAS: loaded ones first, then the one bundled with NumPy's wheel."""
    found = _loaded("openblas")
    here = os.path.dirname(np.__file__)
    for pattern in (here + ".libs/*openblas*", os.path.join(here, ".dylibs", "*openblas*")):
        found.extend(p for p in sorted(glob.glob(pattern)) if p not in found)
    return found


def _mkl_paths() -> list[str]:
    """MKL's single dynamic library: loaded (a NumPy built on MKL), or the `mkl` wheel's copy in
    this environment's lib/ (what `pip install blockrt[mkl]` brings on Linux; the wheels have no
    macOS build, and Windows is untested)."""
    found = _loaded("mkl_rt")
    pattern = os.path.join(sys.prefix, "lib", "libmkl_rt.so*")
    found.extend(p for p in sorted(glob.glob(pattern)) if p not in found)
    return found


def _library(path: str) -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(path)
    except OSError:
        return None


def _open_openblas(path: str) -> Gemm | None:
    library = _library(path)
    if library is None:
        return None
    for prefix, suffix in _NAMINGS:
        config = getattr(library, f"{prefix}openblas_get_config{suffix}", None)
        if config is None or not hasattr(library, f"{prefix}cblas_sgemm{suffix}"):
            continue
        config.restype = ctypes.c_char_p
        text = (config() or b"").decode(errors="replace")
        wide = "USE64BITINT" in text
        name = " ".join(text.split()[:2]) or "OpenBLAS"
        gemm = Gemm(library, prefix, suffix, ctypes.c_int64 if wide else ctypes.c_int32, name,
                    products=False)
        return gemm if _passes(gemm) else None
    return None


def _open_mkl(path: str) -> Gemm | None:
    library = _library(path)
    version = None if library is None else getattr(library, "MKL_Get_Version_String", None)
    if version is None or not hasattr(library, "cblas_sgemm_64"):
        return None
    text = ctypes.create_string_buffer(256)
    version.restype = None
    version.argtypes = [ctypes.c_char_p, ctypes.c_int]
    version(text, len(text))
    words = text.value.decode(errors="replace").split()
    # "Intel(R) oneAPI Math Kernel Library Version 2025.2-Product Build ..." -> MKL 2025.2
    number = next((w.split("-")[0] for w in words if w[:1].isdigit()), "")
    # NOTE: the _64 entry points take 64-bit integers whatever MKL_INTERFACE_LAYER says
    gemm = Gemm(library, "", "_64", ctypes.c_int64, f"MKL {number}".strip(), products=True)
    return gemm if _passes(gemm) else None


#: BLOCKRT_BLAS values: which CBLAS the CPU device calls for gemm (and on MKL for its products).
CHOICES = ("auto", "mkl", "openblas", "none")
_VENDORS = {"mkl": (_mkl_paths, _open_mkl), "openblas": (_openblas_paths, _open_openblas)}
_MISSING = {
    "mkl": "no MKL that passes the self-test was found (neither loaded in this process nor "
           "in this environment's lib/: pip install blockrt[mkl], or unset it)",
    "openblas": "NumPy's BLAS is not an OpenBLAS that passes the self-test (unset it, or set "
                "none)",
}


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
_loads: dict[str, Gemm | None] = {}
_lock = threading.Lock()


def choice() -> str:
    """The BLOCKRT_BLAS setting ("auto" when unset); ValueError names a value it does not know."""
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r} is not one of {', '.join(CHOICES)}")
    return value


def load(vendor: str) -> Gemm | None:
    """The first library of `vendor` ("mkl" or "openblas") found here that passes the
    self-test, or None. Looked up once per process."""
    if vendor not in _loads:
        paths, opener = _VENDORS[vendor]
        if vendor == "openblas":
            np.ones((2, 2)) @ np.ones((2, 2))  # NOTE: makes sure NumPy's BLAS is loaded
        _loads[vendor] = next((g for g in map(opener, paths()) if g is not None), None)
    return _loads[vendor]


def find() -> Gemm | None:
    """The CBLAS the CPU device uses, as a `Gemm`, or None (products go to `np.matmul`, and
    accumulation to an elementwise pass). Chosen once per process by BLOCKRT_BLAS: "auto" (the
    default) takes MKL where the `mkl` wheel is installed or NumPy is built on it, else NumPy's
    own OpenBLAS; "mkl" and "openblas" take only that one, and raise RuntimeError saying what is
    missing where it is not here; "none" takes neither. Nothing is remembered after an error."""
    if _found:
        return _found[0]
    with _lock:
        if not _found:
            wanted = choice()
            order = {"auto": ("mkl", "openblas"), "none": ()}.get(wanted, (wanted,))
            gemm = next((g for g in map(load, order) if g is not None), None)
            if gemm is None and wanted in _VENDORS:
                raise RuntimeError(f"{ENV}={wanted}, but {_MISSING[wanted]}")
            _found.append(gemm)
        return _found[0]
