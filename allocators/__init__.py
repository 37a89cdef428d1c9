"""Allocators as plugins: one small interface, built-ins by name, third parties by entry point.

Example:
    >>> import allocators
    >>> "direct" in allocators.names()
    True
    >>> alloc = allocators.create("direct", "cpu")
    >>> alloc.free(alloc.allocate(256))

`ACCELERATED` is True when the caching allocator's C hot path (allocators._speedups) is in use;
the environment variable BLOCKRT_PURE_PYTHON=1 turns it off (`backends.accelerated`, the one
table of C paths).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib import metadata
from typing import Any

from allocators._core import ACCELERATED
from allocators.adaptors import (
    Adaptor,
    FaultInjectionAdaptor,
    LimitAdaptor,
    StatisticsAdaptor,
    TraceAdaptor,
)
from allocators.base import Allocation, Allocator, InvalidFreeError, OutOfMemoryError, format_bytes
from allocators.direct import DirectAllocator

__all__ = ["ACCELERATED", "Adaptor", "Allocation", "Allocator", "DirectAllocator",
           "FaultInjectionAdaptor", "InvalidFreeError", "LimitAdaptor", "OutOfMemoryError",
           "StatisticsAdaptor", "TraceAdaptor", "ENTRY_POINT_GROUP", "create", "format_bytes",
           "names", "register"]

#: Third-party allocators register a factory `(device, **options) -> Allocator` under this group.
ENTRY_POINT_GROUP = "blockrt.allocators"

#: name -> "module:attribute" for the allocators that ship with blockrt.
BUILTINS: dict[str, str] = {
    "direct": "allocators.direct:DirectAllocator",
    "caching": "allocators.caching:CachingAllocator",
}

_registered: dict[str, Callable[..., Allocator]] = {}


def register(name: str, factory: Callable[..., Allocator]) -> None:
    """Make `factory(device, **options)` available as `create(name, ...)` in this process."""
    if not isinstance(name, str):
        raise TypeError(f"an allocator name is a string, got {type(name).__name__}")
    if not name:
        raise ValueError("an allocator name cannot be empty")
    if not callable(factory):
        raise TypeError(f"the factory for allocator {name!r} must be callable, got {factory!r}")
    _registered[name] = factory


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def names() -> list[str]:
    """Every allocator name `create` accepts: built-ins, registered ones and entry-point plugins."""
    return sorted(set(BUILTINS) | set(_registered) | set(_entry_points()))


def _factory(name: str) -> Callable[..., Allocator]:
    if name in _registered:
        return _registered[name]
    if name in BUILTINS:
        module_name, _, attr = BUILTINS[name].partition(":")
        return getattr(importlib.import_module(module_name), attr)
    plugin = _entry_points().get(name)
    if plugin is None:
        raise ValueError(f"unknown allocator {name!r}; known: {', '.join(names())}")
    try:
        return plugin.load()
    except Exception as exc:
        raise ImportError(f"allocator plugin {name!r} ({plugin.value}, entry point group "
                          f"{ENTRY_POINT_GROUP}) failed to load: {exc}") from exc


def create(name: str, device: Any = None, **options: Any) -> Allocator:
    """Build the allocator called `name` on `device` (a spec or Device; default "cpu").

    Keyword options are the allocator's own.

    Raises:
        ValueError: no allocator has that name (the message lists the known ones).
        ImportError: a plugin's entry point failed to load.
        TypeError: the factory did not return an Allocator.
    """
    if not isinstance(name, str):
        raise TypeError(f"an allocator name is a string, got {type(name).__name__}")
    allocator = _factory(name)(device, **options)
    if not isinstance(allocator, Allocator):
        raise TypeError(f"allocator factory {name!r} returned {type(allocator).__name__}, "
                        f"not an allocators.Allocator")
    return allocator
