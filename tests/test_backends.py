"""Device specs, the lazy backend table, raw memory, copies, views and kernels.

Tests that take the `device` fixture run on every backend available here; the rest are about the
registry or the NumPy device in particular.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from op_references import REFERENCES

import backends
from backends import BackendUnavailableError, Device
from backends.base import BINARY_KERNELS, REDUCE_KERNELS, TERNARY_KERNELS, UNARY_KERNELS
from backends.numpy import NumpyDevice
from helpers import BINARY_REFERENCE, TERNARY_REFERENCE, UNARY_REFERENCE, relu_reference, to_device


@pytest.fixture(scope="module", params=backends.available())
def device(request) -> Device:
    return backends.get_device(request.param)


def empty_on(device: Device, shape: tuple[int, ...], dtype=np.float32):
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    strides = np.empty(shape, dtype).strides
    return device.array_view(device.raw_alloc(nbytes), 0, shape, dtype, strides)


# ---------------------------------------------------------------------- specs and the table
def test_cpu_is_available():
    kinds = backends.available()
    assert isinstance(kinds, list)
    assert "cpu" in kinds


def test_the_same_spec_gives_the_same_device():
    first = backends.get_device("cpu")
    assert backends.get_device("cpu") is first
    assert backends.get_device() is first
    assert isinstance(first, NumpyDevice)
    assert first.name == "cpu"


@pytest.mark.parametrize("spec", ["CPU", "cpu:0", " cpu ", "Cpu:0"])
def test_spellings_of_cpu_give_the_same_device(spec):
    assert backends.get_device(spec) is backends.get_device("cpu")


def test_parse_spec_splits_kind_and_index():
    assert backends.parse_spec("cpu") == ("cpu", 0)
    assert backends.parse_spec("CPU:0") == ("cpu", 0)


def test_a_missing_device_index_says_how_many_exist():
    with pytest.raises(ValueError, match=r"'cpu:1'.*1 device"):
        backends.get_device("cpu:1")


@pytest.mark.parametrize("spec", ["cpu:x", "cpu:-1", "cpu:1.0"])
def test_a_malformed_index_is_a_value_error(spec):
    with pytest.raises(ValueError, match="index"):
        backends.get_device(spec)


def test_an_unknown_backend_lists_the_known_ones():
    with pytest.raises(ValueError, match="tpu") as caught:
        backends.get_device("tpu")
    for kind in backends.BACKENDS:
        assert kind in str(caught.value)


@pytest.mark.parametrize("spec", [0, None, b"cpu", ["cpu"]])
def test_a_spec_that_is_not_a_string_is_a_type_error(spec):
    with pytest.raises(TypeError, match="string"):
        backends.get_device(spec)


def test_a_device_passes_through():
    cpu = backends.get_device("cpu")
    assert backends.get_device(cpu) is cpu
    homemade = NumpyDevice(0)
    assert backends.get_device(homemade) is homemade


class NoDevices(Device):
    """A backend whose package imports but finds no hardware."""

    @classmethod
    def device_count(cls) -> int:
        return 0


class BrokenDriver(Device):
    """A backend whose driver fails when asked for its devices."""

    @classmethod
    def device_count(cls) -> int:
        raise RuntimeError("driver exploded")


def test_a_backend_whose_module_is_missing_is_unavailable(monkeypatch):
    monkeypatch.setitem(backends.BACKENDS, "phantom", "no_such_blockrt_backend:PhantomDevice")
    with pytest.raises(BackendUnavailableError, match="no_such_blockrt_backend") as caught:
        backends.get_device("phantom")
    assert isinstance(caught.value.__cause__, ImportError)
    kinds = backends.available()
    assert "phantom" not in kinds
    assert "cpu" in kinds


def test_a_backend_without_hardware_is_unavailable(monkeypatch):
    monkeypatch.setitem(backends.BACKENDS, "empty", f"{__name__}:NoDevices")
    assert "empty" not in backends.available()
    # The get_device docstring: BackendUnavailableError when "package or hardware is missing".
    with pytest.raises(BackendUnavailableError, match="empty"):
        backends.get_device("empty")


def test_a_backend_whose_driver_fails_is_left_out(monkeypatch):
    monkeypatch.setitem(backends.BACKENDS, "broken", f"{__name__}:BrokenDriver")
    kinds = backends.available()
    assert "broken" not in kinds
    assert "cpu" in kinds


def test_backends_are_imported_only_when_asked_for(monkeypatch):
    monkeypatch.setitem(backends.BACKENDS, "phantom", "no_such_blockrt_backend:PhantomDevice")
    assert backends.get_device("cpu").name == "cpu"
    assert backends.parse_spec("phantom:2") == ("phantom", 2)


# ---------------------------------------------------------------------- raw memory
@given(nbytes=st.integers(1, 1 << 20))
def test_raw_memory_is_aligned_and_sized(device, nbytes):
    raw = device.raw_alloc(nbytes)
    assert device.address(raw) % device.alignment == 0
    assert device.nbytes_of(raw) == nbytes
    device.raw_free(raw)


def test_zero_byte_raw_memory_is_aligned_too(device):
    raws = [device.raw_alloc(0) for _ in range(16)]
    # NOTE: malloc aligns to 16, so 16 zero-byte blocks all aligned by luck are unlikely.
    misaligned = [device.address(raw) % device.alignment for raw in raws
                  if device.address(raw) % device.alignment]
    assert misaligned == []
    assert [device.nbytes_of(raw) for raw in raws] == [0] * 16


def test_cpu_alignment_is_a_cache_line():
    assert backends.get_device("cpu").alignment == 64


def test_live_raw_blocks_do_not_overlap(device):
    raws = [device.raw_alloc(nbytes) for nbytes in (1, 63, 64, 65, 4096)]
    spans = sorted((device.address(raw), device.address(raw) + device.nbytes_of(raw))
                   for raw in raws)
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start


@pytest.mark.parametrize("nbytes", [-1, -4096])
def test_negative_raw_sizes_are_value_errors(device, nbytes):
    with pytest.raises(ValueError, match=str(nbytes)):
        device.raw_alloc(nbytes)


@pytest.mark.parametrize("nbytes", [1.0, 8.5, True, "8", None])
def test_non_integer_raw_sizes_are_type_errors(device, nbytes):
    with pytest.raises(TypeError, match="integer"):
        device.raw_alloc(nbytes)


def test_an_impossible_raw_size_is_a_memory_error(device):
    with pytest.raises(MemoryError):
        device.raw_alloc(2**64)


def test_total_memory_is_positive_or_unknown(device):
    total = device.total_memory
    assert total is None or (isinstance(total, int) and total > 0)


# ---------------------------------------------------------------------- read-only raw memory
class NoReadOnlyDevice(NumpyDevice):
    """Host memory without the read-only kind, as on CUDA: the base class's fallback."""

    capabilities = dataclasses.replace(NumpyDevice.capabilities, read_only_memory=False)
    _raw_alloc_read_only = Device._raw_alloc_read_only
    _is_read_only = Device._is_read_only


