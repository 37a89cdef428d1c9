"""The dtypes a tensor holds, and which of them the ops compute in.

Storage: every dtype frameworks exchange through DLPack except complex: bool, the signed and
unsigned integers of 8 to 64 bits, float16, bfloat16 and float32 / float64. bfloat16 is
`ml_dtypes.bfloat16`, the NumPy dtype JAX and TensorFlow use (NumPy has none of its own). NumPy
gives it kind "V" and no `np.finfo`, so code here asks `kind()` and `finfo()` instead.

Compute: the arithmetic ops take float32 and float64 (`COMPUTE`) and refuse the other dtypes by
name; `ops.cast` converts between any two of them under stated rules, and `ops.copy` moves any
dtype's bits. Every backend stores every dtype: a kernel that only moves or converts items needs
no arithmetic of the dtype (OpenCL loads and stores half with `vload_half` / `vstore_half`,
which need no extension, and bfloat16 as the upper half of a float's bits).

Example:
    >>> from runtime import dtypes
    >>> half = dtypes.BFLOAT16
    >>> dtypes.kind(half), dtypes.is_float(half), half in dtypes.COMPUTE
    ('f', True, False)
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["BFLOAT16", "COMPUTE", "DTYPES", "FLOATS", "HALVES", "finfo", "first_changed",
           "is_float", "kind"]

#: NumPy dtype of bfloat16 (through ml_dtypes).
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
#: The floating dtypes a tensor holds, narrowest first.
FLOATS = (np.dtype("float16"), BFLOAT16, np.dtype("float32"), np.dtype("float64"))
#: The two-byte floats: stored, converted and moved, not computed in (yet).
HALVES = FLOATS[:2]
#: The dtypes the arithmetic ops (runtime.ops) compute in.
COMPUTE = FLOATS[2:]
#: Every dtype a tensor may hold.
DTYPES = (np.dtype("float32"), np.dtype("float64"), np.dtype("int32"), np.dtype("int64"),
          np.dtype("uint8"), np.dtype("bool"), np.dtype("float16"), BFLOAT16,
          np.dtype("int8"), np.dtype("int16"), np.dtype("uint16"), np.dtype("uint32"),
          np.dtype("uint64"))


def kind(dtype: np.dtype) -> str:
    """NumPy's kind letter ("b", "i", "u", "f"), with "f" for bfloat16 in either byte order
    (NumPy says "V")."""
    if dtype.kind == "V" and dtype.itemsize == 2 and dtype.newbyteorder("=") == BFLOAT16:
        return "f"
    return dtype.kind


def is_float(dtype: np.dtype) -> bool:
    return kind(dtype) == "f"


def finfo(dtype: np.dtype) -> Any:
    """`np.finfo` of a float dtype, bfloat16 included."""
    return ml_dtypes.finfo(dtype) if dtype == BFLOAT16 else np.finfo(dtype)


def first_changed(src: np.dtype, dst: np.dtype) -> int | None:
    """The integer of least magnitude that the integer or bool dtype `src` holds and `dst` does
    not hold exactly, or None when `dst` holds every value of `src`: the rule of `ops.cast`.

    A float holds the integers up to 2**(nmant + 1) exactly (2049 is the first that float16
    rounds, 257 bfloat16's, 2**24 + 1 float32's, 2**53 + 1 float64's); an integer dtype those of
    its range, bool 0 and 1.

    Example:
        >>> from runtime import dtypes
        >>> dtypes.first_changed(np.dtype("int8"), np.dtype("float16")) is None
        True
        >>> dtypes.first_changed(np.dtype("int64"), np.dtype("float32"))
        16777217
    """
    low, high = _range(src)
    if is_float(dst):
        first = 2 ** (finfo(dst).nmant + 1) + 1
        return first if high >= first else -first if low <= -first else None
    dst_low, dst_high = _range(dst)
    beyond = [v for v in (dst_low - 1, dst_high + 1) if low <= v <= high]
    return min(beyond, key=abs) if beyond else None


def _range(dtype: np.dtype) -> tuple[int, int]:
    """The least and greatest value of an integer or bool dtype."""
    if dtype.kind == "b":
        return 0, 1
    info = np.iinfo(dtype)
    return int(info.min), int(info.max)
