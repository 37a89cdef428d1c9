"""Lending a blockrt allocator to other array libraries.

`pyopencl_allocator(alloc)` is an `allocator=` for pyopencl (`pyopencl.array.Array`,
`pyopencl.array.empty`, ...), for an allocator on an OpenCL device. CuPy's counterpart lives with
its backend: `backends.cuda.use_with_cupy(alloc)`. pyopencl is imported only when a hook runs.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from allocators.base import Allocation, Allocator
from backends.base import check_nbytes


class _Lease:
    """Owns one blockrt allocation lent to pyopencl; the buffer handed out holds it."""

    __slots__ = ("allocator", "allocation", "__weakref__")

    def __init__(self, allocator: Allocator, allocation: Allocation) -> None:
        self.allocator = allocator
        self.allocation = allocation


def _sub_buffer(allocation: Allocation) -> Any:
    """A new cl.Buffer over exactly the bytes of `allocation`.

    The device's own native view (a pyopencl Array) says which cl.Buffer holds the allocation
    and where, whatever the backend wraps its raw memory in.
    """
    import pyopencl as cl

    view = allocation.device.array_view(allocation.raw, allocation.offset, (allocation.nbytes,),
                                        np.uint8, (1,))
    buffer, offset = view.base_data, view.offset
    parent = buffer.get_info(cl.mem_info.ASSOCIATED_MEMOBJECT)
    if parent is not None:  # NOTE: OpenCL has no sub-buffer of a sub-buffer
        offset += buffer.get_info(cl.mem_info.OFFSET)
        buffer = parent
    align = max(buffer.context.devices[0].mem_base_addr_align // 8, 1)
    if offset % align:
        raise ValueError(f"a pyopencl buffer cannot start at byte {offset} of a cl.Buffer: "
                         f"OpenCL sub-buffers start at multiples of {align} bytes "
                         f"(CL_DEVICE_MEM_BASE_ADDR_ALIGN); give the allocator that alignment")
    return buffer.get_sub_region(offset, allocation.nbytes)


def pyopencl_allocator(allocator: Allocator, queue: Any = None) -> Callable[[int], Any]:
    """An `allocator=` for pyopencl that takes its memory from blockrt's `allocator`.

    Each call `hook(nbytes)` allocates from `allocator` and returns a new `cl.Buffer` (a
    sub-buffer of the allocation's segment, at its offset) that pyopencl uses as an array's
    data. When pyopencl drops the buffer the allocation goes back with `allocator.free`.

    The hook is bound to one queue, as pyopencl's own `ImmediateAllocator` is: the queue its
    arrays are used on, `queue`, by default the device's home queue (`device.queue`). Memory
    is queue-ordered (Note [queue-ordered reuse] in backends/base.py): for a queue other than
    the home queue, `queue` first waits on the device for what the home queue has queued (the
    memory's earlier users), and the memory is recorded as used on `queue`, so that once freed
    it is handed out again only after an event on `queue` says its commands have run; on the
    home queue, reuse is immediate. An array also used on a third queue needs
    `record_queue(array, that_queue)` before it goes.

    The allocator's device must make pyopencl arrays as native views (blockrt's OpenCL backend),
    and allocations must start at multiples of the device's CL_DEVICE_MEM_BASE_ADDR_ALIGN.

    Raises:
        TypeError: `allocator` is not a blockrt Allocator; `queue` is not a CommandQueue.
        ValueError: `allocator` is not on an OpenCL device (its device is named); `queue` is in
            another context.
        TypeError, ValueError (on a call): the size is not an int, or negative; the allocation
            is not aligned for an OpenCL sub-buffer.

    Example:
        >>> import allocators, backends, pyopencl.array                # doctest: +SKIP
        >>> alloc = allocators.create("caching", "opencl")             # doctest: +SKIP
        >>> hook = pyopencl_allocator(alloc, queue)                    # doctest: +SKIP
        >>> x = pyopencl.array.zeros(queue, (1024,), "float32", allocator=hook)  # doctest: +SKIP
    """
    if not isinstance(allocator, Allocator):
        raise TypeError(f"pyopencl_allocator needs a blockrt Allocator, got "
                        f"{type(allocator).__name__}")
    device = allocator.device
    if device.name.partition(":")[0] != "opencl":
        raise ValueError(f"pyopencl_allocator needs an allocator on an OpenCL device; "
                         f"{allocator!r} is on {device.name} ({type(device).__name__})")
    home = device.home_queue
    if queue is not None and device.queue_key(queue) == device.queue_key(home):
        queue = None  # the home queue needs no join

    def hook(nbytes: int) -> Any:
        nbytes = check_nbytes(nbytes, "pyopencl_allocator hook: size")
        # NOTE: OpenCL has no empty buffers
        allocation = allocator.allocate_for(max(nbytes, 1), queue)
        try:
            buffer = _sub_buffer(allocation)
        except BaseException:
            allocator.free(allocation)
            raise
        lease = _Lease(allocator, allocation)
        weakref.finalize(lease, allocator.free, allocation)
        # NOTE: cl.Buffer takes no weak references but has a __dict__: the lease lives (and the
        # allocation stays out) exactly as long as the buffer does.
        buffer._blockrt_lease = lease
        return buffer

    return hook


def record_queue(array: Any, queue: Any) -> None:
    """Note that memory from a `pyopencl_allocator` hook is used on `queue` too, so that once
    freed it waits for `queue`'s commands before anyone gets it again (`Allocator.record_queue`,
    PyTorch's `record_stream`).

    `array` is a pyopencl Array whose data came from the hook, or the hook's `cl.Buffer`.

    Raises:
        TypeError: `array` holds no memory from a blockrt hook; `queue` is not a CommandQueue.
        ValueError: `queue` is in another context.
    """
    buffer = getattr(array, "base_data", array)
    lease = getattr(buffer, "_blockrt_lease", None)
    if not isinstance(lease, _Lease):
        raise TypeError(f"record_queue needs a pyopencl Array or Buffer made by "
                        f"pyopencl_allocator; {type(array).__name__} holds no blockrt memory")
    lease.allocator.record_queue(lease.allocation, queue)