@pytest.mark.parametrize("nbytes", [0, 1, 100, 4096])
def test_read_only_raw_memory_is_filled_by_copies_and_read_by_kernels(device, nbytes):
    raw = device.raw_alloc(nbytes, read_only=True)
    assert device.is_read_only(raw) is device.capabilities.read_only_memory
    assert device.address(raw) % device.alignment == 0
    assert device.nbytes_of(raw) == nbytes
    payload = np.arange(nbytes, dtype=np.uint8)
    device.copyin(raw, 0, payload)
    np.testing.assert_array_equal(device.copyout(raw, 0, nbytes), payload)
    n = nbytes // 4
    values = device.array_view(raw, 0, (n,), np.float32, (4,))
    out = empty_on(device, (n,))
    device.unary("neg", values, out)
    np.testing.assert_array_equal(device.to_host(out), -payload[:4 * n].view(np.float32))
    device.raw_free(raw)


def test_ordinary_raw_memory_is_not_read_only(device):
    assert not device.is_read_only(device.raw_alloc(64))
    assert not device.is_read_only(device.raw_alloc(64, read_only=False))


def test_read_only_raw_sizes_are_checked_like_any(device):
    with pytest.raises(ValueError, match="-8"):
        device.raw_alloc(-8, read_only=True)
    with pytest.raises(TypeError, match="integer"):
        device.raw_alloc(8.0, read_only=True)


