"""The eager fast path: the common case of an elementwise op, run by the optional C extension
`runtime._dispatch`.

Note [the eager fast path]: `ops._elementwise` first offers the op to `_dispatch.elementwise(op,
out, operands)` (as does `ops._sub_scaled`, an optimizer's update, with its three operands a, b
and the number, once it has refused an input that records gradients). The C code takes it only
when every check of the Python path would pass without a side effect of its own: exact Tensors
over plain Blocks of their generation that hold data (use after free and unwritten reads go to
Python, which raises), plain numbers within the dtype, one device and dtype (float32 or float64,
float16 or bfloat16 where the device has `fast_half_kernels`; any dtype for copy), shapes that
broadcast, and an `out=` of the result's shape, dtype and device that is writable, does not
overlap itself (as cached by `Tensor.has_internal_overlap`) and shares a block with an input
only as the identical view or on disjoint cached byte spans (Note [blocks that may share memory]
in docs/aliasing.md: any other overlap gets the exact test and its copy-or-raise policy in
Python). It then does what the Python path does, in the same order: a fresh result from
`Tensor._fresh` on the first input's allocator, numbers as `dtype.type(x)` (as float32 for a
two-byte float, ops._scalar), the kernel of the device's `Capabilities.fast_kernels` table
(`fast_half_kernels` for a two-byte float, whose kernels keep
Note [two-byte floats compute in float32] in backends/base.py) on the tensors' native views
(NumPy broadcasts, so inputs are not broadcast first; the kernels give the same elements either
way), under Note [IEEE results, no floating-point signals] in backends/base.py, then the out
block's version and written flag, and the autograd record through `ops._record_elementwise`.
Anything else (a graph capture, out= while recording gradients, imported memory, a constant's
result, a device without a table) returns None before anything changed, and the Python path
runs.

So the Python path stays complete and is the specification: BLOCKRT_PURE_PYTHON=1 turns the
fast path off with the allocator's, and tests/test_fastpath.py runs random programs of ops both
ways and compares every value, error, version and allocator statistic. A new check in
`ops._elementwise` or `_prepare_out` must be made in `runtime/_dispatch.c` too, or make it fall
back; a new field it reads is a slot of Tensor or Block, found by name at `configure`.

How it is wired (STYLE.md rule 21): each Python twin asks `backends.accelerated` for the
extension where it is defined and binds the C function in its own module: `autograd.record`,
`autograd._engine` and `autograd._release`, `_tensor._release` (what `Tensor.__del__` calls),
and `ops._fast`, `ops._fast_launch` and `ops._fast_reduce` (from what `load` returns). Until
`load` has configured the extension, and while `python_only()` holds, every C function hands
its call back to its twin (`set_enabled` in runtime/_dispatch.c).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from backends import accelerated, base
from runtime import autograd, tape
from runtime._tensor import _RELEASED, _UNSET, Tensor
from runtime.block import Block, _ids

__all__ = ["ACCELERATED", "load", "python_only"]

#: The extension, or None where the eager fast path is off (`backends.accelerated` says why).
_dispatch = accelerated.load("runtime._dispatch")
#: True when ops run their common case in C (the extension is built, BLOCKRT_PURE_PYTHON is
#: off and NumPy's error state can be set as the kernels need).
ACCELERATED = _dispatch is not None and base._FP_STATE is not None


def load(record: Callable[[str, Tensor, Any], None], copy: Callable[..., Tensor]) -> Any:
    """Configure the C extension and turn it on; return its module, or None when the fast path
    is off. `record` is how an elementwise op's autograd record is made; `copy` what the C
    backward engine copies with (it accumulates with `autograd._accumulate`, as Python's).
    Its `elementwise(op, out, operands)` is the fast `ops._elementwise`; its `launch(op,
    never, out, shape, dtype, inputs, kernel, extra)` is the fast `_prepare_out` + `_launch`
    of an op whose operands Python checked; its `reduce` the fast sum and mean that record
    nothing. The C `backward`, `record` and `release` that autograd and Tensor bound at their
    import run from now on."""
    if _dispatch is None:
        return None
    # NOTE: the C record and release hand back to these until the extension is on, so they
    # are configured whether or not it can be turned on
    _dispatch.configure_autograd(autograd.Node, autograd._unbroadcast, autograd._accumulate,
                                 copy, autograd.python_record)
    if not ACCELERATED:
        accelerated.refuse("runtime._dispatch", f"NumPy {np.__version__} keeps no per-context "
                           f"floating-point error state that C can set (numpy._core.umath)")
        return None
    # NOTE: a number meets a two-byte float as float32 (ops._scalar), so its type and range
    dtypes = (np.dtype(np.float32), np.dtype(np.float64), *base.HALVES)
    largest = float(np.finfo(np.float32).max)
    _dispatch.configure(Tensor, Block, autograd._mode, tape._state, base._FP_STATE,
                        base._FP_IGNORE, dtypes, (np.float32, np.float64, np.float32, np.float32),
                        (largest, float(np.finfo(np.float64).max), largest, largest),
                        Tensor._fresh, record, _ids, _UNSET, _RELEASED)
    _dispatch.set_enabled(True)
    return _dispatch


@contextlib.contextmanager
def python_only() -> Iterator[None]:
    """Run ops on the Python path alone inside the block (in this process, every thread), as
    BLOCKRT_PURE_PYTHON=1 would: for benchmarks and differential tests. The C functions stay
    bound and hand every call back to their Python twins."""
    if _dispatch is None:
        yield
        return
    previous = _dispatch.set_enabled(False)
    try:
        yield
    finally:
        _dispatch.set_enabled(previous)
