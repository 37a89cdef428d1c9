"""DLPack: tensors and NumPy (and PyTorch, CuPy where present) share memory without copies."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import allocators
import backends
import runtime
from runtime._tensor import DTYPES
from runtime.dlpack import ForeignBlock
from runtime.dtypes import BFLOAT16

NO_CUDA = "no CUDA device (cupy not installed or no GPU)"


@pytest.fixture
def alloc() -> allocators.Allocator:
    alloc = allocators.create("caching", "cpu")
    yield alloc
    gc.collect()
    alloc.check_invariants()


def _sample(dtype: np.dtype, shape=(3, 4)) -> np.ndarray:
    values = np.arange(int(np.prod(shape))).reshape(shape) % 7
    return values.astype(dtype)


# ---------------------------------------------------------------------- blockrt -> NumPy
def test_numpy_sees_the_tensor_memory_and_writes_back(alloc):
    t = runtime.tensor(_sample(np.float32), allocator=alloc)
    shared = np.from_dlpack(t)
    assert shared.ctypes.data == t.block.memory_for_read().ptr  # no copy
    shared[1, 2] = 42.0
    assert t.numpy()[1, 2] == 42.0
    runtime.ops.add(t, 1.0, out=t)
    assert shared[0, 1] == 2.0


@pytest.mark.parametrize("make", [
    lambda t: t[1:, ::2],
    lambda t: t.T,
    lambda t: t[2],
    lambda t: t[:, 3],
    lambda t: runtime.view(t, (2, 2), offset=5),
    lambda t: t.reshape(2, 6)[:, 1:4],
], ids=["slice", "transpose", "row", "column", "offset-view", "reshaped-slice"])
def test_strided_and_offset_views_export_their_own_elements(alloc, make):
    t = runtime.tensor(_sample(np.float64), allocator=alloc)
    view = make(t)
    shared = np.from_dlpack(view)
    np.testing.assert_array_equal(shared, view.numpy())
    assert shared.strides == tuple(s * 8 for s in view.strides)
    shared[...] = -1.0  # writes land on exactly the view's elements
    expected = _sample(np.float64)
    make_host = make(runtime.tensor(np.arange(12.0).reshape(3, 4)))
    touched = np.isin(np.arange(12.0).reshape(3, 4), make_host.numpy())
    expected[touched] = -1.0
    np.testing.assert_array_equal(t.numpy(), expected)


class _Capsules:
    """A producer that hands on another's capsules (so that an import reads the capsule, not
    the blockrt Tensor behind it)."""

    def __init__(self, producer):
        self.producer = producer

    def __dlpack__(self, **options):
        return self.producer.__dlpack__(**options)

    def __dlpack_device__(self):
        return self.producer.__dlpack_device__()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_tensor_dtype_round_trips(alloc, dtype):
    host = _sample(dtype)
    t = runtime.tensor(host, allocator=alloc)
    if dtype == BFLOAT16:  # NumPy has no bfloat16 and refuses DLPack's code for it
        with pytest.raises((BufferError, RuntimeError, TypeError)):
            np.from_dlpack(t)
        back = runtime.from_dlpack(_Capsules(t))  # through a capsule of kDLBfloat
    else:
        back = np.from_dlpack(t)
    assert back.dtype == dtype
    np.testing.assert_array_equal(np.asarray(back.numpy() if dtype == BFLOAT16 else back), host)
    again = runtime.from_dlpack(_Capsules(back) if dtype == BFLOAT16 else back)
    assert again.dtype == dtype and again.shape == host.shape
    np.testing.assert_array_equal(again.numpy(), host)
    again.numpy()  # the import shares memory: a write through t is seen
    t[0, 1] = host[0, 0] + 1 if dtype != np.bool_ else not host[0, 0]
    assert again.numpy()[0, 1] == t.numpy()[0, 1]


def test_a_bfloat16_capsule_says_kdlbfloat():
    from runtime.dlpack import _dtype_field

    t = runtime.tensor(np.array([1.5, -2.0], np.float32), dtype="bfloat16")
    for capsule in (t.__dlpack__(max_version=(1, 0)), t.__dlpack__()):  # versioned, not
        field = _dtype_field(capsule)
        assert (field.code, field.bits, field.lanes) == (4, 16, 1)


def test_the_consumer_keeps_the_block_alive_after_the_tensor_goes(alloc):
    t = runtime.tensor(np.full(256, 3.0, np.float32), allocator=alloc)
    shared = np.from_dlpack(t[::2])
    address = shared.ctypes.data
    t.release()
    gc.collect()
    assert alloc.stats()["active_allocations"] == 1  # the block was not given back
    other = runtime.tensor(np.full(256, 9.0, np.float32), allocator=alloc)
    assert other.block.memory_for_read().ptr != address
    np.testing.assert_array_equal(shared, 3.0)  # nobody reused the memory
    assert shared.ctypes.data == address
    del shared
    gc.collect()
    assert alloc.stats()["active_allocations"] == 1  # only `other` is left
    other.release()
    assert alloc.stats()["active_allocations"] == 0


def test_an_unconsumed_capsule_lets_the_block_go(alloc):
    t = runtime.tensor(np.ones(8), allocator=alloc)
    capsule = t.__dlpack__()
    t.release()
    assert alloc.stats()["active_allocations"] == 1
    del capsule
    gc.collect()
    assert alloc.stats()["active_allocations"] == 0


def test_constants_export_read_only():
    c = runtime.constant(np.arange(4.0))
    shared = np.from_dlpack(c, copy=False)  # NOTE: without copy=False a constant goes as a copy
    assert not shared.flags.writeable
    np.testing.assert_array_equal(shared, np.arange(4.0))


def test_export_refuses_freed_unwritten_and_streams(alloc):
    t = runtime.tensor(np.ones(4), allocator=alloc)
    with pytest.raises(BufferError, match="stream must be None"):
        t.__dlpack__(stream=1)
    t.release()
    with pytest.raises(runtime.UseAfterFreeError):
        np.from_dlpack(t)
    with pytest.raises(runtime.UninitializedMemoryError):
        np.from_dlpack(runtime.empty(4, allocator=alloc))


def test_dlpack_device_codes():
    assert runtime.tensor(np.ones(2)).__dlpack_device__() == (1, 0)


@pytest.mark.skipif("opencl" not in backends.available(), reason="no OpenCL device")
def test_opencl_tensors_say_their_device_and_refuse_export():
    t = runtime.tensor(np.ones(3, np.float32), device="opencl")
    assert t.__dlpack_device__() == (4, 0)
    with pytest.raises(BufferError, match="OpenCL"):
        np.from_dlpack(t)


# ---------------------------------------------------------------------- NumPy -> blockrt
def test_tensor_shares_the_producer_memory(alloc):
    host = _sample(np.float32)
    t = runtime.from_dlpack(host, allocator=alloc)
    assert isinstance(t.block, ForeignBlock)
    host[0, 0] = 100.0
    assert t.numpy()[0, 0] == 100.0
    runtime.ops.mul(t, 2.0, out=t)  # a write through blockrt is seen by NumPy
    assert host[0, 0] == 200.0
    assert alloc.stats()["num_allocs"] == 0  # the foreign memory never came from alloc


@pytest.mark.parametrize("pick", [
    lambda a: a[:, ::2],
    lambda a: a[1:, ::-1],
    lambda a: a[::-2, 1],
    lambda a: a.T,
    lambda a: a[2:, 3:],
], ids=["every-other-column", "reversed-columns", "reversed-rows", "transposed", "offset"])
def test_strided_offset_and_negative_stride_imports(alloc, pick):
    host = np.arange(20.0).reshape(4, 5)
    t = runtime.from_dlpack(pick(host), allocator=alloc)
    np.testing.assert_array_equal(t.numpy(), pick(host))
    runtime.ops.add(t, 100.0, out=t)
    expected = np.arange(20.0).reshape(4, 5)
    pick(expected)[...] += 100.0  # exactly the view's elements move, in the producer's memory
    np.testing.assert_array_equal(host, expected)


def test_results_of_ops_come_from_the_given_allocator(alloc):
    t = runtime.from_dlpack(np.ones((2, 3)), allocator=alloc)
    y = runtime.ops.add(t, t)
    assert y.block.allocator is alloc and alloc.stats()["num_allocs"] == 1
    np.testing.assert_array_equal(y.numpy(), 2.0)


def test_the_tensor_keeps_the_producer_alive_then_lets_go(alloc):
    host = np.arange(1000.0)
    alive = weakref.ref(host)
    t = runtime.from_dlpack(host, allocator=alloc)
    view = t[10:20]
    del host
    gc.collect()
    assert alive() is not None
    np.testing.assert_array_equal(view.numpy(), np.arange(10.0, 20.0))
    t.release()
    gc.collect()
    assert alive() is not None  # the view still holds the block
    view.release()
    gc.collect()
    assert alive() is None


def test_foreign_memory_never_reaches_an_allocator(alloc):
    t = runtime.from_dlpack(np.ones(4), allocator=alloc)
    foreign = t.block.foreign
    with pytest.raises(allocators.InvalidFreeError, match="never handed out"):
        alloc.free(foreign)
    block = t.block
    t.release()
    assert block.foreign is None and not block.allocated
    assert alloc.stats()["num_frees"] == 0


def test_read_only_producers_give_read_only_tensors(alloc):
    host = np.arange(3.0)
    host.flags.writeable = False
    t = runtime.from_dlpack(host, allocator=alloc)
    assert t.block.readonly
    with pytest.raises(runtime.ReadOnlyError):
        runtime.ops.neg(t, out=t)
    np.testing.assert_array_equal(runtime.ops.neg(t).numpy(), -np.arange(3.0))


def test_empty_and_zero_d_imports(alloc):
    empty = runtime.from_dlpack(np.zeros((0, 3), np.float32), allocator=alloc)
    assert empty.shape == (0, 3) and empty.numpy().shape == (0, 3)
    scalar = runtime.from_dlpack(np.array(5, np.int32), allocator=alloc)
    assert scalar.shape == () and scalar.item() == 5


def test_importing_a_tensor_gives_a_handle_on_its_block(alloc):
    t = runtime.tensor(np.ones(3), allocator=alloc)
    again = runtime.from_dlpack(t)
    assert again.block is t.block and again is not t


@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
def test_unsupported_dtypes_are_refused(dtype):
    with pytest.raises(TypeError, match=f"elements are {dtype} .*which no tensor holds"):
        runtime.from_dlpack(np.zeros(3, dtype))


class _Retyped:
    """A producer whose capsule says another element type (DLPack (code, bits)) than its bytes
    (uint8), as a float8 producer's would: NumPy has no float8 to export."""

    def __init__(self, code: int, bits: int) -> None:
        self.host, self.code, self.bits = np.zeros(4, np.uint8), code, bits

    def __dlpack_device__(self):
        return self.host.__dlpack_device__()

    def __dlpack__(self, **options):
        from runtime.dlpack import _retyped

        return _retyped(self.host.__dlpack__(**options), (1, 8), (self.code, self.bits))