def test_cpu_read_only_memory_is_a_non_writeable_ndarray_that_kernels_cannot_write():
    cpu = backends.get_device("cpu")
    assert cpu.capabilities.read_only_memory
    raw = cpu.raw_alloc(16, read_only=True)
    assert not raw.flags.writeable
    cpu.copyin(raw, 0, np.arange(4, dtype=np.float32))  # the host fills it
    assert not raw.flags.writeable
    view = cpu.array_view(raw, 0, (4,), np.float32, (4,))
    assert not view.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        cpu.unary("neg", view, view)
    np.testing.assert_array_equal(cpu.to_host(view), np.arange(4))


def test_a_device_without_read_only_memory_hands_out_ordinary_memory():
    dev = NoReadOnlyDevice()
    raw = dev.raw_alloc(16, read_only=True)
    assert not dev.capabilities.read_only_memory and not dev.is_read_only(raw)
    view = dev.array_view(raw, 0, (4,), np.float32, (4,))
    dev.copyin(raw, 0, np.ones(4, np.float32))
    dev.unary("neg", view, view)  # nothing stops a kernel: the runtime's checks must
    np.testing.assert_array_equal(dev.to_host(view), -np.ones(4))


# ---------------------------------------------------------------------- copies
@st.composite
def placements(draw):
    """(raw size, offset, payload) with the payload fitting at the offset."""
    size = draw(st.integers(0, 4096))
    offset = draw(st.integers(0, size))
    payload = draw(st.binary(max_size=size - offset))
    return size, offset, np.frombuffer(payload, dtype=np.uint8)


@given(placement=placements())
def test_copyin_then_copyout_round_trips_and_touches_nothing_else(device, placement):
    size, offset, payload = placement
    raw = device.raw_alloc(size)
    background = np.full(size, 0xA5, np.uint8)
    device.copyin(raw, 0, background)
    device.copyin(raw, offset, payload)
    back = device.copyout(raw, offset, payload.size)
    assert back.dtype == np.uint8
    np.testing.assert_array_equal(back, payload)
    expected = background.copy()
    expected[offset:offset + payload.size] = payload
    np.testing.assert_array_equal(device.copyout(raw, 0, size), expected)


def test_copyout_is_a_copy(device):
    raw = device.raw_alloc(8)
    device.copyin(raw, 0, np.arange(8, dtype=np.uint8))
    host = device.copyout(raw, 0, 8)
    host[:] = 0
    np.testing.assert_array_equal(device.copyout(raw, 0, 8), np.arange(8))


def test_copyin_takes_any_dtype_and_layout(device):
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    raw = device.raw_alloc(values.nbytes)
    device.copyin(raw, 0, values.T)  # not C-contiguous: copied in C order of the transpose
    back = device.copyout(raw, 0, values.nbytes).view(np.float32).reshape(4, 3)
    np.testing.assert_array_equal(back, values.T)


@pytest.mark.parametrize(("offset", "nbytes", "span"), [
    (10, 20, "[10, 30)"), (16, 1, "[16, 17)"), (-1, 4, "[-1, 3)"), (0, 17, "[0, 17)"),
])
def test_out_of_range_copies_are_value_errors_with_the_numbers(device, offset, nbytes, span):
    raw = device.raw_alloc(16)
    for copy in (lambda: device.copyin(raw, offset, np.zeros(nbytes, np.uint8)),
                 lambda: device.copyout(raw, offset, nbytes)):
        with pytest.raises(ValueError) as caught:
            copy()
        assert span in str(caught.value)
        assert "16 bytes" in str(caught.value)


