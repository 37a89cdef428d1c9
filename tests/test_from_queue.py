"""`backends.from_queue`: a device over a framework's own pyopencl queue (and context) or CuPy
stream.

The OpenCL tests run on any OpenCL device (PoCL counts) and check that blockrt really works on
the framework's queue: a kernel held back by a user event on that queue holds blockrt's op
back too, and native views carry the queue. Allocators, tensors, graphs and training give on the
device what they give on `get_device("opencl")`. The CUDA tests skip without CuPy and a GPU.
"""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import textwrap
import weakref

import numpy as np
import pytest

import allocators
import backends
import runtime
from runtime import nn

NO_OPENCL = "no OpenCL device (pyopencl or a platform such as PoCL is missing)"
NO_CUDA = "no CUDA device (cupy not installed or no GPU)"
needs_opencl = pytest.mark.skipif("opencl" not in backends.available(), reason=NO_OPENCL)
needs_cuda = pytest.mark.skipif("cuda" not in backends.available(), reason=NO_CUDA)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------- runs everywhere
@pytest.mark.parametrize("bad", [3, None, "opencl:0", np.zeros(2), object()])
def test_from_queue_refuses_what_is_not_a_queue_naming_its_type(bad):
    with pytest.raises(TypeError, match=re.escape(f"of type {type(bad).__module__}."
                                                  f"{type(bad).__qualname__}")):
        backends.from_queue(bad)


