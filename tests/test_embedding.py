"""Embedding hooks: blockrt allocators lent to pyopencl and CuPy, and the embedding examples
(tests/test_docs.py runs the snippets of docs/embedding.md and docs/embedding-details.md).

The pyopencl hook runs on blockrt's OpenCL backend when it is available, and otherwise on a
minimal real pyopencl-backed Device defined here (PoCL runs it on the CPU): no mocks.
"""

from __future__ import annotations

import gc
import itertools
import pathlib
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import allocators
import backends
from allocators.interop import _sub_buffer, pyopencl_allocator
from backends.base import Device

ROOT = pathlib.Path(__file__).resolve().parent.parent
NO_CUDA = "no CUDA device (cupy not installed or no GPU)"


class PyOpenCLTestDevice(Device):
    """Raw memory is a cl.Buffer; copies and views through pyopencl; no kernels (not needed).

    For when blockrt's OpenCL backend is unavailable but pyopencl runs.

    Addresses are made up (a bump counter), since OpenCL 1.2 buffers have none; they only need
    to be distinct for the allocators' checks.
    """

    _addresses = itertools.count(1 << 20, 1 << 40)

    def __init__(self, context: Any) -> None:
        import pyopencl as cl

        self.name = "pyopencl-test"
        self.context = context
        self.queue = cl.CommandQueue(context)
        self.alignment = context.devices[0].mem_base_addr_align // 8

    def _raw_alloc(self, nbytes: int) -> Any:
        import pyopencl as cl

        raw = cl.Buffer(self.context, cl.mem_flags.READ_WRITE, max(nbytes, 1))
        raw.blockrt_nbytes = nbytes
        raw.blockrt_address = next(self._addresses)
        return raw

    def _raw_free(self, raw: Any) -> None:
        raw.release()

    def _copyin(self, raw: Any, offset: int, host_bytes: np.ndarray) -> None:
        import pyopencl as cl

        cl.enqueue_copy(self.queue, raw, host_bytes, dst_offset=offset)

    def _copyout(self, raw: Any, offset: int, nbytes: int) -> np.ndarray:
        import pyopencl as cl

        host = np.empty(nbytes, np.uint8)
        cl.enqueue_copy(self.queue, host, raw, src_offset=offset)
        return host

    def _array_view(self, raw: Any, offset, shape, dtype, strides) -> Any:
        import pyopencl.array as cla

        return cla.Array(self.queue, shape, dtype, strides=strides, data=raw, offset=offset)

    def _address(self, raw: Any) -> int:
        return raw.blockrt_address

    def _nbytes_of(self, raw: Any) -> int:
        return raw.blockrt_nbytes


@pytest.fixture(scope="module")
def opencl_device() -> Device:
    """blockrt's OpenCL device when it is available, else the minimal test device above."""
    if "opencl" in backends.available():
        return backends.get_device("opencl")
    cl = pytest.importorskip("pyopencl", reason="pyopencl is not installed")
    try:
        context = cl.create_some_context(interactive=False)
    except cl.Error as exc:
        pytest.skip(f"no OpenCL platform: {exc}")
    return PyOpenCLTestDevice(context)


@pytest.fixture
def cl_alloc(opencl_device: Device) -> allocators.Allocator:
    # NOTE: "pytorch" segments put small blocks side by side, so buffers start at offsets > 0
    alloc = allocators.create("caching", opencl_device, segments="pytorch")
    yield alloc
    gc.collect()
    alloc.check_invariants()
    assert alloc.stats()["allocated_bytes"] == 0, "an array kept its allocation after it went"


def test_pyopencl_arrays_live_in_blockrt_memory(cl_alloc):
    import pyopencl.array as cla

    queue = cl_alloc.device.queue  # NOTE: the device's in-order queue: safe recycling
    hook = pyopencl_allocator(cl_alloc)
    arrays = [cla.to_device(queue, np.arange(n, dtype=np.float32) + n, allocator=hook)
              for n in (100, 200, 300)]
    live = cl_alloc.live_allocations()
    assert len(live) == 3 and any(a.offset > 0 for a in live), [a.offset for a in live]
    for n, array, allocation in zip((100, 200, 300), arrays, live):
        expected = np.arange(n, dtype=np.float32) + n
        np.testing.assert_array_equal(array.get(), expected)
        # the bytes are in the blockrt allocation, at its offset in the segment
        stored = cl_alloc.device.copyout(allocation.raw, allocation.offset, 4 * n)
        np.testing.assert_array_equal(stored.view(np.float32), expected)