def test_negative_copyout_length_is_a_value_error(device):
    with pytest.raises(ValueError, match="16 bytes"):
        device.copyout(device.raw_alloc(16), 4, -2)


# ---------------------------------------------------------------------- views
def test_array_view_at_an_offset_with_strides_shares_memory_with_raw():
    cpu = backends.get_device("cpu")
    raw = cpu.raw_alloc(64)
    cpu.copyin(raw, 0, np.zeros(64, np.uint8))
    # 2 x 3 float32 at byte 8, rows 16 bytes apart: elements at bytes 8,12,16 and 24,28,32.
    view = cpu.array_view(raw, 8, (2, 3), np.float32, (16, 4))
    assert isinstance(view, np.ndarray)
    assert np.shares_memory(view, raw)
    view[...] = np.arange(1, 7, dtype=np.float32).reshape(2, 3)
    found = cpu.copyout(raw, 0, 64).view(np.float32)
    expected = np.zeros(16, np.float32)
    expected[[2, 3, 4, 6, 7, 8]] = np.arange(1, 7)
    np.testing.assert_array_equal(found, expected)
    cpu.copyin(raw, 24, np.array([-1.0], np.float32))
    assert view[1, 0] == -1.0


@given(st.integers(0, 15), st.integers(1, 4), st.integers(1, 4))
def test_array_view_reads_what_copyin_wrote(device, start, rows, cols):
    raw = device.raw_alloc(4 * (start + rows * cols))
    values = np.arange(start + rows * cols, dtype=np.float32)
    device.copyin(raw, 0, values)
    view = device.array_view(raw, 4 * start, (rows, cols), "float32", (4 * cols, 4))
    np.testing.assert_array_equal(device.to_host(view),
                                  values[start:].reshape(rows, cols))


def test_to_host_of_a_strided_view_is_a_separate_copy(device):
    source = np.arange(12, dtype=np.float32).reshape(3, 4)
    raw = device.raw_alloc(source.nbytes)
    device.copyin(raw, 0, source)
    transposed = device.array_view(raw, 0, (4, 3), np.float32, (4, 16))
    host = device.to_host(transposed)
    np.testing.assert_array_equal(host, source.T)
    host[0, 0] = 99
    np.testing.assert_array_equal(device.to_host(transposed), source.T)


# ---------------------------------------------------------------------- hooks a backend must supply
class BareDevice(Device):
    """A backend that implements nothing."""


class SizedDevice(Device):
    """Knows how big raw memory is, and nothing else."""

    def _nbytes_of(self, raw) -> int:
        return 64


class ClaimingDevice(Device):
    """Claims every capability that needs hooks, and writes none of them."""

    capabilities = backends.Capabilities(
        **{name: True for name in Device.CAPABILITY_HOOKS if name != "gemm_accumulates"})


HOST = np.zeros((2, 2), np.float32)


