"""Adaptors: allocators that wrap an upstream allocator and add one behaviour (RMM style).

An adaptor owns no memory. It takes `upstream` first, exposes it as `.upstream`, and a stack reads
like a sentence::

    import allocators
    from allocators.adaptors import LimitAdaptor, StatisticsAdaptor

    stack = StatisticsAdaptor(LimitAdaptor(allocators.create("direct", "cpu"), 2**30))
    a = stack.allocate(4096)   # a.upstream is the LimitAdaptor's allocation of the same bytes
    stack.free(a)

Every allocation an adaptor hands out wraps exactly one live allocation of its upstream
(`allocation.upstream`) over the same memory. The base `Allocator.allocate` / `free` still run at
every level, so each adaptor has its own lock, live set, counters and ownership checks: a double or
foreign free is refused by the adaptor it is handed to. Locks are always taken from the top of the
stack down, so a stack cannot deadlock on itself.

The adaptors here:
    StatisticsAdaptor: current, peak and total bytes and counts, and a power-of-two size histogram.
    LimitAdaptor: refuses an allocation that would take the bytes allocated through it past a cap.
    TraceAdaptor: an event log of allocs and frees; `to_jsonl`, then `load_trace` and `replay`
        (the trace format, its loader and the replay benchmark live in `allocators.trace`).
    FaultInjectionAdaptor: fails allocations at random, from a seed, to test recovery paths.
"""

from __future__ import annotations

import numbers
import random
import threading
import time
from pathlib import Path
from typing import IO

from allocators.base import Allocation, Allocator, OutOfMemoryError, format_bytes
from allocators.trace import TraceEvent, load_trace, replay, write_jsonl
from backends.base import check_nbytes

__all__ = ["TRAFFIC_KEYS", "Adaptor", "FaultInjectionAdaptor", "LimitAdaptor",
           "StatisticsAdaptor", "TraceAdaptor", "TraceEvent", "load_trace", "replay"]

#: The keys of an adaptor's `stats()` that count its own traffic; every other key is upstream's.
TRAFFIC_KEYS = ("allocated_bytes", "peak_allocated_bytes", "requested_bytes",
                "peak_requested_bytes", "num_allocs", "num_frees", "num_ooms",
                "active_allocations")


