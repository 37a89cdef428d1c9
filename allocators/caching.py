"""The caching allocator: size classes, best fit, split and coalesce, LRU trimming, OOM retry.

Freed memory stays reserved and serves later requests without asking the device again (DL4J's
caching layer, PyTorch's CUDACachingAllocator, CuPy's memory pool). The layout follows PyTorch:

- A request is rounded up by a size class policy (`allocators.sizeclass`) to its block size.
- Blocks of at most `small_size` (1 MiB) are cut from 2 MiB "small" segments; larger blocks come
  from "large" segments: 20 MiB for blocks under 10 MiB (so several share one), else the block
  rounded up to 2 MiB. The two pools never lend to each other.
- A free block that fits is found best-fit: an exact-size hit first, then the smallest larger
  size. The part not needed is split off as a free block, unless it is too small to be worth it.
- A freed block coalesces with free neighbours at once, so a segment never holds two adjacent
  free blocks, and a segment whose blocks are all free is one free block again.
- Whole free segments are kept in least-recently-freed order; past `max_cached_bytes` cached,
  the oldest go back to the device. `empty_cache()` returns all of them.
- When the device (or `limit_bytes`) refuses a new segment, the cache is emptied and the
  segment asked for once more; then the base class raises `OutOfMemoryError` with the numbers.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterator
from typing import Any

from allocators._core import Block, FreeList, IdleRecord, PoolRecord, speedups
from allocators.base import Allocation, Allocator, format_bytes
from allocators.sizeclass import SizeClass, get_size_class
from backends.base import Device, check_nbytes

__all__ = ["CachingAllocator"]

_MiB = 1 << 20
#: Small blocks are packed into segments of this size (PyTorch's kSmallBuffer).
SMALL_SEGMENT = 2 * _MiB
#: Large blocks under MEDIUM_LIMIT share segments of MEDIUM_SEGMENT bytes (kLargeBuffer) ...
MEDIUM_SEGMENT = 20 * _MiB
MEDIUM_LIMIT = 10 * _MiB
#: ... and larger ones get a segment of their own, rounded up to this (kRoundLarge).
LARGE_ROUND = 2 * _MiB
#: A best-fit search that steps over this many empty size buckets sweeps them all away.
_PRUNE_AFTER = 16
#: How new segments are sized (see CachingAllocator).
SEGMENT_POLICIES = ("exact", "pytorch")
#: Request sizes whose block size is remembered (the memo starts over when full).
_ROUNDED_MEMO = 4096


#: A run of bytes inside a segment (see `allocators._core.Block`, a C struct when the
#: accelerator is built, so the C hot path reads and moves blocks too).
_Block = Block


def _new_block(raw: Any, offset: int, size: int, pool: _Pool) -> _Block:
    """A free block, linked to no neighbour, in no free list and not in the LRU."""
    block = _Block()
    block.raw = raw
    block.offset = offset
    block.size = size
    block.pool = pool
    block.free = True
    block.prev = block.next = block.prev_free = block.next_free = None
    block.free_list = block.prev_idle = block.next_idle = None
    return block


class _Pool(PoolRecord):
    """The free blocks of one pool ("small" or "large"), found by size.

    `buckets` maps a block size to the `FreeList` of that size: its `first` block, most
    recently freed, starts a doubly linked list through the blocks' `prev_free` / `next_free`
    (`first` is None when no block of that size is free), and each block on it names it as its
    `free_list`. `sizes` is the sorted list of the bucket keys, for the best-fit search.
    Pushing, popping and removing a block are O(1) and allocate nothing once its size is
    listed; removing needs no lookup at all.
    """

    # NOTE: the fields are PoolRecord's, which the C hot path reads too:
    # Note [the hot path runs no Python] in allocators/_core.py
    __slots__ = ()

    def __init__(self, name: str, min_split: int) -> None:
        self.name = name
        #: a free block is split only if the part left over is at least this many bytes
        self.min_split = min_split
        # NOTE: emptied buckets stay (and their sizes in `sizes`) so an alloc/free loop of one
        # size never re-sorts; the best-fit search steps over them and prunes them in bulk.
        self.buckets: dict[int, _Block | None] = {}
        self.sizes: list[int] = []

    def push(self, block: _Block) -> None:
        """Put the free `block` first on the free list of its size (listed if new)."""
        size = block.size
        free_list = self.buckets.get(size)
        if free_list is None:
            free_list = self.buckets[size] = FreeList(size)
            insort(self.sizes, size)
        first = free_list.first
        block.prev_free = None
        block.next_free = first
        if first is not None:
            first.prev_free = block
        free_list.first = block
        block.free_list = free_list

    def remove(self, block: _Block) -> None:
        """Take the free `block` off its free list (it keeps naming the list)."""
        before, after = block.prev_free, block.next_free
        if before is None:
            block.free_list.first = after  # it was the first
        else:
            before.next_free = after
        if after is not None:
            after.prev_free = before
        block.prev_free = block.next_free = None

    def pop(self, size: int) -> _Block | None:
        """Remove and return the most recently freed block of exactly `size` bytes, or None."""
        free_list = self.buckets.get(size)
        block = None if free_list is None else free_list.first
        if block is not None:
            self.remove(block)
        return block

    def take_best_fit(self, size: int) -> _Block | None:
        """Remove and return a free block of the smallest size >= `size`, or None."""
        sizes, buckets = self.sizes, self.buckets
        start = index = bisect_left(sizes, size)
        end = len(sizes)
        while index < end:  # NOTE: a while loop costs a third of a for over a range here
            block = buckets[sizes[index]].first
            if block is not None:
                self.remove(block)
                if index - start > _PRUNE_AFTER:
                    self.prune()
                return block
            index += 1
        if end - start > _PRUNE_AFTER:
            self.prune()
        return None

    def prune(self) -> None:
        """Forget the sizes that have no free block (their lists are no longer `listed`)."""
        buckets = self.buckets
        for free_list in buckets.values():
            if free_list.first is None:
                free_list.listed = False
        self.sizes = [size for size in self.sizes if buckets[size].listed]
        self.buckets = {size: buckets[size] for size in self.sizes}

    def largest(self) -> int:
        for size in reversed(self.sizes):
            if self.buckets[size].first is not None:
                return size
        return 0

    def free_blocks(self) -> list[_Block]:
        """Every block on the free lists, walking each list from its first block."""
        blocks = []
        for free_list in self.buckets.values():
            block = free_list.first
            while block is not None:
                blocks.append(block)
                block = block.next_free
        return blocks


class _Idle(IdleRecord):
    """The whole free segments of a caching allocator, least recently freed first: a doubly
    linked list of their head blocks through `prev_idle` / `next_idle`, from `oldest` to
    `newest`. Appending and removing are O(1) and allocate nothing; iterating goes oldest first.
    """

    # NOTE: the fields are IdleRecord's, which the C hot path moves too:
    # Note [the hot path runs no Python] in allocators/_core.py
    __slots__ = ()

    def __init__(self) -> None:
        self.oldest = self.newest = None

    def __contains__(self, head: _Block) -> bool:
        return head.prev_idle is not None or self.oldest is head

    def __bool__(self) -> bool:
        return self.oldest is not None

    def __iter__(self) -> Iterator[_Block]:
        head = self.oldest
        while head is not None:
            yield head
            head = head.next_idle

    def append(self, head: _Block) -> None:
        """Make the head of a segment that just became wholly free the newest."""
        last = self.newest
        head.prev_idle = last
        head.next_idle = None
        if last is None:
            self.oldest = head
        else:
            last.next_idle = head
        self.newest = head

    def discard(self, head: _Block) -> None:
        """Take `head` out, if it is in."""
        before, after = head.prev_idle, head.next_idle
        if before is None and self.oldest is not head:  # NOTE: `head not in self`, inlined
            return
        if before is None:
            self.oldest = after
        else:
            before.next_idle = after
        if after is None:
            self.newest = before
        else:
            after.prev_idle = before
        head.prev_idle = head.next_idle = None


def _hot_path(cls: type[CachingAllocator]) -> type[CachingAllocator]:
    """`cls`, its `allocate` / `free` the C hot path's where `allocators._speedups` is in use
    (`backends.accelerated`), else left as they are (Allocator's): the class decorator that
    says, at the class, which route `alloc.allocate(n)` takes.

    The C functions (`_caching_allocate` / `_caching_free` of allocators/_speedups.c) serve what
    the class's own hooks would, and call `_allocate_slow` / `_free_slow` (Allocator's) for the
    rest: Note [the hot path runs no Python] in allocators/_core.py.
    """
    if speedups is not None:
        # NOTE: method descriptors of `cls` itself, made once the class exists, not of
        # AllocatorState, where the C functions live: CPython 3.11 specializes
        # `alloc.allocate(n)` into a direct C call only when `alloc` is exactly of the
        # descriptor's class (unspecialized, a call cost 35 ns more here)
        cls.allocate, cls.free = speedups.caching_methods(cls)
    return cls


@_hot_path
class CachingAllocator(Allocator):
    """Keeps freed memory for reuse: size classes, best fit, split/coalesce, LRU ("caching").

    Args:
        device: a Device or spec ("cpu" when None).
        size_classes: a policy name from `allocators.sizeclass.SIZE_CLASSES` ("granule",
            "pow2", "mantissa") or a `SizeClass`; its granule must be a multiple of the device's
            alignment. Every block, and so every allocation, starts at a multiple of it.
        max_cached_bytes: bound on free-but-reserved bytes; past it, whole free segments go back
            to the device, least recently freed first (None: no bound). Free space inside
            segments that still hold live blocks cannot go back, so it may exceed the bound.
        limit_bytes: bound on reserved bytes (None: only the device's memory), like PyTorch's
            per-process memory fraction. Near the limit a new segment is cut to the block's size.
        segments: how big a new segment is. "exact" (default): just the block that needs it,
            so a workload that repeats its sizes (a training loop) reserves what it uses at its
            peak, and every later request is an exact-size hit. "pytorch": 2 MiB segments shared
            by small blocks, 20 MiB by large ones under 10 MiB, else the block rounded up to
            2 MiB; fewer device allocations for varied sizes, at the price of reserved bytes.

    `allocate(0)` sets aside one granule (512 bytes by default), so it has an address of its own.

    Raises:
        ValueError / TypeError: bad option values.

    Example:
        >>> import allocators
        >>> alloc = allocators.create("caching", "cpu", size_classes="mantissa")
        >>> alloc.free(alloc.allocate(100_000))
        >>> a = alloc.allocate(100_000)       # served from the cache
        >>> alloc.stats()["cache_hits"], a.size
        (1, 102400)
        >>> alloc.free(a)
        >>> alloc.empty_cache()
        >>> alloc.stats()["reserved_bytes"]
        0
    """

    name = "caching"

    def __init__(self, device: Device | str | None = None, *,
                 size_classes: str | SizeClass = "granule", max_cached_bytes: int | None = None,
                 limit_bytes: int | None = None, segments: str = "exact") -> None:
        super().__init__(device)
        if segments not in SEGMENT_POLICIES:
            raise ValueError(f"segments must be one of {SEGMENT_POLICIES}, got {segments!r}")
        self.segments = segments
        self.size_classes = get_size_class(size_classes)
        granule = self.size_classes.granule
        if granule % self.device.alignment:
            raise ValueError(f"the size classes' granule ({granule} bytes) must be a multiple of "
                             f"the alignment of {self.device.name} ({self.device.alignment}), "
                             f"so that every block cut from a segment stays aligned; pass "
                             f"size_classes=allocators.sizeclass.GranuleSizeClass(granule="
                             f"{max(granule, self.device.alignment)}) (or another size class "
                             f"with that granule)")
        self._max_cached_bytes = _optional_nbytes(max_cached_bytes, "max_cached_bytes")
        self._limit_bytes = _optional_nbytes(limit_bytes, "limit_bytes")
        small_size = self.size_classes.small_size
        self._round = self.size_classes.round
        #: request bytes -> block bytes, a bounded memo
        self._rounded: dict[int, int] = {}
        self._small_size = small_size
        self._small = _Pool("small", min_split=granule)
        # NOTE: as PyTorch, a large block keeps a leftover of up to small_size bytes: split off,
        # it would be too small for any large request and unreachable for small ones.
        self._large = _Pool("large", min_split=small_size + 1)
        #: head block -> bytes of its segment
        self._segments: dict[_Block, int] = {}
        #: the heads of whole free segments, least recently freed first
        self._idle = _Idle()
        # NOTE: the C hot path (allocate / free below) serves only what the hooks here would do;
        # a subclass with hooks of its own gets the Python path throughout
        # (Note [the hot path runs no Python] in allocators/_core.py).
        self._hot = (speedups is not None and type(self)._allocate is CachingAllocator._allocate
                     and type(self)._free is CachingAllocator._free)

    @property
    def max_cached_bytes(self) -> int | None:
        """The bound on cached bytes given to the constructor (None: unbounded)."""
        return self._max_cached_bytes

    @property
    def limit_bytes(self) -> int | None:
        """The bound on reserved bytes given to the constructor (None: the device's memory)."""
        return self._limit_bytes

    # ------------------------------------------------------------------ the hot path
    # NOTE: Note [the hot path runs no Python] in allocators/_core.py. With the extension,
    # allocate / free are its C functions (made for this class by @_hot_path), which serve
    # cache hits (exact, best fit, split or whole) and frees that coalesce into sizes already
    # listed, with the same records and accounting, and call Allocator.allocate / free (as
    # _allocate_slow / _free_slow) for everything else. Without it, they are Allocator's.
    _allocate_slow = Allocator.allocate
    _free_slow = Allocator.free

    # ------------------------------------------------------------------ hooks (lock held)
    def _allocate(self, nbytes: int) -> Allocation:
        size = self._rounded.get(nbytes)
        if size is None:
            size = self._round_and_remember(nbytes)
        pool = self._small if size <= self._small_size else self._large
        block = pool.pop(size)  # an exact fit, the most recently freed
        if block is None:
            block = pool.take_best_fit(size)
            if block is None:
                block = self._grow(size, pool)
        if block.prev is None and block.next is None:
            self._idle.discard(block)  # a whole free segment is in use again
        if block.size - size >= pool.min_split:
            block = self._split(block, size)
        block.free = False
        # NOTE: its free goes straight back to this list while the pool keeps it listed
        block.free_list = pool.buckets.get(block.size)
        # NOTE: the block's size, not `size`: a leftover below min_split stays in the block, so
        # a block may be handed out whole, larger than the request's size class (and so in C)
        allocation = Allocation(self.device, block.raw, block.offset, nbytes, block.size)
        allocation.handle = block
        return allocation

    def _free(self, allocation: Allocation) -> None:
        block = allocation.handle
        allocation.handle = None
        allocation.raw = None  # NOTE: a freed allocation must not keep its segment alive
        pool = block.pool
        after = block.next
        if after is not None and after.free:  # coalesce with the next block
            pool.remove(after)
            block.size += after.size
            after = block.next = after.next
            if after is not None:
                after.prev = block
        before = block.prev
        if before is not None and before.free:  # and with the previous one
            pool.remove(before)
            before.size += block.size
            before.next = after
            if after is not None:
                after.prev = before
            block = before
        else:
            block.free = True
        pool.push(block)
        if block.prev is None and after is None:
            self._idle.append(block)  # the whole segment is free: newest in the LRU order
        if self._max_cached_bytes is not None:
            # NOTE: the base subtracts allocation.size from allocated bytes after this hook.
            self._trim(self._reserved_bytes - self._allocated_bytes + allocation.size)

    def _empty_cache(self) -> None:
        self._release_idle()
        self._small.prune()
        self._large.prune()

    def _largest_free_block(self) -> int:
        return max(self._small.largest(), self._large.largest())

    def _allocation_size(self, nbytes: int) -> int:
        size = self._round(nbytes)
        pool = self._small if size <= self._small_size else self._large
        granule = self.size_classes.granule
        # NOTE: `_allocate` hands out whole a free block whose leftover is below the pool's
        # min_split: nothing more in the small pool (block sizes are granule multiples), up
        # to small_size more in the large one
        return size + (pool.min_split - 1) // granule * granule

    def _limit(self) -> tuple[int | None, str]:
        if self._limit_bytes is not None:
            return self._limit_bytes, "limit_bytes"
        return super()._limit()

    # ------------------------------------------------------------------ mechanism
    def _split(self, block: _Block, size: int) -> _Block:
        """Cut `size` bytes off the top of the free `block`; the rest stays free in its pool."""
        pool = block.pool
        used = _Block()  # NOTE: every field is set here, as in _new_block (see _Block)
        used.raw = block.raw
        used.offset = block.offset + block.size - size
        used.size = size
        used.pool = pool
        used.free = False
        used.prev_free = used.next_free = None
        used.free_list = used.prev_idle = used.next_idle = None
        after = used.next = block.next
        if after is not None:
            after.prev = used
        used.prev = block
        block.next = used
        block.size -= size
        pool.push(block)
        return used

    def _round_and_remember(self, nbytes: int) -> int:
        """The size class of `nbytes`, memoized: a dict hit is cheaper than the policy's call."""
        size = self._round(nbytes)
        if size < max(nbytes, 1) or size % self.size_classes.granule:
            raise ValueError(f"{self.size_classes!r} rounded {nbytes} bytes to {size}, not a "
                             f"positive multiple of its granule >= the request")
        if len(self._rounded) >= _ROUNDED_MEMO:
            self._rounded.clear()
        self._rounded[nbytes] = size
        return size

    def _grow(self, size: int, pool: _Pool) -> _Block:
        """A new segment for a block of `size` bytes, as one free block that is in no free list.

        Recovery is a loop: ask; if refused, empty the cache and ask once more; then give up with
        the last MemoryError (the base class turns it into an OutOfMemoryError with numbers).
        """
        failure: MemoryError | None = None
        for attempt in range(2):
            if attempt and not self._release_idle():
                break  # nothing was cached: asking again would fail the same way
            try:
                raw, nbytes = self._reserve(size, pool)
            except MemoryError as exc:
                failure = exc
                continue
            head = _new_block(raw, 0, nbytes, pool)
            self._segments[head] = nbytes
            if self._max_cached_bytes is not None:
                # NOTE: the new segment is cached bytes too, except the `size` about to be used.
                self._trim(self._reserved_bytes - self._allocated_bytes - size)
            return head
        if failure is None:
            raise AssertionError("a segment could not be had and no error says why")
        raise failure

    def _reserve(self, size: int, pool: _Pool) -> tuple[Any, int]:
        """Raw memory for a segment holding a block of `size` bytes, and the segment's bytes."""
        if self.segments == "exact":
            nbytes = size
        elif pool is self._small:
            nbytes = max(SMALL_SEGMENT, size)
        elif size < MEDIUM_LIMIT:
            nbytes = MEDIUM_SEGMENT
        else:
            nbytes = -(-size // LARGE_ROUND) * LARGE_ROUND
        granule = self.size_classes.granule
        nbytes = -(-nbytes // granule) * granule
        limit = self._limit_bytes
        if limit is not None:
            reserved = self._reserved_bytes
            if reserved + nbytes > limit:
                nbytes = size  # a segment just big enough for the block
            if reserved + nbytes > limit:
                raise MemoryError(f"a new segment of {format_bytes(nbytes)} would pass "
                                  f"limit_bytes: {format_bytes(reserved)} of "
                                  f"{format_bytes(limit)} already reserved")
        return self._device_alloc(nbytes), nbytes

    def _release(self, head: _Block) -> None:
        """Give the whole free segment `head` back to the device."""
        self._idle.discard(head)
        head.pool.remove(head)
        nbytes = self._segments.pop(head)
        self._device_free(head.raw, nbytes)
        head.raw = None

    def _release_idle(self) -> int:
        """Give every whole free segment back; return the bytes released."""
        released = 0
        for head in list(self._idle):
            released += head.size
            self._release(head)
        return released

    def _trim(self, cached: int) -> None:
        """Release whole free segments, least recently freed first, until `cached` fits the bound.

        `cached` is the cached bytes as they will be once the running call returns.
        """
        idle = self._idle
        bound = self._max_cached_bytes
        while cached > bound and idle:
            head = idle.oldest
            cached -= head.size
            self._release(head)

    # ------------------------------------------------------------------ inspection
    def snapshot(self) -> list[dict[str, Any]]:
        """Every segment, by address: its pool, bytes and blocks (offset, size, free).

        Example:
            >>> import allocators
            >>> alloc = allocators.create("caching", "cpu", segments="pytorch")
            >>> a = alloc.allocate(1000)
            >>> [(s["pool"], s["nbytes"], len(s["blocks"])) for s in alloc.snapshot()]
            [('small', 2097152, 2)]
            >>> alloc.free(a)
        """
        with self._lock:
            segments = []
            for head, nbytes in self._segments.items():
                blocks = []
                block: _Block | None = head
                while block is not None:
                    blocks.append({"offset": block.offset, "size": block.size,
                                   "free": block.free})
                    block = block.next
                segments.append({"address": self.device.address(head.raw), "nbytes": nbytes,
                                 "pool": head.pool.name, "blocks": blocks})
        return sorted(segments, key=lambda segment: segment["address"])

    def check_invariants(self) -> None:
        """The base checks, and: segments tile exactly into blocks, free neighbours are merged,
        the free lists hold exactly the free blocks (each naming its list), the LRU exactly the
        whole free segments, and used + free bytes add up to allocated and reserved bytes."""
        super().check_invariants()
        with self._lock:
            self._check_layout()

    def _check_layout(self) -> None:
        granule = self.size_classes.granule
        counters = self._counters
        live_blocks = {id(allocation.handle): allocation for allocation in self._live.values()}
        used_bytes = free_bytes = 0
        free_blocks: list[_Block] = []
        for head, nbytes in self._segments.items():
            if not (head.prev is None and head.offset == 0):
                raise AssertionError("a segment head is not at offset 0")
            if not (nbytes % granule == 0):
                raise AssertionError(f"a segment of {nbytes} bytes is not in granules")
            block: _Block | None = head
            end = 0
            while block is not None:
                where = f"block at +{block.offset} of a {block.pool.name} segment"
                if not (block.offset == end):
                    raise AssertionError(f"{where}: expected at +{end} (gap or overlap)")
                if not (block.size > 0 and block.size % granule == 0):
                    raise AssertionError(f"{where}: size {block.size}")
                if not (block.raw is head.raw and block.pool is head.pool):
                    raise AssertionError(f"{where}: wrong segment")
                if not (block.prev_idle is None and block.next_idle is None
                        or block is head and block.free and block.next is None):
                    raise AssertionError(f"{where}: linked in the LRU, not a whole free segment")
                after = block.next
                if not (after is None or after.prev is block):
                    raise AssertionError(f"{where}: broken links")
                if block.free:
                    if after is not None and after.free:
                        raise AssertionError(f"{where}: free neighbours")
                    free_bytes += block.size
                    free_blocks.append(block)
                else:
                    if not (block.prev_free is None and block.next_free is None):
                        raise AssertionError(f"{where}: used but on a free list")
                    named = block.free_list
                    if not (named is None or named.size == block.size
                            and (named.listed or named.first is None)):
                        raise AssertionError(f"{where}: used, naming a wrong free list")
                    allocation = live_blocks.pop(id(block), None)
                    if not (allocation is not None):
                        raise AssertionError(f"{where}: used but no live allocation")
                    if not (allocation.raw is block.raw and allocation.offset == block.offset
                            and allocation.size == block.size):
                        raise AssertionError(f"{where}: != {allocation!r}")
                    used_bytes += block.size
                end += block.size
                block = after
            if not (end == nbytes):
                raise AssertionError(f"blocks cover {end} of a {nbytes}-byte segment")
        if live_blocks:
            raise AssertionError(f"live allocations outside every segment: {live_blocks}")
        if not (sum(self._segments.values()) == counters["reserved_bytes"]):
            raise AssertionError("reserved drifted")
        if not (used_bytes == counters["allocated_bytes"]):
            raise AssertionError("used blocks != allocated bytes")
        if not (used_bytes + free_bytes == counters["reserved_bytes"]):
            raise AssertionError("used + free != reserved")
        listed: list[_Block] = []
        for pool in (self._small, self._large):
            if not (pool.sizes == sorted(pool.buckets)):
                raise AssertionError(f"{pool.name} sizes out of order")
            for size, free_list in pool.buckets.items():
                where = f"the {size}-byte free list of the {pool.name} pool"
                if not (free_list.size == size and free_list.listed):
                    raise AssertionError(f"{where} is a list of {free_list.size} bytes, listed "
                                         f"{free_list.listed}")
                before, block = None, free_list.first
                while block is not None and len(listed) <= len(free_blocks):
                    if not (block.size == size and block.pool is pool and block.free
                            and block.free_list is free_list):
                        raise AssertionError(f"{where} holds a wrong block (at +{block.offset}, "
                                             f"{block.size} bytes)")
                    if block.prev_free is not before:
                        raise AssertionError(f"{where}: broken links")
                    listed.append(block)
                    before, block = block, block.next_free
        if not (sorted(map(id, listed)) == sorted(map(id, free_blocks))):
            raise AssertionError("the free lists do not hold exactly the free blocks")
        self._check_idle()
        bound = self._max_cached_bytes
        if not (bound is None or free_bytes <= bound or not self._idle):
            raise AssertionError(f"{format_bytes(free_bytes)} cached past max_cached_bytes "
                                 f"{format_bytes(bound)} while whole free segments could go back")

    def _check_idle(self) -> None:
        """The LRU list links exactly the whole free segments, both ways."""
        idle, before = [], None
        head = self._idle.oldest
        while head is not None and len(idle) <= len(self._segments):
            if head.prev_idle is not before:
                raise AssertionError("the LRU: broken links")
            idle.append(head)
            before, head = head, head.next_idle
        if self._idle.newest is not before:
            raise AssertionError("the LRU: its newest is not its last")
        whole = [head for head in self._segments if head.free and head.next is None]
        if not (sorted(map(id, idle)) == sorted(map(id, whole))):
            raise AssertionError("the LRU != whole free segments")



def _optional_nbytes(value: Any, what: str) -> int | None:
    return None if value is None else check_nbytes(value, what)
