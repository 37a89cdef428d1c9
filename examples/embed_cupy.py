"""Lend a blockrt allocator to CuPy, and share arrays with it through DLPack.

After `backends.cuda.use_with_cupy(alloc)` every CuPy array takes its memory from `alloc`, so
blockrt's caching, limits and statistics cover CuPy code too. Needs CuPy and a GPU; without
them it says so and exits with status 1.

    python examples/embed_cupy.py
"""

from __future__ import annotations

import sys

import allocators
import backends
import runtime


def main() -> None:
    if "cuda" not in backends.available():
        sys.exit("embed_cupy.py needs a CUDA device: CuPy is not installed or no GPU was found "
                 "(install blockrt[cuda] on a machine with an NVIDIA GPU)")
    import cupy as cp

    from backends.cuda import use_with_cupy

    alloc = allocators.StatisticsAdaptor(allocators.create("caching", "cuda"))
    use_with_cupy(alloc)
    try:
        x = cp.random.standard_normal((512, 512), dtype=cp.float32)
        for _ in range(20):
            y = cp.tanh(x @ x)  # each step's temporaries come from blockrt and go back to it
            del y
        stats = alloc.stats()
        print(f"cupy allocations served by blockrt: {stats['num_allocs']} "
              f"(cache hits {stats['cache_hits']}, peak "
              f"{allocators.format_bytes(stats['peak_allocated_bytes'])})")

        t = runtime.from_dlpack(x)  # a blockrt tensor over CuPy's array: no copy
        doubled = cp.from_dlpack(runtime.ops.mul(t, 2.0))  # and back: no copy either
        print("round trip through DLPack agrees:", bool(cp.allclose(doubled, 2 * x)))
    finally:
        cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)


if __name__ == "__main__":
    main()
