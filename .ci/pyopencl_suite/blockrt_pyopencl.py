"""A pytest plugin that runs pyopencl's own test suite with its arrays' memory from blockrt.

Every `pyopencl.array.Array` made without an allocator or data of its own gets its memory from
one blockrt allocator on the OpenCL device, through `allocators.interop.pyopencl_allocator`
bound to the array's queue, and every context the suite asks for is the blockrt device's
(pyopencl's test context factory is redirected), so the suite's queues and blockrt's memory
share one context. The allocator is named by BLOCKRT_SUITE_ALLOCATOR (default "caching";
"none" leaves the arrays' memory to pyopencl, in the same shared context: the baseline).
BLOCKRT_SUITE_UNBOUND=1 binds every hook to the device's own queue instead of the array's. At
the end the allocator's stats are printed and its invariants checked.

Run (see .ci/pyopencl_suite/run): PYTHONPATH=.ci/pyopencl_suite pytest -p blockrt_pyopencl ...
"""

from __future__ import annotations

import gc
import os
from typing import Any

import pyopencl as cl
import pyopencl.array as cla
import pyopencl.tools as cl_tools

import allocators
import backends
from allocators.interop import pyopencl_allocator
from backends.accelerated import flag

KIND = os.environ.get("BLOCKRT_SUITE_ALLOCATOR", "").strip() or "caching"
if KIND != "none" and KIND not in allocators.names():
    raise ValueError(f"environment variable BLOCKRT_SUITE_ALLOCATOR={KIND!r}: expected none or "
                     f"one of {', '.join(allocators.names())}")
#: Set to 1 (or true, yes, on; the words of every BLOCKRT_* switch): hooks bound to the
#: device's queue whatever queue the array is on (the misuse that queue-ordered reuse exists
#: for: the suite's own queues are not recorded).
UNBOUND = flag("BLOCKRT_SUITE_UNBOUND")
_device = backends.get_device("opencl")
_allocator = None if KIND == "none" else allocators.create(KIND, _device)
_hooks: dict[int | None, Any] = {}


def _hook(queue: Any) -> Any:
    """The hook bound to `queue` (the device's queue for arrays made without one)."""
    key = None if queue is None else queue.int_ptr
    if key not in _hooks:  # NOTE: keeps the suite's queues alive: fine for one run
        _hooks[key] = pyopencl_allocator(_allocator, None if UNBOUND else queue)
    return _hooks[key]



def _context(self: Any) -> Any:
    cl_tools.clear_first_arg_caches()  # NOTE: as pyopencl's factory does for a new context
    gc.collect()
    return _device.context


cl_tools._ContextFactory.__call__ = _context

if _allocator is not None:
    _array_init = cla.Array.__init__

    def _init(self: Any, cq: Any, shape: Any, dtype: Any, order: str = "C",
              allocator: Any = None, data: Any = None, *args: Any, **kwargs: Any) -> None:
        queue = cq if isinstance(cq, cl.CommandQueue) else None
        context = queue.context if queue is not None else cq
        # NOTE: pyopencl's tools make a context of their own now and then (match_dtype_to_c_struct):
        # blockrt's memory cannot serve it, so those arrays keep pyopencl's
        if allocator is None and data is None and context == _device.context:
            allocator = _hook(queue)
        _array_init(self, cq, shape, dtype, order, allocator, data, *args, **kwargs)

    cla.Array.__init__ = _init


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _allocator is None:
        terminalreporter.write_line("blockrt: arrays' memory from pyopencl (baseline)")
        return
    _device.synchronize()
    stats = _allocator.stats()
    terminalreporter.write_line(
        f"blockrt: {KIND} allocator on {_device.name}: {stats['num_allocs']} allocations, "
        f"hit rate {stats['hit_rate']:.3f}, {len(_allocator.live_allocations())} still live, "
        f"{_allocator.pending_frees()} freed and pending on the suite's queues")
    _allocator.check_invariants()
