"""Allocator interface, DirectAllocator, the registry, byte formatting and the conformance kit."""

from __future__ import annotations

import contextlib
import re
import unittest

import numpy as np
import pytest
from hypothesis import Phase, example, given
from hypothesis import strategies as st

import allocators
import backends
from allocators import Allocation, Allocator, InvalidFreeError, OutOfMemoryError, format_bytes
from allocators.direct import DirectAllocator
from allocators.testing import RATIO_STATS, REQUIRED_STATS, allocation_sizes, make_test_case
from helpers import run_threads
from kit_machines import OpeningMachine

STATS_KEYS = ("allocated_bytes", "peak_allocated_bytes", "reserved_bytes", "cached_bytes",
              "num_allocs", "num_frees", "cache_hits", "cache_misses", "requested_bytes",
              "num_ooms")


def direct() -> DirectAllocator:
    return allocators.create("direct", "cpu")


class BumpAllocator(Allocator):
    """A second, independent allocator for the kit: bump offsets in one lazily reserved arena.

    The arena resets when its last allocation is freed and goes back on `empty_cache()` when
    nothing is live. It runs out of room often, so the kit's out-of-memory path gets exercised.
    Every allocation starts at a multiple of the device's alignment. `overlap_bytes` > 0 plants
    a bug: each allocation overlaps the next (by one alignment unit, so that it stays aligned).
    """

    name = "bump"

    def __init__(self, device: str = "cpu", arena_nbytes: int = 2 << 20,
                 overlap_bytes: int = 0) -> None:
        super().__init__(device)
        self.arena_nbytes = arena_nbytes
        self.overlap_bytes = overlap_bytes
        self._arena = None
        self._top = 0
        self._live_count = 0

    def _allocate(self, nbytes: int) -> Allocation:
        if nbytes > self.arena_nbytes - self._top:
            raise MemoryError(f"arena full: {self._top} of {self.arena_nbytes} bytes in use")
        if self._arena is None:
            self._arena = self._device_alloc(self.arena_nbytes)
        allocation = Allocation(self.device, self._arena, self._top, nbytes, nbytes)
        align = self.device.alignment
        step = -(-nbytes // align) * align
        self._top += max(step - (align if self.overlap_bytes else 0), 0)
        self._live_count += 1
        return allocation

    def _free(self, allocation: Allocation) -> None:
        self._live_count -= 1
        if self._live_count == 0:
            self._top = 0

    def _empty_cache(self) -> None:
        if self._live_count == 0 and self._arena is not None:
            self._device_free(self._arena, self.arena_nbytes)
            self._arena = None


class LeakyAllocator(DirectAllocator):
    """Planted bug: freed memory never goes back to the device."""

    def _free(self, allocation: Allocation) -> None:
        pass


class UncheckedOverlapAllocator(BumpAllocator):
    """Planted bug: overlapping allocations, and a check_invariants() that looks away."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__(device, overlap_bytes=1)

    def check_invariants(self) -> None:
        pass


class ForgivingAllocator(DirectAllocator):
    """Planted bug: double and foreign frees are silently ignored."""

    def free(self, allocation: Allocation) -> None:
        with contextlib.suppress(InvalidFreeError):
            super().free(allocation)


class ScrubbingAllocator(DirectAllocator):
    """Planted bug: empty_cache() zero-fills memory that is still handed out."""

    def _empty_cache(self) -> None:
        for allocation in self._live.values():
            zeros = np.zeros(allocation.nbytes, np.uint8)
            self.device.copyin(allocation.raw, allocation.offset, zeros)


# ---------------------------------------------------------------------- the kit, run for real
TestDirectAllocatorConforms = make_test_case(direct)
# NOTE: a small arena, so that many allocations fail and the kit checks what they leave behind.
TestBumpAllocatorConforms = make_test_case(lambda: BumpAllocator("cpu", arena_nbytes=256 << 10))


def run_machine(factory, **options) -> str:
    """Run the kit on `factory` without shrinking, each program opening with every rule
    (OpeningMachine); return the failure text ('' if it passed)."""
    test_case = make_test_case(factory, machine=OpeningMachine, phases=[Phase.generate],
                               database=None, **options)
    result = unittest.TestResult()
    test_case().run(result)
    return "\n".join(text for _, text in result.failures + result.errors)


def test_kit_passes_a_correct_allocator():
    assert run_machine(direct, max_examples=5) == ""


@pytest.mark.parametrize(("factory", "complaint"), [
    (lambda: BumpAllocator("cpu", overlap_bytes=1), "overlap"),
    (lambda: UncheckedOverlapAllocator("cpu"), "live allocations"),
    (lambda: LeakyAllocator("cpu"), "leaks after every allocation was freed"),
    (lambda: ForgivingAllocator("cpu"), "accepted a"),
    (lambda: ScrubbingAllocator("cpu"), "changed since they were written"),
], ids=["overlap", "overlap-unchecked", "leak", "accepted-invalid-free", "scribbled-contents"])
def test_kit_catches_a_planted_bug(factory, complaint):
    failure = run_machine(factory, max_examples=1)  # NOTE: the opening reaches every rule
    assert complaint in failure


def test_kit_needs_a_new_allocator_per_call():
    shared = direct()
    assert "new allocator on every call" in run_machine(lambda: shared, max_examples=1)


def test_kit_refuses_a_factory_that_makes_no_allocator():
    assert "not an allocators.Allocator" in run_machine(lambda: object(), max_examples=1)


def test_make_test_case_applies_settings():
    test_case = make_test_case(direct, max_examples=7, stateful_step_count=3, database=None)
    assert issubclass(test_case, unittest.TestCase)
    assert test_case.settings.max_examples == 7
    assert test_case.settings.stateful_step_count == 3
    assert test_case.settings.deadline is None
    assert test_case.settings.database is None


def test_kit_defaults_are_fit_for_a_suite():
    settings = make_test_case(direct).settings
    assert (settings.max_examples, settings.stateful_step_count) == (50, 30)
    assert settings.deadline is None


def test_kit_required_stats_are_the_design_keys():
    # the design's keys, plus the current and peak bytes and ratios every allocator reports
    peaks = {f"peak_{key}" for key in ("allocated_bytes", "reserved_bytes", "cached_bytes",
                                       "requested_bytes")}
    assert set(REQUIRED_STATS) == set(STATS_KEYS) | peaks
    assert set(RATIO_STATS) == {"hit_rate", "fragmentation"}


@given(allocation_sizes(4096))
def test_allocation_sizes_stay_in_range(nbytes):
    assert isinstance(nbytes, int)
    assert 0 <= nbytes <= 4096


# ---------------------------------------------------------------------- sizes
def test_allocate_zero_bytes_is_valid():
    alloc = direct()
    allocation = alloc.allocate(0)
    assert allocation.nbytes == 0
    assert allocation.size >= 0
    assert allocation.live
    assert alloc.stats()["num_allocs"] == 1
    assert allocation.device.copyout(allocation.raw, allocation.offset, 0).size == 0
    alloc.free(allocation)
    assert alloc.stats()["num_frees"] == 1


def test_numpy_integer_sizes_are_accepted():
    alloc = direct()
    allocation = alloc.allocate(np.int64(24))
    assert allocation.nbytes == 24
    assert type(allocation.nbytes) is int
    alloc.free(allocation)


@pytest.mark.parametrize("nbytes", [1.5, 4.0, True, False, "4", None, np.float64(8), [8]])
def test_non_integer_sizes_are_type_errors(nbytes):
    alloc = direct()
    with pytest.raises(TypeError, match="integer"):
        alloc.allocate(nbytes)
    assert alloc.stats()["num_allocs"] == 0
    assert alloc.stats()["num_ooms"] == 0


@pytest.mark.parametrize("nbytes", [-1, -(2**70), np.int32(-5)])
def test_negative_sizes_are_value_errors(nbytes):
    alloc = direct()
    with pytest.raises(ValueError, match=str(int(nbytes))):
        alloc.allocate(nbytes)
    assert alloc.stats()["num_allocs"] == 0


# ---------------------------------------------------------------------- out of memory
@pytest.mark.parametrize(("nbytes", "requested"), [(2**50, "1.00 PiB"), (2**64, "16.00 EiB")])
def test_out_of_memory_carries_numbers_and_the_backend_error(nbytes, requested):
    alloc = direct()
    held = alloc.allocate(3 << 20)
    before = alloc.stats()
    with pytest.raises(OutOfMemoryError) as caught:
        alloc.allocate(nbytes)
    error = caught.value
    assert isinstance(error, MemoryError)
    message = str(error)
    assert requested in message
    assert "3.00 MiB in use" in message
    assert format_bytes(alloc.device.total_memory) in message
    assert isinstance(error.__cause__, MemoryError)
    assert not isinstance(error.__cause__, OutOfMemoryError)
    after = alloc.stats()
    assert after == {**before, "num_ooms": before["num_ooms"] + 1}
    alloc.free(held)
    alloc.check_invariants()


def test_allocator_works_after_out_of_memory():
    alloc = direct()
    with pytest.raises(OutOfMemoryError):
        alloc.allocate(2**64)
    allocation = alloc.allocate(128)
    assert allocation.nbytes == 128
    alloc.free(allocation)
    assert alloc.stats()["reserved_bytes"] == 0


def test_out_of_memory_names_the_limit_an_allocator_reports():
    alloc = BumpAllocator("cpu", arena_nbytes=1024)
    with pytest.raises(OutOfMemoryError, match=r"tried to allocate 2\.00 KiB") as caught:
        alloc.allocate(2048)
    assert "arena full" in str(caught.value.__cause__)


# ---------------------------------------------------------------------- invalid frees
def test_double_free_is_refused_and_changes_nothing():
    alloc = direct()
    allocation = alloc.allocate(100)
    alloc.free(allocation)
    before = alloc.stats()
    with pytest.raises(InvalidFreeError, match="double free"):
        alloc.free(allocation)
    assert alloc.stats() == before


def test_foreign_free_is_refused_and_changes_nothing():
    mine, theirs = direct(), direct()
    allocation = theirs.allocate(100)
    before_mine, before_theirs = mine.stats(), theirs.stats()
    with pytest.raises(InvalidFreeError, match="belongs to"):
        mine.free(allocation)
    assert mine.stats() == before_mine
    assert theirs.stats() == before_theirs
    assert allocation.live
    theirs.free(allocation)


def test_foreign_free_with_a_colliding_serial_is_refused():
    mine, theirs = direct(), direct()
    own = mine.allocate(8)
    stranger = theirs.allocate(8)
    assert own.serial == stranger.serial
    with pytest.raises(InvalidFreeError, match="belongs to"):
        mine.free(stranger)
    assert own.live
    mine.free(own)
    theirs.free(stranger)


def test_free_of_an_allocation_nobody_handed_out_is_refused():
    alloc = direct()
    device = alloc.device
    homemade = Allocation(device, device.raw_alloc(16), 0, 16, 16)
    with pytest.raises(InvalidFreeError, match="never handed out"):
        alloc.free(homemade)


@pytest.mark.parametrize("thing", [None, 42, "allocation", np.zeros(8, np.uint8)])
def test_free_of_a_non_allocation_is_a_type_error(thing):
    with pytest.raises(TypeError, match="Allocation"):
        direct().free(thing)


# ---------------------------------------------------------------------- stats
def test_stats_have_every_documented_key_as_an_int():
    stats = direct().stats()
    for key in STATS_KEYS:
        assert key in stats
        assert type(stats[key]) is int
        assert stats[key] == 0


def test_peaks_track_the_high_water_mark():
    alloc = direct()
    small = alloc.allocate(1000)
    big = alloc.allocate(3000)
    assert alloc.stats()["peak_allocated_bytes"] == 4000
    alloc.free(big)
    stats = alloc.stats()
    assert (stats["allocated_bytes"], stats["peak_allocated_bytes"]) == (1000, 4000)
    medium = alloc.allocate(2500)
    stats = alloc.stats()
    assert (stats["allocated_bytes"], stats["peak_allocated_bytes"]) == (3500, 4000)
    alloc.free(medium)
    alloc.free(small)
    stats = alloc.stats()
    assert (stats["allocated_bytes"], stats["peak_allocated_bytes"]) == (0, 4000)
    assert stats["peak_requested_bytes"] == 4000


def test_direct_allocator_asks_the_device_every_time():
    alloc = direct()
    allocations = [alloc.allocate(n) for n in (10, 20, 30)]
    stats = alloc.stats()
    assert stats["cache_misses"] == stats["num_allocs"] == 3
    assert stats["cache_hits"] == 0
    assert stats["reserved_bytes"] == stats["allocated_bytes"] == 60
    assert stats["cached_bytes"] == 0
    for allocation in allocations:
        alloc.free(allocation)
    assert alloc.stats()["reserved_bytes"] == 0


def test_live_allocations_are_listed_oldest_first():
    alloc = direct()
    first, second, third = (alloc.allocate(n) for n in (1, 2, 3))
    alloc.free(second)
    assert alloc.live_allocations() == [first, third]
    assert "live" in repr(first)
    assert "freed" in repr(second)


def test_concurrent_allocate_and_free_keep_exact_counts():
    alloc = direct()
    rounds, workers = 200, 4

    def churn(_: int) -> None:
        for nbytes in range(rounds):
            alloc.free(alloc.allocate(nbytes))

    run_threads(churn, workers)
    stats = alloc.stats()
    assert stats["num_allocs"] == stats["num_frees"] == rounds * workers
    assert stats["allocated_bytes"] == stats["reserved_bytes"] == 0
    alloc.check_invariants()


@given(allocation_sizes().filter(bool))
def test_direct_allocations_are_64_byte_aligned(nbytes):
    alloc = direct()
    allocations = [alloc.allocate(nbytes), alloc.allocate(nbytes + 1)]
    for allocation in allocations:
        assert allocation.ptr % 64 == 0
        assert allocation.size >= allocation.nbytes
        alloc.free(allocation)


def test_zero_byte_direct_allocations_are_64_byte_aligned_too():
    alloc = direct()
    # NOTE: malloc aligns to 16, so 16 zero-byte allocations all aligned by luck are unlikely.
    allocations = [alloc.allocate(0) for _ in range(16)]
    misaligned = [allocation.ptr % 64 for allocation in allocations if allocation.ptr % 64]
    assert misaligned == []


# ---------------------------------------------------------------------- check_invariants can fail
@pytest.mark.parametrize(("counter", "complaint"), [
    ("allocated_bytes", "allocated_bytes drifted"),
    ("requested_bytes", "requested_bytes drifted"),
    ("num_frees", "alloc/free counts drifted"),
])
def test_check_invariants_catches_a_corrupted_counter(counter, complaint):
    alloc = direct()
    allocation = alloc.allocate(64)
    alloc.check_invariants()
    setattr(alloc, f"_{counter}", getattr(alloc, f"_{counter}") + 1)  # deliberate corruption
    with pytest.raises(AssertionError, match=complaint):
        alloc.check_invariants()
    setattr(alloc, f"_{counter}", getattr(alloc, f"_{counter}") - 1)
    alloc.free(allocation)


def test_check_invariants_catches_reserved_below_allocated():
    alloc = direct()
    allocation = alloc.allocate(64)
    alloc._reserved_bytes = 0  # deliberate corruption
    with pytest.raises(AssertionError, match="reserved < allocated"):
        alloc.check_invariants()
    alloc._reserved_bytes = 64
    alloc.free(allocation)


def test_check_invariants_catches_overlapping_allocations():
    alloc = BumpAllocator("cpu", overlap_bytes=1)
    first = alloc.allocate(100)  # NOTE: two alignment units on the CPU, the next overlaps one
    alloc.check_invariants()
    second = alloc.allocate(100)
    assert second.offset == first.offset + alloc.device.alignment
    with pytest.raises(AssertionError, match="overlap"):
        alloc.check_invariants()


# ---------------------------------------------------------------------- registry
@pytest.fixture
def private_registry(monkeypatch):
    """Registrations made by a test vanish after it."""
    monkeypatch.setattr(allocators, "_registered", {})


def test_names_lists_the_builtins():
    names = allocators.names()
    assert "direct" in names
    assert names == sorted(names)


def test_create_builds_an_allocator_on_the_device():
    alloc = allocators.create("direct", "cpu")
    assert isinstance(alloc, DirectAllocator)
    assert alloc.device is backends.get_device("cpu")
    assert allocators.create("direct").device is backends.get_device("cpu")
    assert allocators.create("direct", backends.get_device("cpu")).device is alloc.device


def test_create_with_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="nope") as caught:
        allocators.create("nope")
    for name in allocators.names():
        assert name in str(caught.value)


def test_create_needs_a_string_name():
    with pytest.raises(TypeError):
        allocators.create(DirectAllocator)


def test_register_makes_a_factory_available(private_registry):
    made = []

    def factory(device, **options):
        allocator = DirectAllocator(device)
        made.append((allocator, options))
        return allocator

    allocators.register("recording", factory)
    assert "recording" in allocators.names()
    alloc = allocators.create("recording", "cpu", block_size=4096)
    assert made == [(alloc, {"block_size": 4096})]
    assert alloc.device is backends.get_device("cpu")


def test_register_overrides_a_builtin_name_for_this_process(private_registry):
    allocators.register("direct", lambda device: LeakyAllocator(device))
    assert isinstance(allocators.create("direct", "cpu"), LeakyAllocator)


@pytest.mark.parametrize("factory", [None, 42, "allocators.direct:DirectAllocator"])
def test_register_refuses_a_non_callable(private_registry, factory):
    with pytest.raises(TypeError, match="callable"):
        allocators.register("broken", factory)
    assert "broken" not in allocators.names()


@pytest.mark.parametrize(("name", "error"), [("", ValueError), (None, TypeError), (3, TypeError)])
def test_register_refuses_a_bad_name(private_registry, name, error):
    with pytest.raises(error, match="name"):
        allocators.register(name, DirectAllocator)
    assert name not in allocators.names()


def test_a_factory_returning_a_non_allocator_is_a_type_error(private_registry):
    allocators.register("impostor", lambda device: object())
    with pytest.raises(TypeError, match="impostor.*object"):
        allocators.create("impostor", "cpu")


# ---------------------------------------------------------------------- format_bytes
@pytest.mark.parametrize(("nbytes", "text"), [
    (0, "0 B"), (1, "1 B"), (512, "512 B"), (1023, "1023 B"), (1024, "1.00 KiB"),
    (1536, "1.50 KiB"), (2**20, "1.00 MiB"), (2**30, "1.00 GiB"), (3 * 2**40, "3.00 TiB"),
    (2**50, "1.00 PiB"), (2**64, "16.00 EiB"), (2**70, "1.00 ZiB"), (None, "unknown"),
])
def test_format_bytes_examples(nbytes, text):
    assert format_bytes(nbytes) == text


UNIT_POWERS = {"B": 0, "KiB": 1, "MiB": 2, "GiB": 3, "TiB": 4, "PiB": 5, "EiB": 6, "ZiB": 7}


@given(st.integers(0, 2**72))
@example(16256)  # 15.875 KiB: an exact half, off by exactly half a unit once rounded
def test_format_bytes_reads_back_within_rounding(nbytes):
    match = re.fullmatch(r"(\d+(?:\.\d\d)?) ([KMGTPEZ]iB|B)", format_bytes(nbytes))
    assert match is not None
    value, unit = float(match[1]), match[2]
    scale = 1024 ** UNIT_POWERS[unit]
    assert abs(value * scale - nbytes) <= 0.005 * scale * (1 + 1e-9)  # exact halves round
    if unit not in ("B", "ZiB"):
        assert 1 <= value <= 1024  # NOTE: 1023.999 KiB rounds to "1024.00 KiB"
