"""The error function on NumPy arrays: the CPU device's erf kernel (NumPy has no erf ufunc, and
SciPy is no dependency).

It is C's erf, the function `math.erf` calls, on every element, computed in float64 and rounded
once to the result's dtype: in one C loop over contiguous float32 and float64 arrays
(`_halfconv.erf_op`), else through `np.frompyfunc(math.erf)` (other layouts, numbers, and
without the extension), with the same bits either way. So the CPU's erf is math.erf exactly
(0 ULPs; glibc's is within 1 ULP of the exact erf), and a float32 one is that float64 value
rounded once. Measured at 64x256 float64 on this machine: the C loop about 0.2 ms, frompyfunc
1.4 ms, np.tanh 0.03 ms (a vectorised NumPy series, tried first, took 0.9 ms: 30 Clenshaw
steps over the array). The float32 loop gets C's bits in about a quarter of C's time (3.0
against 12.3 ms on 1.5M GELU arguments, BENCHMARKS.md): polynomials in double
(backends/_erf_table.h), rounded to float32, and C's erf itself wherever a polynomial's value
lies near a point where the rounding changes (`erf_block` in backends/_halfconv.c, on AVX-512,
AVX2 or portable loops; every float32 checked on each by `python -m backends._erf_gen --check`).
GELU and its gradient call that loop from one C pass each (`gelu_op`, backends/numpy.py).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

_KIND = {np.dtype(np.float32): 0, np.dtype(np.float64): 1}
_MATH_ERF = np.frompyfunc(math.erf, 1, 1)


def erf(x: Any, out: np.ndarray | None = None, c: Any = None) -> Any:
    """erf of each element of x (an array or a number) into out (a new array of x's dtype
    where None), computed in float64 and rounded once to out's dtype; `c`: the `_halfconv`
    extension, whose loop takes contiguous float32 and float64 arrays (the caller decides
    whether C paths are in use), or None."""
    if out is None:
        array = np.asarray(x)
        result = erf(array, np.empty(array.shape, array.dtype), c)
        return result if np.ndim(x) else array.dtype.type(result[()])
    kind = _KIND.get(out.dtype)
    if (kind is not None and c is not None and type(x) is np.ndarray
            and x.dtype == out.dtype and c.erf_op(kind, out, x)):
        return out
    np.copyto(out, _MATH_ERF(np.asarray(x, np.float64)), casting="unsafe")
    return out
