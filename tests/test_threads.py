"""Four threads share one allocator and one constant pool, under workloads hypothesis draws.

Hypothesis draws a program per thread: allocate a size, free, write a new byte pattern, verify
one, check for overlaps, look up a constant, drop one. The threads start together behind a
barrier, meet once more halfway (where, with every thread parked, the stats must equal the sums
over what the programs did so far), and finish. Checked throughout:

- no two live allocations overlap: a thread files an allocation in a shared register after
  `allocate()` returns and takes it out before calling `free()`, so the register only ever holds
  memory that is really live, and any overlap in it is a real one;
- every thread's bytes survive the others' work (each allocation holds a pattern of its own,
  written and read back through the device);
- no allocation is lost or returned twice: the counters (allocations, frees, bytes requested and
  allocated) are exact at the halfway barrier and at the end, where they are back to where they
  started, and the allocator's `check_invariants()` passes;
- the constant pool shares one block per content across threads, its lookups equal the lookups
  made, hits + misses add up, each miss is one allocation, and it is empty once the tensors go;
  a lookup racing the release of the last tensor over the same content never hands out a tensor
  whose memory is being freed (`test_a_lookup_never_revives_a_constant_being_freed`).

The allocators: the caching allocator's C hot path, its Python path (`_hot` off: the same state,
no C), the same under a StatisticsAdaptor, and the runtime's default allocator and default
constant pool. `test_the_thread_tests_pass_in_pure_python_mode` reruns this file with
BLOCKRT_PURE_PYTHON=1, the build without the extension.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import allocators
import runtime
from allocators import Allocation, Allocator, StatisticsAdaptor
from allocators.testing import allocation_sizes, byte_pattern
from helpers import pytest_in_pure_python, run_threads
from runtime import ConstantPool
from runtime.constant import get_default_constant_pool

ROOT = Path(__file__).resolve().parent.parent
THREADS = 4
MiB = 1 << 20

#: What the constants hold: a few contents that every thread draws from, so threads look up
#: equal contents at the same time. The values are odd enough that no other test holds them.
CONTENTS = [np.arange(n, dtype=np.float64) * 7919.0 + 0.8125 + k
            for k, n in enumerate((1, 3, 64, 1000, 20_000))]
CONTENTS.append(np.full(17, 0xB10C, dtype=np.int32))

# ---------------------------------------------------------------------- programs
sizes = st.one_of(allocation_sizes(256 << 10), st.sampled_from([512, 4096, 3 * MiB]))
index = st.integers(0, 1 << 16)  # NOTE: taken modulo the length of the list it picks from
operation = st.one_of(
    st.tuples(st.just("alloc"), sizes),
    st.tuples(st.just("free"), index),
    st.tuples(st.just("write"), index),
    st.tuples(st.just("verify"), index),
    st.tuples(st.just("overlaps"), st.just(0)),
    st.tuples(st.just("constant"), st.integers(0, len(CONTENTS) - 1)),
    st.tuples(st.just("drop"), index),
)
programs = st.lists(st.lists(operation, max_size=60), min_size=THREADS, max_size=THREADS)


@dataclass
class Counts:
    """What one thread's program did, for the exact checks."""

    allocs: int = 0
    frees: int = 0
    requested: int = 0  # NOTE: bytes asked for by every allocation, freed or not
    lookups: int = 0
    live: list[tuple[Allocation, np.ndarray]] = field(default_factory=list)
    constants: list[tuple[runtime.Tensor, int]] = field(default_factory=list)


