"""The CPU's one pool of threads (backends/_pool.h; Note [one pool for kernels and products]
in backends/threads.py): every kernel that splits over it gives the bits it gives on one
thread, whatever the count of threads and however small the parts; OpenBLAS's jobs on the pool
give the bits of OpenBLAS's own threads; kernels and products called from several threads at
once, and after a fork, finish with the right results; bad settings are refused, saying what
and why."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import runtime
from backends import threads

pool = pytest.importorskip("backends._halfconv", reason="the C kernels are not built")


@pytest.fixture(scope="module")
def tiny_parts() -> Iterator[None]:
    """Parts of a single item, so that even a test's small arrays split over the pool."""
    before = pool.tuning(-1, 1)
    yield
    pool.tuning(-1, before[1])


def _on_threads(run: Callable[[], Any], counts=(1, 2, 3, 5)) -> list[Any]:
    """run() with the pool at each count of threads; the count is put back after."""
    before = pool.threads(0)
    try:
        results = []
        for n in counts:
            pool.threads(n)
            results.append(run())
        return results
    finally:
        pool.threads(before)


def _all_equal(results: list[Any]) -> None:
    first = results[0]
    for other in results[1:]:
        for a, b in zip(first if isinstance(first, tuple) else (first,),
                        other if isinstance(other, tuple) else (other,)):
            if isinstance(a, np.ndarray):
                assert a.shape == b.shape and a.tobytes() == b.tobytes()
            else:
                assert a == b


