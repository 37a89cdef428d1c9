"""Memory budgets (issue 19): `runtime.graph(step, memory_budget=N)` keeps or recomputes each
forward result the backward pass reads so that the intermediates fit in N bytes, checked by the
allocator's own peak; results equal the unconstrained graph's bit for bit on the CPU; a budget
below the least any choice reaches is refused when planned; under a LimitAdaptor the limit is
the budget by default."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import heapq
import importlib
import math
import re
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_graph_training import build, data, training_programs

import allocators
import backends
import runtime
from allocators import LimitAdaptor, OutOfMemoryError, StatisticsAdaptor
from runtime import BudgetError, nn
from runtime.graph.budget import _RATES, _SEGMENT_BINS, Rates, _segments, _sweep, _table, rates


def deep_step(depth: int = 12, width: int = 32, seed: int = 0,
              device: Any = None) -> tuple[nn.Module, Any]:
    """A deep narrow MLP's SGD training step (config D in miniature) on `device`."""
    rng = np.random.default_rng(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Dense(width, width, rng=rng, device=device), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Dense(width, 10, rng=rng, device=device))
    return model, nn.train_step(model, nn.SGD(model.parameters(), lr=0.05))


def batch(rows: int = 16, width: int = 32, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, width), dtype=np.float32), rng.integers(0, 10, rows)


def not_planned(graph: runtime.Graph, allocator: allocators.Allocator) -> int:
    """Bytes `allocator` holds for the graph outside its plan: its input copies, and outputs
    made in the step (the loss)."""
    capture = graph._last
    blocks = [h.block for h in capture.placeholders if h is not None] + [
        b for b in capture.outside if b._allocation is not None and b.allocator is allocator]
    return sum(b._allocation.size for b in {id(b): b for b in blocks}.values())


def least_bytes(make_step: Any, *args: Any, plan: str = "static",
                allocator: allocators.Allocator | None = None) -> int:
    """The least peak any choice reaches, as the refusal of a budget of 0 names it."""
    with pytest.raises(BudgetError) as caught:
        runtime.graph(make_step(), plan=plan, allocator=allocator, memory_budget=0)(*args)
    return caught.value.least_bytes


#: The allocators a budget is measured under: every byte the graph takes from one counts
#: at the size it hands out (`Allocator.allocation_size`), the caching one's size classes
#: included; a LimitAdaptor whose limit does not bind adds nothing.
ALLOCATORS = {
    "direct": lambda: allocators.create("direct", "cpu"),
    "caching": lambda: allocators.create("caching", "cpu"),
    "limit": lambda: LimitAdaptor(allocators.create("caching", "cpu"), 1 << 30),
}


def assert_within(graph: runtime.Graph, stats: StatisticsAdaptor, budget: int) -> None:
    """The allocator's own peaks, less what the graph holds outside its plan (its input
    copies, the outputs and state the step keeps), are within `budget`: the bytes it handed
    out always; the bytes it reserved from the device under a static plan (one arena) or
    a direct allocator (the bytes recycle gives back to a caching allocator stay in its
    cache, reserved: that is the cache's to bound, with max_cached_bytes)."""
    counts = stats.stats()
    outside = not_planned(graph, stats)
    assert counts["peak_allocated_bytes"] - outside <= budget
    if graph.plan == "static" or isinstance(stats.upstream, allocators.DirectAllocator):
        assert counts["peak_reserved_bytes"] - outside <= budget


def test_the_table_is_the_least_work_over_every_split():
    """T(L, s) against a brute force over every nested split, and the sweep it chooses has no
    more than s units kept at once."""
    cost, _ = _table(9)

    def brute(length: int, room: int) -> float:
        if length <= room:
            return 0
        if room < 2:
            return float("inf")
        return min(brute(length - k, room - 1) + (k - 1) + brute(k, room)
                   for k in range(1, length))

    for length in range(1, 10):
        for room in range(1, 10):
            assert cost[room, length] == brute(length, room), (length, room)
    assert cost[2, 9] == sum(range(8)) - 0 and cost[9, 9] == 0  # room 2: quadratic work

    def most_kept(sweep: Any, room: int) -> int:
        kept = len(sweep.parts) - 1 + sweep.parts[-1][1]
        nested = [most_kept(n, room) for _, _, n in sweep.parts[:-1] if n is not None]
        return max([kept, *nested])

    _, split = _table(30)
    for room in range(2, 30):
        assert most_kept(_sweep(0, 30, room, split), room) <= room


def least_forwards(n: int, most: int, gradients: bool) -> float:
    """The fewest unit forwards beyond the first sweep over every schedule (Dijkstra over
    states) that reverses a chain of n units with at most `most` unit-sized buffers live at
    once. A unit's forward needs its input live and a fresh buffer; its backward reads its own
    result (ReLU's mask), then its input (the weight gradient). With `gradients`, the backward
    pass also holds its gradient: one buffer from the loss on, two while a weight-gradient
    step writes the input's gradient (what the budget's bytes count); without, only results
    count (activation memory)."""
    start = (0, False, n, False)  # held results (bit i: unit i's), backward begun, unit, A done
    best = {start: 0}
    queue = [(0, start)]
    while queue:
        cost, state = heapq.heappop(queue)
        if best.get(state, math.inf) < cost:
            continue
        held, begun, unit, mask_done = state
        if unit == 0:
            return cost - n
        live = bin(held).count("1") + (int(begun) if gradients else 0)
        moves = [(cost + 1, (held | 1 << (i + 1), begun, unit, mask_done)) for i in range(n)
                 if (i == 0 or held >> i & 1) and not held >> (i + 1) & 1 and live < most]
        moves += [(cost, (held & ~(1 << i), begun, unit, mask_done)) for i in range(1, n + 1)
                  if held >> i & 1]
        if not begun:
            if held >> n & 1 and live + gradients <= most:
                moves.append((cost, (held, True, n, False)))
        elif not mask_done:
            if held >> unit & 1:
                moves.append((cost, (held, True, unit, True)))
        elif (unit == 1 or held >> (unit - 1) & 1) and live + gradients <= most:
            moves.append((cost, (held, True, unit - 1, False)))
        for cost_after, after in moves:
            if cost_after < best.get(after, math.inf):
                best[after] = cost_after
                heapq.heappush(queue, (cost_after, after))
    return math.inf


