"""The caching allocator's C hot path (allocators._speedups) against its Python reference.

The C code serves cache hits (best fit, split, coalesce) and hands everything else to the Python
implementation, on one shared state. These tests mix both paths at random and check the
invariants after every step, compare them field by field after every step (`_hot` off is the
Python path on the same state types; BLOCKRT_PURE_PYTHON=1 in a subprocess is the pure-Python
build) and check that the C path served every kind of hit and free meanwhile, test the lock,
and run the allocator test files once more in pure-Python mode so CI covers both builds.
`make asan` runs these tests against a build with AddressSanitizer and UBSan. What the C code
may do is Note [the hot path runs no Python] in allocators/_core.py.
"""

from __future__ import annotations

import gc
import json
import os
import random
import subprocess
import sys
import threading
import time
from bisect import bisect_left
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import currently_in_test_context, event, given, settings
from hypothesis import strategies as st

import allocators
from allocators import InvalidFreeError, OutOfMemoryError
from allocators._core import speedups
from allocators.caching import _PRUNE_AFTER, CachingAllocator
from allocators.pytest_plugin import soak_factor
from allocators.sizeclass import GranuleSizeClass
from backends.accelerated import PURE_PYTHON_ENV
from helpers import pytest_in_pure_python, run_threads

ROOT = Path(__file__).resolve().parent.parent
KiB = 1 << 10
MiB = 1 << 20

needs_speedups = pytest.mark.skipif(
    not allocators.ACCELERATED,
    reason=f"allocators._speedups is not in use (not built at install, for want of a C "
           f"compiler, or {PURE_PYTHON_ENV} is set)")

#: A size class policy with a small pool of blocks up to 8 KiB: a large block keeps a leftover
#: of up to 8 KiB (not split off), so blocks handed out whole come cheaply and often.
SMALL_POOL_8K = GranuleSizeClass(small_size=8 * KiB)
#: Options that take the hot path through its cases: exact segments (whole-segment hits),
#: shared segments (splits and coalescing), size classes, a cache bound (Python frees), a
#: limit, and a small pool of 8 KiB (large blocks handed out whole, in small segments).
OPTIONS = [
    {},
    {"segments": "pytorch"},
    {"segments": "pytorch", "size_classes": "mantissa"},
    {"size_classes": "pow2", "max_cached_bytes": 3 * MiB, "segments": "pytorch"},
    {"limit_bytes": 3 * MiB, "segments": "pytorch"},
    {"size_classes": SMALL_POOL_8K},
    {"size_classes": SMALL_POOL_8K, "segments": "pytorch"},
]
OPTION_IDS = ["exact", "pytorch", "pytorch-mantissa", "pow2-bounded", "limited", "8k-exact",
              "8k-pytorch"]

