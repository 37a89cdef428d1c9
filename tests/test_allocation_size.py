"""`Allocator.allocation_size(nbytes)`: the most an allocation of `nbytes` can take from an
allocator (its `size`), which a graph counts against a memory budget or a limit (issue 27,
part 3). Checked against what the allocators really hand out over random traffic."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import allocators
from allocators import LimitAdaptor, StatisticsAdaptor
from allocators.caching import CachingAllocator

MIB = 1 << 20

MAKERS = {
    "direct": lambda: allocators.create("direct", "cpu"),
    "caching": lambda: allocators.create("caching", "cpu"),
    "caching-pow2": lambda: allocators.create("caching", "cpu", size_classes="pow2"),
    "caching-mantissa": lambda: allocators.create("caching", "cpu", size_classes="mantissa"),
    "caching-pytorch-segments": lambda: allocators.create("caching", "cpu", segments="pytorch"),
    "statistics-limit-caching": lambda: StatisticsAdaptor(
        LimitAdaptor(allocators.create("caching", "cpu"), 64 * MIB)),
}

#: requests from a byte to past the caching allocator's 1 MiB small pool
SIZES = st.one_of(st.integers(0, 4096), st.integers(4096, 3 * MIB))


def bottom(allocator: allocators.Allocator) -> allocators.Allocator:
    """The allocator under every adaptor of a stack."""
    while isinstance(allocator, allocators.Adaptor):
        allocator = allocator.upstream
    return allocator


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(sorted(MAKERS)),
       traffic=st.lists(st.tuples(st.booleans(), SIZES), min_size=1, max_size=30))
def test_no_allocation_is_larger_than_its_allocation_size(kind, traffic):
    """Random allocations and frees: every allocation's size is at most `allocation_size` of
    its request, and the bound is the request's size class plus at most what a pool may hand
    out whole (nothing in the small pool, up to small_size in the large one)."""
    allocator = MAKERS[kind]()
    live = []
    for free, nbytes in traffic:
        if free and live:
            allocator.free(live.pop(len(live) // 2))
            continue
        bound = allocator.allocation_size(nbytes)
        allocation = allocator.allocate(nbytes)
        live.append(allocation)
        assert nbytes <= allocation.size <= bound
        caching = bottom(allocator)
        if not isinstance(caching, CachingAllocator):
            assert bound == nbytes
        else:
            size = caching.size_classes.round(nbytes)
            slack = caching.size_classes.small_size if size > caching.size_classes.small_size \
                else 0
            assert bound == size + slack
    for allocation in live:
        allocator.free(allocation)
    allocator.check_invariants()


def test_a_large_request_may_get_a_larger_free_block_whole():
    """Why the large pool's bound has slack: a cached block up to 1 MiB larger than the
    request's size class is handed out whole, and counts whole against allocated bytes."""
    caching = allocators.create("caching", "cpu")
    caching.free(caching.allocate(3 * MIB))
    got = caching.allocate(2 * MIB + 4096)
    assert got.size == 3 * MIB > caching.size_classes.round(2 * MIB + 4096)
    assert got.size <= caching.allocation_size(2 * MIB + 4096)
    assert caching.stats()["allocated_bytes"] == 3 * MIB
    caching.free(got)


@pytest.mark.parametrize("bad", [-1, 1.5, "4"])
def test_bad_sizes_are_refused_as_allocate_refuses_them(bad):
    allocator = allocators.create("caching", "cpu")
    with pytest.raises((TypeError, ValueError)) as asked:
        allocator.allocation_size(bad)
    with pytest.raises(type(asked.value)):
        allocator.allocate(bad)


def test_numpy_integers_are_sizes():
    assert allocators.create("direct", "cpu").allocation_size(np.int64(10)) == 10
