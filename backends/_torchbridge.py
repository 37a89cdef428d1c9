"""PyTorch's malloc and free served by a blockrt allocator (`backends.cuda.use_with_torch`).

PyTorch's pluggable CUDA allocator (`torch.cuda.memory.CUDAPluggableAllocator`) loads a malloc
and a free from a compiled library, by path and name. blockrt's library is
`backends._torchalloc` (backends/_torchalloc.c): its two entry points forward to the ctypes
callbacks a `Bridge` registers, `Bridge.malloc` and `Bridge.free`, which allocate from and give
back to a blockrt allocator. Nothing here imports PyTorch or CuPy, so the bridge runs (and is
tested) on any device; `use_with_torch` adds PyTorch's side on CUDA.

Queue order, as `use_with_cupy` keeps it (Note [queue-ordered reuse] in backends/base.py): memory
handed to a stream other than the device's own waits for the device's stream first, and is
recorded as used on that stream, so the allocator reuses it only once that stream's work on
it is done.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

from backends import accelerated
from backends.base import BackendUnavailableError

#: PyTorch's signatures: malloc(size, device, stream) -> pointer; free(ptr, size, device, stream)
MALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
#: the names PyTorch looks the two entry points up by
MALLOC_NAME, FREE_NAME = "blockrt_torch_malloc", "blockrt_torch_free"


#: blockrt's compiled entry points, or None where that C path is off (asked for once, here)
_entry_points = accelerated.load("backends._torchalloc")


def library_path() -> str:
    """The path of blockrt's compiled entry points (`backends._torchalloc`, a C path of
    backends/accelerated.py).

    Raises:
        BackendUnavailableError: its C path is off (not built, or BLOCKRT_PURE_PYTHON), with
            the table's reason.
    """
    module = _entry_points
    if module is None:
        (path,) = [p for p in accelerated.paths() if p.module == "backends._torchalloc"]
        raise BackendUnavailableError(
            f"backends._torchalloc, the compiled malloc and free that PyTorch's pluggable "
            f"allocator loads, is {path.why}")
    return module.__file__


class Bridge:
    """Serves the entry points' malloc and free from `allocator` once `install()`ed.

    Args:
        allocator: a blockrt allocator; its device's index must be the one PyTorch asks for.
        queue_of: for a device with queues, the queue object of a stream handle PyTorch
            passes (CUDA: a CuPy `ExternalStream`); memory for another stream than the
            device's own is then ordered and recorded as above.

    Attributes:
        errors: what malloc or free raised: nothing may unwind through PyTorch's C++, so
            malloc returns NULL (PyTorch raises its out-of-memory error) and the exception
            waits here, newest last.
        path: the library PyTorch loads.
    """

    def __init__(self, allocator: Any, queue_of: Callable[[int], Any] | None = None) -> None:
        self.allocator = allocator
        self.queue_of = queue_of
        self.path = library_path()
        self.errors: list[BaseException] = []
        self._library = ctypes.CDLL(self.path)
        self._library.blockrt_torch_hooks.argtypes = [MALLOC, FREE]
        self._library.blockrt_torch_malloc.restype = ctypes.c_void_p
        self._library.blockrt_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int,
                                                       ctypes.c_void_p]
        self._library.blockrt_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t,
                                                     ctypes.c_int, ctypes.c_void_p]
        #: address -> the allocation lent there
        self._lent: dict[int, Any] = {}
        self._lock = threading.Lock()
        # NOTE: the callbacks live as long as the bridge: C holds only their addresses
        self._callbacks = (MALLOC(self._malloc), FREE(self._free))

    def install(self) -> None:
        """Make the entry points serve this bridge (one bridge per process at a time)."""
        self._library.blockrt_torch_hooks(*self._callbacks)

    def uninstall(self) -> None:
        """Detach: malloc then returns NULL, free does nothing; what is lent stays lent."""
        self._library.blockrt_torch_hooks(MALLOC(), FREE())

    def malloc(self, size: int, device: int = 0, stream: int | None = None) -> int:
        """What PyTorch's malloc gets: the entry point itself, called as PyTorch calls it."""
        return int(self._library.blockrt_torch_malloc(size, device, stream) or 0)

    def free(self, ptr: int, size: int, device: int = 0, stream: int | None = None) -> None:
        """The entry point of free, called as PyTorch calls it."""
        self._library.blockrt_torch_free(ptr, size, device, stream)

    @property
    def lent_bytes(self) -> int:
        """Bytes lent to PyTorch and not given back (as asked for)."""
        with self._lock:
            return sum(a.nbytes for a in self._lent.values())

    def _malloc(self, size: int, device: int, stream: int | None) -> int | None:
        try:
            return self._allocate(size, device, stream or 0)
        except BaseException as exc:  # NOTE: nothing may unwind through C (the docstring)
            self.errors.append(exc)
            return None

    def _allocate(self, size: int, device: int, stream: int) -> int:
        own = self.allocator.device
        index = getattr(own, "index", 0)
        if device != index:
            raise ValueError(f"PyTorch asked for {size} bytes on device {device}, but this "
                             f"blockrt allocator lends memory of {own.name}")
        queue = (self.queue_of(stream) if own.capabilities.queues and self.queue_of is not None
                 else None)
        allocation = self.allocator.allocate_for(size, queue)  # NOTE: the module docstring
        with self._lock:
            self._lent[allocation.ptr] = allocation
        return allocation.ptr

    def _free(self, ptr: int | None, size: int, device: int, stream: int | None) -> None:
        try:
            with self._lock:
                allocation = self._lent.pop(ptr or 0, None)
            if allocation is None:
                raise ValueError(f"PyTorch freed {size} bytes at {ptr or 0:#x}, which this "
                                 f"bridge did not lend: nothing was freed")
            self.allocator.free(allocation)
        except BaseException as exc:  # NOTE: nothing may unwind through C
            self.errors.append(exc)
