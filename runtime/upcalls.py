"""The ops that modules below `runtime.ops` call: `OPS`, which `runtime.ops` fills as it is
imported.

Note [calls up to ops]: `runtime.ops` makes tensors, so it imports `runtime._tensor`, and the
modules under it (`runtime._tensor`, `runtime.autograd`) cannot import it back without an
import circle. Yet `a + b` is `ops.add(a, b)`, item assignment and a strided `reshape` are
`ops.copy`, and the backward pass sums gradients with `ops.sum` and `ops.add`. They call those
ops through `OPS`, whose fields `runtime.ops` sets once, as the last step of its import
(`OPS.provide(add=add, ...)`), and which raise RuntimeError until then (nothing calls them while
`runtime` is being imported). NumPy ties the same knot the same way: its array type's number
protocol calls a table of ufuncs that the umath module hands it when it is imported
(`_PyArray_SetNumericOps` in numpy/_core/src/multiarray/number.c). So a reader of `Tensor.__add__`
finds `OPS.add`, and here the one place that fills it; every other import in runtime/ points
down (docs/architecture.md, tests/test_layers.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["OPS", "Ops"]


def _not_yet(name: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"runtime.ops.{name} was called before runtime.ops was imported "
                           f"(Note [calls up to ops] in runtime/upcalls.py)")

    call.placeholder = True  # type: ignore[attr-defined]
    return call


class Ops:
    """The ops `runtime._tensor` and `runtime.autograd` call, as `runtime.ops` defines them
    (see there for what each takes, returns and raises)."""

    __slots__ = ("add", "sub", "mul", "div", "matmul", "neg", "copy", "sum")

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, _not_yet(name))

    def provide(self, **ops: Callable[..., Any]) -> None:
        """Set every field, once, from runtime.ops (each by its name there).

        Raises:
            ValueError: a field is missing, unknown or set before.
        """
        if sorted(ops) != sorted(self.__slots__):
            raise ValueError(f"Ops.provide takes exactly {', '.join(self.__slots__)}; got "
                             f"{', '.join(sorted(ops))}")
        taken = [name for name in self.__slots__
                 if not getattr(getattr(self, name), "placeholder", False)]
        if taken:
            raise ValueError(f"Ops.provide: {', '.join(taken)} set before")
        for name, op in ops.items():
            setattr(self, name, op)


#: Tensor's operators and copies and the backward pass's sums call runtime.ops through this.
OPS = Ops()
