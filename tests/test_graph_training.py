"""Random training programs (a forward pass, a loss, backward, an optimizer step) replayed by a
graph equal eager training under every plan, with and without checkpointing and fusion (issue
16, part 8; before, recomputation was covered by fixed examples only). Also: `Tensor._fresh`,
the fast constructor of the hot paths, sets every field `Tensor.__init__` sets.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import runtime
from runtime import nn
from runtime.graph import CHECKPOINTS, PLANS

ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}
OPTIMIZERS = {
    "sgd": lambda ps: nn.SGD(ps, lr=0.1),
    "momentum": lambda ps: nn.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3, dampening=0.1),
    "nesterov": lambda ps: nn.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda ps: nn.Adam(ps, lr=1e-2, weight_decay=1e-3),
}


@st.composite
def training_programs(draw: Any) -> dict[str, Any]:
    depth = draw(st.integers(1, 5), label="layers")
    return {
        "widths": [draw(st.integers(1, 8)) for _ in range(depth + 1)],
        "activation": draw(st.sampled_from(sorted(ACTIVATIONS))),
        "optimizer": draw(st.sampled_from(sorted(OPTIMIZERS))),
        "loss": draw(st.sampled_from(["cross_entropy", "mse"])),
        "rows": draw(st.integers(1, 5)),
        "steps": draw(st.integers(1, 3)),
        "seed": draw(st.integers(0, 2**16)),
    }


def build(program: dict[str, Any]) -> tuple[nn.Module, nn.Optimizer, Any]:
    """The model, its optimizer and its training step for `program`."""
    nn.manual_seed(program["seed"])
    widths = program["widths"]
    modules: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        modules += [nn.Dense(a, b), ACTIVATIONS[program["activation"]]()]
    model = nn.Sequential(*modules[:-1])
    opt = OPTIMIZERS[program["optimizer"]](model.parameters())
    loss = nn.softmax_cross_entropy if program["loss"] == "cross_entropy" else nn.mse
    return model, opt, nn.train_step(model, opt, loss=loss)


def data(program: dict[str, Any]) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(program["seed"])
    rows, features, outputs = program["rows"], program["widths"][0], program["widths"][-1]
    made = []
    for _ in range(program["steps"]):
        x = rng.normal(size=(rows, features)).astype(np.float32)
        if program["loss"] == "cross_entropy":
            target = rng.integers(0, outputs, rows)
        else:
            target = rng.normal(size=(rows, outputs)).astype(np.float32)
        made.append((x, target))
    return made


@settings(max_examples=150, deadline=None)
@given(program=training_programs(), plan=st.sampled_from(PLANS),
       checkpoint=st.sampled_from(CHECKPOINTS), fuse=st.booleans())
def test_random_training_programs_replay_as_eager_under_every_plan_and_checkpointing(
        program, plan, checkpoint, fuse):
    batches = data(program)
    model, _, step = build(program)
    eager = [step(runtime.tensor(x), runtime.tensor(t)).item() for x, t in batches]
    replayed_model, _, replayed = build(program)
    graph = runtime.graph(replayed, plan=plan, checkpoint=checkpoint, fuse=fuse)
    got = [graph(x, t).item() for x, t in batches]
    np.testing.assert_allclose(got, eager, rtol=1e-5, atol=1e-7)
    for mine, theirs in zip(replayed_model.parameters(), model.parameters()):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(program=training_programs(), checkpoint=st.sampled_from(CHECKPOINTS))
def test_recycle_never_plans_more_than_static_on_a_training_step(program, checkpoint):
    # recycle takes the tail's arena at the commit point, apart from the buffers still live
    # then; where that would hold more than the static arena it takes the static placement
    # (runtime/graph/memory.py, `_recycle_or_one_arena`)
    x, t = data(program)[0]
    tops = {}
    for plan in ("recycle", "static"):
        graph = runtime.graph(build(program)[2], plan=plan, checkpoint=checkpoint)
        graph(x, t)
        tops[plan] = max(graph.timeline(), default=0)
    assert tops["recycle"] <= tops["static"]


def test_fresh_sets_every_field_init_sets():
    allocator = runtime.get_default_allocator("cpu")
    shape, dtype = (3, 2), np.dtype(np.float32)
    made = runtime.Tensor(runtime.Block(24, allocator), shape, dtype)
    fresh = runtime.Tensor._fresh(shape, dtype, allocator)
    slots = [name for cls in type(made).__mro__ for name in getattr(cls, "__slots__", ())
             if name != "__weakref__"]
    assert slots
    for name in slots:
        assert hasattr(made, name) == hasattr(fresh, name), f"_fresh and __init__ differ on {name}"
    for name in ("shape", "dtype", "strides", "offset", "_requires_grad", "_node", "grad",
                 "name"):
        assert getattr(made, name) == getattr(fresh, name), name
    # NOTE: _layout, _span, _self_overlap and _native are caches: what they cache must agree
    assert fresh.layout() == made.layout() and fresh.byte_span() == made.byte_span()
    runtime.ops.copy(runtime.tensor(np.ones(shape, dtype)), out=fresh)
    np.testing.assert_array_equal(fresh.numpy(), np.ones(shape, dtype))
