"""Hot-path latency of one alloc+free pair, at 256 B, 64 KiB, 4 MiB and 64 MiB.

Side by side in one run, in interleaved rounds (best round kept):
- blockrt's allocators through the public `alloc.allocate` / `alloc.free`, as users call them:
  "caching" (a cache hit after warm-up) on the CPU device and on the OpenCL device, and
  "direct" on the CPU (one device allocation per pair);
- `numpy.empty(n, uint8)` (allocate, then drop the array), the CPU device's own allocator;
- `pyopencl.tools.MemoryPool(ImmediateAllocator(queue))` on the queue of blockrt's OpenCL device
  (PoCL on a plain CPU), when pyopencl is installed: `pool.allocate(n).release()`.

Each ratio compares two allocators of one device: caching (cpu) with numpy.empty, caching
(opencl) with pyopencl's pool, which hands out buffers of the same PoCL device and context.
The header names the CPU, Python, NumPy, pyopencl and the OpenCL device, and the load.

Run: python benchmarks/bench_alloc.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit
from collections.abc import Callable
from typing import Any

import numpy as np

import allocators
import backends

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import cpu_name, interleaved_min, versions

SIZES = (256, 64 << 10, 4 << 20, 64 << 20)
#: (numerator, denominator) contenders of each ratio column: two allocators of one device
RATIOS = (("caching (cpu)", "numpy.empty"), ("caching (opencl)", "pyopencl pool"))
#: The contenders that go to the device (or the OS) at every pair: at 1 MiB and up they touch
#: fresh memory, so they run a tenth of the pairs per round to keep the run short.
UNCACHED = ("direct (cpu)", "numpy.empty")


def blockrt_pair(name: str, device: Any, nbytes: int) -> Callable[[], None]:
    alloc = allocators.create(name, device)

    # NOTE: methods looked up at every call, as users write it (and as pyopencl's pair must
    # look up `release`): bound once, blockrt's pair measured 0.02 us less
    def pair() -> None:
        alloc.free(alloc.allocate(nbytes))

    return pair


def numpy_pair(nbytes: int) -> Callable[[], None]:
    def pair() -> None:
        np.empty(nbytes, np.uint8)

    return pair


def opencl_device() -> Any:
    """blockrt's OpenCL device (PoCL here), or None when pyopencl or a device is missing."""
    if "opencl" not in backends.available():
        return None
    return backends.get_device("opencl")


def pyopencl_pair(device: Any, nbytes: int) -> Callable[[], None]:
    import pyopencl.tools as cl_tools

    pool = cl_tools.MemoryPool(cl_tools.ImmediateAllocator(device.queue))

    def pair() -> None:
        pool.allocate(nbytes).release()

    return pair


def header(device: Any, rounds: int, number: int, load: float) -> str:
    speed = "C hot path" if allocators.ACCELERATED else "pure Python (no C hot path)"
    return (f"alloc+free pairs on {cpu_name()}; {versions(device)}; blockrt {speed}; best of "
            f"{rounds} interleaved rounds of {number} pairs ({number // 10} for "
            f"{' and '.join(UNCACHED)} at 1 MiB and up); 1-minute load average {load:.2f} "
            f"before, {os.getloadavg()[0]:.2f} after")


def best_times(contenders: dict[str, Callable[[], None]], nbytes: int, number: int,
               rounds: int) -> dict[str, float]:
    """Microseconds per pair of each contender, best of `rounds` interleaved rounds."""
    def per_pair(name: str, pair: Callable[[], None]) -> Callable[[], float]:
        count = number // 10 if name in UNCACHED and nbytes >= (1 << 20) else number
        return lambda: timeit.timeit(pair, number=count) / count * 1e6

    for pair in contenders.values():
        pair()  # NOTE: warm-up: the cached ones hit from here on
    return interleaved_min({name: per_pair(name, pair) for name, pair in contenders.items()},
                           rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (for smoke runs)")
    args = parser.parse_args()
    rounds, number = (3, 2000) if args.quick else (15, 20000)
    load = os.getloadavg()[0]
    device = opencl_device()
    rows = []
    for nbytes in SIZES:
        contenders = {"caching (cpu)": blockrt_pair("caching", "cpu", nbytes),
                      "direct (cpu)": blockrt_pair("direct", "cpu", nbytes),
                      "numpy.empty": numpy_pair(nbytes)}
        if device is not None:
            contenders["caching (opencl)"] = blockrt_pair("caching", device, nbytes)
            contenders["pyopencl pool"] = pyopencl_pair(device, nbytes)
        rows.append((nbytes, best_times(contenders, nbytes, number, rounds)))
    names = list(rows[0][1])
    ratios = [(top, bottom) for top, bottom in RATIOS if top in names and bottom in names]
    print(header(device, rounds, number, load) + "\n")
    print("| size | " + " | ".join(f"{name} (us)" for name in names) + " | "
          + " | ".join(f"{top} / {bottom}" for top, bottom in ratios) + " |")
    print("|---|" + "---:|" * (len(names) + len(ratios)))
    for nbytes, best in rows:
        cells = [f"{best[name]:.2f}" for name in names]
        cells += [f"{best[top] / best[bottom]:.2f}" for top, bottom in ratios]
        print(f"| {allocators.format_bytes(nbytes)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
