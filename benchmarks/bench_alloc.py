"""Hot-path latency of one alloc+free pair, at 256 B, 64 KiB, 4 MiB and 64 MiB.

Side by side in one run, in interleaved rounds (best round kept):
- blockrt's allocators: "caching" (a cache hit after warm-up) and "direct" (one device
  allocation per pair), through the public `allocate` / `free`;
- `numpy.empty(n, uint8)` (allocate, then drop the array);
- `pyopencl.tools.MemoryPool(ImmediateAllocator(queue))` on the first OpenCL device (PoCL on a
  plain CPU), when pyopencl is installed.

Run: python benchmarks/bench_alloc.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import numpy as np

import allocators

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import interleaved_best

SIZES = (256, 64 << 10, 4 << 20, 64 << 20)


def blockrt_pair(name: str, nbytes: int) -> Callable[[], None]:
    alloc = allocators.create(name, "cpu")
    allocate, free = alloc.allocate, alloc.free

    def pair() -> None:
        free(allocate(nbytes))

    return pair


def numpy_pair(nbytes: int) -> Callable[[], None]:
    def pair() -> None:
        np.empty(nbytes, np.uint8)

    return pair


def pyopencl_pair(nbytes: int) -> Callable[[], None] | None:
    try:
        import pyopencl as cl
        import pyopencl.tools as cl_tools
    except ImportError:
        return None
    queue = cl.CommandQueue(cl.create_some_context(interactive=False))
    pool = cl_tools.MemoryPool(cl_tools.ImmediateAllocator(queue))

    def pair() -> None:
        pool.allocate(nbytes).release()

    return pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (for smoke runs)")
    args = parser.parse_args()
    rounds, number = (3, 2000) if args.quick else (15, 20000)
    rows = []
    for nbytes in SIZES:
        contenders = {"caching": blockrt_pair("caching", nbytes),
                      "direct": blockrt_pair("direct", nbytes),
                      "numpy.empty": numpy_pair(nbytes)}
        opencl = pyopencl_pair(nbytes)
        if opencl is not None:
            contenders["pyopencl pool"] = opencl
        # NOTE: the uncached ones touch fresh memory; fewer repetitions keep the run short
        best = interleaved_best(contenders, number if nbytes < (1 << 20) else number // 10,
                                rounds)
        rows.append((nbytes, best))
    names = list(rows[0][1])
    print("| size | " + " | ".join(f"{n} (us)" for n in names) + " | caching / numpy.empty |"
          + (" caching / pyopencl pool |" if "pyopencl pool" in names else ""))
    print("|---" * (len(names) + 2 + ("pyopencl pool" in names)) + "|")
    for nbytes, best in rows:
        cells = " | ".join(f"{best[n]:.2f}" for n in names)
        line = (f"| {allocators.format_bytes(nbytes)} | {cells} | "
                f"{best['caching'] / best['numpy.empty']:.2f} |")
        if "pyopencl pool" in best:
            line += f" {best['caching'] / best['pyopencl pool']:.2f} |"
        print(line)


if __name__ == "__main__":
    main()
