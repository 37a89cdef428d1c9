"""`Device.fused`: a chain of elementwise kernels run as one equals the kernels run one by one,
on every available backend."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import backends
from backends import Device
from helpers import to_device


@pytest.fixture(scope="module", params=backends.available())
def device(request) -> Device:
    return backends.get_device(request.param)


def sequential(device: Device, program, inputs, shape, dtype):
    """The reference: each link run by the public kernels into a full-size array."""
    results = []
    for name, args, _ in program:
        operands = [inputs[ref] if kind == "input" else results[ref] if kind == "link" else ref
                    for kind, ref in args]
        target = to_device(device, np.zeros(shape, dtype))
        if len(operands) == 1:
            device.unary(name, operands[0], target)
        else:
            device.binary(name, operands[0], operands[1], target)
        results.append(target)
    return device.to_host(results[-1])


# tanh(a * 2 + b) - relu(a), then sigmoid of that times b: inputs, numbers and links mixed
PROGRAM = (("mul", (("input", 0), ("number", np.float32(2.0))), np.float32),
           ("add", (("link", 0), ("input", 1)), np.float32),
           ("tanh", (("link", 1),), np.float32),
           ("relu", (("input", 0),), np.float32),
           ("sub", (("link", 2), ("link", 3)), np.float32),
           ("sigmoid", (("link", 4),), np.float32),
           ("mul", (("link", 5), ("input", 1)), np.float32))


@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2000, 33), (5, 3, 4)])
def test_a_fused_chain_equals_its_kernels_run_one_by_one(device, shape):
    rng = np.random.default_rng(len(shape))
    a = rng.normal(size=shape).astype(np.float32)
    b = rng.normal(size=shape).astype(np.float32)
    inputs = [to_device(device, a), to_device(device, b)]
    out = to_device(device, np.zeros(shape, np.float32))
    program = tuple((name, args, np.dtype(dtype)) for name, args, dtype in PROGRAM)
    device.fused(program, inputs, out)
    expected = sequential(device, program, inputs, shape, np.float32)
    if device.name == "cpu":  # the same kernels on blocks: bit for bit
        np.testing.assert_array_equal(device.to_host(out), expected)
    else:  # one generated kernel: its compiler may contract a * b + c into one rounding
        np.testing.assert_allclose(device.to_host(out), expected, rtol=2e-6, atol=1e-7)


@given(rows=st.integers(1, 3000), cols=st.integers(1, 40))
@settings(max_examples=15)
def test_fused_chains_cut_into_blocks_anywhere_match_numpy(rows, cols):
    device = backends.get_device("cpu")
    rng = np.random.default_rng(rows * 41 + cols)
    a = rng.normal(size=(rows, cols))
    row = rng.normal(size=(cols,))
    raw = device.raw_alloc(row.nbytes)
    device.copyin(raw, 0, row)
    bias = device.array_view(raw, 0, (rows, cols), np.float64, (0, 8))  # one row, broadcast
    out = to_device(device, np.zeros((rows, cols)))
    program = (("add", (("input", 0), ("input", 1)), np.dtype(np.float64)),
               ("exp", (("link", 0),), np.dtype(np.float64)))
    device.fused(program, [to_device(device, a), bias], out)
    np.testing.assert_allclose(device.to_host(out), np.exp(a + row), rtol=1e-15)


def test_bad_programs_are_refused_naming_the_link(device):
    x = to_device(device, np.ones(3, np.float32))
    with pytest.raises(ValueError, match="link 0 names no elementwise kernel: 'matmul'"):
        device.fused((("matmul", (("input", 0), ("input", 0)), np.float32),), [x], x)
    with pytest.raises(ValueError, match="link 0 reads link 0"):
        device.fused((("neg", (("link", 0),), np.float32),), [x], x)
    with pytest.raises(ValueError, match="link 0 reads link 0"):
        device.prepare_fused((("neg", (("link", 0),), np.float32),), [x], x)


@given(rows=st.integers(1, 2500), cols=st.integers(1, 24), runs=st.integers(1, 3))
@settings(max_examples=15)
def test_a_prepared_chain_runs_again_on_new_data_and_shares_scratch(device, rows, cols, runs):
    """prepare_fused sets a chain up once; each run reads the views' current data. Two chains
    given one scratch dict share their block-sized arrays and both stay right."""
    rng = np.random.default_rng(rows * 7 + cols)
    program = tuple((name, args, np.dtype(dtype)) for name, args, dtype in PROGRAM)
    shape = (rows, cols)
    raws = [device.raw_alloc(rows * cols * 4) for _ in range(2)]
    inputs = [device.array_view(raw, 0, shape, np.float32, (cols * 4, 4)) for raw in raws]
    outs = [to_device(device, np.zeros(shape, np.float32)) for _ in range(2)]
    scratch: dict = {}
    chains = [device.prepare_fused(program, inputs, out, scratch) for out in outs]
    for _ in range(runs):
        for raw in raws:
            device.copyin(raw, 0, rng.normal(size=shape).astype(np.float32))
        for chain in chains:
            chain()
        expected = sequential(device, program, inputs, shape, np.float32)
        for out in outs:
            np.testing.assert_allclose(device.to_host(out), expected, rtol=2e-6, atol=1e-7)
    if device.name == "cpu":  # the blocked default: one set of scratch arrays for both chains
        assert len(scratch) == len(program) - 1
