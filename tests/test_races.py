"""A race harness: the shared-state paths run from several threads with a tiny switch interval.

CPython switches threads every 5 ms by default, so a race whose window is a few bytecodes almost
never shows in a test. `tiny_switch_interval()` sets `sys.setswitchinterval(1e-6)`, which makes
the interpreter offer a switch at nearly every chance, and the tests below run the paths that
several threads share through it:

- the first write to a lazy Block (two threads must not both allocate it: one write would be lost
  and one allocation leaked);
- tensor handles made and dropped on one block (the reference count must stay exact);
- an allocator (caching, C hot path and Python path) allocating, writing and freeing;
- a constant pool looking up and dropping equal contents;
- one Graph called from several threads, under each plan (results equal the serial ones, state
  updates are never lost), and a capture while another thread makes tensors.

`test_random_thread_programs` draws a program per thread over shared lazy tensors, views,
constants and a graph, and checks data, reference counts and allocator counters at the end.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import allocators
import runtime
from allocators import StatisticsAdaptor
from helpers import run_threads
from runtime import ops

THREADS = 4
PLANS = ("none", "recycle", "static")


@contextmanager
def tiny_switch_interval(seconds: float = 1e-6) -> Iterator[None]:
    """Offer a thread switch at nearly every chance while the block runs."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def counted(kind: str, **options) -> StatisticsAdaptor:
    """A StatisticsAdaptor over a new allocator of `kind` on the CPU (it counts every call)."""
    return StatisticsAdaptor(allocators.create(kind, "cpu", **options))


ALLOCATORS = {
    "direct": lambda: counted("direct"),
    "caching-c": lambda: counted("caching"),
    "caching-python": lambda: python_path(counted("caching")),
}


def python_path(stats: StatisticsAdaptor) -> StatisticsAdaptor:
    """The caching allocator under `stats` with its C hot path off (the Python path)."""
    stats.upstream._hot = False
    return stats


# ---------------------------------------------------------------------- blocks
@pytest.mark.parametrize("kind", sorted(ALLOCATORS))
def test_the_first_writes_to_a_lazy_block_allocate_it_once(kind):
    allocator = ALLOCATORS[kind]()
    with tiny_switch_interval():
        for trial in range(40):
            t = runtime.empty((THREADS, 64), "float64", allocator=allocator)

            def write_row(i: int, t: runtime.Tensor = t, trial: int = trial) -> None:
                t[i] = float(trial * THREADS + i)

            run_threads(write_row, THREADS)
            got = t.numpy()
            for i in range(THREADS):
                assert (got[i] == trial * THREADS + i).all(), f"trial {trial}: row {i} lost"
            assert allocator.stats()["allocated_bytes"] >= t.nbytes
            t.release()
            stats = allocator.stats()
            assert stats["allocated_bytes"] == 0, f"trial {trial}: {stats['allocated_bytes']} leak"
            assert stats["num_allocs"] == stats["num_frees"]
    allocator.check_invariants()


