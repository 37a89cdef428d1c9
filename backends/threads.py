"""One pool of threads for the CPU: blockrt's C kernels and NumPy's OpenBLAS share it.

    >>> import runtime
    >>> runtime.get_num_threads()          # OpenBLAS's own count at start, else the CPUs here
    2                                      (on a machine of two CPUs)
    >>> runtime.set_num_threads(1)         # the C kernels and OpenBLAS's products alike

Settings: BLOCKRT_NUM_THREADS (a whole number from 1 to 64), read when this module is first
imported; unset, the pool takes OpenBLAS's thread count (which follows OPENBLAS_NUM_THREADS,
OMP_NUM_THREADS and the CPUs this process may run on), else the CPUs it may run on. A value it
cannot use is a `SettingError` naming the variable and the value.

Note [one pool for kernels and products]: PyTorch runs every CPU kernel, products and
elementwise alike, on one pool of threads. blockrt's C kernels ran on the calling thread alone,
while OpenBLAS ran the products on its own threads, whose workers spin for a while after each
product; so a second thread on the kernels gained nothing right after a product (a 1.5M-item
GELU took 3.61 ms on one thread and 3.72 ms on two, after a 512x768x3072 product; Intel Xeon,
family 6 model 167, 2 vCPUs). The pool of backends/_pool.h now runs both. blockrt's kernels
split their work over it, each part a range of rows, channels, planes or tiles, so that the
bits do not depend on how many threads run. And OpenBLAS hands it the jobs it would give its
own threads (`openblas_set_threads_callback_function`, OpenBLAS 0.3.28 and later), so its
own workers never wake; it splits a product the same way whoever runs the jobs, so the
products' bits are those of its own threads. The callback is process-wide: NumPy's own
products in this process run on the pool too (`share_openblas(False)` gives OpenBLAS its own
threads back). A kernel that finds the pool busy (another thread's kernel) runs on its own
thread; OpenBLAS's jobs wait for the pool instead, since they wait on each other and cannot
run one after another. MKL, where it runs the products (Note [one thread pool per process] in
backends/_blas_choice.py), keeps its own OpenMP threads: the pool was measured beside
OpenBLAS only.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

from backends import _blas, accelerated

__all__ = ["ENV", "MOST", "describe", "get_num_threads", "set_num_threads", "share_openblas"]

ENV = "BLOCKRT_NUM_THREADS"
#: The most threads the pool runs (`POOL_MAX` in backends/_pool.h)
MOST = 64

_halfconv = accelerated.load("backends._halfconv")
_lock = threading.Lock()


class _OpenBLAS:
    """NumPy's OpenBLAS's thread functions, where it has the threads callback."""

    def __init__(self, library: ctypes.CDLL, prefix: str, suffix: str) -> None:
        self.setter = ctypes.cast(
            getattr(library, f"{prefix}openblas_set_threads_callback_function{suffix}"),
            ctypes.c_void_p).value
        self.set_threads = getattr(library, f"{prefix}openblas_set_num_threads{suffix}")
        self.set_threads.argtypes = [ctypes.c_int]
        self.set_threads.restype = None
        self.get_threads = getattr(library, f"{prefix}openblas_get_num_threads{suffix}")
        self.get_threads.restype = ctypes.c_int


def _find_openblas() -> _OpenBLAS | None:
    """NumPy's OpenBLAS (`_blas`'s search and naming), where it has the threads callback."""
    for path in _blas._openblas_paths():
        library = _blas._library(path)
        naming = _blas.openblas_naming(library)
        if naming is not None and all(
                hasattr(library, f"{naming[0]}openblas_{name}{naming[1]}")
                for name in ("set_threads_callback_function", "set_num_threads",
                             "get_num_threads")):
            return _OpenBLAS(library, *naming)
    return None


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _count(value: Any, what: str) -> int:
    """A thread count, or a ValueError naming `what` and the value."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MOST:
        raise ValueError(f"{what}: {value!r} is not a whole number of threads from 1 to {MOST}")
    return value


def _from_env() -> int | None:
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    try:
        return _count(int(text), ENV)
    except ValueError:
        raise accelerated.SettingError(
            f"{ENV}={text!r}: not a whole number of threads from 1 to {MOST}") from None


_openblas = _find_openblas() if _halfconv is not None else None
_shared = False


def share_openblas(on: bool) -> None:
    """Run NumPy's OpenBLAS's jobs on the pool (True, the default where the C extension is
    built) or on OpenBLAS's own threads (False). Nothing happens where either is missing."""
    global _shared
    with _lock:
        if _openblas is None or _halfconv is None or _shared == bool(on):
            return
        _halfconv.blas_pool(_openblas.setter, bool(on))
        _shared = bool(on)


def get_num_threads() -> int:
    """The threads the pool splits a kernel over, the calling thread included (1 where the C
    extension is off: the kernels run on the calling thread)."""
    return _halfconv.threads(0) if _halfconv is not None else 1


def set_num_threads(n: int) -> None:
    """The threads of the pool (1 to 64), which NumPy's OpenBLAS takes too: a product is split
    into n jobs. ValueError, nothing changed, for anything else."""
    n = _count(n, "set_num_threads")
    with _lock:
        if _halfconv is not None:
            _halfconv.threads(n)
        if _openblas is not None:
            _openblas.set_threads(n)


def describe() -> str:
    """One line for `blockrt info`: the pool's threads, and who runs OpenBLAS's jobs."""
    if _halfconv is None:
        return "CPU threads: 1 (the C kernels are off: each runs on its calling thread)"
    source = f"{ENV}" if os.environ.get(ENV, "").strip() else \
        "OpenBLAS's count" if _openblas is not None else "the CPUs this process may run on"
    blas = ("OpenBLAS's jobs run on the pool" if _shared else
            "OpenBLAS keeps its own threads" if _openblas is not None else
            "NumPy's OpenBLAS has no threads callback: it keeps its own threads")
    return (f"CPU threads: {get_num_threads()} for the C kernels (from {source}; "
            f"runtime.set_num_threads changes it); {blas}")


def _start() -> None:
    wanted = _from_env()
    if wanted is not None:
        set_num_threads(wanted)
    elif _halfconv is not None:
        found = _openblas.get_threads() if _openblas is not None else _cpus()
        _halfconv.threads(min(max(int(found), 1), MOST))
    share_openblas(True)


_start()
