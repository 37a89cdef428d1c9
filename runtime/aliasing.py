"""Exact overlap tests for strided layouts, and the per-op aliasing policy.

A layout is `(offset, shape, strides, itemsize)` in bytes inside one block. Two layouts share a
byte when there are indices x (of the first) and y (of the second) and byte positions d, e inside
the items with

    offset_a + sum(sa_i * x_i) + d == offset_b + sum(sb_j * y_j) + e.

Flipping every negatively signed term (v -> u - v) turns this into one equation with positive
coefficients, sum(c_k * v_k) == rhs with 0 <= v_k <= u_k, a bounded subset-sum problem. We solve
it exactly: equal coefficients merge, a gcd test prunes, the last two terms are solved in closed
form with the extended Euclidean algorithm, and earlier terms only visit values in the residue
class the gcd of the remaining terms allows. This is the approach NumPy takes in mem_overlap.c,
written here from its description so that every backend gets the same answer without relying on
NumPy's own overlap handling. A work budget bounds pathological cases; past it the answer is
"overlaps" (never a false negative).
"""

from __future__ import annotations

from collections.abc import Sequence
from math import gcd

Layout = tuple[int, Sequence[int], Sequence[int], int]

#: Candidate values tried before the solver gives up and answers "may overlap".
MAX_WORK = 1 << 16

#: How often the work budget ran out (the answer was then the conservative "overlap").
budget_exhausted = 0


def byte_span(layout: Layout) -> tuple[int, int] | None:
    """[first, last + 1) bytes the layout touches, or None for an empty layout."""
    offset, shape, strides, itemsize = layout
    lo = hi = offset
    for n, s in zip(shape, strides):
        if n == 0:
            return None
        if s > 0:
            hi += s * (n - 1)
        else:
            lo += s * (n - 1)
    return lo, hi + itemsize


def _terms(a: Layout, b: Layout) -> tuple[list[tuple[int, int]], int]:
    """The positive-coefficient terms (c, u) and the right-hand side of the overlap equation."""
    oa, sha, sta, isa = a
    ob, shb, stb, isb = b
    rhs = ob - oa
    merged: dict[int, int] = {}

    def add(coef: int, upper: int) -> None:
        nonlocal rhs
        if upper <= 0 or coef == 0:
            return
        if coef < 0:  # coef * v == coef * upper + |coef| * (upper - v)
            rhs -= coef * upper
            coef = -coef
        merged[coef] = merged.get(coef, 0) + upper

    for n, s in zip(sha, sta):
        add(s, n - 1)
    add(1, isa - 1)
    for n, s in zip(shb, stb):
        add(-s, n - 1)
    add(-1, isb - 1)
    return sorted(merged.items(), reverse=True), rhs


def _two_terms(c1: int, u1: int, c2: int, u2: int, rhs: int) -> bool:
    """Is there 0<=v1<=u1, 0<=v2<=u2 with c1*v1 + c2*v2 == rhs? (closed form)"""
    g = gcd(c1, c2)
    if rhs % g:
        return False
    c1, c2, rhs = c1 // g, c2 // g, rhs // g
    v1 = rhs * pow(c1, -1, c2) % c2 if c2 > 1 else 0  # v1 = v1 + c2*t, v2 = v2 - c1*t
    v2 = (rhs - c1 * v1) // c2
    t_lo = max(-(v1 // c2), -((u2 - v2) // c1))      # ceil(-v1/c2), ceil((v2-u2)/c1)
    t_hi = min((u1 - v1) // c2, v2 // c1)
    return t_lo <= t_hi


def _solve(terms: list[tuple[int, int]], rhs: int) -> bool:
    # Phase 1: suffix bounds and gcds for pruning.
    n = len(terms)
    reach = [0] * (n + 1)
    gcds = [0] * (n + 1)
    for k in range(n - 1, -1, -1):
        c, u = terms[k]
        reach[k] = reach[k + 1] + c * u
        gcds[k] = gcd(gcds[k + 1], c)
    work = [MAX_WORK]

    # Phase 2: depth-first search over the leading terms, closed form for the last two.
    def search(k: int, rest: int) -> bool:
        if rest < 0 or rest > reach[k]:
            return False
        if k == n:
            return rest == 0
        if rest % gcds[k]:
            return False
        c, u = terms[k]
        if k == n - 1:
            return rest % c == 0 and rest // c <= u
        if k == n - 2:
            return _two_terms(c, u, terms[k + 1][0], terms[k + 1][1], rest)
        g = gcds[k + 1]
        lo = max(0, -((reach[k + 1] - rest) // c))  # ceil((rest - reach[k+1]) / c)
        hi = min(u, rest // c)
        d = gcd(c, g)
        step = g // d
        v0 = (rest // d) * pow(c // d, -1, step) % step if step > 1 else 0
        first = lo + (v0 - lo) % step
        for v in range(first, hi + 1, step):
            work[0] -= 1
            if work[0] < 0:
                raise _Exhausted
            if search(k + 1, rest - c * v):
                return True
        return False

    try:
        return search(0, rhs)
    except _Exhausted:
        global budget_exhausted
        budget_exhausted += 1
        return True


class _Exhausted(Exception):
    pass


def overlaps(a: Layout, b: Layout) -> bool:
    """True when the two layouts (in the same block) share at least one byte. Exact."""
    span_a, span_b = byte_span(a), byte_span(b)
    if span_a is None or span_b is None:
        return False
    if span_a[1] <= span_b[0] or span_b[1] <= span_a[0]:
        return False
    terms, rhs = _terms(a, b)
    return _solve(terms, rhs)


def same_elements(a: Layout, b: Layout) -> bool:
    """True when both layouts put every index on the same bytes (strides of size-1 dims aside)."""
    if a == b:
        return True
    offset_a, shape_a, strides_a, item_a = a
    offset_b, shape_b, strides_b, item_b = b
    if (offset_a, shape_a, item_a) != (offset_b, shape_b, item_b):
        return False
    return all(n == 1 or sa == sb for n, sa, sb in zip(shape_a, strides_a, strides_b))


def has_internal_overlap(layout: Layout) -> bool:
    """True when two different indices of the layout may share a byte (e.g. a zero stride).

    A sufficient test: sorted by |stride|, each stride must clear the whole extent of the
    smaller dimensions. Every layout the public API creates (slices, transposes, C-order views)
    passes it.
    """
    _, shape, strides, itemsize = layout
    if 0 in shape:
        return False
    extent = itemsize
    for s, n in sorted((abs(s), n) for n, s in zip(shape, strides) if n > 1):
        if s < extent:
            return True
        extent = s * (n - 1) + extent
    return False


def describe(label: str, block_id: int, layout: Layout,
             placed: tuple[int, int] | None = None) -> str:
    """A readable name for an operand in error messages.

    `placed` is (other block's id, shift) for an operand in another block whose memory lies
    `shift` bytes from the start of that block's (memory imported with `from_dlpack`).
    """
    offset, shape, strides, itemsize = layout
    where = f"block #{block_id}"
    if placed is not None:
        where += f", whose memory starts {placed[1]:+d} bytes from block #{placed[0]}'s"
    return (f"{label} ({where}, byte offset {offset}, shape {tuple(shape)}, "
            f"byte strides {tuple(strides)})")
