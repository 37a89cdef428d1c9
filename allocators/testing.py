"""A conformance kit for allocator authors: one hypothesis state machine for every allocator.

`AllocatorStateMachine` keeps its own model of the live allocations and drives an allocator with
random allocations (0 bytes, tiny, odd, powers of two and their neighbours, up to 1 MiB), frees,
double and foreign frees, and `empty_cache()` calls. Each allocation gets a distinctive byte
pattern, written through its device, that must survive until it is freed. After every step the
machine checks the allocator's own `check_invariants()`, that no two live allocations overlap, and
that `stats()` agrees exactly with the model; at the end it frees everything and checks that no
byte leaked. It uses only the `Allocator`, `Allocation` and `Device` interfaces, so it runs on any
backend.

Usage, in a test module that pytest collects (hypothesis is a test dependency)::

    import allocators
    import allocators.testing

    TestMyAllocator = allocators.testing.make_test_case(
        lambda: allocators.create("my-allocator", "cpu"), max_examples=100)

The factory must build a new allocator on every call: the machine makes two per run, one under
test and one whose allocations it tries to free through the first. To add rules of your own,
subclass the machine and override `make_allocator`::

    import backends

    class MyMachine(allocators.testing.AllocatorStateMachine):
        def make_allocator(self):
            return MyAllocator(backends.get_device("cpu"), block_size=4096)

    TestMine = allocators.testing.make_test_case(machine=MyMachine)
"""

from __future__ import annotations

import itertools
import unittest
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
)

from allocators.base import Allocation, Allocator, InvalidFreeError, OutOfMemoryError, format_bytes

__all__ = ["QUEUE_CHECK_SIZES", "RATIO_STATS", "REQUIRED_STATS", "AllocatorStateMachine",
           "allocation_sizes", "byte_pattern", "check_queue_ordered_reuse", "make_test_case"]

#: Keys every allocator's `stats()` has (docs/allocators.md, "One stats mapping"), all
#: non-negative ints.
REQUIRED_STATS = ("allocated_bytes", "peak_allocated_bytes", "reserved_bytes",
                  "peak_reserved_bytes", "cached_bytes", "peak_cached_bytes", "num_allocs",
                  "num_frees", "cache_hits", "cache_misses", "requested_bytes",
                  "peak_requested_bytes", "num_ooms")
#: Ratios every allocator's `stats()` has, each a float in [0, 1].
RATIO_STATS = ("hit_rate", "fragmentation")


