"""checkpoint="pointwise" (Note [pointwise recompute] in runtime/graph/checkpoint.py): forward
results that a chain of fusible elementwise ops makes again from what the backward pass keeps
anyway are recomputed instead of kept; results equal the plain graph's bit for bit, and what
stays for the backward pass never grows. A memory budget starts from this rewrite.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import runtime
from runtime import nn, ops
from runtime.graph import CHECKPOINTS, PLANS
from runtime.graph.checkpoint import _pointwise, _wanted


class ConvBlock(nn.Module):
    """conv -> batch norm -> ReLU, twice, then a classifier: the ReLU outputs are what the next
    convolution's weight gradient reads, pointwise functions of batch norm's kept x-hat."""

    def __init__(self, channels: int = 4, pool: bool = False) -> None:
        super().__init__()
        c = channels
        self.conv1, self.bn1 = nn.Conv2d(2, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.pool = pool
        self.fc = nn.Dense(c if pool else c * 6 * 6, 3)

    def forward(self, x: Any) -> Any:
        h = ops.relu(self.bn1(self.conv1(x)))
        h = ops.relu(self.bn2(self.conv2(h)))
        if self.pool:  # NOTE: a small head, so that the activations make the peak
            return self.fc(ops.mean(h, axis=(2, 3)))
        return self.fc(h.reshape(h.shape[0], -1))


def _data(steps: int = 3, side: int = 6) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(7)
    return [(rng.standard_normal((3, 2, side, side)).astype(np.float32), rng.integers(0, 3, 3))
            for _ in range(steps)]


def _run(make: Any, checkpoint: str | None, plan: str = "static", side: int = 6,
         **options: Any) -> tuple[list[bytes], dict[str, bytes], dict[str, Any]]:
    nn.manual_seed(3)
    model = make()
    graph = runtime.graph(nn.train_step(model, nn.SGD(model.parameters(), lr=0.1,
                                                      momentum=0.9)),
                          plan=plan, checkpoint=checkpoint, **options)
    losses = [graph(x, y).numpy().tobytes() for x, y in _data(side=side)]
    params = {k: v.numpy().tobytes() for k, v in model.state_dict().items()}
    return losses, params, graph.memory_report()


@pytest.mark.parametrize("plan", PLANS)
def test_relu_of_batch_norm_is_recomputed_bit_for_bit_and_keeps_less(plan):
    losses, params, plain = _run(ConvBlock, None, plan)
    got_losses, got_params, report = _run(ConvBlock, "pointwise", plan)
    assert got_losses == losses
    assert got_params == params
    # NOTE: both ReLU outputs (3 x 4 x 6 x 6 float32 each) stop waiting for the backward pass
    assert report["recomputed"] == 2, report
    assert report["kept"] == plain["kept"] - 2
    # NOTE: the classifier's backward reads the second at once, so at the peak only the first
    # is gone
    assert report["activation_bytes"] <= plain["activation_bytes"] - 3 * 4 * 36 * 4
    assert report["recompute_instructions"] > 0
    assert report["checkpoint"] == "pointwise"


def test_an_mlp_keeps_what_it_kept():
    # a ReLU of a matrix product: its source (the product) is not kept, so nothing to do
    def make() -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Dense(72, 16), nn.ReLU(), nn.Dense(16, 3))

    losses, params, plain = _run(make, None)
    got_losses, got_params, report = _run(make, "pointwise")
    assert (got_losses, got_params) == (losses, params)
    assert report["recompute_instructions"] == 0
    assert report["planned_bytes"] == plain["planned_bytes"]


def test_a_source_written_before_the_recompute_keeps_its_result():
    # r = relu(tanh(x @ w) + shift) is a pointwise function of tanh's output (kept for tanh's
    # backward) and `shift`; the step then writes `shift` before the backward pass reads r,
    # so recomputing r there would read the new shift: r must stay kept
    x = np.random.default_rng(1).standard_normal((4, 5)).astype(np.float32)

    def make() -> tuple[Any, Any, Any]:
        rng = np.random.default_rng(2)
        w = runtime.tensor(rng.standard_normal((5, 6)).astype(np.float32), requires_grad=True)
        v = runtime.tensor(rng.standard_normal((6, 2)).astype(np.float32), requires_grad=True)
        return w, v, runtime.tensor(np.full(6, 0.25, np.float32))

    def step_for(w: Any, v: Any, shift: Any) -> Any:
        def step(x: Any) -> Any:
            r = ops.relu(ops.add(ops.tanh(ops.matmul(x, w)), shift))
            loss = ops.sum(ops.matmul(r, v))
            with runtime.no_grad():
                ops.add(shift, 1.0, out=shift)
            loss.backward()
            with runtime.no_grad():
                ops.sub(w, ops.mul(w.grad, 0.1), out=w)
                ops.sub(v, ops.mul(v.grad, 0.1), out=v)
            w.grad = v.grad = None
            return loss
        return step

    state = make()
    eager = step_for(*state)
    expected = [eager(runtime.tensor(x)).numpy().tobytes() for _ in range(3)]
    w, v, shift = make()
    graph = runtime.graph(step_for(w, v, shift), checkpoint="pointwise")
    assert [graph(x).numpy().tobytes() for _ in range(3)] == expected
    for mine, theirs in zip((w, v, shift), state):
        assert mine.numpy().tobytes() == theirs.numpy().tobytes()
    assert graph.memory_report()["recomputed"] == 0


def test_checkpoint_pointwise_is_listed_and_refused_with_a_budget():
    assert "pointwise" in CHECKPOINTS
    with pytest.raises(ValueError, match="checkpoint None"):
        runtime.graph(lambda x: x, checkpoint="pointwise", memory_budget=1 << 20)


class Stack(nn.Module):
    """Six 1x1 conv -> batch norm -> ReLU layers: what they keep for the backward pass makes
    the step's peak, as in ResNet-50."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.Sequential(*[nn.Conv2d(2 if k == 0 else 8, 8, 1, bias=False)
                                     for k in range(6)])
        self.bns = nn.Sequential(*[nn.BatchNorm2d(8) for _ in range(6)])
        self.fc = nn.Dense(8, 3)

    def forward(self, x: Any) -> Any:
        for conv, bn in zip(self.convs, self.bns):
            x = ops.relu(bn(conv(x)))
        return self.fc(ops.mean(x, axis=(2, 3)))


