"""CachingAllocator and its size classes: conformance kit, size class maths, best fit, split and
coalesce, cache hits, LRU trimming, empty_cache, fragmentation, out-of-memory recovery, threads."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

import allocators
import allocators.testing
from allocators import OutOfMemoryError, format_bytes
from allocators.caching import CachingAllocator
from allocators.sizeclass import (
    SIZE_CLASSES,
    GranuleSizeClass,
    MantissaSizeClass,
    Pow2SizeClass,
    SizeClass,
    get_size_class,
)
from allocators.testing import AllocatorStateMachine, allocation_sizes
from backends.numpy import NumpyDevice
from helpers import run_threads

KiB = 1 << 10
MiB = 1 << 20


def caching(**options) -> CachingAllocator:
    return allocators.create("caching", "cpu", **options)


# ---------------------------------------------------------------------- the kit, run for real
TestCachingGranule = allocators.testing.make_test_case(lambda: caching())
TestCachingPow2 = allocators.testing.make_test_case(lambda: caching(size_classes="pow2"))
TestCachingMantissa = allocators.testing.make_test_case(lambda: caching(size_classes="mantissa"))
# NOTE: past 3 MiB cached, whole free 2 MiB segments go back: at most one stays.
TestCachingSmallCache = allocators.testing.make_test_case(
    lambda: caching(max_cached_bytes=3 * MiB, segments="pytorch"))
TestCachingPytorchSegments = allocators.testing.make_test_case(
    lambda: caching(segments="pytorch", size_classes="mantissa"))
# NOTE: less than one 2 MiB segment: every segment is cut to its block; OOMs happen.
TestCachingLimited = allocators.testing.make_test_case(
    lambda: caching(limit_bytes=768 * KiB, segments="pytorch"))
TestCachingLimitedExact = allocators.testing.make_test_case(
    lambda: caching(limit_bytes=768 * KiB))


class LargeRequestsMachine(AllocatorStateMachine):
    """The kit's machine, plus requests of up to 4 MiB: large segments and their limits."""

    @rule(target=AllocatorStateMachine.allocations, nbytes=allocation_sizes(4 * MiB))
    def allocate_large(self, nbytes: int):
        return self.allocate(nbytes)


