"""BLOCKRT_BLAS=auto: the CPU's CBLAS chosen by measuring this process's products
(backends/_blas_choice.py).

Most tests run the chooser on made-up libraries that compute with NumPy and take a set time on
a made-up clock (the clock moves only when they run), so which one is faster is known and no
test depends on this machine's speed. The last ones run the real libraries, for results only.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import backends
import runtime
from backends import _blas, _blas_choice
from backends._blas_choice import SMALL, Chooser, DiskCache, Product, product_of
from blockrt import cli
from runtime import nn

QUIET = 0.25


class Clock:
    """Seconds that pass only when a library runs a product, or when a test moves them on."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Fake:
    """A library that computes c = alpha * a @ b + beta * c with NumPy and takes `per_madd`
    seconds per multiply-add of the clock (`slow` overrides it for chosen shapes), counting the
    products it ran by their `Product`."""

    def __init__(self, name: str, clock: Clock, per_madd: float, products: bool = True,
                 slow: dict[Product, float] | None = None) -> None:
        self.name = name
        self.path = f"/fake/{name}"
        self.products = products
        self.clock = clock
        self.per_madd = per_madd
        self.slow = slow or {}
        self.ran: list[Product] = []

    def __call__(self, a, b, c, alpha, beta) -> bool:
        product = product_of(a, b, c, beta != 0.0)
        np.copyto(c, alpha * (a @ b) + beta * c)
        self.ran.append(product)
        self.clock.now += self.slow.get(product, self.per_madd) * product.size
        return True


def operands(m: int, n: int, k: int, seed: int = 0, transposed: bool = False):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(k, m)).astype(np.float32).T if transposed else \
        rng.normal(size=(m, k)).astype(np.float32)
    return a, rng.normal(size=(k, n)).astype(np.float32), np.zeros((m, n), np.float32)


def chooser(libraries, clock, **options) -> Chooser:
    return Chooser(libraries, options.pop("small", None), quiet=QUIET, clock=clock,
                   **options)


def run_until_decided(choice: Chooser, step, limit: int = 10_000,
                      confirmed: bool = False) -> int:
    """Call `step()` until the choice is made (`confirmed`: until it stays); the number of
    calls."""
    for count in range(1, limit + 1):
        step()
        if choice.decision is not None and not (confirmed and choice.measuring):
            return count
    raise AssertionError(f"no decision after {limit} steps: {choice.state}")


@pytest.mark.parametrize("fast_first", [True, False])
def test_the_faster_library_is_chosen_and_then_runs_every_product(fast_first):
    clock = Clock()
    fast, slow = Fake("fast", clock, 1e-7), Fake("slow", clock, 1.3e-7)
    choice = chooser([fast, slow] if fast_first else [slow, fast], clock)
    shapes = [operands(64, 128, 96, 1), operands(128, 64, 64, 2, transposed=True)]

    def step():
        for a, b, c in shapes:
            assert choice(a, b, c, 1.0, 0.0)
            np.testing.assert_allclose(c, a @ b, rtol=1e-5, atol=1e-5)

    run_until_decided(choice, step)
    assert choice.decision.library is fast
    assert choice.name == "fast" and "measured: fast took" in choice.decision.reason
    assert fast.ran and slow.ran  # both were timed
    before = len(slow.ran)
    for _ in range(5):
        step()
    assert len(slow.ran) == before  # from then on, one library runs everything


def test_shapes_weigh_by_their_calls_and_the_process_keeps_one_library():
    """`one` is faster on the shape called 8 times a step, `two` on the one called once: `one`
    wins, and runs both shapes (Note [one thread pool per process])."""
    clock = Clock()
    often, rare = operands(64, 96, 64, 1), operands(96, 64, 96, 2)
    key_often, key_rare = (product_of(*ops, False) for ops in (often, rare))
    one = Fake("one", clock, 1e-7, slow={key_rare: 3e-7})
    two = Fake("two", clock, 2e-7, slow={key_rare: 1e-7})
    choice = chooser([two, one], clock)

    def step():
        for _ in range(8):
            choice(*often, 1.0, 0.0)
        choice(*rare, 1.0, 0.0)

    run_until_decided(choice, step)
    assert choice.decision.library is one
    rows = {row[0]: row for row in choice.table()}
    assert rows[key_rare][2]["two"] < rows[key_rare][2]["one"]  # two was faster on this one
    assert rows[key_often][1] > rows[key_rare][1]
    one.ran.clear()
    two.ran.clear()
    step()
    assert set(one.ran) == {key_often, key_rare} and two.ran == []