@pytest.mark.parametrize("code, name", [(10, "float8_e4m3fn"), (12, "float8_e5m2"),
                                        (14, "float8_e8m0fnu"), (3, "opaque handle")])
def test_float8_and_other_element_types_are_named_type_errors(code, name):
    """A capsule of an element type no tensor holds is a TypeError naming it, before NumPy
    takes the capsule (NumPy itself raised RuntimeError "Unsupported dtype in DLTensor")."""
    with pytest.raises(TypeError, match=f"elements are {name} \\(DLPack type code {code}, "
                                        f"8 bits\\), which no tensor holds"):
        runtime.from_dlpack(_Retyped(code, 8))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "bool", "uint64"])
def test_two_byte_floats_bool_and_wide_integers_are_imported(dtype):
    """What the docstring says is held comes in, without a copy (bfloat16 through NumPy by
    Note [bfloat16 through DLPack])."""
    host = np.arange(6).astype(dtype)
    if dtype == "bfloat16":  # NOTE: NumPy cannot export it: a tensor's capsule stands in
        back = runtime.from_dlpack(_Exporter(runtime.tensor(host)))
    else:
        back = runtime.from_dlpack(host)
        assert back.block.memory_for_read().ptr == host.ctypes.data
    assert back.dtype == host.dtype and back.numpy().tolist() == host.tolist()