# NOTE: one 2 MiB segment and half as much again: large requests hit the limit at times.
TestCachingLimitedLarge = allocators.testing.make_test_case(
    lambda: caching(limit_bytes=5 * MiB // 2, segments="pytorch"), machine=LargeRequestsMachine)


# ---------------------------------------------------------------------- size classes
POLICIES = [GranuleSizeClass(), Pow2SizeClass(), MantissaSizeClass()]
POLICY_IDS = [policy.name for policy in POLICIES]
request_sizes = st.one_of(st.integers(0, 64 * KiB), st.integers(0, 1 << 40),
                          st.integers(0, 40).map(lambda exponent: 1 << exponent))


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
@given(nbytes=request_sizes)
def test_round_is_the_smallest_block_size_that_holds_the_request(policy, nbytes):
    size = policy.round(nbytes)
    number = policy.bin(nbytes)
    assert size >= nbytes
    assert size > 0 and size % policy.granule == 0, f"{size} is not whole granules"
    assert policy.bin_size(number) == size, "bin_size is not the inverse of bin"
    assert policy.bin(size) == number, "the block size lands in another bin than its request"
    if number > 0:
        assert policy.bin_size(number - 1) < nbytes, "a smaller block size would have held it"
    else:
        assert nbytes <= policy.granule


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
@given(small=request_sizes, extra=request_sizes)
def test_round_and_bin_are_monotonic(policy, small, extra):
    large = small + extra
    assert policy.round(small) <= policy.round(large)
    assert policy.bin(small) <= policy.bin(large)


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_bins_are_consecutive_and_sizes_strictly_increase(policy):
    sizes = [policy.bin_size(number) for number in range(400)]
    assert all(lower < upper for lower, upper in zip(sizes, sizes[1:]))
    for number, size in enumerate(sizes):
        assert policy.bin(size) == number
        assert policy.bin(size + 1) == number + 1, f"{size + 1} bytes skip past bin {number + 1}"


@given(nbytes=request_sizes)
def test_granule_wastes_less_than_one_granule(nbytes):
    size = GranuleSizeClass().round(nbytes)
    if nbytes == 0:
        assert size == 512
    else:
        assert size < nbytes + 512


@given(nbytes=request_sizes)
def test_pow2_is_a_power_of_two_below_twice_the_request(nbytes):
    size = Pow2SizeClass().round(nbytes)
    assert size & (size - 1) == 0, f"{size} is not a power of two"
    if nbytes > 256:
        assert size < 2 * nbytes
    else:
        assert size == 512


@given(nbytes=request_sizes)
def test_mantissa_wastes_at_most_a_sixteenth_above_8_kib(nbytes):
    size = MantissaSizeClass().round(nbytes)
    if nbytes > 8 * KiB:  # NOTE: the smallest bins are plain 512-byte granules up to 8 KiB
        assert 16 * (size - nbytes) < nbytes, f"{size} wastes more than 6.25% of {nbytes}"
    else:
        assert size - nbytes < 512 or nbytes == 0


def test_mantissa_bound_is_tight():
    """The worst case, one byte past a bin, wastes close to 1/17: the bound is no slack guess."""
    policy = MantissaSizeClass()
    worst = max((policy.round(n) - n) / n for n in (17 << shift | 1 for shift in range(9, 40)))
    assert 1 / 18 < worst < 1 / 16


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_pool_splits_at_one_mebibyte(policy):
    assert policy.pool(0) == "small"
    assert policy.pool(MiB) == "small"
    assert policy.pool(MiB + 1) == "large"


def test_size_classes_by_name_and_bad_specs():
    assert sorted(SIZE_CLASSES) == ["granule", "mantissa", "pow2"]
    assert isinstance(get_size_class("mantissa"), MantissaSizeClass)
    custom = Pow2SizeClass(granule=1024)
    assert get_size_class(custom) is custom
    with pytest.raises(ValueError, match="known: granule, pow2, mantissa"):
        get_size_class("fibonacci")
    with pytest.raises(TypeError, match="name or a SizeClass"):
        get_size_class(512)
    with pytest.raises(ValueError, match="power of two"):
        GranuleSizeClass(granule=768)
    with pytest.raises(NotImplementedError, match="round"):
        SizeClass().round(1)


# ---------------------------------------------------------------------- construction
def test_options_are_checked():
    with pytest.raises(ValueError, match="granule .* must be a multiple of the alignment"):
        caching(size_classes=GranuleSizeClass(granule=32))
    with pytest.raises(ValueError, match="max_cached_bytes"):
        caching(max_cached_bytes=-1)
    with pytest.raises(TypeError, match="limit_bytes"):
        caching(limit_bytes=1.5)
    alloc = caching(size_classes="pow2", max_cached_bytes=0, limit_bytes=MiB)
    assert (alloc.size_classes.name, alloc.max_cached_bytes, alloc.limit_bytes) == ("pow2", 0, MiB)


class PageAligned(NumpyDevice):
    """Raw memory on 4096-byte boundaries: more than the default granule of 512 bytes."""

    alignment = 4096


def test_a_device_aligned_past_the_granule_is_told_the_granule_that_fits_and_it_works():
    device = PageAligned()
    with pytest.raises(ValueError, match=r"granule \(512 bytes\) must be a multiple of the "
                                         r"alignment of cpu \(4096\).*GranuleSizeClass"
                                         r"\(granule=4096\)"):
        allocators.create("caching", device)
    alloc = allocators.create("caching", device, size_classes=GranuleSizeClass(granule=4096))
    blocks = [alloc.allocate(n) for n in (0, 1, 4096, 5000, 100)]
    alloc.free(blocks.pop(1))
    blocks.append(alloc.allocate(10))          # a split of a freed block stays aligned too
    assert [(device.address(b.raw) + b.offset) % 4096 for b in blocks] == [0] * 5


class BadRounding(GranuleSizeClass):
    """Planted bug: rounds to a size that is not whole granules."""

    def round(self, nbytes: int) -> int:
        return nbytes + 1


def test_a_policy_that_breaks_its_contract_is_refused_before_anything_changes():
    alloc = caching(size_classes=BadRounding())
    with pytest.raises(ValueError, match="not a positive multiple of its granule"):
        alloc.allocate(3000)
    assert alloc.stats()["reserved_bytes"] == 0
    alloc.check_invariants()


# ---------------------------------------------------------------------- layout
@pytest.mark.parametrize("name", sorted(SIZE_CLASSES))
@settings(max_examples=25)
@given(sizes=st.lists(st.integers(0, 3 * MiB), min_size=1, max_size=12))
def test_every_block_is_granule_aligned(name, sizes):
    alloc = caching(size_classes=name)
    live = [alloc.allocate(nbytes) for nbytes in sizes]
    for allocation in live:
        assert allocation.offset % 512 == 0 and allocation.ptr % 64 == 0, allocation
        rounded = alloc.size_classes.round(allocation.nbytes)
        if rounded <= MiB:  # a small block is never bigger than its size class
            assert allocation.size == rounded, allocation
        else:  # a large block keeps a leftover of at most 1 MiB unsplit
            assert rounded <= allocation.size <= rounded + MiB, allocation
    alloc.check_invariants()
    for allocation in live:
        alloc.free(allocation)


def test_zero_bytes_get_one_granule_each():
    alloc = caching()
    first, second = alloc.allocate(0), alloc.allocate(0)
    assert (first.nbytes, first.size) == (0, 512)
    assert first.ptr != second.ptr
    assert alloc.stats()["allocated_bytes"] == 1024
    alloc.free(first)
    alloc.free(second)
    alloc.check_invariants()


def test_best_fit_picks_the_smallest_free_block_that_fits():
    alloc = caching(segments="pytorch")
    plan = {"a": 256 * KiB, "guard1": 64 * KiB, "b": 128 * KiB, "guard2": 64 * KiB,
            "c": 512 * KiB, "guard3": MiB}  # 2 MiB in all: one small segment, exactly full
    held = {name: alloc.allocate(nbytes) for name, nbytes in plan.items()}
    assert alloc.stats()["reserved_bytes"] == 2 * MiB
    assert alloc.stats()["cached_bytes"] == 0
    spans = {name: (held[name].offset, held[name].offset + held[name].size) for name in "abc"}
    for name in "abc":
        alloc.free(held[name])
    alloc.check_invariants()
    misses = alloc.stats()["cache_misses"]
    for request, expected in ((100 * KiB, "b"), (128 * KiB, "b"), (129 * KiB, "a"),
                              (256 * KiB, "a"), (300 * KiB, "c"), (512 * KiB, "c")):
        got = alloc.allocate(request)
        start, end = spans[expected]
        assert start <= got.offset and got.offset + got.size <= end, (
            f"{request} bytes went to +{got.offset}, not into block {expected} {spans[expected]}")
        alloc.check_invariants()
        alloc.free(got)
    assert alloc.stats()["cache_misses"] == misses
    too_big = alloc.allocate(600 * KiB)
    assert alloc.stats()["cache_misses"] == misses + 1
    assert alloc.stats()["reserved_bytes"] == 4 * MiB
    alloc.free(too_big)


@settings(max_examples=40)
@given(sizes=st.lists(st.integers(0, 300 * KiB), min_size=1, max_size=30), data=st.data())
def test_split_then_coalesce_leaves_one_free_block_per_segment(sizes, data):
    alloc = caching(segments="pytorch")
    live = [alloc.allocate(nbytes) for nbytes in sizes]
    alloc.check_invariants()
    for allocation in data.draw(st.permutations(live), label="free order"):
        alloc.free(allocation)
        alloc.check_invariants()
    segments = alloc.snapshot()
    assert segments
    for segment in segments:
        assert segment["blocks"] == [{"offset": 0, "size": segment["nbytes"], "free": True}]
    stats = alloc.stats()
    assert stats["cached_bytes"] == stats["reserved_bytes"] == 2 * MiB * len(segments)


def test_fragmentation_is_one_minus_largest_free_block_over_free_bytes():
    alloc = caching(segments="pytorch")
    first, middle, last = alloc.allocate(256 * KiB), alloc.allocate(MiB), alloc.allocate(768 * KiB)
    assert alloc.stats()["fragmentation"] == 0.0  # nothing cached
    alloc.free(first)
    alloc.free(last)  # two free blocks, kept apart by the middle one
    stats = alloc.stats()
    assert stats["cached_bytes"] == MiB
    assert stats["fragmentation"] == pytest.approx(1 - 768 / 1024)
    large = alloc.allocate(4 * MiB)  # from a 20 MiB large segment: 16 MiB stay free there
    stats = alloc.stats()
    assert stats["cached_bytes"] == 17 * MiB
    assert stats["fragmentation"] == pytest.approx(1 - 16 / 17)
    alloc.free(large)
    alloc.free(middle)  # all three merge into one free block
    assert alloc.stats()["fragmentation"] == pytest.approx(1 - 20 / 22)
    alloc.empty_cache()
    alloc.free(alloc.allocate(1000))  # one segment, one free block
    assert alloc.stats()["fragmentation"] == 0.0
    alloc.check_invariants()


# ---------------------------------------------------------------------- caching
@pytest.mark.parametrize("nbytes", [256, 64 * KiB, 4 * MiB, 64 * MiB])
@pytest.mark.parametrize("name", sorted(SIZE_CLASSES))
def test_freed_memory_is_a_cache_hit(name, nbytes):
    alloc = caching(size_classes=name)
    alloc.free(alloc.allocate(nbytes))
    before = alloc.stats()
    for _ in range(10):
        alloc.free(alloc.allocate(nbytes))
    after = alloc.stats()
    assert after["cache_hits"] == before["cache_hits"] + 10
    assert after["cache_misses"] == before["cache_misses"] == 1
    assert after["reserved_bytes"] == before["reserved_bytes"] == after["peak_reserved_bytes"]
    assert after["hit_rate"] > before["hit_rate"]
    alloc.check_invariants()


@pytest.mark.parametrize(("free_order", "evicted"), [("ABC", "A"), ("CAB", "C"), ("BCA", "B")])
def test_lru_trimming_returns_the_least_recently_freed_segment(free_order, evicted):
    alloc = caching(max_cached_bytes=25 * MiB)
    held = {name: alloc.allocate(10 * MiB) for name in "ABC"}  # one 10 MiB segment each
    addresses = {name: allocation.ptr for name, allocation in held.items()}
    for name in free_order:
        alloc.free(held[name])
        alloc.check_invariants()
        assert alloc.stats()["cached_bytes"] <= 25 * MiB
    kept = {segment["address"] for segment in alloc.snapshot()}
    assert kept == {addresses[name] for name in "ABC" if name != evicted}
    assert alloc.stats()["reserved_bytes"] == 20 * MiB


def test_lru_order_counts_the_last_free_not_the_first():
    alloc = caching(max_cached_bytes=25 * MiB)
    held = {name: alloc.allocate(10 * MiB) for name in "ABC"}
    addresses = {allocation.ptr: name for name, allocation in held.items()}
    alloc.free(held["A"])
    alloc.free(held["B"])
    again = alloc.allocate(10 * MiB)  # a cache hit on A or B
    reused = addresses[again.ptr]
    alloc.free(again)  # ... which is now the most recently freed
    alloc.free(held["C"])
    kept = {addresses[segment["address"]] for segment in alloc.snapshot()}
    assert kept == {reused, "C"}, f"kept {kept} after freeing A, B, {reused} again, C"


def test_max_cached_bytes_zero_keeps_no_whole_segment():
    alloc = caching(max_cached_bytes=0)
    alloc.free(alloc.allocate(12 * MiB))
    alloc.free(alloc.allocate(1000))
    assert alloc.stats()["reserved_bytes"] == 0
    assert alloc.stats()["cache_misses"] == 2


def test_empty_cache_returns_every_free_segment():
    alloc = caching()
    keep = alloc.allocate(12 * MiB)  # fills its own segment exactly
    for nbytes in (100, 5000, 300 * KiB, 3 * MiB, 30 * MiB):
        alloc.free(alloc.allocate(nbytes))
    assert alloc.stats()["cached_bytes"] > 0
    alloc.empty_cache()
    stats = alloc.stats()
    assert stats["reserved_bytes"] == stats["allocated_bytes"] == 12 * MiB
    assert len(alloc.snapshot()) == 1
    alloc.check_invariants()
    alloc.free(keep)
    alloc.empty_cache()
    assert alloc.stats()["reserved_bytes"] == 0


# ---------------------------------------------------------------------- out of memory
def test_a_request_that_fits_after_emptying_the_cache_succeeds():
    alloc = caching(limit_bytes=32 * MiB)
    alloc.free(alloc.allocate(20 * MiB))  # 20 MiB cached
    assert alloc.stats()["reserved_bytes"] == 20 * MiB
    bigger = alloc.allocate(24 * MiB)  # 20 + 24 > 32: only fits once the cache is gone
    stats = alloc.stats()
    assert stats["num_ooms"] == 0
    assert stats["reserved_bytes"] == stats["allocated_bytes"] == 24 * MiB
    assert stats["cached_bytes"] == 0
    assert stats["cache_misses"] == 2
    alloc.check_invariants()
    alloc.free(bigger)


def test_a_request_that_never_fits_raises_with_the_numbers():
    alloc = caching(limit_bytes=32 * MiB, segments="pytorch")
    keep = [alloc.allocate(12 * MiB), alloc.allocate(1000)]  # the second: a 2 MiB segment
    alloc.free(alloc.allocate(16 * MiB))  # 16 MiB cached in a whole segment
    before = alloc.stats()
    with pytest.raises(OutOfMemoryError) as raised:
        alloc.allocate(40 * MiB)
    after = alloc.stats()
    message = str(raised.value)
    in_use, cached = format_bytes(after["allocated_bytes"]), format_bytes(after["cached_bytes"])
    for figure in ("tried to allocate 40.00 MiB", f"{in_use} in use", f"{cached} cached",
                   "limit 32.00 MiB (limit_bytes)"):
        assert figure in message, f"{figure!r} not in {message!r}"
    assert isinstance(raised.value.__cause__, MemoryError)
    assert after["num_ooms"] == before["num_ooms"] + 1
    for key in ("allocated_bytes", "requested_bytes", "num_allocs", "num_frees"):
        assert after[key] == before[key], key
    assert after["reserved_bytes"] == 14 * MiB, "the whole free segment went back on the way"
    alloc.check_invariants()
    for allocation in keep:
        alloc.free(allocation)
    alloc.empty_cache()
    assert alloc.stats()["reserved_bytes"] == 0


def test_near_the_limit_a_segment_is_cut_to_the_block():
    alloc = caching(limit_bytes=3 * MiB)
    large = alloc.allocate(3 * MiB // 2)  # would get 20 MiB segment, far past the limit
    assert alloc.stats()["reserved_bytes"] == 3 * MiB // 2
    small = alloc.allocate(1000)  # would get a 2 MiB segment, past the limit too
    assert alloc.stats()["reserved_bytes"] == 3 * MiB // 2 + 1024
    alloc.check_invariants()
    alloc.free(large)
    alloc.free(small)


class RefusingDevice(NumpyDevice):
    """A CPU device that refuses raw memory while `refuse` is set, and counts the requests."""

    def __init__(self) -> None:
        super().__init__()
        self.refuse = False
        self.requests = 0

    def _raw_alloc(self, nbytes: int) -> np.ndarray:
        self.requests += 1
        if self.refuse:
            raise MemoryError(f"refused {nbytes} bytes")
        return super()._raw_alloc(nbytes)


def test_the_device_is_asked_again_once_and_only_after_something_went_back():
    device = RefusingDevice()
    alloc = CachingAllocator(device)
    alloc.free(alloc.allocate(64 * MiB))
    device.refuse = True
    device.requests = 0
    with pytest.raises(OutOfMemoryError, match="backend said: refused"):
        alloc.allocate(128 * MiB)
    assert device.requests == 2, "ask, empty the cache, ask once more"
    assert alloc.stats()["reserved_bytes"] == 0
    with pytest.raises(OutOfMemoryError, match="limit .* \\(device memory\\)"):
        alloc.allocate(128 * MiB)
    assert device.requests == 3, "nothing was cached, so nothing to retry"
    assert alloc.stats()["num_ooms"] == 2
    alloc.check_invariants()


# ---------------------------------------------------------------------- threads
THREADS, STEPS = 4, 300


def _pattern(tag: int, nbytes: int) -> np.ndarray:
    return ((np.arange(nbytes, dtype=np.uint32) * 7 + tag) % 251).astype(np.uint8)


def test_threads_share_one_allocator_without_losing_a_byte():
    alloc = caching(max_cached_bytes=8 * MiB)
    errors: list[str] = []
    allocations_made = [0] * THREADS

    def worker(index: int) -> None:
        rng = np.random.default_rng(index)
        live = []
        for step in range(STEPS):
            if live and (len(live) >= 8 or rng.random() < 0.5):
                allocation, pattern = live.pop(int(rng.integers(len(live))))
                found = alloc.device.copyout(allocation.raw, allocation.offset, allocation.nbytes)
                if not np.array_equal(found, pattern):
                    errors.append(f"thread {index}: {allocation!r} was overwritten")
                alloc.free(allocation)
                continue
            large = rng.random() < 0.05
            nbytes = int(rng.integers(MiB, 12 * MiB) if large else rng.integers(0, 200 * KiB))
            allocation = alloc.allocate(nbytes)
            pattern = _pattern(index * STEPS + step, nbytes)
            alloc.device.copyin(allocation.raw, allocation.offset, pattern)
            live.append((allocation, pattern))
            allocations_made[index] += 1
        for allocation, _ in live:
            alloc.free(allocation)

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # NOTE: switch threads often, so calls really interleave
    try:
        run_threads(worker, THREADS)
    finally:
        sys.setswitchinterval(old_interval)
    assert not errors, errors[:3]
    stats = alloc.stats()
    assert stats["num_allocs"] == stats["num_frees"] == sum(allocations_made)
    assert stats["allocated_bytes"] == stats["requested_bytes"] == 0
    assert stats["cache_hits"] + stats["cache_misses"] == stats["num_allocs"]
    assert stats["cached_bytes"] <= 8 * MiB
    alloc.check_invariants()
    alloc.empty_cache()
    assert alloc.stats()["reserved_bytes"] == 0


# ---------------------------------------------------------------------- segment policies
@given(st.lists(st.integers(0, 3 * MiB), min_size=1, max_size=12), st.integers(2, 4))
@settings(max_examples=40)
def test_exact_segments_reserve_what_a_repeating_workload_uses(sizes, steps):
    alloc = caching()
    blocks = [alloc.size_classes.round(max(n, 1)) for n in sizes]
    for step in range(steps):
        live = [alloc.allocate(n) for n in sizes]
        stats = alloc.stats()
        # every segment was cut to its block: nothing reserved beyond the blocks in use
        assert stats["reserved_bytes"] == stats["allocated_bytes"] == sum(blocks)
        if step:
            assert stats["cache_hits"] == step * len(sizes)  # every later request is a hit
        for allocation in live:
            alloc.free(allocation)
        alloc.check_invariants()


def test_segment_policy_is_validated_and_pytorch_segments_are_shared():
    with pytest.raises(ValueError, match="segments.*exact.*pytorch.*'tight'"):
        caching(segments="tight")
    alloc = caching(segments="pytorch")
    held = [alloc.allocate(1000), alloc.allocate(1000)]
    assert alloc.stats()["reserved_bytes"] == 2 * MiB  # both cut from one small segment
    assert held[0].raw is held[1].raw
    for allocation in held:
        alloc.free(allocation)