@pytest.mark.parametrize(("device_class", "call", "hook"), [
    (BareDevice, lambda d: d.raw_alloc(8), "_raw_alloc"),
    (BareDevice, lambda d: d.raw_alloc(8, read_only=True), "_raw_alloc"),
    (BareDevice, lambda d: d.raw_free(object()), "_raw_free"),
    (BareDevice, lambda d: d.address(object()), "_address"),
    (BareDevice, lambda d: d.nbytes_of(object()), "_nbytes_of"),
    (BareDevice, lambda d: d.copyout(object(), 0, 4), "_nbytes_of"),
    (SizedDevice, lambda d: d.copyin(object(), 0, HOST), "_copyin"),
    (SizedDevice, lambda d: d.copyout(object(), 0, 4), "_copyout"),
    (BareDevice, lambda d: d.array_view(object(), 0, (2,), np.float32, (4,)), "_array_view"),
    (BareDevice, lambda d: d.unary("neg", HOST, HOST), "_unary"),
    (BareDevice, lambda d: d.binary("add", HOST, HOST, HOST), "_binary"),
    (BareDevice, lambda d: d.matmul(HOST, HOST, HOST), "_matmul"),
    (BareDevice, lambda d: d.reduce("sum", HOST, None, False, HOST), "_reduce"),
    (BareDevice, lambda d: d.ternary("where", HOST > 0, HOST, HOST, HOST), "_ternary"),
    (BareDevice, lambda d: d.cast(HOST, HOST), "_cast"),
    # NOTE: the defaults of the other hooks start with a required one
    (BareDevice, lambda d: d.to_host(HOST), "_raw_alloc"),
    (BareDevice, lambda d: d.cross_entropy(HOST, np.zeros(2, np.int64), HOST[0], HOST),
     "_raw_alloc"),
    # NOTE: the hooks of a claimed capability
    (ClaimingDevice, lambda d: d.binary("add", HOST.astype(np.float16), HOST.astype(np.float16),
                                        HOST.astype(np.float16)), "_half_elementwise"),
    (ClaimingDevice, lambda d: d.fused([("neg", (("input", 0),), np.float32)], [HOST], HOST),
     "_compile_fused"),
    (ClaimingDevice, lambda d: d.plan_products([]), "_plan_products"),
    (ClaimingDevice, lambda d: d.home_queue, "_home_queue"),
    (ClaimingDevice, lambda d: d.queue_key(object()), "_queue_key"),
    (ClaimingDevice, lambda d: d.record_event(object()), "_record_event"),
    (ClaimingDevice, lambda d: d.event_done(object()), "_event_done"),
    (ClaimingDevice, lambda d: d.wait_event(object()), "_wait_event"),
    (ClaimingDevice, lambda d: d.join(object(), object()), "_join"),
    (ClaimingDevice, lambda d: d.synchronize(), "_synchronize"),
])
def test_a_missing_hook_is_named(device_class, call, hook):
    with pytest.raises(NotImplementedError, match=f"{device_class.__name__}.*{hook}"):
        call(device_class())


# ---------------------------------------------------------------------- kernels
@pytest.mark.parametrize(("call", "kind"), [
    (lambda d, x: d.unary("square", x, x), "unary"),
    (lambda d, x: d.unary("add", x, x), "unary"),
    (lambda d, x: d.binary("pow", x, x, x), "binary"),
    (lambda d, x: d.binary("neg", x, x, x), "binary"),
    (lambda d, x: d.reduce("prod", x, None, True, x), "reduction"),
])
def test_an_unknown_kernel_is_a_value_error_listing_the_known_ones(device, call, kind):
    x = to_device(device, np.ones((2, 2), np.float32))
    with pytest.raises(ValueError, match=f"unknown {kind}") as caught:
        call(device, x)
    known = {"unary": UNARY_KERNELS, "binary": BINARY_KERNELS, "reduction": REDUCE_KERNELS}[kind]
    for name in known:
        assert name in str(caught.value)


REDUCE_REFERENCE = {"sum": np.sum, "mean": np.mean, "max": np.max}


def sample(shape: tuple[int, ...], positive: bool = False) -> np.ndarray:
    values = np.random.default_rng(7).uniform(-3, 3, size=shape)
    return (np.abs(values) + 0.1 if positive else values).astype(np.float32)


def test_every_kernel_has_a_reference():
    assert set(UNARY_REFERENCE) == set(UNARY_KERNELS)
    assert set(BINARY_REFERENCE) == set(BINARY_KERNELS)
    assert set(TERNARY_REFERENCE) == set(TERNARY_KERNELS)
    assert set(REDUCE_REFERENCE) == set(REDUCE_KERNELS)


@pytest.mark.parametrize("name", UNARY_KERNELS)
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in-place"])
def test_unary_kernels_match_numpy(device, name, in_place):
    host = sample((3, 5), positive=REFERENCES[name].domain == "positive")
    x = to_device(device, host)
    out = x if in_place else empty_on(device, host.shape)
    device.unary(name, x, out)
    device.synchronize()
    np.testing.assert_allclose(device.to_host(out), UNARY_REFERENCE[name](host.astype(np.float64)),
                               rtol=1e-6, atol=1e-6)


