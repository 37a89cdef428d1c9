"""Memory limits: a graph plan that cannot fit under a LimitAdaptor fails when it is planned.

The refusal comes at the first call, after the capture and before any kernel runs; it names the
bytes the plan needs and the bytes the allocator has left, leaves the parameters as they were,
and the same model then trains with a smaller batch.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import allocators
import runtime
from allocators import LimitAdaptor, OutOfMemoryError
from runtime import nn

RNG = np.random.default_rng(3)


def batch(n: int) -> tuple[np.ndarray, np.ndarray]:
    return RNG.standard_normal((n, 16)).astype(np.float32), RNG.integers(0, 4, n)


def model_on(allocator: allocators.Allocator):
    nn.manual_seed(0)
    model = nn.Sequential(nn.Dense(16, 64, allocator=allocator), nn.ReLU(),
                          nn.Dense(64, 4, allocator=allocator))
    return model, nn.Adam(model.parameters(), lr=1e-2)


UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def parse_bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * UNITS[unit]


def needs(plan: str, x: np.ndarray, y: np.ndarray) -> tuple[int, int]:
    """(bytes the model and inputs take, bytes the plan needs on top) without a limit."""
    unlimited = LimitAdaptor(allocators.create("direct", "cpu"), 2**40)
    model, opt = model_on(unlimited)
    base = unlimited.stats()["allocated_bytes"]
    step = runtime.graph(nn.train_step(model, opt), plan=plan, allocator=unlimited)
    step(x, y)
    report = step.memory_report()
    peak = max(step.timeline())
    assert peak <= report["naive_bytes"]
    return base, unlimited.stats()["peak_allocated_bytes"] - base


@pytest.mark.parametrize("plan", ["static", "recycle", "none"])
def test_a_plan_that_cannot_fit_fails_when_planned(plan: str) -> None:
    x, y = batch(256)
    base, extra = needs(plan, x, y)
    limited = LimitAdaptor(allocators.create("direct", "cpu"), base + extra // 2)
    model, opt = model_on(limited)
    before = {name: p.numpy().copy() for name, p in model.named_parameters()}
    step = runtime.graph(nn.train_step(model, opt), plan=plan, allocator=limited)
    with pytest.raises(OutOfMemoryError) as caught:
        step(x, y)
    message = str(caught.value)
    assert f"the {plan} plan of step needs" in message and "nothing has run" in message
    found = re.search(r"needs (.+?) \(.*has (.+?) available", message)
    assert found, message
    needed, available = parse_bytes(found.group(1)), parse_bytes(found.group(2))
    assert available < needed, message
    # NOTE: `extra` also counts the graph's input buffers, which the check leaves out
    assert 0.75 * extra <= needed <= 1.01 * extra, (needed, extra)
    assert limited.stats()["limit_refusals"] == 0, "the plan was refused by asking for memory"
    for name, p in model.named_parameters():
        assert np.array_equal(before[name], p.numpy()), f"{name} was touched"
    # the same model and optimizer train with a batch that fits, as they would without a limit
    small_x, small_y = x[:16], y[:16]
    reference, reference_opt = model_on(allocators.create("direct", "cpu"))
    expected = runtime.graph(nn.train_step(reference, reference_opt), plan=plan)
    for _ in range(3):
        assert step(small_x, small_y).item() == expected(small_x, small_y).item()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert np.array_equal(p.numpy(), q.numpy()), name


@settings(max_examples=10)
@given(n=st.integers(1, 96), slack=st.integers(0, 4096))
def test_the_limit_check_is_exact_enough(n: int, slack: int) -> None:
    """With exactly the bytes a static step needs (plus slack) it runs; one byte per cent less
    than the arena it is refused, with the numbers in the message."""
    x, y = batch(n)
    base, extra = needs("static", x, y)
    fits = LimitAdaptor(allocators.create("direct", "cpu"), base + extra + slack)
    model, opt = model_on(fits)
    step = runtime.graph(nn.train_step(model, opt), plan="static", allocator=fits)
    step(x, y)
    step(x, y)
    tight = LimitAdaptor(allocators.create("direct", "cpu"), base + extra * 99 // 100)
    model, opt = model_on(tight)
    step = runtime.graph(nn.train_step(model, opt), plan="static", allocator=tight)
    with pytest.raises(OutOfMemoryError, match=r"static plan of step needs .* available"):
        step(x, y)