@functools.cache
def activation_table(n: int, room: int) -> float:
    """The programme with a recompute's room counting only results (its boundary result, read
    first by the backward pass, already gone): T(L-k, s-1) + (k-1) + T(k-1, s)."""
    if n <= room:
        return 0
    if room < 2:
        return math.inf
    return min(activation_table(n - k, room - 1) + (k - 1) + activation_table(k - 1, room)
               for k in range(1, n))


@settings(max_examples=12, deadline=None)
@given(n=st.integers(3, 9), room=st.integers(2, 6))
def test_the_table_is_the_least_work_of_any_schedule_in_the_bytes_a_budget_counts(n, room):
    """Room for s units is s results plus the backward pass's gradient: over every schedule of
    a chain (not only the programme's nested splits), the least extra work with s + 1 buffers
    counting gradients is the table's. Counting results alone (activation memory), a recompute
    need not hold its boundary result and the least is the activation programme's, never more
    than the table's: the table's extra room is the gradient's buffer (docs/graph.md)."""
    cost, _ = _table(max(n, room))
    assert least_forwards(n, room + 1, gradients=True) == cost[room, n]
    assert least_forwards(n, room, gradients=False) == activation_table(n, room) <= cost[room, n]


def test_the_table_is_griewank_and_walthers_binomial_optimum():
    """With room s, the table's extra work for L units is the binomial optimum of Griewank and
    Walther (Algorithm 799, revolve) with s - 1 checkpoints: p(L, c) = t L - C(c + t, t - 1),
    t the least with C(c + t, t) >= L, less the L - 1 forward steps of one sweep."""
    cost, _ = _table(130)
    for length in range(3, 131):
        for room in range(2, min(length, 24)):
            checkpoints, t = room - 1, 0
            while math.comb(checkpoints + t, t) < length:
                t += 1
            least = t * length - math.comb(checkpoints + t, t - 1)
            assert cost[room, length] == least - (length - 1), (length, room)


