"""The static memory planner: valid placements always, the lower bound where it is reachable."""

from __future__ import annotations

import copy
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime import planner
from runtime.planner import Lifetime, Plan, live_bytes, lower_bound, plan

# (first op, last op, bytes) of the 8-tensor example of Pisarchyk & Lee 2020.
PAPER_EXAMPLE = [(0, 1, 32), (1, 4, 28), (2, 5, 36), (3, 5, 16), (4, 5, 8), (5, 7, 64),
                 (6, 8, 10), (7, 8, 40)]


@st.composite
def lifetimes(draw, max_buffers: int = 40, max_ops: int = 30) -> list[Lifetime]:
    """Random lifetimes: any spans, sizes from 1 byte to 10 kB, now and then a 0-byte buffer."""
    n = draw(st.integers(0, max_buffers))
    result = []
    for key in range(n):
        first = draw(st.integers(0, max_ops - 1))
        last = draw(st.integers(first, max_ops - 1))
        nbytes = draw(st.integers(0, 10_000) | st.sampled_from([0, 1, 64, 4096]))
        result.append(Lifetime(f"t{key}", first, last, nbytes))
    return result


@st.composite
def dense_lifetimes(draw, max_buffers: int = 150, max_ops: int = 6) -> list[Lifetime]:
    """Many buffers over a few ops, so that most are live with 48 or more others: placement
    finds their gaps by lifetime, without a list of conflicts. Spans and sizes come from a
    drawn seed (drawing each would cost most of the test's time); one buffer in ten is empty."""
    n = draw(st.integers(0, max_buffers))
    n_ops = draw(st.integers(1, max_ops))
    rng = random.Random(draw(st.integers(0, 2**32)))
    result = []
    for key in range(n):
        first, last = sorted((rng.randrange(n_ops), rng.randrange(n_ops)))
        nbytes = 0 if rng.random() < 0.1 else rng.choice([64, 1024, rng.randint(1, 4096)])
        result.append(Lifetime(key, first, last, nbytes))
    return result


@st.composite
def chains(draw, spans: tuple[int, ...] = (1,)) -> list[Lifetime]:
    """Op i writes buffer i; the last read is `span` ops later, a span drawn from `spans`."""
    sizes = draw(st.lists(st.integers(1, 1 << 20), min_size=1, max_size=60))
    return [Lifetime(i, i, i + draw(st.sampled_from(spans)), nbytes)
            for i, nbytes in enumerate(sizes)]


def dag_lifetimes(n_ops: int, seed: int) -> list[Lifetime]:
    """One buffer an op, read by one to three later ops: mostly the next few, one in five any."""
    rng = random.Random(seed)
    first: list[int] = []
    last: list[int] = []
    for op in range(n_ops):
        for _ in range(rng.randint(1, 3) if first else 0):
            if rng.random() < 0.2:
                j = rng.randrange(len(first))
            else:
                j = max(0, len(first) - 1 - int(rng.expovariate(0.5)))
            last[j] = max(last[j], op)
        first.append(op)
        last.append(op)
    return [Lifetime(i, f, la, rng.randint(1, 8) * 256)
            for i, (f, la) in enumerate(zip(first, last))]


@st.composite
def dags(draw) -> list[Lifetime]:
    return dag_lifetimes(draw(st.integers(1, 60)), draw(st.integers(0, 2**32)))


def live_together(a: Lifetime, b: Lifetime) -> bool:
    return a.first <= b.last and b.first <= a.last


def random_intervals(n: int, n_ops: int, seed: int) -> list[Lifetime]:
    """Each buffer live between two ops drawn uniformly: about 2/3 of all pairs conflict."""
    rng = random.Random(seed)
    result = []
    for key in range(n):
        first, last = sorted((rng.randrange(n_ops), rng.randrange(n_ops)))
        result.append(Lifetime(key, first, last, rng.randint(1, 1 << 20)))
    return result


