"""blockrt-buddy: a power-of-two buddy allocator, shipped as a third-party blockrt plugin.

Installing this package registers `BuddyAllocator` under the entry point group
`blockrt.allocators` as "buddy", so blockrt finds it by name::

    import allocators

    alloc = allocators.create("buddy", "cpu", arena_nbytes=1 << 20)
    a = alloc.allocate(3000)        # a 4 KiB block: a.size == 4096
    alloc.free(a)
    alloc.empty_cache()             # wholly free arenas go back to the device

Memory comes in arenas from `Allocator._device_alloc`, each a power of two of bytes. A block of
order k holds `min_block << k` bytes and starts at a multiple of its size inside its arena; its
buddy is the block at `offset ^ size`. Allocation takes the smallest free block that fits and
splits it in halves down to the order asked for; a free merges the block with its buddy for as
long as the buddy is free too. A request larger than `arena_nbytes` gets an arena of its own.
"""

from __future__ import annotations

from typing import Any

from allocators import Allocation, Allocator
from backends.base import check_nbytes

__all__ = ["BuddyAllocator"]


def _power_of_two(value: Any, what: str) -> int:
    value = check_nbytes(value, what)
    if value == 0 or value & (value - 1):
        raise ValueError(f"{what} must be a power of two, got {value}")
    return value


class _Arena:
    """One device allocation split into buddy blocks."""

    __slots__ = ("free", "nbytes", "raw", "top", "used")

    def __init__(self, raw: Any, nbytes: int, top: int) -> None:
        self.raw = raw
        self.nbytes = nbytes
        #: the order of the whole arena
        self.top = top
        #: free[k] holds the offsets of the free blocks of order k
        self.free: list[set[int]] = [set() for _ in range(top + 1)]
        self.free[top].add(0)
        #: the offset of every handed-out block -> its order
        self.used: dict[int, int] = {}


