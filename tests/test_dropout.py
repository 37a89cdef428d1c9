"""Dropout (issue 30): `ops.dropout`, `ops.Generator` and `nn.Dropout` (inverted dropout, masks
from a seed and a count on the device), and a training step with BatchNorm2d, Dropout and
Embedding captured as a graph: bit for bit the eager steps under the "recycle" and "static"
plans, `checkpoint="sqrt"` and a `memory_budget`, the running statistics, the step count and
the masks included (a recomputed segment neither draws a new mask nor updates a running
statistic twice)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import backends
import runtime
from runtime import nn, ops

KINDS = ["cpu"] + [pytest.param("opencl", marks=pytest.mark.skipif(
    "opencl" not in backends.available(), reason="no OpenCL device (PoCL) here"))]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", ml_dtypes.bfloat16])
def test_inverted_dropout_zeroes_about_p_and_scales_the_rest(kind, dtype):
    dev = backends.get_device(kind)
    x = runtime.tensor(np.ones(20000, dtype), device=dev, requires_grad=True)
    y = ops.dropout(x, 0.3, generator=ops.Generator(3))
    values = y.numpy()
    scale = np.float32(1) / np.float32(0.7) if dtype != "float64" else 1 / 0.7
    assert set(values.tolist()) == {0.0, float(np.array(scale).astype(dtype))}
    kept = (values != 0).mean()
    assert abs(kept - 0.7) < 5 * np.sqrt(0.21 / 20000)
    ops.sum(y).backward()
    assert x.grad.numpy().tobytes() == values.tobytes()  # NOTE: d(x * mask) = mask


def test_the_same_seed_draws_the_same_masks_on_every_device_and_manual_seed_restarts():
    x = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    masks = []
    for kind in ["cpu", *(["opencl"] if "opencl" in backends.available() else [])]:
        dev = backends.get_device(kind)
        generator = ops.Generator(11)
        first = ops.dropout(runtime.tensor(x, device=dev), 0.5, generator=generator).numpy()
        second = ops.dropout(runtime.tensor(x, device=dev), 0.5, generator=generator).numpy()
        assert not np.array_equal(first, second)  # NOTE: each call draws the next mask
        generator.manual_seed(11)
        again = ops.dropout(runtime.tensor(x, device=dev), 0.5, generator=generator).numpy()
        assert again.tobytes() == first.tobytes()
        masks.append(first.tobytes())
    assert len(set(masks)) == 1


def test_evaluation_and_p_zero_are_the_identity_and_p_one_zeroes():
    x = runtime.tensor(np.arange(1.0, 5.0))
    assert ops.dropout(x, 0.5, training=False) is x
    assert ops.dropout(x, 0.0) is x
    out = runtime.zeros(4, "float64")
    assert ops.dropout(x, 0.5, training=False, out=out) is out
    assert out.numpy().tolist() == [1, 2, 3, 4]
    assert ops.dropout(x, 1.0).numpy().tolist() == [0, 0, 0, 0]
    layer = nn.Dropout(0.25)
    assert repr(layer) == "Dropout(p=0.25, inplace=False)" and layer.training
    assert layer.eval()(x) is x and layer.train().training
    inplace = nn.Dropout(0.5, True, rng=0)
    y = runtime.tensor(np.ones(8))
    assert inplace(y) is y and set(y.numpy().tolist()) <= {0.0, 2.0}
    with pytest.raises(runtime.AutogradError, match="cannot write into out="):
        inplace(runtime.tensor(np.ones(8), requires_grad=True))


def test_out_may_be_x_itself_and_a_partial_overlap_is_refused_before_a_mask_is_drawn():
    generator = ops.Generator(5)
    x = runtime.tensor(np.ones(6))
    want = ops.dropout(runtime.tensor(np.ones(6)), 0.5, generator=ops.Generator(5)).numpy()
    assert ops.dropout(x, 0.5, generator=generator, out=x) is x
    assert x.numpy().tobytes() == want.tobytes()
    state = generator.state(x).numpy().tolist()
    assert state == [5, 1]
    runtime.set_aliasing("raise")
    with pytest.raises(runtime.AliasingError, match="dropout: the output .* overlaps input x"):
        ops.dropout(x[1:], 0.5, generator=generator, out=x[:5])
    assert generator.state(x).numpy().tolist() == state  # NOTE: nothing drawn


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda x: ops.dropout(x, 1.5), ValueError,
     r"dropout: p \(the probability of zeroing an element\) must lie in \[0.0, 1.0\], got 1.5"),
    (lambda x: ops.dropout(x, -0.1), ValueError, "got -0.1"),
    (lambda x: ops.dropout(x, "half"), TypeError, "must be a number"),
    (lambda x: ops.dropout(x, 0.5, generator=np.random.default_rng()), TypeError,
     "generator must be an ops.Generator"),
    (lambda x: ops.dropout(runtime.tensor(np.ones(2, np.int32)), 0.5), TypeError,
     "computes on float dtypes only"),
    (lambda x: nn.Dropout(2), ValueError, "Dropout: p"),
    (lambda x: ops.Generator(-1), ValueError, r"seed must lie in \[0, 2\*\*63\)"),
])
def test_bad_arguments_are_named(call, error, message):
    with pytest.raises(error, match=message):
        call(runtime.tensor(np.ones(3)))


# ---------------------------------------------------------------------- training steps
class Net(nn.Module):
    """Embedding -> Dense -> BatchNorm2d (a Dense layer's output seen as 2 channels of 2x2)
    -> ReLU -> Dropout -> Dense -> BatchNorm1d -> Dropout -> Dense."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 3)
        self.dense = nn.Dense(12, 8)
        self.norm = nn.BatchNorm2d(2)
        self.drop = nn.Dropout(0.3)
        self.middle = nn.Dense(8, 6)
        self.norm1 = nn.BatchNorm1d(6, momentum=0.2)
        self.drop1 = nn.Dropout(0.5)
        self.head = nn.Dense(6, 3)

    def forward(self, indices):
        h = self.embed(indices)                      # (batch, 4, 3)
        h = self.dense(h.reshape(h.shape[0], 12))    # (batch, 8)
        h = self.norm(h.reshape(h.shape[0], 2, 2, 2)).reshape(h.shape[0], 8)
        h = self.drop(ops.relu(h))
        h = self.drop1(ops.relu(self.norm1(self.middle(h))))
        return self.head(h)


def _model(seed: int) -> tuple[Net, object]:
    nn.manual_seed(seed)
    model = Net()
    return model, nn.train_step(model, nn.Adam(model.parameters(), lr=0.05))


def _state(model: Net) -> dict[str, bytes]:
    state = {name: t.numpy().tobytes() for name, t in model.state_dict().items()}
    for name in ("drop", "drop1"):
        generator = getattr(model, name).generator
        state[name] = b"".join(s.numpy().tobytes() for s in generator._states.values())
    return state


def _batches(steps: int = 4) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(9)
    return [(rng.integers(0, 7, (6, 4)), rng.integers(0, 3, 6)) for _ in range(steps)]


@pytest.mark.parametrize("options", [
    dict(plan="recycle"), dict(plan="static"), dict(plan="static", fuse=False),
    dict(plan="static", checkpoint="sqrt"), dict(plan="recycle", checkpoint="sqrt"),
    dict(plan="static", memory_budget="least"), dict(plan="recycle", memory_budget="least"),
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_a_captured_training_step_equals_eager_bit_for_bit(options):
    eager_model, eager = _model(4)
    losses = [eager(runtime.tensor(x), runtime.tensor(y)).numpy().tobytes()
              for x, y in _batches()]
    model, step = _model(4)
    if options.get("memory_budget") == "least":
        try:
            runtime.graph(_model(4)[1], memory_budget=1, plan=options["plan"])(*_batches()[0])
        except runtime.BudgetError as error:
            options = {**options, "memory_budget": error.least_bytes}
    graph = runtime.graph(step, **options)
    got = [graph(x, y).numpy().tobytes() for x, y in _batches()]
    assert got == losses
    assert _state(model) == _state(eager_model)
    assert model.norm.num_batches_tracked.item() == 4
    assert model.drop.generator.state(model.dense.weight).numpy()[1] == 4
    report = graph.memory_report()
    if "checkpoint" in options or "memory_budget" in options:  # NOTE: something was rewritten
        assert report["recomputed"] + report["moved"] > 0, report


def test_in_evaluation_a_captured_step_draws_nothing_and_reads_the_running_statistics():
    model, _ = _model(2)
    for x, _ in _batches(2):
        model(runtime.tensor(x))
    model.eval()
    before = _state(model)
    forward = runtime.graph(lambda x: model(x), plan="static")
    outputs = [forward(x).numpy().tobytes() for x, _ in _batches(3)]
    assert _state(model) == before
    assert outputs == [model(runtime.tensor(x)).numpy().tobytes() for x, _ in _batches(3)]


@pytest.mark.skipif("opencl" not in backends.available(), reason="no OpenCL device (PoCL) here")
@pytest.mark.parametrize("options", [dict(plan="static", checkpoint="sqrt"),
                                     dict(plan="static", memory_budget="least")],
                         ids=["static-sqrt", "static-budget"])
def test_on_opencl_a_captured_training_step_equals_eager_bit_for_bit(options):
    """On OpenCL a budget may also move results to host memory and back (PoCL's memory is
    not the runtime's host memory): masks and statistics come through as on the CPU."""
    previous = runtime.get_default_device()
    runtime.set_default_device("opencl")
    try:
        test_a_captured_training_step_equals_eager_bit_for_bit(options)
    finally:
        runtime.set_default_device(previous)


def test_mixed_precision_trains_the_layers_and_a_graph_replays_it_bit_for_bit():
    """Under `precision="float16"` the Dense layers compute in float16: BatchNorm normalises
    their half outputs in float32 with float32 statistics, dropout's masks are float16."""
    def build():
        model, _ = _model(6)
        return model, nn.train_step(model, nn.Adam(model.parameters(), lr=0.01),
                                    precision="float16")

    eager_model, eager = build()
    want = [eager(runtime.tensor(x), runtime.tensor(y)).numpy().tobytes() for x, y in _batches()]
    model, step = build()
    graph = runtime.graph(step, plan="static", checkpoint="sqrt")
    assert [graph(x, y).numpy().tobytes() for x, y in _batches()] == want
    assert _state(model) == _state(eager_model)
    assert model.norm.running_mean.dtype == np.float32
    assert all(np.isfinite(t.numpy().astype(np.float64)).all()
               for t in model.state_dict().values())
