"""Process-wide runtime settings: the aliasing mode and each device's default allocator."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import allocators
import backends

if TYPE_CHECKING:
    from allocators import Allocator
    from backends import Device

ALIASING_MODES = ("copy", "raise")

_state = {"aliasing": "copy"}
_default_allocators: dict[Device, Allocator] = {}  # NOTE: keyed by the Device object itself
_lock = threading.Lock()


def set_aliasing(mode: str) -> str:
    """Choose what an op does when its output overlaps an input unsafely; returns the old mode.

    "copy" (default): compute into a temporary, then write it to the output.
    "raise": raise runtime.AliasingError naming the op and the overlapping operands.
    """
    if mode not in ALIASING_MODES:
        raise ValueError(f"aliasing mode must be one of {ALIASING_MODES}, got {mode!r}")
    old, _state["aliasing"] = _state["aliasing"], mode
    return old


def get_aliasing() -> str:
    """The current aliasing mode, "copy" or "raise"."""
    return _state["aliasing"]


def set_default_allocator(allocator: str | Allocator, device: str | Device | None = None,
                          **options) -> Allocator:
    """Make `allocator` (a registered name or an Allocator) the default for `device` (default cpu).

    Tensors created afterwards on that device without an explicit allocator use it; existing
    tensors keep the allocator they were made with. Returns the allocator now in use.
    """
    dev = backends.get_device(device if device is not None else "cpu")
    if isinstance(allocator, str):
        allocator = allocators.create(allocator, dev, **options)
    elif not isinstance(allocator, allocators.Allocator):
        raise TypeError(f"set_default_allocator takes a name or an Allocator, "
                        f"got {type(allocator).__name__}")
    elif options:
        raise TypeError("options are only accepted together with an allocator name")
    if allocator.device is not dev:
        raise ValueError(f"allocator {allocator!r} lives on {allocator.device.name}, "
                         f"not on {dev.name}")
    with _lock:
        _default_allocators[dev] = allocator
    return allocator


def get_default_allocator(device: str | Device | None = None) -> Allocator:
    """The default allocator of `device`, created as "direct" on first use."""
    dev = backends.get_device(device if device is not None else "cpu")
    allocator = _default_allocators.get(dev)
    if allocator is None:
        with _lock:
            allocator = _default_allocators.get(dev)
            if allocator is None:
                allocator = _default_allocators[dev] = allocators.create("direct", dev)
    return allocator


def default_allocators() -> dict[Device, Allocator]:
    """Device -> default allocator, for every device that has one so far."""
    with _lock:
        return dict(_default_allocators)
