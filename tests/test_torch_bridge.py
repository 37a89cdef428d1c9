"""PyTorch's pluggable-allocator entry points (backends/_torchalloc.c) and the bridge behind
them (backends/_torchbridge.py), called through the compiled entry points exactly as PyTorch
calls them, on the CPU device. `backends.cuda.use_with_torch`, which hands them to PyTorch, is
tested in tests/test_cuda.py where PyTorch has a GPU.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

import allocators
import backends
from allocators import LimitAdaptor, OutOfMemoryError
from backends import _torchbridge, accelerated

_OFF = next(p.why for p in accelerated.paths() if p.module == "backends._torchalloc")
needs_entry_points = pytest.mark.skipif(_torchbridge._entry_points is None,
                                        reason=f"backends._torchalloc is {_OFF}")


@pytest.fixture
def bridge():
    allocator = allocators.create("caching", backends.get_device("cpu"))
    made = _torchbridge.Bridge(allocator)
    made.install()
    yield made
    made.uninstall()


@needs_entry_points
def test_the_library_exports_the_entry_points_pytorch_looks_up():
    library = ctypes.CDLL(_torchbridge.library_path())
    for name in (_torchbridge.MALLOC_NAME, _torchbridge.FREE_NAME, "blockrt_torch_hooks"):
        assert hasattr(library, name), name


@needs_entry_points
def test_malloc_lends_the_allocators_memory_and_free_gives_it_back(bridge):
    stats = bridge.allocator.stats
    ptr = bridge.malloc(1000, 0, None)
    assert ptr and bridge.lent_bytes == 1000
    assert stats()["allocated_bytes"] >= 1000
    ctypes.memset(ptr, 0x5A, 1000)  # NOTE: the memory is real and writable
    assert ctypes.string_at(ptr, 1000) == b"\x5a" * 1000
    bridge.free(ptr, 1000, 0, None)
    assert bridge.lent_bytes == 0 and stats()["allocated_bytes"] == 0
    assert bridge.errors == []
    bridge.allocator.check_invariants()


@needs_entry_points
def test_many_threads_malloc_and_free_with_exact_accounting(bridge):
    sizes = np.random.default_rng(0).integers(1, 1 << 16, 400)

    def work(part):
        held = []
        for size in part:
            held.append((bridge.malloc(int(size), 0, None), int(size)))
            if len(held) > 5:
                bridge.free(*held.pop(0), 0, None)
        for ptr, size in held:
            bridge.free(ptr, size, 0, None)

    threads = [threading.Thread(target=work, args=(sizes[k::4],)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bridge.errors == [] and bridge.lent_bytes == 0
    assert bridge.allocator.stats()["allocated_bytes"] == 0
    bridge.allocator.check_invariants()


@needs_entry_points
def test_a_refused_malloc_returns_null_and_keeps_the_error():
    cpu = backends.get_device("cpu")
    limited = LimitAdaptor(allocators.create("direct", cpu), limit_bytes=4096)
    bridge = _torchbridge.Bridge(limited)
    bridge.install()
    try:
        kept = bridge.malloc(4000, 0, None)
        assert kept and bridge.malloc(4000, 0, None) == 0  # NULL: PyTorch's out of memory
        assert isinstance(bridge.errors[-1], OutOfMemoryError)
        assert bridge.malloc(10, 3, None) == 0  # another device than the allocator's
        assert "device 3" in str(bridge.errors[-1]) and "cpu" in str(bridge.errors[-1])
        bridge.free(kept, 4000, 0, None)
        assert limited.stats()["allocated_bytes"] == 0
    finally:
        bridge.uninstall()


@needs_entry_points
def test_freeing_memory_the_bridge_did_not_lend_frees_nothing_and_says_so(bridge):
    ptr = bridge.malloc(64, 0, None)
    bridge.free(ptr + 8, 64, 0, None)
    assert "did not lend: nothing was freed" in str(bridge.errors[-1])
    assert bridge.lent_bytes == 64
    bridge.free(ptr, 64, 0, None)
    assert bridge.lent_bytes == 0


@needs_entry_points
def test_after_uninstall_malloc_returns_null(bridge):
    bridge.uninstall()
    assert bridge.malloc(16, 0, None) == 0 and bridge.errors == []


def test_in_pure_python_mode_the_bridge_is_refused_saying_why():
    import subprocess
    import sys

    code = ("from backends import _torchbridge\ntry:\n    _torchbridge.library_path()\n"
            "except Exception as e:\n    print(type(e).__name__, e)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**__import__("os").environ,
                                            "BLOCKRT_PURE_PYTHON": "1"})
    assert done.stdout.startswith("BackendUnavailableError") and "BLOCKRT_PURE_PYTHON=1" in \
        done.stdout, done.stdout + done.stderr


def test_use_with_torch_refuses_an_allocator_that_is_not_on_cuda_by_name():
    from backends.cuda import use_with_torch

    with pytest.raises(ValueError, match="needs an allocator on a CUDA device, not on cpu"):
        use_with_torch(allocators.create("direct", backends.get_device("cpu")))