def test_pyopencl_results_use_the_hook_and_give_memory_back(cl_alloc):
    import pyopencl.array as cla

    queue = cl_alloc.device.queue  # NOTE: the device's in-order queue: safe recycling
    hook = pyopencl_allocator(cl_alloc)
    a = cla.to_device(queue, np.full(1000, 2.0, np.float32), allocator=hook)
    b = a * 3 + a  # pyopencl kernels; results allocate with the array's allocator
    np.testing.assert_array_equal(b.get(), np.full(1000, 8.0, np.float32))
    assert cl_alloc.stats()["active_allocations"] == 2
    del a, b
    gc.collect()
    assert cl_alloc.stats()["active_allocations"] == 0
    hits = cl_alloc.stats()["cache_hits"]
    c = cla.empty(queue, (1000,), np.float32, allocator=hook)
    assert cl_alloc.stats()["cache_hits"] == hits + 1  # the freed memory is reused
    del c


def test_pyopencl_hook_refuses_a_misaligned_start(opencl_device):
    raw = opencl_device.raw_alloc(4096)
    try:
        with pytest.raises(ValueError, match="CL_DEVICE_MEM_BASE_ADDR_ALIGN"):
            _sub_buffer(allocators.Allocation(opencl_device, raw, 4, 64, 64))
    finally:
        opencl_device.raw_free(raw)


def test_pyopencl_hook_needs_a_blockrt_allocator():
    with pytest.raises(TypeError, match="blockrt Allocator"):
        pyopencl_allocator(lambda nbytes: None)


# ---------------------------------------------------------------------- CuPy
def test_use_with_cupy_needs_cupy_or_a_cuda_allocator():
    from backends import cuda

    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(backends.BackendUnavailableError, match="CuPy"):
            cuda.use_with_cupy(allocators.create("direct", "cpu"))
    else:
        with pytest.raises(ValueError, match="CUDA device"):
            cuda.use_with_cupy(allocators.create("direct", "cpu"))


@pytest.mark.skipif("cuda" not in backends.available(), reason=NO_CUDA)
def test_use_with_cupy_makes_cupy_allocate_from_blockrt():
    import cupy as cp

    from backends import cuda

    alloc = allocators.create("caching", "cuda")
    try:
        cuda.use_with_cupy(alloc)
        x = cp.arange(1000, dtype=cp.float32)
        assert alloc.stats()["active_allocations"] >= 1
        assert int((x * 2).sum()) == 999 * 1000
        del x
        gc.collect()
        cp.cuda.Device().synchronize()
        assert alloc.stats()["active_allocations"] == 0
    finally:
        cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)


# ---------------------------------------------------------------------- examples and docs
def _run(name: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "examples" / name)], capture_output=True,
                          text=True, timeout=300, check=False, cwd=ROOT)


@pytest.mark.parametrize(("script", "backend", "success", "refusal"), [
    ("embed_cupy.py", "cuda", "cupy allocations served by blockrt", "needs a CUDA device"),
    ("embed_pyopencl.py", "opencl", "pyopencl arrays served by blockrt",
     "needs blockrt's OpenCL backend"),
])
def test_embedding_example_runs_or_says_why_not(script, backend, success, refusal):
    result = _run(script)
    if backend in backends.available():
        assert result.returncode == 0, result.stderr
        assert success in result.stdout
    else:
        assert result.returncode == 1
        assert refusal in result.stderr


def test_dlpack_numpy_example_shares_memory():
    result = _run("dlpack_numpy.py")
    assert result.returncode == 0, result.stderr
    assert "shared: True" in result.stdout
    assert "still readable after the tensor went: True" in result.stdout
