"""Memory budgets (issue 19): `runtime.graph(step, memory_budget=N)` keeps or recomputes each
forward result the backward pass reads so that the intermediates fit in N bytes, checked by the
allocator's own peak; results equal the unconstrained graph's bit for bit on the CPU; a budget
below the least any choice reaches is refused when planned; under a LimitAdaptor the limit is
the budget by default."""

from __future__ import annotations

import re
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_graph_training import build, data, training_programs

import allocators
import backends
import runtime
from allocators import LimitAdaptor, OutOfMemoryError, StatisticsAdaptor
from runtime import BudgetError, nn
from runtime.graph.budget import _sweep, _table


def deep_step(depth: int = 12, width: int = 32, seed: int = 0) -> tuple[nn.Module, Any]:
    """A deep narrow MLP's SGD training step (config D in miniature)."""
    rng = np.random.default_rng(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Dense(width, width, rng=rng), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Dense(width, 10, rng=rng))
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


def least_bytes(make_step: Any, *args: Any, plan: str = "static") -> int:
    """The least peak any choice reaches, as the refusal of a budget of 0 names it."""
    with pytest.raises(BudgetError) as caught:
        runtime.graph(make_step(), plan=plan, memory_budget=0)(*args)
    return caught.value.least_bytes


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


@pytest.mark.parametrize("plan", ["static", "recycle"])
def test_a_budget_is_met_by_the_allocators_own_peak_and_results_are_bit_exact(plan: str):
    x, y = batch()
    reference_model, reference_step = deep_step()
    reference = runtime.graph(reference_step, plan=plan)
    losses = [reference(x, y).item() for _ in range(3)]
    full = reference.memory_report()
    least = least_bytes(lambda: deep_step()[1], x, y, plan=plan)
    unconstrained = max(reference.timeline())
    assert least < unconstrained / 2
    for budget in (least, (least + unconstrained) // 2, unconstrained - 1):
        stats = StatisticsAdaptor(allocators.create("direct", "cpu"))
        model, step = deep_step()
        graph = runtime.graph(step, plan=plan, allocator=stats, memory_budget=budget)
        got = []
        for _ in range(3):
            got.append(graph(x, y).item())
            # NOTE: the graph's allocator holds its inputs, its outputs and the plan's memory
            assert stats.stats()["peak_allocated_bytes"] - not_planned(graph, stats) <= budget
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
    peak = full.memory_report()["planned_bytes"]
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
       fuse=st.booleans(), where=st.floats(0, 1))
def test_random_programs_under_random_budgets_equal_the_unconstrained_graph_bit_for_bit(
        program, plan, fuse, where):
    batches = data(program)
    reference_model, reference_step = build(program)
    reference = runtime.graph(reference_step, plan=plan, fuse=fuse)
    expected = [reference(x, t).item() for x, t in batches]
    unconstrained = max(reference.timeline())
    with pytest.raises(BudgetError) as caught:
        runtime.graph(build(program)[1], plan=plan, fuse=fuse, memory_budget=0)(*batches[0])
    least = caught.value.least_bytes
    assert least <= unconstrained
    budget = least + int(where * (unconstrained - least))
    stats = StatisticsAdaptor(allocators.create("direct", "cpu"))
    model, step = build(program)
    graph = runtime.graph(step, plan=plan, fuse=fuse, allocator=stats, memory_budget=budget)
    got = []
    for x, t in batches:
        got.append(graph(x, t).item())
        assert stats.stats()["peak_allocated_bytes"] - not_planned(graph, stats) <= budget
    assert got == expected
    for mine, theirs in zip(model.parameters(), reference_model.parameters()):
        assert np.array_equal(mine.numpy(), theirs.numpy())


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


@pytest.mark.parametrize("kind", sorted(NEEDS))
def test_moves_to_host_memory_fit_the_budget_bit_for_bit(kind: str):
    """On a device whose memory is not the host's the budget first moves forward results to
    host memory and back (on PoCL the device's memory is in fact host memory: the path runs
    for correctness); results equal the unconstrained graph's bit for bit."""
    device = separate_memory_device(kind)
    assert not device.host_memory and backends.get_device("cpu").host_memory
    x, y = batch(rows=8, width=16)

    def on_device(seed: int = 0) -> tuple[nn.Module, Any]:
        rng = np.random.default_rng(seed)
        layers: list[nn.Module] = []
        for _ in range(8):
            layers += [nn.Dense(16, 16, rng=rng, device=device), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Dense(16, 10, rng=rng, device=device))
        return model, nn.train_step(model, nn.SGD(model.parameters(), lr=0.05))

    reference_model, reference_step = on_device()
    reference = runtime.graph(reference_step, device=device)
    expected = [reference(x, y).item() for _ in range(3)]
    need = reference.memory_report()["planned_bytes"]
    for budget in (need * 8 // 10, need // 2, need // 3):
        stats = StatisticsAdaptor(allocators.create("direct", device))
        model, step = on_device()
        graph = runtime.graph(step, device=device, allocator=stats, memory_budget=budget)
        got = []
        for _ in range(3):
            got.append(graph(x, y).item())
            assert stats.stats()["peak_allocated_bytes"] - not_planned(graph, stats) <= budget
        assert got == expected
        for mine, theirs in zip(model.parameters(), reference_model.parameters()):
            assert np.array_equal(mine.numpy(), theirs.numpy())
        report = graph.memory_report()
        assert report["moved"] > 0 and report["recomputed"] == 0
        assert report["moved_bytes"] > 0 and "moved to host memory" in report["moves"]
        assert report["kept"] + report["moved"] == reference.memory_report()["kept"]