#: Sizes that repeat (so most requests are cache hits), with a few odd ones, and large ones
#: less than a small pool apart (of 8 KiB, of 1 MiB), so a large block can serve another whole.
NEAR_SIZES = [9 * KiB, 12 * KiB, 3 * MiB // 2, 5 * MiB // 2, 3 * MiB]
sizes = st.one_of(st.sampled_from([0, 4, 512, 1000, 4 * KiB, 100 * KiB, 1 * MiB, *NEAR_SIZES]),
                  st.integers(0, 300 * KiB))


@st.composite
def palettes(draw) -> list[int]:
    """Up to three sizes, each perhaps with a neighbour a little larger: less than a small pool
    apart, so a large block of the one can be handed out whole for the other."""
    palette = []
    for size in draw(st.lists(sizes, min_size=1, max_size=3)):
        palette.append(size)
        if draw(st.booleans()):
            palette.append(size + draw(st.sampled_from([512, 3 * KiB, 256 * KiB, 768 * KiB])))
    return palette


@st.composite
def programs(draw, min_size: int = 1, max_size: int = 60) -> list[tuple[str, int]]:
    """A program of steps: ("alloc", nbytes), ("reuse", index) (`reuse_size`), ("fit", index)
    (`fit_size`), ("free", index into the live list) or ("empty", 0), in the ratio
    3 : 1 : 1 : 3 : 1, run one to three times over, as a training loop repeats its steps.

    The C path serves only sizes the Python path has seen: a request size it has rounded, a
    free block size it has listed. So sizes repeat: three requests in four take one from a
    palette (`palettes`), and the repeats find the sizes the first run listed."""
    palette = st.sampled_from(draw(palettes()))
    alloc = st.tuples(st.just("alloc"), st.one_of(palette, palette, palette, sizes))
    index = st.integers(0, 1 << 16)
    # NOTE: the oldest first often: blocks are cut from the top of a free block, so freeing in
    # order of allocation merges a block with the one after it
    free = st.tuples(st.just("free"), st.one_of(st.just(0), index))
    step = st.one_of(alloc, alloc, alloc, st.tuples(st.just("reuse"), index),
                     st.tuples(st.just("fit"), index), free, free, free,
                     st.tuples(st.just("empty"), st.just(0)))
    body = draw(st.lists(step, min_size=min_size, max_size=max_size))
    return body * draw(st.integers(1, 3))


operations = programs()


def kind_of_allocate(alloc: CachingAllocator, nbytes: int, merged: dict | None = None) -> set[str]:
    """What serving `nbytes` will do, read off the pools beforehand (changes nothing):
    "miss" (a new segment), else a hit on an "exact"-size block, or on a larger one, "split" or
    handed out "whole" (its leftover too small to split); "segment" when the block is a whole
    free segment, "coalesced" when it is as a free merged it (`merged`: block -> size then)."""
    size = alloc.size_classes.round(nbytes)
    pool = alloc._small if size <= alloc._small_size else alloc._large
    free_list = pool.buckets.get(size)
    block = None if free_list is None else free_list.first
    kinds = {"exact"}
    if block is None:
        sizes = pool.sizes
        fits = (pool.buckets[key].first for key in sizes[bisect_left(sizes, size):])
        block = next((first for first in fits if first is not None), None)
        if block is None:
            return {"miss"}
        kinds = {"split" if block.size - size >= pool.min_split else "whole"}
    if block.prev is None and block.next is None:
        kinds.add("segment")
    if merged is not None and merged.get(block) == block.size:
        kinds.add("coalesced")
    return kinds


def reuse_size(alloc: CachingAllocator, index: int) -> int | None:
    """A request size `alloc` has rounded before (so the C path may serve it) that a larger free
    block would serve, split or whole, the index-th of them (modulo); None if there is none."""
    fits = [nbytes for nbytes in sorted(alloc._rounded)
            if kind_of_allocate(alloc, nbytes) & {"split", "whole"}]
    return fits[index % len(fits)] if fits else None


def fit_size(alloc: CachingAllocator, index: int) -> int | None:
    """A request a little smaller than a free block, the index-th of them (modulo), 1 to 4
    granules less, so the block is handed out whole or split; None if no block is free."""
    blocks = alloc._small.free_blocks() + alloc._large.free_blocks()
    if not blocks:
        return None
    block = blocks[index % len(blocks)]
    nbytes = block.size - alloc.size_classes.granule * (1 + index % 4) + 1
    return nbytes if nbytes > 0 else None


#: The steps of a program that choose their request size from the allocator's state.
CHOOSERS = {"reuse": reuse_size, "fit": fit_size}


def run_program(alloc: CachingAllocator, program, check: bool = True) -> list:
    """Run `program` against `alloc`; return what it saw (offsets, sizes, serials, stats)."""
    live, seen = [], []
    for action, value in program:
        if action in CHOOSERS:
            action, value = "alloc", CHOOSERS[action](alloc, value)
            if value is None:
                continue
        if action == "alloc":
            try:
                allocation = alloc.allocate(value)
            except OutOfMemoryError:
                seen.append(("oom", value))
            else:
                live.append(allocation)
                seen.append(("alloc", allocation.serial, allocation.offset, allocation.size,
                             allocation.nbytes))
        elif action == "free" and live:
            allocation = live.pop(value % len(live))
            alloc.free(allocation)
            seen.append(("free", allocation.serial))
        elif action == "empty":
            alloc.empty_cache()
            seen.append(("empty",))
        if check:
            alloc.check_invariants()
    stats = alloc.stats()
    # NOTE: segments in a deterministic order (by address, the order varies from run to run)
    layout = sorted(json.dumps([s["pool"], s["nbytes"], s["blocks"]]) for s in alloc.snapshot())
    for allocation in live:
        alloc.free(allocation)
    alloc.check_invariants()
    return [seen, stats, layout]


# ---------------------------------------------------------------------- fast and slow, mixed
@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
@given(program=operations)
@settings(max_examples=60, deadline=None)
def test_random_programs_keep_the_invariants_after_every_step(options, program):
    # NOTE: run_program calls check_invariants() after every step; the counts must be exact too
    seen, stats, _ = run_program(allocators.create("caching", "cpu", **options), program)
    assert stats["num_allocs"] == sum(1 for event in seen if event[0] == "alloc")
    assert stats["num_frees"] == sum(1 for event in seen if event[0] == "free")


# ---------------------------------------------------------------- the two paths, field by field
class Witness(CachingAllocator):
    """A caching allocator that counts the requests its C hot path hands to the Python path.

    It keeps CachingAllocator's hooks, so its hot path stays on (`_hot`); the C code looks the
    slow methods up on the instance, so it finds these.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slow_calls = 0

    def _allocate_slow(self, nbytes):
        self.slow_calls += 1
        return CachingAllocator._allocate_slow(self, nbytes)

    def _free_slow(self, allocation):
        self.slow_calls += 1
        return CachingAllocator._free_slow(self, allocation)


def state_of(alloc: CachingAllocator, freed: list) -> dict[str, Any]:
    """Every field the C and the Python paths write, in terms two allocators can compare.

    A block is named by (segment number, offset), segments numbered in the order they were made
    (the order of `_segments`); memory is named by its segment. `freed` are allocations given
    back so far: their records must agree too (not live, no memory, no handle).
    """
    number = {id(head.raw): index for index, head in enumerate(alloc._segments)}

    def name(block):
        if block is None:
            return None
        return (number.get(id(block.raw), "not a segment of this allocator"), block.offset)

    def list_name(block):
        """A block's `free_list`: its size, whether listed, whether its pool's list now."""
        free_list = block.free_list
        if free_list is None:
            return None
        return (free_list.size, free_list.listed,
                block.pool.buckets.get(free_list.size) is free_list, name(free_list.first))

    def block_fields(block) -> dict[str, Any]:
        return {"at": name(block), "size": block.size, "free": block.free,
                "pool": block.pool.name, "prev": name(block.prev), "next": name(block.next),
                "prev_free": name(block.prev_free), "next_free": name(block.next_free),
                "free_list": list_name(block), "prev_idle": name(block.prev_idle),
                "next_idle": name(block.next_idle)}

    def record(allocation) -> dict[str, Any]:
        raw, handle = allocation.raw, allocation.handle
        return {"serial": allocation.serial, "live": allocation.live,
                "nbytes": allocation.nbytes, "size": allocation.size,
                "offset": allocation.offset,
                "memory": None if raw is None else number.get(id(raw), "elsewhere"),
                "memory is its block's": handle is not None and raw is handle.raw,
                "device": allocation.device is alloc.device, "owner": allocation.owner is alloc,
                "upstream": allocation.upstream,
                "handle": None if handle is None else block_fields(handle)}

    segments = []
    for head, nbytes in alloc._segments.items():
        blocks, block = [], head
        while block is not None:
            blocks.append(block_fields(block) | {"raw is the segment's": block.raw is head.raw})
            block = block.next
        segments.append({"nbytes": nbytes, "blocks": blocks})
    pools = {pool.name: {"min_split": pool.min_split, "sizes": list(pool.sizes),
                         "buckets": {size: (free_list.size, free_list.listed,
                                            name(free_list.first))
                                     for size, free_list in pool.buckets.items()}}
             for pool in (alloc._small, alloc._large)}
    idle = alloc._idle
    return {"live": [(serial, record(allocation)) for serial, allocation in alloc._live.items()],
            "freed": [record(allocation) for allocation in freed],
            "segments": segments, "pools": pools, "idle": [name(head) for head in idle],
            "idle ends": (name(idle.oldest), name(idle.newest)),
            "rounded": dict(alloc._rounded), "last_serial": alloc._last_serial,
            "counters": alloc._counters, "stats": alloc.stats()}


def kind_of_free(allocation) -> set[str]:
    """What freeing `allocation` will do: merge with the free block after it ("merge-next"),
    before it ("merge-prev"), or neither ("free", and "own list" when the block goes back to
    the free list it names, "list by size" when that list is no longer listed or it names none,
    so the list is looked up by size); "free-segment" when its segment becomes one free
    block."""
    block = allocation.handle
    after = block.next is not None and block.next.free
    before = block.prev is not None and block.prev.free
    kinds = {"merge-next"} if after else set()
    if before:
        kinds.add("merge-prev")
    if not kinds:
        named = block.free_list
        kinds = {"free", "own list" if named is not None and named.listed else "list by size"}
    if (block.prev is None or before and block.prev.prev is None) and (
            block.next is None or after and block.next.next is None):
        kinds.add("free-segment")
    return kinds


def run_both(options: dict, program, reached: Counter | None = None) -> None:
    """Run `program` on a hot and a Python-path allocator in lockstep; after every step both
    keep their invariants and agree on every field (`state_of`). `reached` counts the kinds of
    step (`kind_of_allocate`, `kind_of_free`) the C path served itself."""
    hot, cold = Witness("cpu", **options), Witness("cpu", **options)
    cold._hot = False  # NOTE: the Python path throughout, on the same state types
    assert hot._hot
    live: list[tuple[Any, Any]] = []
    freed: tuple[list, list] = ([], [])
    merged: dict = {}  # block -> its size when a free merged it (the hot allocator's)
    for step, (action, value) in enumerate(program):
        slow_calls = hot.slow_calls
        if action in CHOOSERS:
            action, value = "alloc", CHOOSERS[action](hot, value)
            if value is None:
                continue
        if action == "alloc":
            kinds = kind_of_allocate(hot, value, merged)
            try:
                allocation = hot.allocate(value)
            except OutOfMemoryError:
                kinds = {"out of memory"}
                with pytest.raises(OutOfMemoryError):
                    cold.allocate(value)
            else:
                live.append((allocation, cold.allocate(value)))
        elif action == "free" and live:
            pair = live.pop(value % len(live))
            kinds = kind_of_free(pair[0])
            block = pair[0].handle
            result = block.prev if "merge-prev" in kinds else block  # the free block it ends in
            for alloc, allocation, gone in zip((hot, cold), pair, freed):
                alloc.free(allocation)
                gone.append(allocation)
            if kinds & {"merge-next", "merge-prev"}:
                merged[result] = result.size
        elif action == "empty":
            kinds = {"empty"}
            hot.empty_cache()
            cold.empty_cache()
        else:
            continue
        in_c = action != "empty" and hot.slow_calls == slow_calls
        assert not (in_c and "miss" in kinds), f"step {step}: C made a segment"
        for kind in sorted(kinds):
            if currently_in_test_context():  # NOTE: --hypothesis-show-statistics lists them
                event(f"{kind} in {'C' if in_c else 'Python'}")
            if in_c and reached is not None:
                reached[kind] += 1
        hot.check_invariants()
        cold.check_invariants()
        assert state_of(hot, freed[0]) == state_of(cold, freed[1]), (
            f"step {step}: {action} {value} ({', '.join(sorted(kinds))}) differs")


@needs_speedups
@pytest.mark.parametrize("options, small, large",
                         [({}, 5 * MiB // 2, 3 * MiB),
                          ({"size_classes": SMALL_POOL_8K}, 9 * KiB, 12 * KiB)],
                         ids=["1mib-small-pool", "8k-small-pool"])
def test_a_block_handed_out_whole_is_counted_whole(options, small, large):
    """A cached block whose leftover is too small to split off is handed out whole: the C path
    records and counts the block's size, not the request's rounded size (it once did, so
    allocated_bytes fell short and check_invariants() failed)."""
    alloc = Witness("cpu", **options)
    kept = alloc.allocate(small)
    alloc.free(alloc.allocate(large))
    slow_calls = alloc.slow_calls
    whole = alloc.allocate(small)  # the free `large` block: less than a small pool is left
    assert alloc.slow_calls == slow_calls, "the C path did not serve the hit"
    assert whole.size == whole.handle.size == large
    assert alloc.stats()["allocated_bytes"] == kept.size + large
    alloc.check_invariants()
    alloc.free(whole)
    assert alloc.slow_calls == slow_calls, "the C path did not take the block back"
    assert alloc.stats()["allocated_bytes"] == kept.size
    alloc.check_invariants()
    # and field by field, step by step, against the Python path
    run_both(options, [("alloc", small), ("alloc", large), ("free", 1), ("alloc", small),
                       ("free", 1), ("alloc", small)])


def loop_program(seed: int = 0, steps: int = 40) -> list[tuple[str, int]]:
    """A seeded random program over sizes near the pool bounds, run three times over like a
    training loop: the first run lists the sizes, the repeats hit them (see `programs`). The
    programs of LOOP_SEEDS together have the C path serve every kind of step REACHED asks of
    every option set (the test below checks), whatever the random programs reach."""
    rng = random.Random(seed)
    palette = [4 * KiB, 100 * KiB, *NEAR_SIZES]
    body = []
    for _ in range(steps):
        draw = rng.random()
        if draw < 0.4:
            body.append(("alloc", rng.choice(palette)))
        elif draw < 0.6:
            body.append(("reuse" if draw < 0.5 else "fit", rng.randrange(1 << 16)))
        else:
            body.append(("free", rng.choice([0, 0, 1, rng.randrange(1 << 16)])))
    return body * 3


#: Seeds of `loop_program` whose programs, together, reach every kind of step of REACHED (seed 0
#: alone misses a block handed out whole under "8k-pytorch", and frees that look their list up).
LOOP_SEEDS = (0, 5)
#: The kinds of step each option set must see the C path serve over a run of the test below.
#: Small blocks are multiples of the granule, the small pool's min_split, so only large blocks
#: can be handed out whole; pow2's large blocks are multiples of 2 MiB, more than a small pool
#: apart, so never; under max_cached_bytes every free goes the Python way.
ALL_HITS = {"exact", "split", "whole", "segment", "coalesced"}
ALL_FREES = {"free", "own list", "list by size", "merge-next", "merge-prev", "free-segment"}
REACHED = {
    "exact": ALL_HITS | ALL_FREES,
    "pytorch": ALL_HITS | ALL_FREES,
    "pytorch-mantissa": ALL_HITS | ALL_FREES,
    "pow2-bounded": ALL_HITS - {"whole"},
    "limited": ALL_HITS | ALL_FREES,
    "8k-exact": ALL_HITS | ALL_FREES,
    "8k-pytorch": ALL_HITS | ALL_FREES,
}


@needs_speedups
@pytest.mark.parametrize("options, expected",
                         [(options, REACHED[name]) for options, name in zip(OPTIONS, OPTION_IDS)],
                         ids=OPTION_IDS)
def test_the_hot_path_does_what_the_python_path_does(options, expected):
    """Programs on a hot and a Python-path allocator: after every step, every field of every
    allocation record (live and freed) and of every block, the free lists, the LRU, the memo,
    every counter and every key of stats() agree, and both keep their invariants. The loop
    programs (LOOP_SEEDS) come first and must see the C path serve every kind of hit and free
    the options allow (REACHED); random programs follow."""
    reached: Counter = Counter()
    for seed in LOOP_SEEDS:
        run_both(options, loop_program(seed), reached)
    assert expected <= set(reached), f"the C path never served {expected - set(reached)}"

    # NOTE: an inner @given, so the loop programs run once; soak mode scales it here, as the
    # plugin scales top-level tests.
    @given(program=programs(min_size=10))
    @settings(max_examples=40 * soak_factor(), deadline=None)
    def same_on_both_paths(program) -> None:
        run_both(options, program)

    same_on_both_paths()




@needs_speedups
def test_the_hot_path_serves_repeating_requests_without_python(monkeypatch):
    alloc = allocators.create("caching", "cpu", segments="pytorch")
    calls = []
    slow_allocate, slow_free = CachingAllocator._allocate_slow, CachingAllocator._free_slow
    monkeypatch.setattr(CachingAllocator, "_allocate_slow",
                        lambda self, n: calls.append(n) or slow_allocate(self, n))
    monkeypatch.setattr(CachingAllocator, "_free_slow",
                        lambda self, a: calls.append(a) or slow_free(self, a))
    step = [4 * KiB, 4 * KiB, 100 * KiB, 1000, 3 * MiB]
    for rounds in (2, 5):  # the first rounds round the sizes and list the free sizes
        calls.clear()
        for _ in range(rounds):
            held = [alloc.allocate(n) for n in step]  # splits of free segments ...
            for allocation in held[::2] + held[1::2]:
                alloc.free(allocation)  # ... and coalescing, in both directions
            alloc.check_invariants()
    assert calls == []
    assert alloc.stats()["cache_misses"] == alloc.stats()["num_device_allocs"]


def test_pure_python_and_the_extension_agree():
    """The same program in this process and in a pure-Python one: same stats, same offsets.
    Besides the caching allocator, the direct one and an adaptor, whose books are kept by the
    base class (AllocatorState._book_allocation / _book_free, C in one build, Python in the
    other)."""
    script = (
        "import json, random, sys\n"
        "sys.path.insert(0, 'tests')\n"
        "import allocators\n"
        "from allocators.adaptors import StatisticsAdaptor\n"
        "from test_speedups import run_program\n"
        "rng = random.Random(7)\n"
        "sizes = [0, 4, 1000, 4096, 100 * 1024, 1 << 20, 3 << 20, 777]\n"
        "program = [('alloc', rng.choice(sizes)) if rng.random() < 0.55 else\n"
        "           ('free', rng.randrange(1 << 16)) for _ in range(400)]\n"
        "out = {}\n"
        "for segments in ('exact', 'pytorch'):\n"
        "    alloc = allocators.create('caching', 'cpu', segments=segments)\n"
        "    out[segments] = run_program(alloc, program, check=False)\n"
        "def books(alloc):\n"
        "    live, serials = [], []\n"
        "    for action, value in program:\n"
        "        if action == 'alloc':\n"
        "            live.append(alloc.allocate(value))\n"
        "            serials.append(live[-1].serial)\n"
        "        elif live:\n"
        "            alloc.free(live.pop(value % len(live)))\n"
        "    alloc.check_invariants()\n"
        "    return [serials, alloc.stats()]\n"
        "out['direct'] = books(allocators.create('direct', 'cpu'))\n"
        "out['statistics'] = books(StatisticsAdaptor(allocators.create('caching', 'cpu')))\n"
        "print(json.dumps({'accelerated': allocators.ACCELERATED, 'runs': out}))\n")

    def run(pure: bool) -> dict:
        env = dict(os.environ)
        env.pop(PURE_PYTHON_ENV, None)
        if pure:
            env[PURE_PYTHON_ENV] = "1"
        done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, check=True,
                              capture_output=True, text=True)
        return json.loads(done.stdout)

    pure, default = run(pure=True), run(pure=False)
    assert pure["accelerated"] is False
    assert pure["runs"] == default["runs"]
    assert default["runs"]["direct"][1]["num_allocs"] > 100


@needs_speedups
def test_threads_mixing_both_paths_lose_nothing():
    alloc = allocators.create("caching", "cpu", segments="pytorch")
    stop = threading.Event()

    def worker(index: int) -> None:
        rng = np.random.default_rng(index)
        live = []
        for _ in range(1500):
            if live and rng.random() < 0.5:
                alloc.free(live.pop(int(rng.integers(len(live)))))
            else:
                nbytes = int(rng.choice([512, 4 * KiB, 64 * KiB, int(rng.integers(1, 900_000))]))
                live.append(alloc.allocate(nbytes))
        for allocation in live:
            alloc.free(allocation)

    errors: list[BaseException] = []

    def meddler() -> None:  # holds the lock from Python, so the C path must step aside
        try:
            while not stop.is_set():
                alloc.stats()
                alloc.empty_cache()
                alloc.check_invariants()
        except BaseException as exc:
            errors.append(exc)

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    side = threading.Thread(target=meddler)
    side.start()
    try:
        run_threads(worker, 4)
    finally:
        stop.set()
        side.join()
        sys.setswitchinterval(old_interval)
    if errors:
        raise errors[0]
    stats = alloc.stats()
    assert stats["num_allocs"] == stats["num_frees"] > 0
    assert stats["allocated_bytes"] == stats["requested_bytes"] == 0
    alloc.check_invariants()


class _Releaser:
    """Frees an allocation when the garbage collector finalizes it (like a dropped tensor)."""

    def __init__(self, alloc, allocation) -> None:
        self.alloc, self.allocation, self.cycle = alloc, allocation, self

    def __del__(self) -> None:
        self.alloc.free(self.allocation)


def test_finalizers_that_free_during_an_allocation_do_no_harm():
    alloc = allocators.create("caching", "cpu", segments="pytorch")
    old = gc.get_threshold()
    gc.set_threshold(1)  # NOTE: a collection at (nearly) every new tracked object
    try:
        for index in range(300):
            _Releaser(alloc, alloc.allocate([512, 4096, 70_000][index % 3]))
            alloc.free(alloc.allocate([4096, 512, 1000][index % 3]))
    finally:
        gc.set_threshold(*old)
    gc.collect()
    alloc.check_invariants()
    stats = alloc.stats()
    assert stats["num_allocs"] == stats["num_frees"] == 600


# ---------------------------------------------------------------------- same answers, same errors
@pytest.mark.parametrize("bad, error", [(-1, ValueError), (1.0, TypeError), (True, TypeError),
                                        ("8", TypeError), (np.int64(-3), ValueError)])
def test_bad_sizes_raise_as_before(bad, error):
    alloc = allocators.create("caching", "cpu")
    alloc.free(alloc.allocate(8))
    with pytest.raises(error):
        alloc.allocate(bad)
    assert alloc.stats()["num_allocs"] == 1


def test_numpy_and_huge_sizes_take_the_python_path():
    alloc = allocators.create("caching", "cpu")
    alloc.free(alloc.allocate(np.int32(100)))
    assert alloc.allocate(np.int64(100)).size == 512
    with pytest.raises(OutOfMemoryError):
        alloc.allocate(1 << 70)  # past a C long long: the Python path says out of memory


def test_double_and_foreign_frees_are_refused_with_the_same_messages():
    alloc, other = allocators.create("caching", "cpu"), allocators.create("caching", "cpu")
    allocation = alloc.allocate(4096)
    stranger = other.allocate(4096)
    alloc.free(allocation)
    with pytest.raises(InvalidFreeError, match="double free: allocation #1 of 4.00 KiB"):
        alloc.free(allocation)
    with pytest.raises(InvalidFreeError, match="belongs to"):
        alloc.free(stranger)
    with pytest.raises(TypeError, match="takes an Allocation"):
        alloc.free("not an allocation")
    alloc.check_invariants()
    other.free(stranger)


def test_serials_come_from_one_counter_on_both_paths():
    alloc = allocators.create("caching", "cpu")
    first = alloc.allocate(700)  # the Python path: a new size
    second = alloc.allocate(700)  # a new segment again: Python
    alloc.free(first)
    third = alloc.allocate(700)  # a cache hit: C where built
    fourth = alloc.allocate(5000)
    assert [a.serial for a in (first, second, third, fourth)] == [1, 2, 3, 4]
    assert sorted(a.serial for a in alloc.live_allocations()) == [2, 3, 4]
    assert alloc._last_serial == 4


def test_a_subclass_with_hooks_of_its_own_runs_in_python():
    class Counting(CachingAllocator):
        def _allocate(self, nbytes):
            self.calls = getattr(self, "calls", 0) + 1
            return super()._allocate(nbytes)

    alloc = Counting()
    assert not alloc._hot
    for _ in range(3):
        alloc.free(alloc.allocate(100))
    assert alloc.calls == 3


def test_counters_are_one_state_for_python_and_c():
    alloc = allocators.create("caching", "cpu")
    alloc.free(alloc.allocate(1000))
    held = alloc.allocate(1000)  # a hit
    assert alloc._num_allocs == 2 and alloc.stats()["cache_hits"] == 1
    alloc._num_ooms += 5  # Python writes the field the C path reads
    assert alloc.stats()["num_ooms"] == 5
    alloc.free(held)
    assert alloc._counters["num_frees"] == 2


def test_the_books_change_nothing_when_they_refuse():
    """Allocator.allocate's books (AllocatorState._book_allocation) are all or nothing."""
    alloc = allocators.create("direct", "cpu")
    kept = alloc.allocate(64)
    before = alloc.stats()
    stray = allocators.Allocation(alloc.device, None, 0, 8, 8)
    with pytest.raises(TypeError):
        alloc._book_allocation(stray, "eight", 0)
    assert alloc.stats() == before and alloc._last_serial == kept.serial == 1
    assert stray.owner is None and not stray.live and alloc._live == {1: kept}
    alloc.free(kept)
    alloc.check_invariants()


@needs_speedups
def test_the_pools_and_the_lru_take_only_records_of_their_kind():
    """The hot path follows `_small`, `_large` and `_idle` without checking their types: the
    C state checks them when they are set."""
    alloc = allocators.create("caching", "cpu")
    for field, kind in (("_small", "PoolRecord"), ("_large", "PoolRecord"),
                        ("_idle", "IdleRecord")):
        with pytest.raises(TypeError, match=f"^{field} takes a {kind}, not dict$"):
            setattr(alloc, field, {})
        with pytest.raises(TypeError, match="not a deletion"):
            delattr(alloc, field)
    alloc._small, alloc._large = alloc._small, alloc._large
    for _ in range(3):
        alloc.free(alloc.allocate(1000))
    alloc.check_invariants()
    assert alloc.stats()["cache_hits"] == 2
    assert allocators.create("direct", "cpu")._idle is None  # unset: reads as None


@needs_speedups
def test_allocate_and_free_are_c_methods_of_the_caching_allocator_itself():
    """So that CPython specializes `alloc.allocate(n)` (it does for exactly the descriptor's
    class); a subclass (Witness) runs the same C code through the generic call."""
    for name in ("allocate", "free"):
        method = CachingAllocator.__dict__[name]
        assert type(method).__name__ == "method_descriptor"
        assert method.__objclass__ is CachingAllocator
    alloc = Witness("cpu")
    alloc.free(alloc.allocate(100))
    alloc.free(alloc.allocate(100))
    assert alloc.slow_calls == 2  # the first allocate and free: a new size


@needs_speedups
def test_the_c_search_gives_up_where_python_prunes():
    assert speedups.PRUNE_AFTER == _PRUNE_AFTER


# ---------------------------------------------------------------------- the lock
@needs_speedups
def test_the_lock_is_a_plain_lock():
    lock = speedups.Lock()
    assert not lock.locked()
    assert lock.acquire()
    assert lock.locked()
    assert not lock.acquire(blocking=False)
    assert not lock.acquire(timeout=0.01)
    lock.release()
    with pytest.raises(RuntimeError, match="release unlocked lock"):
        lock.release()
    with lock:
        assert lock.locked()
    assert not lock.locked()
    with pytest.raises(ValueError):
        lock.acquire(blocking=False, timeout=1)
    with pytest.raises(ValueError):
        lock.acquire(timeout=-2)
    with pytest.raises(TypeError):
        speedups.Lock(1)
    assert "unlocked" in repr(lock)


@needs_speedups
def test_a_blocking_acquire_waits_without_the_gil():
    lock = speedups.Lock()
    lock.acquire()
    got = []
    waiter = threading.Thread(target=lambda: got.append(lock.acquire()))
    waiter.start()
    ticks = 0
    deadline = time.monotonic() + 0.2
    while time.monotonic() < deadline:  # NOTE: this thread keeps running: the GIL is free
        ticks += 1
    assert got == [] and ticks > 0
    lock.release()
    waiter.join(timeout=5)
    assert got == [True] and lock.locked()
    lock.release()


@needs_speedups
def test_allocators_use_the_c_lock_and_the_hot_path_steps_aside_while_it_is_held():
    alloc = allocators.create("caching", "cpu")
    assert isinstance(alloc._lock, speedups.Lock)
    alloc.free(alloc.allocate(64))
    alloc._lock.acquire()
    result = []
    worker = threading.Thread(target=lambda: result.append(alloc.allocate(64)))
    worker.start()
    worker.join(timeout=0.2)
    assert worker.is_alive() and result == []  # it waits for the lock in the Python path
    alloc._lock.release()
    worker.join(timeout=5)
    assert len(result) == 1
    alloc.free(result[0])
    alloc.check_invariants()


# ---------------------------------------------------------------------- CI: the pure-Python build
@pytest.mark.slow
@pytest.mark.skipif(not allocators.ACCELERATED,
                    reason="this run is pure Python already (the suite itself covers it)")
def test_the_allocator_tests_pass_in_pure_python_mode():
    done = pytest_in_pure_python("tests/test_allocators.py", "tests/test_caching.py",
                                         "tests/test_adaptors.py", "tests/test_speedups.py")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
