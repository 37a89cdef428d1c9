"""Lend a blockrt allocator to pyopencl: its arrays live in blockrt memory and go back to it.

`allocators.interop.pyopencl_allocator(alloc)` is an `allocator=` for pyopencl. Give pyopencl the
device's own in-order queue, so memory that comes back is reused only after the work on it. Needs
blockrt's OpenCL backend (pyopencl and a platform, such as PoCL); without it the example says so
and exits with status 1.

    python examples/embed_pyopencl.py
"""

from __future__ import annotations

import gc
import sys

import numpy as np

import allocators
import backends
from allocators.interop import pyopencl_allocator


def main() -> None:
    if "opencl" not in backends.available():
        sys.exit("embed_pyopencl.py needs blockrt's OpenCL backend: pyopencl and an OpenCL "
                 "platform such as PoCL (install blockrt[opencl])")
    import pyopencl.array as cla

    device = backends.get_device("opencl")
    alloc = allocators.StatisticsAdaptor(allocators.create("caching", device))
    hook = pyopencl_allocator(alloc)
    rng = np.random.default_rng(0)
    total = 0.0
    for _ in range(20):
        host = rng.random(100_000, dtype=np.float32)
        a = cla.to_device(device.queue, host, allocator=hook)
        b = a * 2 + 1  # pyopencl's kernels; results allocate through the same hook
        total += float(b.get().sum(dtype=np.float64))
        del a, b
    gc.collect()
    stats = alloc.stats()
    print(f"pyopencl arrays served by blockrt: {stats['num_allocs']} allocations, "
          f"{stats['cache_hits']} from its cache, peak "
          f"{allocators.format_bytes(stats['peak_allocated_bytes'])}, "
          f"{stats['active_allocations']} still live")
    print(f"checksum {total:.1f}")


if __name__ == "__main__":
    main()
