"""Batch normalisation (issue 30): `ops.batch_norm` and `nn.BatchNorm1d` / `nn.BatchNorm2d`
against PyTorch's CPU (forward, every gradient, the running statistics and the step count),
in float32 and float64 (the two-byte floats within their rounding), on the CPU and on OpenCL
where it is here; finite differences in float64; `out=` and refused overlaps; bad arguments
named. The running statistics under a captured graph, checkpointing and a memory budget are
in tests/test_dropout.py's training-step tests, with the dropout masks."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import backends
import runtime
from runtime import nn, ops

torch = pytest.importorskip("torch", reason="PyTorch (CPU) is the reference here")

KINDS = ["cpu"] + [pytest.param("opencl", marks=pytest.mark.skipif(
    "opencl" not in backends.available(), reason="no OpenCL device (PoCL) here"))]
BF16 = np.dtype(ml_dtypes.bfloat16)


def _torch(a: np.ndarray, grad: bool = False) -> torch.Tensor:
    return torch.tensor(a, requires_grad=grad)


def _case(shape: tuple[int, ...], dtype: str, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    channels = shape[1]
    return {"x": (rng.standard_normal(shape) * 3 + 1).astype(dtype),
            "weight": rng.uniform(0.5, 1.5, channels).astype(dtype),
            "bias": rng.standard_normal(channels).astype(dtype),
            "mean": rng.standard_normal(channels).astype(dtype),
            "var": rng.uniform(0.5, 2.0, channels).astype(dtype),
            "g": rng.standard_normal(shape).astype(dtype)}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", [(4, 3, 2, 5), (6, 4), (3, 2, 7)])
@pytest.mark.parametrize("training", [True, False])
def test_forward_gradients_and_running_statistics_match_pytorch(kind, dtype, shape, training):
    case = _case(shape, dtype)
    dev = backends.get_device(kind)
    x, w, b = (runtime.tensor(case[k], device=dev, requires_grad=True)
               for k in ("x", "weight", "bias"))
    mean, var = (runtime.tensor(case[k], device=dev) for k in ("mean", "var"))
    y = ops.batch_norm(x, mean, var, w, b, training=training, momentum=0.3, eps=1e-3)
    y.backward(runtime.tensor(case["g"], device=dev))
    tx, tw, tb = (_torch(case[k], True) for k in ("x", "weight", "bias"))
    tmean, tvar = _torch(case["mean"]), _torch(case["var"])
    ty = torch.nn.functional.batch_norm(tx, tmean, tvar, tw, tb, training, 0.3, 1e-3)
    ty.backward(_torch(case["g"]))
    tol = {"float32": dict(rtol=2e-5, atol=2e-5), "float64": dict(rtol=1e-12, atol=1e-12)}[dtype]
    np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), **tol)
    for ours, theirs in ((x, tx), (w, tw), (b, tb)):
        np.testing.assert_allclose(ours.grad.numpy(), theirs.grad.numpy(), **tol)
    np.testing.assert_allclose(mean.numpy(), tmean.numpy(), **tol)
    np.testing.assert_allclose(var.numpy(), tvar.numpy(), **tol)
    if not training:  # NOTE: evaluation leaves the running statistics as they were
        assert mean.numpy().tobytes() == case["mean"].tobytes()


@pytest.mark.parametrize("dtype", ["float16", BF16])
@pytest.mark.parametrize("kind", KINDS)
def test_two_byte_floats_compute_in_float32_and_round_once(dtype, kind):
    """PyTorch's CPU computes half batch norm in float32 too: results within one rounding of
    the float32 reference (a few units of the last place: its order of sums is its own)."""
    case = _case((5, 3, 2, 2), "float32", seed=3)
    dev = backends.get_device(kind)
    half = {k: v.astype(dtype) for k, v in case.items()}
    x = runtime.tensor(half["x"], device=dev, requires_grad=True)
    w, b = (runtime.tensor(half[k], device=dev, requires_grad=True) for k in ("weight", "bias"))
    mean, var = (runtime.tensor(half[k], device=dev) for k in ("mean", "var"))
    y = ops.batch_norm(x, mean, var, w, b, training=True)
    y.backward(runtime.tensor(half["g"], device=dev))
    assert y.dtype == dtype and x.grad.dtype == dtype and mean.dtype == dtype
    wide = {k: torch.tensor(v.astype(np.float32), requires_grad=k in ("x", "weight", "bias"))
            for k, v in half.items()}
    ty = torch.nn.functional.batch_norm(wide["x"], wide["mean"], wide["var"], wide["weight"],
                                        wide["bias"], True)
    ty.backward(wide["g"])
    eps = float(ml_dtypes.finfo(dtype).eps)
    for ours, theirs in ((y, ty), (x.grad, wide["x"].grad), (w.grad, wide["weight"].grad),
                         (mean, wide["mean"]), (var, wide["var"])):
        want = theirs.detach().numpy()
        got = ours.numpy().astype(np.float32)
        np.testing.assert_allclose(got, want, rtol=2 * eps, atol=4 * eps * np.abs(want).max())


def test_float64_gradients_match_finite_differences():
    rng = np.random.default_rng(5)
    shape = (3, 2, 2, 2)
    x0, w0, b0 = rng.standard_normal(shape), rng.uniform(0.5, 2, 2), rng.standard_normal(2)
    r = rng.standard_normal(shape)

    def loss(x, w, b):
        y = ops.batch_norm(runtime.tensor(x), None, None, runtime.tensor(w),
                           runtime.tensor(b), training=True)
        return float((y.numpy() * r).sum())

    x, w, b = (runtime.tensor(a, requires_grad=True) for a in (x0, w0, b0))
    y = ops.batch_norm(x, None, None, w, b, training=True)
    ops.sum(ops.mul(y, runtime.tensor(r))).backward()
    h = 1e-6
    for value, grad, which in ((x0, x.grad, 0), (w0, w.grad, 1), (b0, b.grad, 2)):
        numeric = np.zeros_like(value)
        for index in np.ndindex(value.shape):
            args = [x0.copy(), w0.copy(), b0.copy()]
            args[which][index] += h
            up = loss(*args)
            args[which][index] -= 2 * h
            numeric[index] = (up - loss(*args)) / (2 * h)
        np.testing.assert_allclose(grad.numpy(), numeric, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", KINDS)
def test_the_module_trains_then_evaluates_as_pytorchs(kind):
    dev = backends.get_device(kind)
    case = _case((4, 3, 2, 2), "float32", seed=7)
    ours = nn.BatchNorm2d(3, momentum=0.2, device=dev)
    theirs = torch.nn.BatchNorm2d(3, momentum=0.2)
    for step in range(3):
        x = case["x"] * (step + 1)
        ours(runtime.tensor(x, device=dev))
        theirs(torch.tensor(x))
    assert ours.num_batches_tracked.item() == theirs.num_batches_tracked.item() == 3
    assert ours.num_batches_tracked.dtype == np.int64
    for name in ("running_mean", "running_var"):
        np.testing.assert_allclose(getattr(ours, name).numpy(),
                                   getattr(theirs, name).numpy(), rtol=1e-5)
    assert ours.eval() is ours and not ours.training
    theirs.eval()
    y = ours(runtime.tensor(case["x"], device=dev))
    np.testing.assert_allclose(y.numpy(), theirs(torch.tensor(case["x"])).detach().numpy(),
                               rtol=1e-5, atol=1e-5)
    assert ours.num_batches_tracked.item() == 3  # NOTE: evaluation counts nothing
    assert repr(ours) == ("BatchNorm2d(3, eps=1e-05, momentum=0.2, affine=True, "
                          "track_running_stats=True)")
    assert [n for n, _ in ours.named_parameters()] == ["weight", "bias"]
    assert [n for n, _ in ours.named_buffers()] == ["running_mean", "running_var",
                                                   "num_batches_tracked"]


@pytest.mark.parametrize("kind", KINDS)
def test_momentum_none_is_pytorchs_cumulative_average(kind):
    dev = backends.get_device(kind)
    ours, theirs = nn.BatchNorm2d(2, momentum=None, device=dev), torch.nn.BatchNorm2d(
        2, momentum=None)
    rng = np.random.default_rng(4)
    for _ in range(3):
        x = rng.standard_normal((3, 2, 2, 2)).astype(np.float32) * 2 + 1
        ours(runtime.tensor(x, device=dev))
        theirs(torch.tensor(x))
    for name in ("running_mean", "running_var"):
        np.testing.assert_allclose(getattr(ours, name).numpy(),
                                   getattr(theirs, name).numpy(), rtol=1e-5, atol=1e-6)
    assert ours.num_batches_tracked.item() == 3 and "momentum=None" in repr(ours)
    step = runtime.graph(lambda x: ours(x))  # NOTE: the factor is computed on the device
    for _ in range(2):
        step(runtime.tensor(np.ones((2, 2, 1, 1), np.float32), device=dev))
    assert ours.num_batches_tracked.item() == 5


def test_without_running_statistics_or_affine_the_batch_normalises_in_both_modes():
    x = _case((5, 2), "float64")["x"]
    bn = nn.BatchNorm1d(2, affine=False, track_running_stats=False, dtype="float64")
    assert bn.weight is None and bn.running_mean is None and bn.parameters() == []
    assert list(bn.state_dict()) == []
    want = torch.nn.functional.batch_norm(torch.tensor(x), None, None, training=True).numpy()
    np.testing.assert_allclose(bn(runtime.tensor(x)).numpy(), want, rtol=1e-12)
    np.testing.assert_allclose(bn.eval()(runtime.tensor(x)).numpy(), want, rtol=1e-12)


def test_out_receives_the_result_and_an_overlap_is_refused_before_anything_changes():
    case = _case((4, 2, 3), "float32")
    x = runtime.tensor(case["x"])
    mean, var = runtime.tensor(case["mean"]), runtime.tensor(case["var"])
    want = ops.batch_norm(x, runtime.tensor(case["mean"]), runtime.tensor(case["var"]),
                          training=True).numpy()
    out = runtime.zeros((4, 2, 3))
    assert ops.batch_norm(x, mean, var, training=True, out=out) is out
    np.testing.assert_array_equal(out.numpy(), want)
    runtime.set_aliasing("raise")
    before = [t.numpy().tobytes() for t in (x, mean, var)]
    with pytest.raises(runtime.AliasingError, match="batch_norm: the output .* overlaps input x"):
        ops.batch_norm(x, mean, var, training=True, out=x)
    assert [t.numpy().tobytes() for t in (x, mean, var)] == before
    runtime.set_aliasing("copy")
    ops.batch_norm(x, runtime.tensor(case["mean"]), runtime.tensor(case["var"]), training=True,
                   out=x)  # NOTE: in "copy" mode x itself may take its own result
    np.testing.assert_array_equal(x.numpy(), want)
    grad = runtime.tensor(case["x"], requires_grad=True)
    with pytest.raises(runtime.AutogradError, match="batch_norm: cannot write into out="):
        ops.batch_norm(grad, None, None, training=True, out=runtime.zeros((4, 2, 3)))


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda x, c: ops.batch_norm(x, c(3), c(2), training=True), ValueError,
     r"running_mean has shape \(3,\), expected \(2,\)"),
    (lambda x, c: ops.batch_norm(x[:1, :, :1], None, None, training=True), ValueError,
     r"expected more than 1 value per channel when training, got x of shape \(1, 2, 1\)"),
    (lambda x, c: ops.batch_norm(x, None, None), ValueError,
     r"evaluation \(training=False\) needs running_mean"),
    (lambda x, c: ops.batch_norm(x, c(2), None, training=True), ValueError, "both"),
    (lambda x, c: ops.batch_norm(x, None, None, training=True, momentum=1.5), ValueError,
     r"momentum must lie in \[0.0, 1.0\], got 1.5"),
    (lambda x, c: ops.batch_norm(x, None, None, training=True, eps=-1), ValueError, "eps"),
    (lambda x, c: ops.batch_norm(x, c(2).numpy(), c(2), training=True), TypeError,
     "running_mean must be a Tensor or None"),
    (lambda x, c: ops.batch_norm(x, runtime.zeros(2, "float64"), c(2), training=True),
     TypeError, "running_mean has dtype float64, x float32"),
    (lambda x, c: ops.batch_norm(x[0, 0], None, None), ValueError, "at least 2 dimensions"),
    (lambda x, c: nn.BatchNorm2d(2)(x), ValueError, r"expected 4D input \(got 3D input"),
    (lambda x, c: nn.BatchNorm2d(0), ValueError, "num_features must be a positive int"),
    (lambda x, c: nn.BatchNorm2d(2, momentum=2), ValueError, "BatchNorm2d: momentum"),
])
def test_bad_arguments_are_named(call, error, message):
    x = runtime.tensor(_case((4, 2, 3), "float32")["x"])
    with pytest.raises(error, match=message):
        call(x, lambda n: runtime.zeros(n))


def test_a_refused_step_leaves_the_running_statistics_and_the_count_as_they_were():
    bn = nn.BatchNorm2d(2)
    with pytest.raises(ValueError):
        bn(runtime.zeros((1, 2, 1, 1)))
    assert bn.num_batches_tracked.item() == 0
    assert bn.running_mean.numpy().tolist() == [0, 0]


class _Twice(nn.Module):
    """One BatchNorm1d called twice in a step (its running statistics move twice), then a
    Dense layer: a model whose forward pass reads state it has just updated."""

    def __init__(self, bn: nn.Module, dense: nn.Module) -> None:
        super().__init__()
        self.bn, self.dense = bn, dense

    def forward(self, x):
        return self.dense(ops.relu(self.bn(ops.mul(self.bn(x), 2.0))))


def _pair(dev, momentum):
    nn.manual_seed(3)
    ours = _Twice(nn.BatchNorm1d(4, momentum=momentum, device=dev), nn.Dense(4, 3, device=dev))
    theirs = torch.nn.ModuleDict({"bn": torch.nn.BatchNorm1d(4, momentum=momentum),
                                  "dense": torch.nn.Linear(4, 3)})
    with torch.no_grad():
        theirs["dense"].weight.copy_(torch.tensor(ours.dense.weight.numpy()).reshape(3, 4))
        theirs["dense"].bias.copy_(torch.tensor(ours.dense.bias.numpy()))
    return ours, theirs


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("momentum", [0.25, None])
@pytest.mark.parametrize("plan", [None, "recycle", "static"])
def test_a_layer_called_twice_in_a_training_step_moves_its_statistics_twice(kind, momentum,
                                                                            plan):
    # inside train_step the second call reads the value the first one left pending (Note
    # [state writes wait for the commit point] in runtime/ops.py), so the statistics are
    # PyTorch's, eager or captured
    dev = backends.get_device(kind)
    ours, theirs = _pair(dev, momentum)
    step = nn.train_step(ours, nn.SGD(ours.parameters(), lr=0.1))
    step = step if plan is None else runtime.graph(step, plan=plan)
    topt = torch.optim.SGD(theirs.parameters(), lr=0.1)
    rng = np.random.default_rng(5)
    for _ in range(3):
        x = rng.standard_normal((6, 4)).astype(np.float32) * 3 + 1
        y = rng.integers(0, 3, 6)
        loss = step(runtime.tensor(x, device=dev), y)
        bn = theirs["bn"]
        tloss = torch.nn.functional.cross_entropy(
            theirs["dense"](torch.relu(bn(bn(torch.tensor(x)) * 2.0))), torch.tensor(y))
        topt.zero_grad()
        tloss.backward()
        topt.step()
        np.testing.assert_allclose(loss.item(), tloss.item(), rtol=1e-5)
    assert ours.bn.num_batches_tracked.item() == theirs["bn"].num_batches_tracked.item() == 6
    for name in ("running_mean", "running_var"):
        np.testing.assert_allclose(getattr(ours.bn, name).numpy(),
                                   getattr(theirs["bn"], name).numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_a_step_that_fails_after_the_forward_pass_leaves_the_statistics_as_they_were(kind):
    # the forward pass has run (and computed new statistics) when the loss raises; a retry
    # then moves them once, as one PyTorch step does
    dev = backends.get_device(kind)
    ours, theirs = _pair(dev, 0.1)
    calls = []

    def loss(logits, target):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the loss failed")
        return nn.softmax_cross_entropy(logits, target)

    step = nn.train_step(ours, nn.SGD(ours.parameters(), lr=0.1), loss)
    x = np.linspace(-2, 3, 24, dtype=np.float32).reshape(6, 4)
    before = {n: getattr(ours.bn, n).numpy().copy() for n in ("running_mean", "running_var")}
    with pytest.raises(RuntimeError, match="the loss failed"):
        step(runtime.tensor(x, device=dev), np.arange(6) % 3)
    assert ours.bn.num_batches_tracked.item() == 0
    for name, value in before.items():
        np.testing.assert_array_equal(getattr(ours.bn, name).numpy(), value)
    step(runtime.tensor(x, device=dev), np.arange(6) % 3)
    bn = theirs["bn"]
    bn(bn(torch.tensor(x)) * 2.0)
    assert ours.bn.num_batches_tracked.item() == 2
    np.testing.assert_allclose(ours.bn.running_var.numpy(), bn.running_var.numpy(), rtol=1e-5)


def test_state_writes_outside_a_training_step_happen_where_they_are_computed():
    bn = nn.BatchNorm1d(2)
    with ops.state_writes() as writes:
        bn(runtime.tensor(np.array([[1.0, 2.0], [3.0, 6.0]], np.float32)))
        assert len(writes) == 3 and bn.num_batches_tracked.item() == 0
        assert bn.running_mean.numpy().tolist() == [0, 0]
    assert bn.num_batches_tracked.item() == 1
    np.testing.assert_allclose(bn.running_mean.numpy(), [0.2, 0.4], rtol=1e-6)
    bn(runtime.tensor(np.array([[1.0, 2.0], [3.0, 6.0]], np.float32)))
    assert bn.num_batches_tracked.item() == 2


def test_a_captured_step_commits_after_its_forward_pass_and_recomputes_batch_norm():
    # the running statistics are written at the commit point, so the commit comes after the
    # forward pass (a "recycle" replay frees the forward's temporaries as it goes) and
    # checkpointing may recompute a segment holding a batch norm
    def model(track=True):
        nn.manual_seed(0)
        return nn.Sequential(*[m for _ in range(4) for m in (
            nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3, track_running_stats=track),
            nn.ReLU())], nn.Flatten(), nn.Dense(48, 2))

    x = runtime.tensor(np.random.default_rng(0).standard_normal((2, 3, 4, 4), np.float32))
    reports, losses = {}, {}
    for name, options in {"recycle": dict(plan="recycle"),
                          "sqrt": dict(plan="static", checkpoint="sqrt"),
                          "untracked": dict(plan="recycle")}.items():
        m = model(track=name != "untracked")
        step = runtime.graph(nn.train_step(m, nn.SGD(m.parameters(), lr=0.1)), **options)
        losses[name] = [step(x, np.array([0, 1])).item() for _ in range(3)]
        reports[name] = step.memory_report()
    eager = model()
    step = nn.train_step(eager, nn.SGD(eager.parameters(), lr=0.1))
    assert losses["recycle"] == losses["sqrt"] == [step(x, np.array([0, 1])).item()
                                                   for _ in range(3)]
    # NOTE: without running statistics the first write to state is the update's (SGD's fold
    # writes a weight in backward): the statistics' writes come no earlier
    assert reports["recycle"]["commit_step"] >= reports["untracked"]["commit_step"] > 40
    assert reports["sqrt"]["recompute_instructions"] > 0


# ---------------------------------------------------------------------- the statistics kernels
def _exact_moments(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    wide = x.astype(np.float64)
    mean = wide.mean(axis=(0, 2), keepdims=True)
    return mean, ((wide - mean) ** 2).sum(axis=(0, 2), keepdims=True)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "chunked"])
def test_the_cpus_statistics_kernels_match_exact_sums_in_every_layout(dtype, layout,
                                                                      monkeypatch):
    """`Device.moments` / `channel_dots` on the CPU: its C kernel (contiguous float32 and
    float64), the base's chunks where the C kernel refuses a layout (every other sample of a
    larger x), and the base's chunks made a few samples at a time (STATS_CHUNK lowered), all
    within float32's (float64's) rounding of the exact sums; a large mean loses nothing (the
    squares are summed around the mean, not as E[x^2] - E[x]^2)."""
    device = backends.get_device("cpu")
    dtype = np.dtype(BF16 if dtype == "bfloat16" else dtype)
    rng = np.random.default_rng(1)
    big = rng.standard_normal((10, 5, 33)) + 1000.0
    g = rng.standard_normal(big.shape)
    if layout == "strided":
        x, gx = big.astype(dtype)[::2], g.astype(dtype)[::2]
        assert not x.flags.c_contiguous
    else:
        x, gx = big.astype(dtype), g.astype(dtype)
    if layout == "chunked":
        monkeypatch.setattr(backends.base, "STATS_CHUNK", 2 * 5 * 33 + 1)
        hooks = [backends.base.Device._moments.__get__(device),
                 backends.base.Device._channel_dots.__get__(device)]
        monkeypatch.setattr(device, "_moments", hooks[0])
        monkeypatch.setattr(device, "_channel_dots", hooks[1])
    outs = [np.full((1, 5, 1), np.nan, dtype) for _ in range(4)]
    device.moments(x, outs[0], outs[1])
    device.channel_dots(gx, x, outs[2], outs[3])
    mean, m2 = _exact_moments(x)
    wx, wg = x.astype(np.float64), gx.astype(np.float64)
    sums, dots = wg.sum(axis=(0, 2), keepdims=True), (wg * wx).sum(axis=(0, 2), keepdims=True)
    u = 2.0 ** -24 if dtype != np.float64 else 2.0 ** -53
    half = {np.dtype(np.float16): 2.0 ** -11, BF16: 2.0 ** -8}.get(dtype, u)
    count = x.shape[0] * x.shape[2]
    assert np.all(np.abs(outs[0].astype(np.float64) - mean) <= 4 * count * u * 1001 + half * 1001)
    # NOTE: x - mean rounds by u * 1000 per element: that, squared and summed, bounds m2's error
    spread = 2 * count * u * 1000 * np.abs(wx - mean).max() + 4 * count * u * m2 + half * m2
    assert np.all(np.abs(outs[1].astype(np.float64) - m2) <= spread)
    assert np.all(np.abs(outs[2].astype(np.float64) - sums)
                  <= 4 * count * u * np.abs(wg).sum(axis=(0, 2), keepdims=True)
                  + half * np.abs(sums))
    assert np.all(np.abs(outs[3].astype(np.float64) - dots)
                  <= 4 * count * u * np.abs(wg * wx).sum(axis=(0, 2), keepdims=True)
                  + half * np.abs(dots))
    if layout == "contiguous" and dtype in (np.float32, np.float64):  # NOTE: the C kernel ran
        assert backends.numpy._halfconv is None or backends.numpy._halfconv.moments(
            int(dtype == np.float64), np.empty(5, dtype), np.empty(5, dtype), x)


def test_the_statistics_kernels_refuse_bad_operands_before_writing():
    device = backends.get_device("cpu")
    x = np.ones((2, 3, 4), np.float32)
    mean, m2 = np.full((1, 3, 1), 7.0, np.float32), np.full((1, 3, 1), 7.0, np.float32)
    with pytest.raises(ValueError, match=r"moments: outputs must be \(1, 3, 1\) for inputs of "
                                         r"shape \(2, 3, 4\), got \(1, 3, 1\), \(1, 2, 1\)"):
        device.moments(x, mean, np.zeros((1, 2, 1), np.float32))
    with pytest.raises(ValueError, match=r"channel_dots: inputs must be \(N, C, S\) views of "
                                         r"one shape, got \(2, 3, 4\), \(2, 3, 5\)"):
        device.channel_dots(x, np.ones((2, 3, 5), np.float32), mean, m2)
    with pytest.raises(TypeError, match="moments: every operand must have one float dtype, got "
                                        "float32, float64, float32"):
        device.moments(x, mean.astype(np.float64), m2)
    with pytest.raises(TypeError, match="one float dtype, got int64"):
        device.moments(np.ones((2, 3, 4), np.int64), mean.astype(np.int64), m2.astype(np.int64))
    assert np.all(mean == 7.0) and np.all(m2 == 7.0)


def test_a_captured_batch_norm_runs_its_normalisation_as_one_fused_pass():
    """x - mean and the product by 1 / sqrt(var + eps) fuse in a graph (`fuse._sunk` moves
    the subtraction down past the small ops the product waits for), the backward's four
    elementwise ops fuse, and neither statistic makes a temporary of x's size."""
    nn.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Flatten(), nn.Dense(8 * 36, 2))
    step = runtime.graph(nn.train_step(model, nn.SGD(model.parameters(), lr=0.1)),
                         plan="static")
    x = runtime.tensor(np.random.default_rng(0).standard_normal((4, 3, 6, 6), np.float32))
    step(x, np.array([0, 1, 0, 1])).item()
    chains = [[i.op for i in s.instructions] for s in step._last.steps]
    assert ["sub", "mul"] in chains
    assert ["mul", "sub", "sub", "mul"] in chains
    kernels = [i.op for s in step._last.steps for i in s.instructions]
    assert kernels.count("moments") == kernels.count("channel_dots") == 1


