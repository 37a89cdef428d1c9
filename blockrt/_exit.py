"""An error that ends the import of blockrt, said in one line where it ends the program.

A BLOCKRT_* environment variable that blockrt cannot use is the user's setting, not a bug,
and the first one read (BLOCKRT_PURE_PYTHON, as `allocators` is imported) stops the import of
blockrt, before the `blockrt` command (whose module is inside this package) can run a line. So
the facade hands such an error (a `backends.accelerated.SettingError`, named: its module's
import is what raises it) to `one_line_on_exit`: it still raises, and a caller may catch
it; if nothing does and it ends the program, Python's last report of it is one line,
`blockrt: error: MESSAGE` (exit status 1), instead of a traceback through the imports.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from types import TracebackType

__all__ = ["one_line_on_exit"]


@contextlib.contextmanager
def one_line_on_exit(error_class: str) -> Iterator[None]:
    """Re-raise an error of the class named `error_class` ("module.Class") from the block
    unchanged, having set `sys.excepthook` so that, should that very error end the program, it
    is printed as `blockrt: error: MESSAGE`. Every other exception (a bug's ValueError too)
    passes untouched, to the hook that was there before."""
    try:
        yield
    except Exception as error:
        kind = type(error)
        if f"{kind.__module__}.{kind.__qualname__}" != error_class:
            raise
        before, raised = sys.excepthook, error  # NOTE: `error` is unbound when the block ends

        def hook(kind_: type[BaseException], value: BaseException,
                 traceback: TracebackType | None) -> None:
            if value is raised:
                print(f"blockrt: error: {value}", file=sys.stderr)
            else:
                before(kind_, value, traceback)

        sys.excepthook = hook
        raise
