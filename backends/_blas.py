"""CBLAS `?gemm` for the CPU device, called through ctypes: Intel's MKL where it is installed,
and the OpenBLAS that NumPy itself loaded; which of them runs the products is measured
(`backends/_blas_choice.py`) unless BLOCKRT_BLAS names one.

NumPy's `matmul` computes `a @ b` only. BLAS computes `alpha * a @ b + beta * c` into `c` in the
same time, which lets the graph fold an update such as `w -= lr * (x.T @ g)` into the product:
no gradient buffer and no extra pass over it. On MKL the CPU device sends its 2-D products here
too, so one library (one pool of threads) does all of a step's products; on NumPy's OpenBLAS
they stay with `np.matmul`, the same library, which calls it a little faster for small shapes.

Two vendors are recognised. MKL (`pip install blockrt[mkl]` brings Intel's `mkl` wheel; a NumPy
built on MKL has it loaded already) through its 64-bit-integer `cblas_?gemm_64` entry points.
OpenBLAS: NumPy's wheels carry one, named `scipy_openblas64_`; the integer width comes from the
library's own configuration string. No dependency is needed for it. A found library must pass a
self-test against NumPy, with every transposition, before it is used.

Settings (`Settings`, read from the environment at the first product):
    BLOCKRT_BLAS: "auto" (the default: where both libraries are here, the one that runs this
        process's products faster, measured on them, Note [one thread pool per process] in
        backends/_blas_choice.py; else the one that is here), "mkl" or "openblas" (that one
        for every product; RuntimeError where it is not here) or "none" (neither: products go
        to `np.matmul` and accumulation to an elementwise pass, as where no CBLAS is found).
    BLOCKRT_BLAS_CACHE: unset, empty or "0": measure in every process; "1": keep the measured
        times per machine in $XDG_CACHE_HOME/blockrt (default ~/.cache/blockrt), so a later
        process decides without measuring the shapes it finds there; an absolute directory:
        keep them there.
A value it does not know raises ValueError naming the variable and the value.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import platform
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from backends._blas_choice import Chooser, DiskCache, product_of

__all__ = ["CACHE_ENV", "CHOICES", "ENV", "Gemm", "Report", "Settings", "choice", "expect",
           "find", "load", "openblas_naming", "present", "report"]

ENV = "BLOCKRT_BLAS"
CACHE_ENV = "BLOCKRT_BLAS_CACHE"

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
                 name: str, products: bool, threads: Any = None) -> None:
        self.path = library._name
        self.name = name
        #: a function returning how many threads the library runs a product on, or None
        self._threads = threads
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
                and a.ndim == b.ndim == c.ndim == 2 and c.size > 0 and a.shape[1] > 0
                and (a.shape[0], b.shape[1]) == c.shape and a.shape[1] == b.shape[0]):
            return None  # NOTE: shapes that do not agree go to NumPy, which says so
        out, left, right = self._layout(c), self._layout(a), self._layout(b)
        if out is None or out[0] != _NO_TRANS or left is None or right is None:
            return None
        if self._largest is not None and max(*a.shape, *b.shape, left[1], right[1],
                                             out[1]) > self._largest:
            return None  # NOTE: a 32-bit integer BLAS cannot be told these sizes
        return left, right, out[1]

    def bind(self, a: np.ndarray, b: np.ndarray, c: np.ndarray, alpha: float,
             beta: float) -> Callable[[], None] | None:
        """The product a call `(a, b, c, alpha, beta)` runs, as a function of no arguments
        whose layouts, pointers and sizes were worked out and converted to C once (a graph's
        replay runs the same product on the same views at every step: about 1.3 us a call
        against 10 for `__call__` on this machine's AMD EPYC); None where `__call__` would
        return False. The function holds the three views, so the memory it names lives
        while it does."""
        found = self._call(a, b, c, alpha, beta)
        if found is None:
            return None
        function, values = found
        call = functools.partial(function, *(kind(value) for kind, value
                                              in zip(function.argtypes, values)))
        call.views = (a, b, c)  # type: ignore[attr-defined]
        return call

    def threads(self) -> int | None:
        """How many threads the library runs a product on (its own setting), or None."""
        return int(self._threads()) if self._threads is not None else None

    def supports(self, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> bool:
        return self._layouts(a, b, c) is not None

    def __call__(self, a: np.ndarray, b: np.ndarray, c: np.ndarray, alpha: float,
                 beta: float) -> bool:
        call = self._call(a, b, c, alpha, beta)
        if call is None:
            return False
        function, values = call
        function(*values)
        return True

    def _call(self, a: np.ndarray, b: np.ndarray, c: np.ndarray, alpha: float,
              beta: float) -> tuple[Any, tuple] | None:
        """The CBLAS function and the arguments of `c = alpha * a @ b + beta * c`, or None
        where CBLAS cannot read the layouts."""
        layouts = self._layouts(a, b, c)
        if layouts is None:
            return None
        (trans_a, lda), (trans_b, ldb), ldc = layouts
        return self._functions[c.dtype], (
            _ROW_MAJOR, trans_a, trans_b, c.shape[0], c.shape[1], a.shape[1], alpha,
            a.ctypes.data, lda, b.ctypes.data, ldb, beta, c.ctypes.data, ldc)


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


def openblas_naming(library: ctypes.CDLL | None) -> tuple[str, str] | None:
    """The (symbol prefix, symbol suffix) of an OpenBLAS library's entry points (`_NAMINGS`:
    NumPy's wheels, then plain builds), or None where it is no OpenBLAS with a CBLAS."""
    for prefix, suffix in _NAMINGS:
        if library is not None and all(hasattr(library, f"{prefix}{name}{suffix}")
                                       for name in ("openblas_get_config", "cblas_sgemm")):
            return prefix, suffix
    return None


def _open_openblas(path: str) -> Gemm | None:
    library = _library(path)
    naming = openblas_naming(library)
    if naming is None:
        return None
    prefix, suffix = naming
    config = getattr(library, f"{prefix}openblas_get_config{suffix}")
    config.restype = ctypes.c_char_p
    text = (config() or b"").decode(errors="replace")
    wide = "USE64BITINT" in text
    name = " ".join(text.split()[:2]) or "OpenBLAS"
    threads = getattr(library, f"{prefix}openblas_get_num_threads{suffix}", None)
    gemm = Gemm(library, prefix, suffix, ctypes.c_int64 if wide else ctypes.c_int32, name,
                products=False, threads=threads)
    return gemm if _passes(gemm) else None


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
    gemm = Gemm(library, "", "_64", ctypes.c_int64, f"MKL {number}".strip(), products=True,
                threads=getattr(library, "MKL_Get_Max_Threads", None))
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


#: Which library `find()` returns where nothing could be measured: NumPy's own first.
_ORDER = ("openblas", "mkl")
_OFF = ("", "0", "off", "no", "false")
_ON = ("1", "on", "yes", "true")


@dataclass(frozen=True)
class Settings:
    """BLOCKRT_BLAS and BLOCKRT_BLAS_CACHE (the module docstring), read once, at the first
    product (`find()`).

    Attributes:
        blas: one of `CHOICES`.
        cache: the directory of the disk cache of measured times, or None (off).
    """

    blas: str = "auto"
    cache: str | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Settings:
        """Settings from an environment mapping; ValueError names a variable whose value it
        does not know, and the value."""
        blas = environ.get(ENV, "").strip().lower() or "auto"
        if blas not in CHOICES:
            raise ValueError(f"{ENV}={environ[ENV]!r} is not one of {', '.join(CHOICES)}")
        text = environ.get(CACHE_ENV, "").strip()
        if text.lower() in _OFF:
            return cls(blas)
        if text.lower() in _ON:
            home = environ.get("XDG_CACHE_HOME", "")
            if not os.path.isabs(home):  # NOTE: the XDG spec: a relative one is to be ignored
                home = os.path.join(os.path.expanduser("~"), ".cache")
            return cls(blas, os.path.join(home, "blockrt"))
        if not os.path.isabs(text):
            raise ValueError(f"{CACHE_ENV}={environ[CACHE_ENV]!r} is neither 0 nor 1 nor an "
                             f"absolute directory path")
        return cls(blas, text)


_found: list[Any] = []
_loads: dict[str, Gemm | None] = {}
_lock = threading.Lock()


def choice() -> str:
    """The BLOCKRT_BLAS setting ("auto" when unset); ValueError names a value it does not know."""
    return Settings.from_environ(os.environ).blas


def load(vendor: str) -> Gemm | None:
    """The first library of `vendor` ("mkl" or "openblas") found here that passes the
    self-test, or None. Looked up once per process."""
    if vendor not in _loads:
        paths, opener = _VENDORS[vendor]
        if vendor == "openblas":
            np.ones((2, 2)) @ np.ones((2, 2))  # NOTE: makes sure NumPy's BLAS is loaded
        _loads[vendor] = next((g for g in map(opener, paths()) if g is not None), None)
    return _loads[vendor]


def present() -> list[Gemm]:
    """Every library found here that passes the self-test, NumPy's own first."""
    return [gemm for gemm in map(load, _ORDER) if gemm is not None]


def find() -> Any:
    """What the CPU device calls for its products, as a `Gemm` (or something called as one),
    or None (products go to `np.matmul`, and accumulation to an elementwise pass). Set up once
    per process, at the first call, from `Settings`: a library named in BLOCKRT_BLAS (a
    RuntimeError saying what is missing where it is not here); under "auto", the one library
    here, or, where there are two, a `Chooser` that measures them on this process's products
    and then runs them all on the faster. Nothing is remembered after an error."""
    if _found:
        return _found[0]
    with _lock:
        if not _found:
            settings = Settings.from_environ(os.environ)
            _found.append(_route(settings))
        return _found[0]


def _route(settings: Settings) -> Any:
    if settings.blas == "none":
        return None
    if settings.blas in _VENDORS:
        gemm = load(settings.blas)
        if gemm is None:
            raise RuntimeError(f"{ENV}={settings.blas}, but {_MISSING[settings.blas]}")
        return gemm
    libraries = present()
    if len(libraries) < 2:
        return libraries[0] if libraries else None
    cache = None
    if settings.cache is not None:
        cache = DiskCache(settings.cache, _machine(libraries))
    return Chooser(libraries, load("openblas"), quiet=quiet_seconds(), cache=cache)


def expect(products: Iterable[tuple[Any, Any, Any, bool]]) -> None:
    """The 2-D products a captured graph runs at each step, as (a, b, out, accumulates) layouts
    (anything with shape, strides and dtype): while the choice is being measured, each phase
    waits for them, and they weigh in by their count."""
    route = find()
    if isinstance(route, Chooser):
        route.expect([product_of(a, b, out, accumulates) for a, b, out, accumulates in products
                      if len(a.shape) == len(b.shape) == len(out.shape) == 2])


def quiet_seconds() -> float:
    """How long a library's threads may go on spinning after its last product (s): MKL's
    OpenMP blocktime (the loaded libiomp5's, else KMP_BLOCKTIME's, else its 200 ms default;
    at most 1 s, as "infinite" never ends), at least OpenBLAS's 0.1 s, and 50 ms more."""
    blocktime = 200
    for path in _loaded("libiomp5"):
        library = _library(path)
        if library is not None and hasattr(library, "kmp_get_blocktime"):
            blocktime = library.kmp_get_blocktime()
            break
    else:
        text = os.environ.get("KMP_BLOCKTIME", "").strip().lower()
        blocktime = int(text) if text.isdigit() else 1000 if text == "infinite" else blocktime
    return min(max(blocktime / 1000, 0.1), 1.0) + 0.05


def _machine(libraries: list[Gemm]) -> str:
    """What measured times depend on besides the product: the CPU, and each library's version
    and thread count (the disk cache's key)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                fields.setdefault(name.strip(), value.strip())
                if not line.strip():
                    break  # NOTE: the first CPU says it for all
    except OSError:
        pass
    cpu = fields.get("model name") or platform.processor() or platform.machine()
    cpu += "".join(f" {key} {fields[key]}" for key in ("cpu family", "model", "stepping")
                   if key in fields)
    used = "; ".join(f"{gemm.name} x{gemm.threads()}" for gemm in libraries)
    return f"{cpu}, {os.cpu_count()} CPUs; {used}"


@dataclass
class Report:
    """How the CPU device runs its products (`report()`), for `blockrt info` and benchmarks.

    Attributes:
        setting: BLOCKRT_BLAS ("auto" when unset), or the error it gives.
        libraries: every library found here (`present()`).
        route: what `find()` returns now (None: np.matmul), or None after an error.
        chooser: the `Chooser` of this process, where BLOCKRT_BLAS=auto found two libraries.
    """

    setting: str
    libraries: list[Gemm]
    route: Any
    chooser: Chooser | None

    @property
    def summary(self) -> str:
        """One line: the library in use and how it was chosen."""
        if self.chooser is not None:
            decision = self.chooser.decision
            if decision is None:
                return f"not chosen yet ({self.chooser.state})"
            other = "/".join(lib.name for lib in self.chooser.libraries
                             if lib is not decision.library)
            return f"{decision.library.name} (measured against {other})"
        if self.route is None:
            return "none (np.matmul and an elementwise pass)"
        if self.setting in _VENDORS:
            return f"{self.route.name} ({ENV}={self.setting})"
        return f"{self.route.name} (the only CBLAS here)"


def report() -> Report:
    """How the CPU device runs its products now; RuntimeError / ValueError as `find()`."""
    route = find()
    return Report(choice(), present(), route, route if isinstance(route, Chooser) else None)
