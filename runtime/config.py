"""Process-wide runtime settings: the aliasing mode, each device's default allocator and
default constant pool.

The environment is read once, when this module is first imported, into `SETTINGS`; the rest
of the runtime asks that object, never `os.environ`, so changing the environment later changes
nothing.

Environment variables:
    BLOCKRT_ALLOCATOR: the name of the allocator every device gets by default (one of
        `allocators.names()`, e.g. "direct" or "caching"; unset or empty: "caching"). The name is
        checked when a default allocator is first needed, so a plugin registered after import
        still counts; an unknown name raises ValueError naming the variable, the value and the
        known names. `runtime.set_default_allocator(...)` overrides it per device.

    BLOCKRT_DEVICE: the device that tensors, constants and graphs use when none is given
        (a spec such as "cpu", "opencl" or "opencl:1"; unset or empty: "cpu"). It is checked
        when first used; `runtime.set_default_device(...)` overrides it.

Example:
    $ BLOCKRT_ALLOCATOR=caching BLOCKRT_DEVICE=opencl python train.py
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import allocators
import backends
from runtime.errors import device_names

if TYPE_CHECKING:
    from allocators import Allocator
    from backends import Device

ALIASING_MODES = ("copy", "raise")

#: The environment variable that names the default allocator.
ALLOCATOR_ENV = "BLOCKRT_ALLOCATOR"
#: The default allocator when the environment names none.
FALLBACK_ALLOCATOR = "caching"
#: The environment variable that names the default device.
DEVICE_ENV = "BLOCKRT_DEVICE"


@dataclass(frozen=True)
class Settings:
    """Configuration read once from the environment (see the module docstring).

    Attributes:
        allocator: the name of the default allocator, not yet checked against the registry.
        allocator_source: where the name came from, for error messages.
    """

    allocator: str = FALLBACK_ALLOCATOR
    allocator_source: str = "built-in default"
    device: str = "cpu"

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Settings:
        """Settings from an environment mapping (os.environ at import time)."""
        name = environ.get(ALLOCATOR_ENV, "").strip()
        device = environ.get(DEVICE_ENV, "").strip() or "cpu"
        if not name:
            return cls(device=device)
        return cls(allocator=name, allocator_source=f"environment variable {ALLOCATOR_ENV}",
                   device=device)

    def default_allocator_name(self) -> str:
        """The default allocator's name, checked against `allocators.names()` now.

        Raises:
            ValueError: no allocator has that name; says where the name came from.
        """
        known = allocators.names()
        if self.allocator not in known:
            raise ValueError(f"{self.allocator_source} is {self.allocator!r}, which names no "
                             f"allocator; known: {', '.join(known)}")
        return self.allocator


#: Read once, here at the edge; the rest of the runtime asks this object.
SETTINGS = Settings.from_environ(os.environ)

_state: dict[str, Any] = {"aliasing": "copy", "device": None}
# NOTE: a device's defaults (its allocator here, its constant pool in runtime.constant) live on
# the device itself, as attributes, not in a table keyed by it: a table would keep every device
# alive, and a device over a framework's queue (backends.from_queue) must go with the framework's
# last use of it. The weak set only lists the devices that have defaults (devices_with).
#: The device attribute that holds its default allocator (see per_device).
_ALLOCATOR = "_blockrt_default_allocator"
_with_defaults: weakref.WeakSet[Device] = weakref.WeakSet()
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


def set_default_device(device: str | Device) -> Device:
    """Make `device` the one used when a tensor, constant or graph names none; returns it."""
    dev = backends.get_device(device)
    _state["device"] = dev
    return dev


def get_default_device() -> Device:
    """The default device: `set_default_device`'s, else BLOCKRT_DEVICE's, else "cpu".

    Raises:
        ValueError / BackendUnavailableError: BLOCKRT_DEVICE names no usable device (the message
            names the variable).
    """
    dev = _state["device"]
    if dev is None:
        try:
            dev = _state["device"] = backends.get_device(SETTINGS.device)
        except (ValueError, backends.BackendUnavailableError) as exc:
            raise type(exc)(f"environment variable {DEVICE_ENV}={SETTINGS.device!r}: "
                            f"{exc}") from exc
    return dev


def check_settings() -> Device:
    """Every setting read from the environment, checked now as its first use would check it:
    the default device (BLOCKRT_DEVICE, unless `set_default_device` chose one) and the default
    allocator's name (BLOCKRT_ALLOCATOR, against `allocators.names()` as they are now). For an
    edge that wants every error before it starts, such as the `blockrt` command. Returns the
    default device.

    Raises:
        ValueError / BackendUnavailableError: a variable names no device or allocator here; the
            message names the variable, its value and what is known.
    """
    device = get_default_device()
    SETTINGS.default_allocator_name()
    return device


def device_or_default(device: str | Device | None) -> Device:
    return backends.get_device(device) if device is not None else get_default_device()


def set_default_allocator(allocator: str | Allocator, device: str | Device | None = None,
                          **options) -> Allocator:
    """Make `allocator` (a registered name or an Allocator) the default for `device` (default:
    the default device).

    Tensors created afterwards on that device without an explicit allocator use it; existing
    tensors keep the allocator they were made with. Returns the allocator now in use.
    """
    dev = device_or_default(device)
    if isinstance(allocator, str):
        allocator = allocators.create(allocator, dev, **options)
    elif not isinstance(allocator, allocators.Allocator):
        raise TypeError(f"set_default_allocator takes a name or an Allocator, "
                        f"got {type(allocator).__name__}")
    elif options:
        raise TypeError("options are only accepted together with an allocator name")
    if allocator.device is not dev:
        where, wanted = device_names(allocator.device, dev)
        raise ValueError(f"allocator {allocator!r} lives on {where}, not on {wanted}")
    with _lock:
        setattr(dev, _ALLOCATOR, allocator)
        _with_defaults.add(dev)
    return allocator


def per_device(attribute: str, dev: Device, make: Callable[[], Any]) -> Any:
    """The device's default named `attribute`, made by `make()` the first time; one maker wins
    when threads race."""
    value = dev.__dict__.get(attribute)
    if value is None:
        with _lock:
            value = dev.__dict__.get(attribute)
            if value is None:
                value = make()
                setattr(dev, attribute, value)
                _with_defaults.add(dev)
    return value


def devices_with(attribute: str) -> dict[Device, Any]:
    """Device -> its default named `attribute`, for every living device that has one."""
    with _lock:
        devices = list(_with_defaults)
    return {dev: dev.__dict__[attribute] for dev in devices if attribute in dev.__dict__}


def get_default_allocator(device: str | Device | None = None) -> Allocator:
    """The default allocator of `device`, created on first use from `SETTINGS.allocator`
    (BLOCKRT_ALLOCATOR, else "caching") unless `set_default_allocator` chose one.

    Raises:
        ValueError: BLOCKRT_ALLOCATOR names no registered allocator.
    """
    dev = device_or_default(device)
    allocator = dev.__dict__.get(_ALLOCATOR)
    if allocator is None:
        allocator = per_device(_ALLOCATOR, dev,
                                lambda: allocators.create(SETTINGS.default_allocator_name(), dev))
    return allocator


def default_allocators() -> dict[Device, Allocator]:
    """Device -> default allocator, for every living device that has one so far."""
    return devices_with(_ALLOCATOR)
