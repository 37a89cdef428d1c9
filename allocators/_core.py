"""The records and state that allocators.base and allocators.caching share with the C hot path.

The caching allocator's most common cases (a cache hit, and a free that coalesces into a size
already listed) run in C, in the optional extension `allocators._speedups`; everything else runs
in Python. For C and Python to work on one state, the records and the allocator state
are types of that extension when it is built: the fields of an `Allocation`, of a caching
`_Block`, its `FreeList`s, `_Pool` and `_Idle`, and an allocator's counters, serial counter,
live set and lock. This module defines the same names in Python, then takes the C ones when it
can (as CPython's `heapq` does with `_heapq`).

The extension is asked for from `backends.accelerated` (the one table of C paths and the
BLOCKRT_PURE_PYTHON switch, read once, as `allocators` is first imported): where it is off, the
pure-Python classes below are used. `ACCELERATED` says which are in use.

Note [the hot path runs no Python]: the C code (`_caching_allocate` / `_caching_free` in
`allocators/_speedups.c`) runs only while the allocator's lock is free, keeps the GIL from its
first check to its last change, and in between calls no Python code (no method, property or
hook of a Python class), creates no object the garbage collector tracks (a collection may run a
tensor's `__del__`, which frees into this very allocator) and changes nothing until every check
that can fail has passed. So, without taking the lock, it is one atomic step to the Python path,
and a request it cannot serve that way goes to the Python implementation (`_allocate_slow` /
`_free_slow`: `Allocator.allocate` / `free`) with nothing half done. The Python path stays
complete: it is what runs under BLOCKRT_PURE_PYTHON, and `tests/test_speedups.py` runs both
paths on the same requests and compares every field after every step. What that allows:
- anything rare (a new size, a new segment, pruning, trimming, out of memory, bad input) goes in
  Python only: the C code falls back to it, so adding there costs the hot path nothing;
- a field the C code reads is declared twice, in the records below and in the C struct with its
  member table, with the same name and type; in the C build the allocator state's `_small`,
  `_large` and `_idle` take only records of their kind (checked when set), so the C code need
  not check them;
- the common case touches no dictionary it can avoid: a free block knows its free list
  (`Block.free_list`, a `FreeList` whose `first` the C code moves), and the whole free segments
  are a list linked through their head blocks (`IdleRecord`), so a hit on a cached block and its
  free look up one size and move pointers;
- the books of `Allocator.allocate` / `free` (owner, serial, live set, counters) are
  `AllocatorState._book_allocation` / `_book_free`, defined below and in C, where the hot path
  keeps the same books with the same code; new policy there (a check, a counter, a hook) is
  either done by the C code as well, or turns the hot path off while it applies, as
  queue-ordered reuse does (its `_hot_off` clears `_hot` and sets `_ordered` until no
  allocation is recorded or pending); a subclass that overrides `_allocate` or `_free` never
  gets the hot path at all.
"""

from __future__ import annotations

import threading
from typing import Any

from backends import accelerated

__all__ = ["ACCELERATED", "COUNTERS", "AllocationRecord", "AllocatorState", "Block", "FreeList",
           "IdleRecord", "Lock", "PoolRecord", "speedups"]

#: The counters every allocator keeps, by stats key; `stats()` adds the derived ones.
COUNTERS = ("allocated_bytes", "peak_allocated_bytes", "requested_bytes", "peak_requested_bytes",
            "reserved_bytes", "peak_reserved_bytes", "peak_cached_bytes", "num_allocs",
            "num_frees", "cache_misses", "num_ooms", "num_device_allocs", "num_device_frees")

Lock = threading.Lock


class AllocationRecord:
    """The fields of an `allocators.Allocation` (see there)."""

    __slots__ = ("device", "raw", "offset", "nbytes", "size", "owner", "serial", "live",
                 "upstream", "handle")

    def __init__(self, device: Any, raw: Any, offset: int, nbytes: int, size: int,
                 upstream: Any = None) -> None:
        self.device = device
        self.raw = raw
        self.offset = offset
        self.nbytes = nbytes
        self.size = size
        self.upstream = upstream
        self.owner = None
        self.serial = 0
        self.live = False
        self.handle = None


