"""The OpenCL device against NumPy: every kernel on contiguous, strided, broadcast and offset
views in float32 and float64, the kernel cache, alignment, and memory recycled while a queued
kernel still reads it (pyopencl issue 447), and constants in READ_ONLY buffers.

Skipped when pyopencl or an OpenCL device (PoCL counts) is missing.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import allocators
import backends
import runtime
from helpers import BINARY_REFERENCE, UNARY_REFERENCE

cl = pytest.importorskip("pyopencl", reason="pyopencl is not installed (pip install "
                         "blockrt[opencl])")
if "opencl" not in backends.available():
    pytest.skip("no OpenCL device on this machine (PoCL from blockrt[opencl] provides a CPU one)",
                allow_module_level=True)

from backends.base import BINARY_KERNELS, COMPUTE_DTYPES, UNARY_KERNELS  # noqa: E402
from backends.opencl import OpenCLDevice  # noqa: E402

DTYPES = [np.float32, np.float64]
#: every storage dtype (runtime/dtypes.py)
ALL_DTYPES = runtime.dtypes.DTYPES
SHAPE = (3, 5)


@pytest.fixture(scope="module")
def dev() -> OpenCLDevice:
    return backends.get_device("opencl")


def tolerance(dtype) -> dict:
    # NOTE: an atol too: summation order differs from NumPy's, and sums may cancel near 0
    if np.dtype(dtype) == np.float32:
        return {"rtol": 2e-6, "atol": 1e-6}
    return {"rtol": 1e-10, "atol": 1e-12}


# ---------------------------------------------------------------------- layouts
def layout(name: str, shape: tuple) -> tuple[int, tuple]:
    """(offset, strides) in elements of a view called `name` of `shape`."""
    c_order = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    if name == "contiguous":
        return 0, c_order
    if name == "offset":
        return 7, c_order
    if name == "strided":  # every other element along the last axis, rows padded, offset 1
        strides = [2] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1] + 3
        return 1, tuple(strides)
    if name == "transposed":  # Fortran order
        return 0, tuple(int(np.prod(shape[:i])) for i in range(len(shape)))
    if name == "broadcast":  # the last row seen again and again, at an offset
        return 2, (0,) * (len(shape) - 1) + (1,)
    raise ValueError(name)


INPUTS = ["contiguous", "offset", "strided", "transposed", "broadcast"]
OUTPUTS = ["contiguous", "offset", "strided"]


class Placed:
    """A host base array, a device copy of it, and the same view of both."""

    def __init__(self, dev: OpenCLDevice, shape: tuple, dtype, where: str, values=None,
                 seed: int = 0, positive: bool = False) -> None:
        offset, strides = layout(where, shape)
        size = offset + 1
        if all(shape):
            size += sum((n - 1) * s for n, s in zip(shape, strides))
        rng = np.random.default_rng(seed)
        base = rng.uniform(-3, 3, size) if values is None else values(rng, size)
        if positive:
            base = np.abs(base) + 0.1
        self.base = np.asarray(base).astype(dtype)
        self.dev = dev
        self.raw = dev.raw_alloc(self.base.nbytes)
        dev.copyin(self.raw, 0, self.base)
        item = self.base.itemsize
        byte_strides = tuple(s * item for s in strides)
        self.host = np.ndarray(shape, self.base.dtype, buffer=self.base, offset=offset * item,
                               strides=byte_strides)
        self.view = dev.array_view(self.raw, offset * item, shape, self.base.dtype, byte_strides)

    def base_on_device(self) -> np.ndarray:
        return self.dev.copyout(self.raw, 0, self.base.nbytes).view(self.base.dtype)


def check_written(out: Placed, expected: np.ndarray, dtype=np.float32) -> None:
    """`out`'s view holds `expected`, and nothing else of its buffer changed."""
    out.host[...] = expected
    np.testing.assert_allclose(out.base_on_device(), out.base, **tolerance(dtype))


