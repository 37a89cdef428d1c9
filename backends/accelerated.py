"""Which C paths are in use, and why: the one switch (BLOCKRT_PURE_PYTHON) and the one table of
blockrt's optional C extensions.

Each C path has a Python twin, which is its specification and runs whatever the C code hands
back. The twin asks this module for its extension, by the extension's module name, once, where
it is defined, and binds or calls what it gets (STYLE.md rule 21); nothing replaces another
module's names from outside. None means the Python twin runs alone:

    >>> from backends import accelerated
    >>> halfconv = accelerated.load("backends._halfconv")   # the module, or None
    >>> [path.module for path in accelerated.paths()]
    ['allocators._speedups', 'runtime._dispatch', 'backends._halfconv', 'backends._torchalloc']

Where each twin asks (and what it binds):
- `allocators._speedups`: `allocators/_core.py` takes its record types and allocator state,
  `allocators/caching.py` its `allocate` / `free` for `CachingAllocator` (method descriptors
  of that very class, `@_hot_path`), Note [the hot path runs no Python] in
  allocators/_core.py;
- `runtime._dispatch`: `runtime/autograd.py` binds `record` and `_engine`, `runtime/_tensor.py`
  binds `Tensor.__del__`'s release, `runtime.ops` its fast elementwise, launch and reduce once
  `runtime/fastpath.py` has configured it (Note [the eager fast path] there);
- `backends._halfconv`: `backends/numpy.py`, the CPU device's float16 / bfloat16 conversions,
  its vectorised float kernels and `sub_scaled`;
- `backends._torchalloc`: `backends/_torchbridge.py` (imported with `backends/cuda.py`), which
  hands its two C functions to PyTorch (`backends.cuda.use_with_torch`). It has no Python
  twin, since PyTorch loads C by path: where it is off, `use_with_torch` is refused, saying
  why.

The environment variable BLOCKRT_PURE_PYTHON, read once when this module is first imported (as
`allocators` is), turns every one off: 1, true, yes or on; 0, false, no, off or unset keep
them; anything else is a ValueError naming it. A twin may also find its path unusable here
(`refuse`, e.g. a NumPy whose error state the C code cannot set); `paths()` says for each
path whether it is in use and why, as `blockrt info` prints it.

This module imports nothing of blockrt's: it sits below every package, and imports an
extension only when its twin asks, by then inside the import of the twin's own package (an
extension imports nothing of ours either: tests/test_layers.py).
"""

from __future__ import annotations

import importlib
import os
import threading
from dataclasses import dataclass
from types import ModuleType

__all__ = ["FALSE_WORDS", "PURE_PYTHON", "PURE_PYTHON_ENV", "TRUE_WORDS", "Path", "SettingError",
           "flag", "load", "paths", "refuse"]

#: The environment variable that turns every C path off.
PURE_PYTHON_ENV = "BLOCKRT_PURE_PYTHON"
#: The words an on/off environment variable of blockrt accepts (any case).
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


class SettingError(ValueError):
    """An environment variable of blockrt's holds a value blockrt cannot use: the user's
    setting, not a bug, so the `blockrt` command reports it in one line."""


def flag(variable: str) -> bool:
    """The on/off environment variable `variable`: False when unset or empty.

    Raises:
        SettingError: (a ValueError) a value other than TRUE_WORDS and FALSE_WORDS (any
            case), naming the variable and its value.
    """
    value = os.environ.get(variable, "")
    word = value.strip().lower()
    if word in ("", *FALSE_WORDS):
        return False
    if word in TRUE_WORDS:
        return True
    raise SettingError(f"environment variable {variable}={value!r}: expected 1/true/yes/on or "
                     f"0/false/no/off (or unset)")


#: True when BLOCKRT_PURE_PYTHON turned every C path off (read once, at import).
PURE_PYTHON = flag(PURE_PYTHON_ENV)


@dataclass
class Path:
    """One C path: its extension, what it runs in C, and whether it is in use and why."""

    #: the extension's module name, as its twin asks for it
    module: str
    #: what it runs in C (its Python twin runs the rest, and all of it where it is off)
    runs: str
    #: its C source
    source: str
    #: True while in use; None until its twin has asked
    in_use: bool | None = None
    #: why it is or is not in use
    why: str = "not asked for yet: the package that uses it is not imported"


#: extension -> its Path; the one table of blockrt's C paths, in the order of the layers above
#: them (allocators, runtime, backends' CPU device).
_PATHS = {path.module: path for path in (
    Path("allocators._speedups", "the caching allocator's cache hits and coalescing frees",
         "allocators/_speedups.c"),
    Path("runtime._dispatch", "the eager ops' common case, Tensor release, autograd's record "
         "and backward pass", "runtime/_dispatch.c"),
    Path("backends._halfconv", "the CPU device's half conversions and kernels, its float "
         "kernels and sub_scaled", "backends/_halfconv.c"),
    Path("backends._torchalloc", "the malloc and free PyTorch's pluggable CUDA allocator "
         "loads (no Python twin: use_with_torch needs it)", "backends/_torchalloc.c"),
)}
_loaded: dict[str, ModuleType | None] = {}
_lock = threading.Lock()


def _path(module: str) -> Path:
    path = _PATHS.get(module)
    if path is None:
        raise KeyError(f"{module!r} is not a C path of blockrt; the C paths are "
                       f"{', '.join(_PATHS)}")
    return path


def load(module: str) -> ModuleType | None:
    """The extension `module` (e.g. "runtime._dispatch") where its C path is in use, else None
    (BLOCKRT_PURE_PYTHON is set, the extension is not built, or its twin refused it). The first
    call decides; later calls return the same.

    Raises:
        KeyError: `module` is not in the table of C paths.
    """
    path = _path(module)
    with _lock:
        if module in _loaded:
            return _loaded[module]
        extension = None
        if PURE_PYTHON:
            path.why = f"off: {PURE_PYTHON_ENV}={os.environ[PURE_PYTHON_ENV]}"
        else:
            try:
                extension = importlib.import_module(module)
            except ImportError as exc:  # NOTE: built where a C compiler was present at install
                path.why = f"not built ({exc}): reinstall with a C compiler to build it"
            else:
                path.why = "in use"
        path.in_use = extension is not None
        _loaded[module] = extension
        return extension


def refuse(module: str, why: str) -> None:
    """Record that the C path of `module` is off because its twin cannot use it here (`why`,
    for `paths()`): later `load`s return None, and whatever the twins bound before must hand
    every call back to Python (as `runtime._dispatch` does until it is configured)."""
    path = _path(module)
    with _lock:
        _loaded[module] = None
        path.in_use = False
        path.why = f"off: {why}"


def paths() -> list[Path]:
    """Every C path, in use or not, and why (copies)."""
    with _lock:
        return [Path(path.module, path.runs, path.source, path.in_use, path.why)
                for path in _PATHS.values()]
