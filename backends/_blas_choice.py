"""Which CBLAS runs the CPU device's matrix products, chosen by measurement (BLOCKRT_BLAS=auto).

Where MKL and NumPy's OpenBLAS are both here, neither is the faster one everywhere: the static
MLP step on MKL took 0.81-0.90 of its time on OpenBLAS on M and L on the Intel Xeons of
BENCHMARKS.md, and 1.00-1.20 on an AMD EPYC (where OpenBLAS, on two threads, could also stall
for a scheduler tick per product on a busy machine, and MKL did not); on one CPU the two can
rank differently from one shape to the next. So `Chooser` times the products this process runs,
on each library, and then keeps the faster library for the process (Note [one thread pool per
process]).

Note [one thread pool per process]: each library runs its products on a pool of threads that
spin for a while after a product (MKL's OpenMP workers for KMP_BLOCKTIME, 200 ms by default;
OpenBLAS's for about 0.1 s, yielding). Two pools side by side fight over the cores: the M MLP
step with each product shape on the library that was the faster for it alone took 1.75x the
time of the step on one library with one of its six shapes on the other library, and 1.02x
with two small ones (bench_train's blockrt-static-mixed, BENCHMARKS.md, issue 18); an earlier
split, before products were measured, 1.4-2x. So the choice is one library for all the
products of a process, the one whose products took the least time in total (weighted by how
often each shape runs), never a mix; timings are per shape, for that sum and for `blockrt
info`. Products of at
most `SMALL` multiply-adds are the exception: they go to NumPy's own BLAS whatever is chosen,
as OpenBLAS runs them on the calling thread (no pool wakes) with the least per-call cost.
OpenBLAS's pool is blockrt's own where the C kernels are built (Note [one pool for kernels and
products] in backends/threads.py).

How it measures, in phases (`Chooser`): the products run for real, on one library per phase.
A warm-up on the first library comes first, untimed, until the process's loop has come round
(the first shape came back after another) and every shape known to it (seen, or announced by a
captured graph through `Device.plan_products`) has run twice: a first step's first touches of
memory are not any library's. Then the libraries take turns, the order
reversed every other round (A B B A: `rounds` phases each), so that a drift of the machine's
speed favours none. A phase that follows another library's first lets its threads go quiet
(`quiet` seconds: the products still run, untimed), then times every product above `SMALL`
until each known shape has `reps` samples in it and it has lasted `record_seconds` (or `cap`
seconds, for a shape that never comes back). A product's sample is the time from its start to
the start of the next product: the product and the work after it (elementwise passes, Python),
which a library's spinning threads can slow down as much as they speed up the product itself,
so that the samples of a phase add up to its whole wall time. A shape's time on a library is
the median of its samples; these, each times the shape's number of calls, are summed, and the
smaller sum decides. A first choice is measured once more `confirm` seconds later, without the
warm-up, and that second choice stays: on a shared machine the load at a process's start (other
processes starting with it) is not the load it runs under; a library's threads on a busy core
can stall a product for a scheduler tick (OpenBLAS took 16 ms for a 0.06 ms product for seconds
on end in BENCHMARKS.md's runs while MKL did not). Nothing is computed twice and no memory is
taken: the measurement is the process's own work, at the speed of the slower library half of
the time, for a few steps (a few seconds on the benchmarks' S and M steps, about ten steps on
L), twice. Results during those steps come from either library, so they can differ in the last
bits from one step to the next; a library named in BLOCKRT_BLAS gives the same bits every time.

A disk cache (`DiskCache`, off unless BLOCKRT_BLAS_CACHE says where) keeps the per-shape times
per machine (CPU model, library versions and thread counts), so a later process whose shapes
are all known decides without measuring.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

__all__ = ["SMALL", "Chooser", "Decision", "DiskCache", "Measured", "Product", "product_of",
           "run"]

#: Products of at most this many multiply-adds (m * n * k) are not timed and go to NumPy's own
#: BLAS (Note [one thread pool per process]). It is 64**3, OpenBLAS's own limit for running a
#: product on the calling thread; on the AMD EPYC of BENCHMARKS.md such a product took 8 us
#: through np.matmul, against 1.3 us of np.matmul's and about 10 us of a ctypes call's own cost.
SMALL = 1 << 18
#: Samples a phase takes, in all, per shape it must time.
REPS = 2
#: Phases per library.
ROUNDS = 2
#: The least time a phase times products for, after its quiet time (s).
RECORD_SECONDS = 0.2
#: The most time a phase times products for (s), when a known shape does not come back.
CAP_SECONDS = 10.0
#: Rounds after which the choice is made with whatever was timed.
MAX_ROUNDS = 4
#: Seconds after the first choice at which it is measured once more, and that choice stays.
CONFIRM_SECONDS = 30.0


class Product(NamedTuple):
    """What a product's time depends on: the element type, the sizes (out is m x n, the inner
    dimension k), whether each operand is stored transposed, and whether it accumulates into
    its output (beta != 0)."""

    dtype: str
    m: int
    n: int
    k: int
    a_transposed: bool
    b_transposed: bool
    accumulates: bool

    def __str__(self) -> str:
        flags = ("T" if self.a_transposed else "N") + ("T" if self.b_transposed else "N")
        return (f"{self.dtype} {self.m}x{self.k} @ {self.k}x{self.n} {flags}"
                + (" +=" if self.accumulates else ""))

    @classmethod
    def parse(cls, text: str) -> Product:
        """The inverse of str() (the disk cache's keys); ValueError for anything else."""
        words = text.split()
        if len(words) not in (5, 6) or words[2] != "@" or words[5:] not in ([], ["+="]):
            raise ValueError(f"not a product key: {text!r}")
        m, k = (int(v) for v in words[1].split("x"))
        k2, n = (int(v) for v in words[3].split("x"))
        if k != k2 or len(words[4]) != 2 or set(words[4]) - {"N", "T"}:
            raise ValueError(f"not a product key: {text!r}")
        return cls(words[0], m, n, k, words[4][0] == "T", words[4][1] == "T", len(words) == 6)

    @property
    def size(self) -> int:
        """Multiply-adds."""
        return self.m * self.n * self.k


def _transposed(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> bool:
    """Whether a 2-D layout is read as the transpose of a row-major matrix (as `Gemm` reads it)."""
    return not (strides[1] == itemsize or shape[1] == 1)


def product_of(a: Any, b: Any, out: Any, accumulates: bool) -> Product:
    """The `Product` of out = a @ b (+ out): anything with shape, strides (bytes) and dtype."""
    size = np.dtype(out.dtype).itemsize
    return Product(np.dtype(out.dtype).name, out.shape[0], out.shape[1], a.shape[1],
                   _transposed(a.shape, a.strides, size), _transposed(b.shape, b.strides, size),
                   bool(accumulates))


def run(library: Any, a: np.ndarray, b: np.ndarray, c: np.ndarray, alpha: float,
        beta: float) -> bool:
    """c = alpha * a @ b + beta * c on `library` (a `Gemm`); False where CBLAS cannot read the
    layouts. A plain product on NumPy's own BLAS goes through np.matmul (`Gemm.products`)."""
    if not library.products and alpha == 1.0 and beta == 0.0:
        np.matmul(a, b, out=c)
        return True
    return library(a, b, c, alpha, beta)


class Measured:
    """The route once measured: `library` for the products above `SMALL`, NumPy's own BLAS
    (`small`, None to keep them on `library`) for the rest. Called as a `Gemm` is."""

    products = True

    def __init__(self, library: Any, small: Any) -> None:
        self.library = library
        self.small = small
        self.name = library.name
        self.path = library.path

    def __call__(self, a: np.ndarray, b: np.ndarray, c: np.ndarray, alpha: float,
                 beta: float) -> bool:
        if self.small is not None and c.shape[0] * c.shape[1] * a.shape[1] <= SMALL:
            return run(self.small, a, b, c, alpha, beta)
        return run(self.library, a, b, c, alpha, beta)


@dataclass
class Decision:
    """What the chooser decided and why: the library, one line of reason, and the total time
    (s) the products timed on every library would take on each, weighted by calls."""

    library: Any
    reason: str
    totals: dict[str, float] = field(default_factory=dict)


class DiskCache:
    """Per-shape times of each library (`Chooser.typical`), kept in
    `directory`/blas-choice.json under a key naming the machine (CPU, thread counts, library
    versions), so that a later process on the same machine need not measure shapes it has
    seen. Unreadable or foreign content is ignored (and replaced at the next write)."""

    FILE = "blas-choice.json"
    FORMAT = 1

    def __init__(self, directory: str, machine: str) -> None:
        self.path = os.path.join(directory, self.FILE)
        self.machine = machine

    def _read(self) -> dict[str, Any]:
        try:
            with open(self.path) as f:
                content = json.load(f)
        except (OSError, ValueError):
            return {}
        if not isinstance(content, dict) or content.get("format") != self.FORMAT \
                or not isinstance(content.get("machines"), dict):
            return {}
        return content

    def load(self) -> dict[Product, dict[str, float]]:
        """Every product timed on this machine: product -> library name -> seconds."""
        found: dict[Product, dict[str, float]] = {}
        entries = self._read().get("machines", {}).get(self.machine, {})
        for text, times in (entries.items() if isinstance(entries, dict) else ()):
            try:
                product = Product.parse(text)
            except ValueError:
                continue
            if isinstance(times, dict) and all(isinstance(t, (int, float)) and t > 0
                                               for t in times.values()):
                found[product] = {name: float(t) for name, t in times.items()}
        return found

    def store(self, times: dict[Product, dict[str, float]]) -> None:
        """Add `times` to the file (written whole, then renamed into place); a warning, not an
        error, when it cannot be written."""
        content = self._read() or {"format": self.FORMAT, "machines": {}}
        entries = content["machines"].setdefault(self.machine, {})
        entries.update({str(product): t for product, t in times.items()})
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=os.path.dirname(self.path), suffix=".tmp")
            with os.fdopen(handle, "w") as f:
                json.dump(content, f, indent=1, sort_keys=True)
            os.replace(temporary, self.path)
        except OSError as exc:
            warnings.warn(f"BLOCKRT_BLAS_CACHE: cannot write {self.path}: {exc}", RuntimeWarning,
                          stacklevel=2)


class Chooser:
    """Runs the CPU device's products while it measures which library to keep (the module
    docstring), then on the one it chose (`route`). Called as a `Gemm` is; safe to call from
    several threads (the bookkeeping takes a lock, the products do not).

    Args:
        libraries: the candidates, `Gemm`s; the first is kept where nothing could be timed.
        small: NumPy's own BLAS (a `Gemm` with products False), for the products of at most
            `SMALL` multiply-adds; None to leave them on the library of the moment.
        quiet: seconds a library's threads may go on spinning after its last product.
        cache: a `DiskCache`, or None.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, libraries: Sequence[Any], small: Any, *, quiet: float,
                 cache: DiskCache | None = None,
                 clock: Callable[[], float] = time.perf_counter, reps: int = REPS,
                 rounds: int = ROUNDS, record_seconds: float = RECORD_SECONDS,
                 cap: float = CAP_SECONDS, confirm: float = CONFIRM_SECONDS) -> None:
        if len(libraries) < 2:
            raise ValueError(f"a choice needs two libraries or more, got {len(libraries)}")
        self.libraries = tuple(libraries)
        self.small = small
        #: whether the device sends plain products here (not where np.matmul is the route)
        self.products = True
        self.name = "measuring: " + " / ".join(library.name for library in self.libraries)
        self.path = ", ".join(library.path for library in self.libraries)
        #: what runs the products once decided (a `Measured`), None before
        self.route: Any = None
        self.quiet = quiet
        self.cache = cache
        self._clock = clock
        self._reps = reps
        self._rounds = rounds
        self._record_seconds = record_seconds
        self._cap = cap
        self._confirm = confirm
        #: clock() at which the first choice is measured again; inf once the choice stays
        self._confirm_at = float("inf")
        #: every choice made, the one in force last
        self.history: list[Decision] = []
        #: product -> library name -> phase -> its samples (s): each the time from the start
        #: of a call of it to the start of the next product, so that the work between products,
        #: slowed or not by the library's threads, counts too; the disk cache's come as phase -1
        self.times: dict[Product, dict[str, dict[int, list[float]]]] = {}
        #: product -> calls timed, plus those a graph announced per step
        self.calls: Counter[Product] = Counter()
        #: products that came from the disk cache
        self.cached: set[Product] = set()
        self._known: set[Product] = set()
        self._stored = cache.load() if cache is not None else {}
        #: 0: the warm-up (untimed); 1, 2, ...: the timed phases (`library` says whose)
        self._phase = 0
        #: clock() when the current phase began; None before the first product
        self._phase_start: float | None = None
        #: clock() from which products are timed in this phase (after its quiet time)
        self._timed_from = float("inf")
        #: product -> calls seen while measuring, timed or not
        self._seen: Counter[Product] = Counter()
        #: the first product seen and the one seen last: the warm-up ends no sooner than the
        #: first comes back after another (the process's loop has come round once)
        self._first: Product | None = None
        self._previous: Product | None = None
        self._wrapped = False
        self._phase_calls: Counter[Product] = Counter()
        #: the last product timed in this phase, waiting for the next one to start: (product,
        #: its library, when it started)
        self._last: tuple[Product, Any, float] | None = None
        self.decision: Decision | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the products
    @property
    def library(self) -> Any:
        """The library of the current phase (the chosen one once decided): the first during
        the warm-up, then each in turn, the order reversed every other round (A B, B A, ...),
        so that a drift of the machine's speed favours none."""
        if self.decision is not None:
            return self.decision.library
        if self._phase == 0:
            return self.libraries[0]
        round_, position = divmod(self._phase - 1, len(self.libraries))
        order = self.libraries if round_ % 2 == 0 else self.libraries[::-1]
        return order[position]

    def __call__(self, a: np.ndarray, b: np.ndarray, c: np.ndarray, alpha: float,
                 beta: float) -> bool:
        route = self.route
        if route is not None:
            if self._clock() < self._confirm_at:
                return route(a, b, c, alpha, beta)
            self._reopen()
        if c.shape[0] * c.shape[1] * a.shape[1] <= SMALL:
            return run(self.small or self.library, a, b, c, alpha, beta)
        library = self.library
        start = self._clock()
        timed = self._timing(start)
        done = run(library, a, b, c, alpha, beta)
        if done:
            self._after(product_of(a, b, c, beta != 0.0), library, start, timed)
        return done

    def _reopen(self) -> None:
        """Measure the first choice once more (the machine's load may have changed since the
        process began): timed phases again, no warm-up; the fresh samples decide."""
        with self._lock:
            if self.route is None or self._clock() < self._confirm_at:
                return  # NOTE: another thread reopened it first
            previous = self.route.library
            self._confirm_at = float("inf")
            for product in [p for p in self.times if p not in self.cached]:
                del self.times[product]
            self.route = None
            self.decision = None
            self._phase = 1
            self._phase_calls.clear()
            self._last = None
            self._phase_start = now = self._clock()
            self._timed_from = now + (self.quiet if self.library is not previous else 0.0)

    def _timing(self, now: float) -> bool:
        """Whether a product starting now is timed: in a timed phase, past its quiet time."""
        if self._phase_start is None:
            with self._lock:
                if self._phase_start is None:
                    self._phase_start = now
        return now >= self._timed_from

    def expect(self, products: Iterable[Product]) -> None:
        """Products a captured graph runs at every step (one entry per call): known from now on,
        so each phase waits for them, and weighted by their count."""
        with self._lock:
            if self.decision is not None:
                return
            for product in products:
                if product.size > SMALL:
                    self._know(product)
                    self.calls[product] += 1
            if self._known and self._known <= self.cached:
                self._choose(None)

    # ------------------------------------------------------------------ bookkeeping (locked)
    def _know(self, product: Product) -> None:
        if product in self._known:
            return
        self._known.add(product)
        stored = self._stored.get(product)
        if stored is not None and all(lib.name in stored for lib in self.libraries):
            self.times[product] = {lib.name: {-1: [stored[lib.name]]} for lib in self.libraries}
            self.cached.add(product)

    def _after(self, product: Product, library: Any, start: float, timed: bool) -> None:
        """Note a product that ran on `library` from `start`; the one timed before it in this
        phase gets its sample, which ends where this one began."""
        with self._lock:
            if self.decision is not None:
                return
            self._know(product)
            self._seen[product] += 1
            if self._phase == 0 and not self.history:
                if self._first is None:
                    self._first = product
                elif product == self._first and self._previous != product:
                    self._wrapped = True
                self._previous = product
                self._warm_up(start)
                return
            last, self._last = self._last, None
            if not timed or library is not self.library:
                return  # NOTE: in the quiet time, or the phase moved on while it ran
            self._last = (product, library, start)
            self.calls[product] += 1
            if last is None:
                return
            previous, previous_library, began = last
            if previous not in self.cached:
                self.times.setdefault(previous, {}).setdefault(previous_library.name, {}) \
                    .setdefault(self._phase, []).append(start - began)
            self._phase_calls[previous] += 1
            if self._phase_done(start - self._timed_from):
                self._next_phase(start)

    def _warm_up(self, now: float) -> None:
        """End the warm-up once the process's loop has come round (the first product came back
        after another), every known product has run twice (a first step's first touches of
        memory are behind), and the quiet time is over; or at the cap (a loop of one shape)."""
        elapsed = now - self._phase_start
        if elapsed >= self._cap or (elapsed >= self.quiet and self._wrapped
                                    and all(self._seen[p] >= 2 for p in self._known)):
            self._next_phase(now)

    def _phase_done(self, timed_for: float) -> bool:
        if timed_for >= self._cap:
            return True
        needed = self._known - self.cached
        return timed_for >= self._record_seconds and all(self._phase_calls[p] >= self._reps
                                                         for p in needed)

    def _next_phase(self, now: float) -> None:
        previous = self.library
        self._phase += 1
        self._phase_calls.clear()
        self._phase_start = now
        self._last = None
        # NOTE: no quiet time where the library stays (A B, B A: the second B follows B)
        self._timed_from = now + (self.quiet if self.library is not previous else 0.0)
        timed, count = self._phase - 1, len(self.libraries)
        if self._known <= self.cached:
            self._choose(now)
        elif timed % count == 0 and timed >= self._rounds * count \
                and (self._complete() or timed >= MAX_ROUNDS * count):
            self._choose(now)

    def typical(self, product: Product, library: Any) -> float | None:
        """A product's time on `library` (s): the median of its samples over every phase of
        that library, or None where it has none."""
        samples = [t for phase in self.times.get(product, {}).get(library.name, {}).values()
                   for t in phase]
        return statistics.median(samples) if samples else None

    def _complete(self) -> list[Product]:
        """Products timed on every library."""
        return [p for p in self.times if all(self.typical(p, lib) for lib in self.libraries)]

    def _choose(self, now: float | None) -> None:
        """Decide, from the times so far; `now`: when (None: from the disk cache alone, a
        choice that stays), so that a first choice is measured again `confirm` s later."""
        complete = self._complete()
        if not complete:
            library = self.libraries[0]
            decision = Decision(library, f"no product was timed on every library: "
                                         f"{library.name}, the first found")
        else:
            totals = {lib.name: sum(self.calls[p] * self.typical(p, lib) for p in complete)
                      for lib in self.libraries}
            library = min(self.libraries, key=lambda lib: totals[lib.name])
            others = ", ".join(f"{name} {seconds * 1e3:.4g} ms" for name, seconds in
                               totals.items() if name != library.name)
            how = "measured" if not self.history else \
                f"measured again ({self.history[-1].library.name} the first time)"
            decision = Decision(library, f"{how}: {library.name} took "
                                         f"{totals[library.name] * 1e3:.4g} ms for the "
                                         f"{len(complete)} product shapes timed (each call and "
                                         f"the work up to the next product, times its calls), "
                                         f"{others}", totals)
        if self.cache is not None:
            fresh = {p: {lib.name: self.typical(p, lib) for lib in self.libraries}
                     for p in complete if p not in self.cached}
            if fresh:
                self.cache.store(fresh)
        small = self.small if self.small is not library else None
        self.name, self.path = library.name, library.path
        first = now is not None and not self.history
        # NOTE: plain products keep coming here until the choice stays (to see the time come)
        self.products = first or library.products or small is not None
        self.history.append(decision)
        self.route = Measured(library, small)
        self.decision = decision  # NOTE: after the route: a product that sees it finds it
        self._confirm_at = now + self._confirm if first else float("inf")

    # ------------------------------------------------------------------ reports
    def table(self) -> list[tuple[Product, int, dict[str, float | None], bool]]:
        """(product, calls, library name -> its time (`typical`) or None, whether the times
        came from the disk cache) for every product known, the most called first."""
        with self._lock:
            rows = [(product, self.calls[product],
                     {lib.name: self.typical(product, lib) for lib in self.libraries},
                     product in self.cached) for product in self._known]
        return sorted(rows, key=lambda row: (-row[1], str(row[0])))

    @property
    def measuring(self) -> bool:
        """Whether it has begun to run products (above `SMALL`) and its choice does not stay
        yet (not made, or to be measured again)."""
        return self._phase_start is not None and (self.decision is None
                                                  or self._confirm_at != float("inf"))

    @property
    def state(self) -> str:
        """"decided", "measuring" (phase n of at least m) or "waiting" (no product yet)."""
        if self.decision is not None:
            return "decided"
        if self._phase_start is None:
            return "waiting"
        if self._phase == 0:
            return f"measuring (warming up, on {self.library.name})"
        again = ", again" if self.history else ""
        return (f"measuring{again} (phase {self._phase} of at least "
                f"{self._rounds * len(self.libraries)}, on {self.library.name})")