@pytest.mark.parametrize("device", [d for d in ("cpu", "opencl") if d in backends.available()])
def test_an_eager_batch_norm_makes_each_pointwise_formula_in_one_pass(device):
    """Eagerly, x-hat, the affine map and x's gradient are one `Device.fused` pass each where
    the device compiles chains (Note [an op's pointwise formula in one pass]): two tensors of
    x's size in the forward pass and one in the backward (four and four as separate ops), and
    the bits of the ops run one by one (inside a capture, which records them so)."""
    if not backends.get_device(device).capabilities.compiles_fused:
        pytest.skip(f"{device} runs fused chains in blocks here (no compiled chains)")
    import allocators

    rng = np.random.default_rng(5)
    values = rng.standard_normal((4, 3, 5, 5)).astype(np.float32)
    grad = rng.standard_normal((4, 3, 5, 5)).astype(np.float32)
    traced = allocators.TraceAdaptor(allocators.create("direct", device))
    bn = nn.BatchNorm2d(3, device=device)
    with runtime.no_grad():
        bn.weight[...] = rng.uniform(0.5, 1.5, 3).astype(np.float32)
        bn.bias[...] = rng.uniform(-0.5, 0.5, 3).astype(np.float32)
    x = runtime.tensor(values, device=device, allocator=traced, requires_grad=True)
    full = x.nbytes

    def made() -> int:
        return sum(1 for e in traced.events if e.action == "alloc" and e.nbytes >= full)

    gradient = runtime.tensor(grad, device=device, allocator=traced)
    start = made()
    y = bn(x)
    forward = made() - start
    y.backward(gradient)
    assert forward == 2, forward  # NOTE: x-hat (kept for backward) and y
    # NOTE: backward: the pass's copy of `gradient`, then x's gradient, and nothing else
    assert made() - start - forward == 2

    def step(bn: nn.Module, x: runtime.Tensor) -> runtime.Tensor:
        y = bn(x)
        ops.sum(ops.mul(y, runtime.tensor(grad, device=device))).backward()
        return y

    eager_bn = nn.BatchNorm2d(3, device=device)
    eager_bn.load_state_dict(bn.state_dict())
    captured_bn = nn.BatchNorm2d(3, device=device)
    captured_bn.load_state_dict(bn.state_dict())
    xe = runtime.tensor(values, device=device, requires_grad=True)
    ye = step(eager_bn, xe)
    graph = runtime.graph(lambda v: step(captured_bn, v), device=device, plan="static")
    yc = graph(values)
    assert ye.numpy().tobytes() == yc.numpy().tobytes()
