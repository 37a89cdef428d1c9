"""Adaptors: the conformance kit on stacks of them, each adaptor's behaviour, traces and replay."""

from __future__ import annotations

import io
import json
import math
import random
import threading
import unittest

import pytest
from hypothesis import Phase, given
from hypothesis import strategies as st

import allocators
from allocators import Allocation, Allocator, InvalidFreeError, OutOfMemoryError
from allocators.adaptors import (
    TRAFFIC_KEYS,
    Adaptor,
    FaultInjectionAdaptor,
    LimitAdaptor,
    StatisticsAdaptor,
    TraceAdaptor,
    _power_of_two_bucket,
)
from allocators.direct import DirectAllocator
from allocators.testing import RATIO_STATS, REQUIRED_STATS, make_test_case
from allocators.trace import TraceEvent, load_trace, replay
from helpers import run_threads
from kit_machines import OpeningMachine


def direct() -> DirectAllocator:
    return allocators.create("direct", "cpu")


class HoardingAllocator(DirectAllocator):
    """Keeps freed memory reserved until empty_cache(), so that something is cached."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__(device)
        self._hoard: list[tuple[object, int]] = []

    def _free(self, allocation: Allocation) -> None:
        self._hoard.append((allocation.raw, allocation.size))

    def _empty_cache(self) -> None:
        for raw, size in self._hoard:
            self._device_free(raw, size)
        self._hoard.clear()

    def _largest_free_block(self) -> int:
        return max((size for _, size in self._hoard), default=0)


class RoundingAllocator(DirectAllocator):
    """Sets aside a multiple of 256 bytes for every request, as size classes do."""

    def _allocate(self, nbytes: int) -> Allocation:
        size = -(-nbytes // 256) * 256
        return Allocation(self.device, self._device_alloc(size), 0, nbytes, size)


class LeakyAdaptor(Adaptor):
    """Planted bug: never gives the upstream allocation back."""

    def _free(self, allocation: Allocation) -> None:
        pass


class OwnBooksAdaptor(Adaptor):
    """Planted bug: reports only its own counters, as the base Allocator.stats() would."""

    stats = Allocator.stats


def run_kit(factory, **options) -> str:
    """Run the kit on `factory`, each program opening with every rule (OpeningMachine); return
    the failure text ('' if it passed)."""
    result = unittest.TestResult()
    make_test_case(factory, machine=OpeningMachine, **options)().run(result)
    return "\n".join(text for _, text in result.failures + result.errors)


# ---------------------------------------------------------------------- the kit on adaptor stacks
STACKS = {
    "statistics": (lambda: StatisticsAdaptor(direct()), False),
    "limit": (lambda: LimitAdaptor(direct(), 256 << 10), True),
    "trace": (lambda: TraceAdaptor(direct()), False),
    "fault-injection": (lambda: FaultInjectionAdaptor(direct(), 0.1, seed=7), True),
    "statistics-over-limit": (lambda: StatisticsAdaptor(LimitAdaptor(direct(), 512 << 10)), True),
    "all-four": (lambda: TraceAdaptor(FaultInjectionAdaptor(
        StatisticsAdaptor(LimitAdaptor(direct(), 512 << 10)), 0.05, seed=1)), True),
}


@pytest.mark.parametrize("stack", list(STACKS))
def test_kit_passes_an_adaptor_stack(stack):
    build, refuses = STACKS[stack]
    made: list[Allocator] = []

    def factory() -> Allocator:
        made.append(build())
        return made[-1]

    assert run_kit(factory) == ""
    ooms = sum(allocator.stats()["num_ooms"] for allocator in made)
    if refuses:  # the kit really drove the refusal path, and found it clean
        assert ooms > 0
    else:
        assert ooms == 0


@pytest.mark.parametrize("stack", [name for name, (_, refuses) in STACKS.items() if refuses])
def test_every_program_of_the_kit_drives_a_refusing_stack_to_refuse(stack):
    """One program is enough: its opening allocates until the stack refuses (the limits within
    2 MiB; the fault adaptors' seeds fault within its first calls), whatever is drawn after."""
    build, _ = STACKS[stack]
    made: list[Allocator] = []

    def factory() -> Allocator:
        made.append(build())
        return made[-1]

    for _ in range(3):
        made.clear()
        assert run_kit(factory, max_examples=1, database=None) == ""
        assert sum(allocator.stats()["num_ooms"] for allocator in made) > 0


@pytest.mark.parametrize(("adaptor", "complaint"), [
    (LeakyAdaptor, "disagree with the model|leaks"),
    (OwnBooksAdaptor, "stats()['cached_bytes'] = -"),
], ids=["forgets-upstream-free", "reports-own-books-only"])
def test_kit_catches_a_broken_adaptor(adaptor, complaint):
    # NOTE: one program, not shrunk: its opening reaches every rule, so the catch is certain
    failure = run_kit(lambda: adaptor(direct()), max_examples=1, database=None,
                      phases=[Phase.generate])
    assert failure
    assert any(part in failure for part in complaint.split("|")), failure


# ---------------------------------------------------------------------- the Adaptor base
def test_an_adaptor_allocation_wraps_one_upstream_allocation():
    upstream = direct()
    adaptor = StatisticsAdaptor(upstream)
    assert adaptor.upstream is upstream
    assert adaptor.device is upstream.device
    allocation = adaptor.allocate(100)
    inner = allocation.upstream
    assert allocation.owner is adaptor and inner.owner is upstream
    assert (allocation.ptr, allocation.size, allocation.nbytes) == (inner.ptr, inner.size, 100)
    assert upstream.live_allocations() == [inner]
    adaptor.free(allocation)
    assert not inner.live
    assert allocation.raw is None  # no reference kept to freed memory
    assert upstream.stats()["reserved_bytes"] == 0


def test_an_adaptor_needs_an_allocator_upstream():
    with pytest.raises(TypeError, match="wraps an allocators.Allocator"):
        StatisticsAdaptor("direct")


def test_invalid_frees_are_refused_at_the_adaptor():
    upstream = direct()
    adaptor = TraceAdaptor(upstream)
    allocation = adaptor.allocate(64)
    with pytest.raises(InvalidFreeError, match="belongs to"):
        adaptor.free(upstream.allocate(8))
    with pytest.raises(InvalidFreeError, match="belongs to"):
        adaptor.free(allocation.upstream)  # the upstream's allocation is not the adaptor's
    with pytest.raises(InvalidFreeError, match="belongs to"):
        upstream.free(allocation)
    adaptor.free(allocation)
    before = adaptor.stats()
    with pytest.raises(InvalidFreeError, match="double free"):
        adaptor.free(allocation)
    assert adaptor.stats() == before
    assert [event.action for event in adaptor.events] == ["alloc", "free"]


def test_stats_report_own_traffic_over_the_upstream_memory_picture():
    upstream = direct()
    adaptor = StatisticsAdaptor(upstream)
    other = upstream.allocate(1000)  # another user of the same upstream
    mine = adaptor.allocate(100)
    stats = adaptor.stats()
    own = {key: stats[key] for key in ("allocated_bytes", "requested_bytes", "num_allocs",
                                       "active_allocations", "peak_allocated_bytes")}
    assert own == {"allocated_bytes": 100, "requested_bytes": 100, "num_allocs": 1,
                   "active_allocations": 1, "peak_allocated_bytes": 100}
    upstream_stats = upstream.stats()
    for key in ("reserved_bytes", "peak_reserved_bytes", "cache_misses", "cache_hits",
                "num_device_allocs"):
        assert stats[key] == upstream_stats[key], key
    assert stats["reserved_bytes"] == 1100
    assert set(REQUIRED_STATS) | set(RATIO_STATS) <= set(stats)
    assert set(TRAFFIC_KEYS) <= set(stats)
    adaptor.free(mine)
    upstream.free(other)


def test_cached_bytes_and_empty_cache_go_through_to_the_upstream():
    adaptor = StatisticsAdaptor(LimitAdaptor(HoardingAllocator(), 4096))
    adaptor.free(adaptor.allocate(300))
    stats = adaptor.stats()
    assert (stats["allocated_bytes"], stats["reserved_bytes"], stats["cached_bytes"]) == (0, 300,
                                                                                       300)
    assert stats["peak_cached_bytes"] == 300
    assert stats["fragmentation"] == 0.0
    assert stats["limit_bytes"] == 4096  # an inner adaptor's key shows through
    adaptor.empty_cache()
    assert adaptor.stats()["reserved_bytes"] == 0
    adaptor.check_invariants()


def test_an_upstream_refusal_passes_through_unchanged():
    limit = LimitAdaptor(direct(), 1000)
    stack = StatisticsAdaptor(limit)
    with pytest.raises(OutOfMemoryError) as caught:
        stack.allocate(2000)
    error = caught.value
    assert isinstance(error.__cause__, OutOfMemoryError)
    assert str(error) == str(error.__cause__)
    assert "LimitAdaptor has 0 B in use" in str(error)
    assert "limit 1000 B (LimitAdaptor)" in str(error)
    assert stack.stats()["num_ooms"] == 1
    assert limit.stats()["num_ooms"] == 1


def test_limit_and_device_errors_come_from_below_unless_overridden():
    upstream = direct()
    assert StatisticsAdaptor(upstream)._limit() == upstream._limit()
    assert StatisticsAdaptor(LimitAdaptor(upstream, 7))._limit() == (7, "LimitAdaptor")
    with pytest.raises(OutOfMemoryError, match="DirectAllocator has 0 B in use"):
        StatisticsAdaptor(upstream).allocate(2**64)


def test_check_invariants_catches_a_corrupted_adaptor_counter():
    adaptor = StatisticsAdaptor(direct())
    allocation = adaptor.allocate(64)
    adaptor.check_invariants()
    adaptor._allocated_bytes += 1  # deliberate corruption
    with pytest.raises(AssertionError, match="allocated_bytes drifted"):
        adaptor.check_invariants()
    adaptor._allocated_bytes -= 1
    adaptor.free(allocation)


def test_check_invariants_checks_the_upstream_too():
    upstream = direct()
    adaptor = TraceAdaptor(upstream)
    allocation = adaptor.allocate(64)
    upstream._requested_bytes += 1  # deliberate corruption, one level down
    with pytest.raises(AssertionError, match="requested_bytes drifted"):
        adaptor.check_invariants()
    upstream._requested_bytes -= 1
    adaptor.free(allocation)


def test_an_upstream_allocation_freed_behind_the_adaptors_back_is_caught():
    upstream = direct()
    adaptor = StatisticsAdaptor(upstream)
    allocation = adaptor.allocate(64)
    upstream.free(allocation.upstream)  # misuse: bypasses the adaptor
    with pytest.raises(AssertionError, match="not live in its upstream"):
        adaptor.check_invariants()
    with pytest.raises(InvalidFreeError, match="double free"):
        adaptor.free(allocation)
    # the refused free left the adaptor's books as they were
    assert allocation.live
    assert adaptor.live_allocations() == [allocation]
    assert adaptor.stats()["num_frees"] == 0


def test_reprs_read_like_the_stack():
    stack = StatisticsAdaptor(LimitAdaptor(direct(), 2**30))
    assert repr(stack) == "StatisticsAdaptor(LimitAdaptor(<DirectAllocator on cpu>, " \
                          "limit_bytes=1.00 GiB))"
    flaky = FaultInjectionAdaptor(direct(), 0.25, seed=3)
    assert repr(flaky) == "FaultInjectionAdaptor(<DirectAllocator on cpu>, probability=0.25, " \
                          "seed=3)"
    traced = TraceAdaptor(stack)
    traced.free(traced.allocate(1))
    assert repr(traced) == f"TraceAdaptor({stack!r}, events=2)"


def test_concurrent_traffic_through_a_stack_keeps_exact_books():
    traced = TraceAdaptor(direct())
    stack = StatisticsAdaptor(traced)
    rounds, workers = 200, 4
    idents = set()

    def churn(_: int) -> None:
        idents.add(threading.get_ident())
        for nbytes in range(rounds):
            stack.free(stack.allocate(nbytes))

    run_threads(churn, workers)  # NOTE: all alive at once, so thread ids differ
    stats = stack.stats()
    assert stats["num_allocs"] == stats["num_frees"] == rounds * workers
    assert stats["reserved_bytes"] == stats["allocated_bytes"] == 0
    assert 1 <= stats["peak_active_allocations"] <= workers
    stack.check_invariants()
    events = traced.events
    assert len(events) == 2 * rounds * workers
    assert len(idents) == workers
    assert {event.thread for event in events} == idents
    assert replay(events, direct())["allocs"] == rounds * workers  # a well-formed sequence


# ---------------------------------------------------------------------- StatisticsAdaptor
def test_statistics_histogram_and_counters():
    stats = StatisticsAdaptor(direct())
    allocations = [stats.allocate(n) for n in (0, 1, 3, 4, 5, 1000, 1024, 1025)]
    assert stats.histogram() == {0: 1, 1: 1, 4: 2, 8: 1, 1024: 2, 2048: 1}
    for allocation in allocations[:5]:
        stats.free(allocation)
    assert stats.counters() == {
        "bytes": {"current": 3049, "peak": 3062, "total": 3062},
        "allocations": {"current": 3, "peak": 8, "total": 8},
    }
    snapshot = stats.stats()
    assert snapshot["total_allocated_bytes"] == snapshot["total_requested_bytes"] == 3062
    assert snapshot["peak_active_allocations"] == 8
    assert snapshot["largest_allocation_bytes"] == 1025
    stats.check_invariants()
    stats._histogram[4] += 1  # deliberate corruption
    with pytest.raises(AssertionError, match="histogram"):
        stats.check_invariants()


@given(st.integers(1, 2**50))
def test_power_of_two_buckets_are_the_next_power_of_two(nbytes):
    bucket = _power_of_two_bucket(nbytes)
    assert bucket & (bucket - 1) == 0
    assert nbytes <= bucket < 2 * nbytes


def test_the_zero_byte_bucket_is_zero():
    assert _power_of_two_bucket(0) == 0


# ---------------------------------------------------------------------- LimitAdaptor
def test_limit_refuses_past_the_cap_with_numbers():
    upstream = HoardingAllocator()
    capped = LimitAdaptor(upstream, 1000)
    capped.free(capped.allocate(300))  # leaves 300 B cached upstream
    held = capped.allocate(600)
    before = capped.stats()
    with pytest.raises(OutOfMemoryError) as caught:
        capped.allocate(401)
    message = str(caught.value)
    for part in ("tried to allocate 401 B", "LimitAdaptor has 600 B in use",
                 "300 B cached upstream", "limit 1000 B (LimitAdaptor)", "pass the limit by 1 B"):
        assert part in message, message
    assert type(caught.value.__cause__) is MemoryError
    assert capped.stats() == {**before, "num_ooms": 1, "limit_refusals": 1}
    assert upstream.stats()["num_allocs"] == 2  # the refused request never reached it
    exact = capped.allocate(400)  # exactly at the cap is allowed
    zero = capped.allocate(0)
    with pytest.raises(OutOfMemoryError):
        capped.allocate(1)
    for allocation in (held, exact, zero):
        capped.free(allocation)
    capped.free(capped.allocate(1000))
    capped.check_invariants()


def test_limit_over_a_rounding_upstream_caps_requested_bytes():
    capped = LimitAdaptor(RoundingAllocator(), 1000)
    allocations = [capped.allocate(200) for _ in range(3)]  # 768 B allocated after rounding
    with pytest.raises(OutOfMemoryError):
        capped.allocate(300)  # 768 + 300 > 1000
    allocations.append(capped.allocate(200))  # 768 + 200 <= 1000; the upstream makes it 256
    stats = capped.stats()
    assert stats["requested_bytes"] == 800
    assert stats["allocated_bytes"] == 1024  # past the cap by the last rounding, as documented
    capped.check_invariants()
    capped.limit_bytes = 799  # deliberate corruption
    with pytest.raises(AssertionError, match="past its limit"):
        capped.check_invariants()


@pytest.mark.parametrize(("limit", "error"), [
    (1.5, TypeError), ("1024", TypeError), (True, TypeError), (None, TypeError),
    (-1, ValueError),
])
def test_limit_bytes_are_validated(limit, error):
    with pytest.raises(error, match="limit_bytes"):
        LimitAdaptor(direct(), limit)


# ---------------------------------------------------------------------- FaultInjectionAdaptor
def fault_pattern(adaptor: FaultInjectionAdaptor, draws: int) -> list[bool]:
    pattern = []
    for _ in range(draws):
        try:
            adaptor.free(adaptor.allocate(0))
        except OutOfMemoryError:
            pattern.append(True)
        else:
            pattern.append(False)
    return pattern


def test_fault_injection_is_deterministic_for_a_seed():
    first = fault_pattern(FaultInjectionAdaptor(direct(), 0.3, seed=11), 300)
    again = fault_pattern(FaultInjectionAdaptor(direct(), 0.3, seed=11), 300)
    other = fault_pattern(FaultInjectionAdaptor(direct(), 0.3, seed=12), 300)
    assert first == again
    assert first != other


def test_fault_injection_rate_is_near_the_probability():
    draws, probability = 5000, 0.1
    upstream = direct()
    flaky = FaultInjectionAdaptor(upstream, probability, seed=0)
    faults = sum(fault_pattern(flaky, draws))
    sigma = math.sqrt(draws * probability * (1 - probability))
    assert abs(faults - draws * probability) < 4 * sigma
    stats = flaky.stats()
    assert flaky.injected_faults == stats["injected_faults"] == stats["num_ooms"] == faults
    assert upstream.stats()["num_allocs"] == draws - faults  # a fault never reaches it


@pytest.mark.parametrize(("probability", "expected"), [(0, 0), (0.0, 0), (1, 50), (1.0, 50)])
def test_fault_injection_extremes(probability, expected):
    assert sum(fault_pattern(FaultInjectionAdaptor(direct(), probability), 50)) == expected


def test_an_injected_fault_says_so():
    flaky = FaultInjectionAdaptor(direct(), 1.0, seed=5)
    with pytest.raises(OutOfMemoryError, match="injected") as caught:
        flaky.allocate(128)
    assert "tried to allocate 128 B" in str(caught.value)
    assert "seed 5" in str(caught.value)
    assert type(caught.value.__cause__) is MemoryError


@pytest.mark.parametrize(("options", "error"), [
    ({"probability": "0.1"}, TypeError), ({"probability": None}, TypeError),
    ({"probability": True}, TypeError), ({"probability": -0.1}, ValueError),
    ({"probability": 1.5}, ValueError), ({"probability": math.nan}, ValueError),
    ({"probability": 0.5, "seed": "x"}, TypeError), ({"probability": 0.5, "seed": 1.5}, TypeError),
])
def test_fault_injection_options_are_validated(options, error):
    with pytest.raises(error):
        FaultInjectionAdaptor(direct(), **options)


# ---------------------------------------------------------------------- TraceAdaptor
def test_trace_records_each_alloc_and_free():
    traced = TraceAdaptor(direct())
    first, second, third = (traced.allocate(n) for n in (10, 20, 30))
    addresses = [first.ptr, second.ptr]
    traced.free(second)
    events = traced.events
    assert [(e.action, e.serial, e.nbytes, e.size) for e in events] == [
        ("alloc", first.serial, 10, 10), ("alloc", second.serial, 20, 20),
        ("alloc", third.serial, 30, 30), ("free", second.serial, 20, 20)]
    assert [events[0].address, events[1].address] == addresses
    assert events[3].address == addresses[1]
    assert all(event.thread == threading.get_ident() for event in events)
    times = [event.time_ns for event in events]
    assert times == sorted(times)
    assert traced.stats()["trace_events"] == 4
    traced.free(first)
    traced.free(third)


def test_a_failed_allocation_is_not_traced():
    traced = TraceAdaptor(LimitAdaptor(direct(), 100))
    with pytest.raises(OutOfMemoryError):
        traced.allocate(101)
    kept = traced.allocate(100)
    assert [(event.action, event.serial) for event in traced.events] == [("alloc", kept.serial)]
    traced.free(kept)


def run_workload(allocator: Allocator, steps: int = 400, seed: int = 0) -> list[Allocation]:
    """A random mix of allocations and frees; returns what it left live."""
    rng = random.Random(seed)
    live: list[Allocation] = []
    for _ in range(steps):
        if live and rng.random() < 0.45:
            allocator.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(allocator.allocate(rng.choice((0, 1, 64, 100, 4096, 5000, 1 << 16))))
    return live


def test_trace_jsonl_round_trip(tmp_path):
    traced = TraceAdaptor(direct())
    run_workload(traced, steps=50)
    path = tmp_path / "trace.jsonl"
    assert traced.to_jsonl(path) == len(traced.events)
    lines = path.read_text().splitlines()
    assert len(lines) == len(traced.events)
    assert set(json.loads(lines[0])) == set(TraceEvent._fields)
    assert load_trace(path) == traced.events
    assert load_trace(str(path)) == traced.events
    buffer = io.StringIO()
    traced.to_jsonl(buffer)
    buffer.seek(0)
    assert load_trace(buffer) == traced.events


def test_replaying_a_recorded_trace_gives_the_same_traffic(tmp_path):
    traced = TraceAdaptor(StatisticsAdaptor(direct()))
    left_live = run_workload(traced)
    recorded = traced.stats()
    path = tmp_path / "workload.jsonl"
    traced.to_jsonl(path)
    fresh = StatisticsAdaptor(direct())
    result = replay(load_trace(path), fresh)
    assert (result["allocs"], result["frees"]) == (recorded["num_allocs"], recorded["num_frees"])
    assert result["events"] == recorded["num_allocs"] + recorded["num_frees"]
    replayed = result["stats"]
    for key in ("num_allocs", "peak_requested_bytes", "peak_allocated_bytes",
                "total_requested_bytes", "peak_active_allocations"):
        assert replayed[key] == recorded[key], key
    assert fresh.histogram() == traced.upstream.histogram()
    # what the trace left live is freed after the pass
    assert left_live
    assert replayed["num_frees"] == replayed["num_allocs"]
    assert replayed["allocated_bytes"] == replayed["reserved_bytes"] == 0
    assert result["seconds"] > 0
    assert result["us_per_event"] == pytest.approx(result["seconds"] * 1e6 / result["events"])


def test_replay_repeats_each_pass_from_a_clean_start():
    traced = TraceAdaptor(direct())
    run_workload(traced, steps=100)
    recorded = traced.stats()
    result = replay(traced.events, direct(), repeat=3)
    assert result["repeat"] == 3
    assert result["allocs"] == 3 * recorded["num_allocs"]
    assert result["stats"]["num_allocs"] == 3 * recorded["num_allocs"]
    assert result["stats"]["peak_requested_bytes"] == recorded["peak_requested_bytes"]


def test_replay_cleans_up_when_the_allocator_runs_out():
    traced = TraceAdaptor(direct())
    live = [traced.allocate(600) for _ in range(3)]
    capped = LimitAdaptor(direct(), 1000)
    with pytest.raises(OutOfMemoryError):
        replay(traced.events, capped)
    assert capped.stats()["allocated_bytes"] == 0
    assert capped.stats()["num_frees"] == 1
    for allocation in live:
        traced.free(allocation)


def line(action: str = "alloc", serial: int = 1, **changes) -> str:
    record = {"action": action, "serial": serial, "nbytes": 8, "size": 8, "address": 4096,
              "time_ns": 1, "thread": 1, **changes}
    return json.dumps(record)


@pytest.mark.parametrize(("bad", "complaint"), [
    ("{not json", "not a JSON line"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"action": "alloc", "serial": 2}), "lacks nbytes, size, address"),
    (line("realloc", 2), "action must be"),
    (line(serial=2, nbytes=-1), "nbytes must be a non-negative integer"),
    (line(serial=2, nbytes=1.5), "nbytes must be a non-negative integer"),
    (line(serial=2, nbytes=True), "nbytes must be a non-negative integer"),
    (line(serial=2, size=4), "smaller than nbytes"),
    (line("free", 9), "free of allocation #9"),
    (line("alloc", 1), "allocated again while still live"),
], ids=["not-json", "not-an-object", "missing-keys", "bad-action", "negative", "float", "bool",
        "size-below-nbytes", "free-of-unknown-serial", "serial-live-twice"])