class Register:
    """The allocations live right now, whoever made them; complains on any overlap."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, Allocation] = {}

    def add(self, allocation: Allocation) -> None:
        start, end = allocation.ptr, allocation.ptr + allocation.nbytes
        with self._lock:
            for other in self._live.values():
                # NOTE: empty ranges overlap nothing, whatever their addresses.
                if allocation.nbytes and other.nbytes and start < other.ptr + other.nbytes \
                        and other.ptr < end:
                    raise AssertionError(f"{allocation!r} overlaps {other!r}, which is live")
            self._live[id(allocation)] = allocation

    def remove(self, allocation: Allocation) -> None:
        with self._lock:
            del self._live[id(allocation)]

    def check(self) -> None:
        # NOTE: addresses are read under the lock, where nothing in the register can be freed
        with self._lock:
            live = [a for a in self._live.values() if a.nbytes]
            spans = sorted((a.ptr, a.ptr + a.nbytes, n) for n, a in enumerate(live))
        # NOTE: sorted by start, any overlap shows up between neighbours.
        for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
            assert end <= start, f"live allocations {live[first]!r} and {live[second]!r} overlap"

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)


class Workload:
    """Runs one program per thread against `allocator` and `pool`, and checks the results."""

    def __init__(self, allocator: Allocator, pool: ConstantPool,
                 constant: Callable[[np.ndarray], runtime.Tensor]) -> None:
        self.allocator, self.pool, self.constant = allocator, pool, constant
        self.register = Register()
        self.counts = [Counts() for _ in range(THREADS)]
        self.stats0 = allocator.stats()
        self.pool0 = pool.stats()
        self.pool_size0 = len(pool)

    # ------------------------------------------------------------------ one thread
    def run(self, thread: int, program: list[tuple[str, int]], halfway: threading.Barrier) -> None:
        middle = len(program) // 2
        for step, (action, value) in enumerate(program):
            if step == middle:
                halfway.wait()
            getattr(self, f"_{action}")(thread, step, value)
        if middle == len(program):  # NOTE: an empty program still meets the others halfway
            halfway.wait()
        counts = self.counts[thread]
        while counts.live:
            self._free(thread, 0, 0)
        while counts.constants:
            self._drop(thread, 0, 0)

    def _alloc(self, thread: int, step: int, nbytes: int) -> None:
        allocation = self.allocator.allocate(nbytes)
        assert allocation.nbytes == nbytes and allocation.live, f"asked {nbytes}: {allocation!r}"
        self.register.add(allocation)
        counts = self.counts[thread]
        counts.allocs += 1
        counts.requested += nbytes
        counts.live.append((allocation, self._write_pattern(allocation, thread, step)))

    def _free(self, thread: int, step: int, value: int) -> None:
        live = self.counts[thread].live
        if not live:
            return
        allocation, pattern = live.pop(value % len(live))
        self._check_pattern(allocation, pattern, thread)
        self.register.remove(allocation)  # NOTE: before free(), see the module docstring
        self.allocator.free(allocation)
        assert not allocation.live, f"{allocation!r} is still live after free()"
        self.counts[thread].frees += 1

    def _write(self, thread: int, step: int, value: int) -> None:
        live = self.counts[thread].live
        if live:
            position = value % len(live)
            allocation, _ = live[position]
            live[position] = (allocation, self._write_pattern(allocation, thread, step))

    def _verify(self, thread: int, step: int, value: int) -> None:
        live = self.counts[thread].live
        if live:
            self._check_pattern(*live[value % len(live)], thread)

    def _overlaps(self, thread: int, step: int, value: int) -> None:
        self.register.check()

    def _constant(self, thread: int, step: int, which: int) -> None:
        tensor = self.constant(CONTENTS[which])
        self.counts[thread].lookups += 1
        self._check_constant(tensor, which, thread)
        self.counts[thread].constants.append((tensor, which))

    def _drop(self, thread: int, step: int, value: int) -> None:
        constants = self.counts[thread].constants
        if constants:
            tensor, which = constants.pop(value % len(constants))
            self._check_constant(tensor, which, thread)
            tensor.release()

    @staticmethod
    def _write_pattern(allocation: Allocation, thread: int, step: int) -> np.ndarray:
        # NOTE: the tag differs for every (thread, step), so no two writes put the same bytes.
        pattern = byte_pattern(thread << 20 | step, allocation.nbytes)
        allocation.device.copyin(allocation.raw, allocation.offset, pattern)
        return pattern

    @staticmethod
    def _check_pattern(allocation: Allocation, pattern: np.ndarray, thread: int) -> None:
        found = allocation.device.copyout(allocation.raw, allocation.offset, allocation.nbytes)
        changed = np.flatnonzero(np.asarray(found, dtype=np.uint8) != pattern)
        assert not changed.size, (f"thread {thread}: {changed.size} bytes of {allocation!r} "
                                  f"changed under it, the first at byte {int(changed[0])}")

    @staticmethod
    def _check_constant(tensor: runtime.Tensor, which: int, thread: int) -> None:
        assert np.array_equal(tensor.numpy(), CONTENTS[which]), (
            f"thread {thread}: constant {which} does not hold its content")

    # ------------------------------------------------------------------ checks, threads parked
    def check_parked(self) -> None:
        """With every thread parked (halfway, or done): the stats are exact sums."""
        self.register.check()
        self.allocator.check_invariants()
        self.pool.check_invariants()
        stats, pool = self.allocator.stats(), self.pool.stats()
        delta = {key: stats[key] - self.stats0[key] for key in
                 ("num_allocs", "num_frees", "requested_bytes", "allocated_bytes")}
        misses = pool["misses"] - self.pool0["misses"]
        lookups = pool["lookups"] - self.pool0["lookups"]
        live = [allocation for counts in self.counts for allocation, _ in counts.live]
        constants = [pair for counts in self.counts for pair in counts.constants]
        # NOTE: one block per content across all threads, and nothing else new in the pool
        blocks_by_content: dict[int, set[int]] = {}
        for tensor, which in constants:
            blocks_by_content.setdefault(which, set()).add(tensor.block.id)
        shared = {which: ids for which, ids in blocks_by_content.items() if len(ids) != 1}
        assert not shared, f"equal constants in several blocks (content: block ids): {shared}"
        blocks = list({tensor.block.id: tensor.block for tensor, _ in constants}.values())
        assert len(self.pool) - self.pool_size0 == len(blocks), (
            f"the pool holds {len(self.pool) - self.pool_size0} new constants, "
            f"the threads hold {len(blocks)}")
        block_sizes = [block.memory_for_read("the thread test").size for block in blocks]
        expected = {
            "num_allocs": sum(c.allocs for c in self.counts) + misses,
            "num_frees": sum(c.frees for c in self.counts) + misses - len(blocks),
            "requested_bytes": sum(a.nbytes for a in live) + sum(b.nbytes for b in blocks),
            "allocated_bytes": sum(a.size for a in live) + sum(block_sizes),
        }
        wrong = {key: (delta[key], value) for key, value in expected.items()
                 if delta[key] != value}
        assert not wrong, f"stats moved by other amounts than the threads' work: {wrong}"
        assert lookups == sum(c.lookups for c in self.counts), (
            f"the pool counted {lookups} lookups, the threads made "
            f"{sum(c.lookups for c in self.counts)}")
        assert pool["hits"] + pool["misses"] == pool["lookups"], f"hits + misses: {pool}"
        assert pool["collisions"] == self.pool0["collisions"], f"a digest collision? {pool}"
        assert stats["cache_hits"] + stats["cache_misses"] == stats["num_allocs"], stats

    def check_end(self) -> None:
        """After every thread freed and dropped all it held: back to the start, exactly."""
        assert len(self.register) == 0
        self.check_parked()
        stats = self.allocator.stats()
        for key in ("allocated_bytes", "requested_bytes"):
            assert stats[key] == self.stats0[key], f"{key}: {self.stats0[key]} -> {stats[key]}"
        assert stats["num_allocs"] - stats["num_frees"] == (
            self.stats0["num_allocs"] - self.stats0["num_frees"]), "an allocation was not freed"
        assert len(self.pool) == self.pool_size0, f"the pool kept constants: {self.pool!r}"
        assert self.pool.stats()["bytes"] == self.pool0["bytes"]


@contextmanager
def frequent_switches() -> Iterator[None]:
    """Switch threads every 10 microseconds, so that the calls really interleave."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def run_workload(workload: Workload, programs: list[list[tuple[str, int]]]) -> None:
    """Run `programs` in THREADS threads that start together; re-raise the first real error."""
    start = threading.Barrier(THREADS)
    halfway = threading.Barrier(THREADS, action=workload.check_parked)
    errors: list[BaseException] = []

    def run(thread: int) -> None:
        try:
            start.wait()
            workload.run(thread, programs[thread], halfway)
        except BaseException as exc:
            errors.append(exc)
            start.abort()  # NOTE: the others must not wait for this thread at a barrier
            halfway.abort()

    threads = [threading.Thread(target=run, args=(n,)) for n in range(THREADS)]
    with frequent_switches():
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    # NOTE: a broken barrier is what the other threads saw; the error is what broke it.
    real = [exc for exc in errors if not isinstance(exc, threading.BrokenBarrierError)]
    if errors:
        raise (real or errors)[0]
    workload.check_end()


