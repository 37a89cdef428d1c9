"""Module state (issue 30): `train()` / `eval()` / `training`, buffers, `state_dict()` (PyTorch's
names and order) and `load_state_dict()` (a bit-exact round trip in every dtype; missing,
unexpected, misshapen and mistyped entries refused, naming each, before anything is written;
NumPy arrays and tensors alike; amp's working copies cast again after a load)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import backends
import runtime
from runtime import amp, dtypes, nn, ops


def _model(seed: int = 0) -> nn.Sequential:
    nn.manual_seed(seed)
    return nn.Sequential(nn.Dense(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Dropout(0.2),
                         nn.Sequential(nn.Dense(6, 3, bias=False), nn.Embedding(5, 2)))


TORCH_NAMES = ["0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
               "1.num_batches_tracked", "4.0.weight", "4.1.weight"]


def test_state_dict_has_pytorchs_names_in_pytorchs_order():
    assert list(_model().state_dict()) == TORCH_NAMES
    torch = pytest.importorskip("torch")
    twin = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(),
                               torch.nn.Dropout(0.2),
                               torch.nn.Sequential(torch.nn.Linear(6, 3, bias=False),
                                                   torch.nn.Embedding(5, 2)))
    assert list(twin.state_dict()) == TORCH_NAMES


def test_a_pytorch_state_dict_loads_and_computes_as_pytorch():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    twin = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU())
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    twin(torch.tensor(x))  # NOTE: running statistics and the count move
    model = nn.Sequential(nn.Dense(4, 6), nn.BatchNorm1d(6), nn.ReLU())
    result = model.load_state_dict({k: v.numpy() for k, v in twin.state_dict().items()})
    assert result == ([], []) and result.missing_keys == []
    assert model[1].num_batches_tracked.item() == 1
    twin.eval()
    model.eval()
    np.testing.assert_allclose(model(runtime.tensor(x)).numpy(),
                               twin(torch.tensor(x)).detach().numpy(), rtol=1e-5, atol=1e-6)


class Holder(nn.Module):
    """A buffer of each dtype given, and a parameter."""

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        super().__init__()
        self.p = runtime.tensor(np.zeros(2, np.float32), requires_grad=True)
        for name, array in arrays.items():
            self.register_buffer(name, runtime.tensor(np.zeros_like(array)))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), shape=st.sampled_from([(), (3,), (2, 3)]))
def test_a_round_trip_is_bit_exact_in_every_dtype(seed, shape):
    rng = np.random.default_rng(seed)
    arrays = {}
    for dtype in dtypes.DTYPES:
        dtype = np.dtype(dtype)
        if dtype == np.bool_:
            arrays["b_bool"] = rng.integers(0, 2, shape).astype(bool)
            continue
        bits = rng.integers(0, 2**(8 * dtype.itemsize), shape, dtype=np.uint64)
        arrays[f"b_{dtype.name}"] = bits.astype(f"u{dtype.itemsize}").view(dtype)  # NaNs too
    source = Holder(arrays)
    source.load_state_dict({"p": np.array([1.5, -0.0], np.float32), **arrays})
    saved = {name: t.numpy() for name, t in source.state_dict().items()}
    for name, array in arrays.items():
        assert saved[name].dtype == array.dtype and saved[name].tobytes() == array.tobytes()
    target = Holder(arrays)
    target.load_state_dict(source.state_dict())  # NOTE: tensors, device to device
    again = Holder(arrays)
    again.load_state_dict(saved)  # NOTE: NumPy arrays
    for model in (target, again):
        assert {k: v.numpy().tobytes() for k, v in model.state_dict().items()} == {
            k: v.tobytes() for k, v in saved.items()}


def test_bad_entries_are_all_named_and_nothing_is_written():
    model = _model()
    before = {k: v.numpy().tobytes() for k, v in model.state_dict().items()}
    good = {k: v.numpy() for k, v in _model(1).state_dict().items()}
    bad = dict(good)
    del bad["0.bias"]
    bad["extra"] = np.zeros(1)
    bad["1.weight"] = np.zeros(5, np.float32)
    bad["1.running_var"] = good["1.running_var"].astype(np.float64)
    with pytest.raises(RuntimeError) as caught:
        model.load_state_dict(bad)
    message = str(caught.value)
    for part in ("Sequential.load_state_dict: nothing was loaded", "missing key(s): 0.bias",
                 "unexpected key(s): extra", r"1.weight: shape (5,) where the module holds (6,)",
                 "1.running_var: dtype float64 where the module holds float32"):
        assert part in message, message
    assert {k: v.numpy().tobytes() for k, v in model.state_dict().items()} == before
    loose = dict(good)
    del loose["0.bias"]
    loose["extra"] = np.zeros(1)
    result = model.load_state_dict(loose, strict=False)
    assert result.missing_keys == ["0.bias"] and result.unexpected_keys == ["extra"]
    assert model.state_dict()["0.weight"].numpy().tobytes() == good["0.weight"].tobytes()
    assert model.state_dict()["0.bias"].numpy().tobytes() == before["0.bias"]
    with pytest.raises(TypeError, match="takes a mapping"):
        model.load_state_dict([("0.bias", 1)])


def test_train_and_eval_reach_every_submodule_and_return_the_module():
    model = _model()
    assert model.training and all(m.training for m in model._walk())
    assert model.eval() is model
    assert not any(m.training for m in model._walk())
    assert model.train() is model and model[4][1].training
    with pytest.raises(TypeError):
        model.train("no")


def test_buffers_are_state_not_parameters():
    model = _model()
    assert [n for n, _ in model.named_buffers()] == ["1.running_mean", "1.running_var",
                                                    "1.num_batches_tracked"]
    assert all(not b.requires_grad for b in model.buffers())
    assert len(model.parameters()) == 6
    bn = model[1]
    bn.running_mean = runtime.tensor(np.ones(6, np.float32))  # NOTE: stays a buffer
    assert "1.running_mean" in model.state_dict() and bn.running_mean.numpy()[0] == 1
    with pytest.raises(TypeError, match="buffer 'running_mean' takes a Tensor or None"):
        bn.running_mean = 3
    with pytest.raises(KeyError, match="already a parameter"):
        bn.register_buffer("weight", None)
    with pytest.raises(ValueError, match="without '.'"):
        bn.register_buffer("a.b", None)


def test_a_load_is_seen_by_amp_working_copies():
    """A Dense layer under autocast computes from a float16 working copy of its weight; a load
    writes the master, whose version moves, so the next forward casts it again."""
    model = nn.Sequential(nn.Dense(3, 2, rng=0))
    x = runtime.tensor(np.ones((1, 3), np.float32))
    with amp.autocast("float16"):
        model(x)
    other = nn.Sequential(nn.Dense(3, 2, rng=1))
    model.load_state_dict(other.state_dict())
    with amp.autocast("float16"):
        got, want = model(x).numpy(), other(x).numpy()
    assert got.tobytes() == want.tobytes()


@pytest.mark.skipif("opencl" not in backends.available(), reason="no OpenCL device (PoCL)")
def test_a_cpu_state_loads_into_an_opencl_model_bit_for_bit():
    dev = backends.get_device("opencl")
    source = _model(3)
    source[1](runtime.tensor(np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)))
    nn.manual_seed(4)
    target = nn.Sequential(nn.Dense(4, 6, device=dev), nn.BatchNorm1d(6, device=dev),
                           nn.ReLU(), nn.Dropout(0.2),
                           nn.Sequential(nn.Dense(6, 3, bias=False, device=dev),
                                         nn.Embedding(5, 2, device=dev)))
    target.load_state_dict(source.state_dict())
    assert {k: v.numpy().tobytes() for k, v in target.state_dict().items()} == {
        k: v.numpy().tobytes() for k, v in source.state_dict().items()}
    assert all(v.device is dev for v in target.state_dict().values())
    assert ops.sum(target[0].weight).device is dev
