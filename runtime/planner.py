"""Static memory planning: put every intermediate buffer of a captured schedule in one arena.

The graph runtime knows, for each buffer of a captured op schedule, the op that first writes it and
the op that last reads it. `plan` turns those lifetimes into byte offsets in one arena so that two
buffers share bytes only when they are never live at the same op.

Two buffers conflict when their inclusive intervals [first, last] intersect. In particular a buffer
last read by op k and a buffer first written by op k conflict: an op reads its inputs while it
writes its output, so the output may not take the inputs' bytes. (In-place ops are the graph's
business: it gives them no new buffer.)

Sizes are rounded up to `alignment` before placement, and the lower bound is computed on the same
rounded sizes, so `planned_bytes >= lower_bound_bytes` always holds and the ratio says how much the
placement itself costs, not the padding.

The algorithm is greedy by size with best fit (TFLite's arena planner; Pisarchyk & Lee 2020,
"Efficient Memory Management for Deep Neural Net Inference"), run over a few orderings and with
first fit too, keeping the smallest arena. One ordering puts first the buffers live at the busiest
ops (at an op where the lower bound is set, the buffers live there must tile the arena exactly).
From the best, a local search (iterated greedy) moves a buffer that reaches the arena top earlier
in the order, or swaps two neighbours, and replans the rest. All of it stops at the lower bound,
and within a fixed work budget with a seeded generator, so a plan is deterministic: small problems
get many tries, large ones only a few orderings. When at most two buffers are ever live at once (a
plain chain), a two-colouring reaches the lower bound exactly; when every buffer overlaps only a
few others, a bounded depth-first search tries for the lower bound where the greedy missed it.

Conflicts are counted, not listed: with the start and end ops sorted, how many buffers each one
is live with takes two bisections. Only a buffer live with few others gets a list of them, which
placement scans in plain Python. The others find their gap in a table of the placed buffers kept
in offset order, whose lifetimes one vectorized pass matches against theirs; that gives the same
offset as a list would, so a dense schedule never lists its millions of pairs (the shape of a
deep network's training step: every saved activation is live at the turn to the backward pass).
Measured on a shared 2-vCPU AMD EPYC (BENCHMARKS.md, "Planner scaling"): 5,000 buffers with 8.3
million conflicting pairs plan in about 0.33 s (2.5 s when every pair was listed), an 830-layer
MLP training step (about 5,000 buffers, 4 to 7 million pairs) in about 0.15 s (0.8 to 1.4 s), and
the synthetic DAGs of up to 2,000 ops in at most about 0.15 s. The table costs a vectorized pass
and a memory move of its columns a buffer placed, so time grows with the square of the buffers:
10,000 dense ones (33 million pairs) take about 0.8 s.

Example:
    >>> from runtime.planner import Lifetime, plan
    >>> p = plan([Lifetime("a", 0, 1, 100), Lifetime("b", 1, 2, 50), Lifetime("c", 2, 3, 100)])
    >>> p.offsets["a"] == p.offsets["c"], p.planned_bytes, p.lower_bound_bytes, p.naive_bytes
    (True, 192, 192, 320)
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

__all__ = ["Lifetime", "Plan", "live_bytes", "lower_bound", "plan"]

#: Placements stop after about this many steps in all (at least two placements run), a step
#: being a conflicting pair or 1/_BUFFER_STEPS of a buffer placed, so that a plan depends on
#: its input only. It bounds the number of placements, not their time: 5,000 dense buffers get
#: two (about 0.33 s, see the module docstring), a few hundred get a dozen and a local search.
_WORK_BUDGET = 1_000_000
#: The steps of the budget that placing one buffer counts for.
_BUFFER_STEPS = 48
#: The local search spends at most this many whole placements' worth of the budget (it replans
#: only the end of the order, so it makes about twice as many tries).
_LOCAL_PLACEMENTS = 50
#: The local search's moves: this share moves a buffer at the arena top earlier in the order ...
_MOVE_TOP = 0.5
#: ... and the others swap two buffers at most this far apart in the order.
_SWAP_REACH = 5
#: The search for a plan at the lower bound gives up after this many placements (plus two a
#: buffer) ...
_SEARCH_NODES = 2000
#: ... and runs only when no buffer conflicts with more than this many others.
_SEARCH_MAX_CONFLICTS = 8
#: Buffers with at least this many conflicts find their gap in a vectorized table of the placed
#: buffers, without a conflict list; fewer, in plain Python over their list.
_VECTOR_MIN = 48
#: Buffers placed since the last vectorized search go into its table one by one up to this
#: many, merged by a sort beyond.
_SHIFT_MAX = 8
#: Plan.check_invariants tests about this many pairs of buffers at a time.
_CHECK_PAIRS = 1 << 20
#: A gap that no buffer fits, for the vectorized best fit.
_NO_FIT = np.iinfo(np.int64).max


@dataclass(frozen=True)
class Lifetime:
    """One buffer of a schedule: written first by op `first`, read last by op `last` (inclusive).

    Raises ValueError when `first < 0`, `last < first` or `nbytes < 0`. A 0-byte buffer takes no
    room: it is placed at offset 0 and conflicts with nothing.

    Example:
        >>> Lifetime("h1", first=3, last=7, nbytes=4096).last
        7
    """

    key: Hashable
    first: int
    last: int
    nbytes: int

    def __post_init__(self) -> None:
        if self.first < 0 or self.last < self.first:
            raise ValueError(f"lifetime of {self.key!r}: need 0 <= first <= last, "
                             f"got first={self.first}, last={self.last}")
        if self.nbytes < 0:
            raise ValueError(f"lifetime of {self.key!r}: nbytes must be >= 0, got {self.nbytes}")


@dataclass(frozen=True)
class Plan:
    """Where each buffer lives in the arena, with the numbers to judge the placement by.

    All byte counts use sizes rounded up to `alignment`: `naive_bytes` is the arena without any
    reuse (the sum of the sizes), `lower_bound_bytes` the most bytes live at any one op, which no
    placement can beat, and `planned_bytes` the arena this plan needs.

    Example:
        >>> p = plan([Lifetime("x", 0, 0, 10), Lifetime("y", 1, 1, 10)], alignment=16)
        >>> dict(p.offsets), p.planned_bytes
        ({'x': 0, 'y': 0}, 16)
    """

    offsets: Mapping[Hashable, int]
    planned_bytes: int
    lower_bound_bytes: int
    naive_bytes: int
    #: the alignment the sizes were rounded to; check_invariants needs it to redo the sums
    alignment: int = field(default=1)

    def check_invariants(self, lifetimes: Iterable[Lifetime]) -> None:
        """Raise AssertionError unless this plan is a valid placement of `lifetimes`.

        Checks: one offset per buffer and no others; offsets aligned and non-negative; every
        buffer inside the arena and the arena no larger than needed; no two buffers live at the
        same op share a byte (the message names both); the three totals match `lifetimes` and
        lower bound <= planned <= naive.

        Example:
            >>> lts = [Lifetime("a", 0, 1, 8), Lifetime("b", 1, 2, 8)]
            >>> Plan({"a": 0, "b": 4}, 12, 16, 16).check_invariants(lts)
            Traceback (most recent call last):
            ...
            AssertionError: buffers 'a' [0, 8) and 'b' [4, 12) are both live at op 1 and overlap
        """
        lifetimes = list(lifetimes)
        align = self.alignment
        keys = [lt.key for lt in lifetimes]
        if not (set(keys) == set(self.offsets)):
            raise AssertionError(f"plan places {sorted(map(repr, set(self.offsets) - set(keys)))} "
                                 f"that are not buffers and misses "
                                 f"{sorted(map(repr, set(keys) - set(self.offsets)))}")
        top = 0
        for lt in lifetimes:
            off, size = self.offsets[lt.key], _round_up(lt.nbytes, align)
            if not (off >= 0 and off % align == 0):
                raise AssertionError(f"offset {off} of {lt.key!r} is not a non-negative multiple "
                                     f"of {align}")
            if not (off + size <= self.planned_bytes):
                raise AssertionError(f"{lt.key!r} at [{off}, {off + size}) runs past the arena of "
                                     f"{self.planned_bytes} bytes")
            top = max(top, off + size)
        if not (top == self.planned_bytes):
            raise AssertionError(f"arena of {self.planned_bytes} bytes, {top} used")
        _check_no_overlap(lifetimes, self.offsets, align)
        lower = lower_bound(lifetimes, align)
        naive = sum(_round_up(lt.nbytes, align) for lt in lifetimes)
        if not (self.lower_bound_bytes == lower):
            raise AssertionError(f"lower_bound_bytes {self.lower_bound_bytes}, lifetimes give "
                                 f"{lower}")
        if not (self.naive_bytes == naive):
            raise AssertionError(f"naive_bytes {self.naive_bytes}, lifetimes give {naive}")
        if not (lower <= self.planned_bytes <= naive):
            raise AssertionError(f"planned {self.planned_bytes} outside [lower bound {lower}, "
                                 f"naive {naive}]")


def live_bytes(lifetimes: Iterable[Lifetime], n_ops: int | None = None, *,
               alignment: int = 1) -> list[int]:
    """Bytes live at each op index 0 .. n_ops-1 (sizes rounded up to `alignment`).

    `n_ops` defaults to one past the last op any buffer reaches; a smaller one raises ValueError.
    Handy for a memory timeline plot.

    Example:
        >>> live_bytes([Lifetime("a", 0, 1, 8), Lifetime("b", 1, 2, 4)], n_ops=4)
        [8, 12, 4, 0]
    """
    lifetimes = list(lifetimes)
    needed = max((lt.last + 1 for lt in lifetimes), default=0)
    if n_ops is None:
        n_ops = needed
    if n_ops < needed:
        raise ValueError(f"n_ops={n_ops}, but a buffer is live at op {needed - 1}")
    # A difference array: +size where a buffer starts, -size one past where it ends.
    delta = [0] * (n_ops + 1)
    for lt in lifetimes:
        size = _round_up(lt.nbytes, alignment)
        delta[lt.first] += size
        delta[lt.last + 1] -= size
    live, running = [], 0
    for step in delta[:n_ops]:
        running += step
        live.append(running)
    return live


def lower_bound(lifetimes: Iterable[Lifetime], alignment: int = 1) -> int:
    """The most bytes live at any one op: no arena can be smaller (sizes rounded to `alignment`).

    Example:
        >>> lower_bound([Lifetime("a", 0, 1, 8), Lifetime("b", 1, 2, 4)])
        12
    """
    return max(live_bytes(lifetimes, alignment=alignment), default=0)


def plan(lifetimes: Sequence[Lifetime], alignment: int = 64) -> Plan:
    """Place every buffer at an `alignment`-aligned offset in one arena; reuse bytes over time.

    Takes the lifetimes (keys unique) and returns a Plan; mutates nothing. Raises ValueError on a
    repeated key or an alignment below 1.

    Example (the 8-tensor example of Pisarchyk & Lee 2020 reaches its lower bound):
        >>> spans = [(0, 1, 32), (1, 4, 28), (2, 5, 36), (3, 5, 16), (4, 5, 8), (5, 7, 64),
        ...          (6, 8, 10), (7, 8, 40)]
        >>> p = plan([Lifetime(i, *s) for i, s in enumerate(spans)], alignment=1)
        >>> p.planned_bytes, p.lower_bound_bytes, p.naive_bytes
        (124, 124, 234)
    """
    # Phase 1: lifetimes. Validate, round sizes up; buffers are numbered 0..n-1 from here on.
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1, got {alignment}")
    lifetimes = list(lifetimes)
    keys = [lt.key for lt in lifetimes]
    seen: set[Hashable] = set()
    for key in keys:
        if key in seen:
            raise ValueError(f"buffer key {key!r} appears more than once")
        seen.add(key)
    first = [lt.first for lt in lifetimes]
    last = [lt.last for lt in lifetimes]
    size = [_round_up(lt.nbytes, alignment) for lt in lifetimes]

    # Phase 2: events. The live bytes at each op give the lower bound and each buffer's pressure
    # (the most bytes live while it is); sorted start and end ops give how many buffers each
    # one is live with. Only the buffers live with few others get an explicit list of them.
    live = live_bytes(lifetimes, alignment=alignment)
    lower = max(live, default=0)
    naive = sum(size)
    pressure = _pressure(live, first, last)
    # NOTE: intervals that pairwise overlap share an op, so the conflict graph of lifetimes is
    # bipartite (a chain's) exactly when no op has three buffers live
    chain = _most_live(first, last, size) <= 2
    buffers = _buffers(first, last, size, lists_for_all=chain)

    # Phase 3: offsets. Two-colour a chain; otherwise greedy best fit over several orderings,
    # then a bounded local search from the best one. Keep the smallest arena.
    offsets, arena = [], -1
    if chain:
        offsets, arena = _two_colour(buffers.conflicts, size, lower)
    if arena != lower:
        offsets, arena = _best_of_orderings(buffers, pressure, lower)
    if arena != lower and max(buffers.counts, default=0) <= _SEARCH_MAX_CONFLICTS:
        # A bounded search may still fit everything into the lower bound when few buffers
        # overlap each one (chains with short skips): each try then costs little.
        found = _search_lower_bound(first, last, size, buffers.conflicts, lower)
        if found is not None:
            offsets, arena = found, lower

    # Phase 4: result.
    return Plan(offsets=MappingProxyType(dict(zip(keys, offsets))), planned_bytes=arena,
                lower_bound_bytes=lower, naive_bytes=naive, alignment=alignment)


def _round_up(nbytes: int, alignment: int) -> int:
    return -(-nbytes // alignment) * alignment


@dataclass(frozen=True)
class _Buffers:
    """The buffers as placement sees them, numbered 0..n-1 (sizes already rounded)."""

    first: list[int]
    last: list[int]
    size: list[int]
    #: how many buffers each one is live with at some op (0-byte buffers: none)
    counts: list[int]
    #: the buffers each one is live with, for those with fewer than _VECTOR_MIN of them; None
    #: for the others, which placement matches against the placed buffers' lifetimes instead
    conflicts: list[list[int] | None]


def _buffers(first: list[int], last: list[int], size: list[int], lists_for_all: bool = False
             ) -> _Buffers:
    """Count each buffer's conflicts and list them for the buffers that have few.

    Costs O(n log n) plus the length of the lists made: a dense schedule's millions of
    conflicting pairs are counted, never listed. `lists_for_all` lists them for every buffer.
    """
    first_array = np.array(first, dtype=np.int64)
    last_array = np.array(last, dtype=np.int64)
    nonzero = np.array(size, dtype=np.int64) > 0
    # Buffers live together with i: those starting by its last op, less those ending before
    # its first op (they start by then too), less i itself.
    starts = np.sort(first_array[nonzero])
    ends = np.sort(last_array[nonzero])
    counts = (np.searchsorted(starts, last_array, side="right")
              - np.searchsorted(ends, first_array, side="left") - 1)
    counts = np.where(nonzero, counts, 0)
    listed = np.ones(len(size), dtype=bool) if lists_for_all else counts < _VECTOR_MIN
    sources, targets = _listed_pairs(first_array, last_array, nonzero, listed)
    # group the pairs by source: each listed buffer's slice of the targets
    targets = targets[np.argsort(sources, kind="stable")].tolist()
    bounds = np.concatenate(([0], np.cumsum(np.bincount(sources, minlength=len(size))))).tolist()
    conflicts: list[list[int] | None] = [
        targets[bounds[i]:bounds[i + 1]] if listed[i] else None for i in range(len(size))]
    return _Buffers(first=first, last=last, size=size, counts=counts.tolist(),
                    conflicts=conflicts)


def _listed_pairs(first: np.ndarray, last: np.ndarray, nonzero: np.ndarray, listed: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Every conflicting pair (i, j), as two arrays, whose `i` is listed.

    Of two buffers live together, the one that starts later (in start order) starts within the
    other's lifetime; in start order, the buffers starting within one's lifetime are the
    positions after it up to `stop`. A listed buffer takes all of those; an unlisted one only
    the listed among them, found by bisection, so unlisted pairs are never made.
    """
    indices = np.flatnonzero(nonzero)
    by_start = indices[np.argsort(first[indices], kind="stable")]
    stop = np.searchsorted(first[by_start], last[by_start], side="right")
    positions = np.arange(len(by_start))
    is_listed = listed[by_start]
    # listed buffers with every buffer that starts in their lifetime (both ways when both are
    # listed)
    own = positions[is_listed]
    source, later = _ranges(own + 1, stop[own])
    i, j = by_start[own[source]], by_start[later]
    back = listed[j]
    # unlisted buffers with the listed ones that start in their lifetime (one way)
    others = positions[~is_listed]
    source, within = _ranges(np.searchsorted(own, others + 1), np.searchsorted(own, stop[others]))
    k, m = by_start[others[source]], by_start[own[within]]
    return np.concatenate((i, j[back], m)), np.concatenate((j, i[back], k))


