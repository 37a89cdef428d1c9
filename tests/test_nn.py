"""runtime.nn: layers, losses and optimizers against NumPy references, no allocations in warm
optimizer steps, training that learns, and the error catalogue."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import allocators
import backends
import runtime
from runtime import nn, ops


# ---------------------------------------------------------------------- modules
def test_dense_is_initialised_like_pytorch_linear():
    layer = nn.Dense(100, 30, rng=0)
    w, b = layer.weight.numpy(), layer.bias.numpy()
    assert w.shape == (30, 100) and b.shape == (30,) and w.dtype == np.float32
    bound = 1 / math.sqrt(100)
    assert np.abs(w).max() <= bound and np.abs(b).max() <= bound
    assert np.abs(w).max() > 0.9 * bound  # spread over the whole range
    assert layer.weight.requires_grad and layer.weight.is_leaf
    assert nn.Dense(4, 2, bias=False).bias is None


def test_the_same_seed_gives_the_same_layer():
    nn.manual_seed(3)
    first = nn.Dense(5, 4).weight.numpy()
    nn.manual_seed(3)
    np.testing.assert_array_equal(nn.Dense(5, 4).weight.numpy(), first)
    np.testing.assert_array_equal(nn.Dense(5, 4, rng=7).weight.numpy(),
                                  nn.Dense(5, 4, rng=7).weight.numpy())


def test_dense_computes_x_times_weight_transposed_plus_bias():
    layer = nn.Dense(3, 2, dtype="float64", rng=1)
    x = np.random.default_rng(0).normal(size=(5, 3))
    expected = x @ layer.weight.numpy().T + layer.bias.numpy()
    np.testing.assert_allclose(layer(runtime.tensor(x)).numpy(), expected, rtol=1e-12)


def test_sequential_parameters_names_repr_and_indexing():
    model = nn.Sequential(nn.Dense(4, 8), nn.Tanh(), nn.Dense(8, 3, bias=False), nn.Sigmoid())
    names = [name for name, _ in model.named_parameters()]
    assert names == ["0.weight", "0.bias", "2.weight"]
    assert [p.name for p in model.parameters()] == names
    assert len(model) == 4 and isinstance(model[1], nn.Tanh)
    assert [type(m).__name__ for m in model] == ["Dense", "Tanh", "Dense", "Sigmoid"]
    assert repr(model) == ("Sequential(\n"
                           "  (0): Dense(in_features=4, out_features=8, bias=True)\n"
                           "  (1): Tanh()\n"
                           "  (2): Dense(in_features=8, out_features=3, bias=False)\n"
                           "  (3): Sigmoid()\n)")


def test_a_shared_layer_is_one_set_of_parameters():
    layer = nn.Dense(3, 3)
    assert len(nn.Sequential(layer, nn.ReLU(), layer).parameters()) == 2


def test_zero_grad_drops_every_gradient():
    model = nn.Sequential(nn.Dense(2, 2), nn.ReLU(), nn.Dense(2, 1))
    ops.sum(model(runtime.ones((3, 2)))).backward()
    assert all(p.grad is not None for p in model.parameters())
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_activations_compute_what_they_say():
    x = np.array([[-2.0, -0.5, 0.0, 0.5, 3.0]])
    t = runtime.tensor(x)
    np.testing.assert_allclose(nn.ReLU()(t).numpy(), np.maximum(x, 0))
    np.testing.assert_allclose(nn.Tanh()(t).numpy(), np.tanh(x), rtol=1e-12)
    np.testing.assert_allclose(nn.Sigmoid()(t).numpy(), 1 / (1 + np.exp(-x)), rtol=1e-12)


def test_module_errors_are_clear():
    with pytest.raises(ValueError, match="in_features must be a positive int, got 0"):
        nn.Dense(0, 3)
    with pytest.raises(ValueError, match="out_features"):
        nn.Dense(3, 2.5)
    with pytest.raises(TypeError, match="argument 1 is a ufunc"):
        nn.Sequential(nn.ReLU(), np.tanh)

    class Forgetful(nn.Module):
        def __init__(self):
            self.w = 1

    with pytest.raises(RuntimeError, match="super"):
        Forgetful()
    with pytest.raises(NotImplementedError, match="forward"):
        nn.Module()(1)


# ---------------------------------------------------------------------- losses
def reference_cross_entropy(logits: np.ndarray, labels: np.ndarray) -> float:
    top = logits.max(axis=1, keepdims=True)
    logsumexp = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
    return float(np.mean(logsumexp - logits[np.arange(len(labels)), labels]))


@given(rows=st.integers(1, 6), classes=st.integers(1, 5), scale=st.sampled_from([1.0, 1e3, 1e4]),
       seed=st.integers(0, 100))
@settings(max_examples=20)
def test_softmax_cross_entropy_matches_the_stable_formula(rows, classes, scale, seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(rows, classes)) * scale
    labels = rng.integers(0, classes, size=rows)
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # stable even at 1e4
        got = nn.softmax_cross_entropy(runtime.tensor(logits), labels).item()
    assert math.isfinite(got)
    assert got == pytest.approx(reference_cross_entropy(logits, labels), rel=1e-9, abs=1e-9)


def test_softmax_cross_entropy_takes_labels_as_a_tensor_too():
    logits = runtime.tensor(np.array([[1.0, 2.0], [0.5, -1.0]], np.float32))
    labels = np.array([1, 0])
    assert nn.softmax_cross_entropy(logits, runtime.tensor(labels)).item() == pytest.approx(
        nn.softmax_cross_entropy(logits, labels).item())


def test_cross_entropy_label_errors_name_the_numbers():
    logits = runtime.tensor(np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match=r"label 4 is outside \[0, 4\)"):
        nn.softmax_cross_entropy(logits, np.array([0, 4, 1]))
    with pytest.raises(ValueError, match="label -1"):
        nn.softmax_cross_entropy(logits, np.array([0, -1, 1]))
    with pytest.raises(ValueError, match=r"labels have shape \(2,\), expected \(3,\)"):
        nn.softmax_cross_entropy(logits, np.array([0, 1]))
    with pytest.raises(TypeError, match="integer class indices"):
        nn.softmax_cross_entropy(logits, np.array([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match=r"\(rows, classes\)"):
        nn.softmax_cross_entropy(runtime.tensor(np.zeros(4, np.float32)), np.array([0]))


def test_mse_matches_numpy_and_checks_shapes():
    rng = np.random.default_rng(2)
    p, t = rng.normal(size=(4, 3)), rng.normal(size=(4, 3))
    assert nn.mse(runtime.tensor(p), t).item() == pytest.approx(np.mean((p - t) ** 2))
    assert nn.mse(runtime.tensor(p), runtime.tensor(t)).item() == pytest.approx(
        np.mean((p - t) ** 2))
    with pytest.raises(ValueError, match=r"target has shape \(3,\)"):
        nn.mse(runtime.tensor(p), np.zeros(3))


# ---------------------------------------------------------------------- optimizers
def sgd_reference(p, grads, lr, momentum, weight_decay, dampening, nesterov):
    """torch.optim.SGD's documented update, in NumPy."""
    buf = None
    for g in grads:
        d = g + weight_decay * p
        if momentum:
            buf = d.copy() if buf is None else momentum * buf + (1 - dampening) * d
            d = d + momentum * buf if nesterov else buf
        p = p - lr * d
    return p