def test_products_in_a_phases_quiet_time_are_not_timed():
    """`spun` is slow only just after a switch of library (the other library's threads still
    spinning) and the faster otherwise: timing the quiet time too would pick `steady`."""
    clock = Clock()
    a, b, c = operands(80, 80, 80)
    product = product_of(a, b, c, False)

    class Spun(Fake):
        def __call__(self, a, b, c, alpha, beta):
            started = self.clock.now
            done = super().__call__(a, b, c, alpha, beta)
            if started < choice._phase_start + QUIET:
                self.clock.now += 100 * self.per_madd * product.size
            return done

    spun, steady = Spun("spun", clock, 1e-7), Fake("steady", clock, 1.5e-7)
    choice = chooser([steady, spun], clock)
    run_until_decided(choice, lambda: choice(a, b, c, 1.0, 0.0))
    assert choice.decision.library is spun
    assert choice.typical(product, spun) == pytest.approx(1e-7 * product.size)


def test_the_work_between_products_counts_too():
    """`spinner`'s products are the faster, but its threads, spinning after each one, slow
    down the work that follows (a step's elementwise passes): the whole step is faster on
    `steady`, and that is the one to keep."""
    clock = Clock()
    a, b, c = operands(80, 80, 80)
    spinner, steady = Fake("spinner", clock, 1e-7), Fake("steady", clock, 1.2e-7)
    choice = chooser([spinner, steady], clock)
    product = product_of(a, b, c, False)

    def step():
        for _ in range(3):
            ran = len(spinner.ran)
            choice(a, b, c, 1.0, 0.0)
            work = 0.02 * (3 if len(spinner.ran) > ran else 1)  # elementwise work after it
            clock.now += work

    run_until_decided(choice, step)
    assert choice.decision.library is steady
    assert choice.typical(product, spinner) == pytest.approx(1e-7 * product.size + 0.06)
    assert choice.typical(product, steady) == pytest.approx(1.2e-7 * product.size + 0.02)


def test_small_products_go_to_numpys_blas_untimed():
    clock = Clock()
    numpy_blas = Fake("numpy", clock, 1e-7, products=False)
    other = Fake("other", clock, 1e-7)
    choice = chooser([numpy_blas, other], clock, small=numpy_blas)
    a, b, c = operands(64, 64, 64)  # 64**3 multiply-adds: SMALL itself
    assert product_of(a, b, c, False).size == SMALL
    for _ in range(50):
        clock.now += 0.1
        assert choice(a, b, c, 1.0, 0.0)
        assert choice(a, b, c, 2.0, 1.0)
    np.testing.assert_allclose(c, 3 * (a @ b), rtol=1e-4)  # a @ b, then 2 a @ b + c
    assert other.ran == [] and choice.times == {} and choice.decision is None
    assert len(numpy_blas.ran) == 50  # the plain products went through np.matmul itself
    assert choice.state == "waiting"


def test_a_measured_choice_keeps_small_products_on_numpys_blas():
    clock = Clock()
    numpy_blas = Fake("numpy", clock, 2e-7, products=False)
    fast = Fake("fast", clock, 1e-7)
    choice = chooser([numpy_blas, fast], clock, small=numpy_blas)
    big, small = operands(96, 96, 96), operands(32, 32, 32)
    # NOTE: accumulating, so that NumPy's BLAS is timed through the fake, not np.matmul
    run_until_decided(choice, lambda: choice(*big, -1.0, 1.0))
    assert choice.decision.library is fast and choice.products
    numpy_blas.ran.clear()
    fast.ran.clear()
    choice(*big, 1.0, 0.0)
    choice(*small, -0.5, 1.0)
    assert fast.ran == [product_of(*big, False)]
    assert numpy_blas.ran == [product_of(*small, True)]