def _floats(rng: np.random.Generator, shape: tuple, dtype: Any) -> np.ndarray:
    x = rng.standard_normal(shape).astype(dtype)
    if x.size:
        x.flat[rng.integers(0, x.size, max(1, x.size // 50))] = 0.0
    return x


DTYPES = st.sampled_from([np.float32, np.float64])


@settings(max_examples=30, deadline=None)
@given(dtype=DTYPES, rows=st.integers(1, 9), cols=st.integers(2, 700), seed=st.integers(0, 99))
def test_elementwise_kernels_split_over_the_pool_keep_their_bits(tiny_parts, dtype, rows, cols,
                                                                 seed):
    rng = np.random.default_rng(seed)
    kind = int(dtype == np.float64)
    a, b = _floats(rng, (rows, cols), dtype), _floats(rng, (rows, cols), dtype)
    g, e = _floats(rng, (rows, cols), dtype), np.exp(_floats(rng, (rows, cols), dtype))
    bias = _floats(rng, (cols,), dtype)
    codes = {name: code for code, name in enumerate(pool.ops)}

    def run() -> tuple:
        outs = [np.empty_like(a) for _ in range(5)]
        assert pool.float_op(codes["mul"], kind, outs[0], a, b)
        assert pool.float_op(codes["add"], kind, outs[1], a, bias)  # NOTE: a row of cols
        assert pool.float_op(codes["relu_backward"], kind, outs[2].reshape(-1), a.ravel(),
                             b.ravel())  # NOTE: one row, split by columns
        assert pool.gelu_op(kind, outs[3], a)
        assert pool.gelu_op(kind, outs[4], a, g, e)
        sums = np.empty(cols, dtype)
        assert pool.sum_rows(kind, sums, a)
        maxima = np.empty(rows, dtype)
        again = pool.max_rows(kind, maxima, a)
        return (*outs, sums, maxima, again)

    results = _on_threads(run)
    _all_equal(results)
    assert np.array_equal(results[1][0], a * b)
    assert np.array_equal(results[1][5], a.sum(axis=0))


@settings(max_examples=30, deadline=None)
@given(dtype=DTYPES, shape=st.lists(st.integers(1, 6), min_size=2, max_size=5),
       order=st.randoms(use_true_random=False), seed=st.integers(0, 99))
def test_a_chain_split_over_the_pool_keeps_its_bits(tiny_parts, dtype, shape, order, seed):
    from backends import numpy as cpu
    rng = np.random.default_rng(seed)
    axes = list(range(len(shape)))
    order.shuffle(axes)
    x = _floats(rng, tuple(shape), dtype).transpose(axes)  # NOTE: any layout
    y = _floats(rng, x.shape, dtype)
    program = [("mul", (("input", 0), ("input", 1)), np.dtype(dtype)),
               ("add", (("link", 0), ("number", 0.5)), np.dtype(dtype)),
               ("relu", (("link", 1),), np.dtype(dtype))]
    tanh = ("tanh", int(dtype == np.float64)) in cpu._LOOP_CODES  # NOTE: NumPy's loop, in C
    if tanh:
        program.append(("tanh", (("link", 2),), np.dtype(dtype)))

    def run() -> np.ndarray:
        out = np.empty(x.shape, dtype)
        plan = cpu._chain_plan(program, [x, y], out)
        assert plan is not None
        pool.chain(plan)
        return out

    results = _on_threads(run)
    _all_equal(results)
    want = np.maximum(x * y + dtype(0.5), 0)
    assert np.array_equal(results[0], np.tanh(want) if tanh else want)


@settings(max_examples=25, deadline=None)
@given(dtype=DTYPES, n=st.integers(1, 3), c=st.integers(1, 7), h=st.integers(3, 9),
       w=st.integers(3, 9), k=st.integers(1, 3), stride=st.integers(1, 2),
       padding=st.integers(0, 1), seed=st.integers(0, 99))
def test_convolution_and_pooling_kernels_split_over_the_pool_keep_their_bits(
        tiny_parts, dtype, n, c, h, w, k, stride, padding, seed):
    rng = np.random.default_rng(seed)
    kind = int(dtype == np.float64)
    x = _floats(rng, (n, c, h, w), dtype)
    ho, wo = (h + 2 * padding - k) // stride + 1, (w + 2 * padding - k) // stride + 1
    geometry = (k, k, stride, stride, padding, padding)
    pool_geometry = (k, k, stride, stride, min(padding, k // 2), min(padding, k // 2))
    pho = (h + 2 * pool_geometry[4] - k) // stride + 1
    pwo = (w + 2 * pool_geometry[5] - k) // stride + 1
    g = _floats(rng, (n, c, pho, pwo), dtype)

    def run() -> tuple:
        columns = np.empty((c * k * k, n * ho * wo), dtype)
        assert pool.im2col(columns, x, *geometry)
        back = np.empty_like(x)
        assert pool.col2im(kind, back, columns, *geometry)
        mean, m2 = np.empty(c, dtype), np.empty(c, dtype)
        assert pool.moments(kind, mean, m2, x.reshape(n, c, h * w))
        sums, dots = np.empty(c, dtype), np.empty(c, dtype)
        assert pool.channel_dots(kind, sums, dots, x.reshape(n, c, h * w),
                                 back.reshape(n, c, h * w))
        out, where = np.empty((n, c, pho, pwo), dtype), np.empty((n, c, pho, pwo), np.int64)
        assert pool.max_pool(kind, out, where, x, *pool_geometry)
        plain = np.empty_like(out)
        assert pool.max_pool(kind, plain, None, x, *pool_geometry)  # NOTE: scratch a part
        grad = np.empty_like(x)
        assert pool.max_pool_backward(kind, grad, g, where)
        return columns, back, mean, m2, sums, dots, out, where, plain, grad

    results = _on_threads(run)
    _all_equal(results)
    assert np.array_equal(results[0][6], results[0][8])


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 80), cols=st.integers(1, 80),
       dtype=st.sampled_from([np.float16, np.float32, np.float64]), seed=st.integers(0, 99))
def test_a_transpose_split_over_the_pool_moves_every_item(tiny_parts, rows, cols, dtype, seed):
    x = _floats(np.random.default_rng(seed), (cols, rows), dtype)

    def run() -> np.ndarray:
        out = np.empty((rows, cols), dtype)
        assert pool.transpose(out, x)
        return out

    results = _on_threads(run)
    _all_equal(results)
    assert np.array_equal(results[0], x.T)


def test_a_large_copy_splits_over_the_pool_and_copies_every_item():
    from backends import numpy as cpu
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64, 32, 40)).astype(np.float32)
    assert x.size >= cpu._POOLED_COPY_LEAST
    sources = {"a transpose": (x.transpose(1, 0, 2, 3), (64, 4, 32, 40)),
               "every other channel": (x[:, ::2], (4, 32, 32, 40)),
               "a fill": (np.array(-1.5, np.float32), x.shape),
               "a row": (x[0, 0, 0], x.shape)}
    for what, (source, shape) in sources.items():
        def run(source=source, shape=shape) -> np.ndarray:
            out = np.empty(shape, np.float32)
            cpu._copy(source, out)
            return out
        results = _on_threads(run)
        _all_equal(results)
        assert np.array_equal(results[-1], np.broadcast_to(source, shape)), what
    # NOTE: out overlapping x one row further on: NumPy's copy, which buffers
    flat = rng.standard_normal(x.size + 40).astype(np.float32)
    want = flat[:x.size].copy()
    cpu._copy(flat[:x.size], flat[40:])
    assert np.array_equal(flat[40:], want)


def _openblas_bits(shapes: list[tuple]) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    out = []
    for m, k, n, transposed in shapes:
        a = rng.standard_normal((k, m) if transposed else (m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        out.append((a.T if transposed else a) @ b)
    return out


SHAPES = [(512, 768, 300, False), (300, 200, 700, True), (64, 576, 3136, False),
          (3, 5, 7, False)]


@pytest.mark.skipif(threads._openblas is None, reason="NumPy's OpenBLAS has no threads "
                    "callback here (OpenBLAS 0.3.28 or later has it)")
def test_openblas_jobs_on_the_pool_give_the_bits_of_its_own_threads():
    before = runtime.get_num_threads()
    try:
        runtime.set_num_threads(2)
        threads.share_openblas(False)
        own = _openblas_bits(SHAPES)
        threads.share_openblas(True)
        shared = _openblas_bits(SHAPES)
        runtime.set_num_threads(3)  # NOTE: OpenBLAS asks for three jobs, the pool runs them
        three = _openblas_bits(SHAPES)
    finally:
        threads.share_openblas(True)
        runtime.set_num_threads(before)
    for a, b in zip(own, shared):
        assert np.array_equal(a, b)
    for a, b in zip(shared, three):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)


def test_kernels_and_products_from_several_threads_at_once_finish_right(tiny_parts):
    """One thread's kernel finds the pool busy and runs on its own thread; OpenBLAS's jobs
    wait for the pool: nothing hangs, every result is right."""
    rng = np.random.default_rng(2)
    a = rng.standard_normal((200, 300)).astype(np.float32)
    b = rng.standard_normal((300, 250)).astype(np.float32)
    x = rng.standard_normal((64, 1000)).astype(np.float32)
    want_product = a @ b
    want_gelu = np.empty_like(x)
    assert pool.gelu_op(0, want_gelu, x)
    failures: list[str] = []

    def work(index: int) -> None:
        for _ in range(30):
            if index % 2:
                if not np.array_equal(a @ b, want_product):
                    failures.append(f"thread {index}: a product differs")
            else:
                out = np.empty_like(x)
                pool.gelu_op(0, out, x)
                if not np.array_equal(out, want_gelu):
                    failures.append(f"thread {index}: gelu differs")

    workers = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in workers), "a thread hung on the pool"
    assert failures == []


def _child(queue: Any) -> None:
    x = np.random.default_rng(3).standard_normal((64, 5000)).astype(np.float32)
    out = np.empty_like(x)
    pool.tuning(-1, 1)
    pool.gelu_op(0, out, x)
    product = _openblas_bits([(512, 768, 300, False)])[0]
    queue.put((out.tobytes(), product.tobytes()))


@pytest.mark.skipif(sys.platform != "linux", reason="fork is Linux's here")
def test_a_forked_child_starts_its_own_pool(tiny_parts):
    x = np.random.default_rng(3).standard_normal((64, 5000)).astype(np.float32)
    want = np.empty_like(x)
    pool.gelu_op(0, want, x)  # NOTE: the parent's workers are running
    product = _openblas_bits([(512, 768, 300, False)])[0]
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(queue,))
    child.start()
    got = queue.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert got == (want.tobytes(), product.tobytes())