# ---------------------------------------------------------------------- the device
def test_opencl_is_available_and_named(dev):
    assert "opencl" in backends.available()
    assert OpenCLDevice.device_count() >= 1
    assert dev.name == "opencl:0"
    assert backends.get_device("opencl:0") is dev


def test_a_missing_opencl_index_says_how_many_exist():
    count = OpenCLDevice.device_count()
    with pytest.raises(ValueError, match=f"{count} device"):
        backends.get_device(f"opencl:{count}")


def test_alignment_and_memory_come_from_the_device(dev):
    assert dev.alignment == dev.cl_device.mem_base_addr_align // 8
    assert dev.total_memory == dev.cl_device.global_mem_size
    raws = [dev.raw_alloc(n) for n in (0, 1, 100, 4096)]
    addresses = [dev.address(raw) for raw in raws]
    assert all(a % dev.alignment == 0 for a in addresses)
    assert len(set(addresses)) == len(addresses)
    # the caching allocator's 512-byte granule is a multiple of it, so the allocator accepts it
    assert 512 % dev.alignment == 0
    alloc = allocators.create("caching", dev)
    a = alloc.allocate(10)
    assert a.ptr % dev.alignment == 0
    alloc.free(a)


def test_a_huge_buffer_is_a_memory_error(dev):
    with pytest.raises(MemoryError, match="opencl:0"):
        dev.raw_alloc(dev.cl_device.max_mem_alloc_size + 1)


def test_native_views_are_pyopencl_arrays_over_the_buffer(dev):
    placed = Placed(dev, SHAPE, np.float32, "strided")
    assert isinstance(placed.view, cl.array.Array)
    assert placed.view.base_data is placed.raw.buffer
    assert placed.view.strides == placed.host.strides


@pytest.mark.parametrize("where", INPUTS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.uint8, np.bool_])
def test_to_host_of_any_view(dev, where, dtype):
    placed = Placed(dev, (4, 3, 2), dtype, where,
                    values=lambda rng, n: rng.integers(0, 2 if dtype is np.bool_ else 100, n))
    np.testing.assert_array_equal(dev.to_host(placed.view), placed.host)