class AllocatorState:
    """What an allocator's hot path reads and writes: counters, serials, live set, lock, and
    the books `Allocator.allocate` and `free` keep in them.

    Every counter of COUNTERS is an attribute named "_" + its key. `_last_serial` is the serial
    of the last allocation handed out; `_live` maps serial -> live Allocation. `_hot` turns on
    the C hot path of the caching allocator (always False here); `_ordered` says that some
    allocation is recorded on another queue or pending (`Allocator.record_queue`).
    """

    def __init__(self) -> None:
        self._lock = Lock()
        self._live: dict[int, Any] = {}
        self._last_serial = 0
        self._hot = False
        self._ordered = False
        # NOTE: counters are plain attributes, not a dict: on the hot path an attribute update
        # costs half a dict update. `cache_hits` is derived (allocs - misses).
        for key in COUNTERS:
            setattr(self, f"_{key}", 0)

    # NOTE: the books of Allocator.allocate and free, one call each, so that the C build keeps
    # them in C: there, Python reaches a counter (a C field) only through a generic attribute
    # lookup and a new int, about 25 times a pair. The hot path keeps the same books.
    def _book_allocation(self, allocation: Any, nbytes: int, device_allocs: int) -> None:
        """Allocator.allocate's books for `allocation`, just made by `_allocate` for a request
        of `nbytes` with the lock held: its owner, serial and live flag, the live set, and the
        counters (a cache miss if `_num_device_allocs` moved from `device_allocs`). Changes
        nothing if it raises."""
        serial = self._last_serial + 1
        allocated = self._allocated_bytes + allocation.size
        requested = self._requested_bytes + nbytes
        self._live[serial] = allocation  # NOTE: the last step that can fail
        self._last_serial = allocation.serial = serial
        allocation.owner = self
        allocation.live = True
        self._num_allocs += 1
        if self._num_device_allocs != device_allocs:
            self._cache_misses += 1
        self._allocated_bytes = allocated
        self._requested_bytes = requested
        if allocated > self._peak_allocated_bytes:
            self._peak_allocated_bytes = allocated
        if requested > self._peak_requested_bytes:
            self._peak_requested_bytes = requested
        cached = self._reserved_bytes - allocated  # a new segment may leave some cached
        if cached > self._peak_cached_bytes:
            self._peak_cached_bytes = cached

    def _book_free(self, allocation: Any) -> None:
        """Allocator.free's books for `allocation`, off the live set and given to `_free` with
        the lock held: the counters."""
        self._num_frees += 1
        allocated = self._allocated_bytes = self._allocated_bytes - allocation.size
        self._requested_bytes -= allocation.nbytes
        cached = self._reserved_bytes - allocated
        if cached > self._peak_cached_bytes:
            self._peak_cached_bytes = cached


class Block:
    """A run of bytes inside a segment of the caching allocator: used (behind one live
    allocation) or free.

    The blocks of a segment form a doubly linked list by address (`prev`, `next`). The first
    block of a segment, at offset 0, is its head: blocks merge into the lower neighbour and
    splits cut from the top, so the head record lives as long as the segment and names it.
    A free block is also on the free list of its size in its pool: `free_list` is that
    `FreeList`, `prev_free` and `next_free` its neighbours there (see `caching._Pool`). A used
    block has None as `prev_free` and `next_free`, and as `free_list` the list of its size that
    its pool had when it was handed out, or None: while that list is listed, its free goes
    straight back to it. The
    head of a whole free segment is also in the allocator's LRU list of them (`prev_idle`,
    `next_idle`, see `caching._Idle`); every other block has None there. `pool` is its
    `caching._Pool`.
    """

    # NOTE: no __init__: a Python-level __init__ call costs more than the stores, and
    # `caching._split` makes one block per split. `_new_block` and `_split` set every field.
    __slots__ = ("raw", "offset", "size", "pool", "free", "prev", "next", "prev_free",
                 "next_free", "free_list", "prev_idle", "next_idle")

    raw: Any
    offset: int
    size: int
    pool: Any
    free: bool
    prev: Block | None
    next: Block | None
    prev_free: Block | None
    next_free: Block | None
    free_list: FreeList | None
    prev_idle: Block | None
    next_idle: Block | None


class FreeList:
    """The free blocks of one size in one pool of the caching allocator: `first`, the most
    recently freed, then on through the blocks' `next_free`.

    `listed` says whether it is its pool's list of `size` (in `pool.buckets`): a list the pool
    pruned while it was empty is not, and a used block may still name it as its `free_list`.
    """

    __slots__ = ("size", "first", "listed")

    def __init__(self, size: int) -> None:
        self.size = size
        self.first: Block | None = None
        self.listed = True


class PoolRecord:
    """The fields of a pool of the caching allocator (see `caching._Pool`)."""

    __slots__ = ("name", "min_split", "buckets", "sizes")


class IdleRecord:
    """The fields of the caching allocator's LRU list of whole free segments (see
    `caching._Idle`): the head blocks `oldest` and `newest`, None when it is empty."""

    __slots__ = ("oldest", "newest")


#: The C hot path's extension, or None where Python does it all (`backends.accelerated`).
speedups: Any = accelerated.load("allocators._speedups")
if speedups is not None:
    from allocators._speedups import (
        AllocationRecord,
        AllocatorState,
        Block,
        FreeList,
        IdleRecord,
        Lock,
        PoolRecord,
    )

#: True when the C hot path (allocators._speedups) is in use.
ACCELERATED = speedups is not None
