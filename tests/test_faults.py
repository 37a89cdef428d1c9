"""Training under injected allocation faults: a failed step changes nothing, the next one works.

Every allocation of a training run goes through a `FaultInjectionAdaptor` (probability 0.05,
seeded by hypothesis) over a caching allocator, on each CPU backend, for eager training and for
every graph plan. Each step that fails must raise OutOfMemoryError and leave the parameters, their
gradients and the optimizer state bit for bit as they were; the step after a failure runs with the
faults off and must succeed; the run must end with exactly the parameters of a run without faults;
and once the model is gone no byte is left allocated. The rule under test is
Note [the commit point] in runtime/nn.py.
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import allocators
import backends
import runtime
from allocators import FaultInjectionAdaptor, OutOfMemoryError
from runtime import nn
from runtime._tensor import Tensor

DEVICES = [pytest.param(kind, marks=pytest.mark.skipif(
    kind not in backends.available(), reason=f"backend {kind!r} is not available here"))
    for kind in ("cpu", "opencl")]
MODES = ("eager", "none", "recycle", "static")
OPTIMIZERS = {
    "sgd": lambda params: nn.SGD(params, lr=0.05, momentum=0.9, dampening=0.1,
                                 weight_decay=1e-3),
    "adam": lambda params: nn.Adam(params, lr=1e-2),
    # NOTE: plain SGD: under a graph each update is one accumulating gemm into the weight
    "plain": lambda params: nn.SGD(params, lr=0.05),
}
STEPS = 6
RNG = np.random.default_rng(7)
X = RNG.standard_normal((8, 6)).astype(np.float32)
Y = RNG.integers(0, 3, 8)


def build(kind: str, allocator: allocators.Allocator, optimizer: str, mode: str):
    nn.manual_seed(0)
    device = backends.get_device(kind)
    model = nn.Sequential(nn.Dense(6, 12, device=device, allocator=allocator), nn.ReLU(),
                          nn.Dense(12, 3, device=device, allocator=allocator))
    opt = OPTIMIZERS[optimizer](model.parameters())
    inner = nn.train_step(model, opt)
    if mode != "eager":
        return model, opt, runtime.graph(inner, plan=mode, device=device, allocator=allocator)

    def step(x: np.ndarray, y: np.ndarray) -> Tensor:
        return inner(runtime.tensor(x, device=device, allocator=allocator), y)

    return model, opt, step


def snapshot(model: nn.Module, opt: nn.Optimizer) -> dict[str, Any]:
    """Host copies of everything a step may change: parameters, gradients, optimizer state
    (per-parameter tensors and the optimizer's own tensors, e.g. Adam's bias corrections)."""
    found: dict[str, Any] = {}

    def add(name: str, t: Any) -> None:
        if isinstance(t, Tensor):
            found[name] = t.numpy().copy() if t.block.written else "unwritten"
        elif isinstance(t, (tuple, list)):
            for i, item in enumerate(t):
                add(f"{name}[{i}]", item)
        elif isinstance(t, str):
            found[name] = t

    for name, p in model.named_parameters():
        add(name, p)
        add(name + ".grad", "None" if p.grad is None else p.grad)
        for key, value in opt.state[id(p)].items():
            add(f"{name}.{key}", value)
    for key, value in vars(opt).items():
        if key not in ("params", "state", "_scratch_pool"):
            add(f"opt.{key}", value)
    return found


def assert_same(before: dict[str, Any], after: dict[str, Any], where: str) -> None:
    assert before.keys() <= after.keys(), f"{where}: {before.keys() - after.keys()} vanished"
    for name, value in before.items():
        if isinstance(value, str):  # "None" must stay None; "unwritten" has no value to keep
            assert value == "unwritten" or after[name] == value, f"{where}: {name} was set"
            continue
        assert np.array_equal(value, after[name]), f"{where}: {name} changed in a failed step"


def train(kind: str, optimizer: str, mode: str, probability: float, seed: int):
    base = allocators.create("caching", kind)
    flaky = FaultInjectionAdaptor(base, 0.0, seed)
    model, opt, step = build(kind, flaky, optimizer, mode)
    flaky.probability = probability
    done = failures = 0
    while done < STEPS:
        assert failures < 20 * STEPS, f"{failures} failures for {done} steps"
        before = snapshot(model, opt)
        try:
            step(X, Y)
        except OutOfMemoryError as error:
            assert "injected" in str(error)
            failures += 1
            assert_same(before, snapshot(model, opt), f"{mode} failure {failures}")
            flaky.probability = 0.0  # the next step runs without faults and must succeed
            step(X, Y)
            flaky.probability = probability
        done += 1
    final = {name: p.numpy().copy() for name, p in model.named_parameters()}
    flaky.probability = 0.0
    del model, opt, step
    gc.collect()
    return final, failures, flaky, base


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", DEVICES)
# NOTE: two seeded runs per combination (each trains twice); more in soak mode (docs/testing.md)
@settings(max_examples=2)
@given(seed=st.integers(0, 2**32 - 1))
def test_failed_steps_change_nothing(kind: str, mode: str, optimizer: str, seed: int) -> None:
    reference, none_failed, _, _ = train(kind, optimizer, mode, 0.0, seed)
    assert none_failed == 0
    final, failures, flaky, base = train(kind, optimizer, mode, 0.05, seed)
    assert failures == flaky.injected_faults
    for name, value in reference.items():
        assert np.array_equal(value, final[name]), f"{name} differs from the run without faults"
    assert flaky.stats()["allocated_bytes"] == 0, "a block leaked through the faulty allocator"
    assert base.stats()["allocated_bytes"] == 0, "a block leaked in the upstream allocator"
    base.check_invariants()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", DEVICES)
def test_faults_do_happen(kind: str, mode: str) -> None:
    """The property above is not vacuous: over a few seeds, steps do fail (for the static plan
    only its first call allocates, so it is the one most seeds leave alone)."""
    total = sum(train(kind, "adam", mode, 0.05, seed)[1] for seed in range(6))
    assert total > 0


@pytest.mark.parametrize("kind", DEVICES)
def test_every_allocation_failing_leaves_a_trained_model_untouched(kind: str) -> None:
    """Warm graphs of each plan and an eager step, with every allocation refused: a warm static
    replay needs no allocation and succeeds; the others fail and change nothing."""
    for mode in MODES:
        base = allocators.create("caching", kind)
        flaky = FaultInjectionAdaptor(base, 0.0)
        model, opt, step = build(kind, flaky, "adam", mode)
        step(X, Y)
        flaky.probability = 1.0
        before = snapshot(model, opt)
        if mode == "static":
            step(X, Y)
            assert flaky.injected_faults == 0
            continue
        with pytest.raises(OutOfMemoryError, match="injected"):
            step(X, Y)
        assert_same(before, snapshot(model, opt), mode)
        flaky.probability = 0.0
        step(X, Y)