@pytest.mark.parametrize("kind", sorted(ALLOCATORS))
@pytest.mark.parametrize("plan", ["static", "recycle"])
def test_a_budget_is_met_by_the_allocators_own_peak_and_results_are_bit_exact(plan: str,
                                                                               kind: str):
    """Every byte the graph takes for its working memory (intermediates, the fused chains'
    scratch) counts, at the size the allocator hands out: the allocator's own peak is within
    the budget under a direct allocator, a caching one (512-byte size classes) and a
    LimitAdaptor over one."""
    x, y = batch()
    reference_model, reference_step = deep_step()
    reference = runtime.graph(reference_step, plan=plan, allocator=ALLOCATORS[kind]())
    losses = [reference(x, y).item() for _ in range(3)]
    full = reference.memory_report()
    least = least_bytes(lambda: deep_step()[1], x, y, plan=plan, allocator=ALLOCATORS[kind]())
    unconstrained = max(reference.timeline())
    assert least < unconstrained / 2
    for budget in (least, (least + unconstrained) // 2, unconstrained - 1):
        stats = StatisticsAdaptor(ALLOCATORS[kind]())
        model, step = deep_step()
        graph = runtime.graph(step, plan=plan, allocator=stats, memory_budget=budget)
        got = []
        for _ in range(3):
            got.append(graph(x, y).item())
            assert_within(graph, stats, budget)
        assert got == losses
        for mine, theirs in zip(model.parameters(), reference_model.parameters()):
            assert np.array_equal(mine.numpy(), theirs.numpy())
        report = graph.memory_report()
        assert report["memory_budget"] == budget and report["budget_source"] == "memory_budget"
        assert max(graph.timeline()) <= budget
        assert report["kept"] + report["recomputed"] == full["kept"]
        assert report["recomputed"] > 0 and report["recompute_flops"] > 0
        assert report["moved"] == 0 and "host" in report["moves"]
        assert report["activation_bytes"] < full["activation_bytes"]


@pytest.mark.parametrize("plan", ["static", "recycle", "none"])
@pytest.mark.parametrize("chains", ["blocked", "compiled"])
def test_the_fused_chains_scratch_comes_from_the_graphs_allocator(plan: str, chains: str,
                                                                  monkeypatch):
    """The block-sized scratch arrays of fused chains run blocked are one allocation of the
    graph's own allocator, held by the capture, and counted in peak_bytes and timeline()
    (before, the device made them outside any allocator and no budget counted them: 66,600
    bytes on config D, an eighth of the budget at an eighth of its peak); chains the CPU
    compiles (`_halfconv.chain`) need none."""
    cpu = backends.get_device("cpu")
    if chains == "blocked":
        monkeypatch.setattr(cpu, "capabilities",
                            dataclasses.replace(cpu.capabilities, compiles_fused=False))
    elif not cpu.capabilities.compiles_fused:
        pytest.skip("the CPU compiles chains only with backends._halfconv built")
    x, y = batch()
    stats = StatisticsAdaptor(allocators.create("caching", "cpu"))
    graph = runtime.graph(deep_step()[1], plan=plan, allocator=stats)
    graph(x, y)
    report = graph.memory_report()
    scratch = report["scratch_bytes"]
    assert report["fused"] > 0 and (scratch > 0) == (chains == "blocked")
    held = stats.stats()["allocated_bytes"] - not_planned(graph, stats)
    arena = stats.allocation_size(report["planned_bytes"]) if plan == "static" else 0
    held_scratch = stats.allocation_size(scratch) if scratch else 0
    assert held == arena + held_scratch  # NOTE: between calls
    assert report["peak_bytes"] <= max(graph.timeline())
    assert min(graph.timeline()) >= held_scratch
    graph.release()
    assert stats.stats()["allocated_bytes"] == 0  # NOTE: the scratch went back with the rest


def test_a_budget_that_fits_keeps_everything():
    x, y = batch()
    _, step = deep_step()
    graph = runtime.graph(step, memory_budget=1 << 30)
    graph(x, y)
    report = graph.memory_report()
    assert report["recomputed"] == 0 and report["room"] is None and report["depth"] == 0
    assert report["recompute_flops"] == 0 and report["kept"] > 0


def test_a_budget_below_the_least_is_refused_when_planned_naming_both_numbers():
    x, y = batch()
    model, step = deep_step()
    before = [p.numpy().copy() for p in model.parameters()]
    least = least_bytes(lambda: deep_step()[1], x, y)
    graph = runtime.graph(step, memory_budget=least - 1)
    with pytest.raises(BudgetError) as caught:
        graph(x, y)
    error = caught.value
    assert isinstance(error, OutOfMemoryError)
    assert (error.budget_bytes, error.least_bytes) == (least - 1, least)
    message = str(error)
    assert f"{least - 1} bytes" in message and f"{least} bytes" in message
    assert "nothing has run" in message
    for p, old in zip(model.parameters(), before):
        assert np.array_equal(p.numpy(), old)
    assert all(p.grad is None for p in model.parameters())
    # the least itself fits
    _, step = deep_step()
    graph = runtime.graph(step, memory_budget=least)
    graph(x, y)
    assert graph.memory_report()["planned_bytes"] <= least


def test_a_limit_adaptor_is_the_budget_by_default():
    x, y = batch()
    _, step = deep_step()
    unconstrained = runtime.graph(step)
    unconstrained(x, y)
    need = unconstrained.memory_report()["planned_bytes"]
    inputs = x.nbytes + y.astype(np.int64).nbytes + 256
    limited = LimitAdaptor(allocators.create("direct", "cpu"), inputs + need // 2 + 4096)
    model, step = deep_step()
    graph = runtime.graph(step, allocator=limited)
    graph(x, y)
    report = graph.memory_report()
    assert report["budget_source"].startswith("the limit of LimitAdaptor")
    assert report["recomputed"] > 0 and report["planned_bytes"] <= report["memory_budget"]
    assert limited.stats()["limit_refusals"] == 0
    # far below anything reachable: refused with the limit's numbers, as before budgets
    tiny = LimitAdaptor(allocators.create("direct", "cpu"), inputs + 1024)
    _, step = deep_step()
    with pytest.raises(OutOfMemoryError, match=r"static plan of step needs .* available.*"
                                               r"recomputing .* reaches at least"):
        runtime.graph(step, allocator=tiny)(x, y)


@pytest.mark.parametrize("plan", ["static", "recycle"])
@pytest.mark.parametrize("extra", [0, 512, 2048])
def test_a_limit_adaptor_over_a_caching_allocator_counts_its_size_classes(plan: str,
                                                                          extra: int):
    """A limit just above what the step takes from a direct allocator, put over a caching one
    (512-byte size classes): the plan is fitted to what the caching allocator really hands
    out, so the step runs (recomputing as it must) and the limit refuses nothing. Before,
    the plan was fitted at 64-byte granularity and the limit refused an allocation of the
    call (its arena, a buffer) after the capture had accepted it."""
    x, y = batch()
    measured = StatisticsAdaptor(allocators.create("direct", "cpu"))
    runtime.graph(deep_step()[1], plan=plan, allocator=measured)(x, y)
    limited = LimitAdaptor(allocators.create("caching", "cpu"),
                           measured.stats()["peak_allocated_bytes"] + extra)
    graph = runtime.graph(deep_step()[1], plan=plan, allocator=limited)
    for _ in range(3):
        graph(x, y)
    assert limited.stats()["limit_refusals"] == 0
    assert graph.memory_report()["budget_source"].startswith("the limit of LimitAdaptor")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"memory_budget": -1}, "memory_budget must be a number of bytes >= 0"),
    ({"memory_budget": 1.5}, "memory_budget must be a number of bytes >= 0"),
    ({"memory_budget": True}, "memory_budget must be a number of bytes >= 0"),
    ({"memory_budget": 1 << 20, "plan": "none"}, "memory_budget needs plan 'static' or"),
    ({"memory_budget": 1 << 20, "checkpoint": "sqrt"}, "leave checkpoint None"),
])
def test_bad_budgets_are_refused(kwargs: dict, message: str):
    with pytest.raises(ValueError, match=re.escape(message)):
        runtime.graph(lambda x: x, **kwargs)