def test_when_numpys_blas_wins_plain_products_go_back_to_np_matmul():
    clock = Clock()
    numpy_blas = Fake("numpy", clock, 1e-7, products=False)
    slow = Fake("slow", clock, 2e-7)
    choice = chooser([numpy_blas, slow], clock, small=numpy_blas)
    a, b, c = operands(96, 96, 96)
    run_until_decided(choice, lambda: choice(a, b, c, -1.0, 1.0))
    assert choice.decision.library is numpy_blas
    assert choice.products  # until the choice is measured again, plain products come here
    clock.now += _blas_choice.CONFIRM_SECONDS
    run_until_decided(choice, lambda: choice(a, b, c, -1.0, 1.0), confirmed=True)
    assert choice.decision.library is numpy_blas and not choice.measuring
    assert not choice.products  # the device calls np.matmul for plain products itself


def test_the_first_choice_is_measured_again_and_the_second_stays():
    """The machine's load changed after the process began: `one` was the faster then, `two`
    is now; the second measurement, `confirm` seconds after the first, decides for good."""
    clock = Clock()
    one, two = Fake("one", clock, 1e-7), Fake("two", clock, 2e-7)
    choice = chooser([one, two], clock)
    shapes = [operands(80, 80, 80, 1), operands(96, 64, 80, 2)]

    def step():
        for ops in shapes:
            choice(*ops, -1.0, 1.0)

    run_until_decided(choice, step)
    assert choice.decision.library is one and choice.measuring  # to be measured again
    one.per_madd, two.per_madd = 3e-7, 1e-7
    ran = len(two.ran)
    for _ in range(3):
        step()  # before `confirm` seconds: on `one`, nothing measured
    assert choice.decision.library is one and len(two.ran) == ran
    clock.now += _blas_choice.CONFIRM_SECONDS
    run_until_decided(choice, step, confirmed=True)
    assert [d.library for d in choice.history] == [one, two]
    assert choice.decision.reason.startswith("measured again (one the first time): two took")
    assert not choice.measuring
    clock.now += 100 * _blas_choice.CONFIRM_SECONDS
    one.ran.clear()
    for _ in range(10):
        step()
    assert one.ran == [] and choice.decision.library is two  # it stays


def test_each_phase_waits_for_every_product_a_graph_announced():
    clock = Clock()
    first, second = Fake("first", clock, 1e-7), Fake("second", clock, 1e-7)
    choice = chooser([first, second], clock)
    seen, announced = operands(80, 80, 80), operands(96, 96, 96)
    choice.expect([product_of(*announced, False)] * 3)
    assert choice.calls[product_of(*announced, False)] == 3
    for phase in (0, 1):  # the warm-up, then the first timed phase
        start = clock.now
        while clock.now < start + choice._cap:  # only `seen` runs: the phase waits
            assert choice._phase == phase, clock.now - start
            choice(*seen, 1.0, 0.0)
        choice(*seen, 1.0, 0.0)  # past the cap, it moves on all the same
        assert choice._phase == phase + 1


def test_the_first_runs_of_each_product_are_not_timed():
    """`first`'s products are the faster, but the first two runs of each (a first step's
    first touches of memory) are slow: timing them would pick `second`. A step runs the
    first shape three times (layers of one width) before the others come."""
    clock = Clock()
    layer = operands(80, 80, 80, 1)
    shapes = [layer, layer, layer, operands(96, 64, 80, 2), operands(64, 96, 96, 3)]

    class Touching(Fake):
        def __call__(self, a, b, c, alpha, beta):
            product = product_of(a, b, c, beta != 0.0)
            if self.ran.count(product) < 2:
                self.clock.now += 0.5
            return super().__call__(a, b, c, alpha, beta)

    first, second = Touching("first", clock, 1e-8), Fake("second", clock, 1.5e-8)
    choice = chooser([first, second], clock)
    run_until_decided(choice, lambda: [choice(*ops, 1.0, 0.0) for ops in shapes])
    assert choice.decision.library is first
    assert choice.state == "decided"
    samples = [t for by in choice.times.values() for phase in by["first"].values()
               for t in phase]
    assert samples and max(samples) < 0.5  # none of them holds a first touch