def assert_pairwise_valid(result: Plan, lts: list[Lifetime], alignment: int) -> None:
    """No two buffers live together share a byte, checked pair by pair (not by the plan)."""
    size = {lt.key: -(-lt.nbytes // alignment) * alignment for lt in lts}
    for lt in lts:
        assert result.offsets[lt.key] % alignment == 0
        assert result.offsets[lt.key] + size[lt.key] <= result.planned_bytes
    for i, a in enumerate(lts):
        for b in lts[i + 1:]:
            if live_together(a, b) and size[a.key] and size[b.key]:
                a_lo, b_lo = result.offsets[a.key], result.offsets[b.key]
                assert a_lo + size[a.key] <= b_lo or b_lo + size[b.key] <= a_lo, (a, b)


@given(lifetimes(), st.sampled_from([1, 8, 64, 256]))
def test_random_lifetimes_give_a_valid_plan(lts: list[Lifetime], alignment: int) -> None:
    before = copy.deepcopy(lts)
    result = plan(lts, alignment=alignment)
    assert lts == before  # nothing mutated
    result.check_invariants(lts)
    # The same properties, checked here pairwise rather than by the plan's own checker.
    assert_pairwise_valid(result, lts, alignment)
    assert result.lower_bound_bytes <= result.planned_bytes <= result.naive_bytes
    assert result.lower_bound_bytes == lower_bound(lts, alignment)


@given(lifetimes(max_buffers=12, max_ops=8))
def test_lower_bound_is_the_busiest_op(lts: list[Lifetime]) -> None:
    # Against its definition, op by op.
    n_ops = max((lt.last + 1 for lt in lts), default=0)
    by_op = [sum(lt.nbytes for lt in lts if lt.first <= op <= lt.last) for op in range(n_ops)]
    assert live_bytes(lts) == by_op
    assert lower_bound(lts) == max(by_op, default=0)


@given(chains())
def test_chains_reach_the_lower_bound(lts: list[Lifetime]) -> None:
    result = plan(lts, alignment=64)
    result.check_invariants(lts)
    assert result.planned_bytes == result.lower_bound_bytes


@given(chains(spans=(1, 2)))
def test_chains_with_buffers_living_two_or_three_ops_reach_the_lower_bound(
        lts: list[Lifetime]) -> None:
    result = plan(lts, alignment=1)
    result.check_invariants(lts)
    assert result.planned_bytes == result.lower_bound_bytes


def test_paper_example_reaches_the_lower_bound() -> None:
    lts = [Lifetime(i, first, last, nbytes) for i, (first, last, nbytes) in
           enumerate(PAPER_EXAMPLE)]
    result = plan(lts, alignment=1)
    result.check_invariants(lts)
    assert result.lower_bound_bytes == 124
    assert result.planned_bytes == 124
    assert result.naive_bytes == sum(nbytes for _, _, nbytes in PAPER_EXAMPLE)


def test_an_output_may_not_take_its_inputs_bytes() -> None:
    # "a" is last read by op 1, which writes "b": they are live together at op 1.
    lts = [Lifetime("a", 0, 1, 64), Lifetime("b", 1, 2, 64)]
    result = plan(lts)
    assert result.offsets["a"] != result.offsets["b"]
    assert result.lower_bound_bytes == result.planned_bytes == 128
    # One op apart, they share.
    lts = [Lifetime("a", 0, 1, 64), Lifetime("b", 2, 3, 64)]
    assert plan(lts).planned_bytes == 64


def test_sizes_are_rounded_to_the_alignment() -> None:
    lts = [Lifetime("a", 0, 0, 1), Lifetime("b", 0, 0, 65)]
    result = plan(lts, alignment=64)
    assert sorted(result.offsets.values()) in ([0, 64], [0, 128])
    assert result.planned_bytes == result.lower_bound_bytes == result.naive_bytes == 192
    assert lower_bound(lts) == 66  # unaligned on request


def test_empty_and_zero_byte_buffers() -> None:
    result = plan([])
    assert (dict(result.offsets), result.planned_bytes, result.lower_bound_bytes) == ({}, 0, 0)
    lts = [Lifetime("z", 0, 3, 0), Lifetime("a", 1, 2, 10)]
    result = plan(lts, alignment=1)
    result.check_invariants(lts)
    assert result.offsets["z"] == 0 and result.planned_bytes == 10


def test_check_invariants_catches_an_overlap() -> None:
    lts = [Lifetime("a", 0, 2, 64), Lifetime("b", 2, 4, 64), Lifetime("c", 3, 4, 64)]
    good = plan(lts)
    good.check_invariants(lts)
    # Hand-made: "b" and "c" share bytes while both live at ops 3 and 4.
    bad = Plan(offsets={"a": 0, "b": 64, "c": 64}, planned_bytes=128,
               lower_bound_bytes=128, naive_bytes=192, alignment=64)
    with pytest.raises(AssertionError, match="'b'.*'c'.*overlap"):
        bad.check_invariants(lts)


@pytest.mark.parametrize("bad, message", [
    (Plan({"a": 32, "b": 0}, 96, 128, 128, alignment=64), "multiple of 64"),
    (Plan({"a": 0, "b": 64}, 64, 128, 128, alignment=64), "past the arena"),
    (Plan({"a": 0}, 64, 128, 128, alignment=64), "misses"),
    (Plan({"a": 0, "b": 64}, 128, 64, 128, alignment=64), "lower_bound_bytes"),
])
def test_check_invariants_catches_a_bad_plan(bad: Plan, message: str) -> None:
    lts = [Lifetime("a", 0, 1, 64), Lifetime("b", 1, 2, 64)]
    with pytest.raises(AssertionError, match=message):
        bad.check_invariants(lts)


def test_bad_input_raises() -> None:
    with pytest.raises(ValueError, match="first <= last"):
        Lifetime("a", 3, 2, 8)
    with pytest.raises(ValueError, match="nbytes"):
        Lifetime("a", 0, 2, -1)
    with pytest.raises(ValueError, match="more than once"):
        plan([Lifetime("a", 0, 1, 8), Lifetime("a", 2, 3, 8)])
    with pytest.raises(ValueError, match="alignment"):
        plan([], alignment=0)
    with pytest.raises(ValueError, match="n_ops"):
        live_bytes([Lifetime("a", 0, 5, 8)], n_ops=3)


def test_plan_is_deterministic() -> None:
    lts = [Lifetime(i, i % 7, i % 7 + i % 5, 100 + 37 * i) for i in range(200)]
    assert dict(plan(lts).offsets) == dict(plan(lts).offsets)


@given(dags(), st.sampled_from([1, 64, 512]))
def test_dag_shaped_lifetimes_give_a_valid_deterministic_plan(lts: list[Lifetime],
                                                              alignment: int) -> None:
    # DAG-shaped lifetimes send the planner through its local search (seeded, bounded).
    before = copy.deepcopy(lts)
    result = plan(lts, alignment=alignment)
    assert lts == before
    result.check_invariants(lts)
    assert dict(plan(lts, alignment=alignment).offsets) == dict(result.offsets)


def test_random_dags_come_close_to_the_lower_bound() -> None:
    # Before the pressure orderings and the local search, 8 of these were 1.5-7.6% over; seed 9
    # stays 5.6% over within the budget (a budget 50 times larger reaches the lower bound).
    ratios = []
    for seed in range(10):
        lts = dag_lifetimes(80, seed)
        result = plan(lts)
        result.check_invariants(lts)
        ratios.append(result.planned_bytes / result.lower_bound_bytes)
    assert max(ratios) <= 1.06, ratios
    assert sum(ratio == 1 for ratio in ratios) >= 8, ratios


@given(lifetimes(max_buffers=20, max_ops=12))
def test_pressure_is_the_most_bytes_live_during_a_lifetime(lts: list[Lifetime]) -> None:
    live = live_bytes(lts)
    first = [lt.first for lt in lts]
    last = [lt.last for lt in lts]
    assert planner._pressure(live, first, last) == [
        max(live[lt.first:lt.last + 1]) for lt in lts]


@settings(max_examples=20)
@given(dense_lifetimes(), st.sampled_from([1, 64]))
def test_dense_lifetimes_give_a_valid_deterministic_plan(lts: list[Lifetime],
                                                         alignment: int) -> None:
    result = plan(lts, alignment=alignment)
    result.check_invariants(lts)
    assert_pairwise_valid(result, lts, alignment)
    assert result.lower_bound_bytes <= result.planned_bytes
    assert dict(plan(lts, alignment=alignment).offsets) == dict(result.offsets)


@settings(max_examples=50)
@given(dense_lifetimes() | lifetimes(max_buffers=60, max_ops=20), st.data())
def test_replanning_and_vectorized_placement_give_the_offsets_of_a_whole_listed_placement(
        lts: list[Lifetime], data: st.DataObject) -> None:
    # The local search keeps the offsets of the buffers before the one it moves and replans
    # the rest; that must give what a placement of the whole order gives. Buffers live with
    # many others find their gap among the placed buffers by lifetime, without a conflict
    # list; listing every conflict must not change a single offset either.
    first = [lt.first for lt in lts]
    last = [lt.last for lt in lts]
    size = [lt.nbytes for lt in lts]
    unlisted = planner._buffers(first, last, size)
    listed = planner._buffers(first, last, size, lists_for_all=True)
    assert None not in listed.conflicts
    order = data.draw(st.permutations(range(len(lts))))
    cut = data.draw(st.integers(0, len(lts)))
    best_fit = data.draw(st.booleans())
    whole, arena = planner._place(order, listed, best_fit)
    assert planner._place(order, unlisted, best_fit) == (whole, arena)
    placed = [whole[i] if i in order[:cut] else -1 for i in range(len(lts))]
    assert planner._place(order[cut:], listed, best_fit, placed) == (whole, arena)
    assert planner._place(order[cut:], unlisted, best_fit, placed) == (whole, arena)


@settings(max_examples=50)
@given(dense_lifetimes(max_buffers=80) | lifetimes(max_buffers=60, max_ops=20))
def test_conflicts_are_counted_and_listed_as_defined(lts: list[Lifetime]) -> None:
    first = [lt.first for lt in lts]
    last = [lt.last for lt in lts]
    size = [lt.nbytes for lt in lts]
    expected = [sorted(j for j, b in enumerate(lts) if j != i and a.nbytes and b.nbytes
                       and live_together(a, b)) for i, a in enumerate(lts)]
    buffers = planner._buffers(first, last, size)
    assert buffers.counts == [len(near) for near in expected]
    for near, got in zip(expected, buffers.conflicts):
        # listed exactly when there are few
        assert (got is None) == (len(near) >= planner._VECTOR_MIN)
        assert got is None or sorted(got) == near
    listed = planner._buffers(first, last, size, lists_for_all=True)
    assert [sorted(got) for got in listed.conflicts] == expected


@settings(max_examples=50)
@given(lifetimes(max_buffers=30, max_ops=10), st.data())
def test_the_overlap_check_finds_exactly_the_overlapping_pairs(lts: list[Lifetime],
                                                              data: st.DataObject) -> None:
    offsets = {lt.key: data.draw(st.integers(0, 20_000)) for lt in lts}
    overlapping = [
        (a.key, b.key) for i, a in enumerate(lts) for b in lts[i + 1:]
        if live_together(a, b) and a.nbytes and b.nbytes
        and offsets[a.key] < offsets[b.key] + b.nbytes
        and offsets[b.key] < offsets[a.key] + a.nbytes]
    if overlapping:
        with pytest.raises(AssertionError, match="overlap"):
            planner._check_no_overlap(lts, offsets, 1)
    else:
        planner._check_no_overlap(lts, offsets, 1)


def test_dense_5000_buffers_give_a_valid_plan() -> None:
    # Random intervals over 300 ops: millions of conflicting pairs, counted but never listed.
    lts = random_intervals(5000, 300, seed=0)
    buffers = planner._buffers([lt.first for lt in lts], [lt.last for lt in lts],
                               [lt.nbytes for lt in lts])
    assert sum(buffers.counts) // 2 > 5_000_000
    result = plan(lts)
    result.check_invariants(lts)
    assert result.lower_bound_bytes <= result.planned_bytes <= 1.05 * result.lower_bound_bytes


def test_dense_nested_lifetimes_reach_the_lower_bound() -> None:
    # The shape of a deep network's training step: forward results kept until their backward
    # use (nested lifetimes, all live together at the turn), short-lived gradients on the way
    # back. 2500 layers, about 5000 buffers and 3 million conflicting pairs.
    depth = 2500
    lts = [Lifetime(("act", k), k, 2 * depth - k, 4096 * (1 + k % 3)) for k in range(depth)]
    lts += [Lifetime(("grad", k), 2 * depth - k, 2 * depth - k + 1, 8192) for k in range(depth)]
    result = plan(lts)
    result.check_invariants(lts)
    assert result.planned_bytes == result.lower_bound_bytes
    # the same offsets again (the 5000-buffer plan is deterministic too)
    assert dict(plan(lts).offsets) == dict(result.offsets)
