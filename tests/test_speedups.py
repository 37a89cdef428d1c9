"""The caching allocator's C hot path (allocators._speedups) against its Python reference.

The C code serves cache hits (best fit, split, coalesce) and hands everything else to the Python
implementation, on one shared state. These tests mix both paths at random and check the
invariants after every step, compare them step by step (`_hot` off is the Python path on the
same state types; BLOCKRT_PURE_PYTHON=1 in a subprocess is the pure-Python build), test the
lock, and run the allocator test files once more in pure-Python mode so CI covers both builds.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import allocators
from allocators import InvalidFreeError, OutOfMemoryError
from allocators._core import PURE_PYTHON_ENV, speedups
from allocators.caching import _PRUNE_AFTER, CachingAllocator
from helpers import run_threads

ROOT = Path(__file__).resolve().parent.parent
KiB = 1 << 10
MiB = 1 << 20

needs_speedups = pytest.mark.skipif(
    not allocators.ACCELERATED,
    reason=f"allocators._speedups is not in use (not built at install, for want of a C "
           f"compiler, or {PURE_PYTHON_ENV} is set)")

#: Options that take the hot path through its cases: exact segments (whole-segment hits),
#: shared segments (splits and coalescing), size classes, and a cache bound (Python frees).
OPTIONS = [
    {},
    {"segments": "pytorch"},
    {"segments": "pytorch", "size_classes": "mantissa"},
    {"size_classes": "pow2", "max_cached_bytes": 3 * MiB, "segments": "pytorch"},
    {"limit_bytes": 3 * MiB, "segments": "pytorch"},
]
OPTION_IDS = ["exact", "pytorch", "pytorch-mantissa", "pow2-bounded", "limited"]

#: Sizes that repeat (so most requests are cache hits), with a few odd ones and a large one.
sizes = st.one_of(st.sampled_from([0, 4, 512, 1000, 4 * KiB, 100 * KiB, 1 * MiB, 3 * MiB]),
                  st.integers(0, 300 * KiB))
_alloc = st.tuples(st.just("alloc"), sizes)
_free = st.tuples(st.just("free"), st.integers(0, 1 << 16))
#: A program: ("alloc", nbytes), ("free", index into the live list) or ("empty", 0), in the
#: ratio 3 : 3 : 1.
operations = st.lists(st.one_of(_alloc, _alloc, _alloc, _free, _free, _free,
                                st.tuples(st.just("empty"), st.just(0))),
                      min_size=1, max_size=60)


def run_program(alloc: CachingAllocator, program, check: bool = True) -> list:
    """Run `program` against `alloc`; return what it saw (offsets, sizes, serials, stats)."""
    live, seen = [], []
    for action, value in program:
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


@needs_speedups
@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
@given(program=operations)
@settings(max_examples=60, deadline=None)
def test_the_hot_path_does_what_the_python_path_does(options, program):
    hot = allocators.create("caching", "cpu", **options)
    cold = allocators.create("caching", "cpu", **options)
    cold._hot = False  # NOTE: the Python path throughout, on the same state types
    assert hot._hot
    assert run_program(hot, program) == run_program(cold, program)


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
    """The same program in this process and in a pure-Python one: same stats, same offsets."""
    script = (
        "import json, random, sys\n"
        "sys.path.insert(0, 'tests')\n"
        "import allocators\n"
        "from test_speedups import run_program\n"
        "rng = random.Random(7)\n"
        "sizes = [0, 4, 1000, 4096, 100 * 1024, 1 << 20, 3 << 20, 777]\n"
        "program = [('alloc', rng.choice(sizes)) if rng.random() < 0.55 else\n"
        "           ('free', rng.randrange(1 << 16)) for _ in range(400)]\n"
        "out = {}\n"
        "for segments in ('exact', 'pytorch'):\n"
        "    alloc = allocators.create('caching', 'cpu', segments=segments)\n"
        "    out[segments] = run_program(alloc, program, check=False)\n"
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
    env = dict(os.environ, **{PURE_PYTHON_ENV: "1"})
    files = ["tests/test_allocators.py", "tests/test_caching.py", "tests/test_adaptors.py",
             "tests/test_speedups.py"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           *files], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
