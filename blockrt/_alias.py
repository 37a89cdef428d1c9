"""`import blockrt.<name>` for the modules the facade holds: the same module objects, never copies.

`blockrt.allocators` is the package `allocators`, `blockrt.nn` is `runtime.nn`, and so on
(`ALIASES`). So that `import blockrt.allocators`, `from blockrt.allocators import LimitAdaptor`
and `import blockrt.allocators.interop` give those very modules:

- `register()` puts every module of the aliased packages that is loaded already into
  `sys.modules` under its blockrt name (`blockrt.runtime.graph.capture` too);
- a finder on `sys.meta_path` answers for the ones loaded later, by importing the real module
  and handing it over as it is.

Without the finder, `import blockrt.allocators.interop` would find `allocators/interop.py`
through the package's `__path__` and run it a second time as a new module, with its own classes
and state. Note that `blockrt.graph` stays the function `runtime.graph`, while the module
`blockrt.graph` is the package `runtime.graph`, as in `runtime` itself: a name that is loaded
already is never set on its parent again.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence

__all__ = ["ALIASES", "real_name", "register"]

#: blockrt.<name> -> the module it is.
ALIASES = {
    "allocators": "allocators",
    "backends": "backends",
    "runtime": "runtime",
    "amp": "runtime.amp",
    "graph": "runtime.graph",
    "nn": "runtime.nn",
    "ops": "runtime.ops",
}


def real_name(name: str) -> str | None:
    """The module that `name` (e.g. "blockrt.allocators.interop") is an alias of, or None.

    Example:
        >>> real_name("blockrt.nn"), real_name("blockrt.cli")
        ('runtime.nn', None)
    """
    top, _, rest = name.partition(".")
    if top != "blockrt" or not rest:
        return None
    head, dot, tail = rest.partition(".")
    real = ALIASES.get(head)
    return None if real is None else real + dot + tail


class _Loader(importlib.abc.Loader):
    """Hands over the real module, loaded (once) under its own name, and leaves it as it was."""

    def __init__(self, real: str) -> None:
        self.real = real
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(self.real)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # NOTE: the import system has set the alias's spec on the module in between; put back
        # the spec it was loaded with, which names it as it is
        module.__spec__ = self.spec


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        real = real_name(fullname)
        if real is None:
            return None
        if importlib.util.find_spec(real) is None:
            return None  # NOTE: ModuleNotFoundError then names the blockrt name asked for
        return importlib.machinery.ModuleSpec(fullname, _Loader(real))


_FINDER = _Finder()


def register() -> None:
    """Make every alias importable: the loaded modules now, the others through the finder.
    Idempotent (the facade calls it once, when it is imported)."""
    for alias, real in ALIASES.items():
        for name in [name for name in sys.modules if name == real or name.startswith(real + ".")]:
            sys.modules.setdefault(f"blockrt.{alias}{name[len(real):]}", sys.modules[name])
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