def adam_reference(p, grads, lr, betas, eps, weight_decay):
    """torch.optim.Adam's documented update, in NumPy."""
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    for t, g in enumerate(grads, 1):
        g = g + weight_decay * p
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        denom = np.sqrt(v / (1 - betas[1] ** t)) + eps
        p = p - lr / (1 - betas[0] ** t) * m / denom
    return p


def run_optimizer(make, p0, grads):
    p = runtime.tensor(p0, requires_grad=True)
    opt = make([p])
    for g in grads:
        p.grad = runtime.tensor(g)
        opt.step()
    return p.numpy()


@given(momentum=st.sampled_from([0.0, 0.5, 0.9]), weight_decay=st.sampled_from([0.0, 0.01]),
       dampening=st.sampled_from([0.0, 0.3]), nesterov=st.booleans(), seed=st.integers(0, 99))
@settings(max_examples=25)
def test_sgd_follows_pytorchs_update_rule(momentum, weight_decay, dampening, nesterov, seed):
    if nesterov and (momentum == 0 or dampening):
        return
    rng = np.random.default_rng(seed)
    p0 = rng.normal(size=(3, 2))
    grads = [rng.normal(size=(3, 2)) for _ in range(4)]
    got = run_optimizer(lambda ps: nn.SGD(ps, lr=0.1, momentum=momentum, weight_decay=weight_decay,
                                          dampening=dampening, nesterov=nesterov), p0, grads)
    expected = sgd_reference(p0, grads, 0.1, momentum, weight_decay, dampening, nesterov)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


