"""Replay of an MLP training loop's allocation trace (batch 256, width 1024, depth 4).

The trace (benchmarks/mlp_trace.py: 30 allocs and 30 frees per step) is recorded through
blockrt's `TraceAdaptor`, written as JSON lines, loaded back and replayed with
`allocators.adaptors.replay` against each blockrt allocator on the CPU device, and the caching
allocator on the OpenCL device too; numpy.empty and pyopencl's MemoryPool, on the queue of
blockrt's OpenCL device (PoCL), replay the same events with an equivalent loop. So "caching
(opencl)" and "pyopencl pool" hand out buffers of one device. Figures, from one run, under a
header naming the CPU, the versions and the load:

- hit rate after the first step: allocations served from the cache / allocations, steps 2..N;
- peak reserved / peak requested bytes;
- time per event (alloc or free), best of several replays, interleaved across allocators.

Run: python benchmarks/bench_trace.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mlp_trace import mlp_training_events, peak_live_bytes
from timing import cpu_name, interleaved_min, versions

import allocators
import backends
from allocators.adaptors import TraceAdaptor
from allocators.trace import load_trace, replay

ALLOCATORS = ("caching", "direct")


def record_trace(events, path: pathlib.Path) -> None:
    """Run `events` through a TraceAdaptor and write its log as JSON lines."""
    tracer = TraceAdaptor(allocators.create("direct", "cpu"))
    live = {}
    for kind, tensor, nbytes in events:
        if kind == "alloc":
            live[tensor] = tracer.allocate(nbytes)
        else:
            tracer.free(live.pop(tensor))
    with open(path, "w") as f:
        tracer.to_jsonl(f)


def blockrt_memory(name: str, device: Any, trace, steps: int) -> dict:
    """Hit rate after the first step and peak reserved bytes of a fresh allocator."""
    alloc = allocators.create(name, device)
    one_step = len(trace) // steps
    replay(trace[:one_step], alloc)
    first = alloc.stats()
    replay(trace[one_step:], alloc)
    last = alloc.stats()
    allocs = last["num_allocs"] - first["num_allocs"]
    hits = last["cache_hits"] - first["cache_hits"]
    return {"hit_rate": hits / allocs, "peak_reserved": last["peak_reserved_bytes"]}


def loop_replay(alloc_fn, free_fn, events) -> float:
    """One replay with plain callables (numpy.empty, pyopencl); microseconds per event."""
    live = {}
    start = time.perf_counter()
    for kind, tensor, nbytes in events:
        if kind == "alloc":
            live[tensor] = alloc_fn(nbytes)
        else:
            free_fn(live.pop(tensor))
    return (time.perf_counter() - start) / len(events) * 1e6


def loop_memory(alloc_fn, free_fn, events, steps: int, reserved_fn) -> dict:
    """Hit rate after the first step and peak reserved bytes, read off `reserved_fn`."""
    live, peak, misses, allocs = {}, 0, 0, 0
    one_step = len(events) // steps
    for index, (kind, tensor, nbytes) in enumerate(events):
        before = reserved_fn()
        if kind == "alloc":
            live[tensor] = alloc_fn(nbytes)
            if index >= one_step:
                allocs += 1
                misses += reserved_fn() > before
        else:
            free_fn(live.pop(tensor))
        peak = max(peak, reserved_fn())
    return {"hit_rate": 1 - misses / allocs, "peak_reserved": peak}


def opencl_device() -> Any:
    """blockrt's OpenCL device (PoCL here), or None when pyopencl or a device is missing."""
    if "opencl" not in backends.available():
        return None
    return backends.get_device("opencl")


def pyopencl_pool(device: Any) -> Any:
    """pyopencl's own pool on the queue of blockrt's OpenCL `device`."""
    import pyopencl.tools as cl_tools

    return cl_tools.MemoryPool(cl_tools.ImmediateAllocator(device.queue))


def header(device: Any, repeats: int, load: float) -> str:
    speed = "C hot path" if allocators.ACCELERATED else "pure Python (no C hot path)"
    return (f"trace replay on {cpu_name()}; {versions(device)}; blockrt {speed}; best of "
            f"{repeats} interleaved replays; 1-minute load average {load:.2f} before, "
            f"{os.getloadavg()[0]:.2f} after")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (for smoke runs)")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    steps = args.steps or (5 if args.quick else 50)
    repeats = 2 if args.quick else 9
    load = os.getloadavg()[0]
    device = opencl_device()
    events = mlp_training_events(batch=256, width=1024, depth=4, steps=steps)
    requested = peak_live_bytes(events)
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "mlp.jsonl"
        record_trace(events, path)
        trace = load_trace(path)
    # (row name, allocator name, device) of the blockrt contenders
    blockrt = [(f"{name} (cpu)", name, "cpu") for name in ALLOCATORS]
    if device is not None:
        blockrt.append(("caching (opencl)", "caching", device))
    rows = {row: blockrt_memory(name, where, trace, steps) for row, name, where in blockrt}
    timed = {row: (lambda name=name, where=where:
                   replay(trace, allocators.create(name, where))["us_per_event"])
             for row, name, where in blockrt}
    rows["numpy.empty"] = {"hit_rate": None, "peak_reserved": None}
    timed["numpy.empty"] = lambda: loop_replay(lambda n: np.empty(n, np.uint8), lambda a: None,
                                               events)
    if device is not None:
        pool = pyopencl_pool(device)
        rows["pyopencl pool"] = loop_memory(pool.allocate, lambda b: b.release(), events, steps,
                                            reserved_fn=lambda: pool.managed_bytes)
        timed["pyopencl pool"] = lambda: loop_replay(pool.allocate, lambda b: b.release(), events)
    for name, us in interleaved_min(timed, repeats).items():
        rows[name]["us_per_event"] = us
    print(header(device, repeats, load) + "\n")
    print(f"{steps} steps, {len(events)} events, peak requested "
          f"{allocators.format_bytes(requested)}\n")
    print("| allocator | hit rate after step 1 | peak reserved / peak requested | us per event |")
    print("|---|---:|---:|---:|")
    for name, f in rows.items():
        hit = "n/a" if f["hit_rate"] is None else f"{100 * f['hit_rate']:.2f}%"
        ratio = "n/a" if f["peak_reserved"] is None else f"{f['peak_reserved'] / requested:.2f}"
        print(f"| {name} | {hit} | {ratio} | {f['us_per_event']:.2f} |")


if __name__ == "__main__":
    main()