class BuddyAllocator(Allocator):
    """Power-of-two buddy allocation over one or more arenas ("buddy" in the registry).

    Args:
        device: a Device or spec (default "cpu").
        arena_nbytes: bytes per arena, a power of two (default 1 MiB).
        min_block: the smallest block, a power of two and a multiple of the device's alignment
            (default: the larger of 64 and `device.alignment`, which is 64 on the CPU and
            CL_DEVICE_MEM_BASE_ADDR_ALIGN on OpenCL, 128 bytes on PoCL): blocks start at
            multiples of it, so every allocation starts aligned.

    Raises:
        TypeError, ValueError: a size is not an int, or not a power of two, or
            arena_nbytes < min_block, or min_block is not a multiple of the device's alignment.

    Example:
        >>> alloc = BuddyAllocator("cpu", arena_nbytes=4096)
        >>> a, b = alloc.allocate(1000), alloc.allocate(100)
        >>> (a.size, b.size, alloc.stats()["reserved_bytes"])
        (1024, 128, 4096)
        >>> alloc.free(a)
        >>> alloc.free(b)
        >>> alloc.empty_cache()
        >>> alloc.stats()["reserved_bytes"]
        0
    """

    name = "buddy"

    def __init__(self, device: Any = None, arena_nbytes: int = 1 << 20,
                 min_block: int | None = None) -> None:
        super().__init__(device)
        align = self.device.alignment
        self.arena_nbytes = _power_of_two(arena_nbytes, "arena_nbytes")
        self.min_block = _power_of_two(max(64, align) if min_block is None else min_block,
                                       "min_block")
        if self.min_block % align:
            raise ValueError(f"min_block ({self.min_block}) must be a multiple of the alignment "
                             f"of {self.device.name} ({align} bytes): blocks start at multiples "
                             f"of min_block, and every allocation must start aligned")
        if self.arena_nbytes < self.min_block:
            raise ValueError(f"arena_nbytes ({arena_nbytes}) is smaller than min_block "
                             f"({min_block})")
        #: id(arena.raw) -> arena
        self._arenas: dict[int, _Arena] = {}

    # ------------------------------------------------------------------ hooks
    def _order(self, nbytes: int) -> int:
        """The order of the smallest block holding `nbytes` (0 bytes take a minimum block)."""
        blocks = max(-(-nbytes // self.min_block), 1)
        return (blocks - 1).bit_length()

    def _allocate(self, nbytes: int) -> Allocation:
        order = self._order(nbytes)
        arena, found = self._smallest_free(order)
        if arena is None:
            arena = self._new_arena(order)
            found = arena.top
        offset = arena.free[found].pop()
        while found > order:  # split: keep the low half, free the high one
            found -= 1
            arena.free[found].add(offset + (self.min_block << found))
        arena.used[offset] = order
        return Allocation(self.device, arena.raw, offset, nbytes, self.min_block << order)

    def _allocation_size(self, nbytes: int) -> int:
        return self.min_block << self._order(nbytes)

    def _free(self, allocation: Allocation) -> None:
        arena = self._arenas[id(allocation.raw)]
        offset = allocation.offset
        order = arena.used.pop(offset)
        while order < arena.top:  # merge with the buddy for as long as it is free
            buddy = offset ^ (self.min_block << order)
            if buddy not in arena.free[order]:
                break
            arena.free[order].remove(buddy)
            offset = min(offset, buddy)
            order += 1
        arena.free[order].add(offset)

    def _empty_cache(self) -> None:
        for key, arena in list(self._arenas.items()):
            if not arena.used:
                del self._arenas[key]
                self._device_free(arena.raw, arena.nbytes)

    def _largest_free_block(self) -> int:
        orders = [order for arena in self._arenas.values()
                  for order, offsets in enumerate(arena.free) if offsets]
        return self.min_block << max(orders) if orders else 0

    # ------------------------------------------------------------------ helpers
    def _smallest_free(self, order: int) -> tuple[_Arena | None, int]:
        """(arena, order) of the smallest free block of at least `order`; (None, -1) if none."""
        best: tuple[_Arena | None, int] = (None, -1)
        for arena in self._arenas.values():
            for found in range(order, arena.top + 1):
                if arena.free[found]:
                    if best[0] is None or found < best[1]:
                        best = (arena, found)
                    break
        return best

    def _new_arena(self, order: int) -> _Arena:
        nbytes = max(self.arena_nbytes, self.min_block << order)
        raw = self._device_alloc(nbytes)  # MemoryError goes up; the base reports it with numbers
        arena = _Arena(raw, nbytes, (nbytes // self.min_block).bit_length() - 1)
        self._arenas[id(raw)] = arena
        return arena

    # ------------------------------------------------------------------ self-checks
    def check_invariants(self) -> None:
        """The base checks, plus: blocks tile each arena exactly, are aligned to their size,
        no two free buddies are left unmerged, and used blocks match the live allocations."""
        super().check_invariants()
        live = {(id(a.raw), a.offset, a.size) for a in self.live_allocations()}
        with self._lock:
            reserved = self._counters["reserved_bytes"]  # a read-only view of the base's counters
            if not (reserved == sum(arena.nbytes for arena in self._arenas.values())):
                raise AssertionError(f"reserved_bytes {reserved} is not the sum of the arenas")
            for arena in self._arenas.values():
                self._check_arena(arena)
            used = {(id(arena.raw), offset, self.min_block << order)
                    for arena in self._arenas.values() for offset, order in arena.used.items()}
            if not (used == live):
                raise AssertionError(f"used blocks {sorted(used - live)} have no live allocation; "
                                     f"live allocations {sorted(live - used)} have no block")

    def _check_arena(self, arena: _Arena) -> None:
        blocks = sorted([(offset, self.min_block << order, "free")
                         for order, offsets in enumerate(arena.free) for offset in offsets]
                        + [(offset, self.min_block << order, "used")
                           for offset, order in arena.used.items()])
        position = 0
        for offset, size, state in blocks:
            if not (offset == position):
                raise AssertionError(f"{state} block at {offset} leaves a gap or overlaps "
                                     f"(expected {position})")
            if not (offset % size == 0):
                raise AssertionError(f"{state} block of {size} bytes at {offset} is misaligned")
            position += size
        if not (position == arena.nbytes):
            raise AssertionError(f"blocks cover {position} of {arena.nbytes} bytes")
        for order, offsets in enumerate(arena.free[:arena.top]):
            for offset in offsets:
                buddy = offset ^ (self.min_block << order)
                if not (buddy not in offsets):
                    raise AssertionError(f"free buddies at {offset} and {buddy} not merged")

    def __repr__(self) -> str:
        return (f"<BuddyAllocator on {self.device.name}: {len(self._arenas)} arenas of "
                f"{self.arena_nbytes} bytes, min_block {self.min_block}>")