# ---------------------------------------------------------------------- elementwise
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", INPUTS)
@pytest.mark.parametrize("name", UNARY_KERNELS)
def test_unary_kernels_on_every_layout(dev, name, where, dtype):
    x = Placed(dev, SHAPE, dtype, where, positive=name in ("log", "sqrt"))
    out = Placed(dev, SHAPE, dtype, OUTPUTS[INPUTS.index(where) % 3], seed=1)
    dev.unary(name, x.view, out.view)
    check_written(out, UNARY_REFERENCE[name](x.host.astype(np.float64)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", OUTPUTS)
def test_unary_kernels_in_place(dev, where, dtype):
    for name in UNARY_KERNELS:
        x = Placed(dev, SHAPE, dtype, where, positive=True)
        expected = UNARY_REFERENCE[name](x.host.astype(np.float64))
        dev.unary(name, x.view, x.view)
        check_written(x, expected, dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("where", INPUTS)
def test_copy_moves_any_dtype(dev, where, dtype):
    x = Placed(dev, (2, 3, 4), dtype, where, values=lambda rng, n: rng.integers(0, 2, n))
    out = Placed(dev, (2, 3, 4), dtype, "strided", values=lambda rng, n: rng.integers(0, 2, n),
                 seed=5)
    dev.unary("copy", x.view, out.view)
    out.host[...] = x.host
    np.testing.assert_array_equal(out.base_on_device(), out.base)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", INPUTS)
@pytest.mark.parametrize("name", BINARY_KERNELS)
def test_binary_kernels_on_every_layout(dev, name, where, dtype):
    a = Placed(dev, SHAPE, dtype, where)
    b = Placed(dev, SHAPE, dtype, INPUTS[(INPUTS.index(where) + 1) % 5], seed=2, positive=True)
    out = Placed(dev, SHAPE, dtype, OUTPUTS[INPUTS.index(where) % 3], seed=3)
    dev.binary(name, a.view, b.view, out.view)
    check_written(out, BINARY_REFERENCE[name](a.host.astype(np.float64), b.host), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", BINARY_KERNELS)
def test_binary_kernels_take_a_number_on_either_side(dev, name, dtype):
    a = Placed(dev, SHAPE, dtype, "strided", positive=True)
    number = np.dtype(dtype).type(1.5)
    for args, reference in (((a.view, number), (a.host, 1.5)), ((number, a.view), (1.5, a.host))):
        out = Placed(dev, SHAPE, dtype, "offset", seed=4)
        dev.binary(name, *args, out.view)
        check_written(out, BINARY_REFERENCE[name](*np.broadcast_arrays(*reference)), dtype)


def test_zero_dim_and_empty_views(dev):
    x = Placed(dev, (), np.float32, "contiguous")
    out = Placed(dev, (), np.float32, "contiguous", seed=1)
    dev.unary("exp", x.view, out.view)
    check_written(out, np.exp(x.host))
    empty = dev.array_view(dev.raw_alloc(0), 0, (0, 3), np.float32, (12, 4))
    dev.binary("add", empty, empty, empty)
    assert dev.to_host(empty).shape == (0, 3)


def test_sigmoid_saturates_like_numpy(dev):
    x = Placed(dev, (5,), np.float32, "contiguous",
               values=lambda rng, n: np.array([-1e4, -100, 0, 100, 1e4]))
    dev.unary("sigmoid", x.view, x.view)
    np.testing.assert_allclose(dev.to_host(x.view), [0, 0, 0.5, 1, 1], atol=1e-7)


def test_float64_needs_device_support(dev):
    assert (np.dtype(np.float64) in dev.capabilities.compute_dtypes) == dev.fp64
    fresh = OpenCLDevice(0)
    # NOTE: as on a device without cl_khr_fp64
    fresh.fp64 = False
    fresh.capabilities = dataclasses.replace(fresh.capabilities,
                                             compute_dtypes=COMPUTE_DTYPES[:-1])
    x = Placed(fresh, SHAPE, np.float64, "contiguous")
    with pytest.raises(TypeError, match="computes on float16, bfloat16, float32, not float64 "
                                        r"\(opencl:0 lacks float64 arithmetic"):
        fresh.unary("exp", x.view, x.view)
    with pytest.raises(TypeError, match="computes on float16, bfloat16, float32, not int32"):
        ints = Placed(fresh, SHAPE, np.int32, "contiguous").view
        fresh.unary("exp", ints, ints)


# ---------------------------------------------------------------------- matmul
MATMUL_SHAPES = [((3, 4), (4, 2)), ((37, 19), (19, 23)), ((1, 1), (1, 1)), ((5, 0), (0, 3)),
                 ((2, 3, 4), (2, 4, 5)), ((2, 1, 17, 3), (3, 3, 18)), ((4,), (4, 6)),
                 ((3, 5, 4), (4,)), ((7,), (7,)), ((2, 33, 16), (16, 40))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("a_shape", "b_shape"), MATMUL_SHAPES)
@pytest.mark.parametrize("where", ["contiguous", "offset", "strided", "transposed"])
def test_matmul_matches_numpy(dev, a_shape, b_shape, where, dtype):
    a = Placed(dev, a_shape, dtype, where)
    b = Placed(dev, b_shape, dtype, "transposed" if where == "contiguous" else "offset", seed=1)
    expected = np.matmul(a.host.astype(np.float64), b.host)
    out = Placed(dev, expected.shape, dtype, "strided" if where == "offset" else "offset", seed=2)
    dev.matmul(a.view, b.view, out.view)
    out.host[...] = expected
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == np.float32 else {"rtol": 1e-10, "atol": 1e-10}
    np.testing.assert_allclose(out.base_on_device(), out.base, **tol)


@pytest.fixture(scope="module")
def other_gemm() -> OpenCLDevice:
    """A device running the GEMM variant this one does not (local-memory tiles on a CPU)."""
    fresh = OpenCLDevice(0)
    fresh.tiled_gemm = not fresh.tiled_gemm
    return fresh


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("a_shape", "b_shape"), MATMUL_SHAPES)
def test_the_other_gemm_variant_matches_numpy(other_gemm, a_shape, b_shape, dtype):
    a = Placed(other_gemm, a_shape, dtype, "strided")
    b = Placed(other_gemm, b_shape, dtype, "transposed", seed=1)
    expected = np.matmul(a.host.astype(np.float64), b.host)
    out = Placed(other_gemm, expected.shape, dtype, "offset", seed=2)
    other_gemm.matmul(a.view, b.view, out.view)
    out.host[...] = expected
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == np.float32 else {"rtol": 1e-10, "atol": 1e-10}
    np.testing.assert_allclose(out.base_on_device(), out.base, **tol)


def test_matmul_of_a_broadcast_operand(dev):
    a = Placed(dev, (4, 6), np.float32, "broadcast")  # every row the same
    b = Placed(dev, (6, 3), np.float32, "contiguous", seed=1)
    out = Placed(dev, (4, 3), np.float32, "contiguous", seed=2)
    dev.matmul(a.view, b.view, out.view)
    np.testing.assert_allclose(dev.to_host(out.view), a.host @ b.host, rtol=1e-5)


# ---------------------------------------------------------------------- reductions
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", INPUTS)
@pytest.mark.parametrize("axis", [None, (0,), (1,), (2,), (0, 2), (1, 2), ()])
@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("name", ["sum", "mean"])
def test_reductions_match_numpy(dev, name, axis, keepdims, where, dtype):
    x = Placed(dev, (3, 4, 5), dtype, where)
    expected = getattr(np, name)(x.host.astype(np.float64), axis=axis, keepdims=keepdims)
    out = Placed(dev, np.shape(expected), dtype, "offset" if where == "strided" else "strided")
    dev.reduce(name, x.view, axis, keepdims, out.view)
    check_written(out, expected, dtype)


def test_a_long_sum_is_accurate(dev):
    x = Placed(dev, (1_000_000,), np.float32, "contiguous",
               values=lambda rng, n: rng.uniform(0, 1, n))
    out = Placed(dev, (), np.float32, "contiguous")
    dev.reduce("sum", x.view, None, False, out.view)
    assert dev.to_host(out.view) == pytest.approx(x.host.astype(np.float64).sum(), rel=1e-6)


# ---------------------------------------------------------------------- cross entropy
def reference_xent(logits: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    shifted = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
    losses = np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(len(labels)), labels]
    return losses, probs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("label_dtype", [np.int64, np.int32])
@pytest.mark.parametrize("where", ["contiguous", "offset", "strided", "transposed"])
def test_cross_entropy_and_its_backward(dev, where, label_dtype, dtype):
    rows, classes = 6, 5
    logits = Placed(dev, (rows, classes), dtype, where,
                    values=lambda rng, n: rng.uniform(-50, 50, n))
    labels = Placed(dev, (rows,), label_dtype, where,
                    values=lambda rng, n: rng.integers(0, classes, n))
    losses = Placed(dev, (rows,), dtype, "strided", seed=1)
    probs = Placed(dev, (rows, classes), dtype, "offset", seed=2)
    dev.cross_entropy(logits.view, labels.view, losses.view, probs.view)
    expected_losses, expected_probs = reference_xent(logits.host.astype(np.float64), labels.host)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == np.float32 else {"rtol": 1e-10, "atol": 1e-12}
    np.testing.assert_allclose(dev.to_host(losses.view), expected_losses, **tol)
    np.testing.assert_allclose(dev.to_host(probs.view), expected_probs, **tol)

    grad = Placed(dev, (rows,), dtype, "strided", seed=3)
    out = Placed(dev, (rows, classes), dtype, "strided", seed=4)
    dev.cross_entropy_backward(probs.view, labels.view, grad.view, out.view)
    expected = expected_probs.copy()
    expected[np.arange(rows), labels.host] -= 1
    np.testing.assert_allclose(dev.to_host(out.view), expected * grad.host[:, None], **tol)


@pytest.mark.parametrize("bad", [-1, 5, 7])
def test_cross_entropy_names_a_label_out_of_range(dev, bad):
    logits = Placed(dev, (4, 5), np.float32, "contiguous")
    labels = Placed(dev, (4,), np.int64, "contiguous",
                    values=lambda rng, n: np.array([0, 4, bad, 9]))
    losses = Placed(dev, (4,), np.float32, "contiguous")
    probs = Placed(dev, (4, 5), np.float32, "contiguous")
    with pytest.raises(ValueError, match=rf"label {bad} is outside \[0, 5\)"):
        dev.cross_entropy(logits.view, labels.view, losses.view, probs.view)
    labels.host[...] = [0, 4, 1, 2]  # the next good call is not disturbed by the bad one
    dev.copyin(labels.raw, 0, labels.base)
    dev.cross_entropy(logits.view, labels.view, losses.view, probs.view)
    expected, _ = reference_xent(logits.host, labels.host)
    np.testing.assert_allclose(dev.to_host(losses.view), expected, rtol=1e-5)


# ---------------------------------------------------------------------- the kernel cache
def test_kernels_are_built_once_and_counted():
    fresh = OpenCLDevice(0)  # a cache of its own
    assert fresh.kernel_cache_stats() == {"kernels": 0, "hits": 0, "misses": 0}
    x = Placed(fresh, SHAPE, np.float32, "contiguous")
    fresh.unary("exp", x.view, x.view)
    assert fresh.kernel_cache_stats() == {"kernels": 1, "hits": 0, "misses": 1}
    y = Placed(fresh, (7, 2), np.float32, "offset")  # another shape, the same 1-D kernel
    for _ in range(3):
        fresh.unary("exp", y.view, y.view)
    assert fresh.kernel_cache_stats() == {"kernels": 1, "hits": 3, "misses": 1}
    fresh.unary("exp", Placed(fresh, SHAPE, np.float32, "transposed").view, x.view)  # 2-D
    fresh.unary("tanh", x.view, x.view)
    fresh.unary("exp", Placed(fresh, SHAPE, np.float64, "contiguous").view,
                Placed(fresh, SHAPE, np.float64, "contiguous").view)
    assert fresh.kernel_cache_stats() == {"kernels": 4, "hits": 3, "misses": 4}


# ---------------------------------------------------------------------- recycling (issue 447)
SLOW_KERNEL = """
__kernel void slow(__global const float* src, long src_o, __global float* dst, int spins)
{
    long i = get_global_id(0);
    float acc = 0.0f;
    for (int s = 0; s < spins; s++) acc = acc * 0.5f + 1e-3f;  /* busy: about 2e-3 */
    dst[i] = src[src_o + i] + (acc > 1.0f ? 1.0f : 0.0f);  /* read src only at the end */
}
"""


def test_memory_recycled_under_a_queued_kernel_keeps_the_old_data(dev):
    """pyopencl issue 447: a pool hands a freed buffer out again while a queued kernel still
    reads it, and the new owner's write lands first. Here the kernel must see the old data."""
    n = 4096
    alloc = allocators.create("caching", dev)
    program = cl.Program(dev.context, SLOW_KERNEL).build()
    source = alloc.allocate(n * 4)
    dev.copyin(source.raw, source.offset, np.full(n, 1.0, np.float32))
    result = alloc.allocate(n * 4)
    old_address = source.ptr

    spins = 1 << 12
    pending = False
    while not pending:  # until the kernel is slow enough to be still queued at the free
        assert spins < 1 << 28, "the slow kernel always finished before the free"
        spins *= 4
        event = program.slow(dev.queue, (n,), None, source.raw.buffer, np.int64(source.offset // 4),
                             result.raw.buffer, np.int32(spins))
        alloc.free(source)
        pending = event.command_execution_status != cl.command_execution_status.COMPLETE
        # the caching allocator hands the same memory out again; the runtime writes into it
        fresh = runtime.tensor(np.full(n, 7.0, np.float32), allocator=alloc)
        assert fresh.block._allocation.ptr == old_address, "the memory was not reused"
        got = dev.copyout(result.raw, result.offset, n * 4).view(np.float32)
        np.testing.assert_array_equal(got, 1.0)  # the old data, never the new 7.0
        np.testing.assert_array_equal(fresh.numpy(), 7.0)
        fresh.release()
        source = alloc.allocate(n * 4)
        assert source.ptr == old_address
        dev.copyin(source.raw, source.offset, np.full(n, 1.0, np.float32))


# ------------------------------------------------------------------ constants in READ_ONLY buffers
def buffer_flags(t: runtime.Tensor) -> int:
    """The cl.mem_flags of the real cl.Buffer under tensor `t`, as OpenCL reports them."""
    return t.block.memory_for_read().raw.buffer.get_info(cl.mem_info.FLAGS)


@pytest.fixture
def ro_pool(dev) -> runtime.ConstantPool:
    return runtime.ConstantPool(device=dev)


def test_constants_live_in_read_only_buffers_and_tensors_do_not(dev, ro_pool):
    assert buffer_flags(runtime.constant(np.ones(3, np.float32), device=dev)) & \
        cl.mem_flags.READ_ONLY  # the default pool too
    c = ro_pool.constant(np.arange(6, dtype=np.float32))
    assert buffer_flags(c) & cl.mem_flags.READ_ONLY
    assert not buffer_flags(c) & (cl.mem_flags.READ_WRITE | cl.mem_flags.WRITE_ONLY)
    assert dev.is_read_only(c.block.memory_for_read().raw)
    t = runtime.tensor(np.arange(6, dtype=np.float32), device=dev)
    assert buffer_flags(t) & cl.mem_flags.READ_WRITE
    assert not buffer_flags(t) & cl.mem_flags.READ_ONLY
    assert not dev.is_read_only(t.block.memory_for_read().raw)
    np.testing.assert_array_equal(c.numpy(), np.arange(6))  # the host reads it back
    ro_pool.check_invariants()


@pytest.mark.parametrize("dtype", DTYPES)
def test_ops_reading_constants_match_numpy(dev, ro_pool, dtype):
    rng = np.random.default_rng(3)
    w, b, a = (rng.uniform(-1, 1, shape).astype(dtype) for shape in ((4, 3), (3,), (5, 4)))
    cw, cb = ro_pool.constant(w), ro_pool.constant(b)
    x = runtime.tensor(a, device=dev)
    tol = tolerance(dtype)
    ops = runtime.ops
    # NOTE: an ordinary tensor first: a result takes its first operand's allocator
    np.testing.assert_allclose(ops.matmul(x, cw).numpy(), a @ w, **tol)
    np.testing.assert_allclose(ops.matmul(x[:, ::2], cw[::2]).numpy(), a[:, ::2] @ w[::2], **tol)
    np.testing.assert_allclose(ops.add(ops.matmul(x, cw), cb).numpy(), a @ w + b, **tol)  # bcast
    np.testing.assert_allclose(ops.mul(x.T[:, :3], cw).numpy(), a.T[:, :3] * w, **tol)
    np.testing.assert_allclose(ops.sub(x[0, :3], cb[::-1]).numpy(), a[0, :3] - b[::-1], **tol)
    np.testing.assert_allclose(ops.sum(ops.add(x[:, :3], cb)).item(), (a[:, :3] + b).sum(),
                               rtol=1e-5)


def test_dedup_and_exact_accounting_in_read_only_buffers(dev, ro_pool):
    alloc = ro_pool.allocator
    a = ro_pool.constant(np.arange(8, dtype=np.float32))
    b = ro_pool.constant(np.arange(8, dtype=np.float32).reshape(2, 4))  # a verified digest hit
    c = ro_pool.constant(np.arange(3, dtype=np.float64))
    assert a.block is b.block and c.block is not a.block
    stats = ro_pool.stats()
    assert (stats["constants"], stats["bytes"], stats["hits"], stats["misses"]) == (2, 56, 1, 2)
    s = alloc.stats()
    assert (s["allocated_bytes"], s["reserved_bytes"], s["num_allocs"]) == (56, 56, 2)
    alloc.check_invariants()
    ro_pool.check_invariants()
    a.release()
    assert alloc.stats()["allocated_bytes"] == 56  # b still uses the block
    b.release()
    c.release()
    s = alloc.stats()
    assert (s["allocated_bytes"], s["reserved_bytes"], s["num_frees"]) == (0, 0, 2)
    assert len(ro_pool) == 0
    again = ro_pool.constant(np.arange(8, dtype=np.float32))  # a new buffer, filled again
    assert buffer_flags(again) & cl.mem_flags.READ_ONLY
    np.testing.assert_array_equal(again.numpy(), np.arange(8))


def test_a_write_into_a_constant_is_refused_before_any_kernel_is_enqueued(dev, ro_pool):
    c = ro_pool.constant(np.arange(4, dtype=np.float32))
    x = runtime.tensor(np.full(4, 7.0, np.float32), device=dev)
    ops = runtime.ops
    writes = [lambda: ops.add(x, x, out=c), lambda: ops.relu(c, out=c),
              lambda: ops.copy(x, out=c), lambda: c.__setitem__(slice(1, 3), 5.0),
              lambda: ops.mul(x[:2], 2.0, out=c[2:])]
    for write in writes:
        launched = dev.kernel_cache_stats()
        with pytest.raises(runtime.ReadOnlyError, match="constants are immutable"):
            write()
        after = dev.kernel_cache_stats()
        assert after["hits"] + after["misses"] == launched["hits"] + launched["misses"]
    dev.synchronize()
    np.testing.assert_array_equal(c.numpy(), np.arange(4))


@pytest.mark.parametrize("plan", ["none", "recycle", "static"])
def test_graphs_reading_constants_run_under_every_plan(dev, ro_pool, plan):
    ops = runtime.ops
    w_host = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
    w = ro_pool.constant(w_host)

    def step(a):
        bias = ro_pool.constant(np.full(3, 0.25, np.float32))  # made inside the capture
        h = ops.tanh(ops.add(ops.matmul(a, w), bias))         # a fused chain reads `bias`
        return ops.sum(ops.mul(bias, h))                      # a constant as first operand

    graph = runtime.graph(step, plan=plan, device=dev)
    for value in (1.0, -0.5, 1.0):
        a = np.full((5, 4), value, np.float32)
        expected = (0.25 * np.tanh(a @ w_host + 0.25)).sum()
        assert graph(a).item() == pytest.approx(expected, rel=1e-5)
    assert all(dev.is_read_only(block.memory_for_read().raw) for block in ro_pool.blocks())
    np.testing.assert_array_equal(w.numpy(), w_host)
    ro_pool.check_invariants()


def test_results_computed_from_a_constant_are_read_write_buffers(dev, ro_pool):
    c = ro_pool.constant(np.arange(4, dtype=np.float32))
    result = runtime.ops.add(c, runtime.tensor(np.ones(4, np.float32), device=dev))
    assert buffer_flags(result) & cl.mem_flags.READ_WRITE