# ---------------------------------------------------------------------- the allocators
def _caching(hot: bool) -> Callable[[], Allocator]:
    def make() -> Allocator:
        alloc = allocators.create("caching", "cpu", segments="pytorch",
                                  max_cached_bytes=8 * MiB)
        alloc._hot = hot  # NOTE: off, the Python path runs on the same state types
        return alloc
    return make


needs_speedups = pytest.mark.skipif(not allocators.ACCELERATED,
                                    reason="allocators._speedups is not in use")
FACTORIES = [
    pytest.param(_caching(hot=True), id="caching-c", marks=needs_speedups),
    pytest.param(_caching(hot=False), id="caching-python"),
    pytest.param(lambda: StatisticsAdaptor(_caching(hot=allocators.ACCELERATED)()),
                 id="statistics-over-caching"),
]


@pytest.mark.parametrize("factory", FACTORIES)
@given(programs=programs)
@settings(max_examples=100)
def test_threads_share_an_allocator_and_a_constant_pool(factory, programs):
    allocator = factory()
    pool = ConstantPool(allocator)
    run_workload(Workload(allocator, pool, pool.constant), programs)
    allocator.empty_cache()
    assert allocator.stats()["reserved_bytes"] == 0


@given(programs=programs)
@settings(max_examples=60)
def test_threads_share_the_default_allocator_and_constant_pool(programs):
    pool = get_default_constant_pool("cpu")
    # NOTE: the default pool keeps constants in read-only memory from an allocator of its own;
    # the threads share that one (the caching allocator has the tests above)
    assert isinstance(pool.allocator, runtime.ReadOnlyAllocator)
    run_workload(Workload(pool.allocator, pool, lambda data: runtime.constant(data, device="cpu")),
                 programs)