def test_the_libraries_take_turns_in_an_order_that_drift_favours_none():
    clock = Clock()
    one, two = Fake("one", clock, 1e-7), Fake("two", clock, 1e-7)
    choice = chooser([one, two], clock)
    order = []
    for phase in range(7):
        choice._phase = phase
        order.append(choice.library.name)
    assert order == ["one", "one", "two", "two", "one", "one", "two"]  # warm-up, then A B B A


def test_the_disk_cache_decides_a_later_process_without_measuring(tmp_path):
    clock = Clock()
    a, b, c = operands(80, 96, 112)
    product = product_of(a, b, c, True)
    cache = DiskCache(str(tmp_path), "a machine")
    one, two = Fake("one", clock, 1e-7), Fake("two", clock, 2e-7)
    first = chooser([one, two], clock, cache=cache)
    run_until_decided(first, lambda: first(a, b, c, -0.5, 1.0))
    assert first.decision.library is one
    stored = json.loads((tmp_path / DiskCache.FILE).read_text())
    assert set(stored["machines"]["a machine"]) == {str(product)}

    # a new process where `two` would now measure faster: the cache's times decide, at once
    clock2 = Clock()
    one2, two2 = Fake("one", clock2, 3e-7), Fake("two", clock2, 1e-7)
    later = chooser([one2, two2], clock2, cache=DiskCache(str(tmp_path), "a machine"))
    later.expect([product])
    assert later.decision is not None and later.decision.library is one2
    assert later.cached == {product} and one2.ran == two2.ran == []

    # another machine's key finds nothing: it measures
    other = chooser([one2, two2], clock2, cache=DiskCache(str(tmp_path), "another machine"))
    other.expect([product])
    assert other.decision is None
    run_until_decided(other, lambda: other(a, b, c, -0.5, 1.0))
    assert other.decision.library is two2
    stored = json.loads((tmp_path / DiskCache.FILE).read_text())
    assert set(stored["machines"]) == {"a machine", "another machine"}


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"format": 99, "machines": {}}',
                                     '{"format": 1, "machines": {"m": {"no key": {"x": 1}}}}'])
def test_a_cache_file_it_cannot_read_is_ignored_and_replaced(tmp_path, content):
    (tmp_path / DiskCache.FILE).write_text(content)
    cache = DiskCache(str(tmp_path), "m")
    assert cache.load() == {}
    product = Product("float32", 100, 100, 100, False, True, False)
    cache.store({product: {"one": 1e-3, "two": 2e-3}})
    assert cache.load() == {product: {"one": 1e-3, "two": 2e-3}}