@given(weight_decay=st.sampled_from([0.0, 0.01]), lr=st.sampled_from([1e-3, 0.1]),
       seed=st.integers(0, 99))
@settings(max_examples=15)
def test_adam_follows_pytorchs_update_rule(weight_decay, lr, seed):
    rng = np.random.default_rng(seed)
    p0 = rng.normal(size=(4,))
    grads = [rng.normal(size=(4,)) for _ in range(5)]
    got = run_optimizer(lambda ps: nn.Adam(ps, lr=lr, weight_decay=weight_decay), p0, grads)
    expected = adam_reference(p0, grads, lr, (0.9, 0.999), 1e-8, weight_decay)
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("make", [
    lambda ps: nn.SGD(ps, lr=0.1),
    lambda ps: nn.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4, nesterov=True),
    lambda ps: nn.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1),
    lambda ps: nn.Adam(ps, lr=1e-3, weight_decay=1e-4),
], ids=["sgd", "sgd-nesterov", "sgd-dampening", "adam"])
def test_a_warm_optimizer_step_allocates_nothing_and_updates_in_place(make):
    alloc = allocators.create("caching", "cpu")
    model = nn.Sequential(nn.Dense(8, 16, allocator=alloc), nn.ReLU(),
                          nn.Dense(16, 4, allocator=alloc))
    opt = make(model.parameters())
    x = runtime.tensor(np.ones((5, 8), np.float32), allocator=alloc)
    blocks = [p.block for p in model.parameters()]
    for step in range(3):
        ops.sum(model(x)).backward()
        before = alloc.stats()["num_allocs"]
        versions = [p.version for p in model.parameters()]
        opt.step()
        if step:
            assert alloc.stats()["num_allocs"] == before, "a warm step allocated"
        assert all(p.version > v for p, v in zip(model.parameters(), versions))
        opt.zero_grad()
    assert [p.block for p in model.parameters()] == blocks


def test_optimizer_errors_name_the_value():
    w = runtime.tensor(np.ones(2), requires_grad=True)
    with pytest.raises(ValueError, match=r"lr must lie in \[0.0, inf\), got -0.1"):
        nn.SGD([w], lr=-0.1)
    with pytest.raises(ValueError, match="empty parameter list"):
        nn.SGD([], lr=0.1)
    with pytest.raises(ValueError, match="leaf tensor with requires_grad"):
        nn.SGD([runtime.tensor(np.ones(2))], lr=0.1)
    with pytest.raises(ValueError, match="leaf"):
        nn.Adam([ops.mul(w, 2.0)])
    with pytest.raises(TypeError, match="takes Tensors"):
        nn.Adam([np.ones(2)])
    with pytest.raises(ValueError, match=r"betas\[1\] must lie in \[0.0, 1.0\), got 1.0"):
        nn.Adam([w], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match=r"eps must lie in \(0.0"):
        nn.Adam([w], eps=0)
    with pytest.raises(ValueError, match="Nesterov"):
        nn.SGD([w], lr=0.1, nesterov=True)
    with pytest.raises(TypeError, match="lr must be a number"):
        nn.SGD([w], lr="fast")
    assert repr(nn.SGD([w, w], lr=0.5, momentum=0.9)) == (
        "SGD(lr=0.5, momentum=0.9, weight_decay=0.0, 1 parameters)")


@pytest.mark.parametrize("kind", ["cpu", "opencl"])
@given(dtype=st.sampled_from(["float32", "float64"]), lr=st.sampled_from([0.1, 1e-3, 0.37]),
       seed=st.integers(0, 2**16), missing=st.integers(0, 3))
