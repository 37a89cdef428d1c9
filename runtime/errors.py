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
