"""The `Allocator` interface, the `Allocation` record, errors, and byte formatting.

`Allocator.allocate` / `free` hold the policy shared by every allocator: size validation, a lock,
exact accounting, ownership checks and out-of-memory errors with numbers. A concrete allocator
implements only `_allocate` / `_free` (and `_empty_cache` if it caches), and touches the device
only through `_device_alloc` / `_device_free`, so reserved bytes are always counted exactly.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

import backends
from allocators._core import COUNTERS, AllocationRecord, AllocatorState, speedups
from backends.base import Device, check_nbytes


class OutOfMemoryError(MemoryError):
    """An allocation could not be satisfied. The message gives requested, in-use, cached and limit
    sizes; the backend's own error is chained as `__cause__`."""


class InvalidFreeError(RuntimeError):
    """`free` got an allocation that is not live in this allocator (double or foreign free)."""


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB")


def format_bytes(nbytes: int | float | None) -> str:
    """Readable binary units: 512 -> '512 B', 1536 -> '1.50 KiB', None -> 'unknown'."""
    if nbytes is None:
        return "unknown"
    value = float(nbytes)
    for unit in _UNITS:
        if abs(value) < 1023.995 or unit == _UNITS[-1]:  # so 1048575 reads 1.00 MiB
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


class Allocation(AllocationRecord):
    """A piece of device memory handed out by an allocator.

    Attributes:
        device: the Device the memory lives on.
        raw: the backend's raw memory object (a segment that may hold other allocations too).
        offset: byte offset of this allocation inside `raw`.
        nbytes: the bytes that were requested.
        size: the bytes set aside for it (>= nbytes; size classes may round up).
        owner: the allocator that handed it out and must get it back.
        serial: a number unique within the owner, for messages and traces.
        upstream: for adaptors, the upstream allocation this one wraps (else None).
        live: True from `allocate` until `free`.
        handle: the owner's own record of the allocation, for it to find again on free (the
            caching allocator keeps its block here); None unless the owner sets it.

    `Allocation(device, raw, offset, nbytes, size, upstream=None)` makes one (in an allocator's
    `_allocate`); the base class sets owner, serial and live. offset, nbytes, size and serial
    are ints (64-bit when the C accelerator is in use).
    """

    # NOTE: the fields are AllocationRecord's, a C struct when the extension is built, so the
    # C hot path makes and frees allocations too: Note [the hot path runs no Python] in
    # allocators/_core.py
    __slots__ = ()

    @property
    def ptr(self) -> int:
        """The device address of the first byte."""
        return self.device.address(self.raw) + self.offset

    def __repr__(self) -> str:
        state = "live" if self.live else "freed"
        return (f"<Allocation #{self.serial} {format_bytes(self.nbytes)} on {self.device.name} "
                f"at +{self.offset} ({state})>")


if speedups is not None:
    speedups.set_allocation_class(Allocation)  # what the C hot path hands out


#: Every allocator made and not yet collected, by the order it was made (`live_allocators`).
_live: weakref.WeakValueDictionary[int, Allocator] = weakref.WeakValueDictionary()
_made = itertools.count()
_live_lock = threading.Lock()


def live_allocators() -> list[Allocator]:
    """Every allocator made in this process and still alive, in the order made (adaptors and
    their upstreams each on their own); `runtime.memory_summary()` lists them."""
    with _live_lock:
        return list(_live.values())