def test_a_malformed_trace_names_the_line(tmp_path, bad, complaint):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([line(), "", bad, line("free", 1)]) + "\n")  # the bad one: line 3
    with pytest.raises(ValueError, match="line 3") as caught:
        load_trace(path)
    assert complaint in str(caught.value)
    assert str(path) in str(caught.value)


def test_a_double_free_in_a_trace_names_the_line(tmp_path):
    path = tmp_path / "double.jsonl"
    path.write_text("\n".join([line(), line("free"), line("free")]))
    with pytest.raises(ValueError, match="line 3: free of allocation #1"):
        load_trace(path)


def test_replay_checks_the_trace_before_touching_the_allocator():
    good = TraceEvent("alloc", 1, 8, 8, 0, 0, 0)
    allocator = direct()
    with pytest.raises(ValueError, match="trace event 3: free of allocation #2"):
        replay([good, good._replace(action="free"), good._replace(action="free", serial=2)],
               allocator)
    assert allocator.stats()["num_allocs"] == 0


@pytest.mark.parametrize(("args", "error"), [
    (([], "direct"), TypeError),
    (([], None, 0), ValueError),
    (([], None, 1.0), TypeError),
    (([{"action": "alloc"}], None), TypeError),
])
def test_replay_arguments_are_checked(args, error):
    trace, allocator, *rest = args
    with pytest.raises(error):
        replay(trace, allocator if allocator is not None else direct(), *rest)
