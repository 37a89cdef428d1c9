"""Errors the runtime raises; each message names the tensor, block or op and the numbers."""

from __future__ import annotations


class UseAfterFreeError(RuntimeError):
    """A tensor was used after its handle was released or its block's memory was freed."""


class UninitializedMemoryError(RuntimeError):
    """A tensor was read before anything was written to its block (blocks allocate lazily)."""


class AliasingError(ValueError):
    """An op's output overlaps one of its inputs in a way the op cannot compute safely
    (raised in `runtime.set_aliasing("raise")` mode)."""


class ReadOnlyError(RuntimeError):
    """A write to an immutable (constant) tensor."""


class AutogradError(RuntimeError):
    """backward() cannot compute a gradient: nothing requires one, the output is not a scalar,
    a tensor saved for backward was modified in place, or the graph was already freed."""


class GraphCaptureError(RuntimeError):
    """Something a captured function did cannot be recorded (reading a value while capturing,
    nested captures) or a replay cannot go on (its inputs do not match)."""


def device_names(first: object, second: object) -> tuple[str, str]:
    """The names of two devices for a message that says they differ.

    Two Device instances may share a name (two NumPy devices are both "cpu"); then each name
    gets the instance's id, so that "cpu and cpu" does not read as the same device.
    """
    a, b = first.name, second.name  # type: ignore[attr-defined]
    if a == b and first is not second:
        a = f"{a} (Device instance {id(first):#x})"
        b = f"{b} (another Device instance, {id(second):#x})"
    return a, b
