"""`Block`: logical memory that allocates lazily, counts references and catches use after free.

A Block knows its size, device and allocator but holds no memory until something first writes
to it (SINGA's lazy allocation). Every tensor and view over it holds one reference; when the last
reference goes, the memory returns to the allocator at once (refcount recycling). Each time the
memory goes back the block's `generation` moves on, and a handle from an older generation raises
`UseAfterFreeError` on any later use.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable
from typing import Any

from allocators import Allocation, Allocator, InvalidFreeError, format_bytes
from runtime.errors import ReadOnlyError, UninitializedMemoryError, UseAfterFreeError

_ids = itertools.count(1)
#: Publishes a block's first allocation (see `Block.memory_for_write`); held for a few
#: bytecodes, never across an allocator call.
_first_write = threading.Lock()


class Block:
    """Lazily allocated, reference-counted, generation-checked device memory.

    Attributes:
        nbytes: the logical size in bytes.
        allocator: where the memory comes from and goes back to.
        generation: moves on every time the memory is freed; handles record it.
        version: moves on at every write; shared by every tensor and view over this block.
        readonly: writes raise ReadOnlyError (constants).
        on_return: None, or a callable `on_return(block)` run once, right after the memory next
            goes back to the allocator; it is cleared before it runs (a constant pool uses it to
            forget the block).

    Example:
        >>> import allocators
        >>> block = Block(64, allocators.create("direct"))
        >>> block.allocated                      # nothing is allocated before the first write
        False
    """

    __slots__ = ("nbytes", "allocator", "device", "id", "generation", "version", "readonly",
                 "on_return", "lock", "exports", "_allocation", "_written", "_refs",
                 "__weakref__")

    def __init__(self, nbytes: int, allocator: Allocator) -> None:
        self.nbytes = nbytes
        self.allocator = allocator
        self.device = allocator.device
        self.id = next(_ids)
        self.generation = 0
        self.version = 0
        self.readonly = False
        self.on_return: Callable[[Block], None] | None = None
        #: set by owners that hand the block to new handles from other threads (the constant
        #: pool): references then move under it, so a handle never revives a block whose last
        #: reference is going
        self.lock: Any = None
        #: DLPack exports of the block's memory that a consumer still holds (runtime.dlpack)
        self.exports = 0
        self._allocation: Allocation | None = None
        self._written = False
        self._refs = 0

    # ------------------------------------------------------------------ state
    @property
    def allocated(self) -> bool:
        """True while the block holds memory from its allocator."""
        return self._allocation is not None

    @property
    def written(self) -> bool:
        """True once something was written since the memory was (re)allocated."""
        return self._written

    @property
    def refcount(self) -> int:
        """How many live tensor handles refer to this block."""
        return self._refs

    # ------------------------------------------------------------------ references
    def acquire(self) -> int:
        """Add a reference; returns the generation the new handle belongs to."""
        lock = self.lock
        if lock is None:
            self._refs += 1
            return self.generation
        with lock:
            self._refs += 1
            return self.generation

    def release(self, generation: int) -> None:
        """Drop a reference taken at `generation`; the last one returns the memory.

        A handle from an older generation (its memory already freed) drops nothing.
        """
        lock = self.lock
        # NOTE: the body is written twice, not moved into a helper: this runs for every tensor
        # handle that goes, and blocks without a lock should pay one attribute read, no call
        if lock is None:
            if generation == self.generation:
                self._refs -= 1
                if self._refs <= 0:
                    self._last_reference_gone()
            return
        with lock:
            if generation == self.generation:
                self._refs -= 1
                if self._refs <= 0:
                    self._last_reference_gone()

    def _last_reference_gone(self) -> None:
        if self._refs < 0:
            self._refs = 0
            raise InvalidFreeError(
                f"block #{self.id} ({format_bytes(self.nbytes)}): release() without a matching "
                f"acquire() (generation {self.generation}, no reference left to drop); every "
                f"release must pair with the acquire() that returned that generation")
        self._return_memory()

    def free(self) -> None:
        """Return the memory now, whatever references remain: every existing handle goes stale
        and raises UseAfterFreeError when used. The block can be written (and allocated) again
        through handles acquired afterwards.

        Raises:
            BufferError: another library still holds a DLPack export of the memory (it would
                read and write memory handed to someone else); nothing is freed.
        """
        if self.exports:
            raise BufferError(
                f"free(): block #{self.id} ({format_bytes(self.nbytes)}) has {self.exports} live "
                f"DLPack export(s): another library's array still uses its memory, which free() "
                f"would hand to someone else; drop those arrays first (the memory goes back when "
                f"the last of them and of the tensors goes)")
        with self.lock or contextlib.nullcontext():  # NOTE: not a hot path, unlike release
            self._refs = 0
            self._return_memory()

    def _return_memory(self) -> None:
        allocation, self._allocation = self._allocation, None
        self._written = False
        self.generation += 1
        hook, self.on_return = self.on_return, None  # one-shot; unused hooks cost one test
        if allocation is not None:
            self.allocator.free(allocation)
        if hook is not None:
            hook(self)

    # ------------------------------------------------------------------ access
    def check(self, generation: int, what: str = "tensor") -> None:
        """Raise UseAfterFreeError unless a handle of `generation` is still valid."""
        if generation != self.generation:
            raise UseAfterFreeError(
                f"{what} uses block #{self.id} ({format_bytes(self.nbytes)}) after its memory was "
                f"freed (handle generation {generation}, block generation {self.generation})")

    def memory_for_read(self, what: str = "tensor") -> Allocation:
        """The allocation to read from; raises UninitializedMemoryError if never written."""
        if not self._written:
            raise UninitializedMemoryError(
                f"{what} reads block #{self.id} ({format_bytes(self.nbytes)}) before anything was "
                f"written to it; blocks allocate lazily and hold no data until first written")
        return self._allocation  # type: ignore[return-value]

    def memory_for_write(self, what: str = "tensor") -> Allocation:
        """The allocation to write to, allocated now if this is the first use."""
        if self.readonly:
            raise ReadOnlyError(f"{what} writes to read-only block #{self.id} "
                                f"({format_bytes(self.nbytes)}): constants are immutable; "
                                f"copy one with runtime.ops.copy() to get a writable tensor")
        allocation = self._allocation
        if allocation is None:
            allocation = self._first_allocation()
        return allocation

    def _first_allocation(self) -> Allocation:
        """Allocate and publish the block's memory. Two threads may race here on one lazy
        block: each allocates outside any lock, one publishes its allocation, and the other
        gives its own back and writes into the published one, so no write is lost and no
        memory leaks."""
        fresh = self.allocator.allocate(self.nbytes)
        with _first_write:
            allocation = self._allocation
            if allocation is None:
                allocation = self._allocation = fresh
                fresh = None
        if fresh is not None:
            self.allocator.free(fresh)
        return allocation

    def mark_written(self) -> None:
        """Record a completed write: the data is readable and the version moves on."""
        self._written = True
        self.version += 1

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else "unallocated"
        return (f"<Block #{self.id} {format_bytes(self.nbytes)} on {self.device.name} {state} "
                f"refs={self._refs} gen={self.generation} v={self.version}>")