class Allocator(AllocatorState):
    """Base of every allocator: validation, accounting, locking and errors live here.

    Subclasses implement `_allocate(nbytes) -> Allocation`, `_free(allocation)` and optionally
    `_empty_cache()`, `_limit()` and `_allocation_size(nbytes)` (when an allocation may be
    larger than asked).

    The state `allocate` and `free` keep (counters, serials, the live set, the lock) is in
    `AllocatorState` (allocators/_core.py), shared with the caching allocator's C hot path.

    Example:
        >>> import allocators
        >>> alloc = allocators.create("direct", "cpu")
        >>> a = alloc.allocate(4096)
        >>> alloc.stats()["allocated_bytes"]
        4096
        >>> alloc.free(a)
    """

    name = "allocator"
    #: whether the memory it hands out is the device's read-only memory (kernels may only read
    #: it; the host fills it by copies): set by allocators for constants
    read_only_memory = False

    def __init__(self, device: Device | str | None = None) -> None:
        super().__init__()
        self.device: Device = backends.get_device(device if device is not None else "cpu")
        with _live_lock:
            _live[next(_made)] = self
        #: queue-ordered reuse (`record_queue`): serial -> {queue key: queue} of the live
        #: allocations used on queues other than the device's home queue
        self._queue_uses: dict[int, dict[int, Any]] = {}
        #: serial -> (allocation, events) of those freed while their queues may still use them
        #: (pending: still live in the books, their memory not yet back)
        self._pending: dict[int, tuple[Allocation, list[Any]]] = {}
        #: `_hot` from before `_hot_off`: while `_queue_uses` or `_pending` is not empty, the
        #: C hot path is off and every free and allocation comes through Python
        #: (Note [the hot path runs no Python] in allocators/_core.py)
        self._hot_when_idle = False

    @property
    def _counters(self) -> dict[str, int]:
        """The raw counters by stats key (a read-only snapshot; reading it takes no lock)."""
        return {key: getattr(self, f"_{key}") for key in COUNTERS}

    # ------------------------------------------------------------------ public policy
    # NOTE: the caching allocator's C hot path does what allocate and free do, for its cache
    # hits, so a change here is made there as well or turns the hot path off:
    # Note [the hot path runs no Python] in allocators/_core.py
    def allocate(self, nbytes: int) -> Allocation:
        """Return an Allocation of at least `nbytes` bytes (0 is valid).

        Raises:
            TypeError: nbytes is not an integer.
            ValueError: nbytes is negative.
            OutOfMemoryError: the memory cannot be had; says how much was asked, used and allowed.
        """
        if type(nbytes) is not int or nbytes < 0:
            nbytes = check_nbytes(nbytes, "allocation size")
        with self._lock:
            if self._ordered and self._pending:
                self._collect_pending(wait=False)
            device_allocs = self._num_device_allocs
            try:
                allocation = self._allocate(nbytes)
            except MemoryError as exc:
                allocation = self._allocate_after_pending(nbytes, exc)
            # owner, serial, live set and counters (allocators/_core.py)
            self._book_allocation(allocation, nbytes, device_allocs)
        return allocation

    def free(self, allocation: Allocation) -> None:
        """Give `allocation` back. Raises InvalidFreeError on a double or foreign free."""
        if type(allocation) is not Allocation and not isinstance(allocation, Allocation):
            raise TypeError(f"free() takes an Allocation, got {type(allocation).__name__}")
        with self._lock:
            live = self._live
            if live.get(allocation.serial) is not allocation:
                raise InvalidFreeError(self._describe_invalid_free(allocation))
            if self._ordered and self._defer(allocation):
                return
            del live[allocation.serial]
            self._give_back(allocation)

    def _give_back(self, allocation: Allocation) -> None:
        """Hand the memory of `allocation`, off the live set, to `_free` and take it off the
        books (lock held)."""
        allocation.live = False
        self._free(allocation)
        self._book_free(allocation)

    # ------------------------------------------------------------------ queue-ordered reuse
    def allocate_for(self, nbytes: int, queue: Any = None) -> Allocation:
        """`allocate(nbytes)` for memory that `queue` uses (lent to a framework's queue or
        stream): where `queue` is another than the device's home queue, `queue` first waits,
        on the device, for what the home queue has queued (the memory's earlier users), and
        the allocation is recorded as used on `queue` (`record_queue`), so that once freed it
        is handed out again only after `queue` is done with it. None, the home queue, or a
        device without queues: `allocate` alone. Note [queue-ordered reuse] in
        backends/base.py.

        Raises:
            what `allocate` and `record_queue` raise; a refused record frees the memory first.
        """
        device = self.device
        home = device.home_queue
        if queue is None or home is None or device.queue_key(queue) == device.queue_key(home):
            return self.allocate(nbytes)
        device.join(queue, home)
        allocation = self.allocate(nbytes)
        try:
            self.record_queue(allocation, queue)
        except BaseException:
            self.free(allocation)
            raise
        return allocation

    def record_queue(self, allocation: Allocation, queue: Any) -> None:
        """Note that `allocation` is used on `queue` as well as on its device's home queue
        (PyTorch's `Tensor.record_stream`).

        When it is freed, an event is queued on each recorded queue, and its memory is not handed
        out again, to any queue, until those events say that everything queued there before the
        free has run: a kernel still queued on `queue` can never write memory that someone else
        owns. Until then the allocation is pending: still counted as allocated, collected by a
        later `allocate` (which waits for the events only when memory runs out) or by
        `empty_cache` (which waits). Call it before the free, for every queue other than
        `device.home_queue` that the memory is used on; the home queue itself needs nothing (an
        in-order queue reuses at once). While any allocation has a recorded queue or is pending,
        frees and allocations take the Python path (the caching allocator's C hot path steps
        aside). Note [queue-ordered reuse] in backends/base.py.

        Raises:
            TypeError: `queue` is not a queue of the allocator's device (a synchronous device,
                such as the CPU, has none).
            ValueError: `queue` belongs to another device or context.
            InvalidFreeError: `allocation` is not live in this allocator.
        """
        device = self.device
        key = device.queue_key(queue)
        home = device.home_queue
        with self._lock:
            if (self._live.get(allocation.serial) is not allocation
                    or allocation.serial in self._pending):
                raise InvalidFreeError(f"record_queue needs a live allocation of this allocator: "
                                       f"{self._describe_invalid_free(allocation)}")
            if home is not None and key == device.queue_key(home):
                return
            self._hot_off()
            self._queue_uses.setdefault(allocation.serial, {})[key] = queue

    def recorded_queues(self, allocation: Allocation) -> list[Any]:
        """The queues other than the home queue recorded for the live `allocation`."""
        with self._lock:
            return list(self._queue_uses.get(allocation.serial, {}).values())

    def pending_frees(self) -> int:
        """How many freed allocations wait for events on their recorded queues now: those whose
        events have completed are taken back first (without waiting), as `stats` does."""
        with self._lock:
            if self._pending:
                self._collect_pending(wait=False)
            return len(self._pending)

    def _hot_off(self) -> None:
        if not self._ordered:
            self._hot_when_idle = self._hot
            self._hot = False
            self._ordered = True

    def _hot_again(self) -> None:
        if self._ordered and not self._queue_uses and not self._pending:
            self._hot = self._hot_when_idle
            self._ordered = False

    def _defer(self, allocation: Allocation) -> bool:
        """Free `allocation` later if queues were recorded for it: queue an event on each and
        make it pending; False when it has none (lock held)."""
        serial = allocation.serial
        if serial in self._pending:
            raise InvalidFreeError(f"double free: allocation #{serial} of "
                                   f"{format_bytes(allocation.nbytes)} was already freed (it "
                                   f"waits for the queues recorded with record_queue)")
        uses = self._queue_uses.get(serial)
        if not uses:
            return False
        events = [self.device.record_event(queue) for queue in uses.values()]
        del self._queue_uses[serial]  # NOTE: only once every event is queued
        self._pending[serial] = (allocation, events)
        allocation.live = False  # NOTE: freed for its user; the books keep it until collected
        return True

    def _collect_pending(self, wait: bool) -> None:
        """Give back the pending allocations whose events have completed, or all of them after
        waiting for their events when `wait` (lock held)."""
        device = self.device
        for serial, (allocation, events) in list(self._pending.items()):
            if wait:
                for event in events:
                    device.wait_event(event)
            elif not all(device.event_done(event) for event in events):
                continue
            del self._pending[serial]
            del self._live[serial]
            self._give_back(allocation)
        self._hot_again()

    def _allocate_after_pending(self, nbytes: int, exc: MemoryError) -> Allocation:
        """Out of memory: wait for the pending frees and try once more, else raise (lock held)."""
        if self._pending:
            self._collect_pending(wait=True)
            try:
                return self._allocate(nbytes)
            except MemoryError as again:
                exc = again
        self._num_ooms += 1
        raise self._out_of_memory(nbytes, exc) from exc

    def stats(self) -> dict[str, int | float]:
        """A snapshot of the counters; every allocator has the same keys.

        Bytes (current and peak): allocated (handed out, after rounding), requested (as asked),
        reserved (held from the device), cached (reserved but free). Counts: num_allocs,
        num_frees, cache_hits (allocations served without new device memory), cache_misses,
        num_ooms, active_allocations (a free pending on other queues counts as active until
        their events complete; the snapshot first takes back those that have). Ratios:
        hit_rate = cache_hits / num_allocs, and fragmentation = 1 - largest free block / cached
        bytes (0 when nothing is cached).
        """
        with self._lock:
            if self._pending:  # NOTE: a free whose queues have finished is done, not active
                self._collect_pending(wait=False)
            snapshot: dict[str, int | float] = self._counters
            largest = self._largest_free_block()
        snapshot["cache_hits"] = snapshot["num_allocs"] - snapshot["cache_misses"]
        cached = snapshot["reserved_bytes"] - snapshot["allocated_bytes"]
        snapshot["cached_bytes"] = cached
        snapshot["active_allocations"] = snapshot["num_allocs"] - snapshot["num_frees"]
        allocs = snapshot["num_allocs"]
        snapshot["hit_rate"] = snapshot["cache_hits"] / allocs if allocs else 0.0
        snapshot["fragmentation"] = 1.0 - largest / cached if cached else 0.0
        return snapshot

    def empty_cache(self) -> None:
        """Return every cached (free but reserved) byte to the device; first wait for the frees
        pending on other queues (`record_queue`) and take their memory back."""
        with self._lock:
            if self._pending:
                self._collect_pending(wait=True)
            self._empty_cache()

    def live_allocations(self) -> list[Allocation]:
        """The allocations handed out and not yet freed, oldest first (not those pending on
        other queues, see `record_queue`)."""
        with self._lock:
            return [a for a in self._live.values() if a.live]

    def check_invariants(self) -> None:
        """Raise AssertionError if the accounting or the layout of live allocations is wrong."""
        _, c = self._check_books()
        if not (c["reserved_bytes"] >= c["allocated_bytes"]):
            raise AssertionError("reserved < allocated")
        with self._lock:  # NOTE: a free in another thread clears allocation.raw
            spans = sorted((a.ptr, a.ptr + a.size, a.serial) for a in self._live.values()
                           if a.size)
        for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
            if not (end <= start):
                raise AssertionError(f"allocations #{first} and #{second} overlap")

    def _check_books(self) -> tuple[list[Allocation], dict[str, int]]:
        """Assert the traffic counters match the live allocations, from one locked snapshot;
        returns (live allocations, counters) of that snapshot."""
        with self._lock:
            live = list(self._live.values())
            c = self._counters
        if not (c["allocated_bytes"] == sum(a.size for a in live)):
            raise AssertionError("allocated_bytes drifted")
        if not (c["requested_bytes"] == sum(a.nbytes for a in live)):
            raise AssertionError("requested_bytes drifted")
        if not (c["num_allocs"] - c["num_frees"] == len(live)):
            raise AssertionError("alloc/free counts drifted")
        return live, c

    # ------------------------------------------------------------------ mechanism for subclasses
    def _device_alloc(self, nbytes: int) -> Any:
        """Raw memory from the device (its read-only memory when `read_only_memory` is set),
        counted in reserved bytes. Call with the lock held."""
        device = self.device  # NOTE: allocate() already validated nbytes
        raw = (device._raw_alloc_read_only(nbytes) if self.read_only_memory
               else device._raw_alloc(nbytes))
        self._num_device_allocs += 1
        reserved = self._reserved_bytes = self._reserved_bytes + nbytes
        if reserved > self._peak_reserved_bytes:
            self._peak_reserved_bytes = reserved
        return raw

    def _device_free(self, raw: Any, nbytes: int) -> None:
        """Give raw memory of `nbytes` back to the device. Call with the lock held."""
        self.device.raw_free(raw)
        self._num_device_frees += 1
        self._reserved_bytes -= nbytes

    def _allocate(self, nbytes: int) -> Allocation:
        raise NotImplementedError(f"{type(self).__name__} does not implement _allocate()")

    def _free(self, allocation: Allocation) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement _free()")

    def _empty_cache(self) -> None:
        """Nothing cached by default."""

    def _allocation_size(self, nbytes: int) -> int:
        """The request itself by default: an allocator that hands out more overrides it."""
        return nbytes

    def _largest_free_block(self) -> int:
        """Bytes of the largest block that could serve one allocation without new device memory."""
        return 0

    def _limit(self) -> tuple[int | None, str]:
        """(bytes this allocator may use, where that limit comes from)."""
        return self.device.total_memory, "device memory"

    def allocation_size(self, nbytes: int) -> int:
        """The most bytes an allocation of `nbytes` can take from this allocator: the `size`
        it may be handed (after rounding up to a size class, or a larger free block handed out
        whole), which is what it adds to `allocated_bytes` and so counts against a limit. A
        graph fits its memory plan and budget with it (docs/graph.md, "Memory budgets").

        Raises:
            TypeError: nbytes is not an integer.
            ValueError: nbytes is negative.

        Example:
            >>> import allocators
            >>> allocators.create("caching", "cpu").allocation_size(1000)
            1024
        """
        if type(nbytes) is not int or nbytes < 0:
            nbytes = check_nbytes(nbytes, "allocation size")
        return self._allocation_size(nbytes)

    def available_bytes(self) -> int | None:
        """Bytes this allocator could still hand out before it reaches its limit (`_limit()`,
        less what is allocated now), or None when it knows no limit. An upper bound: a request
        above it certainly fails; one below it may still fail (fragmentation, other users of
        the device)."""
        limit, _ = self._limit()
        if limit is None:
            return None
        with self._lock:
            return max(0, limit - self._allocated_bytes)

    # ------------------------------------------------------------------ errors with numbers
    def _out_of_memory(self, nbytes: int, cause: BaseException) -> OutOfMemoryError:
        c = self._counters
        limit, source = self._limit()
        cached = c["reserved_bytes"] - c["allocated_bytes"]
        return OutOfMemoryError(
            f"out of memory on {self.device.name}: tried to allocate {format_bytes(nbytes)}; "
            f"{type(self).__name__} has {format_bytes(c['allocated_bytes'])} in use and "
            f"{format_bytes(cached)} cached; limit {format_bytes(limit)} ({source}); "
            f"backend said: {cause}")

    def _describe_invalid_free(self, allocation: Allocation) -> str:
        what = f"allocation #{allocation.serial} of {format_bytes(allocation.nbytes)}"
        if allocation.owner is None:
            return f"invalid free: {what} was never handed out by an allocator"
        if allocation.owner is not self:
            owner, me = repr(allocation.owner), repr(self)
            if owner == me:  # two allocators of one kind on one device read alike
                owner, me = f"{owner} at {id(allocation.owner):#x}", f"{me} at {id(self):#x}"
            return (f"invalid free: {what} belongs to another allocator, {owner}, not to this "
                    f"one, {me}; free it through its owner")
        return f"double free: {what} was already freed"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} on {self.device.name}>"