def test_a_budget_between_pointwise_and_static_recomputes_no_more_than_pointwise():
    losses, params, static = _run(Stack, None, side=24)
    _, _, cheap = _run(Stack, "pointwise", side=24)
    assert cheap["peak_bytes"] < static["peak_bytes"]
    got_losses, got_params, report = _run(Stack, None, side=24,
                                          memory_budget=cheap["peak_bytes"])
    assert (got_losses, got_params) == (losses, params)
    assert report["peak_bytes"] <= cheap["peak_bytes"]
    # NOTE: the cheapest choice recomputes no more than the ReLUs: no convolution (the
    # segments family, which may win, recomputes the same ReLUs from batch norm's x-hat)
    assert 0 < report["recompute_flops"] <= cheap["recompute_flops"], report


@st.composite
def conv_nets(draw: Any) -> list[tuple]:
    layers: list[tuple] = []
    channels = 2
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["convbn", "relu", "gelu", "sigmoid", "residual"]))
        if kind == "convbn":
            out = draw(st.integers(1, 3))
            layers.append((kind, channels, out))
            channels = out
        else:
            layers.append((kind, channels))
    return layers


class Net(nn.Module):
    def __init__(self, layers: list[tuple]) -> None:
        super().__init__()
        self.layers = layers
        self.convs = nn.Sequential(*[nn.Conv2d(layer[1], layer[2], 3, padding=1)
                                     for layer in layers if layer[0] == "convbn"])
        self.bns = nn.Sequential(*[nn.BatchNorm2d(layer[2])
                                   for layer in layers if layer[0] == "convbn"])
        channels = layers[-1][2] if layers[-1][0] == "convbn" else layers[-1][1]
        self.fc = nn.Dense(channels * 36, 3)

    def forward(self, x: Any) -> Any:
        conv = 0
        for layer in self.layers:
            if layer[0] == "convbn":
                x = self.bns[conv](self.convs[conv](x))
                conv += 1
            elif layer[0] == "residual":
                x = ops.relu(ops.add(x, ops.mul(x, 0.5)))
            else:
                x = {"relu": ops.relu, "gelu": ops.gelu, "sigmoid": ops.sigmoid}[layer[0]](x)
        return self.fc(x.reshape(x.shape[0], -1))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=conv_nets(), plan=st.sampled_from(PLANS))
def test_random_conv_nets_replay_bit_for_bit_and_keep_no_more(layers, plan):
    def make() -> nn.Module:
        return Net(layers)

    losses, params, plain = _run(make, None, plan)
    got_losses, got_params, report = _run(make, "pointwise", plan)
    assert got_losses == losses
    assert got_params == params
    assert report["kept"] + report["recomputed"] == plain["kept"]
    assert report["activation_bytes"] <= plain["activation_bytes"]


class Residual(nn.Module):
    """Two residual blocks (conv, batch norm, ReLU, conv, batch norm, + input, ReLU)."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.Sequential(*[nn.Conv2d(2, 2, 3, padding=1, bias=False)
                                     for _ in range(4)])
        self.bns = nn.Sequential(*[nn.BatchNorm2d(2) for _ in range(4)])
        self.fc = nn.Dense(2, 3)

    def forward(self, x: Any) -> Any:
        for k in (0, 2):
            h = ops.relu(self.bns[k](self.convs[k](x)))
            x = ops.relu(ops.add(self.bns[k + 1](self.convs[k + 1](h)), x))
        return self.fc(ops.mean(x, axis=(2, 3)))


def test_local_pointwise_keeps_what_a_later_unit_reads(monkeypatch):
    # a budget's units are cut at the results the backward pass reads; `local` drops only
    # results whose forward reads end before the next such result: the inner ReLU, not the
    # block's output, which the block's last add reads
    graph_module = importlib.import_module("runtime.graph")
    seen = []
    build = graph_module._build

    def spy(recorder, **kwargs):
        seen.append(capture_module._sort_blocks(recorder, kwargs["outputs"]))
        return build(recorder, **kwargs)

    capture_module = importlib.import_module("runtime.graph.capture")
    monkeypatch.setattr(graph_module, "_build", spy)
    _run(Residual, None)
    recorded = seen[0]
    everything = _pointwise(recorded)
    local = _pointwise(recorded, local=True)
    relus = sum(1 for i in recorded.program if i.phase == "forward" and i.op == "relu")
    assert relus == 4
    assert everything.recomputed > local.recomputed > 0
    made = {o.block.id for i in recorded.program if i.phase == "forward" for o in i.outputs}
    for rewritten in (everything, local):  # NOTE: a rewrite only ever stops keeping results
        still = _wanted(rewritten.program, rewritten.intermediate) & made
        assert still < _wanted(recorded.program, recorded.intermediate)
    # the first block's output (its second ReLU) stays wanted under local, not under all
    outputs = [i.outputs[0].block.id for i in recorded.program
               if i.phase == "forward" and i.op == "relu"]
    assert outputs[1] in _wanted(local.program, local.intermediate)
    assert outputs[1] not in _wanted(everything.program, everything.intermediate)
    assert outputs[0] not in _wanted(local.program, local.intermediate)