def test_units_past_the_cap_are_merged_and_still_fit(monkeypatch):
    from runtime.graph import budget as budget_module

    x, y = batch()
    _, reference_step = deep_step()
    reference = runtime.graph(reference_step)
    expected = reference(x, y).item()
    need = reference.memory_report()["planned_bytes"]
    monkeypatch.setattr(budget_module, "_MAX_UNITS", 5)
    _, step = deep_step()
    graph = runtime.graph(step, memory_budget=need * 2 // 3)
    assert graph(x, y).item() == expected
    report = graph.memory_report()
    assert report["units"] == 5 and report["recomputed"] > 0
    assert report["planned_bytes"] <= need * 2 // 3


def test_a_program_with_nothing_to_recompute_is_refused_below_its_peak():
    def forward_only(x):
        return runtime.ops.sum(runtime.ops.tanh(runtime.ops.matmul(x, x)))

    x = np.ones((8, 8), np.float32)
    full = runtime.graph(forward_only)
    full(x)
    peak = max(full.timeline())
    with pytest.raises(BudgetError) as caught:
        runtime.graph(forward_only, memory_budget=peak - 1)(x)
    assert caught.value.least_bytes == peak


def test_the_plan_for_a_deep_net_is_chosen_fast():
    """Config D's depth at an eighth of its width: budgets of a third and a sixth of the
    unconstrained plan are met, each capture planned and run in well under a second (config D
    itself: benchmarks/bench_budget.py)."""
    x, y = batch()
    full = runtime.graph(deep_step(depth=64)[1])
    full(x, y)
    need = full.memory_report()["planned_bytes"]
    for budget in (need // 3, need // 6):
        graph = runtime.graph(deep_step(depth=64)[1], memory_budget=budget)
        start = time.perf_counter()
        graph(x, y)
        assert time.perf_counter() - start < 2.0  # NOTE: capture and one step included
        assert graph.memory_report()["planned_bytes"] <= budget


@settings(max_examples=25, deadline=None)
@given(program=training_programs(), plan=st.sampled_from(["static", "recycle"]),
       fuse=st.booleans(), where=st.floats(0, 1), kind=st.sampled_from(sorted(ALLOCATORS)))
def test_random_programs_under_random_budgets_equal_the_unconstrained_graph_bit_for_bit(
        program, plan, fuse, where, kind):
    """Drawn training programs, plans, budgets between the least and the unconstrained peak,
    and allocators: the allocator's own peak stays within the budget, and results equal the
    unconstrained graph's bit for bit."""
    batches = data(program)
    reference_model, _, reference_step = build(program)
    reference = runtime.graph(reference_step, plan=plan, fuse=fuse, allocator=ALLOCATORS[kind]())
    expected = [reference(x, t).item() for x, t in batches]
    unconstrained = max(reference.timeline())
    with pytest.raises(BudgetError) as caught:
        runtime.graph(build(program)[2], plan=plan, fuse=fuse, allocator=ALLOCATORS[kind](),
                      memory_budget=0)(*batches[0])
    least = caught.value.least_bytes
    assert least <= unconstrained
    budget = least + int(where * (unconstrained - least))
    stats = StatisticsAdaptor(ALLOCATORS[kind]())
    model, _, step = build(program)
    graph = runtime.graph(step, plan=plan, fuse=fuse, allocator=stats, memory_budget=budget)
    got = []
    for x, t in batches:
        got.append(graph(x, t).item())
        assert_within(graph, stats, budget)
    assert got == expected
    for mine, theirs in zip(model.parameters(), reference_model.parameters()):
        assert np.array_equal(mine.numpy(), theirs.numpy())


@settings(max_examples=25, deadline=None)
@given(program=training_programs(), plan=st.sampled_from(["static", "recycle"]),
       upstream=st.sampled_from(["direct", "caching"]), where=st.floats(0, 1.25))
def test_under_a_limit_adaptor_a_step_fits_or_is_refused_before_it_runs(program, plan,
                                                                        upstream, where):
    """A LimitAdaptor's limit is the budget when none is given: drawn programs under limits
    from nothing to more than the unconstrained graph takes. Either the first call is
    refused (an OutOfMemoryError, parameters as they were), or every call runs, equal to the
    unconstrained graph bit for bit, with no allocation refused by the limit: never an
    out-of-memory error in the middle of a step."""
    batches = data(program)
    reference_model, _, reference_step = build(program)
    measured = StatisticsAdaptor(ALLOCATORS[upstream]())
    reference = runtime.graph(reference_step, plan=plan, allocator=measured)
    expected = [reference(x, t).item() for x, t in batches]
    limit = int(where * measured.stats()["peak_allocated_bytes"])
    limited = LimitAdaptor(ALLOCATORS[upstream](), limit)
    model, _, step = build(program)
    before = [p.numpy().copy() for p in model.parameters()]
    graph = runtime.graph(step, plan=plan, allocator=limited)
    try:
        got = [graph(*batches[0]).item()]
    except OutOfMemoryError as error:
        event("refused")
        assert "limit" in str(error) or "available" in str(error)
        for p, old in zip(model.parameters(), before):
            assert np.array_equal(p.numpy(), old)
        return
    event("fitted by recomputing" if graph.memory_report()["recomputed"] else "fits as it is")
    got += [graph(x, t).item() for x, t in batches[1:]]
    assert got == expected
    for mine, theirs in zip(model.parameters(), reference_model.parameters()):
        assert np.array_equal(mine.numpy(), theirs.numpy())
    assert limited.stats()["limit_refusals"] == 0
    limited.check_invariants()


# ---------------------------------------------------------------------- moves (OpenCL, CUDA)
NEEDS = {"opencl": ("pyopencl", "pip install 'blockrt[opencl]'; PoCL provides a CPU device"),
         "cuda": ("cupy", "CuPy and an NVIDIA GPU")}


def separate_memory_device(kind: str) -> Any:
    module, how = NEEDS[kind]
    pytest.importorskip(module, reason=f"{module} is not installed ({how}): moves to host "
                        f"memory run on devices whose memory is not the host's")
    if kind not in backends.available():
        pytest.skip(f"no {kind} device on this machine ({how})")
    return backends.get_device(kind)


def unconstrained_on(device: Any, depth: int, steps: int) -> tuple[Any, nn.Module, Any, list]:
    """A deep_step of `depth` x 16 on `device` as a factory, and the unconstrained graph of
    one: its model, the graph, and its losses over `steps` steps on batch(8, 16)."""
    on_device = functools.partial(deep_step, depth, 16, device=device)
    reference_model, reference_step = on_device()
    reference = runtime.graph(reference_step, device=device)
    x, y = batch(rows=8, width=16)
    return on_device, reference_model, reference, [reference(x, y).item() for _ in range(steps)]


def equal_under_budget(make: Any, device: Any, budget: int, inputs: tuple, expected: list,
                       reference_model: nn.Module) -> dict:
    """Run a fresh `make()` step under `budget` on `device` once per expected loss; check each
    loss and every parameter against the unconstrained graph's bit for bit, and the
    allocator's own peak against the budget after every step. Its memory report."""
    stats = StatisticsAdaptor(allocators.create("direct", device))
    model, step = make()
    graph = runtime.graph(step, device=device, allocator=stats, memory_budget=budget)
    got = []
    for _ in expected:
        got.append(graph(*inputs).item())
        assert stats.stats()["peak_allocated_bytes"] - not_planned(graph, stats) <= budget
    assert got == expected
    for mine, theirs in zip(model.parameters(), reference_model.parameters()):
        assert np.array_equal(mine.numpy(), theirs.numpy())
    return graph.memory_report()


@contextlib.contextmanager
def forced_rates(device: Any, **rates_given: float) -> Any:
    """`device`'s measured rates set to `rates_given` for the block, then put back."""
    before = _RATES.get(id(device))
    _RATES[id(device)] = (device, Rates(**rates_given))
    try:
        yield
    finally:
        if before is None:
            del _RATES[id(device)]
        else:
            _RATES[id(device)] = before


def cpu_rates(**rates_given: float) -> Any:
    """The CPU device's measured rates set to `rates_given` for the block, then put back."""
    return forced_rates(backends.get_device("cpu"), **rates_given)


@pytest.mark.parametrize("kind", sorted(NEEDS))
def test_moves_to_host_memory_fit_the_budget_bit_for_bit(kind: str):
    """On a device whose memory is not the host's, where moving a byte costs less than
    recomputing it (the rates are set: on an H100 the measured ones choose recompute at these
    sizes), the budget moves forward results to host memory and back (on PoCL the device's
    memory is in fact host memory: the path runs for correctness); results equal the
    unconstrained graph's bit for bit."""
    device = separate_memory_device(kind)
    assert not device.capabilities.host_memory
    assert backends.get_device("cpu").capabilities.host_memory
    x, y = batch(rows=8, width=16)
    on_device, reference_model, reference, expected = unconstrained_on(device, 8, 3)
    need = reference.memory_report()["planned_bytes"]
    with forced_rates(device, per_byte=1e-12, per_flop=1e-9, per_element=0.0, per_call=0.0):
        with pytest.raises(runtime.BudgetError) as refused:  # NOTE: the least, alignment's
            runtime.graph(on_device()[1], device=device, memory_budget=1)(x, y)
        # NOTE: fractions of the plan, none below the least the device's plan reaches (on an
        # H200 that least was 5376 of 5888 bytes, where the CPU's is 2048 of 4992)
        least = refused.value.least_bytes
        reports = [equal_under_budget(on_device, device, max(budget, least), (x, y), expected,
                                      reference_model)
                   for budget in (need * 8 // 10, need // 2, need // 3)]
    for report in reports:
        assert report["moved"] > 0 and report["recomputed"] == 0
        assert report["moved_bytes"] > 0 and "moved to host memory" in report["moves"]
        assert report["kept"] + report["moved"] == reference.memory_report()["kept"]


@pytest.mark.parametrize("kind", sorted(NEEDS))
def test_moves_and_recompute_are_chosen_by_measured_cost_and_may_mix(kind: str):
    """The exchange rate of moves against recompute is measured on the device (a copy and a
    product, once a process); it decides: bytes dear, recompute only; bytes cheap, moves
    only; in between, on a deep chain at a tight budget, some units moved and some recomputed.
    Whatever the choice, results equal the unconstrained graph's bit for bit under the
    allocator's own peak."""
    device = separate_memory_device(kind)
    measured = rates(device)
    assert all(0 < r < 1e-3 for r in (measured.per_byte, measured.per_flop,
                                      measured.per_element, measured.per_call))
    assert rates(device) is measured  # NOTE: measured once, then cached
    x, y = batch(rows=8, width=16)
    on_device, reference_model, reference, expected = unconstrained_on(device, 32, 2)
    need = reference.memory_report()["planned_bytes"]
    with pytest.raises(runtime.BudgetError) as refused:  # NOTE: the least, as above
        runtime.graph(on_device()[1], device=device, memory_budget=1)(x, y)
    seen = {}
    # NOTE: seconds per byte moved, per flop recomputed (a unit: 1 KiB moved, 4.2 kflop)
    for bytes_per_flop, budget in ((1e5, need // 4), (1e-3, need // 4), (7.0, need // 5)):
        with forced_rates(device, per_byte=bytes_per_flop * 1e-10, per_flop=1e-10,
                          per_element=0.0, per_call=0.0):
            report = equal_under_budget(on_device, device,
                                        max(budget, refused.value.least_bytes), (x, y),
                                        expected, reference_model)
        seen[bytes_per_flop] = (report["moved"], report["recomputed"])
        assert (report["moved_bytes"] > 0) == (report["moved"] > 0)
        assert (report["recompute_flops"] > 0) == (report["recomputed"] > 0)
    assert rates(device) is measured  # NOTE: the measured rates are back
    assert seen[1e5][0] == 0 and seen[1e5][1] > 0
    assert seen[1e-3][0] > 0 and seen[1e-3][1] == 0
    assert seen[7.0][0] > 0 and seen[7.0][1] > 0


def test_the_cpu_device_needs_no_rates_and_moves_nothing():
    """Without lossy, the CPU device's choice reads no clock (no probe runs); with lossy and
    a budget that everything fits, no probe runs either."""
    x, y = batch()
    cpu = backends.get_device("cpu")
    before = _RATES.pop(id(cpu), None)
    try:
        graph = runtime.graph(deep_step()[1], memory_budget=20_000)
        graph(x, y)
        report = graph.memory_report()
        assert report["recomputed"] > 0 and report["moved"] == 0
        graph = runtime.graph(deep_step()[1], memory_budget=1 << 30, lossy=True)
        graph(x, y)
        assert id(cpu) not in _RATES
        graph = runtime.graph(deep_step()[1], memory_budget=20_000, lossy=True)
        graph(x, y)
        assert _RATES[id(cpu)][0] is cpu  # NOTE: the one that competes measures
    finally:
        _RATES.pop(id(cpu), None)
        if before is not None:
            _RATES[id(cpu)] = before


@pytest.mark.parametrize(("depth", "width"), [(24, 32), (40, 16), (12, 64)])
def test_at_sqrts_own_peak_the_budget_does_no_more_work_than_sqrt(depth: int, width: int):
    """checkpoint="sqrt"'s segmentation is one of the budget's candidates: at sqrt's planned
    peak the budget's choice recomputes no more than sqrt does, and fits."""
    x, y = batch(width=width)
    sqrt = runtime.graph(deep_step(depth, width)[1], checkpoint="sqrt")
    sqrt(x, y)
    theirs = sqrt.memory_report()
    graph = runtime.graph(deep_step(depth, width)[1], memory_budget=max(sqrt.timeline()))
    graph(x, y)
    mine = graph.memory_report()
    assert max(graph.timeline()) <= max(sqrt.timeline())
    assert 0 < mine["recompute_flops"] <= theirs["recompute_flops"]


# ---------------------------------------------------------------------- lossy stores (issue 20)
def test_without_lossy_nothing_is_stored_lossy():
    x, y = batch()
    for budget in (None, 30_000, 12_000):
        graph = runtime.graph(deep_step()[1], memory_budget=budget)
        graph(x, y)
        assert graph.memory_report()["lossy"] == []
        assert not any(i.phase == "store" or i.op == "cast"
                       for s in graph._last.steps for i in s.instructions)


@pytest.mark.parametrize(("lossy", "dtype", "tolerance"), [
    (True, "bfloat16", 1e-3), ("bfloat16", "bfloat16", 1e-3), ("float16", "float16", 2e-4)])
def test_lossy_stores_fit_with_less_recompute_within_a_stated_tolerance(lossy, dtype,
                                                                        tolerance):
    """With lossy allowed, kept float32 results may wait in a half dtype: at a tight budget
    the choice recomputes less than the lossless one, every tensor stored so is named with
    its dtype, the allocator's peak stays in the budget, and after three SGD steps the loss
    is within `tolerance` of the float32 graph's and every parameter within `tolerance` of
    the largest change three float32 steps made to any parameter. bfloat16 keeps 8 bits of
    precision, float16 11."""
    x, y = batch(width=256)
    reference_model, reference_step = deep_step(depth=24, width=256)
    reference = runtime.graph(reference_step)
    expected = [reference(x, y).item() for _ in range(3)]
    budget = reference.memory_report()["planned_bytes"] // 4
    stats = StatisticsAdaptor(allocators.create("direct", "cpu"))
    model, step = deep_step(depth=24, width=256)
    # NOTE: rates as measured on a quiet machine (7e-12 s a flop, 1e-10 s a cast element,
    # 1.2e-6 s a call): on a loaded one the product probe may stall and lean to lossy stores
    with cpu_rates(per_byte=4e-11, per_flop=7e-12, per_element=1e-10, per_call=1.2e-6):
        lossless = runtime.graph(deep_step(depth=24, width=256)[1], memory_budget=budget)
        lossless(x, y)
        graph = runtime.graph(step, memory_budget=budget, lossy=lossy, allocator=stats)
        got = []
        for _ in range(3):
            got.append(graph(x, y).item())
            assert stats.stats()["peak_allocated_bytes"] - not_planned(graph, stats) <= budget
    report = graph.memory_report()
    assert report["lossy"] and all(s["dtype"] == dtype for s in report["lossy"])
    assert all(s["nbytes"] * 2 == math.prod(s["shape"]) * 4 for s in report["lossy"])
    casts = [i for s in graph._last.steps for i in s.instructions if i.phase == "store"]
    assert {str(i.outputs[0].dtype) for i in casts} == {dtype, "float32"}
    assert report["recompute_flops"] < lossless.memory_report()["recompute_flops"]
    assert np.allclose(got, expected, rtol=tolerance, atol=0)
    initial = [p.numpy() for p in deep_step(depth=24, width=256)[0].parameters()]
    update = max(np.max(np.abs(b.numpy() - a))
                 for a, b in zip(initial, reference_model.parameters()))
    off = max(np.max(np.abs(a.numpy() - b.numpy()))
              for a, b in zip(model.parameters(), reference_model.parameters()))
    assert 0 < off <= tolerance * update  # NOTE: rounded, but within the tolerance


def test_lossy_with_nothing_to_fit_changes_nothing():
    x, y = batch()
    reference = runtime.graph(deep_step()[1])
    expected = reference(x, y).item()
    graph = runtime.graph(deep_step()[1], memory_budget=1 << 30, lossy=True)
    assert graph(x, y).item() == expected
    assert graph.memory_report()["lossy"] == []


@pytest.mark.parametrize("lossy", ["half", 16, None, "float32"])
def test_bad_lossy_is_refused(lossy):
    with pytest.raises(ValueError, match=re.escape(f"lossy must be False, True, 'float16' or "
                                                   f"'bfloat16', got {lossy!r}")):
        runtime.graph(lambda x: x, memory_budget=1 << 20, lossy=lossy)


def test_rates_are_measured_per_device_object():
    module = importlib.import_module("runtime.graph.budget")
    device = backends.get_device("cpu")
    before = dict(_RATES)
    try:
        _RATES.clear()
        first = rates(device)
        assert all(0 < r < 1e-3 for r in (first.per_byte, first.per_flop, first.per_element,
                                          first.per_call))
        assert _RATES[id(device)][0] is device
        assert rates(device) is first and module._RATES is _RATES
    finally:
        _RATES.clear()
        _RATES.update(before)


@settings(max_examples=25, deadline=None)
@given(program=training_programs(), plan=st.sampled_from(["static", "recycle"]),
       where=st.floats(0, 0.8), dtype=st.sampled_from(["bfloat16", "float16"]))
def test_random_programs_with_lossy_stores_fit_and_are_exact_where_nothing_is_lossy(
        program, plan, where, dtype):
    """With lossy allowed, any budget between the least and the unconstrained peak is met by
    the allocator's own peak; a choice that stores nothing lossy gives the unconstrained
    results bit for bit, and one that does names only tensors of the asked dtype and gives
    losses within a stated tolerance (5% for bfloat16, 1% for float16). (The CPU's
    rates are set so that a cast costs little against a flop, as on large layers, so that
    the tiny programs here do choose lossy stores.)"""
    batches = data(program)
    reference = runtime.graph(build(program)[2], plan=plan)
    expected = [reference(x, t).item() for x, t in batches]
    unconstrained = max(reference.timeline())
    stats = StatisticsAdaptor(allocators.create("direct", "cpu"))
    with cpu_rates(per_byte=1e-10, per_flop=1e-10, per_element=1e-12, per_call=0.0):
        with pytest.raises(BudgetError) as caught:
            runtime.graph(build(program)[2], plan=plan, memory_budget=0,
                          lossy=dtype)(*batches[0])
        least = caught.value.least_bytes
        budget = least + int(where * (unconstrained - least))
        graph = runtime.graph(build(program)[2], plan=plan, allocator=stats,
                              memory_budget=budget, lossy=dtype)
        got = []
        for x, t in batches:
            got.append(graph(x, t).item())
            assert stats.stats()["peak_allocated_bytes"] - not_planned(graph, stats) <= budget
    stored = graph.memory_report()["lossy"]
    assert all(s["dtype"] == dtype for s in stored)
    if not stored:
        assert got == expected
    else:  # NOTE: a stored value keeps 8 (bfloat16) or 11 (float16) bits of precision
        tolerance = 0.05 if dtype == "bfloat16" else 0.01
        assert np.allclose(got, expected, rtol=tolerance, atol=tolerance, equal_nan=True)


def test_blockrt_plan_budget_lossy_names_what_it_stored(capsys):
    """`blockrt plan --budget B --lossy DTYPE` prints the choice and, when it stored results
    lossy, how many and in which dtype; --lossy without --budget is refused."""
    from blockrt import cli

    argv = ["plan", "--config", "D", "--batch", "16", "--width", "64", "--depth", "12"]
    with cpu_rates(per_byte=4e-11, per_flop=7e-12, per_element=1e-10, per_call=0.0):
        assert cli.main([*argv, "--budget", "40000", "--lossy", "float16"]) in (0, None)
    out = capsys.readouterr().out
    choice = next(line for line in out.splitlines() if line.startswith("choice: "))
    assert "stored lossy" in choice, out
    assert re.search(r"^stored lossy: \d+ results \(float16, ", out, re.M), out
    with pytest.raises(SystemExit):
        cli.main([*argv, "--lossy", "float16"])
    assert "--lossy" in capsys.readouterr().err


# ---------------------------------------------------------------------- the schedule's speed-up
def _reference_schedule(program: Any, intermediate: frozenset[int]) -> list[int]:
    """The scheduler's rule written plainly: among ready instructions, the earliest that adds
    no live bytes (frees at least what it allocates), else the earliest."""
    from runtime.graph.schedule import _dependencies

    preds = _dependencies(program, intermediate)
    waiting = [len(p) for p in preds]
    uses: dict[int, int] = {}
    sizes: dict[int, int] = {}
    for instr in program:
        for operand in {o.block.id: o for o in (*instr.inputs, *instr.outputs)}.values():
            if operand.block.id in intermediate:
                uses[operand.block.id] = uses.get(operand.block.id, 0) + 1
                sizes[operand.block.id] = operand.block.nbytes
    born: set[int] = set()
    order: list[int] = []
    while len(order) < len(program):
        ready = [j for j, n in enumerate(waiting) if n == 0 and j not in order]

        def growth(j: int) -> int:
            ids = {o.block.id for o in (*program[j].inputs, *program[j].outputs)}
            return sum((sizes[b] if b not in born else 0) - (sizes[b] if uses[b] == 1 else 0)
                       for b in ids & intermediate)

        pick = min(ready, key=lambda j: (growth(j) > 0, j))
        order.append(pick)
        for b in {o.block.id for o in (*program[pick].inputs, *program[pick].outputs)}:
            if b in intermediate:
                born.add(b)
                uses[b] -= 1
        for j, before in enumerate(preds):
            if pick in before:
                waiting[j] -= 1
    return order


def test_the_scheduler_gives_its_plain_rules_order_on_every_rewrite(monkeypatch):
    """`_schedule` (each instruction's blocks looked up once, the ready list kept in order and
    scanned to the first that does not grow) orders every program the budget plans, recompute,
    moves and sqrt alike, exactly as the rule written plainly does."""
    from runtime.graph import schedule

    fast, seen = schedule._schedule, []

    def checked(program: Any, intermediate: frozenset[int]) -> list[int]:
        order = fast(program, intermediate)
        seen.append(len(program))
        assert order == _reference_schedule(program, intermediate)
        return order

    monkeypatch.setattr(schedule, "_schedule", checked)
    x, y = batch(rows=8, width=16)
    direct = allocators.create("direct", "cpu")  # NOTE: bytes as planned: no size classes
    need = runtime.graph(deep_step(10, 16)[1], allocator=direct)
    need(x, y)
    planned = max(need.timeline())
    least = least_bytes(lambda: deep_step(10, 16)[1], x, y, allocator=direct)
    for budget in ((least + planned) // 2, least):
        runtime.graph(deep_step(10, 16)[1], allocator=direct, memory_budget=budget)(x, y)
    runtime.graph(deep_step(10, 16)[1], checkpoint="sqrt")(x, y)
    assert len(seen) >= 5 and max(seen) > 100


@pytest.mark.parametrize("bytes_per_flop", [1e5, 7.0, 1e-3])
def test_the_recompute_floor_never_changes_the_choice(monkeypatch, bytes_per_flop: float):
    """Where moves compete, a recompute family is skipped when a candidate already costs no
    more than its floor (`_Search.floor`); the choice, at every budget down to the least, is
    the one the full search makes, and the floor is never above a recompute candidate's cost."""
    from runtime.graph import budget as budget_module

    device = separate_memory_device("opencl")
    x, y = batch(rows=8, width=16)
    _, _, reference, _ = unconstrained_on(device, 16, 1)
    need = reference.memory_report()["planned_bytes"]
    search = budget_module._Search
    floor, offer = search.floor, search.offer
    below = []

    def checked_offer(self, recorded, **kwargs):
        fits = offer(self, recorded, **kwargs)
        if fits and kwargs.get("room") is not None and kwargs.get("copied", 0) == 0:
            below.append(floor(self, 0) <= self.found[-1].cost * (1 + 1e-9))
        return fits

    def chosen(pruned: bool, budget: int) -> tuple:
        monkeypatch.setattr(search, "floor", floor if pruned else lambda self, first: -math.inf)
        monkeypatch.setattr(search, "offer", checked_offer)
        graph = runtime.graph(deep_step(16, 16, device=device)[1], device=device,
                              memory_budget=budget)
        graph(x, y)
        report = graph.memory_report()
        return report["schedule"], report["moved"], report["recomputed"], report["planned_bytes"]

    with forced_rates(device, per_byte=bytes_per_flop * 1e-10, per_flop=1e-10,
                      per_element=0.0, per_call=1e-7):
        with pytest.raises(runtime.BudgetError) as refused:
            runtime.graph(deep_step(16, 16, device=device)[1], device=device,
                          memory_budget=1)(x, y)
        least = refused.value.least_bytes
        for budget in sorted({need * 3 // 4, need // 2, need // 4, need // 8, least}):
            if budget >= least:
                assert chosen(True, budget) == chosen(False, budget)
    assert below and all(below)


def _parts_estimate(parts, sizes, besides, reach, room):
    """Whether `parts` fit `room` by `_segments`' estimate (exact bytes), and their work."""
    kept_before = 0.0
    for first, count in parts:
        end = first + count
        live = float(sum(sizes[first:end])) + float(max(besides[first:end]))
        if kept_before + live > room:
            return False
        kept_before += float(sizes[end - 1]) + sum(
            float(sizes[i]) for i in range(first, end - 1) if reach[i] >= end)
    return True


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_parts_by_bytes_and_work_are_the_least_work_that_fits(data):
    # `_segments` (the parts family's programme) against every way of cutting a few units:
    # its parts cover the units in order, fit by its own estimate, and cost no more work
    # than any cut that fits with a bin of room to spare per part (it rounds kept bytes up
    # to bins of room / _SEGMENT_BINS)
    n = data.draw(st.integers(1, 7), label="units")
    sizes = np.array(data.draw(st.lists(st.integers(1, 100), min_size=n, max_size=n)), float)
    work = np.array(data.draw(st.lists(st.integers(0, 50), min_size=n, max_size=n)), float)
    besides = np.array(data.draw(st.lists(st.integers(0, 60), min_size=n, max_size=n)), float)
    reach = [max(i, data.draw(st.integers(i, n - 1))) if data.draw(st.booleans()) else i
             for i in range(n)]
    room = float(data.draw(st.integers(50, 600), label="room"))
    found = _segments(sizes, work, besides, reach, room)
    cuts = []
    for mask in range(2 ** (n - 1)):
        ends = [i + 1 for i in range(n - 1) if mask >> i & 1] + [n]
        parts, first = [], 0
        for end in ends:
            parts.append((first, end - first))
            first = end
        cuts.append(parts)

    def cost(parts):
        return sum(float(work[first:first + count - 1].sum()) for first, count in parts)

    slack = room / _SEGMENT_BINS
    easy = [p for p in cuts if _parts_estimate(p, sizes, besides, reach, room - n * slack)]
    if found is None:
        assert not easy
        return
    found = [tuple(p) for p in found]
    assert [first for first, _ in found] == [sum(c for _, c in found[:k])
                                             for k in range(len(found))]
    assert sum(c for _, c in found) == n
    assert _parts_estimate(found, sizes, besides, reach, room)
    if easy:
        assert cost(found) <= min(cost(p) for p in easy)