def test_a_cache_it_cannot_write_warns(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the directory should be
    cache = DiskCache(str(blocker / "sub"), "m")
    with pytest.warns(RuntimeWarning, match="BLOCKRT_BLAS_CACHE: cannot write") as warned:
        cache.store({Product("float32", 100, 100, 100, False, False, False): {"x": 1.0}})
    assert len(warned) == 1 and str(blocker) in str(warned[0].message)
    assert cache.load() == {}  # nothing was written, and reading says so without failing


def test_product_keys_read_back_and_bad_ones_are_refused():
    for product in (Product("float32", 1024, 10, 4096, False, True, False),
                    Product("float64", 3, 4, 5, True, False, True)):
        assert Product.parse(str(product)) == product
    for bad in ("", "float32 3x4 @ 5x6 NN", "float32 3x4 @ 4x6 NX", "float32 3x4 4x6 NN",
                "float32 3x4 @ 4x6 NN -="):
        with pytest.raises(ValueError, match="not a product key"):
            Product.parse(bad)


def test_product_of_reads_layouts_as_the_cblas_call_does():
    a, b, c = operands(8, 6, 4)
    assert product_of(a, b, c, False) == Product("float32", 8, 6, 4, False, False, False)
    assert product_of(a, b.T.copy().T, c, True) == Product("float32", 8, 6, 4, False, True, True)
    assert product_of(np.asfortranarray(a), b, c, False).a_transposed


# ---------------------------------------------------------------------- settings
def test_settings_read_the_cache_variable_and_refuse_what_they_do_not_know(tmp_path):
    read = _blas.Settings.from_environ
    assert read({}) == _blas.Settings("auto", None)
    assert read({"BLOCKRT_BLAS": " MKL ", "BLOCKRT_BLAS_CACHE": "0"}) == \
        _blas.Settings("mkl", None)
    assert read({"BLOCKRT_BLAS_CACHE": "1", "XDG_CACHE_HOME": str(tmp_path)}).cache == \
        str(tmp_path / "blockrt")
    relative = read({"BLOCKRT_BLAS_CACHE": "on", "XDG_CACHE_HOME": "rel", "HOME": "/h"})
    assert relative.cache.endswith("/.cache/blockrt")
    assert read({"BLOCKRT_BLAS_CACHE": str(tmp_path)}).cache == str(tmp_path)
    with pytest.raises(ValueError, match=r"BLOCKRT_BLAS_CACHE='maybe' is neither 0 nor 1 nor "):
        read({"BLOCKRT_BLAS_CACHE": "maybe"})
    with pytest.raises(ValueError, match=r"BLOCKRT_BLAS='fastest' is not one of auto, mkl, "):
        read({"BLOCKRT_BLAS": "fastest"})


def test_a_bad_cache_variable_is_refused_at_the_first_product(monkeypatch):
    monkeypatch.setattr(_blas, "_found", [])
    monkeypatch.setenv(_blas.CACHE_ENV, "relative/dir")
    cpu = backends.get_device("cpu")
    a = np.ones((2, 2), np.float32)
    with pytest.raises(ValueError, match="BLOCKRT_BLAS_CACHE='relative/dir'"):
        cpu.matmul(a, a, np.empty((2, 2), np.float32))
    assert _blas._found == []


# ---------------------------------------------------------------------- the graph announces
def test_a_captured_graph_announces_its_products_to_the_chooser(monkeypatch):
    clock = Clock()  # NOTE: products that take no time: never past the quiet time, never timed
    choice = chooser([Fake("one", clock, 0.0), Fake("two", clock, 0.0)], clock)
    monkeypatch.setattr(_blas, "_found", [choice])
    rng = np.random.default_rng(0)
    model = nn.Sequential(nn.Dense(128, 128, rng=rng), nn.ReLU(), nn.Dense(128, 128, rng=rng))
    step = runtime.graph(nn.train_step(model, nn.SGD(model.parameters(), lr=0.1)))
    x = rng.normal(size=(64, 128)).astype(np.float32)
    step(x, rng.integers(0, 128, 64))
    forward = Product("float32", 64, 128, 128, False, True, False)
    backward = Product("float32", 64, 128, 128, False, False, False)
    update = Product("float32", 128, 128, 64, True, False, True)  # w -= lr * g.T @ x, folded
    assert choice.calls == {forward: 2, backward: 1, update: 2}  # one entry per call
    assert {row[0] for row in choice.table()} == {forward, backward, update}


# ---------------------------------------------------------------------- blockrt info
def test_info_measure_shows_the_choice_and_each_shapes_times(capsys, monkeypatch):
    clock = Clock()
    fast, slow = Fake("fast", clock, 1e-7), Fake("slow", clock, 2e-7)
    monkeypatch.setattr(_blas, "_found", [chooser([slow, fast], clock)])
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "CPU gemm: measured per process (BLOCKRT_BLAS=auto) between slow (/fake/slow) and " \
           "fast (/fake/fast)" in out
    assert "  chosen: nothing yet, waiting: a process times the products of more than 262144 " \
           "multiply-adds" in out
    assert cli.main(["info", "--measure", "S"]) == 0
    out = capsys.readouterr().out
    assert "  chosen: fast (to be measured once more 30 s after the first choice; that " \
           "choice stays); measured: fast took " in out
    assert "  disk cache: off (BLOCKRT_BLAS_CACHE=1 keeps the times per machine)" in out
    rows = {line.strip().split("  ")[0]: line.split() for line in out.splitlines()
            if line.startswith("    float32")}
    # the S step's hidden layers: forward (x @ w.T), backward (g @ w), folded update (w -= g.T x)
    assert set(rows) == {"float32 64x256 @ 256x256 NT", "float32 64x256 @ 256x256 NN",
                         "float32 256x64 @ 64x256 TN +="}
    for words in rows.values():
        slow_ms, fast_ms = float(words[-3]), float(words[-2])
        assert slow_ms == pytest.approx(2 * fast_ms, rel=1e-3) and words[-1] == "measured"


@pytest.mark.parametrize("setting", ["mkl", "openblas", "none"])
def test_info_names_a_library_that_blockrt_blas_forces(capsys, monkeypatch, setting):
    monkeypatch.setattr(_blas, "_found", [])
    monkeypatch.setenv(_blas.ENV, setting)
    forced = _blas.load(setting) if setting != "none" else None
    if setting != "none" and forced is None:
        pytest.skip(_blas._MISSING[setting])
    assert cli.main(["info", "--measure", "S"]) == 0  # nothing to measure: no step runs
    out = capsys.readouterr().out
    what = f"CBLAS of {forced.name} ({forced.path})" if forced else "matmul + a fused pass"
    assert f"CPU gemm: {what}, BLOCKRT_BLAS={setting}\n" in out


# ---------------------------------------------------------------------- the real libraries
both = pytest.mark.skipif(len(_blas.present()) < 2, reason="needs MKL and NumPy's OpenBLAS "
                          "(the mkl extra): with one library there is nothing to choose")


@both
def test_results_are_right_while_measuring_and_after_on_the_real_libraries(monkeypatch):
    libraries = _blas.present()
    choice = Chooser(libraries, _blas.load("openblas"), quiet=0.0, record_seconds=0.0)
    monkeypatch.setattr(_blas, "_found", [choice])
    cpu = backends.get_device("cpu")
    rng = np.random.default_rng(5)
    cases = []
    for m, n, k, transposed in ((96, 80, 72, False), (72, 96, 80, True), (40, 30, 20, False)):
        a = rng.normal(size=(m, k)).astype(np.float32)
        b = rng.normal(size=(n, k)).astype(np.float32).T if transposed else \
            rng.normal(size=(k, n)).astype(np.float32)
        cases.append((a, b, rng.normal(size=(m, n)).astype(np.float32)))
    used = set()
    for _ in range(200):
        used.add(choice.library.name)
        for a, b, c in cases:
            out = np.empty_like(c)
            cpu.matmul(a, b, out)
            np.testing.assert_allclose(out, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)
            acc = c.copy()
            cpu.gemm(a, b, acc, -0.5, 1.0)
            want = c - 0.5 * (a.astype(np.float64) @ b)
            np.testing.assert_allclose(acc, want, rtol=1e-4, atol=1e-4)
        if choice.decision is not None:
            break
    assert used == {lib.name for lib in libraries}  # both ran while it measured
    assert choice.decision is not None and choice.decision.library in libraries
    report = _blas.report()
    assert report.chooser is choice and report.summary.startswith(choice.decision.library.name)


@both
def test_auto_measures_where_both_libraries_are_here(monkeypatch):
    monkeypatch.setattr(_blas, "_found", [])
    monkeypatch.delenv(_blas.ENV, raising=False)
    found = _blas.find()
    assert isinstance(found, Chooser)
    assert {lib.name for lib in found.libraries} == {lib.name for lib in _blas.present()}
    assert found.quiet >= 0.15  # MKL's threads spin 200 ms by default: at least OpenBLAS's 0.1
    assert found.cache is None  # BLOCKRT_BLAS_CACHE is off by default


def test_quiet_time_follows_the_blocktime(monkeypatch):
    monkeypatch.setattr(_blas, "_loaded", lambda word: [])  # as before MKL's OpenMP loads
    for value, want in (("0", 0.15), ("300", 0.35), ("infinite", 1.05), ("", 0.25)):
        monkeypatch.setenv("KMP_BLOCKTIME", value)
        assert _blas.quiet_seconds() == pytest.approx(want)
    assert _blas_choice.SMALL == 64 ** 3
