"""The tape: while a graph captures, ops are recorded here instead of running (delayed execution).

`runtime.ops` asks `active()` before it launches a kernel. Inside a capture it hands the tape an
`Instruction` (the kernel call as a function of native views, and every operand as a layout over a
Block) and marks the outputs written, but nothing runs and no block gets memory: blocks made
during the capture stay lazy until the graph has planned where they go (SINGA's buffered ops).
Reading a value back to the host inside a capture is refused with `GraphCaptureError`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from runtime.errors import GraphCaptureError, ReadOnlyError

if TYPE_CHECKING:
    from runtime.block import Block

#: A runtime Tensor, as the annotations here name it: runtime/_tensor.py sits above this module
#: (docs/architecture.md), so it is not imported, not even for a type checker.
Tensor = Any

__all__ = ["Instruction", "Operand", "Tape", "active", "recording"]


@dataclass(frozen=True)
class Operand:
    """A strided layout over a block: what a kernel reads or writes.

    Attributes:
        block: the Block (its memory is decided at replay).
        offset: byte offset of the first element in the block.
        shape, strides: as the native view sees them (strides in bytes; 0 for broadcast axes).
        dtype: the element type.
    """

    block: Block
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: np.dtype

    @property
    def whole(self) -> bool:
        """True when the operand covers its whole block, contiguously, in C order."""
        step = self.dtype.itemsize
        for n, stride in zip(reversed(self.shape), reversed(self.strides)):
            if n != 1 and stride != step:
                return False
            step *= n
        return self.offset == 0 and step == self.block.nbytes


@dataclass
class Instruction:
    """One recorded kernel launch.

    `run(input_views, *output_views)` is the op's kernel call, a pure function of native views
    (Note [closures hold no tensors] in runtime/autograd.py); `scalars` maps argument positions
    to numbers inserted among the input views (as `_launch` does). A "load" instruction copies
    `host` bytes into its one output instead.
    """

    op: str
    policy: str
    inputs: list[Operand]
    outputs: list[Operand]
    run: Callable[..., None] | None = None
    scalars: dict[int, Any] | None = None
    host: np.ndarray | None = None
    phase: str = "forward"
    index: int = 0

    @property
    def kind(self) -> str:
        return "load" if self.host is not None else "kernel"


class Tape:
    """The instructions recorded by one capture, in program order, and the blocks they touch."""

    def __init__(self, first_block_id: int) -> None:
        self.instructions: list[Instruction] = []
        #: blocks with ids >= this one were made during the capture
        self.first_block_id = first_block_id
        #: handles on the blocks that existed before the capture and that it touched, so they
        #: stay alive (and keep their memory) while the graph replays
        self.external: dict[int, Tensor] = {}
        #: blocks made during the capture but not by it (another thread's, holding data)
        self.foreign: set[int] = set()
        #: leaves whose `.grad` backward set during the capture (None before), so that a capture
        #: that fails can take back gradients that only the tape ever wrote
        self.grads_given: list[Tensor] = []
        self.phase = "forward"

    def made_here(self, block: Block) -> bool:
        return block.id >= self.first_block_id and block.id not in self.foreign

    def operand(self, t: Tensor, shape: tuple[int, ...] | None = None) -> Operand:
        offset, shape, strides, _ = t.layout(shape)
        block = t.block
        # NOTE: a block the capture makes holds no memory until the graph plans it; one with
        # memory was made meanwhile by another thread and is outside data, like a parameter
        if block.id >= self.first_block_id and block.allocated and block.id not in self.external:
            self.foreign.add(block.id)
        # NOTE: constants made inside the capture hold real data already: kept like outside ones
        if (block.readonly or not self.made_here(block)) and block.id not in self.external:
            self.external[block.id] = t.detach()
        return Operand(block, offset, shape, strides, t.dtype)

    def record(self, op: str, policy: str, run: Callable[..., None],
               inputs: list[tuple[Tensor, tuple[int, ...]]], outputs: list[Tensor],
               scalars: dict[int, Any] | None) -> None:
        """Record a kernel launch after the same checks a real launch makes."""
        for t, _ in inputs:
            t._check(op)
            t.block.memory_for_read(op)  # NOTE: raises if never written (no memory is needed)
        for t in outputs:
            t._check(op)
            if t.block.readonly:
                raise ReadOnlyError(f"{op} writes to read-only block #{t.block.id}: constants "
                                    f"are immutable")
        self.instructions.append(Instruction(
            op, policy, [self.operand(t, shape) for t, shape in inputs],
            [self.operand(t) for t in outputs], run=run, scalars=scalars or None,
            phase=self.phase, index=len(self.instructions)))
        for t in outputs:
            t.block.mark_written()

    def load(self, t: Tensor, host: np.ndarray) -> None:
        """Record a copy of host data (kept as a copy) into the whole tensor `t`."""
        self.instructions.append(Instruction(
            "load", "never", [], [self.operand(t)], host=np.array(host, copy=True),
            phase=self.phase, index=len(self.instructions)))
        t.block.mark_written()


class _State(threading.local):
    tape: Tape | None = None


_state = _State()


def active() -> Tape | None:
    """The tape of the capture running in this thread, or None."""
    return _state.tape


@contextmanager
def recording(tape: Tape) -> Iterator[Tape]:
    """Record ops into `tape` instead of running them (captures do not nest)."""
    if _state.tape is not None:
        raise GraphCaptureError("a graph is already capturing in this thread; captures do not "
                                "nest (call the inner step outside the outer function)")
    _state.tape = tape
    try:
        yield tape
    finally:
        _state.tape = None


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark the instructions recorded inside as belonging to `name` ("backward", ...)."""
    tape = _state.tape
    if tape is None:
        yield
        return
    previous, tape.phase = tape.phase, name
    try:
        yield
    finally:
        tape.phase = previous


def refuse_read(what: str) -> None:
    """Raise if a capture is running: values do not exist until the graph runs."""
    if _state.tape is not None:
        raise GraphCaptureError(
            f"{what} reads a tensor's value while a graph is capturing, but captured ops have "
            f"not run yet; return the tensor from the function and read it after the call")