def _ranges(starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """All of range(starts[r], stops[r]) for each r, concatenated, and for each element its r."""
    lengths = np.maximum(stops - starts, 0)
    row = np.repeat(np.arange(len(starts)), lengths)
    # each element's place within its range, from a running count that restarts at each range
    place = np.arange(len(row)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return row, starts[row] + place


def _most_live(first: list[int], last: list[int], size: list[int]) -> int:
    """The most buffers (with bytes) live at any one op."""
    nonzero = np.array(size, dtype=np.int64) > 0
    if not nonzero.any():
        return 0
    starts = np.array(first, dtype=np.int64)[nonzero]
    ends = np.array(last, dtype=np.int64)[nonzero] + 1
    delta = np.bincount(starts, minlength=ends.max() + 1) - np.bincount(ends)
    return int(np.cumsum(delta).max())


def _pressure(live: list[int], first: list[int], last: list[int]) -> list[int]:
    """For each buffer, the most bytes live at any op it is live at."""
    if not first:
        return []
    # NOTE: reduceat over [first, last + 1) pairs; the padding keeps last + 1 a valid index
    bounds = np.column_stack((first, np.add(last, 1))).ravel()
    return np.maximum.reduceat(np.array([*live, 0], dtype=np.int64), bounds)[::2].tolist()


def _two_colour(conflicts: list[list[int]], size: list[int], lower: int
                ) -> tuple[list[int], int]:
    """Exact when the conflict graph is bipartite and no conflicting pair exceeds `lower`.

    That is the case when at most two buffers are ever live at once (the graph is then a forest):
    one colour sits at the bottom of an arena of `lower` bytes, the other at its top. Returns an
    arena of -1 when the graph has an odd cycle or a pair does not fit.
    """
    colour = [-1] * len(size)
    for root in range(len(size)):
        if colour[root] >= 0:
            continue
        colour[root], stack = 0, [root]
        while stack:
            i = stack.pop()
            for j in conflicts[i]:
                if size[i] + size[j] > lower:
                    return [], -1
                if colour[j] < 0:
                    colour[j] = 1 - colour[i]
                    stack.append(j)
                elif colour[j] == colour[i]:
                    return [], -1
    offsets = [0 if c == 0 else lower - s for c, s in zip(colour, size)]
    return offsets, max((o + s for o, s in zip(offsets, size)), default=0)


class _Placed:
    """The placed buffers with bytes, in offset order: offset, end, first op and last op.

    Finds the gaps a buffer may take among the placed buffers live with it without a list of
    them: a few vectorized passes over columns already in offset order, so nothing is sorted
    per buffer. Buffers placed since the last search wait in a Python list and go in together
    when the next one comes (shifted in one by one when they are few, merged when many).
    """

    def __init__(self, buffers: _Buffers, offset: list[int]) -> None:
        #: rows offset, end, first, last; columns [0, count) are the placed buffers in offset
        #: order, and the column after them holds the arena top while a gap is sought
        self.table = np.zeros((4, len(offset) + 1), dtype=np.int64)
        self.count = 0
        #: (offset, end, first, last) of buffers placed but not yet in the table
        self.pending = [(o, o + buffers.size[i], buffers.first[i], buffers.last[i])
                        for i, o in enumerate(offset) if o >= 0 and buffers.size[i]]

    def add(self, offset: int, end: int, first: int, last: int) -> None:
        self.pending.append((offset, end, first, last))

    def fit(self, first: int, last: int, need: int, arena: int, best_fit: bool) -> int:
        """The offset for a buffer live over [first, last]: the gaps below each placed buffer
        live with it, in offset order, and the space above them up to `arena`."""
        self._take_pending()
        count = self.count
        self.table[0, count] = arena
        lo = self.table[0, :count + 1]
        hi, starts, ends = self.table[1:, :count]
        live = starts <= last
        live &= ends >= first
        # below[k]: the top of the live buffers before column k (0 for none); buffers not live
        # count as ending at 0, so the gap below a live one is lo - below
        below = np.zeros(count + 1, dtype=np.int64)
        np.maximum.accumulate(np.multiply(hi, live), out=below[1:])
        gaps = lo - below
        fits = gaps >= need
        fits[:count] &= live
        if best_fit:
            # NOTE: argmin returns the first smallest, as min() does in the list path
            chosen = int(np.argmin(np.where(fits, gaps, _NO_FIT)))
        else:
            chosen = int(np.argmax(fits))
        return int(below[chosen] if fits[chosen] else below[-1])

    def _take_pending(self) -> None:
        count, pending = self.count, self.pending
        if len(pending) > _SHIFT_MAX:
            merged = np.concatenate((self.table[:, :count], np.array(pending).T), axis=1)
            # NOTE: the order among equal offsets does not change any gap that fits
            order = np.argsort(merged[0], kind="stable")
            self.table[:, :count + len(pending)] = merged[:, order]
            count += len(pending)
        else:
            for column in pending:
                at = int(np.searchsorted(self.table[0, :count], column[0], side="right"))
                self.table[:, at + 1:count + 1] = self.table[:, at:count]
                self.table[:, at] = column
                count += 1
        self.count, self.pending = count, []


def _place(order: Sequence[int], buffers: _Buffers, best_fit: bool,
           placed: list[int] | None = None) -> tuple[list[int], int]:
    """Place buffers in `order`, each in a gap among the placed buffers it conflicts with.

    A gap is free space between placed conflicting buffers; the space above the highest of them
    counts as a gap up to the current arena top. `best_fit` takes the tightest gap that fits
    (TFLite), otherwise the lowest (first fit). When no gap fits the buffer goes on top of its
    conflicts, growing the arena. A buffer with a conflict list scans it in plain Python; the
    others take the vectorized pass of `_Placed`, which gives the same offset. `placed`, when
    given, holds the offsets of buffers already placed (-1 for the others, which must be
    exactly those in `order`); it is copied, not changed.
    """
    size, first, last, conflicts = buffers.size, buffers.first, buffers.last, buffers.conflicts
    offset = [-1] * len(size) if placed is None else list(placed)
    arena = max((o + s for o, s in zip(offset, size) if o >= 0), default=0)
    # NOTE: only a buffer without a conflict list needs the placed ones in offset order
    table = _Placed(buffers, offset) if any(conflicts[i] is None for i in order) else None
    for i in order:
        need = size[i]
        near = conflicts[i]
        if near is not None:
            spans = sorted((offset[j], offset[j] + size[j]) for j in near if offset[j] >= 0)
            tops = list(itertools.accumulate((hi for _, hi in spans), max, initial=0))
            gaps = [lo - below for (lo, _), below in zip(spans, tops)]
            # The space above every conflict, up to the arena top, is one more (bounded) gap.
            gaps.append(arena - tops[-1])
            fits = [k for k, gap in enumerate(gaps) if gap >= need]
            if not fits:
                best = tops[-1]
            elif best_fit:
                best = tops[min(fits, key=gaps.__getitem__)]
            else:
                best = tops[fits[0]]
        else:
            best = table.fit(first[i], last[i], need, arena, best_fit)
        offset[i] = best
        if table is not None and need:
            table.add(best, best + need, first[i], last[i])
        arena = max(arena, best + need)
    return offset, arena


def _best_of_orderings(buffers: _Buffers, pressure: list[int], lower: int
                       ) -> tuple[list[int], int]:
    """Best fit and first fit over a few orderings, then a seeded local search from the best.

    Work is counted in steps (`_BUFFER_STEPS` a buffer placed plus one a conflicting pair) against
    `_WORK_BUDGET`, so small problems get many tries, large ones few, and the result depends on
    the input only.
    """
    first, last, size = buffers.first, buffers.last, buffers.size
    n = len(size)
    duration = [last[i] - first[i] + 1 for i in range(n)]
    cost = [_BUFFER_STEPS + count for count in buffers.counts]
    # Sort keys, each an ordering to try; ties fall to the next element.
    keys = {
        # greedy by size (TFLite); the longer-lived, then the earlier first
        "size": lambda i: (-size[i], -duration[i], first[i]),
        # the buffers live at the busiest ops first, in schedule order: at an op where the
        # lower bound is set they must tile the arena exactly, so they go in before the rest
        "pressure": lambda i: (-pressure[i], first[i], -size[i]),
        # ... or by size among the same pressure
        "pressure, size": lambda i: (-pressure[i], -size[i], first[i]),
        # longest-lived first: they constrain everything they overlap
        "duration": lambda i: (-duration[i], -size[i], first[i]),
        # greedy by breadth: bytes x ops
        "breadth": lambda i: (-size[i] * duration[i], -size[i], first[i]),
        # in schedule order, as a linear-scan allocator would see them
        "schedule": lambda i: (first[i], -size[i], -duration[i]),
    }
    # (ordering, best fit), those that win most often on random DAGs first, as large problems
    # get through only a few of them
    orderings = (("size", False), ("pressure", True), ("pressure, size", True),
                 ("size", True), ("pressure", False), ("pressure, size", False),
                 ("duration", True), ("breadth", True), ("duration", False),
                 ("breadth", False), ("schedule", True), ("schedule", False))
    # at least two placements run whatever the budget; past it, stop early
    placement = sum(cost)
    budget = max(_WORK_BUDGET, 2 * placement)
    best = (-1, [], [], False)  # arena, offsets, order, best fit
    for name, best_fit in orderings:
        order = sorted(range(n), key=keys[name])
        offsets, arena = _place(order, buffers, best_fit)
        budget -= placement
        if best[0] < 0 or arena < best[0]:
            best = (arena, offsets, order, best_fit)
        if best[0] == lower or budget < placement:
            return best[1], best[0]
    # Local search (iterated greedy): a buffer that reaches the top of the arena was placed too
    # late; move one, picked by a seeded generator, to an earlier place in the order and replan
    # from there (the buffers before it keep their offsets). Keep the new order when its arena
    # is no larger, so the search can walk across plateaus.
    arena, offsets, order, best_fit = best
    rng = random.Random(0)
    budget = min(budget, _LOCAL_PLACEMENTS * placement)
    while arena > lower:
        trial_order = list(order)
        if rng.random() < _MOVE_TOP:
            moved = rng.choice([i for i in range(n) if offsets[i] + size[i] == arena])
            old = order.index(moved)
            # NOTE: old > 0: the first buffer in the order sits at 0, so it tops the arena only
            # when the arena is no larger than it, hence at the lower bound
            start = rng.randrange(old)
            trial_order[start:old + 1] = [moved, *order[start:old]]
        else:
            a = rng.randrange(n)
            b = min(n - 1, max(0, a + rng.randint(-_SWAP_REACH, _SWAP_REACH)))
            trial_order[a], trial_order[b] = order[b], order[a]
            start = min(a, b)
        spent = sum(cost[i] for i in trial_order[start:])
        if budget < spent:
            break
        budget -= spent
        placed = list(offsets)
        for i in trial_order[start:]:
            placed[i] = -1
        trial_offsets, trial_arena = _place(trial_order[start:], buffers, best_fit, placed)
        if trial_arena <= arena:
            order, offsets, arena = trial_order, trial_offsets, trial_arena
    return offsets, arena


def _search_lower_bound(first: list[int], last: list[int], size: list[int],
                        conflicts: list[list[int]], lower: int) -> list[int] | None:
    """Offsets that fit every buffer into `lower` bytes, found by a bounded depth-first search.

    Buffers are placed in schedule order; each tries the bottom, the top and the edges of the
    placed buffers it conflicts with. Returns None when the search gives up (after
    `_SEARCH_NODES` tries plus two per buffer) or finds that these positions cannot do it.
    """
    order = sorted((i for i in range(len(size)) if size[i]), key=lambda i: (first[i], -size[i]))
    rank = {i: depth for depth, i in enumerate(order)}
    offset = [0] * len(size)
    failed: set[tuple[int, frozenset[tuple[int, int]]]] = set()
    budget = _SEARCH_NODES + 2 * len(order)

    def candidates(depth: int) -> tuple[tuple[int, frozenset[tuple[int, int]]], list[int]]:
        i = order[depth]
        live = frozenset((j, offset[j]) for j in conflicts[i] if rank[j] < depth)
        edges = {0, lower - size[i]}
        for j, lo in live:
            edges.update((lo + size[j], lo - size[i]))
        fits = [pos for pos in sorted(edges) if 0 <= pos <= lower - size[i] and all(
            pos + size[i] <= lo or lo + size[j] <= pos for j, lo in live)]
        return (depth, live), fits

    # an explicit stack of (state, untried positions); a state that failed once fails again
    stack = [candidates(0)] if order else []
    while stack:
        state, fits = stack[-1]
        if not fits or state in failed:
            failed.add(state)
            stack.pop()
            continue
        budget -= 1
        if budget < 0:
            return None
        depth = len(stack) - 1
        offset[order[depth]] = fits.pop(0)
        if depth + 1 == len(order):
            return offset
        stack.append(candidates(depth + 1))
    return None if order else offset


def _check_no_overlap(lifetimes: list[Lifetime], offsets: Mapping[Hashable, int],
                      alignment: int) -> None:
    """AssertionError naming two buffers live at the same op whose byte ranges intersect.

    Of two buffers live together, the later to start starts within the other's lifetime: those
    pairs are tested, vectorized, about `_CHECK_PAIRS` at a time.
    """
    first = np.array([lt.first for lt in lifetimes], dtype=np.int64)
    last = np.array([lt.last for lt in lifetimes], dtype=np.int64)
    lo = np.array([offsets[lt.key] for lt in lifetimes], dtype=np.int64)
    hi = lo + np.array([_round_up(lt.nbytes, alignment) for lt in lifetimes], dtype=np.int64)
    indices = np.flatnonzero(hi > lo)
    by_start = indices[np.argsort(first[indices], kind="stable")]
    stop = np.searchsorted(first[by_start], last[by_start], side="right")
    # the pairs made before each source position, to cut the sources into chunks
    made = np.cumsum(stop - np.arange(1, len(by_start) + 1))
    start = 0
    while start < len(by_start):
        before = int(made[start - 1]) if start else 0
        end = max(start + 1, int(np.searchsorted(made, before + _CHECK_PAIRS, side="right")))
        positions = np.arange(start, end)
        source, later = _ranges(positions + 1, stop[start:end])
        a, b = by_start[positions[source]], by_start[later]
        clash = np.flatnonzero((lo[a] < hi[b]) & (lo[b] < hi[a]))
        if len(clash):
            a, b = int(a[clash[0]]), int(b[clash[0]])
            if lo[b] < lo[a]:
                a, b = b, a
            raise AssertionError(
                f"buffers {lifetimes[a].key!r} [{lo[a]}, {hi[a]}) and {lifetimes[b].key!r} "
                f"[{lo[b]}, {hi[b]}) are both live at op {max(first[a], first[b])} and overlap")
        start = end
