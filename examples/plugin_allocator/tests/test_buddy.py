"""BuddyAllocator: blockrt's conformance kit through its pytest plugin, and the buddy system."""

from __future__ import annotations

import pytest
from blockrt_buddy import BuddyAllocator

import allocators


# ---------------------------------------------------------------------- the kit, in a few lines
def test_buddy_conforms(blockrt_allocator_conformance):
    blockrt_allocator_conformance(lambda: allocators.create("buddy", "cpu"))


def test_buddy_with_small_arenas_conforms(blockrt_allocator_conformance):
    # 64 KiB arenas, so most of the kit's sizes need an arena of their own
    blockrt_allocator_conformance(lambda: BuddyAllocator("cpu", arena_nbytes=64 << 10))


# ---------------------------------------------------------------------- the buddy system
def test_sizes_round_up_to_a_power_of_two_blocks():
    alloc = BuddyAllocator("cpu", arena_nbytes=1 << 16, min_block=64)
    for nbytes in (0, 1, 63, 64, 65, 1000, 4096, 4097, 1 << 16):
        allocation = alloc.allocate(nbytes)
        size = allocation.size
        assert size >= max(nbytes, 64)
        assert size & (size - 1) == 0
        assert size < 2 * max(nbytes, 64)  # never more than twice what was needed
        assert allocation.offset % size == 0
        assert allocation.ptr % 64 == 0
        alloc.free(allocation)
        alloc.check_invariants()


def test_split_then_merge_gives_back_one_whole_arena():
    alloc = BuddyAllocator("cpu", arena_nbytes=4096, min_block=64)
    allocations = [alloc.allocate(64) for _ in range(64)]  # every minimum block of the arena
    assert alloc.stats()["reserved_bytes"] == 4096
    assert alloc.stats()["fragmentation"] == 0.0
    alloc.check_invariants()
    for allocation in allocations[::2] + allocations[1::2]:
        alloc.free(allocation)
        alloc.check_invariants()
    stats = alloc.stats()
    assert stats["cached_bytes"] == 4096
    assert stats["fragmentation"] == 0.0  # merged back into one 4 KiB block
    alloc.empty_cache()
    assert alloc.stats()["reserved_bytes"] == 0


def test_a_split_arena_serves_from_its_free_halves():
    alloc = BuddyAllocator("cpu", arena_nbytes=4096, min_block=64)
    first = alloc.allocate(1024)
    second = alloc.allocate(2048)
    third = alloc.allocate(1024)
    assert {first.offset, second.offset, third.offset} == {0, 1024, 2048}
    assert alloc.stats()["cache_misses"] == 1
    fourth = alloc.allocate(64)  # the arena is full: a second arena
    assert alloc.stats()["reserved_bytes"] == 8192
    for allocation in (first, second, third, fourth):
        alloc.free(allocation)
    alloc.check_invariants()


def test_empty_cache_keeps_arenas_that_are_in_use():
    alloc = BuddyAllocator("cpu", arena_nbytes=4096)
    kept = alloc.allocate(4096)
    freed = alloc.allocate(4096)
    alloc.free(freed)
    alloc.empty_cache()
    assert alloc.stats()["reserved_bytes"] == 4096
    assert kept.live
    alloc.free(kept)
    alloc.empty_cache()
    assert alloc.stats()["reserved_bytes"] == 0


def test_a_request_larger_than_an_arena_gets_its_own():
    alloc = BuddyAllocator("cpu", arena_nbytes=4096)
    big = alloc.allocate(10_000)
    assert big.size == 16384
    assert alloc.stats()["reserved_bytes"] == 16384
    alloc.free(big)
    alloc.check_invariants()


def test_check_invariants_catches_unmerged_buddies():
    alloc = BuddyAllocator("cpu", arena_nbytes=4096, min_block=64)
    alloc.free(alloc.allocate(64))
    (arena,) = alloc._arenas.values()
    arena.free[arena.top].clear()  # deliberate corruption: split the whole free arena by hand
    arena.free[arena.top - 1].update({0, 2048})
    with pytest.raises(AssertionError, match="not merged"):
        alloc.check_invariants()


def test_check_invariants_catches_a_lost_block():
    alloc = BuddyAllocator("cpu", arena_nbytes=4096, min_block=64)
    allocation = alloc.allocate(64)
    (arena,) = alloc._arenas.values()
    arena.free[0].clear()  # deliberate corruption: the buddy of the live block disappears
    with pytest.raises(AssertionError, match="gap"):
        alloc.check_invariants()
    arena.free[0].add(64)
    alloc.free(allocation)


@pytest.mark.parametrize(("options", "error"), [
    ({"arena_nbytes": 3000}, ValueError),
    ({"min_block": 48}, ValueError),
    ({"arena_nbytes": 64, "min_block": 128}, ValueError),
    ({"arena_nbytes": 0}, ValueError),
    ({"min_block": 64.0}, TypeError),
])
def test_bad_options_are_refused(options, error):
    with pytest.raises(error):
        BuddyAllocator("cpu", **options)