class Adaptor(Allocator):
    """Base of every adaptor: forwards to `upstream`, keeping its own books on the way.

    A subclass adds behaviour by overriding `_allocate` / `_free` (calling `super()`), and reports
    its own figures through `_extra_stats()` and its options through `_describe()`.

    Args:
        upstream: the Allocator (or Adaptor) that really hands out the memory.

    Raises:
        TypeError: upstream is not an allocators.Allocator.
    """

    name = "adaptor"

    def __init__(self, upstream: Allocator) -> None:
        if not isinstance(upstream, Allocator):
            raise TypeError(f"{type(self).__name__} wraps an allocators.Allocator, "
                            f"got {type(upstream).__name__}")
        super().__init__(upstream.device)
        self.upstream = upstream

    # ------------------------------------------------------------------ public
    def stats(self) -> dict[str, int | float]:
        """The upstream's memory picture, with this adaptor's own traffic counts.

        From `upstream.stats()`: every key except TRAFFIC_KEYS, i.e. reserved_bytes,
        peak_reserved_bytes, cached_bytes, peak_cached_bytes, cache_hits, cache_misses,
        hit_rate, fragmentation, num_device_allocs, num_device_frees, and any key of the
        upstream's own (an inner adaptor's extra keys show through).
        From this adaptor (TRAFFIC_KEYS): allocated_bytes, peak_allocated_bytes,
        requested_bytes, peak_requested_bytes, num_allocs, num_frees, num_ooms (this adaptor's
        refusals and the upstream refusals it passed on) and active_allocations.
        Then the subclass's extra keys (see each class), which win over upstream keys.

        When the adaptor is its upstream's only user the two sources agree (cached_bytes ==
        reserved_bytes - allocated_bytes, cache_hits + cache_misses == num_allocs). When others
        share the upstream, the memory keys count their traffic too and the traffic keys do not.
        """
        with self._lock:
            counters = self._counters
            own = {key: counters[key] for key in TRAFFIC_KEYS if key in counters}
            own["active_allocations"] = len(self._live)
            extra = self._extra_stats()
            # NOTE: taken under our lock, after it the upstream's: the order allocate() uses.
            merged = dict(self.upstream.stats())
        merged.update(own)
        merged.update(extra)
        return merged

    def check_invariants(self) -> None:
        """Check this adaptor's books, that each live allocation wraps a live upstream one over
        the same bytes, then the upstream's own invariants."""
        live, _ = self._check_books()  # NOTE: not super(): an adaptor reserves nothing itself
        for allocation in live:
            inner = allocation.upstream
            if not (inner is not None and inner.live and inner.owner is self.upstream):
                raise AssertionError(f"{allocation!r} of {self!r} wraps {inner!r}, which is not "
                                     f"live in its upstream")
            same = (allocation.raw is inner.raw and allocation.offset == inner.offset
                    and allocation.size == inner.size and allocation.nbytes == inner.nbytes)
            if not (same):
                raise AssertionError(f"{allocation!r} does not cover the same bytes as {inner!r}")
        # NOTE: no overlap check here: ours mirror upstream allocations one to one, and the
        # upstream checks those.
        self.upstream.check_invariants()

    # ------------------------------------------------------------------ mechanism
    def _allocate(self, nbytes: int) -> Allocation:
        inner = self.upstream.allocate(nbytes)
        return Allocation(inner.device, inner.raw, inner.offset, inner.nbytes, inner.size,
                          upstream=inner)

    def _free(self, allocation: Allocation) -> None:
        try:
            self.upstream.free(allocation.upstream)
        except BaseException:
            # NOTE: the base took `allocation` off our live set before calling us; put it back so
            # our books still match the upstream, which kept (or never had) its allocation.
            self._live[allocation.serial] = allocation
            allocation.live = True
            raise
        allocation.raw = None  # NOTE: like DirectAllocator, hold no reference to freed memory

    def _empty_cache(self) -> None:
        self.upstream.empty_cache()

    def _limit(self) -> tuple[int | None, str]:
        return self.upstream._limit()

    def _allocation_size(self, nbytes: int) -> int:
        return self.upstream.allocation_size(nbytes)  # NOTE: an adaptor hands out the same

    def available_bytes(self) -> int | None:
        return self.upstream.available_bytes()

    @property
    def read_only_memory(self) -> bool:  # type: ignore[override]
        return self.upstream.read_only_memory

    def _extra_stats(self) -> dict[str, int | float]:
        """Keys this adaptor adds to `stats()`. Called with the lock held."""
        return {}

    def _describe(self) -> str:
        """Options for `repr`, e.g. ', limit_bytes=1.00 GiB'."""
        return ""

    def _out_of_memory(self, nbytes: int, cause: BaseException) -> OutOfMemoryError:
        if isinstance(cause, OutOfMemoryError):
            # NOTE: an allocator below refused; its message already names it and its numbers.
            return OutOfMemoryError(str(cause))
        limit, source = self._limit()
        cached = self.upstream.stats()["cached_bytes"]
        return OutOfMemoryError(
            f"out of memory on {self.device.name}: tried to allocate {format_bytes(nbytes)}; "
            f"{type(self).__name__} has {format_bytes(self._counters['allocated_bytes'])} in "
            f"use and {format_bytes(cached)} cached upstream; limit {format_bytes(limit)} "
            f"({source}); {cause}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.upstream!r}{self._describe()})"


def _power_of_two_bucket(nbytes: int) -> int:
    """The smallest power of two >= nbytes (0 for 0): 1 -> 1, 3 -> 4, 4 -> 4, 1025 -> 2048."""
    return 1 << (nbytes - 1).bit_length() if nbytes else 0


class StatisticsAdaptor(Adaptor):
    """Counts the traffic through it, whoever else uses the upstream (RMM's statistics adaptor).

    Beyond the counters every allocator keeps, it adds to `stats()`:
        total_allocated_bytes: bytes ever handed out through it (after upstream rounding).
        total_requested_bytes: bytes ever asked for through it.
        peak_active_allocations: the most allocations live at once.
        largest_allocation_bytes: the largest single request.
    `counters()` gives current/peak/total for bytes and for allocation counts, and
    `histogram()` the number of requests per power-of-two size bucket.

    Example:
        >>> import allocators
        >>> stats = StatisticsAdaptor(allocators.create("direct", "cpu"))
        >>> stats.free(stats.allocate(3000))
        >>> stats.histogram()
        {4096: 1}
    """

    name = "statistics"

    def __init__(self, upstream: Allocator) -> None:
        super().__init__(upstream)
        self._total_bytes = 0
        self._total_requested = 0
        self._active = 0
        self._peak_active = 0
        self._largest = 0
        #: bucket b counts requests with b/2 < nbytes <= b; bucket 0 counts 0-byte ones
        self._histogram: dict[int, int] = {}

    def counters(self) -> dict[str, dict[str, int]]:
        """{"bytes": {current, peak, total}, "allocations": {current, peak, total}}."""
        with self._lock:
            c = self._counters
            return {
                "bytes": {"current": c["allocated_bytes"], "peak": c["peak_allocated_bytes"],
                          "total": self._total_bytes},
                "allocations": {"current": self._active, "peak": self._peak_active,
                                "total": c["num_allocs"]},
            }

    def histogram(self) -> dict[int, int]:
        """Requests per size bucket, smallest bucket first: {power of two: count}."""
        with self._lock:
            return dict(sorted(self._histogram.items()))

    def check_invariants(self) -> None:
        super().check_invariants()
        with self._lock:
            c = dict(self._counters)
            histogram_total = sum(self._histogram.values())
            active, peak, total = self._active, self._peak_active, self._total_bytes
        if not (histogram_total == c["num_allocs"]):
            raise AssertionError("the size histogram lost requests")
        if not (active == c["num_allocs"] - c["num_frees"]):
            raise AssertionError("active allocation count drifted")
        if not (peak >= active):
            raise AssertionError("peak_active_allocations is below the live count")
        if not (total >= c["allocated_bytes"]):
            raise AssertionError("total_allocated_bytes is below the live bytes")

    def _allocate(self, nbytes: int) -> Allocation:
        allocation = super()._allocate(nbytes)
        self._total_bytes += allocation.size
        self._total_requested += nbytes
        self._active += 1
        self._peak_active = max(self._peak_active, self._active)
        self._largest = max(self._largest, nbytes)
        bucket = _power_of_two_bucket(nbytes)
        self._histogram[bucket] = self._histogram.get(bucket, 0) + 1
        return allocation

    def _free(self, allocation: Allocation) -> None:
        super()._free(allocation)
        self._active -= 1

    def _extra_stats(self) -> dict[str, int | float]:
        return {"total_allocated_bytes": self._total_bytes,
                "total_requested_bytes": self._total_requested,
                "peak_active_allocations": self._peak_active,
                "largest_allocation_bytes": self._largest}


class LimitAdaptor(Adaptor):
    """Refuses any allocation that would take the bytes allocated through it past `limit_bytes`.

    The check is `allocated_bytes + nbytes <= limit_bytes`, made before the upstream is asked, so
    a refusal never touches the upstream. An upstream that rounds sizes up can still take
    allocated_bytes past the limit by the rounding of the last allocation admitted;
    requested_bytes never passes it. A refusal raises OutOfMemoryError naming the request, the
    bytes in use, the bytes cached upstream and the limit. Adds `limit_bytes` and
    `limit_refusals` to `stats()`.

    Args:
        upstream: the allocator to cap.
        limit_bytes: the cap, a non-negative int.

    Raises:
        TypeError: limit_bytes is not an integer. ValueError: it is negative.

    Example:
        >>> import allocators
        >>> capped = LimitAdaptor(allocators.create("direct", "cpu"), 1024)
        >>> held = capped.allocate(1000)
        >>> try:
        ...     capped.allocate(100)
        ... except allocators.OutOfMemoryError as error:
        ...     print(str(error).split("; ")[2])
        limit 1.00 KiB (LimitAdaptor)
    """

    name = "limit"

    def __init__(self, upstream: Allocator, limit_bytes: int) -> None:
        super().__init__(upstream)
        self.limit_bytes = check_nbytes(limit_bytes, "limit_bytes")
        self._refusals = 0

    def check_invariants(self) -> None:
        super().check_invariants()
        with self._lock:
            requested = self._counters["requested_bytes"]
        if not (requested <= self.limit_bytes):
            raise AssertionError(f"{format_bytes(requested)} requested through {self!r}, past its "
                                 f"limit")

    def _allocate(self, nbytes: int) -> Allocation:
        in_use = self._allocated_bytes
        if in_use + nbytes > self.limit_bytes:
            self._refusals += 1
            over = in_use + nbytes - self.limit_bytes
            raise MemoryError(f"{format_bytes(in_use)} in use + {format_bytes(nbytes)} requested "
                              f"would pass the limit by {format_bytes(over)}")
        return super()._allocate(nbytes)

    def _limit(self) -> tuple[int | None, str]:
        return self.limit_bytes, "LimitAdaptor"

    def available_bytes(self) -> int | None:
        with self._lock:
            here = max(0, self.limit_bytes - self._allocated_bytes)
        upstream = self.upstream.available_bytes()
        return here if upstream is None else min(here, upstream)

    def _extra_stats(self) -> dict[str, int | float]:
        return {"limit_bytes": self.limit_bytes, "limit_refusals": self._refusals}

    def _describe(self) -> str:
        return f", limit_bytes={format_bytes(self.limit_bytes)}"


class TraceAdaptor(Adaptor):
    """Records every successful alloc and free as a TraceEvent (RMM's logging adaptor).

    `events` is the log so far, in the order the operations took the adaptor's lock; `to_jsonl`
    writes it as JSON lines, which `load_trace` reads back and `replay` runs against any
    allocator as a benchmark. The log grows with every operation; make a new adaptor to start
    over. Adds `trace_events` to `stats()`.

    Example:
        >>> import allocators
        >>> traced = TraceAdaptor(allocators.create("direct", "cpu"))
        >>> traced.free(traced.allocate(64))
        >>> [(event.action, event.serial, event.nbytes) for event in traced.events]
        [('alloc', 1, 64), ('free', 1, 64)]
    """

    name = "trace"

    def __init__(self, upstream: Allocator) -> None:
        super().__init__(upstream)
        self._events: list[TraceEvent] = []
        #: the allocation of the last alloc event while it has no serial yet: the base numbers an
        #: allocation right after _allocate returns, still under the lock, so the event learns
        #: its serial at the next locked step (`_settle`)
        self._unnumbered: Allocation | None = None

    @property
    def events(self) -> list[TraceEvent]:
        """A copy of the log, oldest first."""
        with self._lock:
            self._settle()
            return list(self._events)

    def to_jsonl(self, path_or_file: str | Path | IO[str]) -> int:
        """Write the log as JSON lines (one object per event) to a path or a text file.

        Returns the number of events written.
        """
        return write_jsonl(self.events, path_or_file)

    def _settle(self) -> None:
        if self._unnumbered is not None:
            self._events[-1] = self._events[-1]._replace(serial=self._unnumbered.serial)
            self._unnumbered = None

    def _allocate(self, nbytes: int) -> Allocation:
        self._settle()
        allocation = super()._allocate(nbytes)
        self._events.append(TraceEvent("alloc", 0, nbytes, allocation.size, allocation.ptr,
                                       time.monotonic_ns(), threading.get_ident()))
        self._unnumbered = allocation
        return allocation

    def _free(self, allocation: Allocation) -> None:
        self._settle()
        address = allocation.ptr
        super()._free(allocation)
        self._events.append(TraceEvent("free", allocation.serial, allocation.nbytes,
                                       allocation.size, address, time.monotonic_ns(),
                                       threading.get_ident()))

    def _extra_stats(self) -> dict[str, int | float]:
        return {"trace_events": len(self._events)}

    def _describe(self) -> str:
        return f", events={len(self._events)}"


class FaultInjectionAdaptor(Adaptor):
    """Fails each allocation with probability `probability`, drawn from `random.Random(seed)`.

    An injected fault raises OutOfMemoryError whose message says it was injected; the upstream
    is not asked. The same seed and the same sequence of calls give the same faults. Counts
    `injected_faults` (an attribute and a `stats()` key).

    Args:
        upstream: the allocator that serves the allocations that are let through.
        probability: a real number in [0, 1]; 0 never fails, 1 always does.
        seed: an int seed for the generator.

    Raises:
        TypeError: probability is not a real number or seed not an int.
        ValueError: probability is outside [0, 1] (or NaN).

    Example:
        >>> import allocators
        >>> flaky = FaultInjectionAdaptor(allocators.create("direct", "cpu"), 1.0)
        >>> try:
        ...     flaky.allocate(64)
        ... except allocators.OutOfMemoryError as error:
        ...     print("injected" in str(error), flaky.injected_faults)
        True 1
    """

    name = "fault-injection"

    def __init__(self, upstream: Allocator, probability: float, seed: int = 0) -> None:
        super().__init__(upstream)
        if isinstance(probability, bool) or not isinstance(probability, numbers.Real):
            raise TypeError(f"probability must be a real number, got {probability!r}")
        probability = float(probability)
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"probability must be in [0, 1], got {probability}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        self.probability = probability
        self.seed = seed
        self.injected_faults = 0
        self._random = random.Random(seed)

    def _allocate(self, nbytes: int) -> Allocation:
        if self._random.random() < self.probability:
            self.injected_faults += 1
            raise MemoryError(f"fault #{self.injected_faults} injected by FaultInjectionAdaptor "
                              f"(probability {self.probability}, seed {self.seed}); no memory "
                              f"actually ran short")
        return super()._allocate(nbytes)

    def _extra_stats(self) -> dict[str, int | float]:
        return {"injected_faults": self.injected_faults}

    def _describe(self) -> str:
        return f", probability={self.probability}, seed={self.seed}"
