"""The CUDA backend (CuPy): kernels against the NumPy device, raw memory, views, the runtime.

Without CuPy or a GPU only the import and availability checks run; every other test skips with
the reason below.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import allocators
import backends
import runtime
from backends.base import BINARY_KERNELS, UNARY_KERNELS
from helpers import assert_rounded_product, float_chain, half_chain, product_layouts

NO_CUDA = "no CUDA device (cupy not installed or no GPU)"
needs_cuda = pytest.mark.skipif("cuda" not in backends.available(), reason=NO_CUDA)
FLOATS = (np.float32, np.float64)


# ---------------------------------------------------------------------- runs everywhere
def test_the_module_imports_without_importing_cupy():
    code = "import sys, backends.cuda; print('cupy' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"


def test_cuda_is_in_the_table_and_available_only_with_a_device():
    from backends.cuda import CudaDevice

    assert backends.BACKENDS["cuda"] == "backends.cuda:CudaDevice"
    count = CudaDevice.device_count()
    assert ("cuda" in backends.available()) == (count > 0)
    if count == 0:
        with pytest.raises(backends.BackendUnavailableError, match="cuda"):
            backends.get_device("cuda")


# ---------------------------------------------------------------------- needs a GPU
@pytest.fixture(scope="module")
def gpu():
    if "cuda" not in backends.available():
        pytest.skip(NO_CUDA)
    return backends.get_device("cuda")


@pytest.fixture(scope="module")
def cpu():
    return backends.get_device("cpu")


def _raw_on(device, host: np.ndarray):
    """Raw memory on `device` holding a copy of the bytes of `host`."""
    raw = device.raw_alloc(max(host.nbytes, 1))
    device.copyin(raw, 0, host)
    return raw


def _on(device, host: np.ndarray):
    """A native view on `device` holding a copy of `host` (C order)."""
    host = np.require(host, requirements="C")  # NOTE: ascontiguousarray makes 0-d 1-d
    return device.array_view(_raw_on(device, host), 0, host.shape, host.dtype, host.strides)


def _empty(device, shape, dtype):
    dtype = np.dtype(dtype)
    return _on(device, np.zeros(shape, dtype))


def _check(gpu, got, want, dtype):
    tol = 1e-5 if np.dtype(dtype) == np.float32 else 1e-12
    np.testing.assert_allclose(gpu.to_host(got), want, rtol=tol, atol=tol)


@needs_cuda
def test_raw_memory_is_aligned_and_copies_round_trip(gpu):
    raw = gpu.raw_alloc(4096)
    assert gpu.address(raw) % gpu.alignment == 0 and gpu.nbytes_of(raw) == 4096
    data = np.arange(256, dtype=np.uint8)
    gpu.copyin(raw, 1000, data)
    np.testing.assert_array_equal(gpu.copyout(raw, 1000, 256), data)
    with pytest.raises(ValueError, match="outside"):
        gpu.copyout(raw, 4000, 256)
    gpu.raw_free(raw)


@needs_cuda
def test_views_share_raw_memory_at_an_offset_with_strides(gpu):
    raw = gpu.raw_alloc(1024)
    gpu.copyin(raw, 0, np.arange(128, dtype=np.float64))
    view = gpu.array_view(raw, 16, (3, 2), np.float64, (32, 16))  # start at element 2
    np.testing.assert_array_equal(gpu.to_host(view), [[2, 4], [6, 8], [10, 12]])
    view[0, 0] = -1
    gpu.synchronize()
    assert gpu.copyout(raw, 16, 8).view(np.float64)[0] == -1


@needs_cuda
def test_copies_wait_for_a_write_on_cupys_default_stream(gpu):
    """A native view written through CuPy outside the device's stream (CuPy's default, the
    legacy null stream) is written before a later copy out reads it, with no synchronize:
    the device's stream is a blocking one. Its non-blocking stream let the copy run first (the
    test above failed once in seven loaded runs); here the write comes from a kernel that spins
    for about a tenth of a second first, so the old order fails every time."""
    import cupy as cp

    spin = cp.RawKernel(r"""
    extern "C" __global__ void spin_then_write(double* p, long long cycles) {
        long long start = clock64();
        while (clock64() - start < cycles) {}
        p[0] = -1.0;
    }""", "spin_then_write")
    raw = gpu.raw_alloc(64)
    gpu.copyin(raw, 0, np.zeros(8))
    view = gpu.array_view(raw, 0, (8,), np.float64, (8,))
    with gpu.cuda_device, cp.cuda.Stream.null:
        spin((1,), (1,), (view, np.int64(200_000_000)))
    assert gpu.copyout(raw, 0, 8).view(np.float64)[0] == -1


@needs_cuda
def test_out_of_memory_is_a_memory_error(gpu):
    with pytest.raises(MemoryError, match="cudaMalloc"):
        gpu.raw_alloc(1 << 60)


@needs_cuda
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", UNARY_KERNELS)
def test_unary_kernels_match_numpy(gpu, cpu, name, dtype):
    host = np.linspace(0.1 if name in ("log", "sqrt") else -3, 3, 24, dtype=dtype).reshape(4, 6)
    want = _empty(cpu, host.shape, dtype)
    cpu.unary(name, host, want)
    x, out = _on(gpu, host), _empty(gpu, host.shape, dtype)
    gpu.unary(name, x[:, ::2], out[:, ::2])  # strided views too
    gpu.unary(name, x[:, 1::2], out[:, 1::2])
    _check(gpu, out, want, dtype)
    gpu.unary(name, x, x)  # in place
    _check(gpu, x, want, dtype)


@needs_cuda
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", BINARY_KERNELS)
def test_binary_kernels_match_numpy_with_broadcasting(gpu, cpu, name, dtype):
    rng = np.random.default_rng(0)
    a = rng.uniform(-2, 2, (5, 4)).astype(dtype)
    b = rng.uniform(0.5, 2, (1, 4)).astype(dtype)
    b_full = np.broadcast_to(b, a.shape)
    want = _empty(cpu, a.shape, dtype)
    cpu.binary(name, a, b_full, want)
    b_broadcast = gpu.array_view(_raw_on(gpu, b), 0, a.shape, dtype, (0, b.strides[1]))
    out = _empty(gpu, a.shape, dtype)
    gpu.binary(name, _on(gpu, a), b_broadcast, out)
    _check(gpu, out, want, dtype)


@needs_cuda
@pytest.mark.parametrize("dtype", FLOATS)
def test_matmul_matches_numpy_for_transposed_and_batched_views(gpu, dtype):
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((6, 4)).astype(dtype), rng.standard_normal((6, 5)).astype(dtype)
    out = _empty(gpu, (4, 5), dtype)
    gpu.matmul(_on(gpu, a).T, _on(gpu, b), out)
    _check(gpu, out, a.T @ b, dtype)
    x = rng.standard_normal((3, 2, 4)).astype(dtype)
    y = rng.standard_normal((3, 4, 2)).astype(dtype)
    out = _empty(gpu, (3, 2, 2), dtype)
    gpu.matmul(_on(gpu, x), _on(gpu, y), out)
    _check(gpu, out, x @ y, dtype)


@needs_cuda
@pytest.mark.parametrize("name", ["sum", "mean"])
@pytest.mark.parametrize("axis, keepdims", [(None, False), ((0,), False), ((1,), True),
                                            ((0, 2), False)])
def test_reductions_match_numpy(gpu, cpu, name, axis, keepdims):
    host = np.arange(24, dtype=np.float64).reshape(2, 3, 4) / 7
    want = getattr(np, name)(host, axis=axis, keepdims=keepdims)
    out = _empty(gpu, np.shape(want), np.float64)
    gpu.reduce(name, _on(gpu, host), axis, keepdims, out)
    _check(gpu, out, want, np.float64)


@needs_cuda
@pytest.mark.parametrize("dtype", FLOATS)
def test_cross_entropy_and_its_backward_match_numpy(gpu, cpu, dtype):
    rng = np.random.default_rng(2)
    logits = (rng.standard_normal((8, 5)) * 30).astype(dtype)  # large: the stable path matters
    labels = rng.integers(0, 5, 8)
    grad = rng.uniform(0, 1, 8).astype(dtype)
    losses, probs = _empty(cpu, (8,), dtype), _empty(cpu, (8, 5), dtype)
    cpu.cross_entropy(logits, labels, losses, probs)
    back = _empty(cpu, (8, 5), dtype)
    cpu.cross_entropy_backward(probs, labels, grad, back)
    g_losses, g_probs = _empty(gpu, (8,), dtype), _empty(gpu, (8, 5), dtype)
    g_labels = _on(gpu, labels)
    gpu.cross_entropy(_on(gpu, logits), g_labels, g_losses, g_probs)
    _check(gpu, g_losses, losses, dtype)
    _check(gpu, g_probs, probs, dtype)
    g_back = _empty(gpu, (8, 5), dtype)
    gpu.cross_entropy_backward(g_probs, g_labels, _on(gpu, grad), g_back)
    _check(gpu, g_back, back, dtype)
    with pytest.raises(ValueError, match="label 7"):
        gpu.cross_entropy(_on(gpu, logits), _on(gpu, np.full(8, 7)), g_losses, g_probs)


@needs_cuda
def test_allocators_pool_cuda_memory(gpu):
    alloc = allocators.create("caching", gpu)
    a = alloc.allocate(1 << 20)
    first = a.ptr
    alloc.free(a)
    b = alloc.allocate(1 << 20)
    assert alloc.stats()["cache_hits"] == 1 and b.ptr == first
    alloc.free(b)
    alloc.empty_cache()
    assert alloc.stats()["reserved_bytes"] == 0
    alloc.check_invariants()


@needs_cuda
def test_runtime_ops_and_autograd_on_cuda(gpu):
    rng = np.random.default_rng(3)
    xh, wh = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((3, 2))
    x = runtime.tensor(xh, device=gpu)
    w = runtime.tensor(wh.astype(np.float32), device=gpu, requires_grad=True)
    loss = runtime.ops.sum(runtime.ops.tanh(runtime.ops.matmul(x, w)))
    loss.backward()
    y = np.tanh(xh @ wh.astype(np.float32))
    np.testing.assert_allclose(loss.item(), y.sum(), rtol=1e-5)
    np.testing.assert_allclose(w.grad.numpy(), xh.T @ (1 - y * y), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(x[1:, ::2].numpy(), xh[1:, ::2])


@needs_cuda
def test_training_steps_on_cuda_match_the_cpu(gpu):
    from runtime import nn

    rng = np.random.default_rng(4)
    xh = rng.standard_normal((32, 8)).astype(np.float32)
    yh = rng.integers(0, 3, 32)
    losses = {}
    for device in ("cpu", gpu):
        model = nn.Sequential(nn.Dense(8, 16, device=device), nn.Sigmoid(),
                              nn.Dense(16, 3, device=device))
        for p, seed in zip(model.parameters(), range(10)):
            with runtime.no_grad():
                init = np.random.default_rng(seed).uniform(-0.5, 0.5, p.shape)
                runtime.ops.copy(runtime.tensor(init.astype(np.float32), device=device), out=p)
        opt = nn.SGD(model.parameters(), lr=0.5, momentum=0.9)
        x, y = runtime.tensor(xh, device=device), runtime.tensor(yh, device=device)
        history = []
        for _ in range(5):
            opt.zero_grad()
            loss = nn.softmax_cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            history.append(loss.item())
        losses[str(device)] = history
    np.testing.assert_allclose(losses[str(gpu)], losses["cpu"], rtol=1e-4)


@needs_cuda
@pytest.mark.parametrize("name", ["exp", "tanh", "sigmoid", "relu", "add", "mul", "div",
                                  "matmul", "sum", "mean", "chain"])
def test_float16_computes_in_float32_and_rounds_once(gpu, name):
    """The rule of HALVES in backends/base.py on CUDA: a float16 op gives its float32 result
    (from the same values) rounded once, bit for bit, not CuPy's own float16 arithmetic; a
    product (one GemmEx, float32 accumulation in cuBLAS's order) the exact product rounded to
    a neighbour; the exactly rounded ones (add, mul, a chain of them, each op rounding) give
    the CPU's bits too, and a captured graph the eager bits."""
    ops = runtime.ops
    rng = np.random.default_rng(5)
    hosts = [rng.normal(0, 2, (6, 70)).astype(np.float16) for _ in range(2)]

    def run(x, y):
        calls = {"matmul": lambda: ops.matmul(x, y.T), "sum": lambda: ops.sum(x, axis=1),
                 "mean": lambda: ops.mean(x),
                 "chain": lambda: ops.add(ops.mul(ops.sub(x, y), 0.1), ops.mul(x, x))}
        if name in calls:
            return calls[name]()
        f = getattr(ops, name)
        return f(x) if name in UNARY_KERNELS else f(x, y)

    half = [runtime.tensor(h, device=gpu) for h in hosts]
    got = run(*half).numpy()
    assert got.dtype == np.float16
    if name == "matmul":  # NOTE: one GemmEx, in cuBLAS's order: the exact product, rounded
        assert_rounded_product(got, hosts[0], hosts[1].T)
    elif name != "chain":  # each op of the chain rounds: against the CPU below
        wide = run(*(ops.cast(t, "float32") for t in half))
        np.testing.assert_array_equal(got.view(np.uint16),
                                      ops.cast(wide, "float16").numpy().view(np.uint16))
    np.testing.assert_array_equal(runtime.graph(run)(*half).numpy().view(np.uint16),
                                  got.view(np.uint16))
    if name in ("add", "mul", "chain"):
        on_cpu = run(*(runtime.tensor(h) for h in hosts)).numpy()
        np.testing.assert_array_equal(on_cpu.view(np.uint16), got.view(np.uint16))


HALF_NAMES = [n for n in UNARY_KERNELS if n != "copy"] + list(BINARY_KERNELS)
EDGES = [0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65520.0, 6e-8, 1e-40, 3.3e38, -2.5]


@needs_cuda
@pytest.mark.parametrize("half", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", HALF_NAMES)
def test_half_kernels_equal_the_widened_path_bit_for_bit(gpu, name, half):
    """CUDA's half kernels (`_half_elementwise`: halves loaded into float, the float32 formula,
    one rounding) give what `Device._in_float32` gives on the same GPU (widened float32 copies,
    the float32 kernel, a rounding cast), bit for bit: edge values, a transposed operand, a
    broadcast one, a float32 one and a number."""
    from backends.cuda import has_bfloat16

    if half == "bfloat16" and not has_bfloat16():
        pytest.skip("this CuPy has no bfloat16 (CuPy 14 or newer with ml_dtypes stores it)")
    dtype = np.dtype(runtime.dtypes.BFLOAT16 if half == "bfloat16" else half)
    rng = np.random.default_rng(11)
    a = rng.normal(0, 3, (7, 33)).astype(np.float32)
    a.flat[:len(EDGES)] = EDGES
    b = rng.normal(0, 3, (33, 7)).astype(np.float32).T  # transposed
    b.flat[-len(EDGES):] = EDGES[::-1]
    if name in ("log", "sqrt"):
        a = np.abs(a)
    with np.errstate(over="ignore"):  # NOTE: 3.3e38 is an infinity in float16
        a16, b16 = a.astype(dtype), np.ascontiguousarray(b.T).astype(dtype)
    x, y = _on(gpu, a16), _on(gpu, b16).T
    broadcast = gpu.array_view(_raw_on(gpu, a16[:1].copy()), 0, a.shape, dtype,
                               (0, dtype.itemsize))
    unary = name in UNARY_KERNELS
    cases = [(x,)] if unary else [(x, y), (x, broadcast), (x, _on(gpu, b)), (x, np.float32(0.3))]
    for operands in cases:
        got, want = _empty(gpu, a.shape, dtype), _empty(gpu, a.shape, dtype)
        kernel = gpu.unary if unary else gpu.binary
        kernel(name, *operands, got)
        hook = gpu._unary if unary else gpu._binary
        gpu._in_float32(lambda *args, hook=hook: hook(name, *args), operands, (want,))
        np.testing.assert_array_equal(gpu.to_host(got).view(np.uint16),
                                      gpu.to_host(want).view(np.uint16))


@needs_cuda
@pytest.mark.parametrize("dtype", FLOATS)
def test_a_fused_chain_is_one_kernel_with_its_links_own_bits(gpu, dtype):
    """A float32 / float64 chain compiles into one kernel (`_chain_kernel`), without contracting
    a link's product into the next link's sum, so it gives the kernels' own results one by one
    bit for bit: products then sums, the activations and their derivatives, the math library's
    functions (compiled with the same options eagerly), numbers."""
    rng = np.random.default_rng(3)
    a, b = (rng.normal(0, 2, (257, 129)).astype(dtype) for _ in range(2))
    program = float_chain(dtype)
    x, y = _on(gpu, a), _on(gpu, b)
    got = _empty(gpu, a.shape, dtype)
    gpu.fused(program, [x, y], got)
    links = []
    for name, args, _ in program:
        operands = [x if (kind, ref) == ("input", 0) else y if kind == "input" else
                    links[ref] if kind == "link" else np.dtype(dtype).type(ref)
                    for kind, ref in args]
        result = _empty(gpu, a.shape, dtype)
        (gpu.unary if len(operands) == 1 else gpu.binary)(name, *operands, result)
        links.append(result)
    bits = np.uint32 if dtype == np.float32 else np.uint64
    np.testing.assert_array_equal(gpu.to_host(got).view(bits), gpu.to_host(links[-1]).view(bits))


def _widened(gpu, view):
    """A float32 copy of a half view (a broadcast one made whole), by an exact cast."""
    wide = _empty(gpu, view.shape, np.float32)
    gpu.cast(view, wide)
    return wide


@needs_cuda
@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_a_half_chain_is_one_kernel_rounding_each_link_as_its_own_kernel(gpu, half,
                                                                        monkeypatch):
    """A chain of float16 or bfloat16 links, float32 links among them, compiles into one kernel
    too (never the blocked default), rounds each two-byte link in registers as the link's own
    kernel rounds its store, and so gives the links one by one bit for bit: edge values, a
    transposed input, a broadcast one, numbers, every formula."""
    from backends.base import Device
    from backends.cuda import has_bfloat16

    if half == "bfloat16" and not has_bfloat16():
        pytest.skip("this CuPy has no bfloat16 (CuPy 14 or newer with ml_dtypes stores it)")
    dtype, f32 = np.dtype(runtime.dtypes.BFLOAT16 if half == "bfloat16" else half), np.float32
    rng = np.random.default_rng(5)
    wide = rng.normal(0, 2, (65, 130)).astype(np.float32)
    wide.flat[:len(EDGES)] = EDGES
    with np.errstate(over="ignore"):
        a = wide.astype(dtype)
    x = _on(gpu, np.ascontiguousarray(a.T)).T  # transposed
    row = gpu.array_view(_raw_on(gpu, a[1].copy()), 0, a.shape, dtype, (0, dtype.itemsize))
    program = half_chain(dtype)
    got = _empty(gpu, a.shape, dtype)

    def blocked(*args):
        raise AssertionError("the half chain ran the blocked default")

    with monkeypatch.context() as patch:
        patch.setattr(Device, "_blocked", blocked)
        gpu.fused(program, [x, row], got)
    links = []
    for name, args, link_dtype in program:
        operands = [x if (kind, ref) == ("input", 0) else row if kind == "input" else
                    links[ref] if kind == "link" else np.float32(ref) for kind, ref in args]
        if link_dtype == f32:  # NOTE: the rule: a float32 link reads its halves widened exactly
            operands = [_widened(gpu, v) if getattr(v, "dtype", f32) == dtype else v
                        for v in operands]
        result = _empty(gpu, a.shape, link_dtype)
        (gpu.unary if len(operands) == 1 else gpu.binary)(name, *operands, result)
        links.append(result)
    np.testing.assert_array_equal(gpu.to_host(got).view(np.uint16),
                                  gpu.to_host(links[-1]).view(np.uint16))


@needs_cuda
@pytest.mark.parametrize("dtype", runtime.dtypes.DTYPES, ids=str)
def test_every_dtype_round_trips_through_pytorch_on_cuda(gpu, dtype):
    """DLPack both ways with PyTorch's CUDA tensors, every storage dtype (bfloat16 included
    where this CuPy stores it): no copy, writes seen on both sides."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch has no CUDA")
    from backends.cuda import has_bfloat16

    dtype = np.dtype(dtype)
    if dtype == runtime.dtypes.BFLOAT16 and not has_bfloat16():
        pytest.skip("this CuPy has no bfloat16 (CuPy 14 or newer with ml_dtypes stores it)")
    host = (np.arange(12).reshape(3, 4) % 7).astype(dtype)
    t = runtime.tensor(host, device=gpu)
    theirs = torch.from_dlpack(t)
    assert theirs.is_cuda and theirs.data_ptr() == t.block.memory_for_read().ptr
    assert str(theirs.dtype).removeprefix("torch.") == (
        "bool" if dtype == np.bool_ else str(dtype))
    np.testing.assert_array_equal(theirs.cpu().float().numpy(), host.astype(np.float32))
    back = runtime.from_dlpack(theirs)
    assert back.dtype == dtype and back.device.name.startswith("cuda")
    # NOTE: written as bytes: PyTorch's CUDA kernels do not fill every dtype (uint32, uint64)
    value = np.array([1 if dtype != np.bool_ else not bool(host[0, 1])], dtype)
    size = dtype.itemsize
    theirs.view(torch.uint8)[0, size:2 * size] = torch.as_tensor(value.view(np.uint8),
                                                                 device=theirs.device)
    torch.cuda.synchronize()
    assert t.numpy()[0, 1] == back.numpy()[0, 1] == value[0]


# ---------------------------------------------------------------------- queue-ordered reuse
#: Waits until the host sets *flag (managed memory), then writes v into x[0:n] (one block).
LATE = r"""
extern "C" __global__ void late(volatile int *flag, int *x, int n, int v) {
    if (threadIdx.x == 0) { while (*flag == 0) { } }
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) x[i] = v;
}
"""


@needs_cuda
def test_a_late_kernel_on_another_stream_never_writes_memory_handed_out_again(gpu):
    """The OpenCL tests of tests/test_queue_order.py on CUDA: a kernel held back (spinning on a
    flag the host sets) on a second stream writes memory that is then freed; the memory stays
    pending until an event says the kernel has run, and only then serves an allocation."""
    import ctypes

    import cupy as cp

    if not cp.cuda.runtime.getDeviceProperties(gpu.index)["concurrentManagedAccess"]:
        pytest.skip("the held kernel needs concurrent managed memory access")
    alloc = allocators.create("caching", gpu)
    with gpu.cuda_device:
        flag = cp.cuda.malloc_managed(4)
        host_flag = (ctypes.c_int * 1).from_address(flag.ptr)
        host_flag[0] = 0
        cp.cuda.runtime.deviceSynchronize()
        other = cp.cuda.Stream(non_blocking=True)
        first = alloc.allocate(1024)
        alloc.record_queue(first, other)
        kernel = cp.RawKernel(LATE, "late")
        kernel((1,), (128,), (flag.ptr, first.ptr, np.int32(256), np.int32(7)), stream=other)
        where = first.ptr
        alloc.free(first)
        second = alloc.allocate(1024)
        assert second.ptr != where and alloc.pending_frees() == 1
        host_flag[0] = 1
        other.synchronize()
        third = alloc.allocate(1024)
        assert third.ptr == where and alloc.pending_frees() == 0
        alloc.free(second)
        alloc.free(third)


@needs_cuda
def test_record_queue_on_cuda_refuses_what_is_not_a_stream(gpu):
    alloc = allocators.create("caching", gpu)
    a = alloc.allocate(64)
    with pytest.raises(TypeError, match="expected a cupy.cuda.Stream"):
        alloc.record_queue(a, "stream")
    alloc.record_queue(a, gpu.stream)  # NOTE: the home stream: nothing to join
    assert alloc.recorded_queues(a) == []
    alloc.free(a)


# ---------------------------------------------------------------------- products and graphs
def test_the_float32_matmul_precision_is_a_setting_with_a_checked_value():
    from backends import cuda

    assert cuda.get_float32_matmul_precision() == "highest"
    with pytest.raises(ValueError, match="'medium'"):
        cuda.set_float32_matmul_precision("medium")
    assert cuda.get_float32_matmul_precision() == "highest"


def test_without_a_device_that_records_the_report_says_why_and_the_option_is_checked():
    from runtime import nn

    model = nn.Sequential(nn.Dense(4, 3))
    step = runtime.graph(nn.train_step(model, nn.SGD(model.parameters(), lr=0.1)))
    x, y = np.ones((2, 4), np.float32), np.array([0, 2])
    for _ in range(3):
        step(x, y)
    assert step.memory_report()["device_graph"] == "cpu records no device graphs"
    with pytest.raises(TypeError, match="device_graph must be True or False"):
        runtime.graph(step, device_graph="yes")
    with pytest.raises(backends.base.RecordError, match="cpu records no device graphs"):
        backends.get_device("cpu").record(lambda: None)


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_products_through_cublas_match_numpy_in_every_layout(gpu, dtype):
    from backends import cuda

    if dtype == "bfloat16" and not cuda.has_bfloat16():
        pytest.skip("this CuPy stores no bfloat16")
    dtype = runtime._tensor.as_dtype(dtype)
    rng = np.random.default_rng(11)
    tol = {2: 1e-2, 4: 1e-5, 8: 1e-12}[dtype.itemsize]
    for a, view_a, b, view_b in product_layouts(rng, dtype):
        want = view_a(a).astype(np.float64) @ view_b(b).astype(np.float64)
        out = _empty(gpu, want.shape, dtype)
        gpu.matmul(view_a(_on(gpu, a)), view_b(_on(gpu, b)), out)
        np.testing.assert_allclose(gpu.to_host(out).astype(np.float64), want, rtol=tol,
                                   atol=tol * max(1.0, np.abs(want).max(initial=0)),
                                   err_msg=f"{view_a(a).shape} @ {view_b(b).shape}")


@needs_cuda
def test_tf32_products_are_an_opt_in_that_changes_float32_results(gpu):
    from backends import cuda

    rng = np.random.default_rng(12)
    a = rng.standard_normal((256, 256)).astype(np.float32)
    exact = _empty(gpu, (256, 256), np.float32)
    gpu.matmul(_on(gpu, a), _on(gpu, a), exact)
    fast = _empty(gpu, (256, 256), np.float32)
    cuda.set_float32_matmul_precision("high")
    try:
        gpu.matmul(_on(gpu, a), _on(gpu, a), fast)
    finally:
        cuda.set_float32_matmul_precision("highest")
    want = a.astype(np.float64) @ a
    exact, fast = gpu.to_host(exact), gpu.to_host(fast)
    np.testing.assert_allclose(exact, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(fast, want, rtol=2e-2, atol=5e-2)
    assert np.abs(fast - want).max() > np.abs(exact - want).max()


def _mlp_steps(precision, optimizer, device_graph, steps=5, labels=None):
    """Losses and final parameters (host copies) of `steps` static-graph training steps."""
    from runtime import nn

    rng = np.random.default_rng(13)
    x = rng.standard_normal((32, 16)).astype(np.float32)
    y = rng.integers(0, 4, 32) if labels is None else labels
    nn.manual_seed(0)
    model = nn.Sequential(nn.Dense(16, 32, device="cuda"), nn.ReLU(),
                          nn.Dense(32, 32, device="cuda"), nn.ReLU(),
                          nn.Dense(32, 4, device="cuda"))
    opt = (nn.SGD(model.parameters(), lr=0.1) if optimizer == "sgd"
           else nn.Adam(model.parameters(), lr=1e-2))
    step = runtime.graph(nn.train_step(model, opt, precision=precision), plan="static",
                         device="cuda", device_graph=device_graph)
    tx, ty = runtime.tensor(x, device="cuda"), runtime.tensor(y, device="cuda")
    losses = [step(tx, ty).item() for _ in range(steps)]
    return losses, [p.numpy() for p in model.parameters()], step, model, (tx, ty)


@needs_cuda
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_a_static_step_replays_as_one_cuda_graph_with_the_launches_bits(gpu, optimizer,
                                                                         precision):
    from backends import cuda

    if precision == "bfloat16" and not cuda.has_bfloat16():
        pytest.skip("this CuPy stores no bfloat16")
    graphed, graphed_params, step, _, _ = _mlp_steps(precision, optimizer, True)
    assert step.memory_report()["device_graph"] == "recorded"
    # NOTE: a recording holds its step's CuPy temporaries at once (cross_entropy's rows, half
    # widenings), each rounded up to CuPy's 512-byte chunks, and never the plan a second time
    report = step.memory_report()
    assert 0 <= report["device_graph_bytes"] < report["peak_bytes"] + (64 << 10)
    launched, launched_params, other, _, _ = _mlp_steps(precision, optimizer, False)
    assert other.memory_report()["device_graph"].startswith("device_graph=False")
    assert graphed == launched and graphed[-1] < graphed[0]
    for p, q in zip(graphed_params, launched_params):
        np.testing.assert_array_equal(p.view(np.uint8), q.view(np.uint8))


@needs_cuda
def test_a_recorded_step_still_refuses_bad_labels_before_it_writes(gpu):
    _, _, step, model, (tx, ty) = _mlp_steps("float32", "sgd", True, steps=3)
    assert step.memory_report()["device_graph"] == "recorded"
    before = [p.numpy() for p in model.parameters()]
    bad = runtime.tensor(np.full(32, 7), device="cuda")
    with pytest.raises(ValueError, match="label 7 is outside"):
        step(tx, bad)
    # NOTE: labels the last launch checked are skipped until a write could change them
    step(tx, ty)
    ty[5] = -2
    with pytest.raises(ValueError, match="label -2 is outside"):
        step(tx, ty)
    with pytest.raises(ValueError, match="label 9 is outside"):  # NOTE: checked on the host
        step(tx, np.full(32, 9))
    assert step.memory_report()["device_graph"] == "recorded"
    ty[5] = 1
    step(tx, ty)
    step(tx, np.zeros(32, np.int64))
    before = [p.numpy() for p in model.parameters()]
    for bad in (np.full(32, 4), runtime.tensor(np.full(32, -1), device="cuda")):
        with pytest.raises(ValueError, match="is outside"):
            step(tx, bad)
    for p, q in zip(before, model.parameters()):
        np.testing.assert_array_equal(p, q.numpy())


@needs_cuda
def test_a_step_that_cannot_be_recorded_says_why_and_replays_with_the_same_bits(gpu):
    """cross_entropy's label check reads labels that the step itself makes: it cannot move
    before the launch, so the step is not recorded, and the report says so."""
    from runtime import nn

    results, reports = {}, {}
    for device_graph in (True, False):
        nn.manual_seed(0)
        model = nn.Sequential(nn.Dense(8, 3, device="cuda"))
        opt = nn.SGD(model.parameters(), lr=0.1)

        def train(x, y, model=model, opt=opt):
            labels = runtime.ops.copy(y)  # NOTE: made inside the step
            loss = nn.softmax_cross_entropy(model(x), labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        step = runtime.graph(train, device="cuda", device_graph=device_graph)
        x = runtime.tensor(np.ones((4, 8), np.float32), device="cuda")
        y = runtime.tensor(np.array([0, 1, 2, 1]), device="cuda")
        results[device_graph] = [step(x, y).item() for _ in range(4)]
        reports[device_graph] = step.memory_report()["device_graph"]
    assert results[True] == results[False]
    assert reports[False].startswith("device_graph=False")
    assert "which the step itself writes" in reports[True], reports[True]


TORCH_ON_BLOCKRT = """
import copy, gc, numpy as np, torch
import allocators, runtime
from backends.cuda import use_with_torch
alloc = allocators.create("caching", "cuda")
bridge = use_with_torch(alloc)
x = torch.ones(1000, device="cuda")
assert bridge.lent_bytes >= 4000 and alloc.stats()["allocated_bytes"] >= 4000, alloc.stats()
assert "MiB" in runtime.memory_summary({"torch": alloc}) or "KiB" in runtime.memory_summary(
    {"torch": alloc})
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
on_cpu = copy.deepcopy(model)
model = model.cuda()
data = torch.randn(64, 16), torch.randint(0, 4, (64,))
for net, dev in ((model, "cuda"), (on_cpu, "cpu")):
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(data[0].to(dev)), data[1].to(dev))
        loss.backward()
        opt.step()
for p, q in zip(model.parameters(), on_cpu.parameters()):
    assert torch.allclose(p.cpu(), q, rtol=1e-4, atol=1e-5)
held = bridge.lent_bytes
del x, model, opt, loss, p
gc.collect()
torch.cuda.synchronize()
assert bridge.lent_bytes < held and bridge.errors == [], (held, bridge.lent_bytes, bridge.errors)
print("OK", held, bridge.lent_bytes)
"""


@needs_cuda
def test_pytorch_trains_on_blockrts_memory(gpu):
    """backends.cuda.use_with_torch (issue 31): PyTorch's CUDA tensors and a training step on a
    blockrt allocator, in a process of their own (PyTorch swaps its allocator only before its
    first CUDA allocation)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch has no CUDA device")
    done = subprocess.run([sys.executable, "-c", TORCH_ON_BLOCKRT], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("OK"), done.stderr[-3000:]
