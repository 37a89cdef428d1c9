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


# ---------------------------------------------------------------------- the CPU's compiled chains
def _broadcast(rng, shape, pattern, dtype):
    """An operand of out's `shape`: "full", "channel" (axis 1 only, broadcast elsewhere), "row"
    (the last axis only), "scalar", or "strided" (every other element of a larger array)."""
    if pattern == "full":
        return rng.normal(0, 3, shape).astype(dtype)
    if pattern == "strided":
        return rng.normal(0, 3, (*shape[:-1], 2 * shape[-1])).astype(dtype)[..., ::2]
    kept = {"channel": 1, "row": len(shape) - 1}.get(pattern)
    small = tuple(n if axis == kept else 1 for axis, n in enumerate(shape))
    return np.broadcast_to(rng.normal(0, 3, small).astype(dtype), shape)


@pytest.mark.skipif(not backends.get_device("cpu").capabilities.compiles_fused,
                    reason="the CPU compiles fused chains only with backends._halfconv built")
@settings(max_examples=60, deadline=None)
@given(st.sampled_from([(5,), (3, 7), (2, 3, 5, 7), (4, 16, 9, 9), (2, 3, 700), (1, 5, 1, 1)]),
       st.lists(st.sampled_from(["full", "channel", "row", "scalar", "strided"]), min_size=3,
                max_size=3),
       st.sampled_from([np.float32, np.float64]), st.booleans(), st.integers(0, 2**32 - 1))
def test_the_cpus_compiled_chain_gives_its_links_bits_on_broadcast_operands(
        shape, patterns, dtype, in_place, seed):
    """`_halfconv.chain` (the CPU's `_compile_fused`) over per-channel, row, scalar and strided
    operands and numbers gives the bits of the links run one by one, into out or into one of
    its operands (the identical view), and a prepared chain runs again on new data."""
    device = backends.get_device("cpu")
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    inputs = [_broadcast(rng, shape, p, dtype) for p in patterns]
    inputs[0] = rng.normal(0, 3, shape).astype(dtype)  # NOTE: a full one, which out may be
    program = (("mul", (("input", 1), ("number", dtype.type(1.5))), dtype),
               ("sub", (("input", 0), ("link", 0)), dtype),
               ("copy", (("link", 1),), dtype),
               ("relu_backward", (("link", 2), ("input", 2)), dtype),
               ("div", (("link", 3), ("number", dtype.type(3.0))), dtype),
               ("add", (("link", 4), ("input", 0)), dtype))
    expected = sequential(device, program, inputs, shape, dtype)
    out = inputs[0] if in_place else np.zeros(shape, dtype)
    run = device._compile_fused(program, inputs, out)
    assert callable(run), "a float chain of the CPU's ops over these layouts compiles"
    run()
    np.testing.assert_array_equal(out, expected)
    if not in_place:  # NOTE: the same views, new values
        inputs[0][...] = rng.normal(0, 3, shape)
        run()
        np.testing.assert_array_equal(out, sequential(device, program, inputs, shape, dtype))


@pytest.mark.skipif(not backends.get_device("cpu").capabilities.compiles_fused,
                    reason="the CPU compiles fused chains only with backends._halfconv built")
def test_the_cpu_runs_blocked_what_it_does_not_compile():
    """A chain with an op C has no loop for (erf), a mixed dtype or a strided out is not
    compiled (`_compile_fused` says None) and still gives its links' bits."""
    device = backends.get_device("cpu")
    rng = np.random.default_rng(5)
    a = rng.normal(size=(6, 8)).astype(np.float32)
    f32 = np.dtype(np.float32)
    for program, out in [
            ((("erf", (("input", 0),), f32), ("add", (("link", 0), ("input", 0)), f32)),
             np.zeros((6, 8), np.float32)),
            ((("mul", (("input", 0), ("input", 0)), f32),
              ("add", (("link", 0), ("input", 0)), f32)),
             np.zeros((6, 16), np.float32)[:, ::2])]:
        assert device._compile_fused(program, [a], out) is None
        device.fused(program, [a], out)
        np.testing.assert_array_equal(out, sequential(device, program, [a], a.shape, np.float32))