def test_views_made_and_dropped_from_many_threads_keep_the_count_exact():
    allocator = counted("direct")
    base = runtime.tensor(np.arange(4096.0), allocator=allocator)

    def churn(i: int) -> None:
        for _ in range(300):
            view = base[i::THREADS]
            assert view.shape == (4096 // THREADS,)
            view.T.release()
            view.release()

    with tiny_switch_interval():
        run_threads(churn, THREADS)
    assert base.block.refcount == 1
    np.testing.assert_array_equal(base.numpy(), np.arange(4096.0))
    assert allocator.stats()["num_allocs"] == 1 and allocator.stats()["num_frees"] == 0


# ---------------------------------------------------------------------- allocators
@pytest.mark.parametrize("kind", ["caching-c", "caching-python"])
def test_an_allocator_under_races_keeps_data_and_counts(kind):
    allocator = ALLOCATORS[kind]()
    device = allocator.device
    register: dict[int, tuple[int, int]] = {}  # serial -> (address, size) of live allocations
    lock = threading.Lock()
    sizes = (512, 1000, 4096, 70_000)

    def work(i: int) -> None:
        live = []
        for k in range(150):
            allocation = allocator.allocate(sizes[(i + k) % len(sizes)])
            pattern = np.full(allocation.nbytes, (i * 31 + k) % 251, np.uint8)
            device.copyin(allocation.raw, allocation.offset, pattern)
            start = device.address(allocation.raw) + allocation.offset
            with lock:
                for first, size in register.values():
                    assert start + allocation.nbytes <= first or first + size <= start
                register[allocation.serial] = (start, allocation.nbytes)
            live.append((allocation, pattern))
            if k % 3 == 2:
                for held, expected in live:
                    got = device.copyout(held.raw, held.offset, held.nbytes)
                    np.testing.assert_array_equal(got, expected)
                    with lock:
                        del register[held.serial]
                    allocator.free(held)
                live.clear()
        for held, _ in live:
            with lock:
                del register[held.serial]
            allocator.free(held)

    with tiny_switch_interval():
        run_threads(work, THREADS)
    stats = allocator.stats()
    assert stats["num_allocs"] == stats["num_frees"] == THREADS * 150
    assert stats["allocated_bytes"] == 0
    allocator.check_invariants()


def test_a_constant_pool_under_races_shares_one_block_per_content():
    allocator = counted("direct")
    pool = runtime.ConstantPool(allocator)
    contents = [np.arange(n, dtype=np.float64) + 0.25 * n for n in (3, 100, 5000)]
    blocks: dict[int, set[int]] = {k: set() for k in range(len(contents))}
    lock = threading.Lock()

    def work(i: int) -> None:
        kept = []
        for k in range(120):
            which = (i + k) % len(contents)
            c = pool.constant(contents[which])
            np.testing.assert_array_equal(c.numpy(), contents[which])
            with lock:
                blocks[which].add(id(c.block))
            kept.append(c)
            if len(kept) > 2:
                kept.pop(0).release()
        for c in kept:
            c.release()

    with tiny_switch_interval():
        run_threads(work, THREADS)
    assert len(pool) == 0
    stats = allocator.stats()
    assert stats["allocated_bytes"] == 0 and stats["num_allocs"] == stats["num_frees"]


# ---------------------------------------------------------------------- graphs
@pytest.mark.parametrize("plan", PLANS)
def test_one_graph_called_from_threads_gives_each_its_own_result(plan):
    rng = np.random.default_rng(7)
    w = runtime.tensor(rng.standard_normal((8, 8)))
    step = runtime.graph(lambda x: ops.tanh(ops.matmul(x, w)), plan=plan)
    inputs = [rng.standard_normal((4, 8)) for _ in range(THREADS)]
    wanted = [np.tanh(x @ w.numpy()) for x in inputs]
    bad = []

    def call(i: int) -> None:
        for k in range(60):
            got = step(inputs[i]).numpy()
            if not np.allclose(got, wanted[i], rtol=1e-12, atol=1e-12):
                bad.append((i, k))

    with tiny_switch_interval():
        run_threads(call, THREADS)
    assert not bad, f"{len(bad)} of {THREADS * 60} results were another call's"


@pytest.mark.parametrize("plan", PLANS)
def test_state_updates_from_threads_are_never_lost(plan):
    """Each call adds its input to a parameter: whatever order the calls run in, the parameter
    ends at the sum of all inputs, and each result is the sum after one more update."""
    w = runtime.tensor(np.zeros(16))

    def step(x):
        with runtime.no_grad():
            ops.add(w, x, out=w)
        return ops.sum(w)

    graphed = runtime.graph(step, plan=plan)
    calls = 40
    results: list[float] = []

    def call(i: int) -> None:
        for _ in range(calls):
            results.append(float(graphed(np.ones(16)).item()))

    with tiny_switch_interval():
        run_threads(call, THREADS)
    n = THREADS * calls
    np.testing.assert_array_equal(w.numpy(), np.full(16, float(n)))
    assert sorted(results) == [16.0 * k for k in range(1, n + 1)]


def test_a_tensor_another_thread_makes_during_a_capture_is_outside_data():
    """A capture tells blocks it makes from blocks with ids past its start that another thread
    made and wrote meanwhile: the latter hold data and are read in place, never planned."""
    made = threading.Event()
    go = threading.Event()
    box: dict[str, runtime.Tensor] = {}

    def maker() -> None:
        go.wait()
        box["t"] = runtime.tensor(np.full(8, 3.0))
        made.set()

    def step(x):
        y = ops.mul(x, 2.0)  # a block made by the capture
        go.set()
        made.wait()
        return ops.add(y, box.pop("t"))  # the other thread's block, dropped once read

    thread = threading.Thread(target=maker)
    thread.start()
    graphed = runtime.graph(step, plan="static")
    first = graphed(np.ones(8)).numpy()
    thread.join()
    again = graphed(np.ones(8)).numpy()
    np.testing.assert_array_equal(first, np.full(8, 5.0))
    np.testing.assert_array_equal(again, np.full(8, 5.0))


# ---------------------------------------------------------------------- random programs
operation = st.one_of(
    st.tuples(st.just("write"), st.integers(0, 2)),    # write this thread's row of tensor j
    st.tuples(st.just("view"), st.integers(0, 2)),     # make and drop views of tensor j
    st.tuples(st.just("constant"), st.integers(0, 2)),  # look up and drop constant k
    st.tuples(st.just("graph"), st.integers(0, 3)),    # call the shared graph on input m
)
programs = st.lists(st.lists(operation, max_size=25), min_size=THREADS, max_size=THREADS)
CONTENTS = [np.arange(n, dtype=np.float64) * 3.5 + n for n in (2, 50, 700)]


@settings(max_examples=25, deadline=None)
@given(programs=programs, plan=st.sampled_from(PLANS), kind=st.sampled_from(sorted(ALLOCATORS)))
def test_random_thread_programs(programs, plan, kind):
    allocator = ALLOCATORS[kind]()
    pool = runtime.ConstantPool(allocator)
    tensors = [runtime.empty((THREADS, 32), "float64", allocator=allocator) for _ in range(3)]
    rows: dict[tuple[int, int], float] = {}  # (tensor, thread) -> the value last written
    lock = threading.Lock()
    w = runtime.tensor(np.eye(4) * 2.0, allocator=allocator)
    graphed = runtime.graph(lambda x: ops.relu(ops.matmul(x, w)), plan=plan, allocator=allocator)
    inputs = [np.full((2, 4), float(m) - 1.5) for m in range(4)]

    def run(i: int) -> None:
        for k, (kind_of, j) in enumerate(programs[i]):
            if kind_of == "write":
                value = float(100 * i + k)
                tensors[j][i] = value
                with lock:
                    rows[(j, i)] = value
            elif kind_of == "view":
                view = tensors[j][i]
                view.T.release()
                view.release()
            elif kind_of == "constant":
                c = pool.constant(CONTENTS[j])
                np.testing.assert_array_equal(c.numpy(), CONTENTS[j])
                c.release()
            else:
                got = graphed(inputs[j]).numpy()
                np.testing.assert_array_equal(got, np.maximum(inputs[j] @ (np.eye(4) * 2), 0))

    with tiny_switch_interval():
        run_threads(run, THREADS)
    for (j, i), value in rows.items():
        assert (tensors[j].numpy()[i] == value).all()
    for t in tensors:
        assert t.block.refcount == 1
        t.release()
    graphed.release()
    w.release()
    assert len(pool) == 0
    stats = allocator.stats()
    assert stats["allocated_bytes"] == 0, stats
    assert stats["num_allocs"] == stats["num_frees"]
    allocator.check_invariants()