@settings(max_examples=20, deadline=None)
def test_the_plain_sgd_step_gives_the_bits_of_the_general_path(kind, dtype, lr, seed, missing):
    """SGD without momentum or weight decay updates in one loop (`SGD._step`); it must give the
    bits of the general path (`Optimizer._step` through `_update`): p - (g * lr), rounded
    twice, as NumPy computes it, on every device."""
    if kind not in backends.available():
        pytest.skip(f"no {kind} device here")
    device = backends.get_device(kind)
    rng = np.random.default_rng(seed)
    shapes = [(3, 5), (5,), (3, 5), (1,)]
    start = [rng.normal(size=s).astype(dtype) for s in shapes]
    steps = [[rng.normal(size=s).astype(dtype) for s in shapes] for _ in range(3)]
    calls = []

    def train(plain: bool) -> tuple[list[np.ndarray], list[int]]:
        params = [runtime.tensor(x, requires_grad=True, device=device) for x in start]
        opt = nn.SGD(params, lr=lr)
        for grads in steps:
            for i, (p, g) in enumerate(zip(params, grads)):
                p.grad = None if i == missing else runtime.tensor(g, device=device)
            versions = [p.version for p in params]
            opt.step() if plain else nn.Optimizer._step(opt, None)
            assert [p.version > v for p, v in zip(params, versions)] == [
                i != missing for i in range(len(params))]
        return [p.numpy() for p in params], [p.version for p in params]

    general = nn.SGD._update
    nn.SGD._update = lambda self, *a: (calls.append(1), general(self, *a))[1]
    try:
        plain, plain_versions = train(True)
        assert not calls, "the plain case went through _update"
        general_result, general_versions = train(False)
        assert calls, "the general path did not run _update"
    finally:
        nn.SGD._update = general
    assert plain_versions == general_versions
    expected = [x.copy() for x in start]
    for grads in steps:
        for i, g in enumerate(grads):
            if i != missing:
                expected[i] = expected[i] - g * np.dtype(dtype).type(lr)
    for mine, theirs, numpy in zip(plain, general_result, expected):
        assert mine.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(mine.view(np.uint8), theirs.view(np.uint8))
        np.testing.assert_array_equal(mine.view(np.uint8), numpy.view(np.uint8))


@pytest.mark.parametrize("fuse", [False, True])
def test_a_captured_plain_sgd_step_replays_as_eager(fuse):
    """A capture records the general path's ops (SGD._step leaves the plain loop while a graph
    captures), so the replayed plain SGD step updates as eager does."""
    def build():
        nn.manual_seed(3)
        model = nn.Sequential(nn.Dense(6, 8), nn.Tanh(), nn.Dense(8, 3))
        return model, nn.train_step(model, nn.SGD(model.parameters(), lr=0.2))

    rng = np.random.default_rng(5)
    batches = [(rng.normal(size=(4, 6)).astype(np.float32), rng.integers(0, 3, 4))
               for _ in range(3)]
    model, step = build()
    eager = [step(runtime.tensor(x), t).item() for x, t in batches]
    replayed_model, replayed = build()
    graph = runtime.graph(replayed, fuse=fuse)
    got = [graph(x, t).item() for x, t in batches]
    np.testing.assert_allclose(got, eager, rtol=1e-6)
    untrained = build()[0].parameters()
    for mine, theirs, first in zip(replayed_model.parameters(), model.parameters(), untrained):
        assert not np.array_equal(mine.numpy(), first.numpy()), "the replay did not update"
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-6, atol=1e-7)


def test_a_parameter_without_gradient_is_left_alone():
    a = runtime.tensor(np.ones(2), requires_grad=True)
    b = runtime.tensor(np.ones(2), requires_grad=True)
    opt = nn.SGD([a, b], lr=1.0)
    ops.sum(a).backward()
    opt.step()
    np.testing.assert_array_equal(a.numpy(), [0.0, 0.0])
    np.testing.assert_array_equal(b.numpy(), [1.0, 1.0])


# ---------------------------------------------------------------------- training
@pytest.mark.parametrize("make", [lambda ps: nn.SGD(ps, lr=0.5, momentum=0.9),
                                  lambda ps: nn.Adam(ps, lr=0.05)], ids=["sgd", "adam"])
def test_training_drives_the_loss_down(make):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 2)).astype(np.float32)
    labels = (x[:, 0] * x[:, 1] > 0).astype(np.int64)  # XOR of the signs: not linear
    model = nn.Sequential(nn.Dense(2, 16, rng=1), nn.Tanh(), nn.Dense(16, 2, rng=2))
    opt = make(model.parameters())
    inputs = runtime.tensor(x)
    losses = []
    for _ in range(150):
        loss = nn.softmax_cross_entropy(model(inputs), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.25 * losses[0]
    with runtime.no_grad():
        predicted = model(inputs).numpy().argmax(axis=1)
    assert np.mean(predicted == labels) > 0.9


def test_regression_with_mse_fits_a_line():
    x = np.linspace(-1, 1, 32).reshape(-1, 1)
    y = 3 * x - 0.5
    layer = nn.Dense(1, 1, dtype="float64", rng=0)
    opt = nn.SGD(layer.parameters(), lr=0.3)
    for _ in range(200):
        loss = nn.mse(layer(runtime.tensor(x)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert layer.weight.item() == pytest.approx(3.0, abs=1e-3)
    assert layer.bias.item() == pytest.approx(-0.5, abs=1e-3)