def test_telling_queues_apart_imports_neither_pyopencl_nor_cupy():
    code = ("import sys, backends\n"
            "try:\n    backends.from_queue(object())\nexcept TypeError:\n    pass\n"
            "print('pyopencl' in sys.modules, 'cupy' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, cwd=ROOT)
    assert result.stdout.split() == ["False", "False"]


def test_cuda_locate_queue_needs_cupy_or_a_stream():
    from backends.cuda import CudaDevice

    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(backends.BackendUnavailableError, match="CuPy"):
            CudaDevice.locate_queue(object())
    else:
        with pytest.raises(TypeError, match="cupy.cuda.Stream"):
            CudaDevice.locate_queue(object())


# ---------------------------------------------------------------------- OpenCL
@pytest.fixture(scope="module")
def cl():
    if "opencl" not in backends.available():
        pytest.skip(NO_OPENCL)
    import pyopencl

    return pyopencl


@pytest.fixture(scope="module")
def framework(cl):
    """A framework's own context and in-order queue, on the device of "opencl:0"."""
    context = cl.Context([backends.get_device("opencl").cl_device])
    return cl.CommandQueue(context)


@pytest.fixture(scope="module")
def dev(framework):
    return backends.from_queue(framework)


def test_get_device_of_the_name_says_the_device_is_not_in_the_registry(dev):
    """A from_queue device is not in get_device's registry: its name is refused saying so and
    saying to keep the object (it said "device index ... must be a non-negative integer")."""
    with pytest.raises(ValueError, match=re.escape(repr(dev.name)) + " is the name of a device "
                       r"made by backends.from_queue\(queue\).*not in the registry.*keep the "
                       r"device object"):
        backends.get_device(dev.name)
    assert backends.get_device(dev) is dev


def _native(t: runtime.Tensor):
    """The device's native view (a pyopencl Array) of the C-contiguous tensor `t`."""
    memory = t.block.memory_for_read()
    strides = tuple(s * t.dtype.itemsize for s in t.strides)  # NOTE: a Tensor's are elements
    return t.device.array_view(memory.raw, memory.offset, t.shape, t.dtype, strides)


def test_the_device_runs_on_the_framework_queue_in_its_context(cl, framework, dev):
    assert dev.queue is framework and dev.home_queue is framework
    assert dev.context == framework.context and dev.cl_device == framework.device
    assert re.fullmatch(r"opencl:0@queue:0x[0-9a-f]+", dev.name), dev.name
    assert backends.from_queue(framework) is dev
    assert backends.get_device(dev) is dev
    default = backends.get_device("opencl")
    assert dev is not default and default.context != framework.context
    t = runtime.tensor(np.arange(6, dtype=np.float32), device=dev)
    assert t.device is dev and _native(t).queue is framework
    assert _native(runtime.ops.exp(t)).context == framework.context


def test_blockrt_enqueues_on_the_framework_queue(cl, framework, dev):
    """A user event holds the framework's queue back: blockrt's op waits behind it, as it can
    only if it was enqueued there (on a queue of its own it would run at once)."""
    alloc = allocators.create("caching", dev)
    x = runtime.tensor(np.full(256, 2.0, np.float32), device=dev, allocator=alloc)
    out = runtime.tensor(np.zeros(256, np.float32), device=dev, allocator=alloc)
    memory = out.block.memory_for_read()
    bystander = cl.CommandQueue(framework.context)  # reads without waiting on the framework

    def seen() -> np.ndarray:
        return dev.array_view(memory.raw, memory.offset, (256,), np.float32, (4,)) \
            .with_queue(bystander).get()

    gate = cl.UserEvent(framework.context)
    cl.enqueue_barrier(framework, wait_for=[gate])
    try:
        runtime.ops.mul(x, 3.0, out=out)  # enqueued, not run: the queue waits on the gate
        marker = cl.enqueue_marker(framework)
        np.testing.assert_array_equal(seen(), 0.0)
        assert marker.command_execution_status > cl.command_execution_status.COMPLETE
    finally:
        gate.set_status(cl.command_execution_status.COMPLETE)
    framework.finish()
    np.testing.assert_array_equal(seen(), 6.0)
    np.testing.assert_array_equal(out.numpy(), 6.0)


def test_the_same_queue_gives_the_same_device_while_it_is_used_and_nothing_keeps_it(cl, framework):
    queue = cl.CommandQueue(framework.context)
    references = sys.getrefcount(queue)
    first = backends.from_queue(queue)
    assert backends.from_queue(queue) is first
    assert backends.from_queue(cl.CommandQueue(framework.context)) is not first
    alloc = allocators.create("direct", first)
    t = runtime.tensor(np.ones(4, np.float32), device=first, allocator=alloc)
    name, gone = first.name, weakref.ref(first)
    del first
    gc.collect()
    assert backends.from_queue(queue).name == name  # the tensor still uses it: the same device
    assert gone() is backends.from_queue(queue)
    del t, alloc
    gc.collect()
    assert gone() is None, gc.get_referrers(gone())
    assert sys.getrefcount(queue) == references  # blockrt holds the queue no more
    again = backends.from_queue(queue)
    assert again.name == name and again.queue is queue


def test_a_device_with_a_default_allocator_and_pool_still_goes_with_its_last_use(cl, framework):
    """The runtime's per-device defaults live on the device, not in a table that keeps it."""
    from runtime.constant import default_constant_pools

    queue = cl.CommandQueue(framework.context)
    references = sys.getrefcount(queue)
    device = backends.from_queue(queue)
    t = runtime.tensor(np.ones(4, np.float32), device=device)  # makes the default allocator
    c = runtime.constant(np.ones(4, np.float32), device=device)  # and the default pool
    assert device in runtime.config.default_allocators()
    assert device in default_constant_pools()
    gone = weakref.ref(device)
    del device, t, c
    gc.collect()
    assert gone() is None, gc.get_referrers(gone())
    assert sys.getrefcount(queue) == references


def test_an_out_of_order_queue_is_refused_saying_why_and_what_to_pass(cl, framework):
    try:
        queue = cl.CommandQueue(framework.context, properties=cl.command_queue_properties
                                .OUT_OF_ORDER_EXEC_MODE_ENABLE)
    except cl.Error as exc:
        pytest.skip(f"the platform makes no out-of-order queue: {exc}")
    with pytest.raises(ValueError, match="out of order") as caught:
        backends.from_queue(queue)
    message = str(caught.value)
    assert "OUT_OF_ORDER_EXEC_MODE_ENABLE" in message and "in-order" in message
    assert "pyopencl.CommandQueue(queue.context, queue.device)" in message


def test_a_queue_on_a_device_blockrt_cannot_see_is_refused(cl):
    root = backends.get_device("opencl").cl_device
    try:
        sub = root.create_sub_devices([cl.device_partition_property.EQUALLY, 1])[0]
        queue = cl.CommandQueue(cl.Context([sub]), sub)
    except (cl.Error, AttributeError) as exc:
        pytest.skip(f"the device cannot be partitioned into sub-devices: {exc}")
    with pytest.raises(ValueError, match=r"is not one of the \d+ OpenCL device\(s\) blockrt "
                                         r"can see"):
        backends.from_queue(queue)


def test_a_context_of_several_devices_uses_the_queue_device(cl):
    """PoCL shows two devices with POCL_DEVICES="basic pthread": one context holds both, and a
    queue on each gives a device over that device, whose kernels run."""
    code = textwrap.dedent("""
        import numpy as np, pyopencl as cl, backends, runtime
        found = [d for p in cl.get_platforms() for d in p.get_devices()]
        if len(found) < 2:
            raise SystemExit("one device")
        context = cl.Context(found)
        for index in (1, 0):
            queue = cl.CommandQueue(context, found[index])
            dev = backends.from_queue(queue)
            assert dev.cl_device == found[index] and dev.context == context, dev
            assert dev.name.startswith(f"opencl:{index}@queue:"), dev.name
            t = runtime.tensor(np.arange(4, dtype=np.float32), device=dev)
            print(dev.name.split("@")[0], runtime.ops.mul(t, 2.0).numpy().tolist())
    """)
    env = dict(os.environ, POCL_DEVICES="basic pthread")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, env=env, timeout=300, check=False)
    if "one device" in result.stderr:
        pytest.skip("the OpenCL platform shows one device (PoCL's POCL_DEVICES makes two)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["opencl:1 [0.0, 2.0, 4.0, 6.0]",
                                          "opencl:0 [0.0, 2.0, 4.0, 6.0]"]


