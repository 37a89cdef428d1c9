"""A test device whose kernels are deliberately unsafe when operands overlap.

`NaiveDevice` keeps the NumPy device's memory (raw uint8 host arrays) but replaces every kernel
with a plain loop that writes one element at a time, in C order, reading its inputs as it goes,
the way a real GPU or BLAS kernel does. Nothing here hands the whole computation to NumPy, so
NumPy's own overlap handling (it buffers overlapping ufunc operands) never rescues a result:

- `matmul` is BLAS with beta=0: `out` is zeroed first, then `out[i, j] += a[i, k] * b[k, j]` is
  accumulated over k, so a zeroed or half-accumulated `out` is what a later read of an
  overlapping input sees;
- `sum` / `mean` zero `out` first and accumulate element by element in the same way, and
  `max` sets `out` to -inf first and keeps the larger element by element (a NaN once met);
- elementwise kernels compute `out[idx] = f(x[idx])` element by element;
- `gather` and `scatter_add` are the base Device's defaults, made of the kernels above (a row
  copy, an in-place row add), so the defaults are checked here too.

A result on this device is therefore only right when the runtime kept overlapping operands away
from the kernels. Use one instance per process (the runtime keys default allocators by the device
name), or pass an allocator made with `allocators.create("direct", device)`.

Example:
    >>> import numpy as np, runtime
    >>> dev = NaiveDevice()
    >>> x = runtime.tensor(np.arange(3.0), device=dev)
    >>> runtime.ops.add(x, 1.0).numpy()
    array([1., 2., 3.])
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import numpy as np

from backends import _erf, optable
from backends.base import Device
from backends.numpy import NumpyDevice

#: Each primitive of backends/optable.py on one element (NumPy scalars and numbers): every op's
#: formula is evaluated element by element from the table (Note [one declaration per op])
_SCALAR: dict[str, Callable[..., Any]] = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
    "sqrt": np.sqrt, "abs": np.absolute, "exp": np.exp, "log": np.log, "tanh": np.tanh,
    "erf": _erf.erf, "lt": operator.lt, "gt": operator.gt, "eq": operator.eq,
    "isnan": np.isnan, "isfinite": np.isfinite, "either": lambda a, b: bool(a or b),
    "select": lambda c, a, b: a if c else b,
}


def _element(operand: Any, index: tuple[int, ...]) -> Any:
    """One element of an array operand, or the scalar operand itself."""
    return operand[index] if isinstance(operand, np.ndarray) else operand


class NaiveDevice(NumpyDevice):
    """Host memory with element-by-element kernels that corrupt overlapping operands."""

    def __init__(self, index: int = 0) -> None:
        super().__init__(index)
        self.name = "naive"

    def _unary(self, name: str, x: Any, out: np.ndarray) -> None:
        self._elements(name, (x,), out)

    def _binary(self, name: str, a: Any, b: Any, out: np.ndarray) -> None:
        self._elements(name, (a, b), out)

    def _ternary(self, name: str, a: Any, b: Any, c: Any, out: np.ndarray) -> None:
        self._elements(name, (a, b, c), out)

    def _elements(self, name: str, operands: tuple, out: np.ndarray) -> None:
        formula = optable.BY_NAME[name].formula
        for index in np.ndindex(out.shape):
            out[index] = optable.evaluate(formula, [_element(x, index) for x in operands],
                                          _SCALAR)

    def _matmul(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        if a.ndim != 2 or b.ndim != 2:
            raise NotImplementedError(f"NaiveDevice._matmul handles 2-D operands only, got "
                                      f"shapes {a.shape} and {b.shape}")
        rows, inner = a.shape
        cols = b.shape[1]
        out[...] = 0  # beta = 0: the output is cleared before anything is read
        for k in range(inner):
            for i in range(rows):
                for j in range(cols):
                    out[i, j] += a[i, k] * b[k, j]

    def _reduce(self, name: str, x: np.ndarray, axis: tuple[int, ...] | None, keepdims: bool,
                out: np.ndarray) -> None:
        axes = tuple(range(x.ndim)) if axis is None else axis
        out[...] = 0
        for index in np.ndindex(x.shape):
            if keepdims:
                target = tuple(0 if d in axes else i for d, i in enumerate(index))
            else:
                target = tuple(i for d, i in enumerate(index) if d not in axes)
            out[target] += x[index]
        if name == "mean":
            count = math.prod(x.shape[d] for d in axes)
            for index in np.ndindex(out.shape):
                out[index] /= count

    # NOTE: the defaults of backends/base.py, over this device's element-by-element kernels
    _gather = Device._gather
    _scatter_add = Device._scatter_add
    _from_host = Device._from_host

    def _reduce_max(self, x: np.ndarray, axis: tuple[int, ...] | None, keepdims: bool,
                    out: np.ndarray) -> None:
        axes = tuple(range(x.ndim)) if axis is None else axis
        out[...] = -np.inf
        for index in np.ndindex(x.shape):
            if keepdims:
                target = tuple(0 if d in axes else i for d, i in enumerate(index))
            else:
                target = tuple(i for d, i in enumerate(index) if d not in axes)
            value, best = x[index], out[target]
            if not np.isnan(best) and (value > best or np.isnan(value)):
                out[target] = value