def allocation_sizes(max_nbytes: int = 1 << 20) -> st.SearchStrategy[int]:
    """Sizes worth asking an allocator for: 0, tiny, odd, powers of two +-1, and up to `max_nbytes`.

    Example:
        >>> from hypothesis import given
        >>> @given(allocation_sizes(4096))
        ... def test_fits(nbytes):
        ...     assert 0 <= nbytes <= 4096
    """
    largest_exponent = max(max_nbytes.bit_length() - 1, 0)
    near_powers_of_two = st.builds(lambda exponent, delta: 2**exponent + delta,
                                   st.integers(0, largest_exponent), st.sampled_from((-1, 0, 1)))
    return st.one_of(
        st.just(0),
        st.integers(1, 64),
        near_powers_of_two.map(lambda nbytes: min(nbytes, max_nbytes)),
        st.integers(0, max_nbytes // 16).map(lambda k: 2 * k + 1),  # odd, so never aligned
        st.integers(0, max_nbytes),
    )


def byte_pattern(tag: int, nbytes: int) -> np.ndarray:
    """`nbytes` pseudo-random bytes determined by `tag`; different tags give unrelated patterns."""
    return np.random.default_rng(tag).integers(0, 256, size=nbytes, dtype=np.uint8)


def _expect_invalid_free(allocator: Allocator, allocation: Allocation, what: str) -> None:
    """Free `allocation` through `allocator`, which must refuse it and leave its stats alone."""
    before = allocator.stats()
    try:
        allocator.free(allocation)
    except InvalidFreeError:
        pass
    else:
        raise AssertionError(f"{allocator!r} accepted a {what} of {allocation!r}")
    after = allocator.stats()
    if not (after == before):
        raise AssertionError(f"a refused {what} changed the stats of {allocator!r}: {before} -> "
                             f"{after}")


class AllocatorStateMachine(RuleBasedStateMachine):
    """Drives one allocator against a model of its live allocations (see the module docstring).

    Override `make_allocator` (or use `make_test_case(factory)`), then collect `.TestCase`.
    The allocator under test is `self.allocator`; `self.foreign` is a second one from the same
    factory. Allocations that fail with `OutOfMemoryError` are allowed (limits, small arenas), but
    they must leave the live accounting unchanged and count one `num_ooms`.
    """

    allocations = Bundle("allocations")

    def __init__(self) -> None:
        super().__init__()
        self.allocator = self.make_allocator()
        self.foreign = self.make_allocator()
        for made in (self.allocator, self.foreign):
            if not isinstance(made, Allocator):
                raise TypeError(f"make_allocator() returned {type(made).__name__}, "
                                f"not an allocators.Allocator")
        if self.foreign is self.allocator:
            raise ValueError("make_allocator() must return a new allocator on every call")
        #: the model: id(allocation) -> (allocation, the bytes written into it)
        self.model: dict[int, tuple[Allocation, np.ndarray | None]] = {}
        self.freed: list[Allocation] = []
        self.expected_allocs = 0
        self.expected_frees = 0
        self.expected_ooms = 0
        self._tags = itertools.count(1)

    def make_allocator(self) -> Allocator:
        """Build a fresh allocator. `make_test_case(factory)` overrides this to call `factory()`."""
        raise NotImplementedError(f"{type(self).__name__} must override make_allocator(), or be "
                                  f"made with allocators.testing.make_test_case(factory)")

    # ------------------------------------------------------------------ rules
    @rule(target=allocations, nbytes=allocation_sizes())
    def allocate(self, nbytes: int) -> Any:
        before = self.allocator.stats()
        try:
            allocation = self.allocator.allocate(nbytes)
        except OutOfMemoryError:
            self._check_failed_allocation_left_no_trace(before)
            return multiple()
        if not (isinstance(allocation, Allocation)):
            raise AssertionError(f"allocate() returned {allocation!r}")
        # NOTE: in the model before any check, so that teardown frees it even when a check
        # fails (a leak report would hide that failure); its pattern comes after the checks
        self.model[id(allocation)] = (allocation, None)
        self.expected_allocs += 1
        if not (allocation.nbytes == nbytes):
            raise AssertionError(f"asked for {nbytes} bytes, got {allocation!r}")
        if not (allocation.size >= allocation.nbytes):
            raise AssertionError(f"{allocation!r} sets aside {allocation.size} bytes, fewer than "
                                 f"its {nbytes}")
        bound = self.allocator.allocation_size(nbytes)
        if not (allocation.size <= bound):
            raise AssertionError(f"{allocation!r} sets aside {allocation.size} bytes, more than "
                                 f"allocation_size({nbytes}) = {bound}, which budgets and limits "
                                 f"count (override _allocation_size)")
        if not (allocation.live and allocation.owner is self.allocator):
            raise AssertionError(f"{allocation!r} is not live or not owned by {self.allocator!r}")
        self._check_placement(allocation)
        pattern = byte_pattern(next(self._tags), nbytes)
        allocation.device.copyin(allocation.raw, allocation.offset, pattern)
        self.model[id(allocation)] = (allocation, pattern)
        return allocation

    @rule(allocation=consumes(allocations))
    def free(self, allocation: Allocation) -> None:
        self._check_contents(allocation)
        self.allocator.free(allocation)
        del self.model[id(allocation)]
        self.freed.append(allocation)
        self.expected_frees += 1
        if allocation.live:
            raise AssertionError(f"{allocation!r} still says it is live after free()")

    @rule(allocation=allocations)
    def contents_survive(self, allocation: Allocation) -> None:
        self._check_contents(allocation)

    @rule()
    def empty_cache(self) -> None:
        before = self.allocator.stats()
        self.allocator.empty_cache()
        after = self.allocator.stats()
        for key in ("allocated_bytes", "requested_bytes", "num_allocs", "num_frees"):
            if not (after[key] == before[key]):
                raise AssertionError(f"empty_cache() changed {key}: {before} -> {after}")
        if not (after["reserved_bytes"] <= before["reserved_bytes"]):
            raise AssertionError(f"empty_cache() reserved more memory: {before} -> {after}")

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def double_free_is_refused(self, data: st.DataObject) -> None:
        allocation = data.draw(st.sampled_from(self.freed), label="already freed")
        _expect_invalid_free(self.allocator, allocation, "double free")

    @rule(nbytes=allocation_sizes())
    def foreign_free_is_refused(self, nbytes: int) -> None:
        try:
            stranger = self.foreign.allocate(nbytes)
        except OutOfMemoryError:
            return
        try:
            _expect_invalid_free(self.allocator, stranger, "free of another allocator's allocation")
        finally:
            self.foreign.free(stranger)

    @rule(allocation=allocations)
    def free_through_another_allocator_is_refused(self, allocation: Allocation) -> None:
        _expect_invalid_free(self.foreign, allocation, "free of another allocator's allocation")
        if not (allocation.live):
            raise AssertionError(f"{allocation!r} died when another allocator refused to free it")

    # ------------------------------------------------------------------ checks after every step
    @invariant()
    def allocator_is_consistent(self) -> None:
        for allocator in (self.allocator, self.foreign):
            own_check = getattr(allocator, "check_invariants", None)
            if callable(own_check):
                own_check()
        self._check_no_overlap()
        self._check_stats()

    def _check_placement(self, allocation: Allocation) -> None:
        """On the allocator's device, inside its raw memory, at an aligned address."""
        device = self.allocator.device
        if allocation.device is not device:
            raise AssertionError(f"{allocation!r} is on {allocation.device.name}, its allocator "
                                 f"on {device.name}")
        if not (allocation.offset >= 0 and (
            allocation.offset + allocation.size <= device.nbytes_of(allocation.raw))):
            raise AssertionError(f"{allocation!r} spans bytes {allocation.offset} to "
                                 f"{allocation.offset + allocation.size} of a raw memory of "
                                 f"{device.nbytes_of(allocation.raw)} bytes")
        align = device.alignment
        if not (allocation.ptr % align == 0):
            raise AssertionError(f"{allocation!r} starts at address {allocation.ptr:#x} (offset "
                                 f"{allocation.offset} in its raw memory), not a multiple of "
                                 f"{device.name}'s alignment of {align} bytes (Device.alignment): "
                                 f"every allocation must start there (OpenCL sub-buffers, the "
                                 f"pyopencl hook and vector loads rely on it)")

    def _check_no_overlap(self) -> None:
        live = [allocation for allocation, _ in self.model.values() if allocation.nbytes]
        spans = sorted((allocation.ptr, allocation.ptr + allocation.nbytes, index)
                       for index, allocation in enumerate(live))
        # sorted by start, any overlap shows up between neighbours
        for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
            if not (end <= start):
                raise AssertionError(f"live allocations {live[first]!r} and {live[second]!r} "
                                     f"overlap")

    def _check_stats(self) -> None:
        stats = self.allocator.stats()
        missing = [key for key in REQUIRED_STATS if key not in stats]
        if missing:
            raise AssertionError(f"stats() lacks {missing}: {stats}")
        missing = [key for key in RATIO_STATS if key not in stats]
        if missing:
            raise AssertionError(f"stats() lacks {missing}: {stats}")
        for key, value in stats.items():
            if key in RATIO_STATS:
                if not (isinstance(value, float) and 0.0 <= value <= 1.0):
                    raise AssertionError(f"stats()[{key!r}] = {value!r} is not a ratio in [0, 1]")
                continue
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                raise AssertionError(f"stats()[{key!r}] = {value!r} is not a non-negative int")
        for key in ("allocated_bytes", "reserved_bytes", "cached_bytes", "requested_bytes"):
            if not (stats[f"peak_{key}"] >= stats[key]):
                raise AssertionError(f"peak_{key} is below {key}: {stats}")
        allocs = stats["num_allocs"]
        if stats["hit_rate"] != (stats["cache_hits"] / allocs if allocs else 0.0):
            raise AssertionError(f"hit_rate {stats['hit_rate']} is not cache_hits / num_allocs: "
                                 f"{stats}")
        requested = sum(allocation.nbytes for allocation, _ in self.model.values())
        expected = {"requested_bytes": requested, "num_allocs": self.expected_allocs,
                    "num_frees": self.expected_frees, "num_ooms": self.expected_ooms,
                    "cached_bytes": stats["reserved_bytes"] - stats["allocated_bytes"],
                    "cache_hits": stats["num_allocs"] - stats["cache_misses"]}
        wrong = {key: (stats[key], value) for key, value in expected.items() if stats[key] != value}
        if wrong:
            raise AssertionError(f"stats disagree with the model, key: (stats, model): {wrong}")
        if stats["num_allocs"] - stats["num_frees"] != len(self.model):
            raise AssertionError(f"{stats['num_allocs']} allocations less {stats['num_frees']} "
                                 f"frees, but {len(self.model)} live in the model")
        if not (stats["allocated_bytes"] >= requested):
            raise AssertionError(f"allocated_bytes {stats['allocated_bytes']} < {requested} bytes "
                                 f"requested and live")
        if not (stats["reserved_bytes"] >= stats["allocated_bytes"]):
            raise AssertionError(f"reserved < allocated: {stats}")
        if not (stats["peak_allocated_bytes"] >= stats["allocated_bytes"]):
            raise AssertionError(f"peak < now: {stats}")

    def _check_contents(self, allocation: Allocation) -> None:
        _, pattern = self.model[id(allocation)]
        if pattern is None:  # NOTE: a check failed before the pattern was written
            return
        found = allocation.device.copyout(allocation.raw, allocation.offset, allocation.nbytes)
        changed = np.flatnonzero(np.asarray(found, dtype=np.uint8) != pattern)
        if changed.size:
            raise AssertionError(f"{changed.size} bytes of {allocation!r} changed since they were "
                                 f"written, the first at byte {int(changed[0])}")

    def _check_failed_allocation_left_no_trace(self, before: dict[str, int]) -> None:
        self.expected_ooms += 1
        after = self.allocator.stats()
        for key in ("allocated_bytes", "requested_bytes", "num_allocs", "num_frees"):
            if not (after[key] == before[key]):
                raise AssertionError(f"a failed allocation changed {key}: {before} -> {after}")
        if not (after["num_ooms"] == before["num_ooms"] + 1):
            raise AssertionError(f"a failed allocation did not count one num_ooms: {before} -> "
                                 f"{after}")
        # NOTE: reserved bytes may shrink (an allocator may empty its cache and retry), never grow.
        if not (after["reserved_bytes"] <= before["reserved_bytes"]):
            raise AssertionError(f"a failed allocation kept memory reserved: {before} -> {after}")

    # ------------------------------------------------------------------ the end of every run
    def teardown(self) -> None:
        for allocation, _ in list(self.model.values()):
            self._check_contents(allocation)
            self.allocator.free(allocation)
        self.model.clear()
        for allocator in (self.allocator, self.foreign):
            allocator.empty_cache()
            stats = allocator.stats()
            leaks = {key: format_bytes(stats[key])
                     for key in ("allocated_bytes", "requested_bytes", "reserved_bytes")
                     if stats[key] != 0}
            if leaks:
                raise AssertionError(f"{allocator!r} leaks after every allocation was freed and "
                                     f"the cache emptied: {leaks}")

    @classmethod
    def for_factory(cls, factory: Callable[[], Allocator],
                    name: str | None = None) -> type[AllocatorStateMachine]:
        """A subclass whose `make_allocator()` returns `factory()`."""
        if not callable(factory):
            raise TypeError(f"an allocator factory must be callable, got {factory!r}")

        def make_allocator(self: AllocatorStateMachine) -> Allocator:
            return factory()

        return type(name or cls.__name__, (cls,), {"make_allocator": make_allocator})


def make_test_case(factory: Callable[[], Allocator] | None = None, *,
                   machine: type[AllocatorStateMachine] = AllocatorStateMachine,
                   max_examples: int = 50, stateful_step_count: int = 30,
                   deadline: Any = None, soak: int = 1,
                   **settings_options: Any) -> type[unittest.TestCase]:
    """A `unittest.TestCase` class running `machine` (bound to `factory` when given).

    Args:
        factory: called with no arguments, returns a new Allocator each time.
        machine: an AllocatorStateMachine subclass; with no factory it must override
            `make_allocator`.
        max_examples, stateful_step_count, deadline: hypothesis settings, here with defaults
            fit for a test suite; any other keyword is passed to `hypothesis.settings` too.
        soak: a whole number >= 1 that multiplies max_examples (soak mode; under pytest, the
            blockrt plugin scales collected TestCases itself when BLOCKRT_SOAK is set, so leave
            this at 1 for classes that pytest collects).

    Returns:
        A TestCase class; assign it to a module-level name starting with `Test` for pytest.

    Example:
        >>> import allocators, allocators.testing
        >>> TestDirect = allocators.testing.make_test_case(
        ...     lambda: allocators.create("direct", "cpu"), max_examples=10)
    """
    if isinstance(soak, bool) or not isinstance(soak, int) or soak < 1:
        raise ValueError(f"soak must be a whole number >= 1, got {soak!r}")
    if factory is not None:
        machine = machine.for_factory(factory)
    options = {"suppress_health_check": [HealthCheck.too_slow], **settings_options}
    test_case = machine.TestCase
    test_case.settings = settings(max_examples=max_examples * soak,
                                  stateful_step_count=stateful_step_count, deadline=deadline,
                                  **options)
    probe = factory() if factory is not None else None  # the machine refuses non-allocators
    if isinstance(probe, Allocator) and _holds_kernels(probe.device):
        def test_queue_ordered_reuse(self: unittest.TestCase) -> None:
            check_queue_ordered_reuse(factory)

        test_case.test_queue_ordered_reuse = test_queue_ordered_reuse
    return test_case


def _holds_kernels(device: Any) -> bool:
    """Whether `check_queue_ordered_reuse` runs on `device` (OpenCL: user events)."""
    return device.home_queue is not None and device.name.partition(":")[0] == "opencl"


# ---------------------------------------------------------------------- queue-ordered reuse
#: OpenCL C for the queue check: x[offset + i] = value, one work item per word.
_PUT_WORDS = ("__kernel void put(__global uint *x, ulong offset, uint value) "
              "{ x[offset + get_global_id(0)] = value; }")
#: The sizes the queue check frees and asks for again.
QUEUE_CHECK_SIZES = (4, 256, 4096, 65536, (1 << 20) + 512)


def check_queue_ordered_reuse(factory: Callable[[], Allocator], *, reuses: int = 4,
                              guard_seconds: float = 30.0) -> bool:
    """Check that memory freed while a kernel on another queue may still write it is not handed
    out again before that kernel has run (Note [queue-ordered reuse] in backends/base.py).

    For each size of QUEUE_CHECK_SIZES: allocate, `record_queue` a second queue, hold a kernel
    that writes the allocation back on that queue with an OpenCL user event, free the
    allocation, then allocate `reuses` times the same size and write each on the device's queue;
    release the held kernel and read everything back. An allocation that holds the held
    kernel's words was handed out too early. Runs only on OpenCL devices (PoCL counts), the
    ones where a kernel can be held back deterministically; returns False, checking nothing,
    elsewhere. A timer releases the held kernel after `guard_seconds` whatever happens, so that
    an allocator that waits for it (when memory runs out) cannot hang the check.

    Raises:
        AssertionError: memory was handed out early (the message names the allocations), or
            the allocator's books are wrong afterwards.
    """
    import threading

    allocator = factory()
    device = allocator.device
    if not _holds_kernels(device):
        return False
    import pyopencl as cl

    home = device.home_queue
    other = cl.CommandQueue(device.context)
    kernel = cl.Program(device.context, _PUT_WORDS).build().put
    complete = cl.command_execution_status.COMPLETE

    def put(queue: Any, allocation: Allocation, value: int, wait_for: list | None = None) -> Any:
        view = device.array_view(allocation.raw, allocation.offset, (1,), np.uint8, (1,))
        return kernel(queue, (allocation.nbytes // 4,), None, view.base_data,
                      np.uint64(view.offset // 4), np.uint32(value), wait_for=wait_for)

    def words(allocation: Allocation) -> np.ndarray:
        view = device.array_view(allocation.raw, allocation.offset, (allocation.nbytes // 4,),
                                 np.uint32, (4,))
        return view.get(queue=home)

    for nbytes in QUEUE_CHECK_SIZES:
        held = cl.UserEvent(device.context)
        guard = threading.Timer(guard_seconds, held.set_status, (complete,))
        guard.start()
        try:
            late = allocator.allocate(nbytes)
            allocator.record_queue(late, other)
            put(other, late, 0xBAD0BAD0, wait_for=[held])
            freed = f"allocation #{late.serial} of {format_bytes(nbytes)}"
            allocator.free(late)
            again = [allocator.allocate(nbytes) for _ in range(reuses)]
            for value, allocation in enumerate(again, 1):
                put(home, allocation, value)
        finally:
            if not guard.finished.is_set():
                guard.cancel()
                held.set_status(complete)
        other.finish()
        home.finish()
        for value, allocation in enumerate(again, 1):
            seen = words(allocation)
            if not ((seen == value).all()):
                raise AssertionError(f"{allocator!r} handed out allocation #{allocation.serial} "
                                     f"of {format_bytes(nbytes)} over memory that a kernel queued "
                                     f"on another queue (recorded with record_queue) could still "
                                     f"write: {freed} was freed while the kernel was held, and "
                                     f"the new allocation holds its words "
                                     f"({sorted(set(seen.tolist()))[:4]}, expected {value}); "
                                     f"freed memory must wait for the recorded queues (does the "
                                     f"allocator override free or record_queue?)")
            allocator.free(allocation)
    allocator.empty_cache()
    allocator.check_invariants()
    stats = allocator.stats()
    if not (stats["active_allocations"] == 0):
        raise AssertionError(f"{allocator!r} still counts {stats['active_allocations']} "
                             f"allocations after the queue check freed everything and emptied its "
                             f"cache")
    return True
