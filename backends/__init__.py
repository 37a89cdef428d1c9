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
import threading

from backends.base import BackendUnavailableError, Device

__all__ = ["BackendUnavailableError", "Device", "available", "get_device", "parse_spec"]

#: kind -> "module:Class". The only place backends are named; no discovery by file name.
BACKENDS: dict[str, str] = {
    "cpu": "backends.numpy:NumpyDevice",
    "opencl": "backends.opencl:OpenCLDevice",
    "cuda": "backends.cuda:CudaDevice",
}

_devices: dict[str, Device] = {}
_lock = threading.Lock()


def parse_spec(spec: str) -> tuple[str, int]:
    """Split "kind" or "kind:index" into (kind, index); raise ValueError on anything else."""
    if not isinstance(spec, str):
        raise TypeError(f"a device spec is a string such as 'cpu' or 'opencl:1', "
                        f"got {spec!r} of type {type(spec).__name__}")
    kind, _, index = spec.strip().lower().partition(":")
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