def test_tensors_of_another_context_do_not_mix_and_the_error_names_both(dev):
    default = backends.get_device("opencl")
    mine = runtime.tensor(np.ones(3, np.float32), device=dev)
    theirs = runtime.tensor(np.ones(3, np.float32), device=default)
    names = f"{re.escape(dev.name)} and {re.escape(default.name)}"
    with pytest.raises(ValueError, match=f"add: operands are on different devices: {names}"):
        runtime.ops.add(mine, theirs)
    with pytest.raises(ValueError, match=re.escape(dev.name)):
        runtime.ops.exp(theirs, out=mine)
    with pytest.raises(ValueError, match=re.escape(dev.name)):
        runtime.tensor(np.ones(3, np.float32), device=dev,
                       allocator=runtime.get_default_allocator(default))


def test_an_allocator_on_the_device_serves_and_reuses_memory(dev):
    alloc = allocators.create("caching", dev)
    pattern = np.arange(1000, dtype=np.float32)
    a = alloc.allocate(pattern.nbytes)
    dev.copyin(a.raw, a.offset, pattern)
    np.testing.assert_array_equal(dev.copyout(a.raw, a.offset, pattern.nbytes)
                                  .view(np.float32), pattern)
    assert a.device is dev and a.raw.buffer.context == dev.context
    first = a.ptr
    alloc.free(a)
    b = alloc.allocate(pattern.nbytes)
    assert b.ptr == first and alloc.stats()["cache_hits"] == 1  # home queue: reused at once
    alloc.free(b)
    alloc.check_invariants()
    assert alloc.stats()["allocated_bytes"] == 0 and alloc.pending_frees() == 0


def _compute(device) -> list[np.ndarray]:
    """Eager ops, a captured graph and SGD training on `device`, as host arrays."""
    rng = np.random.default_rng(7)
    a_host = rng.standard_normal((6, 5)).astype(np.float32)
    b_host = rng.standard_normal((5, 4)).astype(np.float32)
    a, b = runtime.tensor(a_host, device=device), runtime.tensor(b_host, device=device)
    ops = runtime.ops
    eager = ops.sum(ops.tanh(ops.matmul(a, b)), axis=0)

    graph = runtime.graph(lambda x, y: ops.sigmoid(ops.add(ops.matmul(x, y), 0.5)),
                          plan="static", device=device)
    replays = [graph(a_host * scale, b_host) for scale in (1.0, -2.0)]

    model = nn.Sequential(nn.Dense(5, 8, device=device, rng=1), nn.ReLU(),
                          nn.Dense(8, 3, device=device, rng=2))
    step = runtime.graph(nn.train_step(model, nn.SGD(model.parameters(), lr=0.3, momentum=0.9)),
                         device=device)
    labels = np.array([0, 1, 2, 1, 0, 2])
    losses = [step(a_host, labels).item() for _ in range(4)]
    return [eager.numpy(), *(r.numpy() for r in replays), np.array(losses),
            *(p.numpy() for p in model.parameters())]


