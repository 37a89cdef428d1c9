"""Devices and backends: one `Device` interface over NumPy (CPU) and, later, OpenCL and CUDA.

Backends are listed in one explicit table and imported only when asked for, so a missing optional
package (pyopencl, cupy) costs nothing until that backend is requested.

Example:
    >>> import backends
    >>> backends.available()
    ['cpu']
    >>> backends.get_device("cpu").name
    'cpu'
"""

from __future__ import annotations

import importlib
import sys
import threading
import weakref
from typing import Any

from backends.base import BackendUnavailableError, Capabilities, Deferred, Device

__all__ = ["BackendUnavailableError", "Capabilities", "Deferred", "Device", "available",
           "from_queue", "get_device", "parse_spec"]

#: kind -> "module:Class". The only place backends are named; no discovery by file name.
BACKENDS: dict[str, str] = {
    "cpu": "backends.numpy:NumpyDevice",
    "opencl": "backends.opencl:OpenCLDevice",
    "cuda": "backends.cuda:CudaDevice",
}
#: kind -> (module, class names) of the framework queues `from_queue` takes. A queue of a
#: package means the package is imported already, so telling them apart imports nothing.
QUEUE_TYPES: dict[str, tuple[str, tuple[str, ...]]] = {
    "opencl": ("pyopencl", ("CommandQueue",)),
    "cuda": ("cupy.cuda", ("Stream", "ExternalStream")),
}

_devices: dict[str, Device] = {}
# NOTE: weak on the device, not the queue (pyopencl queues take no weak references, and the
# device holds its queue): the cache never keeps a framework's queue alive.
#: (kind, index, queue handle) -> the device over that queue, while anything uses the device.
_over_queues: weakref.WeakValueDictionary[tuple, Device] = weakref.WeakValueDictionary()
_lock = threading.Lock()


def parse_spec(spec: str) -> tuple[str, int]:
    """Split "kind" or "kind:index" into (kind, index); raise ValueError on anything else."""
    if not isinstance(spec, str):
        raise TypeError(f"a device spec is a string such as 'cpu' or 'opencl:1', "
                        f"got {spec!r} of type {type(spec).__name__}")
    kind, _, index = spec.strip().lower().partition(":")
    if "@" in index:
        raise ValueError(f"{spec!r} is the name of a device made by backends.from_queue(queue) "
                         f"over a framework's queue, and such devices are not in the registry "
                         f"of get_device; keep the device object from_queue returned (pass it "
                         f"wherever a device is asked for; get_device(device) returns it), or "
                         f"call from_queue(queue) again for the same device")
    if kind not in BACKENDS:
        raise ValueError(f"unknown device {spec!r}; known backends: {', '.join(sorted(BACKENDS))}")
    if not index and not spec.endswith(":"):
        return kind, 0
    if not index.isdigit():
        raise ValueError(f"device index in {spec!r} must be a non-negative integer")
    return kind, int(index)


def _load(kind: str) -> type:
    module_name, _, class_name = BACKENDS[kind].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailableError(
            f"backend {kind!r} is not available: importing {module_name} failed ({exc}); "
            f"install blockrt[{kind}] for its optional dependencies") from exc
    return getattr(module, class_name)


def get_device(spec: str | Device = "cpu") -> Device:
    """Return the device for `spec` ("cpu", "opencl:1", "cuda:0"); a Device passes through.

    The same spec always gives the same Device object, so per-device settings (such as the default
    allocator) attach to it.

    Raises:
        ValueError: the spec names no known backend, or an index the backend does not have.
        BackendUnavailableError: the backend's package or hardware is missing.
    """
    if isinstance(spec, Device):
        return spec
    kind, index = parse_spec(spec)
    key = f"{kind}:{index}"
    with _lock:
        device = _devices.get(key)
        if device is None:
            cls = _load(kind)
            count = cls.device_count()
            if count == 0:
                raise BackendUnavailableError(f"backend {kind!r} found no device on this machine")
            if index >= count:
                raise ValueError(f"device {spec!r} does not exist: backend {kind!r} has "
                                 f"{count} device(s), indices 0..{count - 1}")
            device = _devices[key] = cls(index)
    return device


def _queue_kind(queue: Any) -> str:
    """The backend kind whose framework queues include `queue`, or a TypeError naming its type."""
    for kind, (module_name, class_names) in QUEUE_TYPES.items():
        module = sys.modules.get(module_name)
        if module is not None and isinstance(queue, tuple(getattr(module, name)
                                                          for name in class_names)):
            return kind
    raise TypeError(f"from_queue takes a pyopencl.CommandQueue or a cupy.cuda.Stream, got "
                    f"{queue!r:.80} of type {type(queue).__module__}.{type(queue).__qualname__}")


def from_queue(queue: Any) -> Device:
    """A device over a framework's own queue: a `pyopencl.CommandQueue` (the device uses its
    context and runs every copy and kernel on it) or a `cupy.cuda.Stream` (the stream's GPU,
    running on that stream).

    blockrt's allocators, tensors, graphs and training then work on the framework's queue, and
    the framework's arrays (on that queue, in that context) and blockrt's memory can be
    exchanged (`allocators.interop.pyopencl_allocator`, native views). The same queue always
    gives the same Device object while that device is in use (a weak cache: a queue nobody
    uses any more is not kept alive by blockrt). Its name is the device's plus the queue, e.g.
    "opencl:0@queue:0x55d0c2a3b4c0"; `get_device(device)` returns it. It is a device of its
    own: its tensors do not mix with those of `get_device("opencl:0")` (another context).

    Raises:
        TypeError: `queue` is not a pyopencl.CommandQueue or a CuPy stream.
        ValueError: an out-of-order OpenCL queue (blockrt relies on in-order execution; pass an
            in-order queue of the same context), or a queue whose device blockrt cannot see.
        BackendUnavailableError: the backend cannot run here.

    Example:
        >>> import pyopencl as cl, backends                       # doctest: +SKIP
        >>> queue = cl.CommandQueue(cl.create_some_context())     # doctest: +SKIP
        >>> dev = backends.from_queue(queue)                      # doctest: +SKIP
        >>> dev.queue is queue, backends.from_queue(queue) is dev # doctest: +SKIP
        (True, True)
    """
    kind = _queue_kind(queue)
    cls = _load(kind)
    index, handle = cls.locate_queue(queue)
    key = (kind, index, handle)
    with _lock:
        device = _over_queues.get(key)
        if device is None:
            device = _over_queues[key] = cls(index, queue)
    return device


def available() -> list[str]:
    """The backend kinds that can run here, in table order (e.g. ["cpu", "opencl"])."""
    kinds = []
    for kind in BACKENDS:
        try:
            if _load(kind).device_count() > 0:
                kinds.append(kind)
        except Exception:
            continue
    return kinds