def test_sigmoid_saturates_without_overflow(device):
    host = np.array([-1e4, -100, 0, 100, 1e4], np.float32)
    out = empty_on(device, host.shape)
    with np.errstate(all="raise"):
        device.unary("sigmoid", to_device(device, host), out)
    np.testing.assert_allclose(device.to_host(out), [0, 0, 0.5, 1, 1], atol=1e-7)


@pytest.mark.parametrize("name", BINARY_KERNELS)
def test_binary_kernels_match_numpy(device, name):
    a_host = sample((3, 4))
    b_host = sample((3, 4), positive=True) + 0.5  # away from 0 for div
    out = empty_on(device, (3, 4))
    device.binary(name, to_device(device, a_host), to_device(device, b_host), out)
    expected = BINARY_REFERENCE[name](a_host.astype(np.float64), b_host)
    np.testing.assert_allclose(device.to_host(out), expected, rtol=1e-6)


@pytest.mark.parametrize("name", BINARY_KERNELS)
def test_binary_kernels_broadcast_through_zero_strides(device, name):
    a_host = sample((3, 4))
    row = sample((4,), positive=True)
    raw = device.raw_alloc(row.nbytes)
    device.copyin(raw, 0, row)
    b = device.array_view(raw, 0, (3, 4), np.float32, (0, 4))  # one row, seen three times
    out = empty_on(device, (3, 4))
    device.binary(name, to_device(device, a_host), b, out)
    expected = BINARY_REFERENCE[name](a_host.astype(np.float64), row[np.newaxis, :])
    np.testing.assert_allclose(device.to_host(out), expected, rtol=1e-6)


@pytest.mark.parametrize(("a_shape", "b_shape"), [
    ((3, 4), (4, 2)), ((1, 1), (1, 1)), ((2, 3, 4), (2, 4, 5)),
])
def test_matmul_matches_numpy(device, a_shape, b_shape):
    a_host, b_host = sample(a_shape), sample(b_shape)
    expected = np.matmul(a_host.astype(np.float64), b_host)
    out = empty_on(device, expected.shape)
    device.matmul(to_device(device, a_host), to_device(device, b_host), out)
    np.testing.assert_allclose(device.to_host(out), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", REDUCE_KERNELS)
@pytest.mark.parametrize("axis", [None, (0,), (1,), (0, 2)])
@pytest.mark.parametrize("keepdims", [False, True])
def test_reductions_match_numpy(device, name, axis, keepdims):
    host = sample((2, 3, 4))
    expected = REDUCE_REFERENCE[name](host.astype(np.float64), axis=axis, keepdims=keepdims)
    out = empty_on(device, np.shape(expected))
    device.reduce(name, to_device(device, host), axis, keepdims, out)
    np.testing.assert_allclose(device.to_host(out), expected, rtol=1e-5, atol=1e-6)


SPECIAL = [-0.0, 0.0, np.nan, -np.nan, np.inf, -np.inf, 1e-45, -1e-45, 1e-310, -1e-310, 1.0,
           -1.0, 3.4e38, -3.4e38]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(14,), (3, 14), (64, 1024 + 14)])  # the last: zeros by row
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "in place"])
def test_cpu_relu_gives_pytorchs_bits(dtype, shape, layout):
    """The NumPy device's relu, in C (contiguous) or NumPy (any other layout), gives +0 where
    x < 0 and x elsewhere, bit for bit: -0.0 stays -0.0 and NaN payloads pass (Note [relu's
    zero] in backends/base.py)."""
    with np.errstate(all="ignore"):
        values = np.resize(np.array(SPECIAL, dtype), shape)
    x = values.T.copy().T if layout == "transposed" else values.copy()
    expected = relu_reference(x)
    dev = backends.get_device("cpu")
    out = x if layout == "in place" else np.empty_like(x)
    dev.unary("relu", x, out)
    assert out.tobytes() == np.ascontiguousarray(expected).tobytes()