@pytest.mark.parametrize("bad", [0, -1, 65, 2.0, True, "2", None])
def test_set_num_threads_refuses_what_is_not_a_count_and_changes_nothing(bad):
    before = runtime.get_num_threads()
    with pytest.raises(ValueError, match=r"set_num_threads: .* not a whole number of threads "
                                         r"from 1 to 64"):
        runtime.set_num_threads(bad)
    assert runtime.get_num_threads() == before


def test_set_num_threads_sets_the_pool_and_openblas():
    before = runtime.get_num_threads()
    try:
        runtime.set_num_threads(3)
        assert runtime.get_num_threads() == 3 == pool.threads(0)
        if threads._openblas is not None:
            assert threads._openblas.get_threads() == 3
    finally:
        runtime.set_num_threads(before)


@pytest.mark.parametrize("value, ok", [("3", True), ("0", False), ("many", False),
                                       ("65", False), ("", True)])
def test_the_environment_names_the_count(value, ok):
    env = dict(os.environ, BLOCKRT_NUM_THREADS=value)
    code = ("import runtime, backends.threads as t; print(runtime.get_num_threads())")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    if ok:
        assert done.returncode == 0, done.stderr
        if value:
            assert done.stdout.split()[-1] == value
    else:
        assert done.returncode != 0
        assert f"BLOCKRT_NUM_THREADS={value!r}" in done.stderr
        assert "not a whole number of threads from 1 to 64" in done.stderr