class _Exporter:
    """A tensor's own capsule, seen as a foreign producer's (so from_dlpack does not shortcut
    a Tensor to its block)."""

    def __init__(self, tensor) -> None:
        self.tensor = tensor

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()

    def __dlpack__(self, **options):
        return self.tensor.__dlpack__(**options)


class _OtherDevice:
    """A producer on a device blockrt does not take (its __dlpack__ is never reached)."""

    def __init__(self, device_type: int) -> None:
        self.device_type = device_type

    def __dlpack__(self, **kwargs):
        raise AssertionError("from_dlpack must refuse before asking for the capsule")

    def __dlpack_device__(self):
        return self.device_type, 0


@pytest.mark.parametrize("device_type, name", [(4, "OpenCL"), (8, "Metal"), (10, "ROCm")])
def test_unsupported_devices_are_refused(device_type, name):
    with pytest.raises(BufferError, match=name):
        runtime.from_dlpack(_OtherDevice(device_type))


def test_objects_without_dlpack_are_refused():
    with pytest.raises(TypeError, match="__dlpack__"):
        runtime.from_dlpack([1.0, 2.0])


# ---------------------------------------------------------------------- other libraries
def test_pytorch_round_trip_shares_memory(alloc):
    torch = pytest.importorskip("torch")
    t = runtime.tensor(np.arange(6.0, dtype=np.float32).reshape(2, 3), allocator=alloc)
    x = torch.from_dlpack(t)
    x[0, 0] = 9.0
    assert t.numpy()[0, 0] == 9.0
    source = torch.arange(8, dtype=torch.int64)[1::2]
    y = runtime.from_dlpack(source, allocator=alloc)
    source.add_(100)
    np.testing.assert_array_equal(y.numpy(), [101, 103, 105, 107])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_through_pytorch(alloc, dtype):
    torch = pytest.importorskip("torch")
    host = _sample(dtype)
    t = runtime.tensor(host, allocator=alloc)
    theirs = torch.from_dlpack(t)
    assert str(theirs.dtype) == f"torch.{dtype}"
    np.testing.assert_array_equal(theirs.float().numpy(), host.astype(np.float32))
    back = runtime.from_dlpack(theirs)
    assert back.dtype == dtype and back.block is not t.block
    theirs[0, 1] = 1 if dtype != np.bool_ else not bool(host[0, 1])  # shared both ways
    assert t.numpy()[0, 1] == back.numpy()[0, 1] == theirs[0, 1].item()


@pytest.mark.skipif("cuda" not in backends.available(), reason=NO_CUDA)
def test_cupy_round_trip_shares_device_memory():
    import cupy as cp

    alloc = allocators.create("caching", "cuda")
    source = cp.arange(12, dtype=cp.float32).reshape(3, 4)[:, ::2]
    t = runtime.from_dlpack(source, allocator=alloc)
    assert t.device.name == "cuda:0" and t.strides == (4, 2)
    source += 1
    t.device.synchronize()
    np.testing.assert_array_equal(t.numpy(), cp.asnumpy(source))
    back = cp.from_dlpack(runtime.ops.mul(t, 2.0))
    np.testing.assert_array_equal(cp.asnumpy(back), 2 * cp.asnumpy(source))
    t2 = runtime.tensor(np.ones(5, np.float32), allocator=alloc)
    shared = cp.from_dlpack(t2)
    shared[0] = 7
    cp.cuda.Device().synchronize()
    assert t2.numpy()[0] == 7
    t2.release()
    gc.collect()
    assert alloc.stats()["active_allocations"] >= 1  # `shared` keeps its block
    del shared
    gc.collect()