def test_tensors_graphs_and_training_give_what_the_default_device_gives(dev):
    on_queue = _compute(dev)
    default = _compute(backends.get_device("opencl"))
    for got, want in zip(on_queue, default):
        np.testing.assert_array_equal(got, want)  # the same kernels on the same hardware
    losses = on_queue[3]
    assert losses[-1] < losses[0], losses  # and the training learns


def test_framework_arrays_and_blockrt_tensors_exchange_memory(cl, framework, dev):
    import pyopencl.array as cla

    from allocators.interop import pyopencl_allocator

    alloc = allocators.create("caching", dev, segments="pytorch")
    hook = pyopencl_allocator(alloc)  # bound to the device's queue: the framework's
    theirs = cla.to_device(framework, np.arange(8, dtype=np.float32), allocator=hook)
    mine = runtime.tensor(np.full(8, 10.0, np.float32), device=dev, allocator=alloc)
    view = _native(mine)
    # the framework's kernels take blockrt's memory and write into it, in one context
    total = theirs + view  # allocated through the hook: blockrt memory
    view += theirs
    np.testing.assert_array_equal(mine.numpy(), np.arange(8) + 10.0)
    np.testing.assert_array_equal(total.get(), np.arange(8) + 10.0)
    assert alloc.stats()["active_allocations"] == 3
    del theirs, total, view
    gc.collect()
    assert alloc.stats()["active_allocations"] == 1 and alloc.pending_frees() == 0
    mine.release()
    alloc.check_invariants()


def test_dlpack_names_the_device_under_the_queue(dev):
    t = runtime.tensor(np.ones(3, np.float32), device=dev)
    want = runtime.tensor(np.ones(3, np.float32), device="opencl").__dlpack_device__()
    assert t.__dlpack_device__() == want


# ---------------------------------------------------------------------- CUDA
@needs_cuda
def test_a_cupy_stream_gives_a_device_running_on_it():
    import cupy as cp

    stream = cp.cuda.Stream(non_blocking=True)
    dev = backends.from_queue(stream)
    assert dev.stream is stream and dev.home_queue is stream
    assert re.fullmatch(r"cuda:\d+@stream:0x[0-9a-f]+", dev.name), dev.name
    assert backends.from_queue(stream) is dev and backends.get_device(dev) is dev
    host = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = runtime.tensor(host, device=dev)
    np.testing.assert_allclose(runtime.ops.tanh(t).numpy(), np.tanh(host), rtol=1e-6)
    np.testing.assert_array_equal(cp.from_dlpack(t).get(), host)  # DLPack names the GPU
    default = runtime.tensor(host, device=backends.get_device(dev.name.split("@")[0]))
    with pytest.raises(ValueError, match=re.escape(dev.name)):
        runtime.ops.add(t, default)


@needs_cuda
def test_blockrt_enqueues_on_the_cupy_stream():
    """Work queued on the framework's stream before blockrt's op comes first: a long CuPy
    kernel on the stream writes x, and blockrt's op reads x after it, on the same stream."""
    import cupy as cp

    stream = cp.cuda.Stream(non_blocking=True)
    dev = backends.from_queue(stream)
    x = runtime.tensor(np.zeros(1 << 22, np.float32), device=dev)
    memory = x.block.memory_for_write("test")
    view = dev.array_view(memory.raw, memory.offset, x.shape, x.dtype, (4,))
    with stream:
        for _ in range(20):  # long enough to be still queued when blockrt's op is enqueued
            cp.add(view, 1.0, out=view)
    x.block.mark_written()
    assert runtime.ops.sum(x).item() == pytest.approx(20.0 * (1 << 22), rel=1e-5)  # not racing


def test_a_cuda_stream_of_another_kind_is_refused():
    try:
        import cupy  # noqa: F401
    except ImportError:
        pytest.skip("CuPy is not installed: no CUDA stream to refuse")
    from backends.cuda import CudaDevice

    with pytest.raises(TypeError, match="cupy.cuda.Stream"):
        CudaDevice.locate_queue("stream")