def test_the_tuning_refuses_what_it_cannot_use():
    with pytest.raises(ValueError, match="spin_ns -5 and grain 3"):
        pool.tuning(-5, 3)
    with pytest.raises(ValueError, match="grain 0"):
        pool.tuning(-1, 0)
    with pytest.raises(ValueError, match="threads: 65 is not between 1 and 64"):
        pool.threads(65)


def test_blockrt_info_says_how_many_threads_and_who_runs_openblas_jobs():
    done = subprocess.run([sys.executable, "-m", "blockrt", "info"], capture_output=True,
                          text=True, timeout=300,
                          env=dict(os.environ, BLOCKRT_NUM_THREADS="3"))
    assert done.returncode == 0, done.stderr
    line = next(t for t in done.stdout.splitlines() if t.startswith("CPU threads:"))
    assert line.startswith("CPU threads: 3 for the C kernels (from BLOCKRT_NUM_THREADS")
    if threads._openblas is not None:
        assert line.endswith("OpenBLAS's jobs run on the pool")


@settings(max_examples=40, deadline=None)
@given(dtype=DTYPES, shape=st.lists(st.integers(1, 9), min_size=1, max_size=3),
       n=st.integers(1, 2000), special=st.booleans(), seed=st.integers(0, 99))
def test_sums_over_the_last_axis_keep_numpys_bits_on_any_count_of_threads(
        tiny_parts, dtype, shape, n, special, seed):
    """The CPU's sum and mean over a contiguous last axis (NumPy's add loop a row, from C,
    rows split over the pool) give np.add.reduce's and np.mean's bits."""
    from backends import numpy as cpu
    if int(dtype == np.float64) not in cpu._SUM_IN_C:
        pytest.skip("NumPy's add loop is not called from C here")
    rng = np.random.default_rng(seed)
    x = _floats(rng, (*shape, n), dtype) * dtype(10.0 ** int(rng.integers(-3, 4)))
    if special:
        x.flat[rng.integers(0, x.size, 3)] = rng.choice([np.nan, np.inf, -np.inf, -0.0], 3)
    axis = (x.ndim - 1,)

    def run() -> tuple:
        total, mean = np.empty(shape, dtype), np.empty((*shape, 1), dtype)
        with np.errstate(all="ignore"):
            cpu._reduce("sum", x, axis, False, total)
            cpu._reduce("mean", x, axis, True, mean)
        return total, mean

    results = _on_threads(run)
    _all_equal(results)
    with np.errstate(all="ignore"):
        want_sum = np.add.reduce(x, axis=-1)
        want_mean = np.mean(x, axis=-1, keepdims=True)
    assert results[0][0].tobytes() == want_sum.tobytes()
    assert results[0][1].tobytes() == want_mean.tobytes()