@given(programs=programs)
@settings(max_examples=40)
def test_the_statistics_adaptor_counts_every_threads_traffic(programs):
    adaptor = StatisticsAdaptor(_caching(hot=allocators.ACCELERATED)())
    pool = ConstantPool(adaptor)
    workload = Workload(adaptor, pool, pool.constant)
    run_workload(workload, programs)
    adaptor.check_invariants()
    stats, upstream = adaptor.stats(), adaptor.upstream.stats()
    misses = pool.stats()["misses"]
    # NOTE: the adaptor is the upstream's only user, so both count the same traffic
    assert stats["num_allocs"] == upstream["num_allocs"] == sum(
        c.allocs for c in workload.counts) + misses
    assert stats["num_frees"] == upstream["num_frees"] == stats["num_allocs"]
    assert sum(adaptor.histogram().values()) == stats["num_allocs"]
    assert adaptor.counters()["allocations"] == {
        "current": 0, "peak": stats["peak_active_allocations"], "total": stats["num_allocs"]}
    largest = max(len(c) for c in CONTENTS) * 8
    program_bytes = sum(c.requested for c in workload.counts)
    # NOTE: which contents missed depends on the interleaving; each miss asked for one of them
    assert program_bytes <= stats["total_requested_bytes"] <= program_bytes + misses * largest


# ---------------------------------------------------------------------- CI: the pure-Python build
@pytest.mark.slow
@pytest.mark.skipif(not allocators.ACCELERATED,
                    reason="this run is pure Python already (the tests above cover it)")
def test_the_thread_tests_pass_in_pure_python_mode():
    done = pytest_in_pure_python("tests/test_threads.py", "-k", "not pure_python_mode")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1 skipped" in done.stdout, "the C hot path test should skip without the extension"


def test_a_lookup_never_revives_a_constant_being_freed() -> None:
    """Four threads look up the same content and release it at once, switching every
    microsecond: a lookup racing the last release must either share the block before the
    release (which then frees nothing) or miss and make a new block, never share a block whose
    memory is going back (its tensor would raise UseAfterFreeError)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        pool = ConstantPool(allocators.create("caching", "cpu"))
        data = np.arange(16.0)

        def worker(index: int) -> None:
            for _ in range(3000):
                t = pool.constant(data)
                assert np.array_equal(t.numpy(), data)
                t.release()

        run_threads(worker, THREADS)
    finally:
        sys.setswitchinterval(interval)
    stats = pool.stats()
    assert stats["lookups"] == 3000 * THREADS == stats["hits"] + stats["misses"]
    assert stats["constants"] == 0 and pool.allocator.stats()["allocated_bytes"] == 0
    pool.check_invariants()