def test_relu_of_negative_zero_is_pytorchs_on_every_device(device):
    """relu(-0.0) is -0.0, relu(-1) +0.0 and relu(NaN) NaN on every backend, as torch.relu
    gives on the CPU (Note [relu's zero] in backends/base.py)."""
    host = np.array([-0.0, 0.0, -1.0, -np.inf, np.nan, 2.0], np.float32)
    out = empty_on(device, host.shape)
    device.unary("relu", to_device(device, host), out)
    got = device.to_host(out)
    assert got.view(np.uint32).tolist()[:4] == [0x80000000, 0, 0, 0]
    assert np.isnan(got[4]) and got[5] == 2.0


def test_relu_matches_torch_where_torch_is_installed():
    """The reference itself: torch.relu's bits on signed zeros, infinities and NaN."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    for dtype in (np.float32, np.float64):
        with np.errstate(all="ignore"):
            host = np.array(SPECIAL, dtype)
        want = torch.relu(torch.from_numpy(host.copy())).numpy()
        bits = f"u{host.itemsize}"
        assert np.array_equal(relu_reference(host).view(bits), want.view(bits))


# ---------------------------------------------------------------------- dtypes the kernels take
def _every_device() -> list[Device]:
    from naive_device import NaiveDevice

    return [backends.get_device(kind) for kind in backends.available()] + [NaiveDevice()]


#: Each kernel family called on integer views: (what it is, a call on (device, x, y, out)).
INTEGER_CALLS = {
    "exp": lambda d, x, y, out: d.unary("exp", x, out),
    "relu": lambda d, x, y, out: d.unary("relu", x, out),
    "add": lambda d, x, y, out: d.binary("add", x, y, out),
    "relu_backward": lambda d, x, y, out: d.binary("relu_backward", x, y, out),
    "sub_scaled": lambda d, x, y, out: d.sub_scaled(x, y, 0.5, out),
    "sum": lambda d, x, y, out: d.reduce("sum", x, (1,), True, out[:, :1]),
    "matmul": lambda d, x, y, out: d.matmul(x, y, out),
    "fused": lambda d, x, y, out: d.fused(
        [("mul", (("input", 0), ("input", 1)), out.dtype),
         ("exp", (("link", 0),), out.dtype)], [x, y], out),
}


@pytest.mark.parametrize("dtype", ["int64", "int32", "uint8", "bool"])
@pytest.mark.parametrize("call", sorted(INTEGER_CALLS))
def test_every_backend_refuses_integer_kernels_alike_before_writing(call, dtype):
    """An arithmetic kernel on a dtype it does not compute is one TypeError, the same words on
    every backend (the base's policy, before any kernel is built: CUDA once failed inside
    NVRTC, the naive device truncated exp into integers), and out is left as it was."""
    messages = set()
    for device in _every_device():
        host = (np.arange(9) % 3).reshape(3, 3).astype(dtype)
        x, y, out = (to_device(device, host) for _ in range(3))
        with pytest.raises(TypeError, match=rf"^{device.name}: the \S+ kernel computes on "
                                            rf"float16, bfloat16, float32, float64, not {dtype}"):
            INTEGER_CALLS[call](device, x, y, out)
        assert device.to_host(out).tobytes() == host.tobytes()
        with pytest.raises(TypeError) as caught:
            INTEGER_CALLS[call](device, x, y, out)
        messages.add(str(caught.value).replace(device.name, "<device>"))
    assert len(messages) == 1, messages


def test_copy_moves_every_dtype_on_every_backend():
    for device in _every_device():
        host = np.arange(6, dtype=np.int64).reshape(2, 3)
        out = to_device(device, np.zeros_like(host))
        device.unary("copy", to_device(device, host), out)
        assert device.to_host(out).tolist() == host.tolist()
